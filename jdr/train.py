"""Train a dense retriever: `python -m jdr.train --config configs/X.py[:arg] --workdir DIR [--config.k=v]`.

One trainer for every method: which towers train, where negatives come from and which loss is used are
config values (see configs/base.py), never a fork of this file. `train_and_evaluate` reads top to bottom:
mesh, data, model, state (resume | init_from | fresh), the jitted step, the loop, evaluation.
"""

import argparse
import functools
import json
import math
import pathlib
import sys
import time
from typing import Any, Callable

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import tqdm

from jdr import checkpoint
from jdr import config_files
from jdr import encode as encode_lib
from jdr import index as index_lib
from jdr import losses
from jdr import metric_writers
from jdr import metrics as metrics_lib
from jdr import optimizers
from jdr import parallel
from jdr.data import pairs
from jdr.data import text as text_lib
from jdr.models import build as build_lib
from jdr.models.towers import TwoTower


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: steps taken; the batch and the dropout rng follow from it
  params: Any
  opt_state: Any
  rng: jax.Array  # uint32[2] base key; step s uses fold_in(rng, s)


def make_loss(loss_cfg: ml_collections.ConfigDict) -> Callable[[jax.Array, jax.Array], jax.Array]:
  """Per-example loss of a [B, C] score matrix whose row b's positive is column b."""
  if loss_cfg.name == "softmax_nll":
    return functools.partial(losses.softmax_nll, temperature=loss_cfg.temperature)
  if loss_cfg.name == "ranknet":
    return losses.ranknet
  if loss_cfg.name == "hinge":
    return functools.partial(losses.hinge, margin=loss_cfg.margin)
  if loss_cfg.name == "bce":
    return losses.bce
  raise ValueError(f"loss.name must be softmax_nll, ranknet, hinge or bce; got {loss_cfg.name!r}")


def make_train_step(model: TwoTower, tx: optax.GradientTransformation, config: ml_collections.ConfigDict):
  """The pure step (state, batch) -> (state, metrics); the caller jits it with explicit shardings."""
  loss_fn_of_scores = make_loss(config.loss)
  hardest = config.negatives.hardest_in_batch

  def train_step(state: TrainState, batch: dict[str, jax.Array]):
    query_rng, doc_rng = jax.random.split(jax.random.fold_in(state.rng, state.step))

    def loss_fn(params):
      variables = {"params": params}
      q = model.apply(variables, batch["query_ids"], batch["query_mask"], deterministic=False,
                      rngs={"dropout": query_rng}, method=TwoTower.encode_query)
      d = model.apply(variables, batch["doc_ids"], batch["doc_mask"], deterministic=False,
                      rngs={"dropout": doc_rng}, method=TwoTower.encode_doc)
      # Every query is scored against every document of the global batch: under jit the batch-sharded
      # document matrix is all-gathered across devices and hosts by XLA, no hand-written collective.
      scores = q @ d.T
      valid = batch["valid"]
      if hardest:
        valid = losses.hardest_negative_mask(scores, valid)
      per_example = loss_fn_of_scores(scores, valid)
      masked = jnp.where(valid, scores, -jnp.inf)
      rows = jnp.arange(scores.shape[0])
      accuracy = jnp.mean(jnp.argmax(masked, axis=1) == rows)
      return jnp.mean(per_example), {"train_accuracy": accuracy}

    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
    return new_state, {"loss": loss, "grad_norm": optax.tree.norm(grads), **aux}

  return train_step


def _dummy_inputs(config: ml_collections.ConfigDict):
  q = jnp.ones((1, config.data.query_max_length), jnp.int32)
  d = jnp.ones((1, config.data.doc_max_length), jnp.int32)
  return q, q, d, d


