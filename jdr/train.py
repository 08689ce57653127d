"""Train a dense retriever: `python -m jdr.train --config configs/X.py[:arg] --workdir DIR [--config.k=v]`.

One trainer for every method: which towers train, where negatives come from and which loss is used are
config values (see configs/base.py), never a fork of this file. `train_and_evaluate` reads top to bottom:
mesh, data, model, state (resume | init_from | fresh), the jitted step, the loop, evaluation.
"""

import argparse
import json
import math
import pathlib
import sys
import time
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import tqdm

from jdr import atomic
from jdr import checkpoint
from jdr import cli
from jdr import config_files
from jdr import distill
from jdr import evaluation
from jdr import gradcache
from jdr import losses
from jdr import metric_writers
from jdr import optimizers
from jdr import parallel
from jdr import paths
from jdr import preemption
from jdr.data import pairs
from jdr.data import pretrain_batches
from jdr.negatives import retrieved
from jdr.negatives import sources
from jdr.models import build as build_lib
from jdr.models.towers import TwoTower


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: steps taken; the batch and the dropout rng follow from it
  params: Any
  opt_state: Any
  rng: jax.Array  # uint32[2] base key; step s uses fold_in(rng, s)


def make_train_step(model: TwoTower, tx: optax.GradientTransformation, config: ml_collections.ConfigDict,
                    mesh=None, candidates: str = "tokens", retrieve_in_step: bool = False):
  """The pure step (state, batch[, corpus, bias]) -> (state, metrics); the caller jits it with shardings.

  Batches follow the contract of jdr/data/batch.py. "tokens": documents are token ids encoded in the step
  by the document tower. "corpus": candidates are rows of the fixed corpus matrix `corpus` (ADORE / LTRe),
  retrieved here (`retrieve_in_step`) or given as the batch field `cand_rows`; no document tower runs.
  With `grad_cache.chunk_size` > 0 (tokens only) the loss and gradients come from jdr/gradcache.py, exact,
  encoding that many rows at a time, with one dropout key per row.
  """
  loss_of = losses.make_loss(config.loss)
  chunk_rows = config.model.get("encode_chunk_rows", 0)
  hardest = config.negatives.hardest_in_batch
  query_only = config.model.train_towers == "query"
  top_n = config.negatives.top_n
  logq = config.loss.logq_correction
  chunk = check_grad_cache(config, candidates)
  mlm = config.data.kind == "pretrain" and config.data.pretrain_task == "mlm"
  distilling = distill.enabled(config)
  distill_levels = distill.levels(config) if distilling else []
  if chunk:
    encode_query = gradcache.per_row_encoder(model, "encode_query")
    frozen_doc = gradcache.per_row_encoder(model, "encode_doc", deterministic=True)
    encode_doc = (lambda *a: jax.lax.stop_gradient(frozen_doc(*a))) if query_only else \
        gradcache.per_row_encoder(model, "encode_doc")

  def finish(scores, fields, positive, aux):
    per_example = loss_of(scores, fields)
    masked = jnp.where(fields["valid"] | positive, scores, -jnp.inf)
    top = jnp.argmax(masked, axis=1)
    aux["train_accuracy"] = jnp.mean(jnp.take_along_axis(positive, top[:, None], axis=1))
    return jnp.mean(per_example), aux

  def distillation_terms(q, spans, scores, valid, batch):
    """Document-level KD and FGD's per-level KD (jdr/distill.py) over each query's own candidates."""
    num_q, num_d = scores.shape
    per = (num_d - num_q) // num_q
    own = jnp.concatenate([jnp.arange(num_q)[:, None],
                           num_q + jnp.arange(num_q)[:, None] * per + jnp.arange(per)[None, :]], axis=1)
    own_valid = jnp.take_along_axis(valid, own, axis=1)
    terms = {}
    # The student's scores on the scale its contrastive loss uses (loss.temperature: cosine towers need
    # ~0.05), the teacher's logits at distill.temperature (the paper's 1).
    s_scale, t_scale = config.loss.temperature, config.distill.temperature
    if config.distill.document:
      teacher = batch["teacher_doc"]
      ok = own_valid & jnp.isfinite(teacher)
      terms["kd_document"] = jnp.mean(losses.distillation_kl(
          jnp.take_along_axis(scores, own, axis=1) / s_scale, jnp.where(ok, teacher, 0.0) / t_scale, ok))
    start = 0
    per_level = []
    for name, _ in distill_levels:
      t_pos, t_neg = batch[f"teacher_{name}_pos"], batch[f"teacher_{name}_neg"]  # [B, K], [B, n, K]
      k = t_pos.shape[1]
      piece = spans[:, start:start + k]  # [C, K, D]
      start += k
      s_pos = jnp.einsum("bd,bkd->bk", q, piece[:num_q])
      s_neg = jnp.einsum("bd,bnkd->bnk", q, piece[num_q:].reshape(num_q, per, k, -1))
      neg_ok = jnp.isfinite(t_neg) & own_valid[:, 1:, None]  # pieces of negative documents only (Eq. 15)
      per_level.append((name, k, t_pos, t_neg, s_pos, s_neg, neg_ok))
    if config.distill.negative_pieces:
      kept = distill.hierarchical_negatives([lv[5] for lv in per_level], [lv[6] for lv in per_level],
                                            [size for _, size in distill_levels], config.distill.negative_pieces)
      per_level = [lv[:6] + (lv[6] & keep,) for lv, keep in zip(per_level, kept)]
    for name, k, t_pos, t_neg, s_pos, s_neg, neg_ok in per_level:
      pos_ok = jnp.isfinite(t_pos)
      student = jnp.concatenate([s_pos[:, :, None], jnp.broadcast_to(
          s_neg.reshape(num_q, 1, per * k), (num_q, k, per * k))], axis=2)
      teacher = jnp.concatenate([t_pos[:, :, None], jnp.broadcast_to(
          t_neg.reshape(num_q, 1, per * k), (num_q, k, per * k))], axis=2)
      ok = jnp.concatenate([pos_ok[:, :, None], jnp.broadcast_to(
          neg_ok.reshape(num_q, 1, per * k), (num_q, k, per * k))], axis=2) & pos_ok[:, :, None]
      terms[f"fgd_{name}"] = jnp.mean(losses.granular_distillation(
          student / s_scale, jnp.where(ok, teacher, 0.0) / t_scale, ok))
    return terms

  def tokens_loss(q, d, batch, spans=None):
    # Every query is scored against every document of the global batch: under jit the batch-sharded
    # document matrix is all-gathered across devices and hosts by XLA, no hand-written collective.
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
    if not distilling:
      return finish(scores, fields, positive, {})
    contrastive, aux = finish(scores, fields, positive, {})
    terms = distillation_terms(q, spans, scores, batch["valid"], batch)
    aux.update({f"loss/{name}": value for name, value in terms.items()})
    aux["loss/contrastive"] = contrastive
    return config.distill.contrastive_weight * contrastive + sum(terms.values()), aux

  def mlm_loss(params, batch, rng):
    # The masked-LM baseline (Chang et al. 2020): BERT's token cross-entropy at the chosen positions only.
    logits = model.apply({"params": params}, batch["mlm_ids"], batch["mlm_mask"], batch["mlm_positions"],
                         deterministic=False, rngs={"dropout": rng}, method=TwoTower.mlm_logits)
    weights = batch["mlm_weights"]
    per_token = optax.softmax_cross_entropy_with_integer_labels(logits, batch["mlm_labels"])
    total = jnp.maximum(jnp.sum(weights), 1.0)
    hits = (jnp.argmax(logits, axis=-1) == batch["mlm_labels"]) * weights
    return jnp.sum(per_token * weights) / total, {"train_accuracy": jnp.sum(hits) / total}

  def train_step(state: TrainState, batch: dict[str, jax.Array], corpus=None, bias=None):
    query_rng, doc_rng = step_rngs(state)

    def loss_fn(params):
      variables = {"params": params}
      aux = {}
      if candidates == "pairs":
        # A cross-encoder: every (query, candidate) pair is one joint forward pass, one logit each.
        ids = batch["pair_ids"]
        rows, n, length = ids.shape
        flat = lambda x: x.reshape(rows * n, length)
        scores = encode_in_chunks(
            lambda a, key: model.apply(variables, *a, deterministic=False, rngs={"dropout": key}),
            (flat(ids), flat(batch["pair_mask"]), flat(batch["pair_types"])), query_rng, chunk_rows
        ).reshape(rows, n)
        fields = {"labels": batch["labels"], "valid": batch["valid"]}
        return finish(scores, fields, batch["labels"] > 0, aux)
      q = encode_in_chunks(
          lambda a, key: model.apply(variables, *a, deterministic=False, rngs={"dropout": key},
                                     method=TwoTower.encode_query),
          (batch["query_ids"], batch["query_mask"]), query_rng, chunk_rows)
      if candidates == "corpus":
        if retrieve_in_step:
          rows = retrieved.sharded_top_k(jax.lax.stop_gradient(q), corpus, bias, top_n, mesh,
                                         config.negatives.top_k_recall_target)
        else:
          rows = batch["cand_rows"]
        rows, labels, retrieved_labels = retrieved.replace_last(rows, batch["positive_rows"])
        docs = retrieved.gather_rows(corpus, rows, mesh)
        scores = jnp.einsum("bd,bnd->bn", q, docs)
        fields = {"labels": labels, "valid": rows >= 0}
        aux.update(retrieved.retrieval_diagnostics(retrieved_labels, batch["positive_rows"]))
        positive = labels > 0
        return finish(scores, fields, positive, aux)
      # A frozen document tower runs forward only, without dropout: nothing of it is trained.
      spans = None
      span_mask = distill.span_masks(batch["doc_mask"], distill_levels) if distill_levels else None
      d = encode_in_chunks(
          lambda a, key: model.apply(variables, a[0], a[1], deterministic=query_only,
                                     rngs={} if query_only else {"dropout": key}, method=TwoTower.encode_doc,
                                     span_mask=a[2], span_pooling=config.distill.pooling),
          (batch["doc_ids"], batch["doc_mask"], span_mask), doc_rng, chunk_rows)
      if span_mask is not None:
        d, spans = d
      if query_only:
        d = jax.lax.stop_gradient(d)
      return tokens_loss(q, d, batch, spans)

    if mlm:
      (loss, aux), grads = jax.value_and_grad(mlm_loss, has_aux=True)(state.params, batch, query_rng)
    elif chunk:
      # Sharded chunk loops (one gradient all-reduce per step) when every shard holds whole chunks.
      shards = parallel.data_parallel_size(mesh) if mesh is not None else 1
      sizes = (batch["query_ids"].shape[0], batch["doc_ids"].shape[0], chunk)
      loss, aux, grads = gradcache.cached_value_and_grad(
          encode_query, encode_doc, lambda q, d: tokens_loss(q, d, batch), state.params, batch,
          jax.random.fold_in(state.rng, state.step), chunk_size=chunk,
          mesh=mesh if shards > 1 and not any(n % shards for n in sizes) else None,
          batch_axes=parallel.BATCH_AXES)
    else:
      (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
    return new_state, {"loss": loss, "grad_norm": optax.tree.norm(grads), **aux,
                       **group_grad_norms(grads, skip=("doc_tower",) if query_only else ())}

  if mesh is None:
    return train_step

  def train_step_on_mesh(*args):
    # The towers pin their activations to this mesh's batch axes (jdr.models.bert.Encoder).
    with parallel.activations_on(mesh):
      return train_step(*args)

  return train_step_on_mesh


def step_rngs(state: TrainState) -> tuple[jax.Array, jax.Array]:
  """The (query, document) dropout keys of the step `state.step`: a function of the step alone."""
  return jax.random.split(jax.random.fold_in(state.rng, state.step))


def encode_in_chunks(encode, arrays, rng: jax.Array, chunk_rows: int):
  """`encode(arrays, rng)` (rows first in every array) run `chunk_rows` rows at a time, as one jax.lax.map.

  The chunks are strided (chunk k holds rows k, k + n, k + 2n, ... for n chunks), so on a mesh every chunk
  keeps the batch's split over the data devices. Chunk k draws its dropout from fold_in(rng, k). With
  chunk_rows 0, at least the number of rows, or not dividing it, `encode` runs once on everything."""
  rows = jax.tree.leaves(arrays)[0].shape[0]
  if chunk_rows <= 0 or chunk_rows >= rows or rows % chunk_rows:
    return encode(arrays, rng)
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


def check_cross_encoder(config: ml_collections.ConfigDict) -> None:
  """Refuses what a cross-encoder cannot train with, before anything is read."""
  neg = config.negatives
  if config.data.kind != "pairs":
    raise ValueError("model.architecture=cross_encoder trains on supervised pairs: set data.kind=pairs")
  if neg.source not in ("random", "bm25", "bm25_random", "static") or neg.per_query < 1 or neg.in_batch:
    raise ValueError("model.architecture=cross_encoder scores each query's own candidates: set "
                     "negatives.source to random | bm25 | bm25_random | static, negatives.per_query >= 1 and "
                     "negatives.in_batch=False")
  if config.grad_cache.chunk_size:
    raise ValueError("model.architecture=cross_encoder: gradient caching is for two towers; set "
                     "grad_cache.chunk_size=0")


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
  if chunk and rows:
    raise ValueError("grad_cache.chunk_size already encodes the batch in chunks; leave model.encode_chunk_rows at 0")
  return chunk


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


def _dummy_inputs(config: ml_collections.ConfigDict):
  if config.model.architecture == "cross_encoder":
    pair = jnp.ones((1, config.data.doc_max_length), jnp.int32)
    return pair, pair
  q = jnp.ones((1, config.data.query_max_length), jnp.int32)
  d = jnp.ones((1, config.data.doc_max_length), jnp.int32)
  return q, q, d, d


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str | pathlib.Path) -> dict:
  """Trains per `config`, checkpointing to and resuming from `workdir`; returns the final metrics."""
  # ---------------------------------------------------------------- hosts and mesh
  # first: both must run before anything starts a jax backend
  parallel.use_cpu_devices(config.mesh.cpu_devices)
  parallel.initialize_distributed()
  workdir = paths.absolute(workdir)  # local, or gs://... (etils.epath)
  workdir.mkdir(parents=True, exist_ok=True)
  is_host0 = jax.process_index() == 0
  mesh = parallel.make_mesh(config.mesh.shape)
  rules = parallel.rules_for(config.mesh.rules)
  parallel.check_batch_size(config.batch_size, mesh)
  sources.check(config)
  pretrain_batches.check(config)
  pretraining = config.data.kind == "pretrain"
  check_grad_cache(config, "corpus" if config.negatives.source == "retrieval" else "tokens")
  distill.check(config)
  if config.model.architecture == "cross_encoder":
    check_cross_encoder(config)
  losses.make_loss(config.loss)  # an unknown loss fails here, before any data is read

  # ---------------------------------------------------------------- data and model
  built = build_lib.build(config.model, config.data)
  if pretraining:  # pairs from articles, made by the step; no corpus and no evaluation
    batches, data = pretrain_batches.make(config, built.tokenizer, process_index=jax.process_index(),
                                          process_count=jax.process_count())
  else:
    data = pairs.load(config.data, workdir)
  model = built.model
  cross_encoder = config.model.architecture == "cross_encoder"
  if pretraining and config.data.pretrain_task == "mlm":
    model = model.clone(mlm_head=True)  # trained here, dropped by every reader of the workdir
  query_only = config.model.train_towers == "query"
  candidates = "corpus" if config.negatives.source == "retrieval" else "pairs" if cross_encoder else "tokens"
  if is_host0:
    atomic.write_text(workdir / "config.json", config.to_json_best_effort(indent=1))
    atomic.write_text(workdir / "model.json", json.dumps(built.description, indent=1))

  # ---------------------------------------------------------------- optimizer and abstract state
  tx = optimizers.make_optimizer(config.optimizer, config.num_train_steps, config.model.train_towers)
  init_rng = jax.random.PRNGKey(config.seed)
  abstract_state, state_shardings = abstract_train_state(model, tx, config, mesh, rules)

  # ---------------------------------------------------------------- state: resume | init_from | fresh
  mngr = checkpoint.manager(workdir, keep=config.keep_checkpoints)
  if mngr.latest_step() is not None:
    state, _ = checkpoint.restore(mngr, abstract_state)
    print(f"resumed from {workdir / 'checkpoints'} at step {int(state.step)}", file=sys.stderr)
  else:
    params = initial_params(model, built, config, init_rng, state_shardings.params)
    opt_state = jax.jit(tx.init, out_shardings=state_shardings.opt_state)(params)
    state = TrainState(step=jax.device_put(jnp.int32(0), state_shardings.step), params=params,
                       opt_state=opt_state,
                       rng=jax.device_put(jax.random.PRNGKey(config.seed + 1), state_shardings.rng))

  # ---------------------------------------------------------------- negatives (may mine with the weights)
  encoder = evaluation.TowerEncoder(
      model, built.tokenizer, data, query_max_length=config.data.query_max_length,
      doc_max_length=config.eval.doc_max_length or config.data.doc_max_length,
      tokens_per_batch=config.eval.tokens_per_batch, mesh=mesh)

  negatives = sources.make(config, data, workdir, encoder, state.params, mesh, make_step_query_vectors(model, config.model.encode_chunk_rows))
  if not pretraining:
    batches = pairs.Batches(
        data, built.tokenizer, batch_size=config.batch_size,
        query_max_length=config.data.query_max_length, doc_max_length=config.data.doc_max_length,
        negative_source=negatives.sampler, negatives_per_query=config.negatives.per_query,
        in_batch=config.negatives.in_batch, seed=config.seed,
        process_index=jax.process_index(), process_count=jax.process_count(),
        candidates=candidates, random_weight=config.negatives.random_weight)
    if is_host0:
      pairs.describe_counts(data, batches)
  distiller = None
  if distill.enabled(config):  # the teacher scores every (query, document) it can meet, once, cached
    distiller = distill.Distiller(config, data, built.tokenizer, batches, negatives.sampler, workdir / "cache")

  # ---------------------------------------------------------------- the step, jitted once
  batch_shardings = parallel.batch_sharding(mesh)
  train_step = make_train_step(model, tx, config, mesh, candidates, negatives.retrieve_in_step)
  if candidates == "corpus":
    corpus_sharding, bias_sharding = retrieved.corpus_shardings(mesh)
    jitted = jax.jit(train_step, in_shardings=(state_shardings, batch_shardings, corpus_sharding, bias_sharding),
                     out_shardings=(state_shardings, parallel.replicated(mesh)), donate_argnums=(0,))
    step_fn = lambda st, b: jitted(st, b, negatives.corpus.device, negatives.corpus.bias)
  else:
    step_fn = jax.jit(train_step, in_shardings=(state_shardings, batch_shardings),
                      out_shardings=(state_shardings, parallel.replicated(mesh)), donate_argnums=(0,))

  def batch_at(step: int, state) -> dict[str, jax.Array]:
    negatives.prepare(step, state)
    batch = negatives.complete(batches.local(step), state)
    if distiller is not None:
      batch = distiller.complete(batch, step)
    return parallel.global_batch(batch, mesh)

  # ---------------------------------------------------------------- evaluation
  start = int(state.step)
  writer = metric_writers.MetricWriter(workdir, start_step=start)  # a resume drops the lines it logs again
  evaluator = None
  if data.eval_qrels and cross_encoder:
    evaluator = evaluation.RerankEvaluator(model, built.tokenizer, data, config)
  elif data.eval_qrels:
    diagnostics = evaluation.TrainingDiagnostics(encoder, data, negatives, config)
    evaluator = evaluation.Evaluator(encoder, config, mesh, doc_tower_frozen=query_only,
                                     diagnostics=diagnostics, fixed_doc_emb=negatives.doc_emb)
  results = {}
  if evaluator and start == 0 and config.eval_before_training:
    results["before"] = evaluator(state.params)
    writer.write(0, {f"eval/{k}": v for k, v in results["before"].items()})
    evaluation.print_metrics("before training", results["before"])

  # ---------------------------------------------------------------- loop
  bar = tqdm.tqdm(total=config.num_train_steps, initial=start, unit="step", desc="train",
                  disable=not is_host0, mininterval=1.0 if sys.stderr.isatty() else 30.0)
  window, window_start = [], time.perf_counter()
  next_batch = batch_at(start, state) if start < config.num_train_steps else None
  stop = preemption.StopRequests().install()  # SIGTERM / SIGINT: stop after this step, saved
  try:
    for step in range(start, config.num_train_steps):
      state, step_metrics = step_fn(state, next_batch)
      # Build the next batch on the host while the device runs this step (sources that need the new
      # weights, ADORE's host retrieval and ANCE's snapshots, wait for them).
      if step + 1 < config.num_train_steps:
        next_batch = batch_at(step + 1, state)
      step_metrics = jax.device_get(step_metrics)
      if not math.isfinite(float(step_metrics["loss"])):
        mngr.wait_until_finished()
        raise FloatingPointError(
            f"loss is {float(step_metrics['loss'])} at step {step + 1}; stopped without saving. The last "
            f"good checkpoint is step {mngr.latest_step()} in {workdir / 'checkpoints'}")
      window.append(step_metrics)
      done = step + 1
      if done % config.checkpoint_every == 0:
        checkpoint.save(mngr, done, state, _data_position(batches, done), force=True)
      if done % config.log_every == 0 or done == config.num_train_steps:
        elapsed = time.perf_counter() - window_start
        scalars = {k: float(np.mean([m[k] for m in window])) for k in window[0]}
        scalars["examples_per_second"] = len(window) * config.batch_size / elapsed
        scalars.update(negatives.log_scalars(done))
        writer.write(done, {f"train/{k}": v for k, v in scalars.items()})
        bar.set_postfix(loss=f"{scalars['loss']:.4f}", ex_s=f"{scalars['examples_per_second']:.1f}")
        window, window_start = [], time.perf_counter()
      bar.update(1)
      if evaluator and config.eval_every and done % config.eval_every == 0 and done < config.num_train_steps:
        scores = evaluator(state.params)
        writer.write(done, {f"eval/{k}": v for k, v in scores.items()})
        bar.write(f"step {done}: " + ", ".join(f"{k}={v:.4f}" for k, v in scores.items()))
      if stop.requested():
        break
  finally:
    stop.restore()
    negatives.close(wait=stop.signum is None)
  bar.close()
  if mngr.latest_step() != int(state.step):
    checkpoint.save(mngr, int(state.step), state, _data_position(batches, int(state.step)), force=True)
  mngr.wait_until_finished()
  if stop.signum is not None:
    writer.close()
    raise preemption.Stopped(stop.signum, int(state.step), workdir)

  if evaluator:
    results["after"] = evaluator(state.params)
    writer.write(int(state.step), {f"eval/{k}": v for k, v in results["after"].items()})
    if "before" in results:
      evaluation.print_metrics("before training", results["before"])
    evaluation.print_metrics(f"after {int(state.step)} steps", results["after"])
  writer.close()
  results["state"] = state
  return results


