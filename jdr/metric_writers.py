"""Where training metrics go: a JSON-lines log and TensorBoard in the workdir (host 0 only)."""

import json
import pathlib
import time

import jax


class MetricWriter:
  """Appends {"step", "time", **scalars} to WORKDIR/metrics.jsonl and writes TensorBoard scalars."""

  def __init__(self, workdir: str | pathlib.Path, *, tensorboard: bool = True):
    self.active = jax.process_index() == 0
    self.path = pathlib.Path(workdir) / "metrics.jsonl"
    self._tb = None
    if self.active and tensorboard:
      try:
        from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
        self._tb = SummaryWriter(str(pathlib.Path(workdir) / "tensorboard"))
      except ImportError:
        self._tb = None  # the JSON-lines log still has everything

  def write(self, step: int, scalars: dict[str, float]) -> None:
    if not self.active:
      return
    record = {"step": int(step), "time": round(time.time(), 3), **{k: float(v) for k, v in scalars.items()}}
    with self.path.open("a") as f:
      f.write(json.dumps(record) + "\n")
    if self._tb is not None:
      for key, value in scalars.items():
        self._tb.add_scalar(key, float(value), int(step))

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()


def read(workdir: str | pathlib.Path) -> list[dict]:
  path = pathlib.Path(workdir) / "metrics.jsonl"
  return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
