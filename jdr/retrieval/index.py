"""Nearest-neighbour search over document embeddings: one Retriever interface, two back-ends.

* `FaissRetriever`: any faiss index_factory string ("Flat" exact, "HNSW32", "OPQ16,IVF1,PQ16", ...),
  inner product by default, on the host; on every GPU (sharded) when faiss has GPU support and GPUs
  are present.
* `JaxRetriever`: exact top-k of queries @ embeddings.T with the embedding matrix sharded by rows over
  a device mesh (`jdr.retrieval.topk`, the same search the ADORE step runs): each device searches its own rows and
  the k * devices candidates are merged, so no device ever holds another's scores.

Both return (scores float32 [Q, k], ids list[list[str]]) with higher scores first, so the training loop
and the command lines can swap one for the other through a value (`jdr.retrieval.retrievers.build_index`, `load_index`).

Memory is reported as `bytes_per_doc()`: what one more document costs in the index (the string ids,
kept in a Python list by both back-ends, are not counted).
"""

from __future__ import annotations

import json
import pathlib
import sys
from typing import Any, Literal, Protocol, Sequence

import numpy as np

from jdr.runtime import atomic
from jdr.runtime import paths
from jdr.retrieval import sharded_rows
from jdr.retrieval import topk

_META = "meta.json"
_IDS = "ids.txt"
_FORMAT = 1


class Retriever(Protocol):
  """What the trainer, `jdr.retrieve` and the benchmarks need from an index."""

  dim: int

  def add(self, embeddings: np.ndarray, ids: Sequence[str]) -> None:
    """Appends documents: float32 [N, dim] embeddings and their N string ids."""

  def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, list[list[str]]]:
    """Top k per query: scores float32 [Q, k'] (k' = min(k, len(self))) and ids, best first."""

  def bytes_per_doc(self) -> float:
    """Index memory per document, in bytes."""

  def save(self, directory: str | pathlib.Path) -> None:
    """Writes the index to a directory that `load_retriever` reads back."""

  @classmethod
  def load(cls, directory: str | pathlib.Path, **kwargs) -> "Retriever":
    """Reads a directory written by `save`."""

  def __len__(self) -> int:
    """Number of documents added."""


# --------------------------------------------------------------------------------------------------
# Shared helpers.


def _as_vectors(x: np.ndarray, dim: int, what: str) -> np.ndarray:
  if isinstance(x, sharded_rows.ShardedRows) and x.shape[1] == dim and x.dtype == np.float32:
    return x  # an encoding's mapped shards: added a shard at a time, never concatenated
  x = np.asarray(x)
  if x.ndim != 2 or x.shape[1] != dim:
    raise ValueError(f"{what} must have shape [n, {dim}], got {x.shape}")
  # faiss needs C-contiguous float32 and silently misreads anything else.
  return np.ascontiguousarray(x, dtype=np.float32)


def _as_ids(ids: Sequence[str], n: int) -> list[str]:
  ids = [str(i) for i in ids]
  if len(ids) != n:
    raise ValueError(f"got {n} embeddings but {len(ids)} ids")
  for i in ids:
    # ids are stored one per line.
    if not i or "\n" in i or "\r" in i:
      raise ValueError(f"document ids must be non-empty and single-line, got {i!r}")
  return ids


def _write_common(directory: str | pathlib.Path, ids: list[str], meta: dict[str, Any]):
  path = paths.as_path(directory)
  path.mkdir(parents=True, exist_ok=True)
  atomic.write_text(path / _IDS, "".join(i + "\n" for i in ids))
  atomic.write_text(path / _META, json.dumps({"format": _FORMAT, **meta}, indent=2) + "\n")
  return path


def _read_meta(directory: str | pathlib.Path) -> dict[str, Any]:
  path = paths.as_path(directory) / _META
  if not path.is_file():
    raise FileNotFoundError(f"{path} not found: not a directory written by a jdr retriever's save()")
  meta = json.loads(path.read_text())
  if meta.get("format") != _FORMAT:
    raise ValueError(f"{path}: unsupported index format {meta.get('format')!r} (expected {_FORMAT})")
  return meta


