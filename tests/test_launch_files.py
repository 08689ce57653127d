"""The job files in launch/: each one's --dry-run prints the commands it would run, through jdr.launch, and the
training commands in them name recipes, recipe arguments and config keys that exist."""

import os
import pathlib
import shlex
import subprocess
import sys

import pytest

from jdr.runtime import config_files

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "launch"


def dry_run(name: str, **env) -> str:
  out = subprocess.run(["bash", str(LAUNCH / name), "--dry-run"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHON": sys.executable, **env})
  assert out.returncode == 0, out.stderr
  return out.stdout


def check_train_command(words: list[str]) -> None:
  """A `python -m jdr.train ...` command: its recipe loads and its overrides name real keys of it."""
  start = words.index("jdr.train")
  rest, overrides = config_files.split_config_args(words[start + 1:])
  config = config_files.load_config_file(str(ROOT / rest[rest.index("--config") + 1]))
  config_files.apply_overrides(config, overrides)


def test_every_job_file_is_documented_in_the_launch_readme():
  readme = (LAUNCH / "README.md").read_text()
  files = sorted(p.name for p in LAUNCH.glob("*.sh"))
  assert files == ["local_multiprocess.sh", "slurm_adore_8gpu.sh", "tpu_ance_msmarco.sh"]
  assert all(f in readme for f in files)


@pytest.mark.parametrize("accelerator,workers", [("v4-32", 4), ("v5litepod-32", 8)])
def test_tpu_pod_ance_on_msmarco(accelerator, workers):
  out = dry_run("tpu_ance_msmarco.sh", ACCELERATOR=accelerator, CREATE="1", LOCAL_DATA="/data/msmarco",
                BUCKET="gs://b/jdr", TPU="pod", ZONE="z", PROJECT="p")
  steps = [shlex.split(line[2:]) for line in out.splitlines() if line.startswith("$ ")]
  assert steps[0] == ["gcloud", "compute", "tpus", "tpu-vm", "create", "pod", "--zone", "z", "--project", "p",
                      "--accelerator-type", accelerator, "--version", steps[0][-1]]
  assert steps[1] == ["gcloud", "storage", "rsync", "--recursive", "/data/msmarco", "gs://b/jdr/data/msmarco"]
  assert steps[2][4:7] == ["scp", "--recurse", "."]  # the working tree to every worker
  setup = steps[3][-1]
  assert "pip install -e '.[tpu]'" in setup and "gs://b/jdr/data/msmarco data/msmarco" in setup
  runs = [shlex.split(s[-1].split(" && ", 1)[1]) for s in steps if "jdr.train" in s[-1]]
  assert [r[r.index("--config") + 1] for r in runs] == ["configs/bm25_neg.py", "configs/ance.py"]
  assert "--workdir" in runs[1] and runs[1][runs[1].index("--workdir") + 1] == "gs://b/jdr/runs/ance"
  assert "--config.model.init_from=gs://b/jdr/runs/bm25_neg" in runs[1]  # ANCE starts from the warm-up
  for words in runs:
    check_train_command(words)
  assert all("--worker=all" in s for s in steps[2:])
  # Every worker of the slice runs each command: one line per worker and command.
  assert sum(line.startswith("# worker ") for line in out.splitlines()) == 3 * workers
  assert f"# worker {workers - 1}:" in out and f"# worker {workers}:" not in out


def test_tpu_job_file_refuses_an_unknown_slice():
  out = subprocess.run(["bash", str(LAUNCH / "tpu_ance_msmarco.sh"), "--dry-run"], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "ACCELERATOR": "v3-8", "PYTHON": sys.executable})
  assert out.returncode == 2 and "ACCELERATOR=v3-8" in out.stderr


def test_slurm_adore_on_one_node_of_eight_gpus():
  out = dry_run("slurm_adore_8gpu.sh", DATA="/shared/msmarco", INIT_FROM="runs/star", WORKDIR="runs/adore")
  for line in ("#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
               "#SBATCH --partition=gpu", "$ sbatch adore-8gpu.sbatch"):
    assert line in out
  task = shlex.split(next(l for l in out.splitlines() if l.startswith("srun")))[-1]
  assert "source .venv/bin/activate" in task and 'JDR_PROCESS_ID="$SLURM_PROCID"' in task
  train = shlex.split(task.split("exec ", 1)[1])
  assert train[train.index("--config") + 1] == "configs/adore.py:jax"  # retrieval inside the step, on the mesh
  assert "--config.data.dataset=/shared/msmarco" in train and "--config.model.init_from=runs/star" in train
  assert not any("corpus_encoding" in w for w in train)  # only when CORPUS_ENCODING is given
  check_train_command(train)
  config = config_files.load_config_file(str(ROOT / "configs" / "adore.py:jax"))
  assert config.negatives.retrieval.backend == "jax" and config.model.train_towers == "query"
  with_encoding = dry_run("slurm_adore_8gpu.sh", CORPUS_ENCODING="/shared/msmarco-emb")
  assert "--config.negatives.retrieval.corpus_encoding=/shared/msmarco-emb" in with_encoding


def test_local_multiprocess_run():
  out = dry_run("local_multiprocess.sh")  # the defaults: 2 processes x 2 simulated CPU devices
  lines = out.splitlines()
  assert len(lines) == 2
  for rank, line in enumerate(lines):
    words = shlex.split(line)
    assert words[0].startswith("JDR_COORDINATOR=127.0.0.1:")
    assert words[1:3] == ["JDR_NUM_PROCESSES=2", f"JDR_PROCESS_ID={rank}"]
    [flags] = [w for w in words if w.startswith("XLA_FLAGS=")]  # the caller's flags, then the device count
    assert flags.split()[-1] == "--xla_force_host_platform_device_count=2", flags
    check_train_command(words)
    # The global batch must split over the 2 x 2 devices of the mesh.
    config = config_files.load_config_file(str(ROOT / words[words.index("--config") + 1]))
    assert config.batch_size % 4 == 0
  assert len(dry_run("local_multiprocess.sh", PROCESSES="3").splitlines()) == 3
