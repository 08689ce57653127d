"""The `python -m jdr.evaluate` command line, on tiny generated files."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from conftest import cpu_devices_env
from jdr.evaluation import metrics

ROOT = pathlib.Path(__file__).resolve().parents[1]

QRELS = {"q1": {"d1": 1, "d3": 2}, "q2": {"d2": 1}, "q3": {"d9": 1}, "q4": {"d1": 0}}
RUN = {
    "q1": {"d3": 0.9, "d2": 0.8, "d1": 0.7},
    "q2": {"d1": 0.5, "d4": 0.5, "d2": 0.1},  # d4 ranks above d1 on the tie (docid descending).
    "q4": {"d1": 1.0},  # no relevant document: skipped
    "q5": {"d1": 1.0},  # not in qrels: ignored
}


def _write_beir_qrels(path):
  lines = ["query-id\tcorpus-id\tscore"]
  lines += [f"{q}\t{d}\t{r}" for q, docs in QRELS.items() for d, r in docs.items()]
  path.write_text("\n".join(lines) + "\n")


def _write_trec_qrels(path):
  path.write_text("".join(f"{q} 0 {d} {r}\n" for q, docs in QRELS.items() for d, r in docs.items()))


def _write_run(path):
  lines = []
  for q, docs in RUN.items():
    ranked = sorted(docs.items(), key=lambda kv: (kv[1], kv[0]), reverse=True)
    lines += [f"{q} Q0 {d} {i} {s} test" for i, (d, s) in enumerate(ranked, 1)]
  path.write_text("\n".join(lines) + "\n")


def _cli(*args):
  env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
  return subprocess.run([sys.executable, "-m", "jdr.evaluate", *map(str, args)], capture_output=True,
                        text=True, env=env, cwd=ROOT, timeout=120)


@pytest.fixture
def files(tmp_path):
  _write_beir_qrels(tmp_path / "qrels.tsv")
  _write_trec_qrels(tmp_path / "qrels.trec")
  _write_run(tmp_path / "run.trec")
  return tmp_path


@pytest.mark.parametrize("qrels_name", ["qrels.tsv", "qrels.trec"])
def test_json_output(files, qrels_name):
  names = "ndcg@10,mrr@10,recall@100,map,precision@2,pairwise_errors"
  result = _cli("--qrels", files / qrels_name, "--run", files / "run.trec", "--metrics", names, "--json")
  assert result.returncode == 0, result.stderr
  got = json.loads(result.stdout)
  assert list(got) == names.split(",")
  assert got == pytest.approx(metrics.evaluate(QRELS, RUN, names.split(",")))
  # q1: relevant at ranks 1 and 3; q2: d4, d1, d2 -> relevant at rank 3.
  assert got["mrr@10"] == pytest.approx((1 + 1 / 3) / 2)
  assert got["pairwise_errors"] == pytest.approx((1 + 2) / 2)
  assert "2 queries evaluated" in result.stderr
  assert "1 judged queries absent from the run (skipped)" in result.stderr
  assert "1 run queries not in qrels ignored" in result.stderr


def test_table_output_and_missing_zero(files, tmp_path):
  per_query = tmp_path / "per_query.json"
  result = _cli("--qrels", files / "qrels.tsv", "--run", files / "run.trec", "--missing", "zero",
                "--metrics", "mrr@10", "--per-query", per_query)
  assert result.returncode == 0, result.stderr
  lines = result.stdout.splitlines()
  assert lines[0].split() == ["metric", "value"]
  assert lines[2].split() == ["mrr@10", f"{(1 + 1 / 3) / 3:.4f}"]
  assert "(3 queries)" in result.stdout
  assert json.loads(per_query.read_text()) == {"q1": {"mrr@10": 1.0}, "q2": {"mrr@10": 1 / 3},
                                               "q3": {"mrr@10": 0.0}}


def test_default_metrics(files):
  result = _cli("--qrels", files / "qrels.tsv", "--run", files / "run.trec", "--json")
  assert result.returncode == 0, result.stderr
  assert list(json.loads(result.stdout)) == ["ndcg@10", "mrr@10", "recall@100", "map"]


@pytest.mark.slow
def test_errors(files, tmp_path):
  result = _cli("--qrels", files / "qrels.tsv", "--run", files / "run.trec", "--metrics", "ndcg10")
  assert result.returncode == 2 and "valid metrics" in result.stderr
  bad = tmp_path / "bad.trec"
  bad.write_text("q1 Q0 d1 1 0.5 t\nq1 Q0 d2 2\n")
  result = _cli("--qrels", files / "qrels.tsv", "--run", bad)
  assert result.returncode != 0 and f"{bad}:2" in result.stderr
  other = tmp_path / "other.trec"
  other.write_text("zz Q0 d1 1 0.5 t\n")
  result = _cli("--qrels", files / "qrels.tsv", "--run", other)
  assert result.returncode != 0 and "no query to evaluate" in result.stderr


_ROWS_ON_MESH = """
import sys
import jax
import numpy as np
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, sys.argv[2])
from conftest import write_tiny_beir
from jdr.training import trainer
from jdr.runtime import config_files
from jdr.runtime import defaults
from jdr.retrieval import tower_encoder
from jdr.evaluation import periodic
from jdr.training import optimizers
from jdr.runtime import parallel
from jdr.training import step
from jdr.data import pairs
from jdr.models import build

assert jax.device_count() == 8
config = defaults.get_config()
config_files.apply_overrides(config, ["model.init_from=", "model.fresh=tiny", "model.pooling=mean",
                                      f"data.dataset={write_tiny_beir(sys.argv[3])}"])
built = build.build(config.model, config.data)
data = pairs.load(config.data, sys.argv[3])
params = trainer.initial_params(built.model, built, config, jax.random.PRNGKey(0), None)
kwargs = dict(query_max_length=16, doc_max_length=32, tokens_per_batch=96)  # 3-row batches: padded to 8
alone = tower_encoder.TowerEncoder(built.model, built.tokenizer, data, **kwargs)
reference = alone.corpus(params), alone.queries(params, sorted(data.queries)[:5])
for shape, rules in (((8, 1, 1), "dp"), ((2, 4, 1), "fsdp")):
  mesh = parallel.make_mesh(shape)
  config.mesh.rules = rules
  tx = optimizers.make_optimizer(config.optimizer, config.num_train_steps)
  _, shardings = step.abstract_train_state(built.model, tx, config, mesh, parallel.rules_for(rules))
  sharded = jax.device_put(params, shardings.params)
  encoder = tower_encoder.TowerEncoder(built.model, built.tokenizer, data, mesh=mesh, **kwargs)
  got = encoder.corpus(sharded), encoder.queries(sharded, sorted(data.queries)[:5])
  for a, b in zip(got, reference):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
print("rows on mesh ok")
"""


@pytest.mark.slow
def test_evaluation_encoding_split_over_8_devices_equals_one(tmp_path):
  """The trainer's corpus and query encoding with rows split over a mesh of 8 simulated CPU devices (data
  parallel, and fully sharded parameters) gives the single-device vectors; 3-row batches exercise padding."""
  env = cpu_devices_env(8, JAX_PLATFORMS="cpu")
  result = subprocess.run([sys.executable, "-c", _ROWS_ON_MESH, str(ROOT), str(ROOT / "tests"), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stdout + result.stderr[-3000:]
  assert "rows on mesh ok" in result.stdout
