"""Where training metrics go: a JSON-lines log and TensorBoard in the workdir (host 0 only).

The workdir may be on object storage (gs://...), which has no appending: there the log is kept in memory and
the whole object rewritten at each write (a few KB; metrics are written every log_every steps).
"""

import json
import sys
import time

import jax

from jdr.runtime import atomic
from jdr.runtime import paths


def _summary_writer_class():
  """tensorboardX's SummaryWriter, imported with torch kept out.

  tensorboardX imports torch, when it is installed, only to accept torch tensors as values; jdr writes Python
  floats, and that import costs seconds in every training process. A torch imported before is used as it is.
  """
  blocked = "torch" not in sys.modules
  if blocked:
    sys.modules["torch"] = None  # `import torch` raises ImportError, which tensorboardX expects without torch
  try:
    from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
  finally:
    if blocked:
      del sys.modules["torch"]  # a later `import torch` (a benchmark's reference) finds the real one
  return SummaryWriter


class MetricWriter:
  """Appends {"step", "time", **scalars} to WORKDIR/metrics.jsonl and writes TensorBoard scalars.

  `start_step`, the step the trainer starts from: a resumed run (start_step > 0) keeps the records up to it
  and drops later ones, which the run it resumes logged after its last checkpoint and which this one logs
  again; a run from step 0 starts a new log. So the log holds each step once, in order. None appends.
  """

  def __init__(self, workdir: paths.PathLike, *, tensorboard: bool = True, start_step: int | None = None):
    self.active = jax.process_index() == 0
    self.path = paths.as_path(workdir) / "metrics.jsonl"
    self._remote_lines = None
    if self.active:
      kept = [line for line, record in _records(self.path)
              if start_step is None or 0 < start_step and record["step"] <= start_step]
      if not paths.is_local(self.path):
        self._remote_lines = kept
      if self.path.exists() and start_step is not None:
        atomic.write_text(self.path, "".join(kept))
    self._tb = None
    if self.active and tensorboard:
      try:
        SummaryWriter = _summary_writer_class()  # pylint: disable=invalid-name
        # tensorboardX writes gs:// and s3:// itself (with google-cloud-storage / boto3 installed).
        # purge_step hides the events past the resumed step that the earlier run wrote.
        self._tb = SummaryWriter(str(paths.as_path(workdir) / "tensorboard"),
                                 purge_step=start_step + 1 if start_step else None)
      except ImportError:
        self._tb = None  # the JSON-lines log still has everything
      except Exception as e:  # pylint: disable=broad-except  (a missing cloud client must not stop training)
        print(f"jdr: no TensorBoard events ({type(e).__name__}: {e}); metrics.jsonl has every scalar", file=sys.stderr)
        self._tb = None

  def recorded(self, step: int, prefix: str) -> dict[str, float]:
    """The scalars named `prefix`... that the log kept for `step` (a finished run's final evaluation), without
    the prefix; {} when none."""
    found = {}
    for _, record in _records(self.path) if self.active else []:
      if record["step"] == step:
        found.update({k[len(prefix):]: v for k, v in record.items() if k.startswith(prefix)})
    return found

  def write(self, step: int, scalars: dict[str, float]) -> None:
    if not self.active:
      return
    record = {"step": int(step), "time": round(time.time(), 3), **{k: float(v) for k, v in scalars.items()}}
    line = json.dumps(record) + "\n"
    if self._remote_lines is None:
      try:
        with open(paths.local(self.path), "a", encoding="utf-8") as f:
          f.write(line)
      except OSError as e:
        raise atomic.naming(e, self.path) from None
    else:
      self._remote_lines.append(line)
      atomic.write_text(self.path, "".join(self._remote_lines))
    if self._tb is not None:
      for key, value in scalars.items():
        self._tb.add_scalar(key, float(value), int(step))

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()


def _records(path) -> list[tuple[str, dict]]:
  """(line, record) of each whole line; a last line cut short by a killed run is dropped."""
  out = []
  for line in path.read_text().splitlines(keepends=True) if path.exists() else []:
    try:
      out.append((line, json.loads(line)))
    except ValueError:
      continue
  return [(line, record) for line, record in out if line.endswith("\n")]


def read(workdir: paths.PathLike) -> list[dict]:
  path = paths.as_path(workdir) / "metrics.jsonl"
  return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
