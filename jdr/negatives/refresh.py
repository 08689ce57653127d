"""ANCE's asynchronous negative refresh (Xiong et al. 2021, section 4 "Asynchronous Index Refresh").

Re-encoding the corpus costs far more than a training step, so ANCE does not do it per batch: every `every`
steps the trainer hands its current parameters (the "snapshot") to an inferencer, keeps training on the
previous negatives, and switches to the new ones once the corpus has been re-encoded and the index rebuilt.
`AsyncRefresher` is that loop with the model left out: the expensive part is a `mine(params, generation)`
callable that returns the pools as one array (ANCE's: int32 corpus rows [training queries, top n], -1
padded), and it runs on one background thread.

The paper switches "once it finishes", which makes the negatives depend on how fast the inferencer happened
to be, so a resumed run would train on different negatives than an uninterrupted one. Here the switch is on a
fixed schedule instead: generation k is mined from the params at step k*every and comes into force at step
k*every + delay (generation 0, from step 0, at once). If it is late the trainer waits (up to `max_wait_s`), so
with the default infinite wait the negatives at every step are a function of the step alone, and a run killed
and resumed from a checkpoint sees the same ones: snapshots and finished generations live in `directory`.

  directory/schedule.json          every and delay, so a resume with another schedule fails loudly
  directory/snapshot-00000010.npz  host copy of the params at step 10, kept until generation 2 is on disk
  directory/gen-000002.npy         generation 2's pools (the miner's array, read back memory-mapped)
  directory/gen-000002.json        its snapshot step, how long mining took and its shape; written last, so
                                   a generation without it is unfinished and never read

Only the two newest finished generations are kept (and the one in force, should it be older): at MS MARCO's
size a generation is 502,939 x 200 rows, 400 MB, and the paper's 60 refreshes would leave 24 GB. Each removal
is logged. A run resumed from a checkpoint older than the generations kept re-mines the one it needs from the
params it resumes with, and says its negatives differ from the uninterrupted run's. Snapshots are the size of
the model and are deleted once mined; a generation no step of the run would use (in force at the run's last
step or later) is not mined, and its snapshot stays for a resume that trains longer.
"""

from __future__ import annotations

import json
import math
import pathlib
import queue
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jdr.runtime import atomic
from jdr.runtime import paths

Pools = np.ndarray

_GEN_RE = re.compile(r"gen-(\d{6})\.json")
KEEP_GENERATIONS = 2
_SNAPSHOT_RE = re.compile(r"snapshot-(\d{8})\.npz")
# npz member holding the dtype names numpy cannot store natively (bfloat16 and the other ml_dtypes).
_DTYPES_KEY = "__dtypes__"


