"""Corpus encoding speed: jdr vs sentence-transformers' `encode`, same model, same documents, one process.

  python -m jdr.bench encode [--num-docs 2000] [--max-length 256] [--dtype float32] [--rounds 2]
                             [--model DIR | --shape distilbert-base | modernbert-base]

Both encode the first N SciFact documents (title + " " + text) with the same model at the same maximum length:
the bundled all-MiniLM-L6-v2 by default, `--model` a published directory (sentence-transformers loads it as it
is, or as Transformer + Pooling + Normalize as jdr reads it), or `--shape` a random-weight model of that
architecture's base size written by transformers (over MiniLM's vocabulary, which only sizes the embedding
table), for architectures whose real weights this machine cannot download. Each side is warmed up first (jdr compiles its length buckets; sentence-transformers runs a
small batch), then timed on the whole set, `--rounds` times each, in turns (jdr, reference, reference, jdr),
so a host whose speed drifts slows both alike; the rate is over the mean time. Tokenizing alone is timed too:
`jdr.data.text.tokenize` against the tokenizer's own call, whose ids it must equal. Model FLOP/s count only real (unpadded) tokens, so they are
comparable across implementations, and are reported as a fraction of the host's float32 matmul peak,
measured in the same run. The embeddings of the two are compared as a correctness check.

`--dtype bfloat16`: jdr computes in bfloat16 (float32 parameters, bfloat16 matmul operands); the reference on
a CPU runs under `torch.autocast("cpu", dtype=torch.bfloat16)`, elsewhere cast to bfloat16. Each side's
vectors are then compared with its own float32 ones (cosine, mean and lowest), and `--scifact-test` adds
nDCG@10 on SciFact test (all documents, exact search) for both sides in both precisions.
"""

import argparse
import json
import sys
import time

import numpy as np

from jdr.retrieval import encoder_runtime
from jdr.bench import peak as peak_lib
from jdr.data import formats
from jdr.data import shared
from jdr.data import text as text_lib
from jdr.models import hf


def _texts(num_docs: int) -> list[str]:
  path = shared.shared_dataset("scifact")
  if path is None:
    raise SystemExit(f"this benchmark reads SciFact from {shared.shared_data_dir() / 'scifact'} "
                     "(set JDR_SHARED_DATA)")
  corpus = formats.read_corpus(path / "corpus.jsonl")
  return [text_lib.doc_text(doc) for doc in list(corpus.values())[:num_docs]]


def streamed_masks(runtime: encoder_runtime.EncoderRuntime, lengths: list[int], tokens_per_batch: int) -> list[np.ndarray]:
  """The attention mask of each batch `encode_texts` builds for texts of these token lengths: it batches as
  the background tokenizer's chunks arrive (`streamed_batches`), so its batches are not `plan_batches`'."""
  plan_args = encoder_runtime.batch_plan_args(runtime.max_length, tokens_per_batch, runtime.rows_multiple)
  stand_ins = [np.zeros(n, np.int32) for n in lengths]
  chunks = ((a, stand_ins[a:b]) for a, b in text_lib.chunk_bounds(len(lengths)))
  return [mask for _, _, mask in text_lib.streamed_batches(chunks, **plan_args)]


def warm_up(runtime: encoder_runtime.EncoderRuntime, lengths: list[int], tokens_per_batch: int) -> float:
  """Compiles every batch shape `encode_texts` and `encode_tokens` will use for texts of these token lengths;
  returns seconds."""
  start = time.perf_counter()
  plan_args = encoder_runtime.batch_plan_args(runtime.max_length, tokens_per_batch, runtime.rows_multiple)
  shapes = {(p.rows, p.length) for p in text_lib.plan_batches(lengths, **plan_args)}  # encode_tokens'
  shapes |= {mask.shape for mask in streamed_masks(runtime, lengths, tokens_per_batch)}  # encode_texts'
  for rows, length in sorted(shapes):
    ids = np.zeros((rows, length), np.int32)
    np.asarray(runtime.apply_fn(runtime.params, ids, np.ones_like(ids)))
  return time.perf_counter() - start


SHAPES = {
    "distilbert-base": ("DistilBertConfig", "DistilBertModel", dict(dim=768, n_layers=6, n_heads=12, hidden_dim=3072,
                                                                    max_position_embeddings=512)),
    "modernbert-base": ("ModernBertConfig", "ModernBertModel", dict(
        hidden_size=768, num_hidden_layers=22, num_attention_heads=12, intermediate_size=1152,
        max_position_embeddings=8192, local_attention=128, global_attn_every_n_layers=3)),
}


