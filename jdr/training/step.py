"""The train state and the step: `make_train_step(model, tx, config, mesh, candidates)`, jitted by `jit_step`.

The step is one pure function of (state, batch[, corpus, bias]). Everything that differs between methods is
chosen once, when the step is built, by factories that close over their own options; the `Spec` holds the
model, the optimizer, the mesh and the chosen gradient function:

  scoring     one factory per candidate kind (`SCORERS`), the kind being `Negatives.candidates`
              (jdr/negatives/sources.py): "tokens" (documents as token ids, encoded here by the document
              tower), "corpus" (rows of a fixed corpus matrix, ADORE / LTRe), "pairs" (a cross-encoder's
              joint (query, candidate) inputs)
  loss terms  the contrastive loss of jdr/training/losses.py plus the terms other modules own, added to it
              (distill.loss_terms: FGD's and document-level distillation)
  gradients   plain autodiff through the scorer, exact gradient caching (jdr/training/gradcache.py), or the masked-LM
              baseline's token loss (jdr/data/pretrain_batches.py), which replaces scoring altogether

Batches follow the contract of jdr/data/batch.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax

from jdr.training import distill
from jdr.training import gradcache
from jdr.training import guide
from jdr.training import losses
from jdr.retrieval import span_embeddings
from jdr.training import optimizers
from jdr.runtime import parallel
from jdr.data import pretrain_batches
from jdr.models.towers import TwoTower
from jdr.negatives import retrieved


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: steps taken; the batch and the dropout rng follow from it
  params: Any
  opt_state: Any
  rng: jax.Array  # uint32[2] base key; step s uses fold_in(rng, s)


@dataclasses.dataclass(frozen=True)
class Spec:
  """The static description of one step, made when it is built (never inside the traced step): the model, the
  optimizer, the mesh and the gradient function chosen for the method, which closes over its own options."""
  model: TwoTower
  tx: optax.GradientTransformation
  mesh: Any
  gradients: Callable  # (state, batch, corpus, bias) -> ((loss, aux), grads)
  frozen: tuple[str, ...] = ()  # parameter groups that do not train, left out of the gradient norms


def make_train_step(model: TwoTower, tx: optax.GradientTransformation, config: ml_collections.ConfigDict,
                    mesh=None, candidates: str = "tokens", retrieve_in_step: bool = False):
  """The pure step (state, batch[, corpus, bias]) -> (state, metrics); `jit_step` jits it with shardings.

  `candidates` is `Negatives.candidates`. "corpus": candidates are rows of `corpus`, retrieved in the step
  (`retrieve_in_step`) or given as the batch field `cand_rows`; no document tower runs. With
  `grad_cache.chunk_size` > 0 (tokens only) the loss and gradients come from jdr/training/gradcache.py, exact,
  encoding that many rows at a time, with one dropout key per row.
  """
  spec = make_spec(model, tx, config, mesh, candidates, retrieve_in_step)
  step = functools.partial(train_step, spec)
  if mesh is None:
    return step
  return functools.partial(_on_mesh, step, mesh)


def make_spec(model: TwoTower, tx: optax.GradientTransformation, config: ml_collections.ConfigDict, mesh,
              candidates: str, retrieve_in_step: bool) -> Spec:
  chunk = check_grad_cache(config, candidates)
  if losses.matryoshka_dims(config.loss) and (candidates == "pairs" or pretrain_batches.is_masked_lm(config)):
    raise ValueError("loss.matryoshka_dims trains prefixes of two towers' vectors; a cross-encoder's scores and "
                     "the masked-LM baseline's token loss have none: set loss.matryoshka_dims=\"\"")
  query_only = optimizers.query_only(config.model)
  # Frozen parameters are not differentiated at all: no weight-gradient matmuls for a 7B base.
  split = functools.partial(optimizers.split_frozen, train_towers=config.model.train_towers,
                            lora=optimizers.uses_lora(config.model))
  if pretrain_batches.is_masked_lm(config):
    gradients = masked_lm_gradients(model)
  elif chunk:
    gradients = cached_gradients(model, config, mesh, chunk, query_only, split)
  else:
    gradients = plain_gradients(SCORERS[candidates](model, config, mesh, retrieve_in_step), split)
  return Spec(model=model, tx=tx, mesh=mesh, gradients=gradients, frozen=("doc_tower",) if query_only else ())


def _on_mesh(step, mesh, *args):
  # The towers pin their activations to this mesh's batch axes (jdr.models.bert.Encoder).
  with parallel.activations_on(mesh):
    return step(*args)


def train_step(spec: Spec, state: TrainState, batch: dict[str, jax.Array], corpus=None, bias=None):
  (loss, aux), grads = spec.gradients(state, batch, corpus, bias)
  updates, opt_state = spec.tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
  return new_state, {"loss": loss, "grad_norm": optax.tree.norm(grads), **aux,
                     **group_grad_norms(grads, skip=spec.frozen)}


# ------------------------------------------------------------------------------------------------ gradients
# Each factory returns (state, batch, corpus, bias) -> ((loss, aux), grads), closing over what it needs.


def plain_gradients(score: Callable, split: Callable = lambda params: (params, None)) -> Callable:
  """Autodiff through one scoring function (`SCORERS`) with respect to the trained params (`split`)."""

  def gradients(state: TrainState, batch, corpus, bias):
    trained, frozen = split(state.params)
    loss_of = lambda params: score(gradcache.merged(params, frozen), batch, step_rngs(state), corpus, bias)
    (loss, aux), grads = jax.value_and_grad(loss_of, has_aux=True)(trained)
    return (loss, aux), optimizers.with_zero_gradients(grads, frozen)

  return gradients


def cached_gradients(model: TwoTower, config: ml_collections.ConfigDict, mesh, chunk: int,
                     query_only: bool, split: Callable = lambda params: (params, None)) -> Callable:
  """Exact gradient caching (jdr/training/gradcache.py) over token batches, `chunk` rows at a time; `split`
  parts the params into (trained, frozen), and only the trained ones are differentiated."""
  # Sharded chunk loops (one gradient all-reduce per step) hold every parameter whole on every device, so
  # not when the parameters are sharded over the batch axes (FSDP: a 7B base would be gathered whole); there
  # the loops stay XLA-partitioned, each chunk's rows pinned to the batch axes (parallel.rows_vmapped).
  whole_params = mesh is not None and not parallel.shards_params_over_batch(
      parallel.rules_for(config.mesh.rules))
  objective = tokens_objective(config, normalizes(model))

  def encoders(spmd):
    frozen_doc = gradcache.per_row_encoder(model, "encode_doc", deterministic=True, spmd_axis_name=spmd)
    encode_doc = ((lambda *a: jax.lax.stop_gradient(frozen_doc(*a))) if query_only else
                  gradcache.per_row_encoder(model, "encode_doc", spmd_axis_name=spmd))
    return gradcache.per_row_encoder(model, "encode_query", spmd_axis_name=spmd), encode_doc

  def gradients(state: TrainState, batch, corpus, bias):
    del corpus, bias  # token batches only (check_grad_cache)
    shards = parallel.data_parallel_size(mesh) if mesh is not None else 1
    sizes = (batch["query_ids"].shape[0], batch["doc_ids"].shape[0], chunk)
    shard_mapped = whole_params and shards > 1 and not any(n % shards for n in sizes)
    spmd = parallel.BATCH_AXES if shards > 1 and not shard_mapped else None
    trained, frozen = split(state.params)
    with parallel.rows_vmapped() if spmd else contextlib.nullcontext():
      loss, aux, grads = gradcache.cached_value_and_grad(
          *encoders(spmd), lambda q, d: objective(q, d, batch), trained, batch,
          jax.random.fold_in(state.rng, state.step), chunk_size=chunk, mesh=mesh if shard_mapped else None,
          batch_axes=parallel.BATCH_AXES, frozen=frozen)
    return (loss, aux), optimizers.with_zero_gradients(grads, frozen)

  return gradients


def masked_lm_gradients(model: TwoTower) -> Callable:
  """The masked-LM baseline's token loss (jdr/data/pretrain_batches.py), which replaces scoring altogether."""

  def gradients(state: TrainState, batch, corpus, bias):
    del corpus, bias
    return jax.value_and_grad(pretrain_batches.masked_lm_loss, argnums=1, has_aux=True)(
        model, state.params, batch, step_rngs(state)[0])

  return gradients


