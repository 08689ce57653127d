"""Outputs: written whole or not at all, with the umask's mode; a FIFO, a device or `-` written directly; a
write that fails is one `error:` line naming the output, with nothing partial left behind."""

import errno
import json
import os
import pathlib
import stat
import subprocess
import sys
import threading

import pytest

from jdr.runtime import atomic
from jdr.runtime import cli
from jdr.data import formats

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUN = {"q1": {"d1": 2.0, "d2": 1.0}, "q2": {"d2": 0.5}}


def test_files_get_the_umasks_mode(tmp_path):
  atomic.write_text(tmp_path / "a.json", "{}")
  assert stat.S_IMODE(os.stat(tmp_path / "a.json").st_mode) == 0o666 & ~atomic.UMASK


def test_a_fifo_is_written_not_replaced(tmp_path):
  fifo = tmp_path / "run.fifo"
  os.mkfifo(fifo)
  got = []
  reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
  reader.start()
  formats.write_run(fifo, RUN)
  reader.join(timeout=30)
  assert got and got[0].splitlines()[0] == "q1 Q0 d1 1 2.0 jdr"
  assert stat.S_ISFIFO(os.stat(fifo).st_mode)
  assert [p.name for p in tmp_path.iterdir()] == ["run.fifo"]


def test_dash_is_standard_output(capfd):
  formats.write_run("-", RUN)
  assert capfd.readouterr().out.splitlines() == ["q1 Q0 d1 1 2.0 jdr", "q1 Q0 d2 2 1.0 jdr", "q2 Q0 d2 1 0.5 jdr"]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full on this system")
def test_a_full_device_is_an_error_naming_it_and_stays_a_device(capsys):
  with pytest.raises(SystemExit) as e, cli.reporting_errors():
    formats.write_run("/dev/full", RUN)
  assert e.value.code == 2
  assert capsys.readouterr().err == "error: /dev/full: No space left on device\n"
  assert stat.S_ISCHR(os.stat("/dev/full").st_mode)


def test_a_failed_write_leaves_no_partial_file(tmp_path):
  def half_then_full(f):
    f.write(b"half")
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

  with pytest.raises(OSError) as e:
    atomic.write_atomic(tmp_path / "out.trec", half_then_full)
  assert e.value.filename == str(tmp_path / "out.trec") and e.value.errno == errno.ENOSPC
  assert list(tmp_path.iterdir()) == []


def _evaluate(tmp_path, *args):
  (tmp_path / "qrels.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\t1\nq2\td2\t1\n")
  formats.write_run(tmp_path / "run.trec", RUN)
  env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
  return subprocess.run([sys.executable, "-m", "jdr.evaluate", "--qrels", str(tmp_path / "qrels.tsv"), "--run",
                         str(tmp_path / "run.trec"), "--metrics", "mrr@10", "--json", *args],
                        capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.slow
def test_evaluate_per_query_to_stdout_and_to_a_full_device(tmp_path):
  proc = _evaluate(tmp_path, "--per-query", "-")
  assert proc.returncode == 0, proc.stderr
  assert json.loads(proc.stdout) == {"q1": {"mrr@10": 1.0}, "q2": {"mrr@10": 1.0}}  # the means went to stderr
  assert '{"mrr@10": 1.0}' in proc.stderr
  if os.path.exists("/dev/full"):
    proc = _evaluate(tmp_path, "--per-query", "/dev/full")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == "error: /dev/full: No space left on device"
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)


# After a failed orbax write, tensorstore's completion callbacks keep reporting "Event loop is closed" (as
# unraisable) for a while after the exception reached the caller; the caller then prints its one error line.
_LATE_REPORTS = """
import os, resource, sys, time
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
import numpy as np, orbax.checkpoint as ocp
from jdr.runtime import checkpoint
rng = np.random.default_rng(0)
params = {f"w{i}": rng.random((1000, 1000), dtype=np.float32) for i in range(8)}  # incompressible, 32 MB
try:
  with checkpoint.failed_writes_quiet(), ocp.StandardCheckpointer() as writer:
    writer.save(sys.argv[1], params, force=True)
except Exception:
  print("failed as expected", flush=True)
time.sleep(3)  # the callbacks' reports arrive here
os._exit(0)
"""


@pytest.mark.slow
def test_late_reports_of_a_failed_checkpoint_write_stay_quiet(tmp_path):
  proc = subprocess.run([sys.executable, "-c", _LATE_REPORTS, str(tmp_path / "ckpt")], capture_output=True,
                        text=True, cwd=ROOT, timeout=300)
  assert proc.stdout == "failed as expected\n", proc.stderr[-2000:]
  assert "Event loop is closed" not in proc.stderr, proc.stderr[-2000:]


def test_a_partial_folder_is_removed_even_while_late_writes_recreate_it(tmp_path):
  # Like tensorstore's writes still in flight after one of them failed: files keep appearing, parent folders
  # included, for a while after the removal starts.
  partial = tmp_path / ".export.tmp"
  (partial / "params" / "d").mkdir(parents=True)
  stop = threading.Event()

  def late_writes():
    for i in range(60):
      (partial / "params" / "d").mkdir(parents=True, exist_ok=True)
      (partial / "params" / "d" / f"chunk.{i}").write_bytes(b"x" * 4096)
      stop.wait(0.005)

  writer = threading.Thread(target=late_writes)
  writer.start()
  assert atomic.remove_tree(partial)
  writer.join()
  assert not partial.exists()
  assert atomic.remove_tree(tmp_path / "never-made")  # nothing to remove is no error


def test_a_short_numpy_write_on_a_full_disk_names_the_file_and_the_reason(tmp_path, monkeypatch):
  """numpy's C writer reports a full disk as "N requested and M written", without an errno: the error names
  the file and says "No space left on device" when the disk has no room left, "a short write" otherwise."""
  import errno as errno_lib  # pylint: disable=g-import-not-at-top
  import os as os_lib  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jdr.retrieval import encodings  # pylint: disable=g-import-not-at-top

  def short_write(f, array):
    raise OSError("32000 requested and 11232 written")
  monkeypatch.setattr(np, "save", short_write)
  real = os_lib.statvfs
  full = type("Stats", (), {"f_bavail": 0, "f_frsize": 4096})
  monkeypatch.setattr(os_lib, "statvfs", lambda p: full)
  with pytest.raises(OSError) as raised:
    encodings.save_npy(tmp_path / "emb-00000.npy", np.zeros((4, 2), np.float32))
  assert raised.value.errno == errno_lib.ENOSPC and raised.value.filename == str(tmp_path / "emb-00000.npy")
  assert "No space left on device" in str(raised.value)
  assert not list(tmp_path.iterdir())  # no partial file
  monkeypatch.setattr(os_lib, "statvfs", real)
  with pytest.raises(OSError, match="a short write"):
    encodings.save_npy(tmp_path / "emb-00000.npy", np.zeros((4, 2), np.float32))