def shaped_model(shape: str, directory) -> str:
  """A random-weight model of `shape` (SHAPES) saved with MiniLM's tokenizer in `directory`."""
  import shutil  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  config_name, model_name, fields = SHAPES[shape]
  config = getattr(transformers, config_name)(vocab_size=30522, pad_token_id=0, **fields)
  getattr(transformers, model_name)(config).save_pretrained(directory)
  for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
    if (hf.minilm_path() / name).exists():
      shutil.copy(hf.minilm_path() / name, f"{directory}/{name}")
  return str(directory)


def reference_model(model: str, info: dict, device: str):
  """sentence-transformers on the same model: the directory's own modules when it is a sentence-transformers
  model, else Transformer + Pooling (+ Normalize) as jdr reads it."""
  import pathlib  # pylint: disable=g-import-not-at-top
  from sentence_transformers import SentenceTransformer  # pylint: disable=g-import-not-at-top
  path = hf.minilm_path() if model == "minilm" else pathlib.Path(model)
  if (path / "modules.json").exists():
    return SentenceTransformer(str(path), device=device)
  try:
    from sentence_transformers.sentence_transformer import modules  # pylint: disable=g-import-not-at-top
  except ImportError:
    from sentence_transformers import models as modules  # pylint: disable=g-import-not-at-top
  base = modules.Transformer(str(path))
  parts = [base, modules.Pooling(base.get_embedding_dimension(), pooling_mode=info["pooling"])]
  if info["normalize"]:
    parts.append(modules.Normalize())
  return SentenceTransformer(modules=parts, device=device)


def model_flops(model: str, lengths: list[int], pooling: str = "mean") -> float:
  """Forward FLOPs of the model's encoder over texts of these lengths (GeGLU's input projection is twice
  as wide as its output: 1.5x a GELU MLP of the same intermediate size); [CLS] pooling needs less of a BERT
  family encoder's last layer (`peak.encoder_flops`), which jdr computes alone."""
  import pathlib  # pylint: disable=g-import-not-at-top
  from jdr.models import architectures  # pylint: disable=g-import-not-at-top
  path = hf.minilm_path() if model == "minilm" else pathlib.Path(model)
  cfg = architectures.config_from_hf(json.loads((path / "config.json").read_text()))
  mlp = cfg.intermediate_size * (1.5 if cfg.model_type == "modernbert" else 1)
  first = pooling == "cls" and architectures.computes_first_position_alone(cfg)
  return peak_lib.encoder_flops(lengths, layers=cfg.num_layers, hidden=cfg.hidden_size, intermediate=int(mlp),
                                first_position=first)


