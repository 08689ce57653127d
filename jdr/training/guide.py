"""In-batch false negatives removed by a guide (GISTEmbed, Solatorio 2024): a candidate that a guide model scores
above the row's own positive is probably relevant too, so it is masked like a positive instead of being pushed
away.

What a config turns on (the group `negatives.guide`, read here alone: `model`, `margin`):

  ""            off
  "self"        the model being trained: its own scores, in the step, under stop_gradient (no extra encoder)
  a model       a frozen guide read once: a bi-encoder (a jdr workdir or export, a Hugging Face or
                sentence-transformers directory, `minilm`) encoding each batch's queries and documents, or a
                cross-encoder (a jdr one, a Hugging Face sequence classifier) scoring each (query, candidate)
                of the batch; on the host, before the step

A valid negative column c of row b is masked when guide(b, c) > guide(b, positive of b) - margin
(sentence-transformers' GISTEmbedLoss, margin_strategy="absolute": margin 0 masks what the guide ranks above the
positive; a negative margin masks only what it ranks above by more). The count masked per batch is logged as
train/masked_by_guide. Exact duplicates and known positives are masked before any guide, by the batch layout
(`jdr.data.batch.candidate_mask`).
"""

from __future__ import annotations

import json
import pathlib
import sys
from typing import Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from jdr.data import text as text_lib

SELF = "self"


def enabled(guide: ml_collections.ConfigDict) -> bool:
  """Whether `negatives.guide` (the group) turns a guide on."""
  return bool(guide.model)


def on_host(guide: ml_collections.ConfigDict) -> bool:
  """Whether the guide is a frozen model scoring each batch on the host (`HostGuide`), not the model itself."""
  return enabled(guide) and guide.model != SELF


def self_margin(guide: ml_collections.ConfigDict) -> float | None:
  """The margin the step masks by with the model's own scores (guide "self"); None for any other guide."""
  return guide.margin if guide.model == SELF else None


def check(guide: ml_collections.ConfigDict, candidates: str, architecture: str) -> None:
  """Refuses a guide the run cannot use, before anything is read (`candidates`: the batches' candidate kind,
  `architecture`: model.architecture)."""
  if not enabled(guide):
    return
  margin = guide.margin
  if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not np.isfinite(margin):
    raise ValueError(f"negatives.guide.margin={margin!r}: a finite number")
  if candidates != "tokens" or architecture != "two_tower":
    raise ValueError("negatives.guide masks the candidates of two towers' token batches; "
                     f"this run's candidates are {candidates!r}: set negatives.guide.model=\"\"")


def masked(scores: jax.Array, valid: jax.Array, margin: float) -> tuple[jax.Array, jax.Array]:
  """(valid without the negatives the guide scores above the positive, how many were masked): scores [B, C] of
  the guide, column b row b's positive (the in-batch layout of jdr/data/batch.py), valid [B, C]. The positive
  column itself stays valid."""
  b, c = scores.shape
  target = jnp.arange(c)[None, :] == jnp.arange(b)[:, None]
  scores = jax.lax.stop_gradient(scores.astype(jnp.float32))
  positive = jnp.sum(jnp.where(target, scores, 0.0), axis=1, keepdims=True)
  drop = valid.astype(bool) & ~target & (scores > positive - margin)
  return valid.astype(bool) & ~drop, jnp.sum(drop)


def masked_numpy(scores: np.ndarray, valid: np.ndarray, margin: float) -> tuple[np.ndarray, int]:
  """`masked` on the host, for a guide scored there."""
  b, c = scores.shape
  target = np.arange(c)[None, :] == np.arange(b)[:, None]
  positive = scores[np.arange(b), np.arange(b)][:, None]
  drop = valid.astype(bool) & ~target & (scores > positive - margin)
  return valid.astype(bool) & ~drop, int(drop.sum())


