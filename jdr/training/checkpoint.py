"""Orbax checkpoints of the train state, with one written load order.

Load order at start-up (trainer.train_and_evaluate):
  1. a checkpoint in the workdir: resume (parameters, optimizer state, step, rng; the data position
     follows from the step, because batches and negatives are a pure function of (seed, step));
  2. else `config.model.init_from`: a jdr workdir or export directory, a Hugging Face directory, or
     `minilm`;
  3. else fresh random weights.
"""

import contextlib
import json
import logging
import os
import sys
from typing import Any, Iterator

import jax
import orbax.checkpoint as ocp

from jdr.runtime import atomic
from jdr.runtime import paths

STATE = "state"
META = "meta"


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


def save(mngr: ocp.CheckpointManager, step: int, state: Any, meta: dict, *, force: bool = False) -> bool:
  """Saves state and JSON metadata at `step`; returns whether a checkpoint was written."""
  return mngr.save(step, args=ocp.args.Composite(**{STATE: ocp.args.StandardSave(state),
                                                      META: ocp.args.JsonSave(meta)}), force=force)


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
    params = ckptr.restore(path / "params")
  return params, json.loads((path / "jdr_model.json").read_text())


def latest_params(workdir: paths.PathLike) -> Any:
  """The parameters of the latest checkpoint in a training workdir, as host arrays (no shardings needed)."""
  mngr = manager(workdir)
  step = mngr.latest_step()
  if step is None:
    raise FileNotFoundError(f"{paths.as_path(workdir) / 'checkpoints'}: no checkpoint to load")
  restored = mngr.restore(step, args=ocp.args.Composite(**{STATE: ocp.args.StandardRestore()}))
  return restored[STATE]["params"]
