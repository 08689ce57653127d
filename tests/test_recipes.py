"""Recipe arguments (`configs/X.py:runlocal,ndcg`): typed, declared by each recipe, and an unknown one is an
error naming the valid ones, never a quiet default. A recipe names its data and starting model, and a missing one
is refused in one line naming the key to set, never replaced by the built-in dataset."""

import ast
import pathlib
import re
import subprocess
import sys

import pytest

from jdr.runtime import config_files

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
  assert load("adore.py:runlocal,static").negatives.retrieval.every == 0
  assert load("adore.py:runlocal,jax").negatives.retrieval.backend == "jax"
  assert load("adore.py:pq").negatives.retrieval.index_factory == "OPQ48,IVF1,PQ48"
  # The typo that used to run MRR LambdaRank without a word.
  with pytest.raises(config_files.ConfigError, match="'ndgc' .did you mean ndcg"):
    load("adore.py:runlocal,ndgc")
  # LTRe is ADORE with RankNet unless LambdaRank is asked for, and LTRe's warm-up at full scale.
  assert load("ltre.py:runlocal").loss.name == "ranknet"
  assert load("ltre.py:runlocal,lambdarank,ndcg").loss.lambda_metric == "ndcg@10"
  assert load("ltre.py:runlocal,lambdarank").loss.name == "lambdarank"
  assert load("ltre.py").optimizer.warmup_steps == 2000
  assert load("adore_star.py:runlocal,jax").negatives.retrieval.backend == "jax"


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


# ---------------------------------------------------------------- full recipes name their inputs

def _takes_runlocal(recipe: str) -> bool:
  try:
    load(f"{recipe}.py:runlocal")
  except config_files.ConfigError as e:
    assert "unknown recipe argument 'runlocal'" in str(e), e
    return False
  return True


FULL = [f"{r}.py" for r in RECIPES if _takes_runlocal(r)] + ["fgd.py:warmup"]  # FGD's two stages
NAMED_INPUT = re.compile(r"(data\.dataset|data\.pretrain_source|model\.init_from)=(\S+): (directory|file) not found; "
                         r"set --config\.\1=(DIR|FILE) \((.+)\)")


def _named_data(config) -> str:
  """The path a config trains on: data.pretrain_source for pretraining from a dump, else data.dataset."""
  if config.data.kind == "pretrain" and config.data.pretrain_source not in ("wikispeedia", "builtin"):
    return config.data.pretrain_source
  return config.data.dataset


def test_every_recipe_but_the_demo_has_a_full_version():
  assert set(FULL) == {f"{r}.py" for r in RECIPES if r != "demo"} | {"fgd.py:warmup"}


@pytest.mark.parametrize("spec", FULL)
def test_every_full_recipe_names_its_model_and_data_and_the_papers_towers(spec):
  """Without runlocal a recipe states the paper's data and starting model (or the run it starts from), never the
  built-in docstrings or the bundled MiniLM, and scores with unnormalized dot products at temperature 1 (the
  seed papers'), or as its own paper says (RepLLaMA's cosines at 0.01)."""
  from jdr.data import shared  # pylint: disable=g-import-not-at-top
  c = load(spec)
  data = _named_data(c)
  assert data not in ("", "builtin", "wikispeedia") and not data.startswith(str(shared.shared_data_dir()))
  assert c.data.description, "the refusal says what the data is"
  if c.model.init_from:
    assert c.model.init_from != "minilm" and c.model.description
  else:  # pretraining: fresh weights of the paper's size
    assert c.model.fresh == "base"
  if spec in COSINE_RECIPES:  # the decoder retrievers' papers score cosines at a temperature of their own
    assert c.model.normalize == 1 and c.loss.temperature == COSINE_RECIPES[spec]
  else:
    assert c.model.normalize in (0, -1) and c.loss.temperature == 1.0


COSINE_RECIPES = {"repllama.py": 0.01}


