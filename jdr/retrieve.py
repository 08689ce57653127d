"""Encode queries, search an encoded corpus, write a TREC run: `python -m jdr.retrieve`.

`--index DIR` is the output of `jdr.encode`. The retriever over it is built on the fly (Faiss with any
factory string, or the exact JAX back-end); `--save-index` keeps a built Faiss index in DIR/index-NAME so
that a compressed index is trained once. The query encoder defaults to the settings recorded in
DIR/meta.json, so queries and documents are embedded the same way unless asked otherwise; each query is
encoded after the model's query prompt, or --query-prompt's. The work is
jdr.retrieval.encoder_runtime's, .encodings' and .retrievers'.
"""

from jdr.runtime import host_memory

# `python -m` this module: glibc's malloc on huge pages, by re-executing before anything heavy is imported.
host_memory.reexec_if_command(__name__)

import argparse
import sys
import time
from typing import Iterable

from jdr.runtime import cli
from jdr.retrieval import flags
from jdr.retrieval import encoder_runtime
from jdr.retrieval import encodings
from jdr.retrieval import retrievers
from jdr.data import formats
from jdr.models import saved


def main(argv: Iterable[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m jdr.retrieve", description=__doc__.splitlines()[0])
  flags.add_model_flags(parser)
  flags.add_prompt_flags(parser, "query")
  parser.add_argument("--index", required=True, help="an encoding directory written by jdr.encode")
  parser.add_argument("--queries", required=True, help="BEIR directory, queries.jsonl or queries TSV")
  parser.add_argument("--split", default=None, help="with a BEIR directory: only queries in qrels/SPLIT")
  parser.add_argument("--top-k", type=int, default=100)
  parser.add_argument("--run", required=True, help="output TREC run file (- = standard output)")
  parser.add_argument("--backend", choices=["faiss", "jax"], default="faiss")
  parser.add_argument("--factory", default="Flat", help="Faiss index factory string, e.g. OPQ96,IVF1,PQ96")
  parser.add_argument("--save-index", action="store_true", help="keep the built Faiss index in --index")
  parser.add_argument("--gpu-layout", choices=["shard", "replicate"], default="shard",
                      help="--backend faiss on several GPUs: split the documents over them, or copy the index "
                           "to each")
  parser.add_argument("--gpu-float16", action="store_true",
                      help="--backend faiss on GPUs: float16 vectors / lookup tables (half the memory)")
  parser.add_argument("--index-dtype", choices=["auto", "float32", "bfloat16", "int8"], default="auto",
                      help="--backend jax: the matrix on the devices (auto: bfloat16 on GPU/TPU, float32 on "
                           "CPU; int8 has one scale per row and is approximate); scores are float32")
  parser.add_argument("--recall-target", type=float, default=1.0,
                      help="--backend jax: below 1, each device's top-k is jax.lax.approx_max_k (fast on TPUs)")
  parser.add_argument("--ensemble-gamma", type=float, default=None,
                      help="FGD's Eq. 16: rescore the top --ensemble-depth by document score + gamma x (best "
                           "window score of each level); needs an encoding made with jdr.encode --pieces")
  parser.add_argument("--ensemble-depth", type=int, default=100, help="documents rescored per query")
  cli.add_skip_invalid_flag(parser)
  args = parser.parse_args(argv)

  with cli.reporting_errors(skip_flag="--skip-invalid"):
    queries = formats.load_queries(args.queries, args.split, skip_invalid=args.skip_invalid)
    if not queries:
      raise ValueError(f"{args.queries}: no queries to retrieve for"
                       + (f" in split {args.split!r}" if args.split else ""))
    meta = encodings.read_meta(args.index)
    model = args.model or meta["model"]
    dim = args.dim or meta.get("truncate_dim")  # the width the documents were served at (jdr.encode --dim)
    if saved.is_jdr_model(model):
      # A trained model carries its own query tower settings (pooling, query length).
      runtime = encoder_runtime.load_runtime(model, pooling=args.pooling, normalize=args.normalize,
                                        max_length=args.max_length, dtype=args.dtype, side="query",
                                        prompt=args.query_prompt, dim=dim)
    else:
      # Embed queries the way the documents were embedded unless told otherwise.
      runtime = encoder_runtime.load_runtime(
          model, pooling=args.pooling or meta.get("pooling"),
          normalize=meta.get("normalize") if args.normalize is None else args.normalize,
          max_length=args.max_length or meta.get("max_length"), dtype=args.dtype, side="query",
          prompt=args.query_prompt, dim=dim)
      if not args.max_length and meta.get("max_length"):
        runtime.info["max_length_from"] = f"the length {args.index} was encoded at"
    print(encoder_runtime.length_line(runtime, "queries"), file=sys.stderr)
    if runtime.info.get("dim") not in (None, meta.get("dim")):
      raise ValueError(f"queries would be {runtime.info['dim']}-dim vectors, {args.index}'s documents are "
                       f"{meta.get('dim')}-dim: give --dim {meta.get('dim')} (jdr.encode --dim)")
    if args.recall_target != 1.0 and args.backend != "jax":
      parser.error("--recall-target needs --backend jax")
    if args.index_dtype != "auto" and args.backend != "jax":
      parser.error("--index-dtype needs --backend jax")
    if (args.gpu_layout != "shard" or args.gpu_float16) and args.backend != "faiss":
      parser.error("--gpu-layout / --gpu-float16 are options of --backend faiss")
    retriever = retrievers.load_index(args.index, args.backend, args.factory, save=args.save_index,
                                      recall_target=args.recall_target, jax_dtype=args.index_dtype,
                                      gpu={"gpu_layout": args.gpu_layout, "gpu_float16": args.gpu_float16})
    print(f"index: {args.backend} {args.factory}, {retriever.bytes_per_doc():.1f} bytes/doc",
          file=sys.stderr)

    start = time.perf_counter()
    qids = list(queries)
    q_emb = encoder_runtime.encode_texts(runtime, [queries[q] for q in qids],
                                    tokens_per_batch=args.tokens_per_batch)
    if args.ensemble_gamma is None:
      run = retrievers.retrieve_run(retriever, qids, q_emb, args.top_k, passages=meta.get("passages", 1))
    else:
      pieces = encodings.load_pieces(args.index)
      doc_ids = encodings.read_ids(args.index)
      first = retrievers.retrieve_run(retriever, qids, q_emb, max(args.ensemble_depth, args.top_k))
      run = retrievers.ensemble_rerank(first, qids, q_emb, {d: i for i, d in enumerate(doc_ids)}, pieces,
                                       args.ensemble_gamma, args.top_k)
    formats.write_run(args.run, run, tag="jdr")
  print(f"retrieved top-{args.top_k} for {len(qids)} queries in "
        f"{time.perf_counter() - start:.1f} s -> {args.run}", file=sys.stderr)


if __name__ == "__main__":
  main()
