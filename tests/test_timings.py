"""The library's timed parts, which benchmarks read through `timings.window()` instead of patching the library."""

import pathlib
import time

import pytest

from jdr.runtime import timings

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_a_window_reads_each_parts_seconds_and_first_start_within_it():
  @timings.timed("test_part")
  def work(seconds):
    time.sleep(seconds)
    return seconds

  work(0.01)  # before the window: not counted in it
  with timings.window() as w:
    opened = time.perf_counter()
    assert work(0.02) == 0.02
    work(0.01)
  assert 0.03 <= w.seconds["test_part"] < 0.5 and w.seconds["other"] == 0
  assert w.first_start["test_part"] >= opened


def test_the_parts_the_scale_bench_reads_are_timed_where_they_are_defined():
  from jdr.data import prepared  # pylint: disable=g-import-not-at-top
  from jdr.retrieval import tower_encoder  # pylint: disable=g-import-not-at-top
  from jdr.evaluation import periodic  # pylint: disable=g-import-not-at-top
  from jdr.retrieval import bm25  # pylint: disable=g-import-not-at-top
  parts = {prepared.Indexer.run: "prepare_index", prepared.Tokenizer.run: "prepare_tokens",
           bm25.corpus_index: "bm25_index", bm25.mine: "bm25_mine", periodic.Evaluator.__call__: "evaluate",
           tower_encoder.TowerEncoder.corpus: "encode_corpus", periodic.TrainingDiagnostics.__call__: "diagnostics"}
  for fn in parts:
    assert fn.__wrapped__, fn  # functools.wraps of timings.timed
  scale = (ROOT / "jdr" / "bench" / "scale.py").read_text()
  assert all(f'"{name}"' in scale for name in parts.values())


def test_no_benchmark_replaces_a_library_attribute():
  for path in sorted((ROOT / "jdr" / "bench").glob("*.py")):
    assert "setattr(" not in path.read_text(), path.name


def test_benchmark_turns_run_each_side_in_turns_and_time_only_the_numbered_steps(monkeypatch):
  """`jdr.bench.turns`: one warm-up each, then per turn every runner's untimed opening step and its share of
  the numbered steps; the medians are of the timed steps alone, read from a clock the runners advance."""
  from jdr.bench import turns  # pylint: disable=g-import-not-at-top
  clock = {"now": 0.0}
  monkeypatch.setattr(turns.time, "perf_counter", lambda: clock["now"])
  calls = []

  def runner(name, seconds):
    def run(s):
      calls.append((name, s))
      clock["now"] += 100.0 if s == 0 else seconds[s - 1]
    return run

  got = turns.median_seconds({"a": runner("a", [1, 2, 9, 4, 5]), "b": runner("b", [3, 3, 3, 7, 7])}, 5, turns=3)
  assert got == {"a": 4.0, "b": 3.0}
  assert calls == [("a", 0), ("b", 0),
                   ("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1), ("b", 2),
                   ("a", 0), ("a", 3), ("a", 4), ("b", 0), ("b", 3), ("b", 4),
                   ("a", 0), ("a", 5), ("b", 0), ("b", 5)]
  with pytest.raises(ValueError, match="at least one step"):
    turns.median_seconds({"a": runner("a", [])}, 0)
