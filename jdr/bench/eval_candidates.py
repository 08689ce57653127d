"""The trainer's evaluation two ways, one model: each query's BM25 candidates re-ranked, against the full corpus.

  python -m jdr.bench eval-candidates [--depth 100] [--model minilm] [--max-queries 0]
  python -m jdr.bench eval-candidates --passages 1000000      # a synthetic MS MARCO-shaped corpus instead

Both kinds are `jdr.evaluation.periodic.Evaluator`'s, as `jdr.train` runs them: "bm25" (BM25's top `--depth` of each
evaluation query, only the distinct candidates encoded, re-ranked by dot product) and "full" (every document
encoded, in resumable shards, and searched exactly). Data: SciFact's test split from the shared data folder,
or with `--passages N` the dev split of `jdr.data.synthetic`'s dataset of N passages (made under --root once).

Timed apart: the candidates' one-time setup (the BM25 index, built or read from --root, and the mining of the
queries' candidates), each evaluation (query and document encoding, search or re-rank, metrics), and before
either, untimed, the compilation of every batch shape both will encode (so neither pays it). The last line is
one JSON object: the metrics both ways and their differences, the seconds, and `ratio` = full seconds /
candidate seconds (higher: the candidates save more).
"""

import argparse
import json
import pathlib
import sys
import time

import jax
import numpy as np

from jdr.runtime import config_files
from jdr.retrieval import encoder_runtime
from jdr.runtime import defaults
from jdr.evaluation import eval_candidates
from jdr.retrieval import tower_encoder
from jdr.evaluation import periodic
from jdr.training import trainer
from jdr.bench import encode_speed
from jdr.data import pairs
from jdr.data import prepared
from jdr.data import shared
from jdr.data import text as text_lib
from jdr.models import build


def _config(args, dataset: pathlib.Path, split: str):
  config = defaults.get_config()
  config_files.apply_overrides(config, [
      f"data.dataset={dataset}", f"data.eval_split={split}", f"model.init_from={args.model}",
      f"data.query_max_length={args.query_max_length}", f"eval.doc_max_length={args.doc_max_length}",
      f"eval.candidates_depth={args.depth}", f"eval.max_queries={args.max_queries}", "eval.diagnostic_queries=0"])
  return config