def _seconds(work):
  start = time.perf_counter()
  result = work()
  return time.perf_counter() - start, result


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m jdr.bench encode", description=__doc__.splitlines()[0])
  parser.add_argument("--num-docs", type=int, default=2000)
  parser.add_argument("--max-length", type=int, default=256)
  parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
  parser.add_argument("--tokens-per-batch", type=int, default=None, help="default: jdr.encode's")
  parser.add_argument("--model", default="minilm", help="minilm or a published model directory")
  parser.add_argument("--shape", choices=sorted(SHAPES), default=None,
                      help="a random-weight model of this architecture's base size instead of --model")
  parser.add_argument("--scifact-test", action="store_true",
                      help="with --dtype bfloat16: also nDCG@10 on SciFact test (all documents) of both sides in "
                           "float32 and bfloat16")
  parser.add_argument("--rounds", type=int, default=2,
                      help="each side encodes the whole set this many times, in turns (jdr, reference, reference, "
                           "jdr, ...); the rate is over the mean time")
  parser.add_argument("--reference-batch-size", type=int, default=32,
                      help="sentence-transformers' encode batch size (its default is 32)")
  args = parser.parse_args(argv)
  if args.rounds < 1:
    parser.error(f"--rounds {args.rounds}: each side encodes at least once")

  texts = _texts(args.num_docs)
  peak = peak_lib.matmul_peak_flops()
  print(f"float32 matmul peak: {peak['peak'] / 1e9:.1f} GFLOP/s "
        f"({', '.join(f'{k} {v / 1e9:.1f}' for k, v in peak.items() if k != 'peak')})", file=sys.stderr)

  import tempfile  # pylint: disable=g-import-not-at-top
  scratch = tempfile.TemporaryDirectory(prefix="jdr-bench-encode-")
  model = shaped_model(args.shape, scratch.name) if args.shape else args.model
  runtime = encoder_runtime.load_runtime(model, max_length=args.max_length, dtype=args.dtype)
  # The tokenizer's own call on the same texts (first, so any warm-up is its): what jdr.tokenize replaces,
  # and the ids it must equal.
  call_s, call = _seconds(lambda: runtime.tokenizer(texts, truncation=True, max_length=args.max_length))
  tokenize_s, token_ids = _seconds(lambda: text_lib.tokenize(runtime.tokenizer, texts, args.max_length))
  if [t.tolist() for t in token_ids] != [list(ids) for ids in call["input_ids"]]:
    raise SystemExit("jdr's token ids differ from the tokenizer's own call")
  lengths = [len(t) for t in token_ids]
  flops = model_flops(model, lengths, runtime.info["pooling"])

  tokens_per_batch = args.tokens_per_batch or encoder_runtime.default_tokens_per_batch()
  compile_s = warm_up(runtime, lengths, tokens_per_batch)

  # The reference runs where jdr runs (the GPU on a GPU host), in the same dtype.
  device = peak_lib.torch_device()
  reference = reference_model(model, runtime.info, device)
  reference.max_seq_length = args.max_length
  ref_encode = reference_encoder(reference, args.dtype, device, args.reference_batch_size)

  def run_jdr():
    return encoder_runtime.encode_texts(runtime, texts, tokens_per_batch=tokens_per_batch)

  def run_reference():
    emb = ref_encode(texts)
    peak_lib.torch_sync(device)
    return emb

  # Each side encodes the whole set once a round, in the order jdr, reference, then reference, jdr (and so
  # on): a host whose speed drifts during the run slows both sides alike (see jdr.bench.turns). Each round's
  # encode opens with an untimed small batch, so neither side starts right behind the other's threads.
  runs = {"jdr": run_jdr, "reference": run_reference}
  openers = {"jdr": lambda: encoder_runtime.encode_texts(runtime, texts[:64], tokens_per_batch=tokens_per_batch),
             "reference": lambda: ref_encode(texts[:args.reference_batch_size])}
  seconds = {"jdr": [], "reference": []}
  embeddings = {}
  for r in range(args.rounds):
    for side in (("jdr", "reference") if r % 2 == 0 else ("reference", "jdr")):
      openers[side]()
      peak_lib.torch_sync(device)
      side_s, embeddings[side] = _seconds(runs[side])
      seconds[side].append(side_s)
  jdr_s, ref_s = float(np.mean(seconds["jdr"])), float(np.mean(seconds["reference"]))
  jdr_emb, ref_emb = embeddings["jdr"], embeddings["reference"]

  jdr_rate, ref_rate = len(texts) / jdr_s, len(texts) / ref_s
  result = {
      "benchmark": "encode", "host_cpu": peak_lib.cpu_line(), "model": args.shape or args.model, "units": "docs/s",
      "jdr": round(jdr_rate, 2), "reference": round(ref_rate, 2),
      "ratio": round(jdr_rate / ref_rate, 3), "reference_name": "sentence-transformers encode", "reference_device": device,
      "num_docs": len(texts), "max_length": args.max_length, "dtype": args.dtype,
      "real_tokens": int(sum(lengths)),
      "jdr_gflops": round(flops / jdr_s / 1e9, 1), "reference_gflops": round(flops / ref_s / 1e9, 1),
      "peak_gflops": round(peak["peak"] / 1e9, 1),
      "jdr_peak_fraction": round(flops / jdr_s / peak["peak"], 3),
      "reference_peak_fraction": round(flops / ref_s / peak["peak"], 3),
      "jdr_compile_seconds": round(compile_s, 1),
      "jdr_tokenize_seconds": round(tokenize_s, 3), "tokenizer_call_seconds": round(call_s, 3),
      "jdr_tokens_per_batch": tokens_per_batch,
      "max_abs_diff_vs_reference": float(np.max(np.abs(jdr_emb - ref_emb))),
      "rounds": args.rounds, "jdr_seconds": [round(x, 4) for x in seconds["jdr"]],
      "reference_seconds": [round(x, 4) for x in seconds["reference"]],
  }
  print(f"jdr {jdr_rate:.1f} docs/s, sentence-transformers {ref_rate:.1f} docs/s: "
        f"ratio {result['ratio']:.2f}", file=sys.stderr)
  if args.dtype != "float32":
    # What the precision changes: each side's vectors against its own float32 ones (untimed).
    full = encoder_runtime.load_runtime(model, max_length=args.max_length, dtype="float32")
    references = {"jdr": encoder_runtime.encode_texts(full, texts, tokens_per_batch=tokens_per_batch),
                  "reference": reference_encoder(reference, "float32", device, args.reference_batch_size)(texts)}
    for side, emb in (("jdr", jdr_emb), ("reference", ref_emb)):
      cos = _cosines(emb, references[side])
      result[f"{side}_cosine_to_float32"] = {"mean": round(float(cos.mean()), 6), "min": round(float(cos.min()), 6)}
    low = peak_lib.matmul_peak_flops(dtype=args.dtype)
    result[f"{args.dtype}_peak_gflops"] = round(low["peak"] / 1e9, 1)
    result[f"jdr_{args.dtype}_peak_fraction"] = round(flops / jdr_s / low["peak"], 3)
    result[f"reference_{args.dtype}_peak_fraction"] = round(flops / ref_s / low["peak"], 3)
    print(f"{args.dtype} matmul peak: {low['peak'] / 1e9:.1f} GFLOP/s "
          f"({', '.join(f'{k} {v / 1e9:.1f}' for k, v in low.items() if k != 'peak')})", file=sys.stderr)
    if args.scifact_test:
      result["scifact_test_ndcg@10"] = scifact_test_ndcg(model, args, tokens_per_batch, reference, device)
    print(f"cosine to float32: jdr {result['jdr_cosine_to_float32']}, "
          f"sentence-transformers {result['reference_cosine_to_float32']}", file=sys.stderr)
  print(json.dumps(result))