# ------------------------------------------------------------------------------------------------ scoring
# One factory per candidate kind: (model, config, mesh, retrieve_in_step) -> score(params, batch, rngs,
# corpus, bias) -> (loss, aux), closing over the options of the method that uses it.


def pairs_scorer(model, config: ml_collections.ConfigDict, mesh=None, retrieve_in_step: bool = False):
  """A cross-encoder: every (query, candidate) pair is one joint forward pass, one logit each."""
  del mesh, retrieve_in_step
  objective, chunk_rows = make_objective(config), config.model.get("encode_chunk_rows", 0)

  def score(params, batch, rngs, corpus=None, bias=None):
    del corpus, bias
    ids = batch["pair_ids"]
    rows, n, length = ids.shape
    flat = lambda x: x.reshape(rows * n, length)
    scores = encode_in_chunks(
        lambda a, key: model.apply({"params": params}, *a, deterministic=False, rngs={"dropout": key}),
        (flat(ids), flat(batch["pair_mask"]), flat(batch["pair_types"])), rngs[0], chunk_rows
    ).reshape(rows, n)
    fields = {"labels": batch["labels"], "valid": batch["valid"]}
    return objective(scores, fields, batch["labels"] > 0, {})

  return score


def corpus_scorer(model, config: ml_collections.ConfigDict, mesh=None, retrieve_in_step: bool = False):
  """ADORE / LTRe: the query tower against rows of the fixed corpus matrix, its retrieved top n completed by
  the missing-positive rule (`retrieved.candidates`); no document tower runs. `retrieve_in_step`: the top n
  is retrieved here, else given as the batch field `cand_rows`."""
  settings = retrieved.settings(config.negatives.retrieval)
  top_n, recall_target = settings.top_n, settings.recall_target
  missing_positive = retrieved.check_missing_positive(settings.missing_positive)
  objective, chunk_rows = make_objective(config), config.model.get("encode_chunk_rows", 0)
  # Matryoshka here trains the query tower's prefixes against the fixed index's prefixes.
  dims, normalize = losses.matryoshka_dims(config.loss), normalizes(model)

  def score(params, batch, rngs, corpus, bias):
    q = encode_queries(model, chunk_rows, params, batch, rngs[0])
    if retrieve_in_step:
      rows = retrieved.sharded_top_k(jax.lax.stop_gradient(q), corpus, bias, top_n, mesh, recall_target)
    else:
      rows = batch["cand_rows"]
    # One rule for both paths, so host Faiss and in-step retrieval build the same candidate list.
    rows, labels, retrieved_labels = retrieved.candidates(rows, batch["positive_rows"], missing_positive)
    if "cand_vectors" in batch:  # host retrieval: the matrix stays on the host, the batch brings the vectors
      docs = retrieved.vectors_of(rows, batch["cand_rows"], batch["cand_vectors"], batch["positive_rows"],
                                  batch["positive_vectors"])
    else:
      docs = retrieved.gather_rows(corpus, rows, mesh)
    fields = {"labels": labels, "valid": rows >= 0}

    def at(dim):
      aux = retrieved.retrieval_diagnostics(retrieved_labels, batch["positive_rows"])
      if dim is None:
        return objective(jnp.einsum("bd,bnd->bn", q, docs), fields, labels > 0, aux)
      q_dim, d_dim = (losses.matryoshka_prefix(x, dim, n) for x, n in zip((q, docs), normalize))
      return objective(jnp.einsum("bd,bnd->bn", q_dim, d_dim), fields, labels > 0, aux)
    return losses.matryoshka_sum(dims, at)

  return score


