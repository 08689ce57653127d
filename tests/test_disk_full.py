"""A full disk, for real: a 2 MiB tmpfs filled to its last kilobytes under each command's output. Every command
ends with one `error:` line naming the path and "No space left on device", status 2, no traceback. Mounting
needs root: elsewhere these tests skip, saying so."""

import pathlib
import shutil
import subprocess
import sys
import uuid

import pytest

from conftest import write_tiny_beir

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def full_disk(tmp_path):
  """A tmpfs of 2 MiB with 28 KiB left: (its path)."""
  mount = tmp_path / f"fs-{uuid.uuid4().hex[:6]}"
  mount.mkdir()
  if shutil.which("mount") is None or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
                                                     capture_output=True).returncode != 0:
    pytest.skip("mounting a small tmpfs needs root; the full-disk tests run where jdr's CI runs them")
  try:
    (mount / "filler").write_bytes(bytes(2020 * 1024))
    yield mount
  finally:
    subprocess.run(["umount", str(mount)], capture_output=True)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  root = tmp_path_factory.mktemp("disk-full")
  data = write_tiny_beir(root / "data")
  proc = subprocess.run([sys.executable, "-m", "jdr.train", "--config", str(ROOT / "configs" / "demo.py:tiny"),
                         "--workdir", str(root / "w"), f"--config.data.dataset={data}", "--config.num_train_steps=1",
                         "--config.data.eval_split=", "--config.batch_size=4"], capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, proc.stderr[-2000:]
  return root


@pytest.mark.slow
@pytest.mark.parametrize("command", ["encode", "mine", "export"])
def test_a_full_disk_is_one_line_naming_the_path(trained, full_disk, command):
  out = full_disk / "out"
  args = {"encode": ["--model", trained / "w", "--corpus", trained / "data", "--out", out, "--shard-size", 10],
          "mine": ["--data", trained / "data", "--out", out, "--depth", 10],
          "export": ["--workdir", trained / "w", "--out", out]}[command]
  proc = subprocess.run([sys.executable, "-m", f"jdr.{command}", *map(str, args)], capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
  assert len(errors) == 1 and errors[0].startswith(f"error: {out}") and "No space left on device" in errors[0]
