"""Encode a corpus into sharded embedding files: `python -m jdr.encode --model M --corpus C --out DIR`.

The output directory holds `emb-NNNNN.npy` (float32 [n, D]) and `ids-NNNNN.txt` per shard plus
`meta.json`. Shards are written atomically, so a killed run resumes from the last finished shard;
`meta.json` records the settings, and a resume with different settings is refused rather than mixing
embeddings of two models in one index.
"""

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import time
from typing import Callable, Iterable, Sequence

import jax
import numpy as np
import tqdm

from jdr.data import formats
from jdr.data import text as text_lib

# A batch holds about this many tokens (padded), whatever its length bucket, so short documents go in
# big batches and long ones in small batches: a small fixed set of compiled shapes, little padding.
# On CPU small batches win: MiniLM at 4 x 256 tokens ran at 287 GFLOP/s on this 2-core machine, at
# 32 x 256 at 122 GFLOP/s, because the [batch, heads, L, L] attention scores then stop fitting in cache.
# Accelerators want big batches to fill the device.
CPU_TOKENS_PER_BATCH = 1024
ACCELERATOR_TOKENS_PER_BATCH = 16384


def default_tokens_per_batch() -> int:
  return CPU_TOKENS_PER_BATCH if jax.default_backend() == "cpu" else ACCELERATOR_TOKENS_PER_BATCH


@dataclasses.dataclass
class EncoderRuntime:
  """A loaded tower with its tokenizer and settings: what it takes to turn texts into vectors."""
  apply_fn: Callable  # (params, input_ids, attention_mask) -> [B, D]
  params: object
  tokenizer: object
  max_length: int
  info: dict


def load_runtime(model: str, *, pooling: str | None = None, normalize: bool | None = None,
                 max_length: int | None = None, dtype: str = "float32",
                 side: str = "doc") -> EncoderRuntime:
  """Loads `model` with its tokenizer, jitted, for one side ("query" or "doc").

  `model` is a Hugging Face directory, `minilm`, or a jdr model (a `jdr.export` directory or a training
  workdir), whose query and document towers may differ and whose pooling is part of what was trained.
  """
  # pylint: disable=g-import-not-at-top  (model code loads lazily, so `--help` stays fast)
  from jdr.models import build
  from jdr.models import hf
  from jdr.models.towers import TwoTower
  if build.is_jdr_model(model):
    two_tower, params, tokenizer, description = build.load_jdr_model(model)
    tower = getattr(two_tower, side)
    if (pooling not in (None, tower.pooling)) or (normalize not in (None, tower.normalize)):
      raise SystemExit(f"{model}: a trained jdr model fixes pooling={tower.pooling} and "
                       f"normalize={tower.normalize}; drop --pooling / --normalize")
    method = TwoTower.encode_query if side == "query" else TwoTower.encode_doc

    @jax.jit
    def apply_two_tower(params, input_ids, attention_mask):
      return two_tower.apply({"params": params}, input_ids, attention_mask, method=method)

    info = {"pooling": tower.pooling, "normalize": tower.normalize,
            "max_length": max_length or description[f"{side}_max_length"]}
    return EncoderRuntime(apply_two_tower, params, tokenizer, int(info["max_length"]), info)

  one_tower, params, tokenizer, info = hf.load_tower(
      model, pooling=pooling, normalize=normalize, max_length=max_length, dtype=dtype)

  @jax.jit
  def apply_fn(params, input_ids, attention_mask):
    return one_tower.apply({"params": params}, input_ids, attention_mask)

  return EncoderRuntime(apply_fn, params, tokenizer, int(info["max_length"]), info)


def batch_plan_args(max_length: int, tokens_per_batch: int) -> dict:
  """How jdr.encode batches: ~tokens_per_batch padded tokens per length bucket, few compiled shapes."""
  return {"max_tokens": tokens_per_batch, "bucket_lengths": text_lib.default_bucket_lengths(max_length),
          "short_rows_to_power_of_two": True}


