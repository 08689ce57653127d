"""Encoding texts with a tower, one way for every caller: `load_runtime` (a tower, its params, tokenizer and
max length), then `encode_texts` / `encode_tokens` (and FGD's `encode_pieces`), batched by token budget,
split over the mesh and, on several hosts, gathered.

  runtime = load_runtime("minilm")
  emb = encode_texts(runtime, texts)                      # or encode_tokens(runtime, token_ids)

Library functions here raise exceptions (ValueError, FileNotFoundError), never SystemExit: a background
refresh calling them must not end the trainer. Command lines turn errors into exit codes (jdr.runtime.cli).
"""

import collections
import concurrent.futures
import dataclasses
import itertools
from typing import Callable, Sequence

import jax
import numpy as np
import tqdm

from jdr.data import granularity
from jdr.runtime import parallel
from jdr.data import prepared
from jdr.data import text as text_lib

# A batch holds about this many tokens (padded), whatever its length bucket, so short documents go in
# big batches and long ones in small batches: a small fixed set of compiled shapes, little padding.
# On CPU small batches win: in big ones the [batch, heads, L, L] attention scores stop fitting in cache.
# Accelerators want big batches to fill the device (both measured: docs/performance.md, `encode`).
CPU_TOKENS_PER_BATCH = 1024
ACCELERATOR_TOKENS_PER_BATCH = 65536


def default_tokens_per_batch() -> int:
  return CPU_TOKENS_PER_BATCH if jax.default_backend() == "cpu" else ACCELERATOR_TOKENS_PER_BATCH


# On a CPU, batches encode this many at a time at most, one per core (each holds its own activations).
MAX_CPU_BATCHES_AT_ONCE = 8


def batches_at_once() -> int:
  """How many batches `encode_texts` / `encode_tokens` run at the same time: on a CPU one per core this process
  may use (up to MAX_CPU_BATCHES_AT_ONCE), each from its own thread; on an accelerator one, queued ahead.

  Why: XLA's CPU runtime runs one program's ops with cores idle between and inside its smaller ops; two
  programs at once keep both cores of a 2-core CPU busy, 12-15% more docs/s there, the vectors bitwise equal
  (docs/performance.md, `encode`). The parameters are shared, not copied, unlike splitting the CPU into
  devices. An accelerator runs one program at a time anyway."""
  if jax.default_backend() != "cpu":
    return 1
  return max(1, min(parallel.usable_cores(), MAX_CPU_BATCHES_AT_ONCE))


# --------------------------------------------------------------------------------------------------
# Encoders.