def abstract_train_state(model, tx: optax.GradientTransformation, config: ml_collections.ConfigDict, mesh,
                         rules) -> tuple[TrainState, Any]:
  """(the TrainState as sharded ShapeDtypeStructs, its shardings) from the logical axis names of the params:
  nothing is allocated. The trainer restores and jits against it; `--compile-only` compiles against it."""
  boxed_params = jax.eval_shape(lambda r: model.init(r, *_dummy_inputs(config))["params"], jax.random.PRNGKey(0))
  abstract = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=boxed_params,
                        opt_state=jax.eval_shape(tx.init, boxed_params), rng=jax.ShapeDtypeStruct((2,), jnp.uint32))
  shardings = parallel.tree_shardings(abstract, mesh, rules)
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), nn.unbox(abstract),
                          shardings)
  return abstract, shardings


def initial_params(model: TwoTower, built: build_lib.Built, config: ml_collections.ConfigDict,
                   rng: jax.Array, shardings: Any) -> Any:
  """init_from's weights (a jdr model, or a pretrained encoder in every tower), else fresh ones."""
  init = jax.jit(lambda r: nn.unbox(model.init(r, *_dummy_inputs(config))["params"]),
                 **({"out_shardings": shardings} if shardings is not None else {}))
  if built.params is not None:
    params = built.params
    if getattr(model, "mlm_head", False):  # a trained model's towers under a fresh masked-LM head
      params = {**params, "lm_head": jax.device_get(init(rng))["lm_head"]}
  else:
    params = init(rng)
    if built.encoder_params is None:
      return params
    params = build_lib.with_encoder_params(jax.device_get(params), built.encoder_params)
  expected = jax.tree.map(lambda s: s.shape, jax.eval_shape(init, rng))
  got = jax.tree.map(lambda x: x.shape, params)
  if jax.tree.structure(expected) != jax.tree.structure(got) or expected != got:
    raise ValueError(f"{config.model.init_from}: its weights do not fit the configured towers "
                     f"(expected {expected}, got {got})")
  return jax.device_put(params, shardings)