def _read_ids(directory: str | pathlib.Path) -> list[str]:
  text = (paths.as_path(directory) / _IDS).read_bytes().decode("utf-8")
  return text.split("\n")[:-1] if text else []


def to_run(query_ids: Sequence[str], scores: np.ndarray, ids: list[list[str]]) -> dict[str, dict[str, float]]:
  """Search output as a run dict {qid: {docid: score}} (slots an index could not fill are dropped)."""
  run = {}
  for qid, row_scores, row_ids in zip(query_ids, scores, ids):
    run[qid] = {d: float(s) for d, s in zip(row_ids, row_scores) if d and np.isfinite(s)}
  return run


# --------------------------------------------------------------------------------------------------
# Faiss.


def import_faiss():
  import faiss  # pylint: disable=import-outside-toplevel
  return faiss


def _gpu_count() -> int:
  faiss = import_faiss()
  return faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0


def gpu_cloner_options(faiss, layout: str, float16: bool):
  """faiss' options for putting a CPU index on all GPUs of the host: sharded or replicated, float16 or not.
  Indices stay 64-bit, so ids past 2^31 documents are safe."""
  options = faiss.GpuMultipleClonerOptions()
  options.shard = layout == "shard"
  options.useFloat16 = bool(float16)  # Flat storage and IVFPQ lookup tables
  options.useFloat16CoarseQuantizer = bool(float16)
  return options


def _skip_polysemous_training(index) -> None:
  """index_factory turns on polysemous training for PQ codes ("PQ16" unless written "PQ16np"). It only
  reorders the codebooks for Hamming-distance pre-filtering, which jdr never enables, and it made training
  several times slower (docs/performance.md, "Measured outside the benchmarks")."""
  faiss = import_faiss()
  index = faiss.downcast_index(index)
  if isinstance(index, faiss.IndexPreTransform):
    index = faiss.downcast_index(index.index)
  if hasattr(index, "do_polysemous_training"):
    index.do_polysemous_training = False


