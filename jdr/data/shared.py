"""Where the real datasets live: `$JDR_SHARED_DATA`, else `../shared/data` beside the project root."""

import os
import pathlib

_PROJECT_ROOT = pathlib.Path(__file__).resolve().parents[2]


def shared_data_dir() -> pathlib.Path:
  """The folder holding scifact/, trec-dl-2019-passage-sample/, wikispeedia/ (may not exist)."""
  override = os.environ.get("JDR_SHARED_DATA")
  if override:
    return pathlib.Path(override)
  return _PROJECT_ROOT.parent / "shared" / "data"


def shared_dataset(name: str) -> pathlib.Path | None:
  """Path of one shared dataset, or None when it is absent from this host."""
  path = shared_data_dir() / name
  return path if path.is_dir() else None
