"""Files written whole or not at all: through a temp file in the same directory, then a rename.

A run killed mid-write (preemption, SIGKILL) must never leave half a cache, snapshot or generation file
that a resumed run would trust. Temp files are hidden (`.NAME.XXXX.tmp`) so a reader can clear strays.
On object storage (gs://, s3://) an object only appears once its upload is closed, so it is built in memory and
uploaded in one piece.
"""

import io
import os
import tempfile
from typing import Any, Callable

from jdr import paths


def write_atomic(path: paths.PathLike, write: Callable[[Any], None]) -> None:
  """Calls `write(binary file)` on a temp file beside `path`, then renames it to `path`."""
  if not paths.is_local(path):
    # Written to memory first: closing an object-storage file uploads whatever it holds, so a `write` that
    # raises half-way would otherwise leave a truncated object that looks finished.
    buffer = io.BytesIO()
    write(buffer)
    target = paths.as_path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(buffer.getvalue())
    return
  path = paths.local(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
  try:
    with os.fdopen(fd, "wb") as f:
      write(f)
    os.replace(tmp, path)
  except BaseException:
    paths.local(tmp).unlink(missing_ok=True)
    raise


def write_text(path: paths.PathLike, text: str) -> None:
  write_atomic(path, lambda f: f.write(text.encode("utf-8")))
