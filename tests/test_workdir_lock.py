"""One run per output folder: a second launch on a live run's workdir refuses in one line naming the owner,
a lock left by a killed run is taken over, and --force takes the folder anyway."""

import json
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from jdr.runtime import workdir_lock

ROOT = pathlib.Path(__file__).resolve().parents[1]

HOLDER = """
import sys, time
from jdr.runtime import workdir_lock
with workdir_lock.held(sys.argv[1], "holder"):
  print("held", flush=True)
  time.sleep(600)
"""


def _hold(folder):
  proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)], stdout=subprocess.PIPE, text=True)
  assert proc.stdout.readline().strip() == "held"
  return proc


def test_second_holder_refused_naming_the_owner_then_taken_after_it_dies(tmp_path, capsys):
  holder = _hold(tmp_path / "w")
  try:
    with pytest.raises(workdir_lock.Busy, match=rf"{tmp_path / 'w'} is in use by pid {holder.pid} on .* \(holder\)"):
      with workdir_lock.held(tmp_path / "w", "second"):
        pass
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait()
  # Killed without releasing: the kernel dropped its lock, the file still names it.
  assert json.loads((tmp_path / "w" / ".jdr-lock").read_text())["pid"] == holder.pid
  with workdir_lock.held(tmp_path / "w", "third"):
    assert "which has ended: taken over" in capsys.readouterr().err
    assert json.loads((tmp_path / "w" / ".jdr-lock").read_text())["command"] == "third"
  assert (tmp_path / "w" / ".jdr-lock").read_text() == ""  # reclaimd cleanly
  with workdir_lock.held(tmp_path / "w", "fourth"):
    assert capsys.readouterr().err == ""


def test_force_takes_a_live_owners_folder(tmp_path, capsys):
  holder = _hold(tmp_path / "w")
  try:
    with workdir_lock.held(tmp_path / "w", "forced", force=True):
      assert f"taking it from pid {holder.pid}" in capsys.readouterr().err
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait()


@pytest.mark.slow
def test_two_trainings_on_one_workdir_one_refused(tmp_path):
  from conftest import write_tiny_beir  # pylint: disable=g-import-not-at-top
  data = write_tiny_beir(tmp_path / "data")
  command = [sys.executable, "-m", "jdr.train", "--config", str(ROOT / "configs" / "demo.py:tiny"), "--workdir",
             str(tmp_path / "w"), f"--config.data.dataset={data}", "--config.data.eval_split=",
             "--config.batch_size=4", "--config.data.query_max_length=16", "--config.data.doc_max_length=32"]
  holder = _hold(tmp_path / "w")
  try:
    proc = subprocess.run(command + ["--config.num_train_steps=2"], capture_output=True, text=True, timeout=300)
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait()
  assert proc.returncode == 2 and "Traceback" not in proc.stderr
  assert proc.stderr.strip().splitlines()[-1].startswith(f"error: {tmp_path / 'w'} is in use by pid {holder.pid}")
  assert sorted(p.name for p in (tmp_path / "w").iterdir()) == [".jdr-lock"]  # nothing written


def test_object_storage_claim_refuses_a_live_owner_and_takes_an_expired_one(fake_gcs, monkeypatch, capsys):
  from etils import epath  # pylint: disable=g-import-not-at-top
  folder = "gs://bucket/w"
  with workdir_lock.held(folder, "first"):
    claim = json.loads(epath.Path(folder, ".jdr-claim").read_text())
    assert claim["command"] == "first" and claim["expires"] > time.time() + 200
    with pytest.raises(workdir_lock.Busy, match="is in use by pid .* \\(first\\)"):
      with workdir_lock.held(folder, "second"):
        pass
  assert not epath.Path(folder, ".jdr-claim").exists()  # reclaimd
  # A claim whose owner died without releasing it: refused until it expires, then taken over.
  epath.Path(folder, ".jdr-claim").write_text(json.dumps({"host": "h", "pid": 1, "started": "t",
                                                          "command": "dead", "expires": time.time() - 1}))
  with workdir_lock.held(folder, "third"):
    assert "which has expired: taken over" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("command", ["encode", "mine", "reproduce"])
def test_encode_mine_and_reproduce_refuse_a_busy_out(tmp_path, command):
  from conftest import write_tiny_beir  # pylint: disable=g-import-not-at-top
  data = write_tiny_beir(tmp_path / "data")
  out = tmp_path / "out"
  args = {"encode": ["jdr.encode", "--model", "minilm", "--corpus", data, "--out", out],
          "mine": ["jdr.mine", "--data", data, "--out", out],
          "reproduce": ["jdr.reproduce", "inbatch-ablation", "--tiny", "--out", out]}[command]
  holder = _hold(out)
  try:
    proc = subprocess.run([sys.executable, "-m", *map(str, args)], capture_output=True, text=True, timeout=300)
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait()
  assert proc.returncode == 2 and "Traceback" not in proc.stderr
  assert proc.stderr.strip().splitlines()[-1].startswith(f"error: {out} is in use by pid {holder.pid}")
  assert sorted(p.name for p in out.iterdir()) == [".jdr-lock"]
