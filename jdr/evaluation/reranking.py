"""Reranking with a cross-encoder: a scorer of (query, document) pairs and the reranking of a first-stage run.

`make_scorer` scores `[CLS] q [SEP] d [SEP]` pairs (the document as `title text`, truncated to fit
`max_length` with the query whole) in length buckets (a few compiled shapes); `rerank` reorders each query's
top `depth` by it and keeps the documents below the depth in first-stage order beneath them. Used by
`python -m jdr.rerank`, the trainer's cross-encoder evaluation and FGD's teacher (jdr/training/distill.py).
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from jdr.retrieval import encoder_runtime
from jdr.data import formats
from jdr.data import text as text_lib


def make_token_scorer(model, params, pad_id: int, *, max_length: int = 256, batch_size: int | None = None
                      ) -> Callable[[Sequence[tuple[Sequence[int], Sequence[int]]]], np.ndarray]:
  """(token ids, token type ids) of joined pairs -> cross-encoder logits [N], float32, in order; pairs are
  batched by length bucket (few compiled shapes); `score.warm_up()` compiles every bucket.

  `batch_size` None sizes each bucket's batch like jdr.encode: about the device's tokens per batch (1,024 on
  CPU, where big [batch, heads, L, L] attention blocks fall out of cache; 16,384 on accelerators), a power of
  two of rows."""
  apply = jax.jit(lambda p, ids, mask, types: model.apply({"params": p}, ids, mask, types))
  buckets = text_lib.default_bucket_lengths(max_length)
  tokens = encoder_runtime.default_tokens_per_batch()

  def rows_for(length: int) -> int:
    if batch_size:
      return batch_size
    return 1 << max(0, int(np.log2(max(1, tokens // length))))

  def score(encoded: Sequence[tuple[Sequence[int], Sequence[int]]]) -> np.ndarray:
    out = np.zeros((len(encoded),), np.float32)
    if not encoded:
      return out
    ids, types = [e[0] for e in encoded], [e[1] for e in encoded]
    longest = max(len(x) for x in ids)
    if longest > max_length:
      raise ValueError(f"a pair of {longest} tokens is longer than the scorer's {max_length}")
    order = np.argsort([-len(x) for x in ids], kind="stable")  # similar lengths share a batch
    start = 0
    while start < len(order):
      length = next(b for b in buckets if b >= len(ids[order[start]]))  # the longest left sets the bucket
      size = rows_for(length)
      rows = order[start:start + size]
      start += size
      batch_ids = np.full((size, length), pad_id, np.int32)
      batch_types = np.zeros((size, length), np.int32)
      mask = np.zeros((size, length), np.int32)
      for i, r in enumerate(rows):
        batch_ids[i, :len(ids[r])] = ids[r]
        mask[i, :len(ids[r])] = 1
        batch_types[i, :len(types[r])] = types[r]
      logits = apply(params, jnp.asarray(batch_ids), jnp.asarray(mask), jnp.asarray(batch_types))
      out[rows] = np.asarray(logits)[:len(rows)]
    return out

  def warm_up() -> None:
    """Compiles every bucket's shape, so timings that follow measure scoring alone."""
    for length in buckets:
      zeros = jnp.zeros((rows_for(length), length), jnp.int32)
      jax.block_until_ready(apply(params, zeros, zeros.at[:, 0].set(1), zeros))

  score.warm_up = warm_up
  return score


def make_scorer(model, params, tokenizer, *, max_length: int = 256, batch_size: int | None = None,
                query_max_length: int | None = None) -> Callable[[Sequence[tuple[str, str]]], np.ndarray]:
  """(query, document text) pairs -> cross-encoder logits [N], float32, in the pairs' order (the input of
  jdr.data.text.pairs_tokens: the query whole unless `query_max_length` caps it)."""
  tokens = make_token_scorer(model, params, tokenizer.pad_token_id or 0, max_length=max_length,
                             batch_size=batch_size)

  def score(pairs: Sequence[tuple[str, str]]) -> np.ndarray:
    return tokens(text_lib.pairs_tokens(tokenizer, list(pairs), max_length, query_max_length))

  score.warm_up = tokens.warm_up
  return score


def check_inputs(run: Mapping[str, Mapping[str, float]], queries: Mapping[str, str],
                 corpus: Mapping[str, formats.Doc], depth: int, run_path: str = "run") -> None:
  """Refuses a run whose queries or top-`depth` documents have no text, naming the run file."""
  missing_queries = [q for q in run if q not in queries]
  if missing_queries:
    raise ValueError(f"{run_path}: {len(missing_queries)} queries have no text in --queries "
                     f"(e.g. {missing_queries[:3]})")
  missing_docs = sorted({d for q in run for d in list(run[q])[:depth] if d not in corpus})
  if missing_docs:
    raise ValueError(f"{run_path}: {len(missing_docs)} documents are not in --corpus (e.g. {missing_docs[:3]})")


def rerank(run: Mapping[str, Mapping[str, float]], queries: Mapping[str, str], corpus: Mapping[str, formats.Doc],
           score: Callable, depth: int, *, run_path: str = "run", progress: bool = True) -> dict:
  """The reranked run: each query's top `depth` by cross-encoder score, then the rest in first-stage order."""
  check_inputs(run, queries, corpus, depth, run_path)
  out = {}
  for qid in tqdm.tqdm(run, desc="rerank", unit="query", disable=not progress, mininterval=5.0):
    ranked = list(run[qid])
    head, tail = ranked[:depth], ranked[depth:]
    scores = score([(queries[qid], text_lib.doc_text(corpus[d])) for d in head])
    reranked = {d: float(s) for d, s in zip(head, scores)}
    floor = min(reranked.values(), default=0.0)
    # Below the reranked block, in first-stage order: strictly decreasing scores under its minimum.
    reranked.update({d: floor - 1.0 - i for i, d in enumerate(tail)})
    out[qid] = reranked
  return out
