"""Encode a corpus into sharded embedding files: `python -m jdr.encode --model M --corpus C --out DIR`.

The output directory holds `emb-NNNNN.npy` (float32 [n, D]) and `ids-NNNNN.txt` per shard plus
`meta.json` (see jdr.retrieval.encodings, which does the work). A killed run resumes from the last finished shard;
a resume with different settings (another document prompt among them) is refused rather than mixing embeddings
of two models in one index. Each document is encoded after the model's document prompt, or --doc-prompt's.
Launched on several hosts (`python -m jdr.launch.local|slurm|tpu ... -- python -m jdr.encode ...`), each
process reads, tokenizes, encodes and writes only its own part of the corpus, as shards of the shared output
directory (local disk all hosts share, or gs://...).
"""

from jdr.runtime import host_memory

# `python -m` this module: glibc's malloc on huge pages, by re-executing before anything heavy is imported.
host_memory.reexec_if_command(__name__)

import argparse
import dataclasses
import sys
import time
from typing import Iterable

import jax

from jdr.runtime import cli
from jdr.retrieval import flags
from jdr.retrieval import encoder_runtime
from jdr.retrieval import encodings
from jdr.runtime import parallel
from jdr.runtime import workdir_lock
from jdr.data import formats


def main(argv: Iterable[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m jdr.encode", description=__doc__.splitlines()[0])
  flags.add_model_flags(parser)
  flags.add_prompt_flags(parser, "doc")
  parser.add_argument("--corpus", required=True, help="BEIR directory, corpus.jsonl or collection TSV")
  parser.add_argument("--out", required=True, help="output directory (resumes if it exists)")
  parser.add_argument("--shard-size", type=int, default=10_000, help="documents per shard file")
  parser.add_argument("--passages", type=int, default=1,
                      help="1 = FirstP (each document truncated to --max-length); P > 1 = MaxP: up to P "
                           "passages of --max-length tokens per document, retrieved by the best one (ANCE: 4)")
  parser.add_argument("--batch-size", type=int, default=None,
                      help="documents per batch at the longest bucket (sets --tokens-per-batch)")
  parser.add_argument("--pieces", default="",
                      help="also store window vectors for FGD's Eq. 16 ensemble, e.g. passage:128,sentence:64 "
                           "([CLS]-pooled models; FirstP only)")
  cli.add_skip_invalid_flag(parser)
  parser.add_argument("--force", action="store_true", help="run even when another live run writes --out")
  args = parser.parse_args(argv)
  if args.model is None:
    parser.error("--model is required")
  # A multi-process launch (jdr.launch.*) splits the shards over the hosts: join it before jax starts.
  parallel.initialize_distributed()
  with cli.reporting_errors(skip_flag="--skip-invalid"), workdir_lock.held(
      args.out, "python -m jdr.encode", force=args.force, process_index=jax.process_index()):
    # The corpus first: a bad line is reported in seconds, not after loading the model. Each process of a
    # multi-host job reads and tokenizes only its own part of the file (its share of the bytes).
    error = corpus = None
    try:
      corpus = formats.read_corpus(args.corpus, skip_invalid=args.skip_invalid, part=jax.process_index(),
                                   parts=jax.process_count())
    except Exception as e:  # pylint: disable=broad-except  (raised below, on every host at once)
      error = e
    parallel.raise_if_any_host_failed(error, f"reading their part of {args.corpus}")
    runtime = encoder_runtime.load_runtime(args.model, pooling=args.pooling, normalize=args.normalize,
                                      max_length=args.max_length, dtype=args.dtype, prompt=args.doc_prompt,
                                      dim=args.dim)
    print(encoder_runtime.length_line(runtime, "documents"), file=sys.stderr)
    tokens_per_batch = args.tokens_per_batch
    if args.batch_size:
      tokens_per_batch = args.batch_size * runtime.max_length
    devices = jax.local_device_count()
    if devices > 1 and not args.pieces:
      # This host's devices split each batch's rows (hosts split the corpus): batches grow with them.
      mesh = parallel.make_mesh((-1, 1, 1), devices=jax.local_devices())
      runtime = dataclasses.replace(runtime, apply_fn=encoder_runtime.rows_on_mesh(runtime.apply_fn, mesh),
                                    rows_multiple=devices)
      tokens_per_batch = (tokens_per_batch or encoder_runtime.default_tokens_per_batch()) * devices
      print(f"{devices} local devices split each batch's rows", file=sys.stderr)
    from jdr.models import build  # pylint: disable=g-import-not-at-top  (model code loads lazily)
    settings = encodings.corpus_settings(runtime, args.model, args.corpus, dtype=build.compute_dtype(args.dtype),
                                         **({"truncate_dim": args.dim} if args.dim else {}))
    start = time.perf_counter()
    if args.passages < 1:
      raise ValueError(f"--passages must be >= 1, got {args.passages}")
    pieces = []
    for part in filter(None, (p.strip() for p in args.pieces.split(","))):
      name, _, size = part.partition(":")
      if not name or not size.isdigit() or int(size) < 1:
        raise ValueError(f"--pieces: {part!r} is not NAME:TOKENS (e.g. passage:128)")
      pieces.append((name, int(size)))
    meta = encodings.encode_corpus(runtime, corpus, args.out, shard_size=args.shard_size,
                                    settings=settings, tokens_per_batch=tokens_per_batch,
                                    passages=args.passages, pieces=pieces)
  seconds = time.perf_counter() - start
  print(f"encoded {meta['num_docs']} documents (dim {meta['dim']}) into {args.out} in {seconds:.1f} s",
        file=sys.stderr)


if __name__ == "__main__":
  main()
