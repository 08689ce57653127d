"""Corpus encoding and index building, in one place for every caller.

`jdr.encode` and `jdr.retrieve` are thin command lines over this module; the trainer's evaluation and
ANCE's index refresh call the same functions, so a corpus is embedded, sharded on disk, indexed and
searched one way everywhere:

  runtime = load_runtime("minilm")                        # a tower, its params, tokenizer, max length
  emb = encode_texts(runtime, texts)                      # or encode_tokens(runtime, token_ids)
  encode_corpus(runtime, corpus, "emb/")                  # sharded files, resumable
  emb, ids, meta = load_embeddings("emb/")
  retriever = build_index(emb, ids, backend="jax", mesh=mesh)   # or load_index("emb/") from disk
  run = retrieve_run(retriever, query_ids, query_emb, k=100)

An encoding directory holds `emb-NNNNN.npy` (float32 [n, D]) and `ids-NNNNN.txt` per shard plus
`meta.json`. Shards are written atomically, so a killed run resumes from the last finished shard;
`meta.json` records the settings, and a resume with other settings is refused rather than mixing the
embeddings of two models in one index.

Library functions here raise exceptions (ValueError, FileNotFoundError), never SystemExit: a
background refresh calling them must not end the trainer. Command lines turn errors into exit codes
(jdr.runtime.cli).
"""

import dataclasses
import itertools
import json
import os
import sys
from typing import Callable, Iterable, Literal, Sequence

import jax
import numpy as np
import tqdm

from jdr.runtime import atomic
from jdr.data import granularity
from jdr.retrieval import index as index_lib
from jdr.runtime import parallel
from jdr.runtime import paths
from jdr.retrieval import sharded_rows
from jdr.data import corpus_by_host
from jdr.data import prepared
from jdr.data import text as text_lib

# A batch holds about this many tokens (padded), whatever its length bucket, so short documents go in
# big batches and long ones in small batches: a small fixed set of compiled shapes, little padding.
# On CPU small batches win: MiniLM at 4 x 256 tokens ran at 287 GFLOP/s on a 2-core x86 CPU, at
# 32 x 256 at 122 GFLOP/s, because the [batch, heads, L, L] attention scores then stop fitting in cache.
# Accelerators want big batches to fill the device: BERT-base at 256 tokens encoded 9% faster at 65,536
# tokens a batch than at 16,384 on an NVIDIA H200.
CPU_TOKENS_PER_BATCH = 1024
ACCELERATOR_TOKENS_PER_BATCH = 65536


def default_tokens_per_batch() -> int:
  return CPU_TOKENS_PER_BATCH if jax.default_backend() == "cpu" else ACCELERATOR_TOKENS_PER_BATCH


# --------------------------------------------------------------------------------------------------
# Encoders.


@dataclasses.dataclass
class EncoderRuntime:
  """A loaded tower with its tokenizer and settings: what it takes to turn texts into vectors."""
  apply_fn: Callable  # (params, input_ids, attention_mask) -> [B, D]
  params: object
  tokenizer: object
  max_length: int
  info: dict
  # (params, input_ids, attention_mask, span_mask [B, S, L]) -> ([B, D], [B, S, D]): FGD's Eq. 7 pieces
  apply_spans: Callable | None = None
  # Batch rows are planned as a multiple of this: the devices that split them (`rows_on_mesh`).
  rows_multiple: int = 1


def rows_on_mesh(fn, mesh):
  """`fn(params, ids, mask)` with the rows of each batch split over the mesh's batch axes: every device
  encodes its own rows, on all hosts; the vectors come back whole to every host (a jax array still being
  computed when this host's devices hold all of it, so the caller can queue the next batch; numpy otherwise).

  Rows must be a multiple of the batch devices: an EncoderRuntime with `rows_multiple` set to
  `parallel.data_parallel_size(mesh)` plans its batches so (with filler rows). Each host passes the same
  full batch; a device reads only its slice of it."""
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  rows_sharding = parallel.batch_sharding(mesh)
  jitted = jax.jit(fn, out_shardings=rows_sharding)
  split = parallel.data_parallel_size(mesh)

  def apply(params, ids, mask):
    if len(ids) % split:
      raise ValueError(f"a batch of {len(ids)} rows does not split over {split} devices; plan batches with "
                       f"rows_multiple={split}")
    put = lambda x: jax.make_array_from_callback(x.shape, rows_sharding, lambda index: np.asarray(x)[index])
    out = jitted(params, put(ids), put(mask))
    return out if out.is_fully_addressable else multihost_utils.process_allgather(out, tiled=True)

  return apply