class FaissRetriever:
  """A faiss index with string ids.

  Args:
    dim: embedding width.
    factory: a faiss.index_factory string: "Flat" (exact), "HNSW32", "IVF1024,PQ32", "OPQ16,IVF1,PQ16"...
    metric: "ip" (inner product, what dense retrievers train for) or "l2" (scores are then negated
      squared distances, so that higher is still better).
    use_gpu: "auto" puts the index on all GPUs (sharded) when faiss has GPU support and sees GPUs;
      True requires that; False keeps it on the host. Index types faiss cannot move to the GPU (HNSW)
      stay on the host with a warning.
    train_size: indexes that need training (IVF, PQ, OPQ) are trained on the first `add`, on at most
      this many of its vectors sampled at random; call `train()` first to choose the vectors yourself.
    search_params: faiss ParameterSpace string applied before each search, e.g. "nprobe=16" or
      "efSearch=128".
    seed: for the training sample.
    gpu_layout: with several GPUs, "shard" splits the documents over them (memory / GPUs each, every
      query searched on all) or "replicate" copies the index to each (more query throughput).
    gpu_float16: store vectors (Flat) and lookup tables (IVFPQ) in float16 on the GPUs: half the memory,
      scores within float16 rounding.

  On GPUs faiss caps k at 2048. Slots an approximate index cannot fill (an IVF probe that reaches
  fewer than k documents) come back with score -inf and id "", which `to_run` drops.
  """

  kind = "faiss"

  def __init__(self, dim: int, factory: str = "Flat", metric: Literal["ip", "l2"] = "ip",
               use_gpu: bool | Literal["auto"] = "auto", train_size: int = 100_000,
               search_params: str | None = None, seed: int = 0, *,
               gpu_layout: Literal["shard", "replicate"] = "shard", gpu_float16: bool = False, _index=None):
    faiss = import_faiss()
    if metric not in ("ip", "l2"):
      raise ValueError(f"metric must be 'ip' or 'l2', got {metric!r}")
    if gpu_layout not in ("shard", "replicate"):
      raise ValueError(f"gpu_layout must be 'shard' or 'replicate', got {gpu_layout!r}")
    self.gpu_layout, self.gpu_float16 = gpu_layout, bool(gpu_float16)
    self.dim = int(dim)
    self.factory = factory
    self.metric = metric
    self.train_size = int(train_size)
    self.search_params = search_params
    self.seed = seed
    if use_gpu not in (True, False, "auto"):
      raise ValueError(f"use_gpu must be True, False or 'auto', got {use_gpu!r}")
    gpus = _gpu_count()
    if use_gpu is True and gpus == 0:
      raise RuntimeError("use_gpu=True but faiss sees no GPU (is faiss-gpu installed?)")
    self._want_gpu = bool(gpus) and use_gpu is not False
    metric_type = faiss.METRIC_INNER_PRODUCT if metric == "ip" else faiss.METRIC_L2
    if _index is None:
      _index = faiss.index_factory(self.dim, factory, metric_type)
      _skip_polysemous_training(_index)
    self.cpu_index = _index
    if self.cpu_index.d != self.dim:
      raise ValueError(f"index has dim {self.cpu_index.d}, expected {self.dim}")
    self.search_index = None  # What searches run on: the CPU index or its GPU clone; set once trained.
    self._ids: list[str] = []
    self._id_array: np.ndarray | None = None
    # Serialized size of the trained, empty index (codebooks, rotations, centroids): subtracted so
    # bytes_per_doc is the marginal cost of a document, not fixed overhead spread over a small corpus.
    self._fixed_bytes: int | None = None
    if self.cpu_index.is_trained:
      self._ready()

  @property
  def on_gpu(self) -> bool:
    return self.search_index is not None and self.search_index is not self.cpu_index

  def __len__(self) -> int:
    return len(self._ids)

  def _ready(self) -> None:
    faiss = import_faiss()
    if self._fixed_bytes is None and self.cpu_index.ntotal == 0:
      self._fixed_bytes = int(faiss.serialize_index(self.cpu_index).size)
    self.search_index = self.cpu_index
    if self._want_gpu:
      try:
        self.search_index = faiss.index_cpu_to_all_gpus(self.cpu_index, gpu_cloner_options(faiss, self.gpu_layout,
                                                                                 self.gpu_float16))
      except RuntimeError as e:  # e.g. HNSW has no GPU implementation.
        print(f"jdr.retrieval.index: {self.factory!r} stays on the CPU ({str(e).splitlines()[0]})", file=sys.stderr)

  def train(self, vectors: np.ndarray) -> None:
    """Trains the quantizers (no-op for indexes that need none)."""
    if self.cpu_index.is_trained:
      return
    vectors = _as_vectors(vectors, self.dim, "training vectors")
    try:
      self.cpu_index.train(vectors)
    except RuntimeError as e:
      raise RuntimeError(
          f"training faiss index {self.factory!r} on {len(vectors)} vectors failed (PQ needs at least "
          f"256 and IVFn about 39*n): {e}") from e
    self._ready()

  def add(self, embeddings: np.ndarray, ids: Sequence[str]) -> None:
    embeddings = _as_vectors(embeddings, self.dim, "embeddings")
    ids = _as_ids(ids, len(embeddings))
    if not len(ids):
      return
    if not self.cpu_index.is_trained:
      sample = embeddings
      if len(embeddings) > self.train_size:
        rows = np.random.default_rng(self.seed).choice(len(embeddings), self.train_size, replace=False)
        sample = embeddings[np.sort(rows)]
      self.train(np.asarray(sample))
    for _, piece in sharded_rows.pieces(embeddings):
      self.search_index.add(np.ascontiguousarray(piece, np.float32))
    self._ids.extend(ids)
    self._id_array = None

  def _apply_search_params(self) -> None:
    if not self.search_params:
      return
    faiss = import_faiss()
    space = faiss.GpuParameterSpace() if self.on_gpu else faiss.ParameterSpace()
    space.set_index_parameters(self.search_index, self.search_params)

  def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, list[list[str]]]:
    if not self._ids:
      raise ValueError("search on an empty index: add documents first")
    queries = _as_vectors(queries, self.dim, "queries")
    k = min(int(k), len(self._ids))
    self._apply_search_params()
    scores, rows = self.search_index.search(queries, k)
    if self.metric == "l2":
      scores = -scores
    # Approximate indexes may find fewer than k documents: those slots are -1.
    missing = rows < 0
    scores = np.where(missing, -np.inf, scores).astype(np.float32)
    if self._id_array is None:
      self._id_array = np.array(self._ids + [""], dtype=object)  # Row -1 reads the trailing "".
    return scores, self._id_array[rows].tolist()

  def _cpu_copy(self):
    return import_faiss().index_gpu_to_cpu(self.search_index) if self.on_gpu else self.cpu_index

  def memory_bytes(self) -> int:
    """Serialized size of the whole index (codes, graph, quantizers)."""
    return int(import_faiss().serialize_index(self._cpu_copy()).size)

  def bytes_per_doc(self) -> float:
    """Marginal bytes per document: (serialized size - size when empty) / documents.

    Serializing copies the index once, so call this for reports, not in a loop.
    """
    if not self._ids:
      raise ValueError("bytes_per_doc of an empty index")
    return (self.memory_bytes() - (self._fixed_bytes or 0)) / len(self._ids)

  def save(self, directory: str | pathlib.Path) -> None:
    path = _write_common(directory, self._ids, {
        "kind": self.kind, "dim": self.dim, "factory": self.factory, "metric": self.metric,
        "train_size": self.train_size, "search_params": self.search_params, "seed": self.seed,
        "fixed_bytes": self._fixed_bytes, "ntotal": len(self._ids), "gpu_layout": self.gpu_layout,
        "gpu_float16": self.gpu_float16})
    # Through bytes, not faiss.write_index: the directory may be on object storage (gs://).
    data = import_faiss().serialize_index(self._cpu_copy())
    atomic.write_atomic(path / "index.faiss", lambda f: f.write(data.tobytes()))

  @classmethod
  def load(cls, directory: str | pathlib.Path, use_gpu: bool | Literal["auto"] = "auto",
           search_params: str | None = None, gpu_layout: str | None = None,
           gpu_float16: bool | None = None) -> "FaissRetriever":
    meta = _read_meta(directory)
    if meta["kind"] != cls.kind:
      raise ValueError(f"{directory} holds a {meta['kind']!r} index, not {cls.kind!r}")
    data = (paths.as_path(directory) / "index.faiss").read_bytes()
    index = import_faiss().deserialize_index(np.frombuffer(data, dtype=np.uint8))
    ids = _read_ids(directory)
    if len(ids) != index.ntotal:
      raise ValueError(f"{directory}: {len(ids)} ids for {index.ntotal} vectors")
    self = cls(meta["dim"], meta["factory"], meta["metric"], use_gpu, meta["train_size"],
               search_params if search_params is not None else meta.get("search_params"),
               meta["seed"], _index=index,
               gpu_layout=gpu_layout or meta.get("gpu_layout", "shard"),
               gpu_float16=meta.get("gpu_float16", False) if gpu_float16 is None else gpu_float16)
    self._fixed_bytes = meta.get("fixed_bytes")
    self._ids = ids
    return self


