"""Seconds the library spends in its named parts, for benchmarks to read rather than patch the library.

A part is timed where it is defined (`@timings.timed("encode_corpus")`), so a rename moves its timing with it;
a benchmark opens a `window()` around the work and reads each part's seconds and the moment its first call began.
Timing a part costs two clock reads a call: only coarse parts (a pass over a corpus, an evaluation) are timed.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
import time
from typing import Callable, Iterator

_lock = threading.Lock()
_seconds: collections.Counter = collections.Counter()
_first_start: dict[str, float] = {}


def timed(name: str) -> Callable:
  """Decorator: every call of the function adds its seconds to part `name`."""
  def decorate(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
      start = time.perf_counter()
      with _lock:
        _first_start.setdefault(name, start)
      try:
        return fn(*args, **kwargs)
      finally:
        with _lock:
          _seconds[name] += time.perf_counter() - start
    return wrapper
  return decorate


class Window:
  """The parts' seconds since the window opened (`seconds[name]`, 0 for a part not called) and when each part's
  first call in it began (`first_start[name]`, perf_counter time; absent when it was not called)."""

  def __init__(self):
    with _lock:
      self._base = collections.Counter(_seconds)
      self._first_before = dict(_first_start)
      _first_start.clear()
    self.seconds: collections.Counter = collections.Counter()
    self.first_start: dict[str, float] = {}

  def close(self) -> None:
    with _lock:
      self.seconds = collections.Counter({k: v - self._base.get(k, 0.0) for k, v in _seconds.items()})
      self.first_start = dict(_first_start)
      for key, value in self._first_before.items():
        _first_start.setdefault(key, value)


@contextlib.contextmanager
def window() -> Iterator[Window]:
  """The parts' seconds while the block runs (read them after it)."""
  w = Window()
  try:
    yield w
  finally:
    w.close()
