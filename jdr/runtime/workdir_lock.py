"""One run per output folder: `with held(folder, "python -m jdr.train"):` before anything is written there.

The lock is FOLDER/.jdr-lock, held with an exclusive `flock` for the life of the process and holding its owner
(host, pid, start time, command) as JSON. A second run on the same folder refuses at once with one line naming
the owner. The kernel drops the lock when its process dies however it dies, so a lock left by a killed run is
taken over, saying whose it was; nothing stale ever blocks. `force` takes the folder even from a live owner (the
folder on a shared disk seen from another host whose lock the kernel here cannot see, or on purpose).

Object storage (gs://) has no file locks: there the folder is not locked, and a line says so. In a multi-host
job the first process holds the lock for all (every process writes into the same folder as one run).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from typing import Iterator

from jdr.runtime import paths

NAME = ".jdr-lock"


class Busy(ValueError):
  """The folder is held by another live run."""


def _owner_text(raw: str) -> str:
  try:
    owner = json.loads(raw)
    return (f"pid {owner['pid']} on {owner['host']} since {owner['started']} "
            f"({owner.get('command', 'a jdr run')})")
  except (ValueError, KeyError, TypeError):
    return "another run"


@contextlib.contextmanager
def held(folder: paths.PathLike, command: str, *, force: bool = False, process_index: int = 0) -> Iterator[None]:
  """Holds `folder`'s lock (creating the folder) while the block runs; raises Busy when another live process
  holds it, unless `force`."""
  folder = paths.as_path(folder)
  if process_index != 0:
    yield
    return
  if not paths.is_local(folder):
    print(f"{folder}: object storage has no file locks; make sure no other run writes here", file=sys.stderr)
    yield
    return
  created = not folder.exists()
  folder.mkdir(parents=True, exist_ok=True)
  path = os.path.join(paths.local(folder), NAME)
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    previous = os.pread(fd, 1 << 16, 0).decode("utf-8", "replace")
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      if not force:
        raise Busy(f"{folder} is in use by {_owner_text(previous)}; wait for it to finish, or pass --force if "
                   "it is not running") from None
      print(f"{folder}: taking it from {_owner_text(previous)} (--force)", file=sys.stderr)
    else:
      if previous.strip():
        print(f"{folder}: a lock left by {_owner_text(previous)}, which has ended: taken over", file=sys.stderr)
    owner = {"host": socket.gethostname(), "pid": os.getpid(),
             "started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": command}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(owner).encode(), 0)
    try:
      yield
    finally:
      os.ftruncate(fd, 0)  # an empty lock file: released cleanly, nothing to report next time
  finally:
    os.close(fd)
    # A folder this run made and left empty (it stopped before writing anything) is not left behind.
    if created and os.listdir(paths.local(folder)) == [NAME]:
      os.remove(path)
      os.rmdir(paths.local(folder))
