"""Rerank a first-stage run with a cross-encoder: `python -m jdr.rerank --model M ... --run R --out R2`.

  python -m jdr.rerank --model M --queries Q --corpus C --run R --depth 100 --out R2

The top `--depth` documents of each query in R are scored by the cross-encoder over `[CLS] q [SEP] d [SEP]`
(the document as `title text`, truncated to fit `--max-length` with the query whole) and reordered; the
documents below the depth keep their first-stage order beneath them, so the output ranks the same documents
as R. Pairs are scored in length buckets (a few compiled shapes). The time per query (tokenization included)
is printed with the depth, the numbers LTRe's Table 2 reports for reranking.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Callable, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from jdr import cli
from jdr.data import formats
from jdr.data import text as text_lib


def make_token_scorer(model, params, pad_id: int, *, max_length: int = 256, batch_size: int | None = None
                      ) -> Callable[[Sequence[tuple[Sequence[int], Sequence[int]]]], np.ndarray]:
  """(token ids, token type ids) of joined pairs -> cross-encoder logits [N], float32, in order; pairs are
  batched by length bucket (few compiled shapes); `score.warm_up()` compiles every bucket.

  `batch_size` None sizes each bucket's batch like jdr.encode: about the device's tokens per batch (1,024 on
  CPU, where big [batch, heads, L, L] attention blocks fall out of cache; 16,384 on accelerators), a power of
  two of rows."""
  from jdr import corpus  # pylint: disable=g-import-not-at-top
  apply = jax.jit(lambda p, ids, mask, types: model.apply({"params": p}, ids, mask, types))
  buckets = text_lib.default_bucket_lengths(max_length)
  tokens = corpus.default_tokens_per_batch()

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
  jdr.data.text.pair_tokens: the query whole unless `query_max_length` caps it)."""
  tokens = make_token_scorer(model, params, tokenizer.pad_token_id or 0, max_length=max_length,
                             batch_size=batch_size)

  def score(pairs: Sequence[tuple[str, str]]) -> np.ndarray:
    return tokens([text_lib.pair_tokens(tokenizer, q, d, max_length, query_max_length) for q, d in pairs])

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


def main(argv: Iterable[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m jdr.rerank", description=__doc__.splitlines()[0])
  parser.add_argument("--model", required=True,
                      help="cross-encoder: a Hugging Face directory (a sequence classifier keeps its head), a "
                           "jdr cross-encoder export, or `minilm` (a fresh head: for smoke tests only)")
  parser.add_argument("--queries", required=True, help="BEIR directory, queries.jsonl or queries TSV")
  parser.add_argument("--split", default=None, help="with a BEIR directory: only queries in qrels/SPLIT")
  parser.add_argument("--corpus", required=True, help="BEIR directory or corpus.jsonl")
  parser.add_argument("--run", required=True, help="first-stage TREC run")
  parser.add_argument("--depth", type=int, default=100, help="documents reranked per query")
  parser.add_argument("--out", required=True, help="reranked TREC run (- = standard output)")
  parser.add_argument("--max-length", type=int, default=256, help="tokens per (query, document) pair")
  parser.add_argument("--batch-size", type=int, default=None,
                      help="pairs per forward pass (default: about 1,024 tokens a batch on CPU, 16,384 on "
                           "accelerators, as jdr.encode)")
  parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
  cli.add_skip_invalid_flag(parser)
  args = parser.parse_args(argv)

  with cli.reporting_errors(skip_flag="--skip-invalid"):
    if args.depth < 1:
      raise ValueError(f"--depth must be >= 1, got {args.depth}")
    from jdr import retrieve  # pylint: disable=g-import-not-at-top
    from jdr.models import cross  # pylint: disable=g-import-not-at-top
    queries = retrieve.load_queries(args.queries, args.split, skip_invalid=args.skip_invalid)
    run = formats.read_run(args.run, skip_invalid=args.skip_invalid)
    if args.split is not None:
      run = {q: docs for q, docs in run.items() if q in queries}
    corpus = formats.read_corpus(args.corpus, skip_invalid=args.skip_invalid)
    check_inputs(run, queries, corpus, args.depth, args.run)  # before the model loads
    model, params, tokenizer = cross.load_cross_encoder(args.model, dtype=args.dtype)
    if args.max_length > model.config.max_length:
      raise ValueError(f"--max-length {args.max_length} exceeds the model's {model.config.max_length} positions")
    score = make_scorer(model, jax.device_put(params), tokenizer, max_length=args.max_length,
                        batch_size=args.batch_size)
    print(f"pairs: up to {args.max_length} tokens (--max-length)", file=sys.stderr)
    score.warm_up()
    start = time.perf_counter()
    reranked = rerank(run, queries, corpus, score, args.depth, run_path=args.run)
    seconds = time.perf_counter() - start
    formats.write_run(args.out, reranked, tag="jdr-rerank")
  per_query = 1000 * seconds / max(len(run), 1)
  print(f"reranked {len(run)} queries at depth {args.depth}: {per_query:.1f} ms/query "
        f"({seconds:.1f} s on {jax.devices()[0].device_kind}); wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
  main()