# --------------------------------------------------------------------------------------------------
# JAX.


class JaxRetriever:
  """Exact inner-product top-k with the embedding matrix sharded by rows over a device mesh (`jdr.retrieval.topk`).

  Args:
    dim: embedding width.
    mesh: a jax.sharding.Mesh whose devices all hold a slice of the documents (rows are split over
      all of its axes, e.g. the training mesh); default: a 1-D mesh over `devices`.
    devices: default jax.devices().
    dtype: storage, "auto" (bfloat16 on GPUs and TPUs, float32 on CPUs), "float32" (exact), "bfloat16"
      (half the memory) or "int8" (one scale per row, a quarter; approximate); scores are float32 always.
    query_chunk: queries scored per step; lowered when one chunk's [chunk, docs per device] float32
      scores would exceed score_budget_bytes.
    precision: matmul precision for a float32 matrix; "highest" keeps it exact on GPUs/TPUs, whose default
      precision (TF32/bfloat16 passes) would reorder near-ties.
    recall_target: 1.0 (exact top-k) or less for each device's top-k by `jax.lax.approx_max_k` (fast on
      TPUs). The merge of the devices' candidates stays exact.
    block_rows: rows reduced to one maximum in the first pass of the exact search (`topk.block_top_k`).

  Documents added after a search are merged by copying the device matrix back to the host once, which
  needs a single-process job; multi-host jobs should add everything (the same on every host) first.
  """

  kind = "jax"

  def __init__(self, dim: int, mesh=None, devices=None, dtype: str = "auto",
               query_chunk: int = 256, score_budget_bytes: int = 1 << 30,
               precision: str = "highest", recall_target: float = 1.0,
               block_rows: int = topk.DEFAULT_BLOCK_ROWS):
    import jax  # pylint: disable=import-outside-toplevel
    self.dim = int(dim)
    if not 0.0 < recall_target <= 1.0:
      raise ValueError(f"recall_target must be in (0, 1], got {recall_target}")
    self.recall_target = float(recall_target)
    if mesh is None:
      mesh = jax.sharding.Mesh(np.array(list(devices or jax.devices())), ("docs",))
    self.mesh = mesh
    self._num_shards = int(mesh.devices.size)
    self.dtype = topk.resolve_dtype(dtype, mesh.devices.flat[0].platform)
    self.query_chunk = int(query_chunk)
    self.score_budget_bytes = int(score_budget_bytes)
    self.precision = precision
    self.block_rows = int(block_rows)
    self._pending: list[np.ndarray] = []  # Host arrays added since the device matrix was built.
    self._corpus: topk.ShardedCorpus | None = None
    self._ids: list[str] = []
    self._id_array: np.ndarray | None = None
    self._fns: dict[int, Any] = {}

  @property
  def _emb(self):
    """The stored rows on the devices (an array, or topk.QuantizedRows for int8)."""
    return None if self._corpus is None else self._corpus.rows

  def __len__(self) -> int:
    return len(self._ids)

  def add(self, embeddings: np.ndarray, ids: Sequence[str]) -> None:
    embeddings = _as_vectors(embeddings, self.dim, "embeddings")
    ids = _as_ids(ids, len(embeddings))
    if not len(ids):
      return
    self._pending.append(embeddings)
    self._ids.extend(ids)
    self._id_array = None

  def _host_matrix(self) -> np.ndarray:
    parts = []
    if self._corpus is not None:
      n_built = self._corpus.num_docs
      # Whole-array transfer, then slice on the host: slicing the sharded array would be a gather,
      # which meshes with Explicit axes refuse without an output sharding.
      rows = self._corpus.rows
      if isinstance(rows, topk.QuantizedRows):
        parts.append(np.asarray(rows.values, np.float32)[:n_built] * np.asarray(rows.scale)[:n_built])
      else:
        parts.append(np.asarray(rows, dtype=np.float32)[:n_built])
    parts.extend(self._pending)
    # One part (the usual single add) goes to the devices as it is: a mapped encoding is read a chunk at a time.
    return np.concatenate([np.asarray(p) for p in parts]) if len(parts) > 1 else parts[0]

  def _materialize(self) -> None:
    """Moves pending documents to the devices (rebuilding the sharded matrix once per batch of adds)."""
    if not self._pending:
      return
    host = self._host_matrix()
    self._pending = []
    self._corpus = topk.put_corpus(host, self.mesh, self.dtype, self.block_rows)
    self._fns = {}

  def _search_fn(self, k: int):
    if k not in self._fns:
      import jax  # pylint: disable=import-outside-toplevel
      precision = jax.lax.Precision[self.precision.upper()] if self.precision else None
      self._fns[k] = topk.search_fn(self._corpus, k, self.mesh, self.recall_target, precision)
    return self._fns[k]

  def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, list[list[str]]]:
    if not self._ids:
      raise ValueError("search on an empty index: add documents first")
    queries = _as_vectors(queries, self.dim, "queries")
    self._materialize()
    k = min(int(k), len(self._ids))
    rows_per_device = self._corpus.padded_rows // self._num_shards
    fn = self._search_fn(k)
    # A power-of-two chunk keeps the number of compiled shapes small.
    chunk = min(self.query_chunk, max(1, self.score_budget_bytes // (4 * rows_per_device)))
    chunk = min(1 << (chunk.bit_length() - 1), 1 << max(0, (len(queries) - 1).bit_length()))
    all_scores, all_rows = [], []
    for start in range(0, len(queries), chunk):
      block = queries[start:start + chunk]
      real = len(block)
      if real < chunk:
        block = np.concatenate([block, np.zeros((chunk - real, self.dim), np.float32)])
      values, rows = fn(block)
      # Outputs are replicated: any local copy is the whole result, also on multi-host meshes.
      all_scores.append(np.asarray(values.addressable_data(0))[:real])
      all_rows.append(np.asarray(rows.addressable_data(0))[:real])
    if self._id_array is None:
      self._id_array = np.array(self._ids, dtype=object)
    rows = np.concatenate(all_rows)
    return np.concatenate(all_scores).astype(np.float32), self._id_array[rows].tolist()

  def bytes_per_doc(self) -> float:
    return float(topk.storage_bytes_per_row(self.dim, self.dtype))

  def save(self, directory: str | pathlib.Path) -> None:
    path = _write_common(directory, self._ids, {
        "kind": self.kind, "dim": self.dim, "dtype": self.dtype, "query_chunk": self.query_chunk,
        "score_budget_bytes": self.score_budget_bytes, "precision": self.precision,
        "block_rows": self.block_rows, "ntotal": len(self._ids)})
    matrix = self._host_matrix() if self._ids else np.zeros((0, self.dim), np.float32)
    atomic.write_atomic(path / "embeddings.npy", lambda f: np.save(f, np.asarray(matrix, np.float32)))

  @classmethod
  def load(cls, directory: str | pathlib.Path, mesh=None, devices=None) -> "JaxRetriever":
    meta = _read_meta(directory)
    if meta["kind"] != cls.kind:
      raise ValueError(f"{directory} holds a {meta['kind']!r} index, not {cls.kind!r}")
    self = cls(meta["dim"], mesh=mesh, devices=devices, dtype=meta["dtype"],
               query_chunk=meta["query_chunk"], score_budget_bytes=meta["score_budget_bytes"],
               precision=meta["precision"], block_rows=meta.get("block_rows", topk.DEFAULT_BLOCK_ROWS))
    embeddings = paths.load_npy(paths.as_path(directory) / "embeddings.npy", mmap_mode="r")
    ids = _read_ids(directory)
    if len(ids) != len(embeddings):
      raise ValueError(f"{directory}: {len(ids)} ids for {len(embeddings)} vectors")
    if ids:
      self.add(embeddings, ids)
    return self


# --------------------------------------------------------------------------------------------------
# Factories.

_KINDS = {"faiss": FaissRetriever, "jax": JaxRetriever}


def make_retriever(kind: Literal["faiss", "jax"], dim: int, **kwargs) -> Retriever:
  """A new empty retriever: make_retriever("faiss", 768, factory="HNSW32") or ("jax", 768)."""
  if kind not in _KINDS:
    raise ValueError(f"unknown retriever kind {kind!r}; valid: {', '.join(_KINDS)}")
  return _KINDS[kind](dim, **kwargs)


def load_retriever(directory: str | pathlib.Path, **kwargs) -> Retriever:
  """Reads any retriever written by `save`; kwargs go to the back-end's load (use_gpu, mesh...)."""
  kind = _read_meta(directory).get("kind")
  if kind not in _KINDS:
    raise ValueError(f"{directory}: unknown retriever kind {kind!r}")
  return _KINDS[kind].load(directory, **kwargs)
