"""jdr: dense retrieval in JAX/Flax. Importing it has no side effect; the command modules (`python -m jdr.X`)
choose their malloc themselves (jdr/runtime/host_memory.py)."""

__version__ = "0.1.0"
