"""The trainer's view of the corpus: `TowerEncoder` tokenizes the corpus and the queries once and encodes them with
any params of the towers being trained, jitted once. The evaluation, the dense miners of STAR's static negatives
and ADORE's index, and ANCE's refresh all encode through it (and through encoder_runtime and encodings
underneath), so there is one encode path.
"""

from __future__ import annotations

import os
import sys
from typing import Sequence

import jax
import numpy as np
import tqdm

from jdr.data import prepared
from jdr.data import text as text_lib
from jdr.models import towers
from jdr.models.towers import TwoTower
from jdr.retrieval import corpus_cache
from jdr.retrieval import encoder_runtime
from jdr.retrieval import encodings
from jdr.runtime import parallel
from jdr.runtime import paths
from jdr.runtime import timings


# Documents a shard of a resumable full-corpus encoding: a killed evaluation redoes at most this many.
SHARD_DOCS = 10_000


class TowerEncoder:
  """Encodes the corpus (document tower) and queries (query tower) of a dataset with given params.

  With a `mesh` of more than one device (the trainer's), each batch's rows are split over its batch axes
  (`jdr.retrieval.encoder_runtime.rows_on_mesh`): no device encodes what another does. On several hosts each host tokenizes
  and encodes only its own contiguous part of the corpus on its own devices (`jdr.retrieval.encoder_runtime.rows_on_mesh` over them), and
  the parts' vectors are gathered to every host.

  With `cache_dir` (one host), corpus vectors are kept there and read back for a document side, settings and
  corpus encoded before (`jdr.retrieval.corpus_cache`).

  `prompts` ({"query", "doc"}: the model's description["prompts"]; None = none): queries are tokenized after
  the query prompt (`query_tokenizer`), documents after the document prompt (`doc_tokenizer`)."""

  def __init__(self, model: TwoTower, tokenizer, data, *, query_max_length: int, doc_max_length: int,
               tokens_per_batch: int | None = None, mesh=None, cache_dir: str = "", prompts: dict | None = None):
    self.data, self.tokenizer = data, tokenizer
    self.query_tokenizer = text_lib.prompted(tokenizer, (prompts or {}).get("query"))
    self.doc_tokenizer = text_lib.prompted(tokenizer, (prompts or {}).get("doc"))
    self._model = model
    self.query_max_length, self.doc_max_length = query_max_length, doc_max_length
    self.tokens_per_batch = tokens_per_batch or None
    self.doc_ids = prepared.id_sequence(data.corpus)  # a prepared corpus's ids stay in its map
    self._doc_tokens = None
    self._query_tokens: dict[str, np.ndarray] = {}
    doc = lambda p, i, m: model.apply({"params": p}, i, m, method=TwoTower.encode_doc)
    query = lambda p, i, m: model.apply({"params": p}, i, m, method=TwoTower.encode_query)
    self.rows_multiple = 1
    if mesh is not None and mesh.devices.size > 1:
      self.encode_doc = encoder_runtime.rows_on_mesh(doc, mesh)
      self.encode_query = encoder_runtime.rows_on_mesh(query, mesh)
      self.rows_multiple = parallel.data_parallel_size(mesh)
    else:
      self.encode_doc, self.encode_query = jax.jit(doc), jax.jit(query)
    # Several hosts: each tokenizes and encodes only its own contiguous part of the corpus, on its own
    # devices, with no collective until the parts' vectors are gathered; tokenizing 8.8M documents on
    # every host, and stepping all hosts through every batch in lockstep, would not scale.
    self.hosts, self.host = jax.process_count(), jax.process_index()
    n = len(self.doc_ids)
    self.part = (n * self.host // self.hosts, n * (self.host + 1) // self.hosts)
    self._doc_fn = doc
    # Encoding only reads the weights: their matmul weights cast once a pass, not in every batch's forward.
    self.serving = jax.jit(lambda p: towers.serving_params(p, model))
    if self.hosts > 1:
      self._host_mesh = parallel.make_mesh((-1, 1, 1), devices=jax.local_devices())
      self._encode_part = encoder_runtime.rows_on_mesh(doc, self._host_mesh)
    # Hosts encode parts of the corpus; one host's cache could not name the others' vectors.
    self.cache = corpus_cache.CorpusCache(cache_dir) if cache_dir and self.hosts == 1 else None
    self._tokens_digest = None

  @property
  def doc_tokens(self):
    """Token ids of this host's part of the corpus (`self.part`; the whole corpus on one host)."""
    if self._doc_tokens is None:  # once per run, on first use: a prepared corpus's rows of its map
      lo, hi = self.part
      self._doc_tokens = encoder_runtime.document_tokens(self.doc_tokenizer, self.data.corpus, self.doc_max_length,
                                                         lo, hi, progress=self.host == 0)
    return self._doc_tokens

  @timings.timed("encode_corpus")
  def corpus(self, params, progress: bool = False, shards_dir: str | os.PathLike | None = None) -> np.ndarray:
    """float32 [N, D], rows in `self.doc_ids` order, on every host.

    With `shards_dir` (one host) the corpus is encoded a shard at a time into a folder of it named for
    everything that made the vectors (`_encode_in_shards`), and a call that finds shards there, left by one
    killed midway, encodes only the rest; the matrix is then those shards memory-mapped (`jdr.retrieval.sharded_rows`)."""
    encode = (lambda: self._encode_corpus(params, progress)) if shards_dir is None or self.hosts > 1 else (
        lambda: self._encode_in_shards(params, paths.as_path(shards_dir)))
    if self.cache is None:
      return encode()
    name = corpus_cache.entry_name(
        doc_weights=corpus_cache.weights_digest(corpus_cache.doc_side(params)), tower=repr(self._model.doc),
        tokens=self._doc_tokens_digest(),
        batching=f"{self.doc_max_length} {self.tokens_per_batch} {self.rows_multiple}")
    emb = self.cache.get(name)
    if emb is None:
      emb = encode()
      self.cache.put(name, emb)
    else:
      print(f"corpus vectors of this document side read from {self.cache.folder}/{name}.npy", file=sys.stderr)
    return emb

  def _doc_tokens_digest(self) -> str:
    if self._tokens_digest is None:
      self._tokens_digest = corpus_cache.tokens_digest(self.doc_tokens)
    return self._tokens_digest

  def _encode_in_shards(self, params, root) -> np.ndarray:
    """`jdr.retrieval.encodings.encode_corpus` into root/NAME (resumable by shard), read back mapped. NAME digests the
    document side's weights and settings, the corpus and the batching, so shards of other weights are never
    mixed in: they are an earlier encoding's (other weights, killed before it ended), and are removed."""
    corpus = self.data.corpus
    if isinstance(corpus, prepared.PreparedCorpus) and prepared.tokenizer_fingerprint(self.doc_tokenizer):
      # The prepared corpus's key names its file; its token ids are the tokenizer's and its prompt's (nothing
      # read per document).
      tokens = f"{corpus.manifest['key']} {prepared.tokenizer_fingerprint(self.doc_tokenizer)}"
    else:
      tokens = self._doc_tokens_digest()
    name = corpus_cache.entry_name(
        doc_weights=corpus_cache.weights_digest(corpus_cache.doc_side(params)), tower=repr(self._model.doc),
        tokens=tokens, batching=f"{self.doc_max_length} {self.tokens_per_batch} {self.rows_multiple} "
                                f"{SHARD_DOCS}")
    if root.exists():
      for stale in root.iterdir():
        if stale.name != name:
          stale.rmtree(missing_ok=True) if stale.is_dir() else stale.unlink(missing_ok=True)
    runtime = encoder_runtime.EncoderRuntime(self.encode_doc, self.serving(params), self.doc_tokenizer,
                                             self.doc_max_length, {}, rows_multiple=self.rows_multiple)
    encodings.encode_corpus(runtime, corpus, root / name, shard_size=SHARD_DOCS,
                             tokens_per_batch=self.tokens_per_batch, settings={"entry": name})
    emb, _, _ = encodings.load_embeddings(root / name)
    return emb

  def documents(self, params, token_ids: Sequence[np.ndarray]) -> np.ndarray:
    """float32 [n, D]: the document tower's vectors of already tokenized documents (evaluation candidates)."""
    runtime = encoder_runtime.EncoderRuntime(self.encode_doc, self.serving(params), self.doc_tokenizer,
                                             self.doc_max_length, {}, rows_multiple=self.rows_multiple)
    return encoder_runtime.encode_tokens(runtime, token_ids, tokens_per_batch=self.tokens_per_batch)

  def _encode_corpus(self, params, progress: bool) -> np.ndarray:
    if self.hosts == 1:
      params = self.serving(params)
      runtime = encoder_runtime.EncoderRuntime(self.encode_doc, params, self.doc_tokenizer, self.doc_max_length, {},
                                          rows_multiple=self.rows_multiple)
    else:
      params = self.serving(encoder_runtime.whole_on(params, self._host_mesh))
      runtime = encoder_runtime.EncoderRuntime(self._encode_part, params, self.doc_tokenizer, self.doc_max_length, {},
                                          rows_multiple=self._host_mesh.devices.size)
    bar = None
    if progress and self.host == 0:
      desc = "encode corpus" if self.hosts == 1 else f"encode corpus (host 0 of {self.hosts})"
      bar = tqdm.tqdm(total=len(self.doc_tokens), unit="doc", desc=desc, mininterval=5.0, leave=False)
    if self.hosts > 1:
      lo, hi = self.part
      print(f"host {self.host} of {self.hosts}: tokenized and encoding documents {lo}-{hi - 1} of "
            f"{len(self.doc_ids)}", file=sys.stderr, flush=True)
    emb = encoder_runtime.encode_tokens(runtime, self.doc_tokens, tokens_per_batch=self.tokens_per_batch,
                                   progress=bar) if (self.doc_tokens or self.hosts == 1) else None
    if bar is not None:
      bar.close()
    if self.hosts > 1:
      probe = jax.ShapeDtypeStruct((1, 8), np.int32)  # the vector width, for a host whose part is empty
      emb = encoder_runtime.gather_host_parts(emb, jax.eval_shape(self._doc_fn, params, probe, probe).shape[-1])
    return emb

  def queries(self, params, qids: Sequence[str]) -> np.ndarray:
    """float32 [Q, D] for the given query ids."""
    missing = [q for q in qids if q not in self._query_tokens]
    if missing:
      tokens = text_lib.tokenize(self.query_tokenizer, [self.data.queries[q] for q in missing],
                                 self.query_max_length)
      self._query_tokens.update(zip(missing, tokens))
    return self.query_vectors(params, [self._query_tokens[q] for q in qids])

  def query_vectors(self, params, token_ids: Sequence[np.ndarray]) -> np.ndarray:
    """float32 [n, D]: the query tower's vectors of already tokenized queries (the evaluation suite's)."""
    runtime = encoder_runtime.EncoderRuntime(self.encode_query, self.serving(params), self.query_tokenizer,
                                             self.query_max_length, {}, rows_multiple=self.rows_multiple)
    return encoder_runtime.encode_tokens(runtime, token_ids, tokens_per_batch=self.tokens_per_batch)


# The values of eval.candidates and eval.final (jdr/runtime/defaults.py says what each means).
