"""jdr: dense retrieval in JAX/Flax."""

__version__ = "0.1.0"
