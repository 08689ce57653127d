"""python -m jdr.bench plan: the hours of each stage of a full recipe, from its settings and measured rates,
checked against the arithmetic done by hand from the recipes' docstring tables."""

import json
import pathlib
import subprocess
import sys

import pytest

from conftest import cpu_devices_env
from jdr.bench import plan

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"


def _stages(spec):
  return plan.stages(plan.recipe_config(spec, CONFIGS))


def _one(stages, name, what_starts=""):
  (found,) = [s for s in stages if s.name == name and s.what.startswith(what_starts)]
  return found


def test_train_hours_follow_the_recipe_steps_and_tokens():
  # STAR's table: 50,000 steps of 256 queries (24 tokens), each with its positive and one hard negative (120).
  star = _one(_stages("star"), "train")
  tokens = 256 * 24 + 256 * 2 * 120
  assert star.seconds == pytest.approx(50_000 * 0.0834 * tokens / (128 * 32 + 128 * 256))
  assert star.bound == "device" and star.on_host_of(8) == pytest.approx(star.seconds / 8)
  # The in-batch baseline's step holds exactly the measured step's 36,864 tokens.
  assert _one(_stages("inbatch"), "train").seconds == pytest.approx(20_000 * 0.0834)


def test_ance_refreshes_once_at_the_start_and_every_m_steps():
  mine = _one(_stages("ance"), "mine")
  # 600,000 steps, a refresh every 10,000, each in force 10,000 steps after its snapshot: the start's mining and
  # the 58 refreshes in force before the end (the one snapshotted at step 590,000 would be in force at 600,000).
  assert mine.what.startswith("59 x top-200")
  docs, queries = 8_841_823, 502_939
  one = docs / 6_722 + queries * 64 / (6_722 * 1_242_251 / 5_183) + -(-queries // 32) * 0.00468
  assert mine.seconds == pytest.approx(59 * one)


def test_host_bound_stages_do_not_shrink_with_gpus_and_unmeasured_ones_say_so():
  adore = _stages("adore")
  train = _one(adore, "train")
  assert train.bound == "host" and train.on_host_of(8) == train.seconds  # Faiss on the host's CPU
  assert train.seconds == pytest.approx(60_000 * (0.769 * 8.841823 + 0.00904))
  assert _one(_stages("adore:jax"), "train").bound == "device"
  # BM25 on MS MARCO passage, from the 8.84M-passage scale run: the index, then 502,939 queries at its rate.
  bm25 = _one(_stages("bm25_neg"), "mine")
  assert bm25.bound == "host" and bm25.on_host_of(8) == bm25.seconds
  assert bm25.seconds == pytest.approx(722.5 + 502_939 / (502_939 / 971.0))
  # Its evaluation's BM25 candidates reuse the negatives' index: only the dev queries are mined.
  assert _one(_stages("bm25_neg"), "evaluate", "BM25").seconds == pytest.approx(6_980 / (502_939 / 971.0))
  assert _one(_stages("star"), "evaluate", "BM25").seconds == pytest.approx(722.5 + 6_980 / (502_939 / 971.0))
  # MS MARCO documents' BM25 was never measured: said, not guessed.
  fgd_bm25 = _one(_stages("fgd"), "evaluate", "BM25")
  assert fgd_bm25.seconds is None and fgd_bm25.on_host_of(8) is None
  table, _ = plan.hours_table({"fgd": plan.recipe_config("fgd", CONFIGS)})
  assert "+ 1 not measured" in table.splitlines()[-1]


def test_fgd_scores_every_pool_document_and_its_pieces_with_the_teacher():
  fgd = _stages("fgd")
  teacher = _one(fgd, "mine", "teacher")
  # MS MARCO document's 367,013 training queries x (positive + top 100); a pair of the document at 512
  # positions, 4 passage pieces of 32 + 128 and 8 sentence pieces of 32 + 64 tokens.
  tokens = 367_013 * 101 * (512 + 4 * 160 + 8 * 96)
  assert teacher.seconds == pytest.approx(tokens / (6_722 * 1_242_251 / 5_183))
  assert not any(s.what.startswith("teacher") for s in _stages("fgd:warmup"))


@pytest.mark.slow
def test_the_plan_compiles_a_recipe_with_its_corpus():
  env = cpu_devices_env(8, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  out = subprocess.run([sys.executable, "-m", "jdr.bench.plan", "--recipes", "adore:jax", "--topology", "cpu",
                        "--fresh", "tiny", "--corpus-rows", "100000"], env=env,
                       capture_output=True, text=True, timeout=600, check=True)
  result = json.loads(out.stdout.strip().splitlines()[-1])
  (compiled,) = result["compiled"]
  sizes = compiled["sizes"]
  assert compiled["recipe"] == "adore:jax" and sizes["devices"] == 8 and sizes["corpus_rows"] == 100_000
  assert sizes["retrieval"] == "in_step" and sizes["corpus_bytes_per_device"] > 0
  assert "| `adore:jax` | 32, 64 / 256 |" in out.stderr