class Evaluator:
  """Encodes the corpus with the document tower, indexes it, retrieves for the eval queries, scores."""

  def __init__(self, model: TwoTower, tokenizer, data: pairs.RetrievalData,
               config: ml_collections.ConfigDict, mesh):
    self.data, self.config, self.mesh, self.tokenizer = data, config, mesh, tokenizer
    self.metric_names = [m.strip() for m in config.eval.metrics.split(",") if m.strip()]
    for name in self.metric_names:
      metrics_lib.parse_metric(name)  # an unknown metric name fails here, before training
    qids = sorted(data.eval_qrels or {})
    if config.eval.max_queries:
      qids = qids[:config.eval.max_queries]
    self.qids = qids
    self.doc_ids = list(data.corpus)
    self.doc_max_length = config.eval.doc_max_length or config.data.doc_max_length
    # Tokenized once: every evaluation of the run encodes the same texts.
    self.doc_tokens = text_lib.tokenize(
        tokenizer, [text_lib.doc_text(data.corpus[d]) for d in self.doc_ids], self.doc_max_length)
    self.query_tokens = text_lib.tokenize(
        tokenizer, [data.queries[q] for q in self.qids], config.data.query_max_length)
    # Jitted once here; each evaluation reuses the compiled length buckets.
    self.encode_doc = jax.jit(lambda p, i, m: model.apply({"params": p}, i, m, method=TwoTower.encode_doc))
    self.encode_query = jax.jit(
        lambda p, i, m: model.apply({"params": p}, i, m, method=TwoTower.encode_query))

  def __call__(self, params) -> dict[str, float]:
    cfg = self.config
    batch_tokens = cfg.eval.tokens_per_batch or None
    doc_runtime = encode_lib.EncoderRuntime(self.encode_doc, params, self.tokenizer, self.doc_max_length, {})
    query_runtime = encode_lib.EncoderRuntime(
        self.encode_query, params, self.tokenizer, cfg.data.query_max_length, {})
    doc_emb = encode_lib.encode_tokens(doc_runtime, self.doc_tokens, tokens_per_batch=batch_tokens)
    query_emb = encode_lib.encode_tokens(query_runtime, self.query_tokens, tokens_per_batch=batch_tokens)
    kwargs = {"mesh": self.mesh} if cfg.eval.backend == "jax" else {}
    retriever = index_lib.make_retriever(cfg.eval.backend, doc_emb.shape[1], **kwargs)
    retriever.add(doc_emb, self.doc_ids)
    scores, ids = retriever.search(query_emb, min(cfg.eval.top_k, len(self.doc_ids)))
    run = index_lib.to_run(self.qids, scores, ids)
    qrels = {q: self.data.eval_qrels[q] for q in self.qids}
    return metrics_lib.evaluate(qrels, run, self.metric_names)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str | pathlib.Path) -> dict:
  """Trains per `config`, checkpointing to and resuming from `workdir`; returns the final metrics."""
  # ---------------------------------------------------------------- hosts and mesh
  parallel.initialize_distributed()  # first: it must run before anything starts a jax backend
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  is_host0 = jax.process_index() == 0
  mesh = parallel.make_mesh(config.mesh.shape)
  rules = parallel.rules_for(config.mesh.rules)
  parallel.check_batch_size(config.batch_size, mesh)

  # ---------------------------------------------------------------- data
  data = pairs.load(config.data, workdir)
  negative_source = pairs.make_negative_source(config.negatives, data, workdir / "cache")
  built = build_lib.build(config.model, config.data)
  batches = pairs.Batches(
      data, built.tokenizer, batch_size=config.batch_size,
      query_max_length=config.data.query_max_length, doc_max_length=config.data.doc_max_length,
      negative_source=negative_source, negatives_per_query=config.negatives.per_query,
      in_batch=config.negatives.in_batch, seed=config.seed,
      process_index=jax.process_index(), process_count=jax.process_count())
  if is_host0:
    pairs.describe_counts(data, batches)
    (workdir / "config.json").write_text(config.to_json_best_effort(indent=1))
    (workdir / "model.json").write_text(json.dumps(built.description, indent=1))

  # ---------------------------------------------------------------- model and optimizer
  model = built.model
  tx = optimizers.make_optimizer(config.optimizer, config.num_train_steps, config.model.train_towers)
  init_rng = jax.random.PRNGKey(config.seed)
  boxed_params = jax.eval_shape(lambda r: model.init(r, *_dummy_inputs(config))["params"], init_rng)
  abstract_state = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=boxed_params,
                              opt_state=jax.eval_shape(tx.init, boxed_params),
                              rng=jax.ShapeDtypeStruct((2,), jnp.uint32))
  state_shardings = parallel.tree_shardings(abstract_state, mesh, rules)
  abstract_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                nn.unbox(abstract_state), state_shardings)

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

  # ---------------------------------------------------------------- the step, jitted once
  batch_shardings = parallel.batch_sharding(mesh)
  step_fn = jax.jit(make_train_step(model, tx, config),
                    in_shardings=(state_shardings, batch_shardings),
                    out_shardings=(state_shardings, parallel.replicated(mesh)),
                    donate_argnums=(0,))

  # ---------------------------------------------------------------- loop
  writer = metric_writers.MetricWriter(workdir)
  evaluator = Evaluator(model, built.tokenizer, data, config, mesh) if data.eval_qrels else None
  results = {}
  start = int(state.step)
  if evaluator and start == 0 and config.eval_before_training:
    results["before"] = evaluator(state.params)
    writer.write(0, {f"eval/{k}": v for k, v in results["before"].items()})
    _print_metrics("before training", results["before"])

  bar = tqdm.tqdm(total=config.num_train_steps, initial=start, unit="step", desc="train",
                  disable=not is_host0, mininterval=1.0 if sys.stderr.isatty() else 30.0)
  window, window_start = [], time.perf_counter()
  next_batch = parallel.global_batch(batches.local(start), mesh) if start < config.num_train_steps else None
  for step in range(start, config.num_train_steps):
    state, step_metrics = step_fn(state, next_batch)
    # Build the next batch on the host while the device runs this step.
    if step + 1 < config.num_train_steps:
      next_batch = parallel.global_batch(batches.local(step + 1), mesh)
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
      writer.write(done, {f"train/{k}": v for k, v in scalars.items()})
      bar.set_postfix(loss=f"{scalars['loss']:.4f}", ex_s=f"{scalars['examples_per_second']:.1f}")
      window, window_start = [], time.perf_counter()
    bar.update(1)
    if evaluator and config.eval_every and done % config.eval_every == 0 and done < config.num_train_steps:
      scores = evaluator(state.params)
      writer.write(done, {f"eval/{k}": v for k, v in scores.items()})
      bar.write(f"step {done}: " + ", ".join(f"{k}={v:.4f}" for k, v in scores.items()))
  bar.close()
  if mngr.latest_step() != int(state.step):
    checkpoint.save(mngr, int(state.step), state, _data_position(batches, int(state.step)), force=True)
  mngr.wait_until_finished()

  if evaluator:
    results["after"] = evaluator(state.params)
    writer.write(int(state.step), {f"eval/{k}": v for k, v in results["after"].items()})
    if "before" in results:
      _print_metrics("before training", results["before"])
    _print_metrics(f"after {int(state.step)} steps", results["after"])
  writer.close()
  results["state"] = state
  return results