def _data_position(batches: pairs.Batches, step: int) -> dict:
  """Where the data stream stands after `step` steps (informational: batches are a function of step)."""
  consumed = step * batches.batch_size
  return {"step": step, "examples_consumed": consumed,
          "epoch": consumed // batches.examples_per_epoch,
          "position_in_epoch": consumed % batches.examples_per_epoch, "seed": batches.seed}


def main(argv=None) -> None:
  argv = sys.argv[1:] if argv is None else list(argv)
  try:
    rest, overrides = config_files.split_config_args(argv)
    from jdr import config_help  # pylint: disable=g-import-not-at-top
    parser = argparse.ArgumentParser(
        prog="python -m jdr.train", description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="config keys, set with --config.KEY=VALUE (the defaults of jdr/defaults.py; a recipe changes "
               "some):\n" + config_help.describe())
    parser.add_argument("--config", required=True, help="configs/X.py[:arg]")
    parser.add_argument("--workdir", default=None, help="checkpoints, logs; an existing one resumes")
    parser.add_argument("--compile-only", action="store_true",
                        help="compile the step for the configured mesh and print its per-device memory and FLOPs "
                             "(jdr/sizing.py); no data is read and nothing trains")
    parser.add_argument("--topology", default=None,
                        help="with --compile-only: compile for this TPU slice's devices instead of the local ones, "
                             "e.g. v5e:2x2 or v4:2x2x1 (ahead of time, from any host with libtpu installed)")
    args = parser.parse_args(rest)
    if args.topology and not args.compile_only:
      parser.error("--topology goes with --compile-only")
    if not args.workdir and not args.compile_only:
      parser.error("--workdir is required (except with --compile-only)")
    config = config_files.load_config_file(args.config)
    config_files.apply_overrides(config, overrides)
  except config_files.ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    raise SystemExit(2) from None
  # Bad input or settings (a malformed file, ids that do not match, a batch that does not split) are the
  # user's to fix: one line naming the file, the line and the reason, status 2, no traceback.
  with cli.reporting_errors():
    if args.compile_only:
      from jdr import sizing  # pylint: disable=g-import-not-at-top
      parallel.use_cpu_devices(config.mesh.cpu_devices)
      parallel.initialize_distributed()
      sizing.report(sizing.size_step(config, topology=args.topology))
      return
    created = not paths.as_path(args.workdir).exists()
    try:
      train_and_evaluate(config, args.workdir)
    except preemption.Stopped as stopped:
      preemption.exit_stopped(stopped, argv)
    except BaseException as e:
      if created:
        _remove_unstarted(args.workdir)
      if isinstance(e, KeyboardInterrupt):  # outside the loop, where SIGINT stops after a saved step
        print(f"jdr: interrupted; checkpoints, if any, are in {args.workdir}/checkpoints", file=sys.stderr)
        raise SystemExit(130) from None
      raise


def _remove_unstarted(workdir: str) -> None:
  """A run that failed before it saved or logged anything leaves no workdir behind (when it made it)."""
  path = paths.as_path(workdir)
  if jax.process_index() != 0 or not path.exists() or (path / "metrics.jsonl").exists():
    return
  if (path / "checkpoints").exists() and any(p.name.isdigit() for p in (path / "checkpoints").iterdir()):
    return
  path.rmtree()

if __name__ == "__main__":
  main()