def tokens_scorer(model, config: ml_collections.ConfigDict, mesh=None, retrieve_in_step: bool = False):
  """Two towers over token batches: every query against every document of the global batch."""
  del mesh, retrieve_in_step
  # A frozen document tower runs forward only, without dropout: nothing of it is trained.
  frozen = optimizers.query_only(config.model)
  chunk_rows = config.model.get("encode_chunk_rows", 0)
  span_levels = tuple(distill.levels(config.distill)) if distill.enabled(config.distill) else ()
  doc_and_spans = span_embeddings.two_tower_document_spans(config.distill.pooling)
  objective = tokens_objective(config, normalizes(model))

  def score(params, batch, rngs, corpus=None, bias=None):
    del corpus, bias
    q = encode_queries(model, chunk_rows, params, batch, rngs[0])
    span_mask = span_embeddings.span_masks(batch["doc_mask"], span_levels) if span_levels else None

    def encode_docs(a, key):
      ids, mask, spans = a
      options = {"deterministic": frozen, "rngs": {} if frozen else {"dropout": key}}
      if spans is None:
        return model.apply({"params": params}, ids, mask, method=TwoTower.encode_doc, **options)
      return model.apply({"params": params}, ids, mask, spans, method=doc_and_spans, **options)

    d = encode_in_chunks(encode_docs, (batch["doc_ids"], batch["doc_mask"], span_mask), rngs[1], chunk_rows)
    spans = None
    if span_mask is not None:
      d, spans = d
    if frozen:
      d = jax.lax.stop_gradient(d)
    return objective(q, d, batch, spans)

  return score


