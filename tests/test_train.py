"""The trainer end to end on a tiny random BERT and tiny generated data: sharding, resume, bad input."""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest

from conftest import cpu_devices_env, run_module, write_tiny_beir

ROOT = pathlib.Path(__file__).resolve().parents[1]

# A tiny random BERT, no evaluation: what these tests check is the optimisation itself.
TINY = [
    "--config.model.init_from=", "--config.model.fresh=tiny", "--config.model.pooling=mean",
    "--config.model.dropout=0.1", "--config.optimizer.learning_rate=1e-3", "--config.optimizer.warmup_steps=5",
    "--config.batch_size=8", "--config.log_every=1", "--config.data.query_max_length=16",
    "--config.data.doc_max_length=32",
]


def _env(devices: int = 1) -> dict:
  env = cpu_devices_env(devices)
  env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
  return env


def _train_cmd(workdir, data, *extra):
  return [sys.executable, "-m", "jdr.train", "--config", str(ROOT / "configs" / "demo.py"),
          "--workdir", str(workdir), f"--config.data.dataset={data}", *TINY, *extra]


def _records(workdir) -> list[dict]:
  return [json.loads(l) for l in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()]


def _losses(workdir) -> list[float]:
  return [r["train/loss"] for r in _records(workdir) if "train/loss" in r]


