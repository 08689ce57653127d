"""Timing two systems' steps in turns, so that both see the same minutes of the host.

Run one after the other, jdr's steps and the reference's saw different minutes of a shared host: on a virtual
2-core EPYC, PyTorch's MiniLM training step alone took 2.6 s one day and 3.0-3.5 s the next, so a ratio
taken from two back-to-back timings moved with the host rather than the code. Timed in turns, both sides see
the same minutes. A turn is several steps, not one: alternating jdr and PyTorch every step slowed jdr's
one-device step from 2.6 to 4.75 s (the other side's threads still waking), which no user's run has; the
untimed step that opens each turn absorbs it.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np


def median_seconds(runners: dict[str, Callable[[int], None]], steps: int, turns: int = 3) -> dict[str, float]:
  """Median seconds of each runner's step over `steps` timed steps, taken in `turns` turns.

  A runner is called with the step's index: 0 for the untimed steps (the warm-up, which compiles, and the
  step opening each turn), 1 to `steps` for the timed ones, so a runner can feed each step its own batch.
  Each turn runs every runner in order: its untimed step, then its share of the timed ones.
  """
  if steps < 1:
    raise ValueError(f"steps={steps}: at least one step is timed")
  for run_step in runners.values():
    run_step(0)  # warm-up: compilation for jax, allocator warm-up for torch
  times: dict[str, list[float]] = {name: [] for name in runners}
  turns = max(1, min(turns, steps))
  done = 0
  for turn in range(turns):
    share = steps // turns + (turn < steps % turns)
    for name, run_step in runners.items():
      run_step(0)
      for s in range(done + 1, done + share + 1):
        start = time.perf_counter()
        run_step(s)
        times[name].append(time.perf_counter() - start)
    done += share
  return {name: float(np.median(t)) for name, t in times.items()}