@dataclasses.dataclass
class EncoderRuntime:
  """A loaded tower with its tokenizer and settings: what it takes to turn texts into vectors."""
  apply_fn: Callable  # (params, input_ids, attention_mask) -> [B, D]
  params: object
  tokenizer: object  # this side's: a `text.Prompted` one puts the side's prompt before every text
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
                 side: str = "doc", prompt: str | None = None, dim: int | None = None) -> EncoderRuntime:
  """Loads `model` with its tokenizer, jitted, for one side ("query" or "doc").

  `model` is a Hugging Face directory, `minilm`, or a jdr model (a `jdr.export` directory or a training
  workdir), whose query and document towers may differ and whose pooling is part of what was trained.

  The runtime's tokenizer puts the side's prompt before every text (`text.Prompted`): `prompt` when given
  ("" = none), else the model's own (a jdr model's description["prompts"], a sentence-transformers
  directory's config_sentence_transformers.json); info["prompt"] holds it, info["prompt_from"] where it
  comes from.

  `dim` serves a Matryoshka model's first `dim` dimensions (re-normalized where the tower normalizes), one of
  the widths it was trained at when it records them (`loss.matryoshka_dims`); None = the model's own width
  (a sentence-transformers directory's saved truncate_dim, else all). info["dim"] is the width served.
  """
  # pylint: disable=g-import-not-at-top  (model code loads lazily, so `--help` stays fast)
  from jdr.models import build
  from jdr.models import published
  from jdr.models import towers
  from jdr.models.towers import TwoTower
  from jdr.retrieval import span_embeddings
  if side not in ("query", "doc"):
    raise ValueError(f"side must be 'query' or 'doc', got {side!r}")
  model = build.resolve_model(model)  # a hub id -> its snapshot in huggingface_hub's cache
  if build.is_jdr_model(model):
    two_tower, params, tokenizer, description = build.load_jdr_model(model)
    tower = getattr(two_tower, side)
    if dim is not None:
      tower = towers.truncated(tower, dim, description.get("matryoshka_dims") or (), model)
      two_tower = two_tower.clone(**{s: towers.truncated(getattr(two_tower, s), dim, (), model)
                                     for s in ("query", "doc")})
    if (pooling not in (None, tower.pooling)) or (normalize not in (None, tower.normalize)):
      raise ValueError(f"{model}: a trained jdr model fixes pooling={tower.pooling} and "
                       f"normalize={tower.normalize}; drop --pooling / --normalize")
    method = TwoTower.encode_query if side == "query" else TwoTower.encode_doc

    @jax.jit
    def apply_two_tower(params, input_ids, attention_mask):
      return two_tower.apply({"params": params}, input_ids, attention_mask, method=method)

    @jax.jit
    def spans_two_tower(params, input_ids, attention_mask, span_mask):
      return two_tower.apply({"params": params}, input_ids, attention_mask, span_mask,
                             method=span_embeddings.two_tower_document_spans())

    params = _serving(params, two_tower)
    length, source = (max_length, "--max-length") if max_length else build.serving_length(description, side)
    info = {"pooling": tower.pooling, "normalize": tower.normalize, "max_length": length, "max_length_from": source,
            "trained_max_length": description[f"{side}_max_length"], "dim": tower.dim}
    # A description from before prompts were recorded has none.
    tokenizer = _with_prompt(tokenizer, info, (description.get("prompts") or published.no_prompts())[side],
                             prompt, side)
    return EncoderRuntime(apply_two_tower, params, tokenizer, int(info["max_length"]), info,
                          spans_two_tower if side == "doc" else None)

  one_tower, params, tokenizer, info = published.load_tower(
      model, pooling=pooling, normalize=normalize, max_length=max_length, dtype=build.compute_dtype(dtype),
      dim=dim)
  params = _serving(params, one_tower)
  tokenizer = _with_prompt(tokenizer, info, info["prompts"][side], prompt, side)

  @jax.jit
  def apply_fn(params, input_ids, attention_mask):
    return one_tower.apply({"params": params}, input_ids, attention_mask)

  @jax.jit
  def apply_spans(params, input_ids, attention_mask, span_mask):
    return one_tower.apply({"params": params}, input_ids, attention_mask, span_mask,
                           method=span_embeddings.document_and_span_vectors)

  return EncoderRuntime(apply_fn, params, tokenizer, int(info["max_length"]), info, apply_spans)


PROMPT_FLAGS = {"query": "--query-prompt", "doc": "--doc-prompt"}



def _with_prompt(tokenizer, info: dict, own: str, asked: str | None, side: str):
  """`tokenizer` putting the side's prompt before every text: `asked` unless None, else the model's `own`;
  recorded in info["prompt"] / info["prompt_from"]."""
  prompt, source = (own, "the model's own") if asked is None else (asked, PROMPT_FLAGS[side])
  info["prompt"], info["prompt_from"] = prompt or "", source
  return text_lib.prompted(tokenizer, prompt)


def _serving(params, module):
  """The weights a runtime encodes with: matmul weights already in the compute dtype (same vectors)."""
  from jdr.models import towers  # pylint: disable=g-import-not-at-top
  return jax.jit(lambda p: towers.serving_params(p, module))(params)


def length_line(runtime: EncoderRuntime, texts: str) -> str:
  """What a command says of the length it cuts `texts` ("queries", "documents") at, and why."""
  info = runtime.info
  trained = f"; trained at {info['trained_max_length']}" if info.get("trained_max_length") else ""
  line = f"{texts}: up to {runtime.max_length} tokens ({info.get('max_length_from', '--max-length')}{trained})"
  if "prompt" in info:  # the prompt counts toward those tokens
    line += (f", after the prompt {info['prompt']!r} ({info['prompt_from']})" if info["prompt"] else
             f", no prompt ({info['prompt_from']})")
  return line


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
  document; any other is tokenized now. `tokenizer` is the document side's: a `text.Prompted` one puts the
  model's document prompt before each document (a prepared corpus keeps those ids apart from unprompted ones)."""
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

  at_once = batches_at_once()
  if at_once > 1:
    # Each batch runs and is fetched in its own worker thread; the next batches are padded here meanwhile.
    with concurrent.futures.ThreadPoolExecutor(at_once, thread_name_prefix="jdr-encode") as pool:
      pending = collections.deque()
      for indices, input_ids, mask in batches:
        pending.append((indices, pool.submit(
            lambda i, m: np.asarray(runtime.apply_fn(runtime.params, i, m), np.float32), input_ids, mask)))
        if len(pending) > at_once:
          done_indices, future = pending.popleft()
          store(done_indices, future.result())
      while pending:
        done_indices, future = pending.popleft()
        store(done_indices, future.result())
    return out
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