def reference_encoder(reference, dtype: str, device: str, batch_size: int):
  """texts -> sentence-transformers' float32 numpy vectors in `dtype`: bfloat16 on a CPU under
  torch.autocast (float32 weights, bfloat16 matmuls: PyTorch's own mixed precision there), elsewhere the
  model cast to bfloat16."""
  import contextlib  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  cast = dtype == "bfloat16" and device != "cpu"
  model = reference.to(torch.bfloat16) if cast else reference.to(torch.float32)

  def encode(texts):
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bfloat16" and device == "cpu"
                else contextlib.nullcontext())
    with torch.inference_mode(), autocast:
      return np.asarray(model.encode(texts, batch_size=batch_size, convert_to_numpy=True), np.float32)
  return encode


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def scifact_test_ndcg(model: str, args, tokens_per_batch: int, reference, device: str) -> dict:
  """nDCG@10 on SciFact test (its 300 queries over all 5,183 documents, exact search) of each side in float32
  and in args.dtype."""
  from jdr.evaluation import metrics  # pylint: disable=g-import-not-at-top
  path = shared.shared_dataset("scifact")
  corpus = formats.read_corpus(path / "corpus.jsonl")
  qrels = formats.read_qrels(path / "qrels" / "test.tsv")
  queries = formats.read_queries(path / "queries.jsonl", only=set(qrels))
  doc_ids, qids = list(corpus), [q for q in qrels if q in queries]
  docs = [text_lib.doc_text(corpus[d]) for d in doc_ids]
  out = {}
  for dtype in ("float32", args.dtype):
    doc_rt = encoder_runtime.load_runtime(model, max_length=args.max_length, dtype=dtype)
    query_rt = encoder_runtime.load_runtime(model, max_length=args.max_length, dtype=dtype, side="query")
    sides = {"jdr": (lambda t, rt: encoder_runtime.encode_texts(rt, t, tokens_per_batch=tokens_per_batch)),
             "reference": (lambda t, rt, e=reference_encoder(reference, dtype, device, args.reference_batch_size): e(t))}
    for side, encode in sides.items():
      d, q = encode(docs, doc_rt), encode([queries[i] for i in qids], query_rt)
      scores = q @ d.T
      top = np.argsort(-scores, axis=1)[:, :100]
      run = {qid: {doc_ids[j]: float(scores[i, j]) for j in top[i]} for i, qid in enumerate(qids)}
      out[f"{side}_{dtype}"] = round(metrics.evaluate(qrels, run, ["ndcg@10"])["ndcg@10"], 4)
      print(f"SciFact test nDCG@10, {side} {dtype}: {out[f'{side}_{dtype}']}", file=sys.stderr)
  return out


if __name__ == "__main__":
  main()
