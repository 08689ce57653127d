"""Encode queries, search an encoded corpus, write a TREC run: `python -m jdr.retrieve`.

`--index DIR` is the output of `jdr.encode`. The retriever over it is built on the fly (Faiss with any
factory string, or the exact JAX back-end); `--save-index` keeps a built Faiss index in DIR/index-NAME so
that a compressed index is trained once. The query encoder defaults to the settings recorded in
DIR/meta.json, so queries and documents are embedded the same way unless asked otherwise.
"""

import argparse
import pathlib
import sys
import time
from typing import Iterable

from jdr import encode as encode_lib
from jdr import index as index_lib
from jdr.data import formats


def load_queries(path: str, split: str | None) -> dict[str, str]:
  """Queries from a BEIR directory (optionally only those judged in qrels/SPLIT.tsv) or a file."""
  path_ = pathlib.Path(path)
  if path_.is_dir():
    queries = formats.read_queries(path_ / "queries.jsonl")
    if split is None:
      return queries
    qrels_path = path_ / "qrels" / f"{split}.tsv"
    if not qrels_path.exists():
      raise SystemExit(f"--split {split}: {qrels_path} is missing")
    qrels = formats.read_qrels(qrels_path, query_ids=queries)
    return {q: queries[q] for q in qrels}
  if split is not None:
    raise SystemExit(f"--split needs a BEIR directory, but {path} is a file")
  return formats.read_queries(path_)


def build_retriever(enc_dir: str, backend: str, factory: str, save: bool):
  """A retriever over the embeddings in enc_dir; reuses a saved Faiss index when present."""
  saved = pathlib.Path(enc_dir) / f"index-{backend}-{factory.replace(',', '_')}"
  if backend == "faiss" and saved.is_dir():
    return index_lib.load_retriever(saved)
  emb, ids, _ = encode_lib.load_embeddings(enc_dir)
  kwargs = {"factory": factory} if backend == "faiss" else {}
  retriever = index_lib.make_retriever(backend, emb.shape[1], **kwargs)
  retriever.add(emb, ids)
  if save and backend == "faiss":
    retriever.save(saved)
  return retriever


def main(argv: Iterable[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m jdr.retrieve", description=__doc__.splitlines()[0])
  encode_lib.add_model_flags(parser)
  parser.add_argument("--index", required=True, help="an encoding directory written by jdr.encode")
  parser.add_argument("--queries", required=True, help="BEIR directory, queries.jsonl or queries TSV")
  parser.add_argument("--split", default=None, help="with a BEIR directory: only queries in qrels/SPLIT")
  parser.add_argument("--top-k", type=int, default=100)
  parser.add_argument("--run", required=True, help="output TREC run file")
  parser.add_argument("--backend", choices=["faiss", "jax"], default="faiss")
  parser.add_argument("--factory", default="Flat", help="Faiss index factory string, e.g. OPQ96,IVF1,PQ96")
  parser.add_argument("--save-index", action="store_true", help="keep the built Faiss index in --index")
  args = parser.parse_args(argv)

  meta = encode_lib.read_meta(args.index)
  model = args.model or meta["model"]
  from jdr.models import build  # pylint: disable=g-import-not-at-top
  if build.is_jdr_model(model):
    # A trained model carries its own query tower settings (pooling, query length).
    runtime = encode_lib.load_runtime(model, pooling=args.pooling, normalize=args.normalize,
                                      max_length=args.max_length, dtype=args.dtype, side="query")
  else:
    # Embed queries the way the documents were embedded unless told otherwise.
    runtime = encode_lib.load_runtime(
        model, pooling=args.pooling or meta.get("pooling"),
        normalize=meta.get("normalize") if args.normalize is None else args.normalize,
        max_length=args.max_length or meta.get("max_length"), dtype=args.dtype, side="query")
  queries = load_queries(args.queries, args.split)
  retriever = build_retriever(args.index, args.backend, args.factory, args.save_index)
  print(f"index: {args.backend} {args.factory}, {retriever.bytes_per_doc():.1f} bytes/doc",
        file=sys.stderr)

  start = time.perf_counter()
  qids = list(queries)
  q_emb = encode_lib.encode_texts(runtime, [queries[q] for q in qids],
                                  tokens_per_batch=args.tokens_per_batch)
  scores, ids = retriever.search(q_emb, args.top_k)
  run = index_lib.to_run(qids, scores, ids)
  formats.write_run(args.run, run, tag="jdr")
  print(f"retrieved top-{args.top_k} for {len(qids)} queries in "
        f"{time.perf_counter() - start:.1f} s -> {args.run}", file=sys.stderr)


if __name__ == "__main__":
  main()
