"""jdr's saved models as files: a jdr export (jdr_model.json + params) or a training workdir (model.json +
checkpoints/), read without building a model.

Both builders stand on this module: jdr/models/build.py turns what it reads into two towers (or a
cross-encoder), jdr/models/cross.py into a cross-encoder for reranking and distillation.
"""

import json
import pathlib
from typing import Any

from jdr.runtime import checkpoint
from jdr.runtime import paths
from jdr.data import text


def is_jdr_model(path: str | pathlib.Path) -> bool:
  """A jdr export (jdr_model.json + params) or a training workdir (config.json + checkpoints/)."""
  path = paths.as_path(path)
  return (path / "jdr_model.json").exists() or (path / "checkpoints").is_dir()


def description(path: str | pathlib.Path) -> dict:
  """The model description (jdr.models.build.describe) saved at `path`; {} when there is none."""
  path = paths.as_path(path)
  for name in ("jdr_model.json", "model.json"):
    if (path / name).exists():
      return json.loads((path / name).read_text())
  return {}


def load(path: str | pathlib.Path) -> tuple[dict, dict, Any]:
  """(params, description, tokenizer) from a jdr export or the latest checkpoint of a workdir."""
  path = paths.as_path(path)
  if (path / "jdr_model.json").exists():
    params, described = checkpoint.load_params(path)
  else:
    description_file = path / "model.json"
    if not description_file.exists():
      raise FileNotFoundError(f"{path}: a jdr workdir needs model.json beside checkpoints/")
    described = json.loads(description_file.read_text())
    params = checkpoint.latest_params(path)
  # A masked-LM pretraining run's head is not part of the retrieval model (jdr.models.towers.TwoTower).
  params = {k: v for k, v in params.items() if k != "lm_head"}
  described = {**described, "tokenizer": tokenizer_path(path, described["tokenizer"])}
  return params, described, text.load_tokenizer(described["tokenizer"], append_eos=bool(described.get("append_eos")))


def tokenizer_path(model_dir, recorded: str) -> str:
  """The tokenizer a saved model names: a path relative to the model's own folder (an export's ".", so the
  export loads wherever it is copied), else as recorded (an absolute path, a gs:// path, a hub name)."""
  if paths.is_local(recorded) and not pathlib.PurePath(recorded).is_absolute():
    candidate = paths.as_path(model_dir) / recorded
    if candidate.exists():
      return str(candidate)
  elif not paths.as_path(recorded).exists() and (paths.as_path(model_dir) / "tokenizer").is_dir():
    return str(paths.as_path(model_dir) / "tokenizer")  # an older export, moved: its tokenizer/ came with it
  return recorded