def generation_at(step: int, every: int, delay: int) -> int:
  """The generation the schedule puts in force at `step`: k once step >= k*every + delay, and 0 from step 0.

  With delay < every that is at most floor(step/every) automatically; the min keeps a generation from ever
  being asked for before its snapshot exists, whatever the arithmetic.
  """
  return max(0, min((step - delay) // every, step // every))


def activation_step(generation: int, every: int, delay: int) -> int:
  """The first step that uses `generation`: its snapshot step plus `delay` (0 for the first generation)."""
  return 0 if generation == 0 else generation * every + delay


@dataclass
class _Generation:
  index: int
  snapshot_step: int
  mine_seconds: float
  pools: Pools
  from_disk: bool = False


def _to_host(params: Any) -> Any:
  """An owned numpy copy of the params: the trainer donates its state, so device buffers die after the step
  (and on CPU `device_get` may hand back a view of one)."""
  return jax.tree_util.tree_map(lambda x: np.array(x, copy=True), jax.device_get(params))


def save_snapshot(path: pathlib.Path, host_params: Any) -> None:
  """Save a params pytree as an npz keyed by pytree path (`jax.tree_util.keystr`), atomically."""
  arrays, dtypes = {}, {}
  for key_path, leaf in jax.tree_util.tree_flatten_with_path(host_params)[0]:
    key = jax.tree_util.keystr(key_path)
    a = np.asarray(leaf)
    if np.dtype(a.dtype.str) != a.dtype:  # bfloat16 & co. would come back as raw void bytes
      dtypes[key] = a.dtype.name
      a = a.view(f"u{a.dtype.itemsize}")
    arrays[key] = a
  arrays[_DTYPES_KEY] = np.array(json.dumps(dtypes))
  atomic.write_atomic(path, lambda f: np.savez(f, **arrays))


def load_snapshot(path: pathlib.Path, like: Any) -> Any:
  """Load a snapshot into the tree structure of `like` (the resumed params): npz keeps leaves, not treedefs."""
  leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(like)
  with paths.load_npy(path) as data:
    dtypes = json.loads(str(data[_DTYPES_KEY]))
    stored = set(data.files) - {_DTYPES_KEY}
    keys = [jax.tree_util.keystr(p) for p, _ in leaves_with_path]
    if stored != set(keys):
      raise ValueError(f"{path.name} does not match the params' structure: only in the file "
                       f"{sorted(stored - set(keys))[:3]}, only in the params {sorted(set(keys) - stored)[:3]}")
    leaves = []
    for key in keys:
      a = data[key]
      if key in dtypes:
        a = a.view(jnp.dtype(dtypes[key]))
      leaves.append(a)
  return jax.tree_util.tree_unflatten(treedef, leaves)


class AsyncRefresher:
  """Hard-negative pools re-mined in the background every `every` steps, switched in on a fixed schedule.

  The trainer calls `prepare(step, params)` before each step and reads `pools(step)`. `mine(params, generation)`
  gets the snapshot as a numpy pytree and returns the pools as one numpy array; it runs on one worker thread, so
  mines never overlap. A mine that raises, or a worker thread that dies, is logged and counted, and training
  keeps the previous generation; nothing from the worker reaches the trainer. Log lines are handed to `log`
  from the trainer's thread only (the worker queues them), so `log` need not be thread-safe.

  `max_wait_s` trades determinism for speed: when a generation is due but not mined yet, the trainer waits up
  to that long; past it the old generation stays in force, the new one comes in at the first later step it is
  ready (a "late switch"), and the negatives then depend on timing, which the log says.

  `initial_params` mines generation 0 in the constructor, for callers that need pools before the first
  `prepare`; it is ignored when `directory` already holds a run (a resume).

  `last_step` (the run's number of steps) skips the mines no step of the run would use: a generation that
  comes in force at `last_step` or later gets its snapshot saved and not mined, so a resume that trains longer
  mines it from the params an uninterrupted longer run would have used.

  `inline=True` mines on the caller's thread at the snapshot step instead (training pauses while it runs).
  The schedule makes the pools at every step the same either way; the trainer asks for it on several hosts,
  where a mine's cross-host gather of the corpus vectors is a collective: issued from a worker thread beside
  the step's own, an accelerator runtime could see the two in a different order on each host and hang.
  """

  def __init__(self, mine: Callable[[Any, int], Pools], *, every: int, delay: int, directory: pathlib.Path,
               max_wait_s: float = float("inf"), log: Callable[[str], None] = print,
               initial_params: Any | None = None, inline: bool = False, last_step: int | None = None):
    if every < 1:
      raise ValueError(f"every must be >= 1, got {every}")
    if delay < 0:
      raise ValueError(f"delay must be >= 0, got {delay}")
    if not max_wait_s >= 0:
      raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
    self._mine = mine
    self.inline = inline
    self.every, self.delay = int(every), int(delay)
    self.last_step = None if last_step is None else int(last_step)
    self.directory = paths.as_path(directory)
    self.max_wait_s = float(max_wait_s)
    self._log = log
    self.directory.mkdir(parents=True, exist_ok=True)
    # On several hosts sharing the workdir, the first clears what a killed run half-wrote and writes the
    # schedule; another host clearing too could delete a file the first is writing at this moment. Hosts
    # write nothing else before the first step, whose collectives wait for every host to be past here.
    self._first_host = jax.process_index() == 0
    if self._first_host:
      for tmp in self.directory.glob(".*.tmp"):
        tmp.unlink(missing_ok=True)  # half-written by a killed run (see jdr.runtime.atomic)
    self._check_schedule_file()

    self._cond = threading.Condition()
    # Everything below is shared with the worker and guarded by self._cond.
    self._ready: dict[int, _Generation] = {}  # finished, not yet superseded by the one in force
    self._pending: set[int] = set()  # queued or being mined
    self._failed: set[int] = set()
    self._messages: list[str] = []  # worker log lines, flushed on the trainer's thread
    self._mines = 0
    self._last_mine_seconds: float | None = None
    # Trainer-side state.
    self._queue: queue.Queue = queue.Queue()
    self._worker: threading.Thread | None = None
    self._closing = False
    self._in_force: _Generation | None = None
    self._timed_out: set[int] = set()  # waited max_wait_s for these; switch in late, without waiting again
    self._blocking: set[int] = set()  # nothing sensible to fall back on: wait without limit, not counted
    self._wait_seconds = 0.0
    self._late_switches = 0
    self._last_step: int | None = None

    fresh = not any(_GEN_RE.fullmatch(p.name) or _SNAPSHOT_RE.fullmatch(p.name) for p in self.directory.iterdir())
    if initial_params is not None and fresh:
      self._snapshot_and_enqueue(0, 0, _to_host(initial_params))
      self._blocking.add(0)
      self._advance(0)

  # ---------------------------------------------------------------- trainer API

  def prepare(self, step: int, params: Any) -> None:
    """Snapshot the params when `step` is a snapshot step, and switch generations when one is due.

    On the first call this is also the resume: generations the schedule has already started by `step` are
    read back from `directory`, and those whose snapshot was saved but whose mine never finished are re-mined
    from that snapshot, so they come out as in the uninterrupted run.
    """
    if self._closing:
      raise RuntimeError("AsyncRefresher.prepare after close()")
    first = self._last_step is None
    if first:
      # The resumed run needs the generation in force now and every one whose snapshot step it has passed.
      generations = range(generation_at(step, self.every, self.delay), step // self.every + 1)
    else:
      # Normally one snapshot step at most; more only if the caller skipped steps.
      generations = range(self._last_step // self.every + 1, step // self.every + 1)
    host = None
    for k in generations:
      if self._known(k):
        continue
      after_the_run = self._after_the_run(k)
      if after_the_run and (k * self.every != step or self._snapshot_path(step).exists()):
        continue  # not mined; a resume at its snapshot step has the snapshot already
      if not after_the_run and first and self._restore(k, params):
        continue
      if host is None:
        host = _to_host(params)
      if after_the_run:
        self._save_unmined(k, step, host)
      elif k * self.every == step:
        self._snapshot_and_enqueue(k, step, host)
        if k == 0:
          self._blocking.add(0)  # nothing to train on before it
      else:
        # Its snapshot step has passed with nothing on disk (directory deleted, or prepare skipped it): the
        # params it should come from are gone, so the current ones stand in.
        self._say(
            f"refresh: generation {k} has no saved snapshot (step {k * self.every}); mining it from the params "
            f"at step {step}, so its negatives differ from an uninterrupted run")
        self._enqueue(k, step, host, None)
        if k == generation_at(step, self.every, self.delay):
          self._blocking.add(k)
    if first:
      self._restore_fallback(step)
    self._last_step = step
    self._advance(step)

  def pools(self, step: int) -> Pools | None:
    """The pools array in force at `step` (shared and read-only); None if no generation has ever been mined
    successfully."""
    self._require_started()
    self._advance(step)
    return self._in_force.pools if self._in_force is not None else None

  def generation(self, step: int) -> tuple[int, int]:
    """(the generation in force at `step`, the step the schedule puts it in force): where a consumer that
    walks through a generation's data (ANCE's triples) starts it, the same after a resume; (-1, 0) if none."""
    self._require_started()
    self._advance(step)
    if self._in_force is None:
      return -1, 0
    return self._in_force.index, activation_step(self._in_force.index, self.every, self.delay)

  def staleness(self, step: int) -> int:
    """How many steps old the params behind the pools in force are (the paper's async gap); -1 if none."""
    self._require_started()
    self._advance(step)
    return -1 if self._in_force is None else step - self._in_force.snapshot_step

  def stats(self) -> dict:
    """Counters for the training log; `failed` and `late_switches` flag runs whose negatives deviated."""
    with self._cond:
      return {
          "generation": None if self._in_force is None else self._in_force.index,
          "snapshot_step": None if self._in_force is None else self._in_force.snapshot_step,
          "mine_seconds": self._last_mine_seconds,
          "wait_seconds": self._wait_seconds,
          "mines": self._mines,
          "failed": len(self._failed),
          "late_switches": self._late_switches,
          "pending": len(self._pending),
      }

  def close(self, wait: bool = True) -> None:
    """Stop the worker: queued mines are dropped, their snapshots stay on disk, so a resume re-mines them. A
    mine in flight finishes (threads cannot be interrupted); `wait=False` does not wait for it (a preempted
    run, which exits next): its generation, if it gets written at all, is written whole (jdr.runtime.atomic)."""
    with self._cond:
      self._closing = True
      worker, jobs = self._worker, self._queue
    if worker is not None:
      jobs.put(None)
      if wait:
        worker.join()
    self._flush()

  # ---------------------------------------------------------------- schedule

  def _advance(self, step: int) -> None:
    """Put in force the newest finished generation the schedule allows at `step`, waiting for it if due."""
    due = generation_at(step, self.every, self.delay)
    with self._cond:
      timed_out = False
      if due in self._pending and due not in self._timed_out:
        done = lambda: due in self._ready or due in self._failed  # noqa: E731
        fallback = self._in_force is not None or any(k < due for k in self._ready)
        if due in self._blocking or not fallback:
          self._cond.wait_for(done)
        else:
          start = time.monotonic()
          ok = self._cond.wait_for(done, timeout=None if math.isinf(self.max_wait_s) else self.max_wait_s)
          self._wait_seconds += time.monotonic() - start
          if not ok:
            self._timed_out.add(due)
            timed_out = True
      newest = max((k for k in self._ready if k <= due), default=None)
      if newest is not None and (self._in_force is None or newest > self._in_force.index):
        self._switch(self._ready[newest], step)
      if timed_out:
        self._say(f"refresh: generation {due} not ready at step {step} after waiting {self.max_wait_s:g}s; keeping "
                  f"generation {self._in_force.index} (snapshot step {self._in_force.snapshot_step}) until it is, "
                  "so from here the negatives differ from an uninterrupted run")
    self._flush()

  def _switch(self, gen: _Generation, step: int) -> None:
    self._in_force = gen
    for k in [k for k in self._ready if k < gen.index]:
      del self._ready[k]  # superseded; its pools can be freed
    how = "restored from disk" if gen.from_disk else f"mined in {gen.mine_seconds:.2f}s"
    line = (f"refresh: generation {gen.index} (snapshot step {gen.snapshot_step}, {how}) in force from step {step}, "
            f"staleness {step - gen.snapshot_step}")
    if gen.index in self._timed_out:
      self._late_switches += 1
      line += (f"; late (due at step {activation_step(gen.index, self.every, self.delay)}), so the negatives "
               "differ from an uninterrupted run")
    self._say(line)

  def _after_the_run(self, k: int) -> bool:
    return self.last_step is not None and activation_step(k, self.every, self.delay) >= self.last_step

  def _save_unmined(self, k: int, step: int, host: Any) -> None:
    path = self._save_snapshot(step, host, f"a longer resumed run mines generation {k} from the params it "
                                           "resumes with")
    if path is not None:
      self._say(f"refresh: generation {k} would come in force at step "
                f"{activation_step(k, self.every, self.delay)}, after the run's last step ({self.last_step - 1}): "
                f"not mined; {path.name} is kept for a longer run")

  def _known(self, k: int) -> bool:
    with self._cond:
      return (k in self._ready or k in self._pending or k in self._failed
              or (self._in_force is not None and self._in_force.index >= k))

  # ---------------------------------------------------------------- disk

  def _gen_path(self, k: int) -> pathlib.Path:
    return self.directory / f"gen-{k:06d}.json"

  def _pools_path(self, k: int) -> pathlib.Path:
    return self.directory / f"gen-{k:06d}.npy"

  def _snapshot_path(self, step: int) -> pathlib.Path:
    return self.directory / f"snapshot-{step:08d}.npz"

  def _check_schedule_file(self) -> None:
    path = self.directory / "schedule.json"
    mine = {"every": self.every, "delay": self.delay}
    if path.exists():
      theirs = json.loads(path.read_text())
      if theirs != mine:
        raise ValueError(f"{self.directory} holds a refresh run with schedule {theirs}, not {mine}: its generations "
                         "would land on the wrong steps; use another directory")
    elif self._first_host:
      atomic.write_atomic(path, lambda f: f.write(json.dumps(mine).encode()))

  def _read_generation(self, k: int) -> _Generation:
    data = json.loads(self._gen_path(k).read_text())
    if "shape" not in data:
      raise ValueError(f"{self._gen_path(k)}: a generation in an older layout (pools as JSON); mine it again by "
                       f"removing {self.directory}")
    pools = paths.load_npy(self._pools_path(k), mmap_mode="r")
    if list(pools.shape) != data["shape"]:
      raise ValueError(f"{self._pools_path(k)}: shape {list(pools.shape)}, but {self._gen_path(k).name} says "
                       f"{data['shape']}")
    return _Generation(k, int(data["snapshot_step"]), float(data["mine_seconds"]), pools, from_disk=True)

  def _restore(self, k: int, like: Any) -> bool:
    """Pick generation k up from disk on resume: its pools if it finished, else a re-mine of its snapshot."""
    snapshot = self._snapshot_path(k * self.every)
    if self._gen_path(k).exists():
      gen = self._read_generation(k)
      with self._cond:
        self._ready[k] = gen
        if self._last_mine_seconds is None:
          self._last_mine_seconds = gen.mine_seconds
      snapshot.unlink(missing_ok=True)  # killed between writing the generation and deleting its snapshot
      return True
    if snapshot.exists():
      try:
        host = load_snapshot(snapshot, like)
      except (OSError, ValueError) as e:
        self._say(f"refresh: cannot read {snapshot.name} for generation {k}: {e}")
        return False
      self._say(f"refresh: generation {k} was not mined when the run stopped; mining it from {snapshot.name}")
      self._enqueue(k, k * self.every, host, snapshot)
      return True
    return False

  def _restore_fallback(self, step: int) -> None:
    """On resume, load the newest finished generation before the due one, for while the due one is re-mined."""
    due = generation_at(step, self.every, self.delay)
    with self._cond:
      if due in self._ready or self._in_force is not None:
        return
    older = [int(m.group(1)) for p in self.directory.iterdir() if (m := _GEN_RE.fullmatch(p.name))]
    older = [k for k in older if k < due]
    if older:
      gen = self._read_generation(max(older))
      with self._cond:
        self._ready[gen.index] = gen

  # ---------------------------------------------------------------- worker

  def _snapshot_and_enqueue(self, k: int, step: int, host: Any) -> None:
    # Unsaved, the mine can still run; only a kill before it finishes loses the generation.
    path = self._save_snapshot(step, host, f"generation {k} is not resumable until mined")
    self._enqueue(k, step, host, path)

  def _save_snapshot(self, step: int, host: Any, if_unsaved: str) -> pathlib.Path | None:
    path = self._snapshot_path(step)
    try:
      save_snapshot(path, host)
    except OSError as e:
      self._say(f"refresh: cannot save {path.name} ({e}); {if_unsaved}")
      return None
    return path

  def _enqueue(self, k: int, snapshot_step: int, host: Any, snapshot: pathlib.Path | None) -> None:
    if self.inline:
      with self._cond:
        self._pending.add(k)
      self._mine_one(k, snapshot_step, host, snapshot)
      return
    # Under the lock, so a worker dying right now either sees this job as pending (and fails it) or has
    # already cleared self._worker (and a new one gets it).
    with self._cond:
      self._pending.add(k)
      if self._worker is None:
        self._queue = queue.Queue()
        self._worker = threading.Thread(target=self._work, args=(self._queue,), name="jdr-negative-refresh",
                                        daemon=True)
        self._worker.start()
      self._queue.put((k, snapshot_step, host, snapshot))

  def _work(self, jobs: queue.Queue) -> None:
    """The worker loop. A mine's exception fails that generation only; anything escaping the loop (a
    BaseException, a bug here) ends the thread, fails all it had queued, and the next snapshot starts a new one."""
    try:
      while True:
        job = jobs.get()
        if job is None:
          return
        if self._closing:
          continue
        self._mine_one(*job)
    except BaseException as e:  # noqa: BLE001 -- the thread is dying; say so instead of hanging the trainer
      with self._cond:
        lost = sorted(self._pending)
        self._failed.update(lost)
        self._pending.clear()
        self._say(f"refresh: worker thread died ({type(e).__name__}: {_one_line(e)}); generation "
                              f"{', '.join(map(str, lost)) or '(none pending)'} failed, keeping the previous "
                              "generation; the next snapshot starts a new worker")
        self._worker = None  # its queue's backlog dies with it (counted as failed); the next job starts anew
        self._cond.notify_all()

  def _mine_one(self, k: int, snapshot_step: int, host: Any, snapshot: pathlib.Path | None) -> None:
    """Mines generation k and makes it ready (or failed); on the worker thread, or the caller's when inline."""
    start = time.perf_counter()
    try:
      pools = np.asarray(self._mine(host, k))
      seconds = time.perf_counter() - start
      atomic.write_atomic(self._pools_path(k), lambda f: np.save(f, pools))
      body = {"generation": k, "snapshot_step": snapshot_step, "mine_seconds": seconds,
              "shape": list(pools.shape), "dtype": pools.dtype.name}
      atomic.write_atomic(self._gen_path(k), lambda f: f.write(json.dumps(body).encode()))
    except Exception as e:  # noqa: BLE001 -- a bad mine must not stop training
      with self._cond:
        self._pending.discard(k)
        self._failed.add(k)
        self._say(f"refresh: generation {k} (snapshot step {snapshot_step}) failed after "
                  f"{time.perf_counter() - start:.2f}s, keeping the previous generation: "
                  f"{type(e).__name__}: {_one_line(e)}")
        self._cond.notify_all()
      return
    if snapshot is not None:
      snapshot.unlink(missing_ok=True)
    self._delete_failed_snapshots(before=k)
    with self._cond:
      self._ready[k] = _Generation(k, snapshot_step, seconds, pools)
      self._pending.discard(k)
      self._mines += 1
      self._last_mine_seconds = seconds
      self._cond.notify_all()
    self._remove_old_generations()

  def _remove_old_generations(self) -> None:
    """Keeps the KEEP_GENERATIONS newest finished generations on disk, and the one in force; logs the rest's
    removal. Only the first host removes (they share the workdir)."""
    if not self._first_host:
      return
    on_disk = sorted(int(m.group(1)) for p in self.directory.iterdir() if (m := _GEN_RE.fullmatch(p.name)))
    with self._cond:
      in_force = None if self._in_force is None else self._in_force.index
      needed = set(self._ready) | ({in_force} if in_force is not None else set())
    keep = set(on_disk[-KEEP_GENERATIONS:]) | needed
    for k in on_disk:
      if k in keep:
        continue
      size = sum(p.stat().length for p in (self._pools_path(k), self._gen_path(k)) if p.exists())
      self._gen_path(k).unlink(missing_ok=True)  # the marker first: a half-removed generation is unfinished
      self._pools_path(k).unlink(missing_ok=True)
      self._say(f"refresh: removed generation {k} ({self._pools_path(k).name}, {size / 2**20:.1f} MiB) from "
                f"{self.directory}: only the last {KEEP_GENERATIONS} generations are kept")

  def _delete_failed_snapshots(self, before: int) -> None:
    """A failed generation keeps its snapshot (a resume may re-mine it) until a later one supersedes it."""
    with self._cond:
      failed = [k for k in self._failed if k < before]
    for k in failed:
      self._snapshot_path(k * self.every).unlink(missing_ok=True)

  # ---------------------------------------------------------------- misc

  def _require_started(self) -> None:
    if self._last_step is None and self._in_force is None and not self._ready and not self._pending:
      raise RuntimeError("AsyncRefresher: call prepare(step, params) (or pass initial_params) before reading pools")

  def _say(self, line: str) -> None:
    with self._cond:
      self._messages.append(line)

  def _flush(self) -> None:
    with self._cond:
      messages, self._messages = self._messages, []
    for line in messages:
      self._log(line)


def _one_line(e: BaseException) -> str:
  return " | ".join(str(e).splitlines()) or "(no message)"