@pytest.mark.parametrize("spec", FULL)
def test_a_full_recipe_without_its_data_is_refused_in_one_line(spec, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # the recipes' relative paths, read from an empty directory
  c = load(spec)
  with pytest.raises(config_files.ConfigError) as e:
    config_files.check_inputs(c)
  line = str(e.value)
  match = NAMED_INPUT.fullmatch(line)
  assert match, line
  key, value, _, _, what = match.groups()
  assert key.startswith("data.") and value == _named_data(c) and what == c.data.description


def test_the_model_is_checked_once_the_data_is_there(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  c = load("inbatch.py")
  (tmp_path / c.data.dataset).mkdir(parents=True)
  with pytest.raises(config_files.ConfigError) as e:
    config_files.check_inputs(c)
  assert str(e.value).startswith(f"model.init_from={c.model.init_from}: directory not found; set "
                                 f"--config.model.init_from=DIR ({c.model.description})")
  assert "RoBERTa-base" in c.model.description and "\n" not in str(e.value)
  (tmp_path / c.model.init_from).mkdir(parents=True)
  config_files.check_inputs(c)  # both there: what is inside is for the loaders to check
  teacher = load("fgd.py")
  config_files.apply_overrides(teacher, [f"data.dataset={tmp_path}", f"model.init_from={tmp_path}"])
  with pytest.raises(config_files.ConfigError, match=r"^distill\.teacher=runs/msmarco-cross: directory not found; "
                                                    r"set --config\.distill\.teacher=DIR \(a cross-encoder"):
    config_files.check_inputs(teacher)


@pytest.mark.parametrize("spec", [f"{r}.py" for r in RECIPES] + [f"{r}.py:runlocal" for r in RECIPES if r != "demo"])
def test_only_the_demo_trains_on_the_builtin_data(spec):
  c = load(spec)
  uses_builtin = c.data.dataset == "builtin" or (c.data.kind == "pretrain" and c.data.pretrain_source == "builtin")
  assert uses_builtin == (spec == "demo.py")


@pytest.mark.parametrize("spec", ["finetune.py:runlocal", "cross_encoder.py:runlocal", "inbatch.py:runlocal",
                                  "pretrain_ict_bfs_wlp.py:runlocal"])
def test_a_runlocal_recipe_names_the_shared_data_and_refuses_it_missing(spec, tmp_path, monkeypatch):
  """The scaled-down recipes name SciFact (Wikispeedia for pretraining) in the shared data folder; where the
  folder lacks it they stop, where they once fell back to the built-in docstrings."""
  monkeypatch.setenv("JDR_SHARED_DATA", str(tmp_path / "shared"))
  c = load(spec)
  name = "wikispeedia" if c.data.kind == "pretrain" else "scifact"
  assert c.data.dataset == str(tmp_path / "shared" / name)
  with pytest.raises(config_files.ConfigError, match=rf"^data\.dataset={re.escape(c.data.dataset)}: directory not "
                                                    rf"found; set --config\.data\.dataset=DIR \(.*{name}"):
    config_files.check_inputs(c)
  (tmp_path / "shared" / name).mkdir(parents=True)
  c = load(spec)
  if c.model.init_from not in ("", "minilm"):
    (tmp_path / c.model.init_from).mkdir(parents=True)
    config_files.apply_overrides(c, [f"model.init_from={tmp_path / c.model.init_from}"])
  config_files.check_inputs(c)


def test_the_loaders_refuse_a_missing_input_with_the_same_line(tmp_path):
  """pairs.load and models.build, for callers that skip check_inputs, say what check_inputs says."""
  from jdr.data import pairs  # pylint: disable=g-import-not-at-top
  from jdr.models import build  # pylint: disable=g-import-not-at-top
  c = load("inbatch.py")
  config_files.apply_overrides(c, [f"data.dataset={tmp_path / 'missing'}", f"model.init_from={tmp_path / 'none'}"])
  with pytest.raises(config_files.ConfigError) as checked:
    config_files.check_inputs(c)
  with pytest.raises(FileNotFoundError) as loaded:
    pairs.load(c.data, tmp_path / "w")
  assert str(loaded.value) == str(checked.value)
  (tmp_path / "missing").mkdir()
  with pytest.raises(config_files.ConfigError) as checked:
    config_files.check_inputs(c)
  with pytest.raises(FileNotFoundError) as built:
    build.build(c.model, c.data)
  assert str(built.value) == str(checked.value) and str(built.value).startswith("model.init_from=")


def test_the_trainer_refuses_a_missing_dataset_before_it_builds_anything(tmp_path):
  """`python -m jdr.train` on a full recipe whose data is missing: one `error:` line naming the key and what the
  recipe trains on, status 2, no workdir. The starting model is an empty directory, which the model loader would
  refuse with another line: the data's line proves the check came first."""
  not_a_model = tmp_path / "not-a-model"
  not_a_model.mkdir()
  workdir = tmp_path / "w"
  out = subprocess.run([sys.executable, "-m", "jdr.train", "--config", str(ROOT / "configs" / "inbatch.py"),
                        "--workdir", str(workdir), f"--config.data.dataset={tmp_path / 'msmarco'}",
                        f"--config.model.init_from={not_a_model}"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
  description = load("inbatch.py").data.description
  assert out.returncode == 2, out.stderr
  assert out.stderr == (f"error: data.dataset={tmp_path / 'msmarco'}: directory not found; set "
                        f"--config.data.dataset=DIR ({description})\n")
  assert not workdir.exists() and not list(not_a_model.iterdir())


# ---------------------------------------------------------------- the released checkpoints the papers started from

ANCE_WARMUP = "https://webdatamltrainingdiag842.blob.core.windows.net/semistructstore/OpenSource/warmup_checpoint.zip"
DRHARD_STAR = "https://drive.google.com/drive/folders/1bJw8P15cFiV239mTgFQxVilXMWqzqXUU"
# recipe: (the keys that name the checkpoint, its default folder, where it is downloaded, the authors' class)
RELEASED = {
    "ance.py": (("model.init_from",), "models/ance/bm25-warmup", ANCE_WARMUP, "RobertaDot_NLL_LN"),
    "star.py": (("model.init_from",), "models/ance/bm25-warmup", ANCE_WARMUP, "RobertaDot_NLL_LN"),
    "adore.py": (("model.init_from",), "models/drhard/star", DRHARD_STAR, "RobertaDot"),
    "adore_star.py": (("model.init_from", "model.doc_init_from"), "models/drhard/star", DRHARD_STAR, "RobertaDot"),
}


@pytest.mark.parametrize("spec", sorted(RELEASED))
def test_a_full_recipe_starts_from_the_released_checkpoint_and_refuses_it_missing(spec, tmp_path, monkeypatch):
  """ANCE and STAR start from the BM25-negative warm-up ANCE released, ADORE and ADORE+STAR from the STAR model
  DRhard released (both towers for ADORE+STAR). The docstring's table says where it is published, in which format
  and what to pass; with the data there, the recipe refuses to start without it in one line that names the
  download, for each key that names it."""
  keys, path, address, cls = RELEASED[spec]
  doc = ast.get_docstring(ast.parse((ROOT / "configs" / spec).read_text()))
  wanted = [address, f"`{cls}`", "| where it is published |", "| its format |", "| what you pass |"]
  for needed in wanted + [f"--config.{key}={path}" for key in keys]:
    assert needed in doc, f"configs/{spec}'s docstring lacks {needed!r}"
  monkeypatch.chdir(tmp_path)
  c = load(spec)
  assert [c.model.get(key.split(".")[1]) for key in keys] == [path] * len(keys)
  assert address in c.model.description and cls in c.model.description
  (tmp_path / c.data.dataset).mkdir(parents=True)
  for key in keys:
    with pytest.raises(config_files.ConfigError) as e:
      config_files.check_inputs(c)
    assert str(e.value) == (f"{key}={path}: directory not found; set --config.{key}=DIR ({c.model.description})")
    config_files.apply_overrides(c, [f"{key}={tmp_path}"])  # this one there: the next key is checked
  config_files.check_inputs(c)
  runlocal = load(f"{spec}:runlocal")  # the scaled-down run keeps jdr's own chain
  assert runlocal.model.init_from in ("minilm", "runs/star") and not runlocal.model.doc_init_from


def test_the_trainer_refuses_a_missing_released_checkpoint_with_its_address(tmp_path):
  """`python -m jdr.train` on configs/ance.py with the data there but no warm-up: status 2, one `error:` line that
  says where the warm-up is downloaded, no workdir."""
  (tmp_path / "data" / "msmarco-passage").mkdir(parents=True)
  workdir = tmp_path / "w"
  out = subprocess.run([sys.executable, "-m", "jdr.train", "--config", str(ROOT / "configs" / "ance.py"),
                        "--workdir", str(workdir)], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
  assert out.returncode == 2, out.stderr
  assert out.stderr == (f"error: model.init_from=models/ance/bm25-warmup: directory not found; set "
                        f"--config.model.init_from=DIR ({load('ance.py').model.description})\n")
  assert ANCE_WARMUP in out.stderr and not workdir.exists()
