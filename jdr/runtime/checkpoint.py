"""Orbax checkpoints of the train state, with one written load order.

Load order at start-up (trainer.train_and_evaluate):
  1. a checkpoint in the workdir: resume (parameters, optimizer state, step, rng; the data position
     follows from the step, because batches and negatives are a pure function of (seed, step));
  2. else `config.model.init_from`: a jdr workdir or export directory, a Hugging Face directory, or
     `minilm`;
  3. else fresh random weights.

Every step this process saves is sealed once orbax has finished it: CHECKSUMS in the step's folder lists each
file's size and CRC-32. A resume restores the newest step that verifies: a step whose files are missing,
truncated or changed, an empty or unreadable step folder, or one holding a non-finite value is reported with its
path, moved to checkpoints-damaged/, and the step before it is tried, saying so. A step saved before sealing
existed (no CHECKSUMS) is restored when orbax reads it and its values are finite.
"""

import contextlib
import json
import logging
import os
import sys
import time
import zlib
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jdr.runtime import atomic
from jdr.runtime import paths

STATE = "state"
META = "meta"
CHECKSUMS = "jdr_checksums.json"  # in each step's folder: {relative path: [bytes, crc32]}
DAMAGED = "checkpoints-damaged"  # beside checkpoints/: steps that failed verification, kept for inspection

# The steps this process saved and has not sealed yet, by checkpoints folder: sealed once orbax has finished them.
_unsealed: dict[str, set[int]] = {}


def directory(workdir: paths.PathLike):
  """Where a workdir's checkpoints live."""
  return paths.absolute(workdir) / "checkpoints"


def manager(workdir: paths.PathLike, *, keep: int = 3) -> ocp.CheckpointManager:
  """The workdir's CheckpointManager, keeping the last `keep` checkpoints; the trainer decides when to save."""
  options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
  return ocp.CheckpointManager(directory(workdir), options=options,
                               item_names=(STATE, META))


def latest_step(workdir: paths.PathLike) -> int | None:
  """The step of a workdir's latest finished checkpoint, None when it has none; creates nothing (a manager
  would create the folder)."""
  if not directory(workdir).is_dir():
    return None
  mngr = manager(workdir)
  try:
    return mngr.latest_step()
  finally:
    mngr.close()


class NonFiniteError(FloatingPointError):
  """Training produced a non-finite value; nothing holding it was saved."""


@jax.jit
def _all_finite(tree) -> jax.Array:
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


def all_finite(tree) -> bool:
  """Whether every floating-point value of `tree` (params, optimizer moments) is finite."""
  return bool(_all_finite(tree))


def save(mngr: ocp.CheckpointManager, step: int, state: Any, meta: dict, *, force: bool = False) -> bool:
  """Saves state and JSON metadata at `step`; returns whether a checkpoint was written. A state holding a
  non-finite value is refused (NonFiniteError): such a step is never kept as the latest good one. Steps saved
  before, which orbax has finished by now, are sealed (CHECKSUMS)."""
  if not all_finite(state):
    raise NonFiniteError(f"the state at step {step} holds a non-finite parameter or optimizer value; not saved. "
                         f"The last good checkpoint is step {mngr.latest_step()} in {mngr.directory}")
  saved = mngr.save(step, args=ocp.args.Composite(**{STATE: ocp.args.StandardSave(state),
                                                       META: ocp.args.JsonSave(meta)}), force=force)
  # orbax finishes the previous save before it starts this one: those steps are complete on disk.
  folder = str(mngr.directory)
  _seal(mngr, _unsealed.setdefault(folder, set()) - {step})
  if saved:
    _unsealed[folder].add(step)
  return saved


def wait(mngr: ocp.CheckpointManager) -> None:
  """Waits for the saves in flight and seals them."""
  mngr.wait_until_finished()
  _seal(mngr, set(_unsealed.get(str(mngr.directory), ())))


def _seal(mngr: ocp.CheckpointManager, steps: set[int]) -> None:
  folder = str(mngr.directory)
  for step in sorted(steps):
    _unsealed.get(folder, set()).discard(step)
    path = paths.as_path(folder) / str(step)
    # Only local checkpoints are sealed: reading a step back from object storage costs its whole size.
    if jax.process_index() == 0 and paths.is_local(path) and path.is_dir():
      atomic.write_text(path / CHECKSUMS, json.dumps(_checksums(path), indent=0, sort_keys=True))


