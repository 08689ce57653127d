"""Rerank a first-stage run with a cross-encoder: `python -m jdr.rerank --model M ... --run R --out R2`.

  python -m jdr.rerank --model M --queries Q --corpus C --run R --depth 100 --out R2

The top `--depth` documents of each query in R are scored by the cross-encoder over `[CLS] q [SEP] d [SEP]`
(the document as `title text`, truncated to fit `--max-length` with the query whole) and reordered; the
documents below the depth keep their first-stage order beneath them, so the output ranks the same documents
as R. Pairs are scored in length buckets (a few compiled shapes). The time per query (tokenization included)
is printed with the depth, the numbers LTRe's Table 2 reports for reranking.
"""

from __future__ import annotations

from jdr.runtime import host_memory

# `python -m` this module: glibc's malloc on huge pages, by re-executing before anything heavy is imported.
host_memory.reexec_if_command(__name__)

import argparse
import sys
import time
from typing import Iterable

import jax

from jdr.runtime import cli
from jdr.evaluation import reranking
from jdr.data import formats
from jdr.models import build
from jdr.models import cross


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
  parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                      help="compute dtype (auto: bfloat16 on GPU/TPU, float32 on CPU)")
  cli.add_skip_invalid_flag(parser)
  args = parser.parse_args(argv)

  with cli.reporting_errors(skip_flag="--skip-invalid"):
    if args.depth < 1:
      raise ValueError(f"--depth must be >= 1, got {args.depth}")
    queries = formats.load_queries(args.queries, args.split, skip_invalid=args.skip_invalid)
    run = formats.read_run(args.run, skip_invalid=args.skip_invalid)
    if args.split is not None:
      run = {q: docs for q, docs in run.items() if q in queries}
    corpus = formats.read_corpus(args.corpus, skip_invalid=args.skip_invalid)
    reranking.check_inputs(run, queries, corpus, args.depth, args.run)  # before the model loads
    model, params, tokenizer = cross.load_cross_encoder(args.model, dtype=build.compute_dtype(args.dtype))
    if args.max_length > model.config.max_length:
      raise ValueError(f"--max-length {args.max_length} exceeds the model's {model.config.max_length} positions")
    score = reranking.make_scorer(model, jax.device_put(params), tokenizer, max_length=args.max_length,
                        batch_size=args.batch_size)
    print(f"pairs: up to {args.max_length} tokens (--max-length)", file=sys.stderr)
    score.warm_up()
    start = time.perf_counter()
    reranked = reranking.rerank(run, queries, corpus, score, args.depth, run_path=args.run)
    seconds = time.perf_counter() - start
    formats.write_run(args.out, reranked, tag="jdr-rerank")
  per_query = 1000 * seconds / max(len(run), 1)
  print(f"reranked {len(run)} queries at depth {args.depth}: {per_query:.1f} ms/query "
        f"({seconds:.1f} s on {jax.devices()[0].device_kind}); wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
  main()