def encode_texts(runtime: EncoderRuntime, texts: Sequence[str], *,
                 tokens_per_batch: int | None = None,
                 progress: tqdm.tqdm | None = None) -> np.ndarray:
  """Embeds texts in their given order; returns float32 [len(texts), D]."""
  if not texts:
    raise ValueError("no texts to encode")
  token_ids = text_lib.tokenize(runtime.tokenizer, list(texts), runtime.max_length)
  return encode_tokens(runtime, token_ids, tokens_per_batch=tokens_per_batch, progress=progress)


def encode_tokens(runtime: EncoderRuntime, token_ids: Sequence[np.ndarray], *,
                  tokens_per_batch: int | None = None,
                  progress: tqdm.tqdm | None = None) -> np.ndarray:
  """Embeds already tokenized texts (unpadded id arrays, each <= runtime.max_length) in their order."""
  tokens_per_batch = tokens_per_batch or default_tokens_per_batch()
  out = None
  for indices, input_ids, mask in text_lib.bucketed_batches(
      token_ids, pad_id=runtime.tokenizer.pad_token_id or 0,
      **batch_plan_args(runtime.max_length, tokens_per_batch)):
    emb = np.asarray(runtime.apply_fn(runtime.params, input_ids, mask), dtype=np.float32)
    if out is None:
      out = np.empty((len(token_ids), emb.shape[-1]), np.float32)
    # Filler rows past len(indices) only round the batch up to a compiled shape.
    out[indices] = emb[:len(indices)]
    if progress is not None:
      progress.update(len(indices))
  return out


def _shard_paths(out_dir: pathlib.Path, shard: int) -> tuple[pathlib.Path, pathlib.Path]:
  return out_dir / f"emb-{shard:05d}.npy", out_dir / f"ids-{shard:05d}.txt"


def _write_atomic(path: pathlib.Path, write: Callable[[pathlib.Path], None]) -> None:
  tmp = path.with_name(path.name + ".tmp")
  write(tmp)
  os.replace(tmp, path)


