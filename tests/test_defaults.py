"""What configs/base.py promises the recipes: each starts from jdr.runtime.defaults (which base.py re-exports)
and changes values, never keys, so `python -m jdr.train --help` (the defaults' keys and their comments) lists
exactly what a recipe can set, and a key a recipe misspells (a new key on its unlocked ConfigDict) fails here
instead of training the default. jdr.runtime.defaults is importable without configs/ on sys.path."""

import importlib.util
import pathlib

import ml_collections
import pytest

from jdr.runtime import config_files
from jdr.runtime import config_help
from jdr.runtime import defaults

ROOT = pathlib.Path(__file__).resolve().parents[1]
RECIPES = sorted(p for p in (ROOT / "configs").glob("*.py") if p.stem != "base")


def _flat(config: ml_collections.ConfigDict, prefix: str = "") -> dict:
  out = {}
  for key, value in config.items():
    if isinstance(value, ml_collections.ConfigDict):
      out.update(_flat(value, f"{prefix}{key}."))
    else:
      out[prefix + key] = value
  return out


def _arguments(path: pathlib.Path) -> list[str | None]:
  """No argument, each boolean argument the recipe declares (ARGS), and each with runlocal."""
  config_files.load_config_file(str(path))  # puts configs/ on sys.path, for the recipe's `import base`
  spec = importlib.util.spec_from_file_location(f"defaults_test_{path.stem}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  flags = [name for name, default in module.ARGS.items() if isinstance(default, bool)]
  with_runlocal = [f"runlocal,{name}" for name in flags if "runlocal" in flags and name != "runlocal"]
  return [None, *flags, *with_runlocal]


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_sets_exactly_the_defaults_keys_with_their_types(path):
  expected = {key: type(value) for key, value in _flat(defaults.get_config()).items()}
  for arg in _arguments(path):
    spec = f"{path}:{arg}" if arg else str(path)
    got = {key: type(value) for key, value in _flat(config_files.load_config_file(spec)).items()}
    assert set(got) - set(expected) == set(), f"{spec}: keys jdr/runtime/defaults.py does not define"
    assert set(expected) - set(got) == set(), f"{spec}: keys the recipe dropped"
    assert {k: t for k, t in got.items() if t is not expected[k]} == {}, f"{spec}: values of another type"


def test_the_help_describes_every_default_key():
  meanings = config_help.meanings()
  assert sorted(meanings) == sorted(config_files.all_keys(defaults.get_config()))
  assert [key for key, meaning in meanings.items() if not meaning] == [], "keys without a comment to show"


def test_train_step_bench_needs_no_configs_on_sys_path():
  from jdr.bench import train_step  # pylint: disable=g-import-not-at-top
  args = type("Args", (), {"query_length": 8, "doc_length": 16, "batch_size": 4})()
  config = train_step.bench_config(args)
  assert (config.data.query_max_length, config.data.doc_max_length, config.batch_size) == (8, 16, 4)
  assert config.model.init_from == "minilm"
