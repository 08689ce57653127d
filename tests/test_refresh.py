"""ANCE's asynchronous refresh with a fake miner: the schedule, exact resume, failures, waiting and lateness.

The fake miner's pools (an int32 array, as ANCE's rows) hold the generation and the params value it was given,
so a test can tell which snapshot produced the negatives in force; `view` reads them back as names. Params at step s are a function of s (a stand-in for training).
"""

import shutil
import sys
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest

from jdr.negatives.refresh import AsyncRefresher, activation_step, generation_at, load_snapshot, save_snapshot


def params_at(step):
  return {"w": jnp.full((3,), float(step)), "layers": [jnp.arange(2, dtype=jnp.bfloat16) * step]}


def fake_mine(sleep=0.0, fail=(), die=(), block=None):
  """A miner whose pools encode (generation, params); it sleeps, raises, kills its thread or blocks on demand."""
  calls = []

  def mine(params, generation):
    calls.append(generation)
    assert isinstance(params["w"], np.ndarray), "the miner gets a host copy"
    if block is not None and generation in block:
      started, release = block[generation]
      started.set()
      release.wait(5)
    if generation in die:
      raise SystemExit("worker killed")
    if generation in fail:
      raise RuntimeError(f"boom in generation {generation}")
    time.sleep(sleep)
    w, b = float(params["w"][0]), float(params["layers"][0][1])
    return np.array([[generation, w], [b, -1]], np.int32)

  mine.calls = calls
  return mine


def view(pools):
  """The fake pools array as names: {"q1": ["gen<k>", "w<step>"], "q2": ["b<step>"]}."""
  pools = np.asarray(pools)
  return {"q1": [f"gen{pools[0, 0]}", f"w{pools[0, 1]}"], "q2": [f"b{pools[1, 0]}"]}


def snapshot_of(pools):
  """The step whose params mined these pools."""
  return int(float(pools["q1"][1][1:]))


def run(refresher, steps, staleness=None):
  """The trainer's view: prepare before each step, then read the pools in force (and their staleness)."""
  seen = {}
  for s in steps:
    refresher.prepare(s, params_at(s))
    seen[s] = view(refresher.pools(s))
    stale = refresher.staleness(s)
    assert stale == s - snapshot_of(seen[s])
    if staleness is not None:
      staleness[s] = stale
  return seen


def wait_for_mines(refresher, mines):
  """Until `mines` generations have been mined: a count, however long the machine takes."""
  deadline = time.monotonic() + 60
  while refresher.stats()["mines"] < mines:
    assert time.monotonic() < deadline, f"{mines} mines not done in 60 s: {refresher.stats()}"
    time.sleep(0.002)