def _is_cross_encoder(path: str, is_jdr: bool, description) -> bool:
  """A jdr cross-encoder, or a Hugging Face directory of a sequence classifier (a reranker's one logit)."""
  if is_jdr:
    return description(path).get("architecture") == "cross_encoder"
  config = pathlib.Path(path) / "config.json"
  if path == "minilm" or (pathlib.Path(path) / "modules.json").exists() or not config.exists():
    return False
  return any(a.endswith("ForSequenceClassification") for a in json.loads(config.read_text()).get("architectures") or ())


class HostGuide:
  """A frozen guide model scoring every batch on the host: `complete(batch, layout)` masks the batch's `valid`
  ([this process's rows, C]) from the guide's scores of the global layout (query ids, document ids, valid).
  `guide` is the group `negatives.guide`; the texts are read at the training lengths (data.query_max_length,
  data.doc_max_length)."""

  def __init__(self, guide: ml_collections.ConfigDict, data, query_length: int, doc_length: int):
    # pylint: disable=g-import-not-at-top  (model code loads with the guide)
    from jdr.models import build
    from jdr.models import cross
    from jdr.models import saved
    from jdr.retrieval import encoder_runtime
    self.data, self.margin = data, float(guide.margin)
    self.path = guide.model
    self.query_length, self.doc_length = query_length, doc_length
    self._masked, self._batches = 0, 0
    resolved = build.resolve_model(self.path)
    if _is_cross_encoder(resolved, build.is_jdr_model(resolved), saved.description):
      from jdr.evaluation import reranking
      model, params, tokenizer = cross.load_cross_encoder(resolved)
      self._pairs = reranking.make_scorer(model, params, tokenizer,
                                          max_length=min(self.query_length + self.doc_length + 3,
                                                         model.config.max_length))
      self._runtimes = None
    else:
      self._pairs = None
      # The texts as long as the training batch reads them, not the guide's own serving length.
      self._runtimes = {side: encoder_runtime.load_runtime(resolved, side=side, max_length=length)
                        for side, length in (("query", self.query_length), ("doc", self.doc_length))}
    kind = "cross-encoder" if self._pairs is not None else "bi-encoder"
    print(f"negatives.guide.model: {self.path} ({kind}) masks in-batch negatives it scores above the positive "
          f"- {self.margin:g}", file=sys.stderr)

  def scores(self, qids: Sequence[str], doc_ids: Sequence[str], valid: np.ndarray) -> np.ndarray:
    """The guide's scores [B, C] of the layout (-inf where a column is not valid for a cross-encoder, which
    scores only the valid pairs and the positives)."""
    from jdr.retrieval import encoder_runtime  # pylint: disable=g-import-not-at-top
    queries = [self.data.queries[q] for q in qids]
    docs = [text_lib.doc_text(self.data.corpus[d]) for d in doc_ids]
    if self._pairs is None:
      q = encoder_runtime.encode_texts(self._runtimes["query"], queries)
      d = encoder_runtime.encode_texts(self._runtimes["doc"], docs)
      return np.asarray(q, np.float32) @ np.asarray(d, np.float32).T
    cells = np.argwhere(valid.astype(bool) | (np.arange(len(doc_ids))[None, :] == np.arange(len(qids))[:, None]))
    out = np.full(valid.shape, -np.inf, np.float32)
    out[cells[:, 0], cells[:, 1]] = self._pairs([(queries[b], docs[c]) for b, c in cells])
    return out

  def complete(self, batch: dict, layout: tuple[list[str], list[str], np.ndarray], rows: tuple[int, int]) -> dict:
    """`batch` with its `valid` masked; `rows` = (first, last + 1) of this process's query rows."""
    qids, doc_ids, valid = layout
    kept, count = masked_numpy(self.scores(qids, doc_ids, valid), valid, self.margin)
    self._masked += count
    self._batches += 1
    return {**batch, "valid": kept[rows[0]:rows[1]]}

  def log_scalars(self) -> dict[str, float]:
    """Negatives masked per batch since the last call."""
    if not self._batches:
      return {}
    out = {"masked_by_guide": self._masked / self._batches}
    self._masked, self._batches = 0, 0
    return out