def encode_corpus(runtime: EncoderRuntime, corpus: dict, out_dir: str | os.PathLike, *,
                  shard_size: int = 10_000, settings: dict | None = None,
                  tokens_per_batch: int | None = None) -> dict:
  """Encodes `corpus` (id -> Doc) into shards under out_dir, resuming finished shards. Returns meta."""
  out_dir = pathlib.Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  doc_ids = list(corpus)
  num_shards = max(1, -(-len(doc_ids) // shard_size))
  meta = {"num_docs": len(doc_ids), "shard_size": shard_size, "num_shards": num_shards,
          **(settings or {})}
  meta_path = out_dir / "meta.json"
  if meta_path.exists():
    old = json.loads(meta_path.read_text())
    diff = {k: (old.get(k), v) for k, v in meta.items() if k != "complete" and old.get(k) != v}
    if diff:
      raise SystemExit(f"{meta_path}: the existing encoding was made with other settings "
                       f"(key: (old, new)) {diff}; use a new --out directory")
  _write_atomic(meta_path, lambda p: p.write_text(json.dumps({**meta, "complete": False}, indent=1)))

  done = [s for s in range(num_shards) if all(p.exists() for p in _shard_paths(out_dir, s))]
  todo = [s for s in range(num_shards) if s not in done]
  done_docs = sum(min(shard_size, len(doc_ids) - s * shard_size) for s in done)
  if done:
    print(f"resuming: {len(done)} of {num_shards} shards already encoded in {out_dir}", file=sys.stderr)
  bar = tqdm.tqdm(total=len(doc_ids), initial=done_docs, unit="doc", desc="encode", smoothing=0.1,
                  mininterval=1.0)
  for shard in todo:
    ids = doc_ids[shard * shard_size:(shard + 1) * shard_size]
    texts = [text_lib.doc_text(corpus[i]) for i in ids]
    emb = encode_texts(runtime, texts, tokens_per_batch=tokens_per_batch, progress=bar)
    emb_path, ids_path = _shard_paths(out_dir, shard)
    # ids first, embeddings last: a shard counts as finished only once its embeddings exist.
    _write_atomic(ids_path, lambda p: p.write_text("".join(i + "\n" for i in ids)))
    _write_atomic(emb_path, lambda p: np.save(open(p, "wb"), emb))
  bar.close()
  meta["complete"] = True
  meta["dim"] = int(np.load(_shard_paths(out_dir, 0)[0], mmap_mode="r").shape[1])
  _write_atomic(meta_path, lambda p: p.write_text(json.dumps(meta, indent=1)))
  return meta


def read_meta(enc_dir: str | os.PathLike) -> dict:
  """The settings of a finished encoding directory (model, pooling, normalize, max_length, ...)."""
  meta_path = pathlib.Path(enc_dir) / "meta.json"
  if not meta_path.exists():
    raise SystemExit(f"{meta_path}: no meta.json; is {enc_dir} the --out of jdr.encode?")
  meta = json.loads(meta_path.read_text())
  if not meta.get("complete"):
    raise SystemExit(f"{enc_dir}: the encoding is unfinished; run jdr.encode again to resume it")
  return meta


def load_embeddings(enc_dir: str | os.PathLike) -> tuple[np.ndarray, list[str], dict]:
  """Reads a finished encoding directory: (embeddings [N, D], ids, meta)."""
  enc_dir = pathlib.Path(enc_dir)
  meta = read_meta(enc_dir)
  embs, ids = [], []
  for shard in range(meta["num_shards"]):
    emb_path, ids_path = _shard_paths(enc_dir, shard)
    embs.append(np.load(emb_path))
    ids.extend(ids_path.read_text().splitlines())
  emb = np.concatenate(embs)
  if emb.shape[0] != len(ids) or len(ids) != meta["num_docs"]:
    raise SystemExit(f"{enc_dir}: {emb.shape[0]} embeddings, {len(ids)} ids, meta says "
                     f"{meta['num_docs']} documents: the directory is corrupt")
  return emb, ids, meta


def add_model_flags(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--model", default=None,
                      help="Hugging Face directory, jdr export directory, or `minilm` (bundled)")
  parser.add_argument("--pooling", choices=["cls", "mean", "max"], default=None,
                      help="default: the model's own (mean for minilm, cls otherwise)")
  parser.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                      help="L2-normalize embeddings (default: the model's own)")
  parser.add_argument("--max-length", type=int, default=None, help="tokens per text (default 256)")
  parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                      help="compute dtype of the encoder")
  parser.add_argument("--tokens-per-batch", type=int, default=None,
                      help="padded tokens per batch; the batch size follows from each length bucket "
                           f"(default {CPU_TOKENS_PER_BATCH} on CPU, {ACCELERATOR_TOKENS_PER_BATCH} on GPU/TPU)")


def main(argv: Iterable[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m jdr.encode", description=__doc__.splitlines()[0])
  add_model_flags(parser)
  parser.add_argument("--corpus", required=True, help="BEIR directory, corpus.jsonl or collection TSV")
  parser.add_argument("--out", required=True, help="output directory (resumes if it exists)")
  parser.add_argument("--shard-size", type=int, default=10_000, help="documents per shard file")
  parser.add_argument("--batch-size", type=int, default=None,
                      help="documents per batch at the longest bucket (sets --tokens-per-batch)")
  args = parser.parse_args(argv)
  if args.model is None:
    parser.error("--model is required")
  tokens_per_batch = args.tokens_per_batch
  runtime = load_runtime(args.model, pooling=args.pooling, normalize=args.normalize,
                         max_length=args.max_length, dtype=args.dtype)
  if args.batch_size:
    tokens_per_batch = args.batch_size * runtime.max_length
  corpus = formats.read_corpus(args.corpus)
  model_name = args.model if args.model == "minilm" else str(pathlib.Path(args.model).resolve())
  settings = {"model": model_name, "corpus": str(pathlib.Path(args.corpus).resolve()),
              **{k: runtime.info[k] for k in ("pooling", "normalize", "max_length")},
              "dtype": args.dtype}
  start = time.perf_counter()
  meta = encode_corpus(runtime, corpus, args.out, shard_size=args.shard_size, settings=settings,
                       tokens_per_batch=tokens_per_batch)
  seconds = time.perf_counter() - start
  print(f"encoded {meta['num_docs']} documents (dim {meta['dim']}) into {args.out} in {seconds:.1f} s",
        file=sys.stderr)


if __name__ == "__main__":
  main()
