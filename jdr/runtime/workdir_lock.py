"""One run per output folder: `with held(folder, "python -m jdr.train"):` before anything is written there.

The lock is FOLDER/.jdr-lock, held with an exclusive `flock` for the life of the process and holding its owner
(host, pid, start time, command) as JSON. A second run on the same folder refuses at once with one line naming
the owner. The kernel drops the lock when its process dies however it dies, so a lock left by a killed run is
taken over, saying whose it was; nothing stale ever blocks. `force` takes the folder even from a live owner (the
folder on a shared disk seen from another host whose lock the kernel here cannot see, or on purpose).

Object storage (gs://) has no file locks: there the lock is a claim file, FOLDER/.jdr-claim holding the owner and
an expiry CLAIM_SECONDS ahead, renewed every RENEW_SECONDS by a background thread while the run lives and
deleted when it ends. A second run refuses while the claim is live; one whose owner died without deleting it is
taken over once it expires, saying so. In a multi-host job the first process holds the lock for all (every
process writes into the same folder as one run).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import threading
import time
from typing import Iterator

from jdr.runtime import paths

NAME = ".jdr-lock"
CLAIM = ".jdr-claim"
CLAIM_SECONDS = 300.0  # a claim not renewed for this long belongs to a run that has died
RENEW_SECONDS = 60.0


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
    with _claimed(folder, command, force):
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
    owner = _owner(command)
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(owner).encode(), 0)
    try:
      yield
    finally:
      os.ftruncate(fd, 0)  # an empty lock file: reclaimd cleanly, nothing to report next time
  finally:
    os.close(fd)
    # A folder this run made and left empty (it stopped before writing anything) is not left behind.
    if created and os.listdir(paths.local(folder)) == [NAME]:
      os.remove(path)
      os.rmdir(paths.local(folder))


def _owner(command: str) -> dict:
  return {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
          "command": command}


@contextlib.contextmanager
def _claimed(folder, command: str, force: bool) -> Iterator[None]:
  """The claim on object storage (see the module note)."""
  claim = folder / CLAIM
  now = time.time()
  if claim.exists():
    raw = claim.read_text()
    try:
      expires = float(json.loads(raw)["expires"])
    except (ValueError, KeyError, TypeError):
      expires = 0.0
    if expires > now and not force:
      raise Busy(f"{folder} is in use by {_owner_text(raw)} (its claim is renewed while it runs); wait for it to "
                 "finish, or pass --force if it is not running")
    print(f"{folder}: " + (f"taking it from {_owner_text(raw)} (--force)" if expires > now else
                           f"a claim left by {_owner_text(raw)}, which has expired: taken over"), file=sys.stderr)
  owner = _owner(command)
  write = lambda: claim.write_text(json.dumps({**owner, "expires": time.time() + CLAIM_SECONDS}))
  folder.mkdir(parents=True, exist_ok=True)
  write()
  # Object storage has no atomic create: of two runs that wrote at once, the one whose claim is read back holds it.
  if json.loads(claim.read_text())["pid"] != owner["pid"] and not force:
    raise Busy(f"{folder} is in use by {_owner_text(claim.read_text())}")
  stop = threading.Event()

  def renew():
    while not stop.wait(RENEW_SECONDS):
      try:
        write()
      except OSError as e:  # a failed renewal is retried; the claim lasts CLAIM_SECONDS
        print(f"{claim}: could not renew the claim ({e})", file=sys.stderr)

  thread = threading.Thread(target=renew, daemon=True, name="jdr-claim")
  thread.start()
  try:
    yield
  finally:
    stop.set()
    thread.join()
    try:
      claim.unlink()
    except OSError:
      pass
