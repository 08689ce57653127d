"""Every numeric setting has a range, the defaults and every recipe lie in it, and a setting out of range is one
line naming the key before anything is read or written."""

import math
import pathlib
import re
import subprocess
import sys

import pytest

from jdr.runtime import config_files
from jdr.runtime import config_help
from jdr.runtime import defaults
from jdr.runtime import settings

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _value(config, key):
  for part in key.split("."):
    config = config[part]
  return config


def test_every_numeric_key_has_a_range_and_every_range_names_a_key():
  config = defaults.get_config()
  numeric = {k for k in config_help.meanings() if isinstance(_value(config, k), (int, float))
             and not isinstance(_value(config, k), bool)}
  assert numeric == set(settings.RANGES), (numeric ^ set(settings.RANGES))


def test_defaults_and_recipes_lie_in_their_ranges():
  assert settings.problems(defaults.get_config()) == []
  for recipe in sorted((ROOT / "configs").glob("*.py")):
    if recipe.name == "base.py":
      continue
    module_args = recipe.read_text()
    for arg in [""] + [a for a in ("runlocal", "tiny") if f"{a}=False" in module_args]:
      config = config_files.load_config_file(f"{recipe}:{arg}" if arg else str(recipe))
      assert settings.problems(config) == [], (recipe.name, arg)


@pytest.mark.parametrize("spec,inside,outside", [
    (">= 1", [1, 7], [0, -4]), ("> 0", [1e-9, 3.0], [0.0, -1.0, math.nan, math.inf]),
    ("[0, 1)", [0.0, 0.5], [1.0, 2.0, -0.1]), ("(0, 1]", [1.0, 0.3], [0.0, 1.5]),
    ("-1 | >= 0", [-1.0, 0.0, 5.0], [-2.0, -0.5]), ("any", [-3.0, 0.0], [math.nan, -math.inf]),
    ("[-1, 1]", [-1, 0, 1], [2, -2])])
def test_ranges_read_as_written(spec, inside, outside):
  assert all(settings.within(v, spec) for v in inside)
  assert not any(settings.within(v, spec) for v in outside)


@pytest.mark.parametrize("key,value", [
    ("optimizer.learning_rate", math.nan), ("optimizer.learning_rate", math.inf), ("optimizer.learning_rate", -1.0),
    ("batch_size", -4), ("batch_size", 0), ("eval.top_k", -1), ("num_train_steps", -5), ("model.dropout", 2.0),
    ("keep_checkpoints", 0)])
def test_out_of_range_settings_are_refused(key, value):
  config = defaults.get_config()
  section, _, name = key.rpartition(".")
  (config[section] if section else config)[name] = value
  with pytest.raises(ValueError, match=rf"^{key}={value!r} is out of range"):
    settings.check(config)


def test_help_prints_each_range_beside_its_meaning():
  assert "  batch_size = 32  [>= 1]  # " in config_help.describe()


@pytest.mark.slow
def test_train_refuses_a_bad_setting_in_one_line_and_writes_nothing(tmp_path):
  proc = subprocess.run([sys.executable, "-m", "jdr.train", "--config", str(ROOT / "configs" / "demo.py:tiny"),
                         "--workdir", str(tmp_path / "w"), "--config.optimizer.learning_rate=nan"],
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2 and "Traceback" not in proc.stderr
  assert proc.stderr.strip().splitlines()[-1] == "error: optimizer.learning_rate=nan is out of range: > 0 (and finite)"
  assert not (tmp_path / "w").exists()


def test_every_renamed_key_is_gone_and_points_at_keys_that_exist():
  keys = set(config_files.all_keys(defaults.get_config()))
  for old, new in settings.RENAMED.items():
    assert old not in keys, old
    named = re.findall(r"negatives(?:\.\w+)+", new)
    assert named and set(named) <= keys, (old, new)
    assert settings.renamed(old) == f"{old} is now {new}"
  assert settings.renamed("negatives.per_query") is None


def test_an_old_key_is_refused_in_one_line_naming_the_new_one(tmp_path):
  """On the command line, in a recipe (a leaf it adds to the unlocked config, or a string where a group now
  is) and in a config built in code, the old name is refused with the new one."""
  config = defaults.get_config()
  with pytest.raises(config_files.ConfigError, match=r"^negatives\.bm25_top_k is now negatives\.bm25\.top_k$"):
    config_files.apply_overrides(config, ["negatives.bm25_top_k=50"])
  with pytest.raises(config_files.ConfigError, match=r"^negatives\.guide is now negatives\.guide\.model$"):
    config_files.apply_overrides(config, ["negatives.guide=self"])
  for body, old in (("c.negatives.refresh_every = 3", "negatives.refresh_every"),
                    ('c.negatives.mined = "runs/mined"', "negatives.mined")):
    recipe = tmp_path / f"old_{old.split('.')[1]}.py"
    recipe.write_text(f"import base\n\n\ndef get_config(arg=None):\n  c = base.get_config()\n  {body}\n  return c\n")
    (tmp_path / "base.py").write_text((ROOT / "configs" / "base.py").read_text())
    with pytest.raises(config_files.ConfigError) as e:
      config_files.load_config_file(str(recipe))
    assert str(e.value) == f"{recipe}: {settings.renamed(old)}"
  config = defaults.get_config()
  config.negatives.retrieve_every = 0  # a config built in code: caught before anything reads it
  with pytest.raises(ValueError, match=r"^negatives\.retrieve_every is now negatives\.retrieval\.every$"):
    settings.check_renamed(config)
  settings.check_renamed(defaults.get_config())
