"""A damaged checkpoint is caught: each fault injected into the newest step of a real run's workdir, then the
same command run again resumes from the step before it, saying which step failed and why. The faults' reruns run
`python -m jdr.train` in the test's process (conftest.run_module); the run with no step left to resume from,
and the rerun of a finished workdir, are processes of their own, as a user's would be."""

import json
import pathlib
import shutil
import subprocess
import sys

import pytest

from conftest import run_module, write_tiny_beir

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = ["--config.model.init_from=", "--config.model.fresh=tiny", "--config.batch_size=4",
        "--config.data.query_max_length=16", "--config.data.doc_max_length=32", "--config.data.eval_split=",
        "--config.checkpoint_every=1", "--config.keep_checkpoints=3", "--config.log_every=1"]


def _args(workdir, data, steps, *extra):
  return ["--config", str(ROOT / "configs" / "demo.py"), "--workdir", str(workdir), f"--config.data.dataset={data}",
          *TINY, f"--config.num_train_steps={steps}", *extra]


def _train(workdir, data, steps, *extra):
  return subprocess.run([sys.executable, "-m", "jdr.train", *_args(workdir, data, steps, *extra)],
                        capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A workdir trained 3 steps, a checkpoint at each: copied by every test, which damages step 3."""
  root = tmp_path_factory.mktemp("faults")
  data = write_tiny_beir(root / "data")
  proc = _train(root / "w", data, 3)
  assert proc.returncode == 0, proc.stderr[-2000:]
  return root


def _largest_file(step_dir: pathlib.Path) -> pathlib.Path:
  return max((p for p in step_dir.rglob("*") if p.is_file() and p.name != "jdr_checksums.json"),
             key=lambda p: p.stat().st_size)


def _truncate(step):
  path = _largest_file(step)
  path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _zero(step):
  path = _largest_file(step)
  path.write_bytes(bytes(path.stat().st_size))


def _overwrite_40_bytes(step):
  path = _largest_file(step)
  raw = bytearray(path.read_bytes())
  middle = len(raw) // 2
  raw[middle:middle + 40] = bytes(255 - b for b in raw[middle:middle + 40])
  path.write_bytes(bytes(raw))


def _garbage_metadata(step):
  (step / "_CHECKPOINT_METADATA").write_text("{not json")


def _empty_meta(step):
  for path in (step / "meta").rglob("*"):
    if path.is_file():
      path.write_text("")


def _empty_folder(step):
  shutil.rmtree(step)
  step.mkdir()


@pytest.mark.slow
@pytest.mark.parametrize("damage", [_truncate, _zero, _overwrite_40_bytes, _garbage_metadata, _empty_meta,
                                    _empty_folder], ids=lambda f: f.__name__.strip("_"))
def test_damaged_newest_step_falls_back_to_the_one_before(trained, tmp_path, damage):
  workdir = shutil.copytree(trained / "w", tmp_path / "w")
  assert (workdir / "checkpoints" / "3" / "jdr_checksums.json").exists()  # sealed once orbax finished it
  damage(workdir / "checkpoints" / "3")
  proc = run_module("jdr.train", _args(workdir, trained / "data", 4))
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr
  assert f"checkpoint {workdir / 'checkpoints' / '3'} is damaged:" in proc.stderr
  assert "resuming from step 2, the newest checkpoint that verifies" in proc.stderr
  assert [p.name.split("-")[0] for p in (workdir / "checkpoints-damaged").iterdir()] == ["3"]
  steps = [json.loads(x)["step"] for x in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert steps == [1, 2, 3, 4]  # step 3 trained again, each step logged once


@pytest.mark.slow
def test_every_step_damaged_is_one_line_naming_them(trained, tmp_path):
  workdir = shutil.copytree(trained / "w", tmp_path / "w")
  for step in (1, 2, 3):
    _truncate(workdir / "checkpoints" / str(step))
  proc = _train(workdir, trained / "data", 4)
  assert proc.returncode == 2 and "Traceback" not in proc.stderr
  line = next(x for x in proc.stderr.splitlines() if x.startswith("error: "))
  assert "no checkpoint in the workdir verifies" in line and str(workdir / "checkpoints" / "1") in line


@pytest.mark.slow
def test_rerunning_a_finished_workdir_adds_no_record(trained, tmp_path):
  """Its final evaluation included: the re-run prints the recorded figures and writes nothing."""
  workdir = tmp_path / "w"
  command = lambda: _train(workdir, trained / "data", 2, "--config.data.eval_split=test",
                           "--config.eval_before_training=False")
  assert command().returncode == 0
  before = (workdir / "metrics.jsonl").read_text()
  assert sum('"eval/' in line for line in before.splitlines()) == 1
  proc = command()
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert (workdir / "metrics.jsonl").read_text() == before
  assert "already finished at step 2; its final evaluation, on record" in proc.stdout