@pytest.mark.long
def test_sharded_runs_equal_one_device(tmp_path):
  """8 steps on 8 simulated CPU devices (data parallel; fully sharded; tensor parallel) match the 1-device run."""
  data = write_tiny_beir(tmp_path / "data")
  script = textwrap.dedent(f"""
      import json, sys, numpy as np, jax
      from jdr import train
      from jdr.training import trainer
      from jdr.runtime import config_files
      runs = {{"single": ["mesh.shape=(1,1,1)"],
               "data_parallel": ["mesh.shape=(8,1,1)", "mesh.rules=dp"],
               "fully_sharded": ["mesh.shape=(2,4,1)", "mesh.rules=fsdp"],
               "tensor_parallel": ["mesh.shape=(4,1,2)", "mesh.rules=tp"]}}
      base = {[a[len('--config.'):] for a in TINY]!r} + [
          "data.dataset={data}", "data.eval_split=", "num_train_steps=8", "checkpoint_every=100"]
      out = {{}}
      for name, extra in runs.items():
        config = config_files.load_config_file("{ROOT / 'configs' / 'demo.py'}")
        config_files.apply_overrides(config, base + extra)
        result = trainer.train_and_evaluate(config, "{tmp_path}/" + name)
        state = result["state"]
        shardings = {{str(x.sharding.spec) for x in jax.tree.leaves(state.params)}}
        params = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(state.params))]
        np.savez("{tmp_path}/" + name + ".npz", *params)
        out[name] = sorted(shardings)
      print("SHARDINGS=" + json.dumps(out))
  """)
  proc = subprocess.run([sys.executable, "-c", script], env=_env(8), capture_output=True, text=True,
                        timeout=600, cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr[-4000:]
  shardings = json.loads(proc.stdout.split("SHARDINGS=")[1].splitlines()[0])
  assert any("fsdp" in s for s in shardings["fully_sharded"]), shardings  # parameters really were split
  assert any("model" in s for s in shardings["tensor_parallel"]), shardings
  single = np.load(tmp_path / "single.npz")
  reference_losses = _losses(tmp_path / "single")
  assert len(reference_losses) == 8
  for name in ("data_parallel", "fully_sharded", "tensor_parallel"):
    losses = _losses(tmp_path / name)
    sharded = np.load(tmp_path / f"{name}.npz")
    param_diff = max(float(np.max(np.abs(sharded[k] - single[k]))) for k in single.files)
    print(f"{name}: max |loss diff| {np.max(np.abs(np.subtract(losses, reference_losses))):.2e}, "
          f"max |param diff| {param_diff:.2e}")
    # float32 sums split over 8 devices add in another order: agreement to ~1e-5 relative, not bitwise.
    np.testing.assert_allclose(losses, reference_losses, rtol=3e-5, atol=1e-5)
    for key in single.files:
      np.testing.assert_allclose(sharded[key], single[key], rtol=1e-4, atol=2e-5, err_msg=f"{name} {key}")


def _two_processes_and_one(tmp_path, data, common):
  """Trains into tmp_path/multi on 2 processes x 2 CPU devices (the local launcher) and into tmp_path/single on
  1 x 4; returns the launcher's completed process (its stderr is host 0's). Two devices a process, not more:
  on a 2-core machine each simulated device adds threads that contend (2 x 4 took 1.5x as long)."""
  launched = subprocess.run([sys.executable, "-m", "jdr.launch.local", "--processes", "2", "--devices-per-process",
                             "2", "--log-dir", str(tmp_path / "logs"), "--",
                             *_train_cmd(tmp_path / "multi", data, *common)],
                            env=_env(2), capture_output=True, text=True, timeout=600)
  assert launched.returncode == 0, launched.stderr[-3000:] + (tmp_path / "logs" / "process-1.log").read_text()[-2000:]
  subprocess.run(_train_cmd(tmp_path / "single", data, *common), env=_env(4), check=True,
                 capture_output=True, timeout=600)
  return launched


@pytest.mark.long
def test_two_processes_equal_one(tmp_path):
  """The multi-host path through the local launcher: 2 processes x 2 CPU devices (jax.distributed) train
  like 1 process x 4 devices, ANCE's refresh included (each host mines on the trainer's thread: the gather of
  the corpus parts is a collective, so the negatives, hence the losses, must match), and their final
  evaluation (each device encoding its own rows of the corpus, gathered across the hosts) scores the same."""
  data = write_tiny_beir(tmp_path / "data")
  common = ["--config.num_train_steps=6", "--config.checkpoint_every=3", "--config.eval_before_training=False",
            "--config.negatives.source=ance", "--config.negatives.per_query=1", "--config.negatives.ance.top_n=5",
            "--config.negatives.ance.refresh_every=2", "--config.negatives.ance.refresh_delay=1"]
  launched = _two_processes_and_one(tmp_path, data, common)
  assert "refresh: generation 2 (snapshot step 4, mined in" in launched.stderr
  assert len(_losses(tmp_path / "multi")) == 6  # host 0 alone writes the log
  np.testing.assert_allclose(_losses(tmp_path / "multi"), _losses(tmp_path / "single"), rtol=3e-5)
  evals = [[r for r in _records(tmp_path / w) if "eval/ndcg@10" in r] for w in ("multi", "single")]
  assert len(evals[0]) == len(evals[1]) == 1
  np.testing.assert_allclose(evals[0][0]["eval/ndcg@10"], evals[1][0]["eval/ndcg@10"], rtol=1e-6)
  assert (tmp_path / "multi" / "checkpoints" / "6").is_dir()
  # Each host tokenized and encoded only its own part of the corpus, and the parts tile it.
  parts = []
  for i in (0, 1):
    log = launched.stderr if i == 0 else (tmp_path / "logs" / f"process-{i}.log").read_text()  # 0: the launcher's
    found = re.findall(rf"host {i} of 2: tokenized and encoding documents (\d+)-(\d+) of (\d+)", log)
    assert found, log[-2000:]
    parts.append(tuple(int(x) for x in found[-1]))
  (lo0, hi0, n), (lo1, hi1, n1) = parts
  assert n == n1 and lo0 == 0 and hi0 + 1 == lo1 and hi1 == n - 1 and hi0 >= lo0 and hi1 >= lo1, parts
  # Each host parsed only its part of corpus.jsonl (jdr.data.corpus_by_host): two parts, swapped through the
  # workdir, that together hold every document once.
  exchange = sorted((tmp_path / "multi" / "corpus-parts").iterdir())
  assert [p.name for p in exchange] == ["part-00000-of-00002.npz", "part-00001-of-00002.npz"]
  ids = [i for p in exchange for i in np.load(p)["ids"].tolist()]
  assert len(ids) == n == len(set(ids)) and all(len(np.load(p)["ids"]) for p in exchange)


ANCE = ["--config.negatives.source=ance", "--config.negatives.per_query=1", "--config.negatives.ance.top_n=5",
        "--config.negatives.ance.refresh_every=6", "--config.negatives.ance.refresh_delay=3"]


def _stop_after_8_more_steps(cmd, workdir, signum) -> int:
  """Starts `cmd`, sends `signum` once it has logged 8 more lines to metrics.jsonl, checks how it stopped (the
  step in flight saved, the resume line, status 128 + signum, no traceback), and returns the saved step."""
  log = workdir / "metrics.jsonl"
  before = log.read_text().count("\n") if log.exists() else 0
  proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 300
  while not (log.exists() and log.read_text().count("\n") >= before + 8) and proc.poll() is None \
      and time.time() < deadline:
    time.sleep(0.005)
  logged = max(r["step"] for r in _records(workdir))
  proc.send_signal(signum)
  _, stderr = proc.communicate(timeout=300)
  assert proc.returncode == 128 + signum, stderr[-3000:]
  assert "Traceback" not in stderr, stderr[-3000:]
  saved = max(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
  assert logged <= saved, (logged, saved)  # the step in flight, not an older one
  last = stderr.strip().splitlines()[-1]
  assert f"after step {saved}" in last and "resume with: python -m jdr.train" in last, last
  return saved


@pytest.mark.long
def test_signalled_run_saves_its_step_and_resumes_exactly(tmp_path):
  """SIGINT, then SIGTERM in the resumed run (no periodic checkpoint due): each time the run finishes its step,
  saves it, says how to resume and exits 130 / 143 without a traceback; nothing logged before a signal is lost,
  the twice-resumed run ends bitwise equal to an uninterrupted one, and its metric log holds each step once, in
  order. ANCE's background refresh is stopped and its generations re-mined from their snapshots on resume."""
  data = write_tiny_beir(tmp_path / "data")
  steps = 40
  common = [f"--config.num_train_steps={steps}", "--config.checkpoint_every=1000", "--config.data.eval_split=",
            *ANCE]
  # The uninterrupted run and the last resume run in this process (conftest.run_module); the signalled ones are
  # processes.
  assert run_module("jdr.train", _train_cmd(tmp_path / "straight", data, *common)[3:]).returncode == 0

  workdir = tmp_path / "stopped"
  first = _stop_after_8_more_steps(_train_cmd(workdir, data, *common), workdir, signal.SIGINT)
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == [str(first)]
  second = _stop_after_8_more_steps(_train_cmd(workdir, data, *common), workdir, signal.SIGTERM)
  assert first < second < steps, (first, second)

  last = run_module("jdr.train", _train_cmd(workdir, data, *common)[3:])
  assert last.returncode == 0, last.stderr[-3000:]
  from jdr.runtime import checkpoint  # pylint: disable=g-import-not-at-top
  straight = jax.tree.leaves(checkpoint.latest_params(tmp_path / "straight"))
  resumed = jax.tree.leaves(checkpoint.latest_params(workdir))
  for a, b in zip(straight, resumed):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # bitwise
  assert [r["step"] for r in _records(workdir) if "train/loss" in r] == list(range(1, steps + 1))


def test_preemption_handler_stops_once_then_leaves_the_default():
  """The first signal only asks to stop; it puts back the default action, so a second one ends the process."""
  from jdr.training import preemption  # pylint: disable=g-import-not-at-top
  before = signal.getsignal(signal.SIGINT)
  with preemption.StopRequests() as stop:
    assert not stop.requested()
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.01)  # Python runs the handler at its next bytecode
    assert stop.requested() and stop.signum == signal.SIGINT
    assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
  signal.signal(signal.SIGINT, before)
  signal.signal(signal.SIGTERM, signal.SIG_DFL)
  with preemption.StopRequests() as stop:  # no signal: the handlers it replaced come back
    assert signal.getsignal(signal.SIGINT) is not before
  assert signal.getsignal(signal.SIGINT) is before and not stop.requested()


def _run_train(tmp_path, *args, devices=1, own_process=False):
  """`python -m jdr.train ARGS`: on one device in this process (conftest.run_module), on several, or where the
  run must start jax itself, in a process of its own (jax fixes the device count when it starts)."""
  if devices == 1 and not own_process:
    return run_module("jdr.train", args)
  return subprocess.run([sys.executable, "-m", "jdr.train", *args], env=_env(devices), capture_output=True,
                        text=True, timeout=600, cwd=tmp_path)


@pytest.mark.slow
def test_unknown_config_key_lists_valid_names(tmp_path):
  proc = _run_train(tmp_path, "--config", str(ROOT / "configs" / "demo.py"), "--workdir", str(tmp_path / "w"),
                    "--config.optimizer.learnin_rate=1e-4")
  assert proc.returncode != 0
  assert "unknown config key 'optimizer.learnin_rate'" in proc.stderr
  assert "optimizer.learning_rate" in proc.stderr  # the suggestion and the valid names
  assert not (tmp_path / "w" / "checkpoints").exists()


@pytest.mark.slow
def test_missing_data_file_is_named(tmp_path):
  data = write_tiny_beir(tmp_path / "data")
  (data / "qrels" / "train.tsv").unlink()
  proc = _run_train(tmp_path, *_train_cmd(tmp_path / "w", data)[3:])
  assert proc.returncode != 0
  assert "train.tsv" in proc.stderr and "missing" in proc.stderr
  assert not (tmp_path / "w").exists()  # a failed start removes the workdir it made


@pytest.mark.slow
def test_qrels_without_overlap_with_queries(tmp_path):
  data = write_tiny_beir(tmp_path / "data")
  lines = (data / "qrels" / "train.tsv").read_text().splitlines()
  (data / "qrels" / "train.tsv").write_text(
      "\n".join([lines[0]] + [l.replace("q", "other-q", 1) for l in lines[1:]]) + "\n")
  proc = _run_train(tmp_path, *_train_cmd(tmp_path / "w", data)[3:])
  assert proc.returncode != 0
  assert "train.tsv" in proc.stderr and "other-q" in proc.stderr
  assert not (tmp_path / "w" / "checkpoints").exists()


def test_batch_not_divisible_by_devices(tmp_path):
  data = write_tiny_beir(tmp_path / "data")
  proc = _run_train(tmp_path, *_train_cmd(tmp_path / "w", data, "--config.batch_size=12")[3:], devices=8)
  assert proc.returncode != 0
  assert "batch_size=12 is not divisible by the 8 data-parallel devices" in proc.stderr
  assert not (tmp_path / "w" / "checkpoints").exists()


def test_cpu_devices_split_the_host_and_are_refused_once_jax_runs(tmp_path):
  """mesh.cpu_devices=8 makes a 1-device process an 8-device one (its batch must then split 8 ways), and a
  process where JAX already runs with another count gets a clear error, not a silent single device."""
  data = write_tiny_beir(tmp_path / "data")
  proc = _run_train(tmp_path, *_train_cmd(tmp_path / "w", data, "--config.batch_size=12",
                                          "--config.mesh.cpu_devices=8")[3:], own_process=True)
  assert proc.returncode != 0
  assert "batch_size=12 is not divisible by the 8 data-parallel devices" in proc.stderr
  from jdr.runtime import parallel  # pylint: disable=g-import-not-at-top
  have = len(jax.devices("cpu"))
  parallel.use_cpu_devices(have)  # the count it has: nothing to change
  parallel.use_cpu_devices(0)
  with pytest.raises(ValueError, match=f"mesh.cpu_devices={have + 1}: JAX already runs in this process with "
                                       f"{have} CPU device"):
    parallel.use_cpu_devices(have + 1)


def test_auto_cpu_devices_take_one_per_core_that_splits_the_batch_and_fits_memory(monkeypatch):
  from jdr.runtime import parallel  # pylint: disable=g-import-not-at-top
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)  # as in a fresh process
  monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
  monkeypatch.setattr(parallel.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
  assert parallel.auto_cpu_devices(32, 0, 1) == parallel.MAX_AUTO_CPU_DEVICES == 8
  assert parallel.auto_cpu_devices(12, 0, 1) == 6  # the most that split the batch
  assert parallel.auto_cpu_devices(12, 4, 1) == 4  # and each gradient-caching chunk
  assert parallel.auto_cpu_devices(11, 0, 1) == 0  # a prime batch above 8: one device
  assert parallel.auto_cpu_devices(32, 0, None) == 0  # the state's size not known
  memory = parallel.os.sysconf("SC_PAGE_SIZE") * parallel.os.sysconf("SC_PHYS_PAGES")
  assert parallel.auto_cpu_devices(32, 0, memory // 4) == 2  # a quarter of the memory holds one more copy
  assert parallel.auto_cpu_devices(32, 0, memory) == 0
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=3")  # the launcher's count stands
  assert parallel.auto_cpu_devices(32, 0, 1) == 0
  monkeypatch.undo()
  jax.devices()
  assert parallel.auto_cpu_devices(32, 0, 1) == 0  # this process's backend runs


def test_weight_bytes_come_from_the_shape_or_the_files(tmp_path):
  from jdr.models import build  # pylint: disable=g-import-not-at-top
  from jdr.runtime import defaults  # pylint: disable=g-import-not-at-top
  c = defaults.get_config().model
  minilm = build.weight_bytes(c)  # the bundled MiniLM: 22.7M float32 parameters in its weight file
  assert 85e6 < minilm < 95e6
  c.shared = False
  assert build.weight_bytes(c) == 2 * minilm
  c.shared, c.init_from, c.fresh = True, "", "base"
  assert 0.4e9 < build.weight_bytes(c) < 0.45e9  # BERT-base: 110M parameters
  c.init_from = str(tmp_path)  # a directory with no weight files: not known
  assert build.weight_bytes(c) is None


@pytest.mark.skipif(len(getattr(os, "sched_getaffinity", lambda pid: ())(0)) < 2, reason="needs 2 cores")
def test_a_training_process_on_two_cores_trains_as_two_devices(tmp_path):
  """The default (mesh.cpu_devices=-1) in a fresh process limited to two cores: two devices, said on stderr,
  and a batch that does not split over them runs on one."""
  data = write_tiny_beir(tmp_path / "data")
  # The suite's compile flags, less its one-device count, so the trainer's default decides.
  from jdr.launch.local import DEVICE_COUNT_FLAG  # pylint: disable=g-import-not-at-top
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT_FLAG + "=")]
  env = {**_env(), "XLA_FLAGS": " ".join(flags)}
  two_cores = lambda: os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])
  runs = {}
  for batch in (8, 7):
    proc = subprocess.run(_train_cmd(tmp_path / f"w{batch}", data, f"--config.batch_size={batch}",
                                     "--config.num_train_steps=2", "--config.eval_every=0",
                                     "--config.eval_before_training=False"),
                          env=env, capture_output=True, text=True, timeout=600, preexec_fn=two_cores)
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs[batch] = proc.stderr
  assert "this CPU trains as 2 XLA devices, one per core" in runs[8]
  assert "XLA devices" not in runs[7]
  # The two-device checkpoint reads in this one-device process as the one-device run's does: same tree.
  from jdr.runtime import checkpoint  # pylint: disable=g-import-not-at-top
  two, one = (checkpoint.latest_params(tmp_path / f"w{b}") for b in (8, 7))
  assert jax.tree.structure(two) == jax.tree.structure(one)
  assert [x.shape for x in jax.tree.leaves(two)] == [x.shape for x in jax.tree.leaves(one)]
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(two))


