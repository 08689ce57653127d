"""jdr: dense retrieval in JAX/Flax."""

from jdr.runtime import host_memory as _host_memory

__version__ = "0.1.0"

# `python -m jdr.<command>`: runs again at once with huge-page malloc (jdr.runtime.host_memory says why); a no-op on
# any other import.
_host_memory.reexec_command_line_with_huge_pages()
