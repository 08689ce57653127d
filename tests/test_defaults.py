"""jdr.runtime.defaults is the recipes' base config, importable without putting configs/ on sys.path."""

import importlib.util
import pathlib

from jdr.runtime import defaults

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_defaults_are_the_recipes_base():
  # configs/base.py is what every recipe starts from (`import base`); the package's defaults must not drift.
  spec = importlib.util.spec_from_file_location("recipes_base", ROOT / "configs" / "base.py")
  base = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(base)
  assert base.get_config().to_dict() == defaults.get_config().to_dict()
  assert defaults.runlocal("runlocal,x") and not defaults.runlocal(None) and not defaults.runlocal("tiny")


def test_train_step_bench_needs_no_configs_on_sys_path():
  from jdr.bench import train_step  # pylint: disable=g-import-not-at-top
  args = type("Args", (), {"query_length": 8, "doc_length": 16, "batch_size": 4})()
  config = train_step._config(args)
  assert (config.data.query_max_length, config.data.doc_max_length, config.batch_size) == (8, 16, 4)
  assert config.model.init_from == "minilm"