@pytest.mark.slow
def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
  data = write_tiny_beir(tmp_path / "data")
  # A huge learning rate blows the weights up within a few steps.
  proc = _run_train(tmp_path, *_train_cmd(
      tmp_path / "w", data, "--config.optimizer.learning_rate=1e25", "--config.optimizer.warmup_steps=0",
      "--config.optimizer.grad_clip_norm=0", "--config.checkpoint_every=1", "--config.num_train_steps=50",
      "--config.data.eval_split=")[3:])
  assert proc.returncode == 3 and "Traceback" not in proc.stderr
  line = next(x for x in proc.stderr.splitlines() if x.startswith("error: "))
  assert ("error: loss is nan at step" in line or "error: grad_norm is" in line) and "last good checkpoint" in line
  bad_step = int(line.split("at step ")[1].split(";")[0])
  saved = sorted(int(p.name) for p in (tmp_path / "w" / "checkpoints").iterdir() if p.name.isdigit())
  assert saved and max(saved) == bad_step - 1
  from jdr.runtime import checkpoint  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(checkpoint.latest_params(tmp_path / "w")))
  # The optimizer's moments too: a non-finite gradient norm stops the run before its state is saved.
  mngr = checkpoint.manager(tmp_path / "w")
  restored = mngr.restore(max(saved), args=checkpoint.ocp.args.Composite(state=checkpoint.ocp.args.StandardRestore()))
  assert checkpoint.all_finite(restored["state"])


