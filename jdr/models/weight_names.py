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


def params_from_table(table: list[Entry], tensors: dict, source: str, *, family: str | None = None,
                      duplicates=(), dtype=np.float32) -> dict:
  """transformers-named tensors -> the nested Flax param dict (numpy in `dtype`), through `table`; every
  missing, unexpected (and duplicated) or mis-shaped tensor reported at once by HFWeightsError."""
  known = {e.hf_name for e in table}
  missing = [e.hf_name for e in table if e.hf_name not in tensors]
  unexpected = list(duplicates) + sorted(set(tensors) - known)
  mismatched = [(e.hf_name, tensors[e.hf_name].shape, e.hf_shape) for e in table
                if e.hf_name in tensors and tuple(tensors[e.hf_name].shape) != e.hf_shape]
  if missing or unexpected or mismatched:
    raise HFWeightsError(source, missing, unexpected, mismatched, family=family)
  params: dict = {}
  for e in table:
    node = params
    for part in e.path[:-1]:
      node = node.setdefault(part, {})
    node[e.path[-1]] = np.ascontiguousarray(e.to_jdr(np.asarray(tensors[e.hf_name]).astype(dtype)))
  return params


def tensors_from_table(table: list[Entry], params, *, dtype=np.float32) -> dict:
  """The reverse of params_from_table: a nested param dict -> transformers-named numpy tensors in `dtype`."""
  flat = {}

  def walk(node, prefix):
    for key, value in node.items():
      if hasattr(value, "items"):
        walk(value, prefix + (key,))
      else:
        flat[prefix + (key,)] = value

  walk(params, ())
  name = lambda p: "/".join(p)
  missing = [name(e.path) for e in table if e.path not in flat]
  unexpected = sorted(name(p) for p in set(flat) - {e.path for e in table})
  tensors, mismatched = {}, []
  for e in table:
    if e.path not in flat:
      continue
    value = np.asarray(flat[e.path])
    # The jdr-side shape, derived from the HF shape through the same layout function (a zero-cost view).
    want = e.to_jdr(np.broadcast_to(np.float32(0), e.hf_shape)).shape
    if value.shape != want:
      mismatched.append((name(e.path), value.shape, want))
    else:
      tensors[e.hf_name] = np.ascontiguousarray(e.to_hf(value.astype(dtype)))
  if missing or unexpected or mismatched:
    raise HFWeightsError("params", missing, unexpected, mismatched)
  return tensors
