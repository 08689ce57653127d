"""Running the public commands (`python -m jdr.train`, `jdr.encode`, ...) as the ablations' stages.

The ablations run every stage as the command a user would type, each a process of its own: the figures are
those of the commands, and on an accelerator several stages run at once (`--jobs`). Each command's stderr goes
to a log file beside its outputs; a failure raises with the log's tail.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import subprocess
import sys
from typing import Callable

from jdr.runtime import atomic
from jdr.training import metric_writers


# The experiments' tables were trained on one device: pinned, they rebuild bitwise on any CPU (the default
# splits a CPU into one device per core, which changes a float's last bits).
ONE_DEVICE = "--config.mesh.cpu_devices=0"


def command(module: str, *args: object) -> list[str]:
  """`python -m MODULE ARGS...` with this interpreter; jdr.train's on one device (ONE_DEVICE)."""
  return [sys.executable, "-m", module, *(str(a) for a in args), *([ONE_DEVICE] if module == "jdr.train" else [])]


def run_command(cmd: list[str], log: pathlib.Path) -> str:
  """Runs one command, its stderr appended to `log`; returns its stdout; raises with the log's tail."""
  log.parent.mkdir(parents=True, exist_ok=True)
  with open(log, "a", encoding="utf-8") as err:
    err.write(f"\n$ {' '.join(cmd)}\n")
    err.flush()
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True, check=False)
  if done.returncode:
    tail = log.read_text(encoding="utf-8", errors="replace").splitlines()[-15:]
    raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}; the end of {log}:\n" + "\n".join(tail))
  return done.stdout


def final_eval(workdir: pathlib.Path) -> dict[str, float]:
  """The metrics of a trainer workdir's last evaluation (its metrics.jsonl), without the "eval/" prefix."""
  evals = [r for r in metric_writers.read(workdir) if any(k.startswith("eval/") for k in r)]
  if not evals:
    raise RuntimeError(f"{pathlib.Path(workdir) / 'metrics.jsonl'}: no evaluation record")
  return {k[len("eval/"):]: v for k, v in evals[-1].items() if k.startswith("eval/")}


def shared_data(name: str) -> pathlib.Path:
  """A dataset of the shared data folder (jdr.data.shared), or an error naming where it was looked for."""
  from jdr.data import shared  # pylint: disable=g-import-not-at-top
  directory = shared.shared_dataset(name)
  if directory is None:
    raise FileNotFoundError(f"{shared.shared_data_dir() / name} is needed by the experiment and is absent")
  return directory


def record_device(out: pathlib.Path) -> dict:
  """OUT/device.json: where the runs ran (the figures of a GPU run and of a CPU run are not comparable),
  probed in a process of its own, as the stages see it; written once."""
  path = pathlib.Path(out) / "device.json"
  if not path.exists():
    probe = ("import jax, json; d = jax.devices()[0]; print(json.dumps({'platform': d.platform, "
             "'device_kind': d.device_kind, 'count': jax.device_count(), 'jax': jax.__version__}))")
    found = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_text(path, found)
  return json.loads(path.read_text())


def seeds_of(text: str) -> tuple[int, ...]:
  """--seeds' comma-separated seeds."""
  return tuple(int(s) for s in text.split(",") if s.strip())


def builtin_data(out: pathlib.Path) -> pathlib.Path:
  """The tiny mode's dataset: the built-in docstrings, written under OUT/data."""
  from jdr.data import builtin  # pylint: disable=g-import-not-at-top
  return builtin.write_builtin(pathlib.Path(out) / "data" / "stdlib-docstrings")


@contextlib.contextmanager
def finished_stages_kept():
  """Ctrl-C ends the experiment with status 130 and says the same command goes on from its finished stages."""
  try:
    yield
  except KeyboardInterrupt:
    print("jdr.reproduce: interrupted; finished stages are kept, and the same command goes on from there",
          file=sys.stderr)
    raise SystemExit(130) from None


def write_outputs(out: pathlib.Path, text: str, write_csv: Callable[[pathlib.Path], pathlib.Path]) -> str:
  """Writes OUT/table.md (`text`) and OUT/runs.csv (`write_csv`); returns `text`."""
  atomic.write_text(pathlib.Path(out) / "table.md", text)
  write_csv(out)
  return text