def initial_params(model: TwoTower, built: build_lib.Built, config: ml_collections.ConfigDict,
                   rng: jax.Array, shardings: Any) -> Any:
  """init_from's weights (a jdr model, or a pretrained encoder in every tower), else fresh ones."""
  init = jax.jit(lambda r: nn.unbox(model.init(r, *_dummy_inputs(config))["params"]),
                 **({"out_shardings": shardings} if shardings is not None else {}))
  if built.params is not None:
    params = built.params
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


def _print_metrics(title: str, scores: dict[str, float]) -> None:
  if jax.process_index() == 0:
    print(f"{title}: " + "  ".join(f"{k}={v:.4f}" for k, v in scores.items()), flush=True)


def main(argv=None) -> None:
  argv = sys.argv[1:] if argv is None else list(argv)
  try:
    rest, overrides = config_files.split_config_args(argv)
    parser = argparse.ArgumentParser(prog="python -m jdr.train", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="configs/X.py[:arg]")
    parser.add_argument("--workdir", required=True, help="checkpoints, logs; an existing one resumes")
    args = parser.parse_args(rest)
    config = config_files.load_config_file(args.config)
    config_files.apply_overrides(config, overrides)
  except config_files.ConfigError as e:
    raise SystemExit(f"error: {e}") from None
  train_and_evaluate(config, args.workdir)


if __name__ == "__main__":
  main()
