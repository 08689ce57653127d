"""The launchers' dry runs: the exact commands for a 4-worker TPU slice, a 2-node x 8-GPU SLURM job and a
2-process local job. (The local launcher runs for real in tests/test_train.py::test_two_processes_equal_one.)"""

import shlex

import pytest

from jdr.launch import local, slurm, tpu

TRAIN = ["python", "-m", "jdr.train", "--config", "configs/inbatch.py", "--workdir", "gs://bucket/run"]


def test_tpu_dry_run_for_a_four_worker_slice(capsys):
  assert tpu.main(["--tpu", "jdr-v4-32", "--zone", "us-central2-b", "--project", "p", "--workers", "4",
                   "--copy", ".", "--setup", "pip install -e '.[tpu]'", "--dry-run", "--", *TRAIN]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert shlex.split(lines[0][2:]) == ["gcloud", "compute", "tpus", "tpu-vm", "scp", "--recurse", ".",
                                       "jdr-v4-32:~/jdr", "--worker=all", "--zone", "us-central2-b", "--project", "p"]
  assert shlex.split(lines[1][2:])[-1] == "cd ~/jdr && pip install -e '.[tpu]'"
  assert shlex.split(lines[2][2:])[-1] == "cd ~/jdr && " + shlex.join(TRAIN)
  assert "--worker=all" in lines[2] and sum(l.startswith("# worker") for l in lines) == 4


def test_slurm_dry_run_two_nodes_eight_gpus(capsys):
  assert slurm.main(["--nodes", "2", "--gpus-per-node", "8", "--per", "gpu", "--partition", "gpu", "--time",
                     "12:00:00", "--dry-run", "--", *TRAIN]) == 0
  out = capsys.readouterr().out
  for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
               "#SBATCH --partition=gpu", "#SBATCH --time=12:00:00", "$ sbatch jdr-job.sbatch"):
    assert line in out
  srun = next(l for l in out.splitlines() if l.startswith("srun"))
  task = shlex.split(srun)[-1]
  assert 'JDR_PROCESS_ID="$SLURM_PROCID"' in task and 'CUDA_VISIBLE_DEVICES="$SLURM_LOCALID"' in task
  assert task.endswith("exec " + shlex.join(TRAIN))
  # One task per host: no per-GPU pinning, one task per node.
  assert slurm.main(["--nodes", "2", "--dry-run", "--", *TRAIN]) == 0
  out = capsys.readouterr().out
  assert "#SBATCH --ntasks-per-node=1" in out and "CUDA_VISIBLE_DEVICES" not in out


