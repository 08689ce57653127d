"""README.md's commands, run: every command of its ```bash blocks, in order, from an empty directory.

Each runs as `python -m jdr.X` would (conftest.run_module: its main() with sys.argv set, in this process: one
import of jax for all of them), scaled down:
SciFact becomes a tiny generated BEIR dataset, `minilm` a tiny random BERT, and every training run takes 2
steps of a tiny batch and evaluates nothing (evaluation during training has tests of its own). The rest of
each command (its recipe, its paths, which run feeds which) is the README's, so a command that needs a file no
earlier command wrote fails here. The commands that are not run are listed in SKIPPED with the reason; a README
command that is neither run nor listed fails the test.
"""

import json
import math
import pathlib
import re
import shlex
import time

import jax
import jax.numpy as jnp
import pytest
import transformers

from conftest import run_module, write_tiny_beir

ROOT = pathlib.Path(__file__).resolve().parents[1]

SKIPPED = {
    "pip install": "installs jdr; the environment running the tests has it",
    "python -m pytest": "the test suite itself",
    "XLA_FLAGS=": "8 simulated devices need a process of their own; tests/test_sizing.py compiles that step",
    "python -m jdr.bench": "benchmarks time real models at real sizes; tests/test_bench_smoke.py runs each small",
    "python -m jdr.training.gradcache": "a search over batch sizes by compiling each; tests/test_gradcache.py covers it",
    "python -m jdr.reproduce": "the whole table trains for hours; tests/test_reproduce.py runs it end to end with --tiny",
}

# Every training run: 2 steps of 4 queries, short texts, small candidate pools, no evaluation split.
TRAIN = ["num_train_steps=2", "batch_size=4", "log_every=1", "checkpoint_every=2", "data.query_max_length=16",
         "data.doc_max_length=32", "data.eval_split=", "negatives.dense_static.top_n=8",
         "negatives.ance.top_n=8", "negatives.retrieval.top_n=8", "negatives.bm25.top_k=8", "eval.diagnostic_queries=4"]


def commands(readme: str) -> list[list[str]]:
  """The commands of the ```bash blocks, in order: continuation lines joined, comments dropped."""
  out = []
  for block in re.findall(r"```bash\n(.*?)```", readme, flags=re.S):
    for line in block.replace("\\\n", " ").splitlines():
      words = shlex.split(line, comments=True)
      while words:  # `A && B` is two commands
        first = words.index("&&") if "&&" in words else len(words)
        out.append(words[:first])
        words = words[first + 1:]
  return out


def skip_reason(words: list[str]) -> str | None:
  line = " ".join(words)
  return next((why for prefix, why in SKIPPED.items() if line.startswith(prefix)), None)


def scaled(words: list[str], data: pathlib.Path, tiny_model: pathlib.Path) -> list[str]:
  """The command on tiny data and a tiny model, and for training, 2 tiny steps."""
  words = [w.replace("../shared/data/scifact", str(data)) for w in words]
  words = [str(tiny_model) if w == "minilm" and i and words[i - 1] == "--model" else w for i, w in enumerate(words)]
  module = words[2]
  if module == "jdr.train":
    config = words[words.index("--config") + 1]
    overrides = list(TRAIN)
    if "pretrain_" in config:
      overrides.append("model.fresh=tiny")  # pretraining starts from fresh weights
    elif not any("model.init_from=" in w for w in words):
      overrides.append(f"model.init_from={tiny_model}")
    words += [f"--config.{o}" for o in overrides]
  if module == "jdr.demo":
    words += ["--model", str(tiny_model)]
  return words


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
  """A random 2-layer BERT as a Hugging Face directory with the MiniLM tokenizer, in place of MiniLM."""
  from jdr.models import hf  # pylint: disable=g-import-not-at-top
  from jdr.models.bert import Encoder, EncoderConfig  # pylint: disable=g-import-not-at-top
  path = tmp_path_factory.mktemp("tiny-bert")
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(hf.minilm_path()))
  cfg = EncoderConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_layers=2, num_heads=2,
                      intermediate_size=64)
  params = Encoder(cfg).init(jax.random.PRNGKey(0), jnp.ones((1, 8), jnp.int32), jnp.ones((1, 8), jnp.int32))
  hf.export_hf(cfg, jax.device_get(params["params"]), path, tokenizer=tokenizer)
  return path


def test_readme_lists_its_commands_and_skips_only_known_ones():
  found = commands((ROOT / "README.md").read_text())
  assert any(w[:3] == ["python", "-m", "jdr.train"] for w in found)
  for words in found:
    assert skip_reason(words) or words[:2] == ["python", "-m"], f"neither run nor skipped: {shlex.join(words)}"


@pytest.mark.long
def test_readme_commands_run_in_order_from_an_empty_directory(tmp_path, monkeypatch, tiny_model):
  data = write_tiny_beir(tmp_path / "data")
  work = tmp_path / "checkout"
  work.mkdir()
  (work / "configs").symlink_to(ROOT / "configs")  # what a checkout has besides runs/
  monkeypatch.chdir(work)
  ran = []
  for words in commands((ROOT / "README.md").read_text()):
    if skip_reason(words):
      continue
    words = scaled(words, data, tiny_model)
    start = time.perf_counter()
    done = run_module(words[2], words[3:])  # what `python -m` runs, in this process
    assert done.returncode == 0, f"{shlex.join(words)} exited {done.returncode}:\n{done.stderr[-3000:]}"
    ran.append((words[2], time.perf_counter() - start))
    if words[2] == "jdr.train":  # each recipe trained its 2 steps to finite losses
      log = pathlib.Path(words[words.index("--workdir") + 1]) / "metrics.jsonl"
      losses = [r["train/loss"] for r in map(json.loads, log.read_text().splitlines()) if "train/loss" in r]
      assert len(losses) == 2 and all(math.isfinite(x) for x in losses), (shlex.join(words), losses)
  print("\n".join(f"{seconds:6.1f} s  {name}" for name, seconds in ran))
  ran = [name for name, _ in ran]
  assert ran.count("jdr.train") >= 9 and {"jdr.encode", "jdr.retrieve", "jdr.evaluate", "jdr.export",
                                          "jdr.rerank", "jdr.demo"} <= set(ran)
  assert (work / "runs" / "scifact-reranked.trec").exists() and (work / "runs" / "bm25-export" / "config.json").exists()
