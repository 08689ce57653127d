"""Files written whole or not at all: through a temp file in the same directory, then a rename.

A run killed mid-write (preemption, SIGKILL) must never leave half a cache, snapshot or generation file
that a resumed run would trust. Temp files are hidden (`.NAME.XXXX.tmp`) so a reader can clear strays.
"""

import os
import pathlib
import tempfile
from typing import Any, Callable


def write_atomic(path: pathlib.Path, write: Callable[[Any], None]) -> None:
  """Calls `write(binary file)` on a temp file beside `path`, then renames it to `path`."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
  try:
    with os.fdopen(fd, "wb") as f:
      write(f)
    os.replace(tmp, path)
  except BaseException:
    pathlib.Path(tmp).unlink(missing_ok=True)
    raise
