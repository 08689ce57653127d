"""The encoding directory: a corpus's vectors as shards on disk, written by `encode_corpus` and read back.

  encode_corpus(runtime, corpus, "emb/")                  # sharded files, resumable
  emb, ids, meta = load_embeddings("emb/")

An encoding directory holds `emb-NNNNN.npy` (float32 [n, D]) and `ids-NNNNN.txt` per shard plus
`meta.json`. Shards are written atomically, so a killed run resumes from the last finished shard;
`meta.json` records the settings, and a resume with other settings is refused rather than mixing the
embeddings of two models in one index. `jdr.encode` is a thin command line over this module.
"""

import json
import os
import sys
from typing import Iterable, Sequence

import jax
import numpy as np
import tqdm

from jdr.runtime import atomic
from jdr.retrieval import encoder_runtime
from jdr.runtime import paths
from jdr.retrieval import sharded_rows
from jdr.data import corpus_by_host
from jdr.data import prepared
from jdr.data import text as text_lib


def shard_paths(out_dir: paths.epath.Path, shard: int) -> tuple[paths.epath.Path, paths.epath.Path]:
  return out_dir / f"emb-{shard:05d}.npy", out_dir / f"ids-{shard:05d}.txt"


def save_npy(path: paths.epath.Path, array: np.ndarray) -> None:
  atomic.write_atomic(path, lambda f: np.save(f, array))


def corpus_settings(runtime: encoder_runtime.EncoderRuntime, model: str, corpus, **extra) -> dict:
  """What an encoding records of how it was made (`encode_corpus`'s settings): the model and corpus as absolute
  paths (`minilm` as named), the runtime's pooling, normalization and length, the document prompt its
  tokenizer puts before each document (only when there is one: an unprompted encoding's settings are what
  they always were), and `extra` (jdr.encode: dtype); a resume under other settings is refused rather than
  mixing two models' embeddings."""
  settings = {"model": model if model == "minilm" else str(paths.absolute(model)),
              "corpus": str(paths.absolute(corpus)),
              **{k: runtime.info[k] for k in ("pooling", "normalize", "max_length")}}
  prompt = text_lib.prompt_of(runtime.tokenizer)
  if prompt:
    settings["doc_prompt"] = prompt
  return {**settings, **extra}


def encode_corpus(runtime: encoder_runtime.EncoderRuntime, docs: dict, out_dir: str | os.PathLike, *,
                  shard_size: int = 10_000, settings: dict | None = None,
                  tokens_per_batch: int | None = None, passages: int = 1,
                  pieces: Sequence[tuple[str, int]] = ()) -> dict:
  """Encodes `docs` (id -> Doc) into shards under out_dir, resuming finished shards. Returns meta.

  A prepared corpus (jdr.data.prepared.PreparedCorpus) is encoded from its token ids (FirstP; tokenized once
  for this tokenizer and length if no run has) and its ids are read a shard at a time: nothing is held per
  document. Its vectors are `encoder_runtime.encode_tokens`' of the same ids, so they may differ from a dict's (tokenized as
  the shards go, `encoder_runtime.encode_texts`) in the last bits, where batches of other shapes compile differently.

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
    multihost_utils.sync_global_devices("jdr.retrieval.encodings.encode_corpus: settings checked")
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
      emb = encoder_runtime.encode_tokens(runtime, table.token_rows(lo, hi), tokens_per_batch=tokens_per_batch, progress=bar)
    elif pieces:
      emb, parts = encoder_runtime.encode_pieces(runtime, text_lib.tokenize(runtime.tokenizer, texts, runtime.max_length),
                                 list(pieces))
      for name, part in parts.items():
        save_npy(out_dir / f"pieces-{name}-{shard:05d}.npy", part)
      bar.update(len(ids))
    elif passages > 1:
      split = text_lib.passage_tokens(runtime.tokenizer, texts, runtime.max_length, passages)
      ids = [doc for doc, parts in zip(ids, split) for _ in parts]
      emb = encoder_runtime.encode_tokens(runtime, [t for parts in split for t in parts], tokens_per_batch=tokens_per_batch)
      bar.update(len(split))
    else:
      emb = encoder_runtime.encode_texts(runtime, texts, tokens_per_batch=tokens_per_batch, progress=bar)
    emb_path, ids_path = shard_paths(out_dir, shard)
    # ids first, embeddings last: a shard counts as finished only once its embeddings exist.
    atomic.write_text(ids_path, "".join(i + "\n" for i in ids))
    save_npy(emb_path, emb)
  bar.close()
  if count > 1:
    multihost_utils.sync_global_devices("jdr.retrieval.encodings.encode_corpus: every host's shards written")
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


def load_pieces(enc_dir: str | os.PathLike) -> dict[str, np.ndarray]:
  """The window vectors of an encoding made with pieces: {level: [N, K, D]} in row order."""
  enc_dir = paths.as_path(enc_dir)
  meta = read_meta(enc_dir)
  if not meta.get("pieces"):
    raise ValueError(f"{enc_dir}: no piece vectors; encode with --pieces (jdr.encode)")
  return {name: np.concatenate([paths.load_npy(enc_dir / f"pieces-{name}-{s:05d}.npy") for s in range(meta["num_shards"])])
          for name in meta["pieces"]}