@pytest.mark.slow
def test_tfds_source_trains_like_the_files(tmp_path):
  """data.source=tfds (array_record via the jdr TFDS builder) feeds the same batches as the files."""
  from jdr.training import trainer  # pylint: disable=g-import-not-at-top
  from jdr.runtime import config_files  # pylint: disable=g-import-not-at-top
  data = write_tiny_beir(tmp_path / "data")
  for source in ("files", "tfds"):
    config = config_files.load_config_file(str(ROOT / "configs" / "demo.py"))
    config_files.apply_overrides(config, [a[len("--config."):] for a in TINY] + [
        f"data.dataset={data}", f"data.source={source}", "num_train_steps=3", "data.eval_split="])
    trainer.train_and_evaluate(config, tmp_path / source)
  assert len(_losses(tmp_path / "files")) == 3
  assert _losses(tmp_path / "tfds") == _losses(tmp_path / "files")


@pytest.mark.slow
def test_train_then_evaluate_end_to_end(tmp_path):
  """A few steps of in-batch training, evaluated before and after; the metrics reach the log."""
  data = write_tiny_beir(tmp_path / "data")
  proc = _run_train(tmp_path, *_train_cmd(tmp_path / "w", data, "--config.num_train_steps=10",
                                          "--config.checkpoint_every=5")[3:])
  assert proc.returncode == 0, proc.stderr[-3000:]
  # Each evaluation line says which kind it is: a corpus this small is evaluated whole.
  assert "before training, eval (full corpus, 40 documents, 10 queries): ndcg@10=" in proc.stdout
  assert "after 10 steps, eval (full corpus, 40 documents, 10 queries): ndcg@10=" in proc.stdout
  records = [json.loads(l) for l in (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()]
  evals = [r for r in records if "eval/ndcg@10" in r]
  assert [r["step"] for r in evals] == [0, 10]
  assert all(0.0 <= r["eval/ndcg@10"] <= 1.0 for r in evals)


# ADORE and ANCE train in tests/test_hard_negatives.py (resume, sharding, a failing refresh); bm25_neg, star
# and adore_star in tests/test_readme.py, whose tour trains them.
# The in-batch recipe stays in the development tier (`-m "not slow"`): one training run end to end in this process.
@pytest.mark.parametrize("recipe", ["inbatch", *(pytest.param(r, marks=pytest.mark.slow)
                                                 for r in ("rand_neg", "nce_neg", "bm25_rand", "ltre"))])
def test_every_recipe_trains(tmp_path, recipe):
  """Each method's config runs through the one trainer: negatives sampled, masked and scored. (With
  checkpoint_every=0: no periodic checkpoint, the last step's alone.)"""
  from jdr.training import trainer
  from jdr.runtime import config_files
  data = write_tiny_beir(tmp_path / "data")
  config = config_files.load_config_file(f"{ROOT / 'configs' / recipe}.py:runlocal")
  config_files.apply_overrides(config, [a[len("--config."):] for a in TINY] + [
      f"data.dataset={data}", "data.eval_split=", "num_train_steps=3", "checkpoint_every=0",
      "negatives.retrieval.top_n=10", "eval.doc_max_length=32"])
  trainer.train_and_evaluate(config, tmp_path / "w")
  losses = _losses(tmp_path / "w")
  assert len(losses) == 3 and all(np.isfinite(losses))
  assert [p.name for p in (tmp_path / "w" / "checkpoints").iterdir() if p.name.isdigit()] == ["3"]
  if config.negatives.source in ("dense_static", "retrieval"):
    # What was mined once (the starting model's top-n or corpus vectors) is cached in the workdir.
    assert (tmp_path / "w" / "cache").exists()
  if config.negatives.source in ("bm25", "bm25_random"):
    # BM25's index and candidates are kept beside the prepared corpus, for every later run over it.
    from jdr.data import pairs  # pylint: disable=g-import-not-at-top
    from jdr.retrieval import bm25  # pylint: disable=g-import-not-at-top
    beside = bm25.kept_beside(pairs.load(config.data, tmp_path / "w").corpus)
    assert beside is not None and list(beside.glob("bm25-*-top*"))


@pytest.mark.slow
def test_query_tower_only_leaves_document_tower_untouched(tmp_path):
  """model.train_towers=query (ADORE / LTRe): separate towers, and the document tower never moves."""
  from jdr.training import trainer
  from jdr.runtime import config_files
  import jax  # pylint: disable=g-import-not-at-top
  data = write_tiny_beir(tmp_path / "data")
  config = config_files.load_config_file(str(ROOT / "configs" / "demo.py"))
  config_files.apply_overrides(config, [a[len("--config."):] for a in TINY] + [
      f"data.dataset={data}", "data.eval_split=", "num_train_steps=3", "checkpoint_every=100",
      "model.shared=false", "model.train_towers=query"])
  end = jax.device_get(trainer.train_and_evaluate(config, tmp_path / "one")["state"].params)
  from jdr.models import build as build_lib  # pylint: disable=g-import-not-at-top
  built = build_lib.build(config.model, config.data)
  start = jax.device_get(trainer.initial_params(built.model, built, config, jax.random.PRNGKey(config.seed), None))
  for a, b in zip(jax.tree.leaves(start["doc_tower"]), jax.tree.leaves(end["doc_tower"])):
    np.testing.assert_array_equal(a, b)
  moved = [float(np.max(np.abs(a - b))) for a, b in
           zip(jax.tree.leaves(start["query_tower"]), jax.tree.leaves(end["query_tower"]))]
  assert max(moved) > 0


@pytest.mark.slow
def test_init_from_jdr_model_applies_model_settings(tmp_path):
  """Starting from a trained shared tower: model.shared=False splits it (ADORE's start), dropout and
  dtype come from the new config, and an override the weights fix (pooling) is refused, not ignored."""
  from jdr.training import trainer
  from jdr.runtime import config_files
  from jdr.models import build as build_lib  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  data = write_tiny_beir(tmp_path / "data")
  config = config_files.load_config_file(str(ROOT / "configs" / "demo.py"))
  config_files.apply_overrides(config, [a[len("--config."):] for a in TINY] + [
      f"data.dataset={data}", "data.eval_split=", "num_train_steps=1", "checkpoint_every=100"])
  trained = jax.device_get(trainer.train_and_evaluate(config, tmp_path / "w")["state"].params)
  config_files.apply_overrides(config, [f"model.init_from={tmp_path / 'w'}", "model.shared=false",
                                        "model.dropout=0.0", "model.pooling=", "model.train_towers=query"])
  built = build_lib.build(config.model, config.data)
  assert not built.model.shared and built.model.query.encoder.hidden_dropout == 0.0
  assert built.model.doc.pooling == "mean" and built.description["shared"] is False
  for side in ("query_tower", "doc_tower"):
    for a, b in zip(jax.tree.leaves(trained["tower"]), jax.tree.leaves(built.params[side])):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # And it trains: the split towers are separate buffers (one would be donated twice).
  trainer.train_and_evaluate(config.copy_and_resolve_references(), tmp_path / "split")
  config_files.apply_overrides(config, ["model.pooling=cls"])
  with pytest.raises(ValueError, match="pooling"):
    build_lib.build(config.model, config.data)


def test_help_lists_every_config_key_with_its_default_and_meaning(capsys):
  from jdr import train  # pylint: disable=g-import-not-at-top
  from jdr.runtime import config_files
  from jdr.runtime import defaults
  with pytest.raises(SystemExit) as e:
    train.main(["--help"])
  assert e.value.code == 0
  listed = {}
  for line in capsys.readouterr().out.splitlines():
    found = re.fullmatch(r"  ([\w.]+) = (.+?)(?:  \[(.+)\])?  # (.+)", line)
    if found:
      listed[found.group(1)] = (found.group(2), found.group(4), found.group(3))
  config = defaults.get_config()
  assert set(listed) == set(config_files.all_keys(config))
  assert listed["num_train_steps"][0] == str(config.num_train_steps)
  assert listed["num_train_steps"][2] == ">= 0" and listed["model.dropout"][2] == "[0, 1)"  # the ranges
  assert all(meaning.strip() for _, meaning, _ in listed.values())


@pytest.mark.slow
def test_a_full_disk_is_one_error_line_and_keeps_earlier_checkpoints(tmp_path):
  """A checkpoint that cannot be written (a file-size limit stands in for a full disk: orbax's writes past
  1 MB fail with EFBIG, in its background threads) ends the run with one `error:` line naming the
  checkpoints folder and status 2, no traceback; the partial checkpoint is removed, the earlier one stays."""
  data = write_tiny_beir(tmp_path / "data")
  workdir = tmp_path / "w"
  no_eval = "--config.data.eval_split="  # evaluation writes no checkpoint: not what is checked here
  first = _run_train(tmp_path, *_train_cmd(workdir, data, "--config.num_train_steps=2",
                                           "--config.checkpoint_every=2", no_eval)[3:])
  assert first.returncode == 0, first.stderr[-2000:]
  limited = ("import os, resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20)); "
             "os.execv(sys.executable, [sys.executable, '-m', 'jdr.train', *sys.argv[1:]])")
  proc = subprocess.run([sys.executable, "-c", limited,
                         *_train_cmd(workdir, data, "--config.num_train_steps=4", "--config.checkpoint_every=2",
                                     no_eval)[3:]],
                        env=_env(), capture_output=True, text=True, timeout=600, cwd=tmp_path)
  errors = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
  assert proc.returncode == 2 and errors == [f"error: {workdir / 'checkpoints'}: File too large"], proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr and "ERROR:absl" not in proc.stderr, proc.stderr[-3000:]
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["2"]
