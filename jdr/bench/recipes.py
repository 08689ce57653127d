"""The recipes (configs/*.py) a benchmark starts from, so it measures what a user trains, not a copy."""

import pathlib

import ml_collections

from jdr.runtime import config_files

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"


def load(name: str, arg: str | None = None) -> ml_collections.ConfigDict:
  """configs/NAME.py's get_config(arg), unlocked so the benchmark can set its sizes."""
  path = CONFIGS / f"{name}.py"
  if not path.is_file():
    raise SystemExit(f"{path}: the benchmarks read the recipes from the source tree's configs/ folder "
                     "(install jdr from a checkout: pip install -e .)")
  config = config_files.load_config_file(f"{path}:{arg}" if arg else str(path))
  config.unlock()
  return config