@pytest.mark.parametrize("every,delay", [(5, 2), (5, 0), (5, 5), (3, 7), (1, 0), (4, 1)])
def test_schedule(tmp_path, every, delay):
  lines = []
  miner = fake_mine()
  r = AsyncRefresher(miner, every=every, delay=delay, directory=tmp_path, log=lines.append)
  staleness = {}
  seen = run(r, range(20), staleness=staleness)
  r.close()
  for s, pools in seen.items():
    k = max(0, (s - delay) // every)
    assert generation_at(s, every, delay) == k
    assert pools["q1"][0] == f"gen{k}"
    assert snapshot_of(pools) == k * every, "generation k comes from the params at step k*every"
    assert staleness[s] == s - k * every
  assert activation_step(2, every, delay) == 2 * every + delay
  # Each generation logs one line when it comes into force, with its staleness.
  k_last = generation_at(19, every, delay)
  assert sum("in force from step" in line for line in lines) == k_last + 1
  assert f"generation {k_last} (snapshot step {k_last * every}, mined in" in [
      line for line in lines if "in force" in line][-1]
  assert r.stats()["generation"] == k_last and r.stats()["failed"] == 0
  # The two newest finished generations are on disk, as arrays beside their metadata, their snapshots
  # deleted; every older one was removed with a line saying so. Ones close() dropped from the queue (possible
  # when delay > every) stay as a snapshot, for a resume to re-mine.
  gens = {int(p.stem.split("-")[1]) for p in tmp_path.glob("gen-*.json")}
  assert gens == {int(p.stem.split("-")[1]) for p in tmp_path.glob("gen-*.npy")}
  finished = sorted(set(miner.calls))
  assert finished[:k_last + 1] == list(range(k_last + 1))
  assert set(finished[-2:]) | {k_last} <= gens
  if delay < every:  # else generations mined ahead of the one in force are kept until it is superseded
    assert gens == set(finished[-2:])
  elif delay == every:  # a snapshot step is also a switch step, and prepare() queues the mine before it switches:
    # a fast last mine can find the generation before it still in force, keep it, and nothing removes it later
    assert set(finished[-2:]) <= gens <= set(finished[-3:])
  removed = [line for line in lines if line.startswith("refresh: removed generation")]
  assert sorted(int(line.split()[3]) for line in removed) == sorted(set(finished) - gens)
  snapshots = {int(p.stem.split("-")[1]) // every for p in tmp_path.glob("snapshot-*.npz")}
  assert set(finished) | snapshots == set(range(19 // every + 1)) and not set(finished) & snapshots


def test_validates_schedule(tmp_path):
  with pytest.raises(ValueError, match="every"):
    AsyncRefresher(fake_mine(), every=0, delay=0, directory=tmp_path)
  with pytest.raises(ValueError, match="delay"):
    AsyncRefresher(fake_mine(), every=5, delay=-1, directory=tmp_path)
  AsyncRefresher(fake_mine(), every=5, delay=2, directory=tmp_path).close()
  with pytest.raises(ValueError, match="schedule"):
    AsyncRefresher(fake_mine(), every=4, delay=2, directory=tmp_path)


def test_snapshot_roundtrip_keeps_bfloat16(tmp_path):
  p = params_at(7)
  save_snapshot(tmp_path / "s.npz", p)
  back = load_snapshot(tmp_path / "s.npz", p)
  assert back["layers"][0].dtype == jnp.bfloat16
  np.testing.assert_array_equal(back["layers"][0], np.asarray(p["layers"][0]))
  np.testing.assert_array_equal(back["w"], np.asarray(p["w"]))


def test_initial_params_mines_generation_zero_up_front(tmp_path):
  r = AsyncRefresher(fake_mine(), every=5, delay=2, directory=tmp_path, log=lambda _: None,
                     initial_params=params_at(0))
  assert view(r.pools(0))["q1"] == ["gen0", "w0"]
  r.prepare(0, params_at(0))
  assert r.stats()["mines"] == 1, "prepare(0) does not mine generation 0 again"
  r.close()


def test_a_generation_past_the_last_step_is_not_mined_and_a_longer_resume_mines_it_as_a_longer_run(tmp_path):
  # every 5, delay 2: generation 2 is snapshotted at step 10 and in force from 12, so a 12-step run never uses it.
  longer = AsyncRefresher(fake_mine(), every=5, delay=2, directory=tmp_path / "whole", log=lambda _: None,
                          last_step=25)
  expected = run(longer, range(25))
  longer.close()

  lines, miner = [], fake_mine()
  short = AsyncRefresher(miner, every=5, delay=2, directory=tmp_path / "cut", log=lines.append, last_step=12)
  got = run(short, range(12))
  short.close()
  assert miner.calls == [0, 1], "generation 2 would first be used at step 12, after the run's last step"
  assert (tmp_path / "cut" / "snapshot-00000010.npz").exists() and not (tmp_path / "cut" / "gen-000002.json").exists()
  assert any("generation 2 would come in force at step 12" in line and "not mined" in line for line in lines)

  again = fake_mine()  # the same run resumed at its last step mines nothing
  same = AsyncRefresher(again, every=5, delay=2, directory=tmp_path / "cut", log=lambda _: None, last_step=12)
  assert run(same, [11]) == {11: expected[11]}
  same.close()
  assert again.calls == []

  resumed_miner = fake_mine()  # trained on to 25 steps: generation 2 comes from the step-10 snapshot
  resumed = AsyncRefresher(resumed_miner, every=5, delay=2, directory=tmp_path / "cut", log=lambda _: None,
                           last_step=25)
  got.update(run(resumed, range(12, 25)))
  resumed.close()
  assert got == expected
  assert resumed_miner.calls[0] == 2


def test_resume_gives_the_same_pools(tmp_path):
  whole = AsyncRefresher(fake_mine(0.005), every=5, delay=2, directory=tmp_path / "whole", log=lambda _: None)
  expected = run(whole, range(25))
  whole.close()

  first = AsyncRefresher(fake_mine(0.005), every=5, delay=2, directory=tmp_path / "cut", log=lambda _: None)
  got = run(first, range(13))
  first.close()
  lines = []
  second = AsyncRefresher(fake_mine(0.005), every=5, delay=2, directory=tmp_path / "cut", log=lines.append)
  got.update(run(second, range(13, 25)))
  second.close()
  assert got == expected
  assert "restored from disk" in lines[0] and "generation 2" in lines[0]


@pytest.mark.parametrize("every,delay", [(5, 2), (3, 0), (4, 7)])
def test_inline_mines_on_the_callers_thread_with_the_same_pools(tmp_path, every, delay):
  """inline=True (the trainer's choice on several hosts): every mine runs on the thread that calls prepare, at
  its snapshot step, and the pools in force at every step equal the worker thread's; a failure still keeps
  the previous generation."""
  threaded = AsyncRefresher(fake_mine(0.002), every=every, delay=delay, directory=tmp_path / "t", log=lambda _: None)
  expected = run(threaded, range(23))
  threaded.close()
  threads = []
  miner = fake_mine(fail={2})

  def mine(params, generation):
    threads.append(threading.current_thread())
    return miner(params, generation)

  lines = []
  inline = AsyncRefresher(mine, every=every, delay=delay, directory=tmp_path / "i", log=lines.append, inline=True)
  got = {}
  for s in range(23):
    inline.prepare(s, params_at(s))
    assert sorted(miner.calls) == list(range(s // every + 1))  # mined at its snapshot step, not later
    got[s] = view(inline.pools(s))
  inline.close()
  assert set(threads) == {threading.current_thread()}
  failed_from = activation_step(2, every, delay)
  assert {s: p for s, p in got.items() if generation_at(s, every, delay) != 2} == {
      s: p for s, p in expected.items() if generation_at(s, every, delay) != 2}
  assert all(got[s] == got[failed_from - 1] for s in range(failed_from, 23) if generation_at(s, every, delay) == 2)
  assert any("generation 2" in l and "failed" in l for l in lines)


def test_resume_while_a_mine_was_in_flight(tmp_path):
  whole = AsyncRefresher(fake_mine(), every=5, delay=2, directory=tmp_path / "whole", log=lambda _: None)
  expected = run(whole, range(25))
  whole.close()

  started, release = threading.Event(), threading.Event()
  first = AsyncRefresher(fake_mine(block={2: (started, release)}), every=5, delay=2, directory=tmp_path / "run",
                         log=lambda _: None)
  got = run(first, range(12))  # generation 2 is due at step 12
  assert started.wait(5)
  # The disk as a kill at this moment would leave it.
  shutil.copytree(tmp_path / "run", tmp_path / "killed")
  release.set()
  first.close()
  assert (tmp_path / "killed" / "snapshot-00000010.npz").exists()
  assert not (tmp_path / "killed" / "gen-000002.json").exists()

  shutil.copytree(tmp_path / "killed", tmp_path / "killed-too")
  lines = []
  mine = fake_mine()
  second = AsyncRefresher(mine, every=5, delay=2, directory=tmp_path / "killed", log=lines.append)
  got.update(run(second, range(12, 25)))
  second.close()
  assert got == expected
  assert mine.calls == [2, 3, 4], "generation 2 re-mined from its snapshot; 0 and 1 read from disk"
  assert any("not mined when the run stopped; mining it from snapshot-00000010.npz" in line for line in lines)
  assert not (tmp_path / "killed" / "snapshot-00000010.npz").exists()

  # With a bounded wait, the resumed run falls back on generation 1 from disk while 2 is re-mined (held until
  # released, so it is still mining when step 12 gives up on it).
  started, release = threading.Event(), threading.Event()
  third = AsyncRefresher(fake_mine(block={2: (started, release)}), every=5, delay=2,
                         directory=tmp_path / "killed-too", max_wait_s=0.01, log=lambda _: None)
  third.prepare(12, params_at(12))
  assert view(third.pools(12)) == expected[11] and third.staleness(12) == 7
  release.set()
  wait_for_mines(third, 1)
  assert view(third.pools(13)) == expected[13]
  assert third.stats()["late_switches"] == 1
  third.close()


def test_resume_without_the_directory_mines_from_current_params(tmp_path):
  lines = []
  r = AsyncRefresher(fake_mine(), every=5, delay=2, directory=tmp_path, log=lines.append)
  r.prepare(13, params_at(13))
  assert view(r.pools(13))["q1"] == ["gen2", "w13"]
  assert r.staleness(13) == 0
  assert any("differ from an uninterrupted run" in line and "generation 2" in line for line in lines)
  r.close()


@pytest.mark.parametrize("how", ["raises", "thread dies"])
def test_failed_mine_keeps_the_previous_generation(tmp_path, how):
  lines = []
  mine = fake_mine(fail={1}) if how == "raises" else fake_mine(die={1})
  r = AsyncRefresher(mine, every=5, delay=2, directory=tmp_path, log=lines.append)
  staleness = {}
  seen = run(r, range(13), staleness=staleness)
  r.close()
  assert [seen[s]["q1"][0] for s in range(13)] == ["gen0"] * 12 + ["gen2"]
  assert staleness[11] == 11 and staleness[12] == 2
  assert r.stats()["failed"] == 1 and r.stats()["mines"] == 2
  failure = [line for line in lines if "generation 1" in line and "fail" in line]
  assert len(failure) == 1
  assert ("boom in generation 1" if how == "raises" else "worker killed") in failure[0]
  assert not list(tmp_path.glob("snapshot-*.npz")), "the failed generation's snapshot goes once 2 is mined"


def test_slow_mine_with_bounded_wait_switches_late(tmp_path):
  lines = []
  started, release = threading.Event(), threading.Event()
  r = AsyncRefresher(fake_mine(block={1: (started, release)}), every=5, delay=2, directory=tmp_path,
                     max_wait_s=0.05, log=lines.append)
  seen = run(r, range(8))  # generation 1 (due at step 7) is held mining until released
  assert seen[7]["q1"][0] == "gen0", "generation 1 is late at step 7: generation 0 stays in force"
  assert r.staleness(7) == 7
  assert any("generation 1 not ready at step 7" in line for line in lines)
  waited = r.stats()["wait_seconds"]
  assert waited >= 0.05 * 0.99, "step 7 waited its max_wait_s (to float rounding) for generation 1"
  release.set()
  wait_for_mines(r, 2)
  seen = run(r, range(8, 10))
  r.close()
  assert seen[8]["q1"] == ["gen1", "w5"], "switched in at the first step it was ready"
  assert r.staleness(8) == 3
  stats = r.stats()
  assert stats["late_switches"] == 1 and stats["generation"] == 1
  assert stats["wait_seconds"] == waited, "a generation that timed out once is not waited for again"
  assert any("late (due at step 7)" in line for line in lines)


def _waiting_on_a_condition(thread: threading.Thread) -> bool:
  """Whether `thread` is blocked in threading.Condition.wait (the refresher's trainer side waits only there)."""
  frame = sys._current_frames().get(thread.ident)  # pylint: disable=protected-access  (documented in sys)
  return frame is not None and frame.f_code is threading.Condition.wait.__code__


@pytest.mark.parametrize("waits", [False, True])
def test_wait_seconds_count_only_a_miner_not_done_when_due(tmp_path, waits):
  """The trainer's wait is counted only when a generation is still mining at its due step: a miner done
  before its due step adds nothing; one that finishes while the trainer waits adds to wait_seconds."""
  trainer = threading.current_thread()
  base = fake_mine()

  def mine(params, generation):
    if waits and generation:  # held until the trainer waits for it at its due step
      deadline = time.monotonic() + 60
      while not _waiting_on_a_condition(trainer):
        assert time.monotonic() < deadline, "the trainer never waited for a generation still mining"
        time.sleep(0.001)
    return base(params, generation)

  every, delay = 4, 3
  r = AsyncRefresher(mine, every=every, delay=delay, directory=tmp_path, log=lambda _: None)
  seen = {}
  for s in range(12):
    k = generation_at(s, every, delay)
    if not waits and k and s == activation_step(k, every, delay):
      wait_for_mines(r, k + 1)  # done before its due step
    r.prepare(s, params_at(s))
    seen[s] = view(r.pools(s))
  r.close()
  assert [seen[s]["q1"][0] for s in range(12)] == ["gen0"] * 7 + ["gen1"] * 4 + ["gen2"]
  stats = r.stats()
  assert stats["late_switches"] == 0 and stats["mines"] == 3
  if waits:
    assert stats["wait_seconds"] > 0
  else:
    assert stats["wait_seconds"] == 0.0
