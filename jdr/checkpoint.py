"""Orbax checkpoints of the train state, with one written load order.

Load order at start-up (train.train_and_evaluate):
  1. a checkpoint in the workdir: resume (parameters, optimizer state, step, rng; the data position
     follows from the step, because batches and negatives are a pure function of (seed, step));
  2. else `config.model.init_from`: a jdr workdir or export directory, a Hugging Face directory, or
     `minilm`;
  3. else fresh random weights.
"""

import json
import logging
from typing import Any

import jax
import orbax.checkpoint as ocp

from jdr import paths

STATE = "state"
META = "meta"


def manager(workdir: paths.PathLike, *, keep: int = 3) -> ocp.CheckpointManager:
  """The workdir's CheckpointManager, keeping the last `keep` checkpoints; the trainer decides when to save."""
  options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
  return ocp.CheckpointManager(paths.absolute(workdir) / "checkpoints", options=options,
                               item_names=(STATE, META))


def save(mngr: ocp.CheckpointManager, step: int, state: Any, meta: dict, *, force: bool = False) -> bool:
  """Saves state and JSON metadata at `step`; returns whether a checkpoint was written."""
  return mngr.save(step, args=ocp.args.Composite(**{STATE: ocp.args.StandardSave(state),
                                                      META: ocp.args.JsonSave(meta)}), force=force)


def restore(mngr: ocp.CheckpointManager, abstract_state: Any, step: int | None = None) -> tuple[Any, dict]:
  """Restores (state, meta) at `step` (default: latest) into the shardings of `abstract_state`."""
  step = mngr.latest_step() if step is None else step
  restored = mngr.restore(step, args=ocp.args.Composite(**{
      STATE: ocp.args.StandardRestore(abstract_state), META: ocp.args.JsonRestore()}))
  return restored[STATE], restored[META]


def abstract_like(tree: Any) -> Any:
  """ShapeDtypeStructs with shardings: the restore target for arrays laid out like `tree`."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def save_params(path: paths.PathLike, params: Any, model_config: dict) -> None:
  """A params-only checkpoint for serving: orbax params plus the model description as JSON."""
  path = paths.absolute(path)
  path.mkdir(parents=True, exist_ok=True)
  # orbax logs a failed write's traceback from its writer thread before raising it here: the caller reports it.
  absl_logger = logging.getLogger("absl")
  level = absl_logger.level
  absl_logger.setLevel(logging.CRITICAL)
  try:
    with ocp.StandardCheckpointer() as ckptr:
      ckptr.save(path / "params", params, force=True)
  finally:
    absl_logger.setLevel(level)
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
