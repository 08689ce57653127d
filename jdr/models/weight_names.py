"""How a Hugging Face checkpoint's tensors correspond to a Flax module's params: one `Entry` a tensor.

Every architecture (jdr.models.architectures) gives a table of these; jdr.models.hf reads and writes any of
them through it, so a name or shape that does not fit is reported the same way for every family.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np


@dataclasses.dataclass(frozen=True)
class Entry:
  hf_name: str
  path: tuple[str, ...]  # where the tensor lives in the Flax param tree
  hf_shape: tuple[int, ...]
  to_jdr: Callable[[np.ndarray], np.ndarray]
  to_hf: Callable[[np.ndarray], np.ndarray]


def same(x: np.ndarray) -> np.ndarray:
  return x


# torch Linear stores [out, in]; Flax kernels are [in, out].
LINEAR = (lambda w: w.T, lambda k: k.T)
SAME = (same, same)


def to_heads(hidden: int, heads: int, head_dim: int):
  """A projection into heads: torch [N*D, H] <-> Flax [H, N, D] (the heads split out of `out`)."""
  return (lambda w: w.T.reshape(hidden, heads, head_dim), lambda k: k.reshape(hidden, heads * head_dim).T)


def heads_bias(heads: int, head_dim: int):
  return (lambda b: b.reshape(heads, head_dim), lambda b: b.reshape(heads * head_dim))


def from_heads(hidden: int, heads: int, head_dim: int):
  """The attention output projection: torch [H, N*D] <-> Flax [N, D, H] (the heads split out of `in`)."""
  return (lambda w: w.T.reshape(heads, head_dim, hidden), lambda k: k.reshape(heads * head_dim, hidden).T)


class HFWeightsError(ValueError):
  """A checkpoint's tensors do not fit the encoder: lists every missing, unexpected and mis-shaped tensor."""

  def __init__(self, source: str, missing=(), unexpected=(), mismatched=(), family: str | None = None):
    self.source, self.missing, self.unexpected = source, list(missing), list(unexpected)
    self.mismatched = list(mismatched)  # (name, shape found, shape expected)
    self.family = family
    looked = f" (read as {family}, which its config.json and tensor names looked like)" if family else ""
    lines = [f"weights in {source} do not fit the encoder config{looked}:"]
    lines += [f"  missing tensor: {name}" for name in self.missing]
    lines += [f"  unexpected tensor: {name}" for name in self.unexpected]
    lines += [f"  shape mismatch: {name}: found {tuple(got)}, expected {tuple(want)}"
              for name, got, want in self.mismatched]
    super().__init__("\n".join(lines))