SCORERS = {"pairs": pairs_scorer, "corpus": corpus_scorer, "tokens": tokens_scorer}


def encode_queries(model, chunk_rows: int, params, batch, rng):
  return encode_in_chunks(
      lambda a, key: model.apply({"params": params}, *a, deterministic=False, rngs={"dropout": key},
                                 method=TwoTower.encode_query),
      (batch["query_ids"], batch["query_mask"]), rng, chunk_rows)


def normalizes(model: TwoTower) -> tuple[bool, bool]:
  """Whether the (query, document) towers L2-normalize their vectors: a Matryoshka prefix is normalized again.
  A module without tower configs (a cross-encoder, a stand-in) normalizes nothing."""
  return tuple(bool(getattr(getattr(model, side, None), "normalize", False)) for side in ("query", "doc"))


def tokens_objective(config: ml_collections.ConfigDict, normalize: tuple[bool, bool] = (False, False)) -> Callable:
  """(q [B, D], d [C, D], batch, spans=None) -> (loss, aux): the configured loss of query vectors against
  document vectors, plus the loss terms other modules own (distill.loss_terms: FGD's and document-level
  distillation), added to it; with loss.matryoshka_dims, all of it summed over the vectors' prefixes
  (`losses.matryoshka_sum`; `normalize`: the (query, document) towers' L2 normalization, applied again to a
  prefix)."""
  objective, logq, hardest = make_objective(config), config.loss.logq_correction, config.negatives.hardest_in_batch
  distilling = distill.enabled(config.distill)
  terms = (distill.loss_terms(config.distill, config.loss.temperature),) if distilling else ()
  contrastive_weight = config.distill.contrastive_weight if distilling else 1.0
  dims = losses.matryoshka_dims(config.loss)
  margin = guide.self_margin(config.negatives.guide)  # None: no guide in the step
  self_guided = margin is not None

  def loss(q, d, batch, spans=None):
    count = None
    if self_guided:  # the full-width scores guide every prefix
      valid, count = guide.masked(q @ d.T, batch["valid"], margin)
      batch = {**batch, "valid": valid}

    def at(dim):
      if dim is None:
        return one_width(q, d, batch, spans)
      prefix = lambda x, side: losses.matryoshka_prefix(x, dim, normalize[side])
      return one_width(prefix(q, 0), prefix(d, 1), batch, None if spans is None else prefix(spans, 1))
    total, aux = losses.matryoshka_sum(dims, at)
    if count is not None:
      aux["masked_by_guide"] = count
    return total, aux

  def one_width(q, d, batch, spans):
    # Under jit the batch-sharded document matrix is all-gathered across devices and hosts by XLA, no
    # hand-written collective.
    scores = q @ d.T
    if logq:
      # Sampled softmax under non-uniform sampling (Yi et al. 2019): s(q, d) - log Q(d) on every column.
      scores = scores - batch["doc_logq"].astype(scores.dtype)[None, :]
    valid = batch["valid"]
    if hardest:
      valid = losses.hardest_negative_mask(scores, valid)
    fields = {"valid": valid}
    if "weights" in batch:
      fields["weights"] = batch["weights"]
    positive = jnp.arange(scores.shape[1])[None, :] == jnp.arange(scores.shape[0])[:, None]
    total, aux = objective(scores, fields, positive, {})
    if not terms:
      return total, aux
    added = {}
    for term in terms:
      added.update(term(q, spans, scores, batch["valid"], batch))
    aux.update({f"loss/{name}": value for name, value in added.items()})
    aux["loss/contrastive"] = total
    return contrastive_weight * total + sum(added.values()), aux

  return loss