def test_local_dry_run(capsys):
  assert local.main(["--processes", "2", "--devices-per-process", "4", "--port", "4321", "--dry-run", "--",
                     *TRAIN]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert len(lines) == 2
  for rank, line in enumerate(lines):
    assert line.startswith(f"JDR_COORDINATOR=127.0.0.1:4321 JDR_NUM_PROCESSES=2 JDR_PROCESS_ID={rank} ")
    assert "--xla_force_host_platform_device_count=4" in line and line.endswith(shlex.join(TRAIN))


def test_simulated_devices_keep_the_callers_other_xla_flags():
  flags = "--xla_dump_to=/tmp/d --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
  assert local.xla_flags_with_devices(flags, 4).split() == [
      "--xla_dump_to=/tmp/d", "--xla_backend_optimization_level=0", "--xla_force_host_platform_device_count=4"]
  assert local.xla_flags_with_devices("", 2) == "--xla_force_host_platform_device_count=2"


@pytest.mark.slow
def test_two_hosts_encode_disjoint_shards_equal_to_one(tmp_path):
  """jdr.encode under the local launcher: 2 processes (jax.distributed) each read only their own part of the
  corpus file (half its bytes) and encode and write its shards, their 2 devices each encoding half of every
  batch's rows, and the directory equals a one-process, one-device encoding, ids and vectors."""
  import os  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from conftest import write_tiny_beir  # pylint: disable=g-import-not-at-top
  from jdr.retrieval import encodings  # pylint: disable=g-import-not-at-top
  data = write_tiny_beir(tmp_path / "data")
  encode = [sys.executable, "-m", "jdr.encode", "--model", "minilm", "--corpus", str(data), "--max-length", "16",
            "--shard-size", "7"]
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  launched = subprocess.run([sys.executable, "-m", "jdr.launch.local", "--processes", "2", "--devices-per-process",
                             "2", "--log-dir", str(tmp_path / "logs"), "--", *encode, "--out", str(tmp_path / "two")],
                            env=env, capture_output=True, text=True, timeout=600)
  assert launched.returncode == 0, launched.stderr[-3000:] + (tmp_path / "logs" / "process-1.log").read_text()[-2000:]
  log = (tmp_path / "logs" / "process-1.log").read_text()
  assert "host 1 of 2" in log and "2 local devices split" in log  # process 1 encoded shards on both devices
  subprocess.run([*encode, "--out", str(tmp_path / "one")], env=env, check=True, capture_output=True, timeout=600)
  two, two_ids, two_meta = encodings.load_embeddings(tmp_path / "two")
  one, one_ids, one_meta = encodings.load_embeddings(tmp_path / "one")
  assert two_ids == one_ids and two_meta["complete"] and one_meta["num_shards"] > 2
  assert sum(two_meta["part_docs"]) == 40 and min(two_meta["part_docs"]) > 0  # both hosts read a part
  assert not (tmp_path / "two" / ".part-ids").exists()  # the hosts' id lists, swapped before encoding, are gone
  np.testing.assert_allclose(two, one, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_bad_line_in_one_hosts_part_stops_every_host(tmp_path):
  """Host 1 alone reads the bad last line; both hosts exit with an error (none waits for ever), host 1's
  naming the file's own line and host 0's naming host 1."""
  import os  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  from conftest import write_tiny_beir  # pylint: disable=g-import-not-at-top
  data = write_tiny_beir(tmp_path / "data")
  with open(data / "corpus.jsonl", "a") as f:
    f.write("{not json\n")
  lines = (data / "corpus.jsonl").read_text().count("\n")
  encode = [sys.executable, "-m", "jdr.encode", "--model", "minilm", "--corpus", str(data), "--max-length", "16",
            "--out", str(tmp_path / "enc")]
  launched = subprocess.run([sys.executable, "-m", "jdr.launch.local", "--processes", "2", "--devices-per-process",
                             "1", "--log-dir", str(tmp_path / "logs"), "--", *encode],
                            env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=300)
  host1 = (tmp_path / "logs" / "process-1.log").read_text()
  assert launched.returncode != 0
  assert f"corpus.jsonl:{lines}" in host1 or f"line {lines}" in host1, host1[-2000:]
  assert "host(s) [1] failed reading their part" in launched.stderr, launched.stderr[-2000:]


@pytest.mark.slow
def test_an_id_in_two_hosts_parts_stops_both_before_encoding(tmp_path):
  """The second half of the corpus repeats a first-half id: both hosts stop before encoding anything, naming
  the id and the two parts."""
  import json  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  from conftest import write_tiny_beir  # pylint: disable=g-import-not-at-top
  data = write_tiny_beir(tmp_path / "data")
  first_id = json.loads((data / "corpus.jsonl").read_text().splitlines()[0])["_id"]
  with open(data / "corpus.jsonl", "a") as f:
    f.write(json.dumps({"_id": first_id, "title": "", "text": "the same id again"}) + "\n")
  encode = [sys.executable, "-m", "jdr.encode", "--model", "minilm", "--corpus", str(data), "--max-length", "16",
            "--out", str(tmp_path / "enc")]
  launched = subprocess.run([sys.executable, "-m", "jdr.launch.local", "--processes", "2", "--devices-per-process",
                             "1", "--log-dir", str(tmp_path / "logs"), "--", *encode],
                            env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=300)
  assert launched.returncode != 0
  message = f"doc id {first_id!r} is in the corpus parts of host 0 and host 1"
  assert message in launched.stderr, launched.stderr[-2000:]
  assert message in (tmp_path / "logs" / "process-1.log").read_text()
  assert not list((tmp_path / "enc").glob("emb-*"))  # nothing encoded
