"""Recipe arguments (`configs/X.py:runlocal,ndcg`): typed, declared by each recipe, and an unknown one is an
error naming the valid ones, never a quiet default."""

import pathlib
import subprocess
import sys

import pytest

from jdr import config_files

ROOT = pathlib.Path(__file__).resolve().parents[1]
RECIPES = sorted(p.stem for p in (ROOT / "configs").glob("*.py") if p.stem != "base")


def load(spec: str):
  return config_files.load_config_file(str(ROOT / "configs" / spec))


def test_parse_arg_types_values_by_their_defaults():
  a = config_files.parse_arg("runlocal,seed=3,metric=ndcg,rate=0.5", runlocal=False, seed=0, metric="mrr",
                             rate=1.0, pq=False)
  assert (a.runlocal, a.seed, a.metric, a.rate, a.pq) == (True, 3, "ndcg", 0.5, False)
  assert isinstance(a.seed, int) and isinstance(a.rate, float)
  assert config_files.parse_arg(None, runlocal=False).runlocal is False
  assert config_files.parse_arg("runlocal=false", runlocal=True).runlocal is False
  assert config_files.parse_arg(" runlocal , ", runlocal=False).runlocal is True  # spaces, a trailing comma


def test_parse_arg_refuses_what_the_recipe_does_not_take():
  with pytest.raises(config_files.ConfigError,
                     match=r"unknown recipe argument 'ndgc' \(did you mean ndcg\?\); this recipe takes "
                           r"runlocal \(bool, default False\), ndcg \(bool, default False\)"):
    config_files.parse_arg("runlocal,ndgc", runlocal=False, ndcg=False)
  with pytest.raises(config_files.ConfigError, match=r"recipe argument 'seed' needs a value \(seed=\.\.\.\)"):
    config_files.parse_arg("seed", seed=0)
  with pytest.raises(config_files.ConfigError, match=r"recipe argument 'seed': cannot use 'one'"):
    config_files.parse_arg("seed=one", seed=0)
  with pytest.raises(config_files.ConfigError, match="this recipe takes no arguments"):
    config_files.parse_arg("runlocal")


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_declares_its_arguments_and_refuses_others(recipe):
  module = load(f"{recipe}.py")  # the default: no argument
  assert module.is_locked
  with pytest.raises(config_files.ConfigError, match=rf"configs/{recipe}\.py: unknown recipe argument 'bogus'"):
    load(f"{recipe}.py:bogus")
  if recipe != "demo":
    scaled = load(f"{recipe}.py:runlocal")
    assert scaled.to_dict() != module.to_dict()


def test_adore_arguments_each_change_what_they_name():
  plain = load("adore.py:runlocal")
  assert (plain.loss.name, plain.loss.lambda_metric) == ("lambdarank", "mrr@10")
  assert load("adore.py:runlocal,ndcg").loss.lambda_metric == "ndcg@10"
  assert load("adore.py:runlocal,ranknet").loss.name == "ranknet"
  assert load("adore.py:runlocal,static").negatives.retrieve_every == 0
  assert load("adore.py:runlocal,jax").negatives.retrieval_backend == "jax"
  assert load("adore.py:pq").negatives.index_factory == "OPQ48,IVF1,PQ48"
  # The typo that used to run MRR LambdaRank without a word.
  with pytest.raises(config_files.ConfigError, match="'ndgc' .did you mean ndcg"):
    load("adore.py:runlocal,ndgc")
  # LTRe is ADORE with RankNet unless LambdaRank is asked for, and LTRe's warm-up at full scale.
  assert load("ltre.py:runlocal").loss.name == "ranknet"
  assert load("ltre.py:runlocal,lambdarank,ndcg").loss.lambda_metric == "ndcg@10"
  assert load("ltre.py:runlocal,lambdarank").loss.name == "lambdarank"
  assert load("ltre.py").optimizer.warmup_steps == 2000
  assert load("adore_star.py:runlocal,jax").negatives.retrieval_backend == "jax"


def test_demo_takes_tiny_only():
  assert load("demo.py:tiny").model.fresh == "tiny"
  with pytest.raises(config_files.ConfigError, match="unknown recipe argument 'runlocal'.*tiny"):
    load("demo.py:tiny,runlocal")


def test_the_trainer_reports_a_bad_recipe_argument_in_one_line():
  out = subprocess.run([sys.executable, "-m", "jdr.train", "--config", str(ROOT / "configs" / "adore.py:ndgc"),
                        "--workdir", "unused"], capture_output=True, text=True, timeout=300,
                       env={"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
  assert out.returncode == 2
  assert out.stderr.startswith("error: ") and "unknown recipe argument 'ndgc'" in out.stderr
  assert "Traceback" not in out.stderr