def make_objective(config: ml_collections.ConfigDict) -> Callable:
  """(scores, fields, positive, aux) -> (loss, aux): the configured loss (jdr.training.losses.make_loss),
  mean over queries, and the training accuracy: is a positive ranked first."""
  loss_of = losses.make_loss(config.loss)

  def objective(scores, fields, positive, aux):
    per_example = loss_of(scores, fields)
    masked = jnp.where(fields["valid"] | positive, scores, -jnp.inf)
    top = jnp.argmax(masked, axis=1)
    aux["train_accuracy"] = jnp.mean(jnp.take_along_axis(positive, top[:, None], axis=1))
    return jnp.mean(per_example), aux

  return objective


# ------------------------------------------------------------------------------------------------ pieces


def step_rngs(state: TrainState) -> tuple[jax.Array, jax.Array]:
  """The (query, document) dropout keys of the step `state.step`: a function of the step alone."""
  return jax.random.split(jax.random.fold_in(state.rng, state.step))


def encode_in_chunks(encode, arrays, rng: jax.Array, chunk_rows: int):
  """`encode(arrays, rng)` (rows first in every array) run `chunk_rows` rows at a time, as one jax.lax.map.

  The chunks are strided (chunk k holds rows k, k + n, k + 2n, ... for n chunks), so on a mesh every chunk
  keeps the batch's split over the data devices. Chunk k draws its dropout from fold_in(rng, k). With
  chunk_rows 0 or at least the number of rows, `encode` runs once on everything; a chunk_rows that does not
  divide the rows is a ValueError, not a quiet pass over everything at once."""
  rows = jax.tree.leaves(arrays)[0].shape[0]
  if chunk_rows <= 0 or chunk_rows >= rows:
    return encode(arrays, rng)
  if rows % chunk_rows:
    raise ValueError(f"chunks of {chunk_rows} rows do not divide the {rows} rows encoded together "
                     "(model.encode_chunk_rows must divide batch_size)")
  n = rows // chunk_rows
  split = lambda x: x.reshape(chunk_rows, n, *x.shape[1:]).swapaxes(0, 1)  # [n, chunk_rows, ...]
  out = jax.lax.map(lambda a: encode(a[0], jax.random.fold_in(rng, a[1])),
                    (jax.tree.map(split, arrays), jnp.arange(n)))
  return jax.tree.map(lambda y: y.swapaxes(0, 1).reshape(rows, *y.shape[2:]), out)


def make_step_query_vectors(model: TwoTower, chunk_rows: int = 0):
  """Jitted (state, query_ids, query_mask) -> exactly the query vectors the step computes (same params,
  same dropout keys, same chunks), so host retrieval between steps ranks what the loss will see."""

  @jax.jit
  def step_query_vectors(state, query_ids, query_mask):
    return encode_in_chunks(
        lambda a, key: model.apply({"params": state.params}, *a, deterministic=False, rngs={"dropout": key},
                                   method=TwoTower.encode_query),
        (query_ids, query_mask), step_rngs(state)[0], chunk_rows)

  return step_query_vectors


def group_grad_norms(grads, skip: tuple[str, ...] = ()) -> dict[str, jax.Array]:
  """Gradient norm per layer group ("grad_norm/query_tower/layer_3", ".../embeddings", ".../head")."""
  groups: dict[str, list] = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(grads)[0]:
    keys = [getattr(k, "key", str(k)) for k in path]
    if keys[0] in skip:
      continue
    if "encoder" in keys:
      group = keys[keys.index("encoder") + 1]
    elif keys[1].startswith("projection"):
      group = "head"
    else:
      group = keys[1]
    groups.setdefault(f"grad_norm/{keys[0]}/{group}", []).append(leaf)
  return {name: optax.tree.norm(leaves) for name, leaves in groups.items()}


# ------------------------------------------------------------------------------------------------ checks


