"""Files written whole or not at all: through a temp file in the same directory, then a rename.

A run killed mid-write (preemption, SIGKILL) must never leave half a cache, snapshot or generation file
that a resumed run would trust. Temp files are hidden (`.NAME.XXXX.tmp`) so a reader can clear strays.
Outputs that are not regular files (a FIFO, a device, /dev/stdout, `-`) cannot be replaced and are written
directly.
On object storage (gs://, s3://) an object only appears once its upload is closed, so it is built in memory and
uploaded in one piece.
"""

import contextlib
import errno
import fcntl
import io
import os
import re
import stat
import sys
import tempfile
import time
from typing import Any, Callable

from jdr.runtime import paths

STDOUT = "-"  # an output path that means standard output (runs, per-query files)


@contextlib.contextmanager
def exclusive(lock_path, waiting: str = ""):
  """Holds an exclusive lock on `lock_path` (created if missing) for the block: one process builds a cache
  entry that several share (the processes of a multi-host run on one machine, two runs), the others wait and
  then find it finished. `waiting` is printed to stderr when another process holds it."""
  lock_path = os.fspath(lock_path)
  os.makedirs(os.path.dirname(lock_path) or ".", exist_ok=True)
  with open(lock_path, "a+b") as f:
    try:
      fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      if waiting:
        print(waiting, file=sys.stderr, flush=True)
      fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def _read_umask() -> int:
  mask = os.umask(0)
  os.umask(mask)
  return mask


# Read once, at import: reading the umask means setting it, which threads writing files at the time would see.
UMASK = _read_umask()


def is_special(path: paths.PathLike) -> bool:
  """A local path that is not a regular file to replace: a FIFO, a device, /dev/stdout (even one that leads to
  a file: /dev itself cannot take a temp file). Such an output is written directly."""
  if not paths.is_local(path):
    return False
  given = os.path.abspath(os.fspath(path))
  if given.startswith(("/dev/", "/proc/")) and not given.startswith("/dev/shm/"):
    return True
  try:
    mode = os.stat(given).st_mode
  except FileNotFoundError:
    return False
  return not stat.S_ISREG(mode) and not stat.S_ISDIR(mode)


def naming(e: OSError, path: paths.PathLike) -> OSError:
  """`e` with `path` as its file name when it has none ("[Errno 28] No space left on device" says where). A
  short write that numpy's C writer reports without an errno ("32000 requested and 11232 written") is a full
  disk when the disk holding `path` has (almost) no space left, and says so."""
  if e.filename is None and e.errno is not None:
    return OSError(e.errno, e.strerror, os.fspath(path))
  if e.errno is None and re.search(r"\d+ requested and \d+ written", str(e)):
    try:
      stats = os.statvfs(os.path.dirname(os.path.abspath(os.fspath(path))) or ".")
      full = stats.f_bavail * stats.f_frsize < (16 << 20)
    except OSError:
      full = False
    reason = os.strerror(errno.ENOSPC) if full else f"a short write ({e})"
    return OSError(errno.ENOSPC if full else errno.EIO, reason, os.fspath(path))
  return e


def os_error_code(e: BaseException) -> int | None:
  """The errno of a failed write, which the Rust and C++ writers (tokenizers, safetensors, orbax's
  tensorstore) report inside their own exception types' messages."""
  if isinstance(e, OSError):
    return e.errno
  found = re.search(r"os error (\d+)|os_error_code='?(\d+)|Os \{ code: (\d+)", str(e))
  return int(next(g for g in found.groups() if g)) if found else None


def remove_tree(path: paths.PathLike, *, settle_seconds: float = 0.2, timeout_seconds: float = 10.0) -> bool:
  """Removes a partly written folder after a failed write; True once it stays gone, False (with a warning on
  standard error naming it) if it still came back after `timeout_seconds`.

  One rmtree is not enough: when one of orbax's tensorstore writes fails, the others already issued go on in
  the background and create files in (and, as tensorstore makes parent folders, even recreate) the folder
  being removed. So it is removed again until it is still absent `settle_seconds` later."""
  path = paths.as_path(path)
  deadline = time.monotonic() + timeout_seconds
  while True:
    try:
      path.rmtree()
    except OSError:  # a file created during the walk (ENOTEMPTY), or already gone
      pass
    time.sleep(settle_seconds)
    if not path.exists():
      return True
    if time.monotonic() > deadline:
      print(f"warning: {path}: a partly written folder that could not be removed; delete it", file=sys.stderr)
      return False


def write_atomic(path: paths.PathLike, write: Callable[[Any], None]) -> None:
  """Calls `write(binary file)` on a temp file beside `path`, then renames it to `path`, with the mode the
  umask gives new files. `-` is standard output; a FIFO or a device is written directly. An OSError names
  `path`, and no partial file is left behind."""
  if os.fspath(path) == STDOUT:
    sys.stdout.flush()
    write(sys.stdout.buffer)
    sys.stdout.buffer.flush()
    return
  if not paths.is_local(path):
    # Written to memory first: closing an object-storage file uploads whatever it holds, so a `write` that
    # raises half-way would otherwise leave a truncated object that looks finished.
    buffer = io.BytesIO()
    write(buffer)
    target = paths.as_path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(buffer.getvalue())
    return
  if is_special(path):
    try:
      with open(path, "ab") as f:  # append: /dev/stdout led to a file keeps what the shell wrote to it
        write(f)
    except OSError as e:
      raise naming(e, path) from None
    return
  path = paths.local(path)
  tmp = None
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
      write(f)
    os.chmod(tmp, 0o666 & ~UMASK)  # mkstemp makes 0600, readable by its owner alone
    os.replace(tmp, path)
  except BaseException as e:
    if tmp is not None:
      paths.local(tmp).unlink(missing_ok=True)
    if isinstance(e, OSError):
      raise naming(e, path) from None
    raise


def write_text(path: paths.PathLike, text: str) -> None:
  write_atomic(path, lambda f: f.write(text.encode("utf-8")))