def _warm_up(encoder: tower_encoder.TowerEncoder, params, candidates, qids) -> float:
  """Compiles the shapes the full corpus, the candidates and the queries are encoded in; returns seconds."""
  start = time.perf_counter()
  corpus = encoder.data.corpus
  if isinstance(corpus, prepared.PreparedCorpus) and prepared.can_tokenize(encoder.doc_tokenizer):
    doc_lengths = corpus.tokenized(encoder.doc_tokenizer, encoder.doc_max_length).token_lengths(range(len(corpus)))
  else:
    doc_lengths = [len(t) for t in encoder.doc_tokens]
  candidate_lengths = [len(t) for t in eval_candidates.tokenize(encoder.doc_tokenizer, corpus, encoder.doc_ids,
                                                                candidates.unique, encoder.doc_max_length)]
  serving = encoder.serving(params)  # the weights the evaluation encodes with
  docs = encoder_runtime.EncoderRuntime(encoder.encode_doc, serving, encoder.doc_tokenizer, encoder.doc_max_length, {})
  queries = encoder_runtime.EncoderRuntime(encoder.encode_query, serving, encoder.query_tokenizer,
                                           encoder.query_max_length, {})
  tokens_per_batch = encoder.tokens_per_batch or encoder_runtime.default_tokens_per_batch()
  query_lengths = [len(t) for t in text_lib.tokenize(encoder.query_tokenizer, [encoder.data.queries[q] for q in qids],
                                                      encoder.query_max_length)]
  for runtime, lengths in ((docs, [int(n) for n in doc_lengths]), (docs, candidate_lengths),
                           (queries, query_lengths)):
    encode_speed.warm_up(runtime, lengths, tokens_per_batch)
  return time.perf_counter() - start


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m jdr.bench eval-candidates", description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="minilm", help="init_from: minilm, a Hugging Face dir, a jdr model")
  parser.add_argument("--depth", type=int, default=100, help="BM25 candidates a query (eval.candidates_depth)")
  parser.add_argument("--max-queries", type=int, default=0, help="eval.max_queries (0: every query of the split)")
  parser.add_argument("--query-max-length", type=int, default=32)
  parser.add_argument("--doc-max-length", type=int, default=256)
  parser.add_argument("--passages", type=int, default=0, help="a synthetic corpus of N passages instead of SciFact")
  parser.add_argument("--root", default="runs/bench-eval-candidates",
                      help="synthetic data, the BM25 cache and the full evaluation's shards")
  args = parser.parse_args(argv)

  root = pathlib.Path(args.root)
  if args.passages:
    from jdr.data import synthetic  # pylint: disable=g-import-not-at-top
    dataset, split, name = synthetic.dataset(root / "data", args.passages), "dev", f"synthetic {args.passages:,}"
  else:
    dataset = shared.shared_dataset("scifact")
    if dataset is None:
      raise SystemExit(f"this benchmark reads SciFact from {shared.shared_data_dir() / 'scifact'} "
                       "(set JDR_SHARED_DATA), or pass --passages N for a synthetic corpus")
    split, name = "test", "SciFact"
  config = _config(args, dataset, split)
  built = build.build(config.model, config.data)
  data = pairs.load(config.data, root)
  params = trainer.initial_params(built.model, built, config, jax.random.PRNGKey(0), None)
  encoder = tower_encoder.TowerEncoder(built.model, built.tokenizer, data, query_max_length=config.data.query_max_length,
                                    doc_max_length=config.eval.doc_max_length,
                                    tokens_per_batch=config.eval.tokens_per_batch)
  cache = root / "cache"

  config.eval.candidates = "bm25"
  start = time.perf_counter()
  on_candidates = periodic.Evaluator(encoder, config, None, cache_dir=cache)
  setup_s = time.perf_counter() - start
  config.eval.candidates = "full"
  full = periodic.Evaluator(encoder, config, None, cache_dir=cache)
  compile_s = _warm_up(encoder, params, on_candidates.candidates, on_candidates.qids)

  timed = {}
  for kind, evaluator in (("bm25", on_candidates), ("full", full)):
    start = time.perf_counter()
    scores = evaluator(params)
    timed[kind] = (time.perf_counter() - start, scores)
    print(f"{kind}: {evaluator.describe()}: {timed[kind][0]:.1f} s, "
          + "  ".join(f"{k}={v:.4f}" for k, v in scores.items()), file=sys.stderr)
  prefix = on_candidates.candidates.prefix
  cand = {k[len(prefix):]: v for k, v in timed["bm25"][1].items()}
  whole = timed["full"][1]
  bm25_s, full_s = timed["bm25"][0], timed["full"][0]
  result = {
      "benchmark": "eval-candidates", "units": "seconds an evaluation", "jdr": round(bm25_s, 2),
      "reference": round(full_s, 2), "ratio": round(full_s / bm25_s, 3),
      "reference_name": "full-corpus evaluation", "data": name, "split": split, "model": args.model,
      "queries": len(on_candidates.qids), "documents": len(encoder.doc_ids), "depth": args.depth,
      "candidate_documents": int(len(on_candidates.candidates.unique)),
      "query_max_length": args.query_max_length, "doc_max_length": args.doc_max_length,
      "candidates": {k: round(v, 4) for k, v in cand.items()}, "full": {k: round(v, 4) for k, v in whole.items()},
      "difference": {k: round(cand[k] - whole[k], 4) for k in whole},
      "candidates_setup_seconds": round(setup_s, 2), "compile_seconds": round(compile_s, 2),
      "backend": jax.default_backend(), "bm25_queries_without_candidates":
          int(np.sum(on_candidates.candidates.rows[:, 0] < 0)),
  }
  print(json.dumps(result))


if __name__ == "__main__":
  main()