def whole_on(params, mesh):
  """params (global arrays, possibly split over hosts) whole and replicated on `mesh`, e.g. this host's own
  devices, for work each host does alone on its part of the corpus (`evaluation.TowerEncoder`)."""
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  whole = lambda x: multihost_utils.process_allgather(x, tiled=True) if (
      isinstance(x, jax.Array) and not x.is_fully_addressable) else np.asarray(x)
  return jax.device_put(jax.tree.map(whole, params), parallel.replicated(mesh))


GATHER_BYTES = 1 << 28


def gather_host_parts(part: np.ndarray | None, dim: int, block_bytes: int = GATHER_BYTES) -> np.ndarray:
  """Every host's [n_i, dim] part (None: an empty one), concatenated in process order, on every host.

  process_allgather stages what it gathers on every local device, so the parts go over in blocks of rows
  (about `block_bytes` gathered per call): an 8.8M x 768 float32 corpus gathered at once would need 27 GB
  on each device. The result is assembled in host memory."""
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  part = np.zeros((0, dim), np.float32) if part is None else np.asarray(part, np.float32)
  sizes = [int(n) for n in np.asarray(multihost_utils.process_allgather(np.int64(len(part)))).ravel()]
  block = max(1, block_bytes // (4 * max(dim, 1) * len(sizes)))
  out = np.empty((sum(sizes), dim), np.float32)
  starts = np.concatenate([[0], np.cumsum(sizes)])
  for lo in range(0, max(sizes), block):  # the same number of calls on every host
    padded = np.zeros((block, dim), np.float32)
    mine = part[lo:lo + block]
    padded[:len(mine)] = mine
    stacked = np.asarray(multihost_utils.process_allgather(padded))  # [hosts, block, dim]
    for host, n in enumerate(sizes):
      take = max(0, min(block, n - lo))
      out[starts[host] + lo:starts[host] + lo + take] = stacked[host, :take]
  return out


def load_runtime(model: str, *, pooling: str | None = None, normalize: bool | None = None,
                 max_length: int | None = None, dtype: str = "auto",
                 side: str = "doc") -> EncoderRuntime:
  """Loads `model` with its tokenizer, jitted, for one side ("query" or "doc").

  `model` is a Hugging Face directory, `minilm`, or a jdr model (a `jdr.export` directory or a training
  workdir), whose query and document towers may differ and whose pooling is part of what was trained.
  """
  # pylint: disable=g-import-not-at-top  (model code loads lazily, so `--help` stays fast)
  from jdr.models import build
  from jdr.models import hf
  from jdr.models.towers import TwoTower
  if side not in ("query", "doc"):
    raise ValueError(f"side must be 'query' or 'doc', got {side!r}")
  if build.is_jdr_model(model):
    two_tower, params, tokenizer, description = build.load_jdr_model(model)
    tower = getattr(two_tower, side)
    if (pooling not in (None, tower.pooling)) or (normalize not in (None, tower.normalize)):
      raise ValueError(f"{model}: a trained jdr model fixes pooling={tower.pooling} and "
                       f"normalize={tower.normalize}; drop --pooling / --normalize")
    method = TwoTower.encode_query if side == "query" else TwoTower.encode_doc

    @jax.jit
    def apply_two_tower(params, input_ids, attention_mask):
      return two_tower.apply({"params": params}, input_ids, attention_mask, method=method)

    @jax.jit
    def spans_two_tower(params, input_ids, attention_mask, span_mask):
      return two_tower.apply({"params": params}, input_ids, attention_mask, span_mask=span_mask,
                             method=TwoTower.encode_doc)

    params = _serving(params, two_tower)
    length, source = (max_length, "--max-length") if max_length else build.serving_length(description, side)
    info = {"pooling": tower.pooling, "normalize": tower.normalize, "max_length": length, "max_length_from": source,
            "trained_max_length": description[f"{side}_max_length"]}
    return EncoderRuntime(apply_two_tower, params, tokenizer, int(info["max_length"]), info,
                          spans_two_tower if side == "doc" else None)

  one_tower, params, tokenizer, info = hf.load_tower(
      model, pooling=pooling, normalize=normalize, max_length=max_length, dtype=build.compute_dtype(dtype))
  params = _serving(params, one_tower)

  @jax.jit
  def apply_fn(params, input_ids, attention_mask):
    return one_tower.apply({"params": params}, input_ids, attention_mask)

  @jax.jit
  def apply_spans(params, input_ids, attention_mask, span_mask):
    return one_tower.apply({"params": params}, input_ids, attention_mask, span_mask=span_mask)

  return EncoderRuntime(apply_fn, params, tokenizer, int(info["max_length"]), info, apply_spans)


def _serving(params, module):
  """The weights a runtime encodes with: matmul weights already in the compute dtype (same vectors)."""
  from jdr.models import towers  # pylint: disable=g-import-not-at-top
  return jax.jit(lambda p: towers.serving_params(p, module))(params)


def length_line(runtime: EncoderRuntime, texts: str) -> str:
  """What a command says of the length it cuts `texts` ("queries", "documents") at, and why."""
  info = runtime.info
  trained = f"; trained at {info['trained_max_length']}" if info.get("trained_max_length") else ""
  return f"{texts}: up to {runtime.max_length} tokens ({info.get('max_length_from', '--max-length')}{trained})"


def encode_pieces(runtime: EncoderRuntime, token_ids: Sequence[np.ndarray], levels: Sequence[tuple[str, int]],
                  *, rows_per_batch: int = 8) -> tuple[np.ndarray, dict[str, np.ndarray]]:
  """Document vectors [N, D] and, per level, window vectors [N, K, D] (NaN where a window is past the end)
  from one forward pass per batch (FGD Eq. 7): documents padded to max_length, windows of each level's size."""
  if runtime.apply_spans is None:
    raise ValueError("this encoder has no span embeddings (a query tower?)")
  if runtime.info.get("pooling") != "cls":
    raise ValueError(f"piece embeddings (Eq. 7) need [CLS] pooling; the model pools with "
                     f"{runtime.info.get('pooling')} (pass --pooling cls for a Hugging Face model)")
  length, pad = runtime.max_length, runtime.tokenizer.pad_token_id or 0
  docs, pieces = [], {name: [] for name, _ in levels}
  for start in range(0, len(token_ids), rows_per_batch):
    chunk = token_ids[start:start + rows_per_batch]
    ids = np.full((rows_per_batch, length), pad, np.int32)
    mask = np.zeros((rows_per_batch, length), np.int32)
    for i, t in enumerate(chunk):
      ids[i, :len(t)], mask[i, :len(t)] = t, 1
    masks, valids = zip(*(granularity.windows(mask, size) for _, size in levels))
    vec, spans = runtime.apply_spans(runtime.params, ids, mask, np.concatenate(masks, axis=1))
    vec, spans = np.asarray(vec, np.float32), np.asarray(spans, np.float32)
    docs.append(vec[:len(chunk)])
    at = 0
    for (name, _), valid in zip(levels, valids):
      k = valid.shape[1]
      part = np.where(valid[:, :, None], spans[:, at:at + k], np.nan)
      pieces[name].append(part[:len(chunk)])
      at += k
  return np.concatenate(docs), {name: np.concatenate(parts) for name, parts in pieces.items()}


def batch_plan_args(max_length: int, tokens_per_batch: int, rows_multiple: int = 1) -> dict:
  """How jdr batches for encoding: ~tokens_per_batch padded tokens per length bucket, few shapes, rows a
  multiple of `rows_multiple` (the devices splitting them)."""
  return {"max_tokens": tokens_per_batch, "bucket_lengths": text_lib.default_bucket_lengths(max_length),
          "short_rows_to_power_of_two": True, "multiple_of": rows_multiple}


def document_tokens(tokenizer, corpus, max_length: int, lo: int = 0, hi: int | None = None,
                    *, progress: bool = True) -> Sequence[np.ndarray]:
  """Token ids of the documents in rows [lo, hi) of `corpus` (a mapping {doc id: Doc}, in row order), as
  `text.tokenize` gives them for `text.doc_text`. A prepared corpus (jdr.data.prepared) reads them from its
  map, tokenizing the whole corpus once on first use for this (tokenizer, max_length), and holds nothing per
  document; any other is tokenized now."""
  hi = len(corpus) if hi is None else hi
  if isinstance(corpus, prepared.PreparedCorpus) and prepared.can_tokenize(tokenizer):
    return corpus.tokenized(tokenizer, max_length, progress=progress).token_rows(lo, hi)
  docs = corpus.docs(range(lo, hi)) if isinstance(corpus, prepared.PreparedCorpus) else [
      corpus[d] for d in itertools.islice(corpus, lo, hi)]
  return text_lib.tokenize(tokenizer, [text_lib.doc_text(doc) for doc in docs], max_length)


def encode_texts(runtime: EncoderRuntime, texts: Sequence[str], *,
                 tokens_per_batch: int | None = None,
                 progress: tqdm.tqdm | None = None) -> np.ndarray:
  """Embeds texts in their given order; returns float32 [len(texts), D].

  The texts are tokenized by a background thread while the first batches encode (`tokenize_in_background`,
  `streamed_batches`): on an accelerator tokenizing is a large share of the whole otherwise."""
  if not texts:
    raise ValueError("no texts to encode")
  tokens_per_batch = tokens_per_batch or default_tokens_per_batch()
  chunks = text_lib.tokenize_in_background(runtime.tokenizer, list(texts), runtime.max_length)
  batches = text_lib.streamed_batches(chunks, pad_id=runtime.tokenizer.pad_token_id or 0,
                                      **batch_plan_args(runtime.max_length, tokens_per_batch, runtime.rows_multiple))
  return _encode_batches(runtime, len(texts), batches, progress)


def encode_tokens(runtime: EncoderRuntime, token_ids: Sequence[np.ndarray], *,
                  tokens_per_batch: int | None = None,
                  progress: tqdm.tqdm | None = None) -> np.ndarray:
  """Embeds already tokenized texts (unpadded id arrays, each <= runtime.max_length) in their order."""
  if not len(token_ids):
    raise ValueError("no texts to encode")
  tokens_per_batch = tokens_per_batch or default_tokens_per_batch()
  batches = text_lib.bucketed_batches(token_ids, pad_id=runtime.tokenizer.pad_token_id or 0,
                                      **batch_plan_args(runtime.max_length, tokens_per_batch, runtime.rows_multiple))
  return _encode_batches(runtime, len(token_ids), batches, progress)


def _encode_batches(runtime: EncoderRuntime, count: int, batches, progress: tqdm.tqdm | None) -> np.ndarray:
  """The vectors of `count` texts from (indices, input_ids, mask) batches that cover each index once."""
  out = None

  def store(indices, emb):
    nonlocal out
    emb = np.asarray(emb, dtype=np.float32)  # waits for this batch only: the next one is already queued
    if out is None:
      out = np.empty((count, emb.shape[-1]), np.float32)
    # Filler rows past len(indices) only round the batch up to a compiled shape.
    out[indices] = emb[:len(indices)]
    if progress is not None:
      progress.update(len(indices))

  # One batch in flight: the device encodes batch i while the host pads batch i+1 and copies it over, so an
  # accelerator does not idle between batches (fetching each result before building the next left it idle
  # for the host's share of every batch).
  in_flight = None
  for indices, input_ids, mask in batches:
    emb = runtime.apply_fn(runtime.params, input_ids, mask)
    if in_flight is not None:
      store(*in_flight)
    in_flight = (indices, emb)
  store(*in_flight)
  return out


# --------------------------------------------------------------------------------------------------
# Encoding directories.


def shard_paths(out_dir: paths.epath.Path, shard: int) -> tuple[paths.epath.Path, paths.epath.Path]:
  return out_dir / f"emb-{shard:05d}.npy", out_dir / f"ids-{shard:05d}.txt"


def save_npy(path: paths.epath.Path, array: np.ndarray) -> None:
  atomic.write_atomic(path, lambda f: np.save(f, array))


def encode_corpus(runtime: EncoderRuntime, docs: dict, out_dir: str | os.PathLike, *,
                  shard_size: int = 10_000, settings: dict | None = None,
                  tokens_per_batch: int | None = None, passages: int = 1,
                  pieces: Sequence[tuple[str, int]] = ()) -> dict:
  """Encodes `docs` (id -> Doc) into shards under out_dir, resuming finished shards. Returns meta.

  A prepared corpus (jdr.data.prepared.PreparedCorpus) is encoded from its token ids (FirstP; tokenized once
  for this tokenizer and length if no run has) and its ids are read a shard at a time: nothing is held per
  document. Its vectors are `encode_tokens`' of the same ids, so they may differ from a dict's (tokenized as
  the shards go, `encode_texts`) in the last bits, where batches of other shapes compile differently.

  In a one-process job `docs` is the corpus. In a multi-process job (jax.distributed: a pod, SLURM,
  `jdr.launch.local`) it is this process's part, in process order (`formats.read_corpus(path,
  part=jax.process_index(), parts=jax.process_count())` reads only that part of the file): process i
  tokenizes, encodes and writes only its part's shards into the shared out_dir (local disk all hosts share,
  or gs://), numbered after the shards of processes 0..i-1, so the directory reads back in corpus order.
  Process 0 writes meta.json, and marks it complete once every host's shards are there and no document id
  occurs in two parts.

  passages = 1 is FirstP (each document truncated to the model's length, one row); passages = P > 1 is
  ANCE's MaxP: up to P consecutive passages of max_length tokens per document, one row each, the ids file
  naming the document on every row (search then keeps a document's best passage: `retrieve_run`).
  `pieces` [(name, window tokens)] also stores each document's window vectors (FGD Eq. 7) in
  pieces-NAME-SHARD.npy [n, K, D] (NaN past a document's end), for the Eq. 16 ensemble of `jdr.retrieve`.
  Raises ValueError when out_dir holds an encoding made with other settings or another split into parts.
  """
  if shard_size < 1:
    raise ValueError(f"shard_size must be positive, got {shard_size}")
  index, count = jax.process_index(), jax.process_count()
  part_docs = [len(docs)]
  if count > 1:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    part_docs = [int(n) for n in np.asarray(multihost_utils.process_allgather(np.int64(len(docs)))).ravel()]
  if not sum(part_docs):
    raise ValueError("the corpus is empty: nothing to encode")
  out_dir = paths.absolute(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  table = None
  if isinstance(docs, prepared.PreparedCorpus):
    if count > 1:
      raise ValueError("a prepared corpus is the whole corpus: on several hosts pass each host its own part")
    doc_ids = docs.id_sequence()
    if passages == 1 and not pieces and prepared.can_tokenize(runtime.tokenizer):
      table = docs.tokenized(runtime.tokenizer, runtime.max_length)
  else:
    doc_ids = list(docs)
  part_shards = [-(-n // shard_size) for n in part_docs]
  first_shard, num_shards = sum(part_shards[:index]), sum(part_shards)
  meta = {"num_docs": sum(part_docs), "shard_size": shard_size, "num_shards": num_shards,
          **(settings or {})}
  if count > 1:
    meta["part_docs"] = part_docs  # the shard layout: a resume must split the corpus the same way
  if passages > 1:
    meta["passages"] = passages
  if pieces:
    if passages > 1:
      raise ValueError("piece vectors are for FirstP encodings (passages=1)")
    meta["pieces"] = {name: int(size) for name, size in pieces}
  meta_path = out_dir / "meta.json"
  if meta_path.exists():
    old = json.loads(meta_path.read_text())
    # Over both key sets: a key only the old encoding has (a split into parts, MaxP passages) differs too.
    diff = {k: (old.get(k), meta.get(k)) for k in sorted((set(old) | set(meta)) - {"complete", "dim"})
            if old.get(k) != meta.get(k)}
    if diff:
      raise ValueError(f"{meta_path}: the existing encoding was made with other settings "
                       f"(key: (old, new)) {diff}; use a new output directory")
  if count > 1:
    # Every host has read meta.json before host 0 rewrites it.
    multihost_utils.sync_global_devices("jdr.retrieval.corpus.encode_corpus: settings checked")
    _check_ids_unique_across_parts(out_dir, doc_ids, index, count)
  if index == 0:
    atomic.write_text(meta_path, json.dumps({**meta, "complete": False}, indent=1))

  mine = range(part_shards[index])  # this part's shards, local numbering
  size_of = lambda s: min(shard_size, len(doc_ids) - s * shard_size)
  done = [s for s in mine if all(p.exists() for p in shard_paths(out_dir, first_shard + s))]
  todo = [s for s in mine if s not in done]
  if done:
    print(f"resuming: {len(done)} of {len(mine)} shards already encoded in {out_dir}", file=sys.stderr)
  bar = tqdm.tqdm(total=len(doc_ids), initial=sum(size_of(s) for s in done), unit="doc",
                  desc="encode" if count == 1 else f"encode (host {index} of {count})", smoothing=0.1,
                  mininterval=1.0)
  for local_shard in todo:
    shard = first_shard + local_shard
    lo, hi = local_shard * shard_size, min(len(doc_ids), (local_shard + 1) * shard_size)
    ids = doc_ids[lo:hi]
    if table is None:
      texts = (docs.texts(range(lo, hi)) if isinstance(docs, prepared.PreparedCorpus)
               else [text_lib.doc_text(docs[i]) for i in ids])
    if table is not None:
      emb = encode_tokens(runtime, table.token_rows(lo, hi), tokens_per_batch=tokens_per_batch, progress=bar)
    elif pieces:
      emb, parts = encode_pieces(runtime, text_lib.tokenize(runtime.tokenizer, texts, runtime.max_length),
                                 list(pieces))
      for name, part in parts.items():
        save_npy(out_dir / f"pieces-{name}-{shard:05d}.npy", part)
      bar.update(len(ids))
    elif passages > 1:
      split = text_lib.passage_tokens(runtime.tokenizer, texts, runtime.max_length, passages)
      ids = [doc for doc, parts in zip(ids, split) for _ in parts]
      emb = encode_tokens(runtime, [t for parts in split for t in parts], tokens_per_batch=tokens_per_batch)
      bar.update(len(split))
    else:
      emb = encode_texts(runtime, texts, tokens_per_batch=tokens_per_batch, progress=bar)
    emb_path, ids_path = shard_paths(out_dir, shard)
    # ids first, embeddings last: a shard counts as finished only once its embeddings exist.
    atomic.write_text(ids_path, "".join(i + "\n" for i in ids))
    save_npy(emb_path, emb)
  bar.close()
  if count > 1:
    multihost_utils.sync_global_devices("jdr.retrieval.corpus.encode_corpus: every host's shards written")
  missing = [s for s in range(num_shards) if not all(p.exists() for p in shard_paths(out_dir, s))]
  if missing:
    raise RuntimeError(f"{out_dir}: shards {missing[:10]} are missing after every host finished; is out_dir on a "
                       "file system all hosts share?")
  if count > 1 and index == 0:
    # Every host read every part's ids before encoding (the sync above is after that): the swap is done.
    swap = out_dir / ".part-ids"
    for part_ids in swap.glob("part-*.npz"):
      part_ids.unlink(missing_ok=True)
    try:
      swap.rmdir()
    except OSError:
      pass  # object stores have no directories to remove; the files are gone, which is what matters
  meta["complete"] = True
  meta["dim"] = int(paths.load_npy(shard_paths(out_dir, 0)[0], mmap_mode="r").shape[1])
  if index == 0:
    atomic.write_text(meta_path, json.dumps(meta, indent=1))
  return meta


def _check_ids_unique_across_parts(out_dir, doc_ids: list[str], index: int, count: int) -> None:
  """Before any host encodes: the hosts swap their parts' ids through out_dir and all raise if one id is in
  two parts (each host has checked its own part while reading it), instead of finding it after hours."""
  where: dict[str, int] = {}
  parts = corpus_by_host.swap_parts(out_dir / ".part-ids", index, count, {"ids": np.asarray(doc_ids, dtype=str)})
  for k, arrays in enumerate(parts):
    for doc in arrays["ids"].tolist():
      if doc in where:
        raise ValueError(f"doc id {doc!r} is in the corpus parts of host {where[doc]} and host {k}: document ids "
                         "must be unique; nothing was encoded")
      where[doc] = k


def read_meta(enc_dir: str | os.PathLike) -> dict:
  """The settings of a finished encoding directory (model, pooling, normalize, max_length, ...)."""
  meta_path = paths.as_path(enc_dir) / "meta.json"
  if not meta_path.exists():
    raise FileNotFoundError(f"{meta_path}: no meta.json; is {enc_dir} the --out of jdr.encode?")
  meta = json.loads(meta_path.read_text())
  if not meta.get("complete"):
    raise ValueError(f"{enc_dir}: the encoding is unfinished; run jdr.encode again to resume it")
  return meta


def read_ids(enc_dir: str | os.PathLike) -> list[str]:
  """The document ids of a finished encoding directory, in row order, without loading embeddings."""
  enc_dir = paths.as_path(enc_dir)
  meta = read_meta(enc_dir)
  ids = []
  for shard in range(meta["num_shards"]):
    ids.extend(shard_paths(enc_dir, shard)[1].read_text().splitlines())
  if _documents(ids, meta) != meta["num_docs"]:
    raise ValueError(f"{enc_dir}: {len(ids)} ids, meta says {meta['num_docs']} documents: "
                     "the directory is corrupt")
  return ids


def _documents(ids: list[str], meta: dict) -> int:
  """Documents behind an encoding's rows: one row each, or (MaxP) runs of rows with the same id."""
  if meta.get("passages", 1) <= 1:
    return len(ids)
  return sum(1 for i, d in enumerate(ids) if i == 0 or ids[i - 1] != d)


def load_embeddings(enc_dir: str | os.PathLike) -> tuple[np.ndarray, list[str], dict]:
  """Reads a finished encoding directory: (embeddings [N, D], ids, meta).

  The embeddings are the shards memory-mapped (on local disk), one shard as a memmap and several as one
  `sharded_rows.ShardedRows`: nothing is concatenated, so the matrix is not held twice on its way to an
  index or the devices. `np.asarray(emb)` is the whole copy where a caller needs one."""
  enc_dir = paths.as_path(enc_dir)
  meta = read_meta(enc_dir)
  embs, ids = [], []
  for shard in range(meta["num_shards"]):
    emb_path, ids_path = shard_paths(enc_dir, shard)
    embs.append(paths.load_npy(emb_path, mmap_mode="r"))
    ids.extend(ids_path.read_text().splitlines())
  emb = embs[0] if len(embs) == 1 else sharded_rows.ShardedRows(embs)
  if emb.shape[0] != len(ids) or _documents(ids, meta) != meta["num_docs"]:
    raise ValueError(f"{enc_dir}: {emb.shape[0]} embeddings, {len(ids)} ids, meta says "
                     f"{meta['num_docs']} documents: the directory is corrupt")
  return emb, ids, meta


def _examples(ids: list[str], limit: int = 5) -> str:
  return ", ".join(repr(i) for i in ids[:limit]) + (", ..." if len(ids) > limit else "")


def check_ids_match(enc_dir_or_ids: str | os.PathLike | Sequence[str], corpus_ids: Iterable[str],
                    what: str) -> None:
  """Raises ValueError unless an encoding holds exactly the corpus' documents, in the same order.

  `enc_dir_or_ids` is an encoding directory (named in the message) or its ids; `corpus_ids` the corpus'
  ids (a corpus dict will do); `what` leads the message and should name the corpus or the setting that
  chose it, e.g. f"data.dataset={path}". Rows of a precomputed encoding are matched to documents by
  position, so another corpus, or the same one reordered, would pair documents with other vectors.
  """
  if isinstance(enc_dir_or_ids, (str, os.PathLike)):
    source, enc_ids = f"the encoding in {enc_dir_or_ids}", read_ids(enc_dir_or_ids)
  else:
    source, enc_ids = "the encoding", list(enc_dir_or_ids)
  corpus_ids = list(corpus_ids)
  if enc_ids == corpus_ids:
    return
  head = f"{what}: {source} ({len(enc_ids)} ids) does not match the corpus ({len(corpus_ids)} ids)"
  enc_set, corpus_set = set(enc_ids), set(corpus_ids)
  only_enc = [i for i in enc_ids if i not in corpus_set]
  only_corpus = [i for i in corpus_ids if i not in enc_set]
  if only_enc or only_corpus:
    parts = [f"{len(ids)} only in the {side} ({_examples(ids)})"
             for side, ids in (("encoding", only_enc), ("corpus", only_corpus)) if ids]
    raise ValueError(f"{head}: {', '.join(parts)}; re-encode this corpus")
  if len(enc_ids) != len(corpus_ids):
    raise ValueError(f"{head}: the same ids, but one side repeats some; re-encode this corpus")
  rows = [r for r, (a, b) in enumerate(zip(enc_ids, corpus_ids)) if a != b]
  shown = ", ".join(f"row {r}: {enc_ids[r]!r} in the encoding, {corpus_ids[r]!r} in the corpus" for r in rows[:3])
  raise ValueError(f"{head}: the same ids in another order, {len(rows)} rows differ ({shown}"
                   f"{', ...' if len(rows) > 3 else ''}); re-encode this corpus")


# --------------------------------------------------------------------------------------------------
# Indexes and search.


def build_index(embeddings: np.ndarray, ids: Sequence[str],
                backend: Literal["faiss", "jax"] = "faiss", factory: str = "Flat",
                mesh=None, recall_target: float = 1.0, gpu: dict | None = None,
                jax_dtype: str = "auto") -> index_lib.Retriever:
  """A retriever over embeddings [N, D] with their N ids.

  `factory` is a Faiss index_factory string (the faiss back-end; `gpu` = {"gpu_layout", "gpu_float16"}
  says how it spreads over the host's GPUs, see FaissRetriever); the jax back-end is exact top-k over
  the embedding matrix sharded by rows over `mesh` (default: all devices) and takes only "Flat"; `jax_dtype`
  is its storage (see index.JaxRetriever).
  """
  if not isinstance(embeddings, sharded_rows.ShardedRows):
    embeddings = np.asarray(embeddings)
  if embeddings.ndim != 2:
    raise ValueError(f"embeddings must be [N, D], got shape {embeddings.shape}")
  if backend == "faiss":
    kwargs = {"factory": factory, **(gpu or {})}
  elif backend == "jax":
    if factory != "Flat":
      raise ValueError(f"the jax back-end is exact (factory 'Flat'), not {factory!r}; use backend='faiss'")
    kwargs = {"mesh": mesh, "recall_target": recall_target, "dtype": jax_dtype}
  else:
    raise ValueError(f"backend must be 'faiss' or 'jax', got {backend!r}")
  retriever = index_lib.make_retriever(backend, embeddings.shape[1], **kwargs)
  retriever.add(embeddings, ids)
  return retriever


def load_index(enc_dir: str | os.PathLike, backend: Literal["faiss", "jax"] = "faiss",
               factory: str = "Flat", *, save: bool = False, mesh=None,
               recall_target: float = 1.0, gpu: dict | None = None,
               jax_dtype: str = "auto") -> index_lib.Retriever:
  """A retriever over an encoding directory; reuses a Faiss index saved in it (see `save`).

  With `save`, a built Faiss index is kept in enc_dir/index-faiss-FACTORY, so that a compressed index
  is trained once.
  """
  saved = paths.as_path(enc_dir) / f"index-{backend}-{factory.replace(',', '_')}"
  if backend == "faiss" and saved.is_dir():
    return index_lib.load_retriever(saved, **(gpu or {}))
  emb, ids, _ = load_embeddings(enc_dir)
  retriever = build_index(emb, ids, backend, factory, mesh, recall_target, gpu if backend == "faiss" else None,
                          jax_dtype)
  if save and backend == "faiss":
    retriever.save(saved)
  return retriever


def load_pieces(enc_dir: str | os.PathLike) -> dict[str, np.ndarray]:
  """The window vectors of an encoding made with pieces: {level: [N, K, D]} in row order."""
  enc_dir = paths.as_path(enc_dir)
  meta = read_meta(enc_dir)
  if not meta.get("pieces"):
    raise ValueError(f"{enc_dir}: no piece vectors; encode with --pieces (jdr.encode)")
  return {name: np.concatenate([paths.load_npy(enc_dir / f"pieces-{name}-{s:05d}.npy") for s in range(meta["num_shards"])])
          for name in meta["pieces"]}


def ensemble_rerank(run: dict[str, dict[str, float]], query_ids: Sequence[str], query_embeddings: np.ndarray,
                    row_of: dict[str, int], pieces: dict[str, np.ndarray], gamma: float,
                    k: int) -> dict[str, dict[str, float]]:
  """FGD's multi-vector ensemble (Eq. 16) over each query's retrieved documents: s(q, d) + gamma x the sum
  over levels of the best window's score, then the top k."""
  out = {}
  for qi, qid in enumerate(query_ids):
    docs = list(run.get(qid, {}))
    if not docs:
      out[qid] = {}
      continue
    rows = np.array([row_of[d] for d in docs])
    extra = np.zeros(len(docs), np.float32)
    for vectors in pieces.values():
      scores = np.einsum("nkd,d->nk", vectors[rows], query_embeddings[qi])
      extra += np.nan_to_num(np.nanmax(np.where(np.isnan(scores), -np.inf, scores), axis=1), neginf=0.0)
    combined = np.array([run[qid][d] for d in docs], np.float32) + gamma * extra
    order = np.argsort(-combined, kind="stable")[:k]
    out[qid] = {docs[i]: float(combined[i]) for i in order}
  return out


def retrieve_run(retriever: index_lib.Retriever, query_ids: Sequence[str], query_embeddings: np.ndarray,
                 k: int, passages: int = 1) -> dict[str, dict[str, float]]:
  """Top k documents per query as a run {query id: {doc id: score}}, best first. With `passages` rows per
  document (a MaxP encoding) it searches k x passages rows and scores a document by its best passage, so
  the k documents are exact whenever each has at most `passages` rows."""
  query_ids = list(query_ids)
  if len(query_ids) != len(query_embeddings):
    raise ValueError(f"{len(query_ids)} query ids for {len(query_embeddings)} query embeddings")
  if k < 1:
    raise ValueError(f"k must be positive, got {k}")
  if not query_ids:
    return {}
  if passages <= 1:
    scores, ids = retriever.search(query_embeddings, k)
    return index_lib.to_run(query_ids, scores, ids)
  scores, ids = retriever.search(query_embeddings, k * passages)
  run = {}
  for qid, row_scores, row_ids in zip(query_ids, scores, ids):
    best: dict[str, float] = {}
    for d, s in zip(row_ids, row_scores):  # best first: a document's first row is its best passage
      if d and np.isfinite(s) and d not in best:
        best[d] = float(s)
    run[qid] = dict(list(best.items())[:k])
  return run