def check_grad_cache(config: ml_collections.ConfigDict, candidates: str = "tokens") -> int:
  """grad_cache.chunk_size (0 = off), refusing what gradient caching cannot do."""
  chunk = config.grad_cache.chunk_size
  if not isinstance(chunk, int) or chunk < 0:
    raise ValueError(f"grad_cache.chunk_size must be an int >= 0 (0 = off), got {chunk!r}")
  if chunk and candidates != "tokens":
    raise ValueError("grad_cache.chunk_size > 0 needs token batches: negatives.source=retrieval scores "
                     "against a fixed corpus matrix and has no document tower to cache")
  rows = config.model.get("encode_chunk_rows", 0)
  if not isinstance(rows, int) or rows < 0:
    raise ValueError(f"model.encode_chunk_rows must be an int >= 0 (0 = off), got {rows!r}")
  if rows and config.batch_size % rows:
    # Every row count the step encodes (queries, documents, cross-encoder pairs) is a multiple of batch_size.
    raise ValueError(f"model.encode_chunk_rows={rows} must divide batch_size={config.batch_size}")
  if chunk and rows:
    raise ValueError("grad_cache.chunk_size already encodes the batch in chunks; leave model.encode_chunk_rows at 0")
  return chunk


# ------------------------------------------------------------------------------------------------ state, jit


def dummy_inputs(config: ml_collections.ConfigDict):
  if config.model.get("architecture", "two_tower") == "cross_encoder":
    pair = jnp.ones((1, config.data.doc_max_length), jnp.int32)
    return pair, pair
  q = jnp.ones((1, config.data.query_max_length), jnp.int32)
  d = jnp.ones((1, config.data.doc_max_length), jnp.int32)
  return q, q, d, d


def abstract_train_state(model, tx: optax.GradientTransformation, config: ml_collections.ConfigDict, mesh,
                         rules) -> tuple[TrainState, Any]:
  """(the TrainState as sharded ShapeDtypeStructs, its shardings) from the logical axis names of the params:
  nothing is allocated. The trainer restores and jits against it; `--compile-only` compiles against it."""
  boxed_params = jax.eval_shape(lambda r: model.init(r, *dummy_inputs(config))["params"], jax.random.PRNGKey(0))
  abstract = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=boxed_params,
                        opt_state=jax.eval_shape(tx.init, boxed_params), rng=jax.ShapeDtypeStruct((2,), jnp.uint32))
  shardings = parallel.tree_shardings(abstract, mesh, rules)
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), nn.unbox(abstract),
                          shardings)
  return abstract, shardings


def compiler_options() -> dict[str, Any]:
  """XLA options of every jitted train step, for the platform being compiled for.

  GPUs: XLA's dot merger is off. It joins matmuls that share an operand into one over their other operands
  concatenated; with shared towers that is each weight's matmuls over the queries and over the documents, so
  every activation and gradient they read was first copied into a concatenation. In BERT-base's in-batch
  step compiled for an NVIDIA H200 turning it off cut the least traffic of a step (`python -m jdr.bench
  compiled`; docs/performance-history.md, "Compiled for the H200, change by change"); the unmerged matmuls
  are each as large as a batch of queries or of documents, big enough for cuBLAS on their own.
  """
  return {"xla_gpu_dot_merger_threshold_mb": 0} if parallel.platform() == "gpu" else {}


def jit(fn: Callable, **jit_kwargs) -> Callable:
  """jax.jit with the train step's compiler options (`compiler_options`): every jitted step goes through it,
  the trainer's and the benchmarks', so a benchmark times what the trainer runs."""
  return jax.jit(fn, compiler_options=compiler_options() or None, **jit_kwargs)


def jit_step(step, state_shardings, mesh, corpus: retrieved.CorpusMatrix | None = None):
  """The step jitted once: explicit in/out shardings, the state donated. With `corpus` (corpus candidates)
  the matrix and its bias are bound, sharded by rows, so the result is (state, batch) -> (state, metrics)
  either way."""
  batch_sharding, out = parallel.batch_sharding(mesh), (state_shardings, parallel.replicated(mesh))
  if corpus is None:
    return jit(step, in_shardings=(state_shardings, batch_sharding), out_shardings=out, donate_argnums=(0,))
  jitted = jit(step, in_shardings=(state_shardings, batch_sharding, *retrieved.corpus_shardings(mesh)),
               out_shardings=out, donate_argnums=(0,))
  return lambda state, batch: jitted(state, batch, corpus.device, corpus.bias)