def _checksums(step_dir) -> dict[str, list[int]]:
  out = {}
  root = paths.local(step_dir)
  for directory_path, _, names in os.walk(root):
    for name in names:
      full = os.path.join(directory_path, name)
      rel = os.path.relpath(full, root)
      if rel == CHECKSUMS:
        continue
      crc = 0
      with open(full, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
          crc = zlib.crc32(block, crc)
      out[rel] = [os.path.getsize(full), crc]
  return out


def verify(step_dir) -> str | None:
  """Why the step folder `step_dir` cannot be trusted, or None: it is empty, or a file its CHECKSUMS lists is
  missing, of another size or another CRC-32. A folder without CHECKSUMS (saved before sealing, or on object
  storage) is not judged here."""
  path = paths.as_path(step_dir)
  if not path.is_dir() or not any(path.iterdir()):
    return "the step's folder is empty"
  if not paths.is_local(path) or not (path / CHECKSUMS).exists():
    return None
  try:
    want = json.loads((path / CHECKSUMS).read_text())
  except ValueError:
    return f"{CHECKSUMS} does not parse"
  got = _checksums(path)
  for rel, (size, crc) in sorted(want.items()):
    if rel not in got:
      return f"{rel} is missing"
    if got[rel][0] != size:
      return f"{rel} has {got[rel][0]} bytes, {size} when saved"
    if got[rel][1] != crc:
      return f"{rel} has changed since it was saved (CRC-32)"
  return None


def restore_latest_good(mngr: ocp.CheckpointManager, abstract_state: Any) -> tuple[Any, dict] | None:
  """(state, meta) of the newest step that verifies, restores and holds only finite values; None when the
  workdir has no step at all. A step that fails is reported on stderr with its path and the reason, moved to
  checkpoints-damaged/, and the one before it is tried; when every step fails, a ValueError names them."""
  failed = []
  for step in sorted(mngr.all_steps(), reverse=True):
    path = paths.as_path(str(mngr.directory)) / str(step)
    problem = verify(path)
    restored = None
    if problem is None:
      try:
        restored = restore(mngr, abstract_state, step)
      except Exception as e:  # pylint: disable=broad-except  (any damage orbax meets: the step is unusable)
        problem = f"it does not restore ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})"
    if problem is None and not all_finite(restored[0]):
      problem = "it holds a non-finite parameter or optimizer value"
    if problem is None:
      if failed:
        print(f"resuming from step {step}, the newest checkpoint that verifies", file=sys.stderr)
      return restored
    failed.append(f"{path}: {problem}")
    print(f"checkpoint {path} is damaged: {problem}; moved to {DAMAGED}/, trying the step before it",
          file=sys.stderr)
    _move_aside(path)
    mngr.reload()
  if failed:
    raise ValueError("no checkpoint in the workdir verifies: " + "; ".join(failed) +
                     f" (they are in {DAMAGED}/; remove the workdir's checkpoints/ to start again)")
  return None


def _move_aside(path) -> None:
  if jax.process_index() != 0:
    return
  target = path.parent.parent / DAMAGED
  target.mkdir(parents=True, exist_ok=True)
  path.rename(target / f"{path.name}-{time.strftime('%Y%m%d-%H%M%S')}")


class WriteError(OSError):
  """A checkpoint that could not be written (a full disk, a file-size limit): names the checkpoints folder."""


class _DropFailedWriteTracebacks(logging.Filter):
  """Drops the records of a failed write (those whose exception carries an OS error code); others pass."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not (record.exc_info and atomic.os_error_code(record.exc_info[1]) is not None)


@contextlib.contextmanager
def failed_writes_quiet() -> Iterator[None]:
  """Inside, a failed write prints nothing by itself, so its caller reports it once: orbax logs its
  traceback from each writer thread, and tensorstore's completion callbacks report, as unraisable, that
  orbax already closed the event loop of the write that failed. After a failed write both filters stay
  for the rest of the process (which then reports the error and ends): the writer threads' callbacks keep
  arriving after the exception has left this block."""
  absl_logger = logging.getLogger("absl")
  quiet = _DropFailedWriteTracebacks()
  absl_logger.addFilter(quiet)
  unraisablehook = sys.unraisablehook

  def hook(unraisable):
    value = unraisable.exc_value
    if not (isinstance(value, RuntimeError) and str(value) == "Event loop is closed"):
      unraisablehook(unraisable)

  sys.unraisablehook = hook
  yield  # an exception leaves both filters installed: tensorstore's callbacks go on firing after it
  absl_logger.removeFilter(quiet)
  sys.unraisablehook = unraisablehook


@contextlib.contextmanager
def writes_reported(workdir: paths.PathLike) -> Iterator[None]:
  """Inside: a checkpoint write that fails with an OS error (raised by a later save or wait, as orbax writes
  in the background) becomes one WriteError naming the checkpoints folder, and its partial step folder is
  removed; earlier checkpoints stay."""
  folder = str(directory(workdir))
  try:
    with failed_writes_quiet():
      yield
  except Exception as e:  # pylint: disable=broad-except
    code = atomic.os_error_code(e)
    if code is None or isinstance(e, WriteError) or folder not in str(e):
      raise
    if jax.process_index() == 0:
      for partial in paths.as_path(folder).glob("*.orbax-checkpoint-tmp*"):
        atomic.remove_tree(partial)
    raise WriteError(code, os.strerror(code), folder) from None


def restore(mngr: ocp.CheckpointManager, abstract_state: Any, step: int | None = None) -> tuple[Any, dict]:
  """Restores (state, meta) at `step` (default: latest) into the shardings of `abstract_state`."""
  step = mngr.latest_step() if step is None else step
  restored = mngr.restore(step, args=ocp.args.Composite(**{
      STATE: ocp.args.StandardRestore(abstract_state), META: ocp.args.JsonRestore()}))
  return restored[STATE], restored[META]


def save_params(path: paths.PathLike, params: Any, model_config: dict) -> None:
  """A params-only checkpoint for serving: orbax params plus the model description as JSON."""
  path = paths.absolute(path)
  path.mkdir(parents=True, exist_ok=True)
  with failed_writes_quiet(), ocp.StandardCheckpointer() as ckptr:  # the caller reports a failed write
    ckptr.save(path / "params", params, force=True)
  (path / "jdr_model.json").write_text(json.dumps(model_config, indent=1, sort_keys=True))


def load_params(path: paths.PathLike) -> tuple[Any, dict]:
  """Reads a params-only checkpoint written by save_params: (params as host arrays, model config)."""
  path = paths.absolute(path)
  if not (path / "jdr_model.json").exists():
    raise FileNotFoundError(f"{path}: not a jdr params checkpoint (no jdr_model.json)")
  with ocp.StandardCheckpointer() as ckptr:
    params = ckptr.restore(path / "params", on_this_host(path / "params"))
  return params, json.loads((path / "jdr_model.json").read_text())


def on_this_host(item: paths.PathLike) -> Any:
  """A restore target for the saved tree at `item` (a checkpoint's state, a params checkpoint) that puts every
  array on one CPU device of this process: a checkpoint saved over several devices (a CPU split into one
  device per core, a GPU host) reads anywhere, where orbax refuses another topology without a target."""
  device = jax.local_devices(backend="cpu")[0]
  absl = logging.getLogger("absl")
  level = absl.level
  absl.setLevel(logging.ERROR)  # orbax warns that an item folder has no step metadata: only steps have it
  try:
    with ocp.StandardCheckpointer() as ckptr:
      tree = ckptr.metadata(paths.absolute(item)).item_metadata
  finally:
    absl.setLevel(level)
  return jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype,
                                                     sharding=jax.sharding.SingleDeviceSharding(device)), tree)


def latest_params(workdir: paths.PathLike) -> Any:
  """The parameters of the newest checkpoint of a training workdir that verifies, restores and is finite, as
  host arrays (no shardings needed); a newer one that fails is reported and left where it is."""
  mngr = manager(workdir)
  if mngr.latest_step() is None:
    raise FileNotFoundError(f"{paths.as_path(workdir) / 'checkpoints'}: no checkpoint to load")
  failed = []
  for step in sorted(mngr.all_steps(), reverse=True):
    path = paths.as_path(str(mngr.directory)) / str(step)
    problem = verify(path)
    if problem is None:
      try:
        target = on_this_host(path / STATE)
        params = mngr.restore(step, args=ocp.args.Composite(**{STATE: ocp.args.StandardRestore(target)}))[STATE]
        params = params["params"]
        if all_finite(params):
          if failed:
            print(f"reading step {step}, the newest checkpoint that verifies", file=sys.stderr)
          return params
        problem = "it holds a non-finite parameter"
      except Exception as e:  # pylint: disable=broad-except  (any damage orbax meets: the step is unusable)
        problem = f"it does not restore ({type(e).__name__})"
    failed.append(f"{path}: {problem}")
    print(f"checkpoint {path} is damaged: {problem}; trying the step before it", file=sys.stderr)
  raise ValueError("no checkpoint in the workdir verifies: " + "; ".join(failed))
