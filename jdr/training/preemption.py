"""Stopping a training run on SIGTERM or SIGINT at a step boundary, with a checkpoint of that step.

A TPU VM, a SLURM job or a spot instance sends SIGTERM some seconds before it takes the machine; Ctrl-C sends
SIGINT. Either asks the trainer to finish the step in flight, checkpoint it and exit with the status a death by
that signal has (143, 130), so that the same command run again resumes with no step lost. A second signal ends
the process at once: the first puts back the system's default action, which does not wait for Python.

On several hosts a signal may reach them at different steps, or reach one of them only. Every host asks at
every step whether any host was signalled (one small all-gather), so all of them stop after the same step and
save the same checkpoint, as `multihost_utils.reached_preemption_sync_point` does for the notices it sees.
"""

import os
import shlex
import signal
import sys
import threading

import jax
import numpy as np

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stopped(Exception):
  """Training stopped on a signal after the checkpoint of `step` was written in `workdir`."""

  def __init__(self, signum: int, step: int, workdir):
    self.signum, self.step, self.workdir = signum, step, workdir
    super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}; its checkpoint is in "
                     f"{workdir}/checkpoints")

  @property
  def exit_status(self) -> int:
    return 128 + self.signum


class StopRequests:
  """`with StopRequests() as stop:` (or install() ... restore()) catches SIGTERM / SIGINT; `stop.requested()` says, the same on every host,
  whether to stop after the step just taken. Outside the main thread (where Python cannot catch signals) it
  catches nothing and never asks to stop."""

  def __init__(self):
    self.signum: int | None = None
    self._previous: dict[int, object] = {}

  def install(self) -> "StopRequests":
    if threading.current_thread() is threading.main_thread():
      for signum in SIGNALS:
        self._previous[signum] = signal.signal(signum, self._handle)
    return self

  def restore(self) -> None:
    if self.signum is None:  # after a signal the defaults stay, so that a second one still ends the process
      for signum, handler in self._previous.items():
        signal.signal(signum, handler)
    self._previous = {}

  def __enter__(self) -> "StopRequests":
    return self.install()

  def __exit__(self, *exc) -> None:
    self.restore()

  def _handle(self, signum: int, frame) -> None:
    del frame
    self.signum = self.signum or signum
    for other in SIGNALS:
      signal.signal(other, signal.SIG_DFL)
    # os.write, not print: the handler may run in the middle of another write to stderr (the progress bar).
    os.write(2, f"\njdr: {signal.Signals(signum).name}: finishing the step in flight, then saving it; "
                f"send it again to stop at once, without saving\n".encode())

  def requested(self) -> bool:
    """Whether any host was signalled; on several hosts a collective, so every host must call it each step."""
    if jax.process_count() == 1:
      return self.signum is not None
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    signalled = np.asarray(multihost_utils.process_allgather(np.int32(self.signum or 0))).ravel()
    if self.signum is None and signalled.any():
      self.signum = int(signalled[signalled > 0][0])
    return self.signum is not None


def resume_line(stopped: Stopped, argv: list[str], command: str = "jdr.train") -> str:
  """The one line a stopped `python -m COMMAND` prints: where it stopped and the command that resumes."""
  return f"{stopped}; resume with: python -m {command} {shlex.join(argv)}"


def exit_stopped(stopped: Stopped, argv: list[str], command: str = "jdr.train") -> None:
  """Prints the resume line and ends the process with the signal's status. os._exit: a background mine that
  a resume redoes from its saved snapshot may still be inside XLA, where tearing the interpreter down under it
  could crash the process after the checkpoint was saved."""
  print(resume_line(stopped, argv, command), file=sys.stderr)
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(stopped.exit_status)
