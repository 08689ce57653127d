"""Cross-encoder scoring throughput: jdr's scorer against sentence-transformers' CrossEncoder, same weights,
same pairs, one process.

  python -m jdr.bench cross-encoder [--model minilm] [--pairs 2000] [--max-length 256] [--batch-size 32]

The pairs are SciFact test queries with documents of the corpus (the built-in dataset when ../shared/data is
absent), in a fixed order. `--model` is any cross-encoder jdr reads (a plain encoder such as the bundled
MiniLM gets a fresh head: scoring speed does not depend on the head's values); its weights are exported to a
Hugging Face directory that sentence-transformers loads, so both score the same network. Both truncate the
document to fit `--max-length`. Pairs/s over the whole set after a warm-up pass (jdr: every length bucket
compiled); the last line is JSON with ratio = jdr / sentence-transformers (goal >= 1).
"""

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time

import jax
import numpy as np

from jdr.bench import peak as peak_lib


def _pairs(n: int) -> list[tuple[str, str]]:
  from jdr.data import builtin, formats, shared, text  # pylint: disable=g-import-not-at-top
  directory = shared.shared_dataset("scifact")
  if directory is None:
    directory = pathlib.Path(tempfile.mkdtemp()) / "builtin"
    builtin.write_builtin(directory)
  corpus, queries, _ = formats.load_beir(directory, "test")
  docs = [text.doc_text(d) for d in corpus.values()]
  qs = list(queries.values())
  rng = np.random.default_rng(0)
  return [(qs[i % len(qs)], docs[int(rng.integers(len(docs)))]) for i in range(n)]


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m jdr.bench cross-encoder", description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="minilm")
  parser.add_argument("--pairs", type=int, default=2000)
  parser.add_argument("--max-length", type=int, default=256)
  parser.add_argument("--batch-size", type=int, default=32, help="sentence-transformers' batch size (and "
                      "jdr's with --same-batch); jdr sizes its batches by tokens otherwise")
  parser.add_argument("--same-batch", action="store_true", help="jdr uses --batch-size too")
  args = parser.parse_args(argv)
  import torch  # pylint: disable=g-import-not-at-top
  torch.set_num_threads(os.cpu_count() or 1)
  from sentence_transformers import CrossEncoder  # pylint: disable=g-import-not-at-top
  from jdr.evaluation import reranking  # pylint: disable=g-import-not-at-top
  from jdr.models import build, cross  # pylint: disable=g-import-not-at-top

  if build.is_jdr_model(args.model):
    model, params, tokenizer, _ = build.load_jdr_model(args.model)
  else:
    model, params, tokenizer = cross.load_cross_encoder(args.model)
  pairs = _pairs(args.pairs)
  score = reranking.make_scorer(model, jax.device_put(params), tokenizer, max_length=args.max_length,
                             batch_size=args.batch_size if args.same_batch else None)
  score.warm_up()
  start = time.perf_counter()
  ours = score(pairs)
  jdr_s = time.perf_counter() - start
  # Tokenizing alone: the batch calls scoring makes, against one call a pair (what bounds scoring on an
  # accelerator when it runs on one host thread).
  from jdr.data import text as text_lib  # pylint: disable=g-import-not-at-top
  start = time.perf_counter()
  text_lib.pairs_tokens(tokenizer, pairs, args.max_length)
  batched_s = time.perf_counter() - start
  start = time.perf_counter()
  for query, doc in pairs:
    text_lib.pair_tokens(tokenizer, query, doc, args.max_length)
  one_by_one_s = time.perf_counter() - start

  with tempfile.TemporaryDirectory() as hf_dir:
    cross.export_cross_encoder(model.config, params, hf_dir, tokenizer=tokenizer)
    # The reference runs where jdr runs (the GPU on a GPU host).
    reference = CrossEncoder(hf_dir, num_labels=1, max_length=args.max_length, device=peak_lib.torch_device(),
                             activation_fn=torch.nn.Identity())
    reference.predict(pairs[:args.batch_size], batch_size=args.batch_size)  # warm-up
    start = time.perf_counter()
    theirs = np.asarray(reference.predict(pairs, batch_size=args.batch_size, show_progress_bar=False))
    st_s = time.perf_counter() - start
  # The same network and inputs: the scores agree (truncation may differ by a token at the boundary).
  agreement = float(np.corrcoef(ours, theirs.reshape(-1))[0, 1])
  result = {"benchmark": "cross-encoder", "host_cpu": peak_lib.cpu_line(), "units": "pairs/s", "pairs": len(pairs),
            "max_length": args.max_length,
            "batch_size": args.batch_size, "jdr_batching": "fixed" if args.same_batch else "tokens per batch", "device": jax.devices()[0].device_kind,
            "jdr": round(len(pairs) / jdr_s, 2), "reference": round(len(pairs) / st_s, 2),
            "reference_name": "sentence-transformers CrossEncoder.predict",
            "reference_device": peak_lib.torch_device(), "score_correlation": round(agreement, 5),
            "ratio": round(st_s / jdr_s, 3), "tokenize_s": round(batched_s, 3),
            "tokenize_one_pair_a_call_s": round(one_by_one_s, 3)}
  print(f"jdr {result['jdr']} pairs/s, sentence-transformers {result['reference']} pairs/s: ratio "
        f"{result['ratio']}", file=sys.stderr)
  print(json.dumps(result))


if __name__ == "__main__":
  main()
