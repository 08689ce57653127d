"""The one trainer: `train_and_evaluate(config, workdir)`, what `python -m jdr.train` runs.

Which towers train, where negatives come from and which loss is used are config values (see configs/base.py),
never a fork of this file. `train_and_evaluate` reads top to bottom: the checks (jdr/training/validate.py), mesh,
data, model, state (resume | init_from | fresh), negatives, the step (jdr/training/step.py, jitted once), the loop,
evaluation.
"""

import json
import math
import pathlib
import sys
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import tqdm

from jdr.runtime import atomic
from jdr.runtime import checkpoint
from jdr.training import distill
from jdr.training import guide
from jdr.retrieval import tower_encoder
from jdr.evaluation import periodic
from jdr.evaluation import suite as suite_lib
from jdr.training import losses
from jdr.training import metric_writers
from jdr.training import optimizers
from jdr.runtime import parallel
from jdr.runtime import paths
from jdr.training import preemption
from jdr.training import step as step_lib
from jdr.training import validate
from jdr.data import mixture
from jdr.data import pairs
from jdr.data import pretrain_batches
from jdr.negatives import sources
from jdr.models import build as build_lib
from jdr.models.towers import TwoTower


def cpu_devices(config: ml_collections.ConfigDict) -> int:
  """mesh.cpu_devices as `parallel.use_cpu_devices` takes it: -1 resolved for this host and run
  (`parallel.auto_cpu_devices`: one device per core where the batch splits and memory holds the copies)."""
  if config.mesh.cpu_devices != -1:
    return config.mesh.cpu_devices
  weights = build_lib.weight_bytes(config.model)
  # A device's copy of the training state: the parameters, their gradients and two optimizer moments.
  count = parallel.auto_cpu_devices(config.batch_size, config.grad_cache.chunk_size,
                                    None if weights is None else 4 * weights)
  if count:
    print(f"this CPU trains as {count} XLA devices, one per core (mesh.cpu_devices=-1; 0 keeps one)",
          file=sys.stderr)
  return count


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str | pathlib.Path) -> dict:
  """Trains per `config`, checkpointing to and resuming from `workdir`; returns the final metrics."""
  # Every refusal the config can meet, each unit checking its own section, before a workdir, a backend or data;
  # data.mixture's plan: each dataset's own run config ([] = data.dataset alone)
  mix = validate.validate(config)
  primary = mix[0].config if mix else config  # the run as its (first) dataset sees it: the one evaluated
  # ---------------------------------------------------------------- hosts and mesh
  # first: both must run before anything starts a jax backend
  parallel.use_cpu_devices(cpu_devices(config))
  parallel.initialize_distributed()
  workdir = paths.absolute(workdir)  # local, or gs://... (etils.epath)
  workdir.mkdir(parents=True, exist_ok=True)
  is_host0 = jax.process_index() == 0
  mesh = parallel.make_mesh(config.mesh.shape)
  rules = parallel.rules_for(config.mesh.rules)
  parallel.check_batch_size(config.batch_size, mesh)  # the one check that needs the mesh
  pretraining = config.data.kind == "pretrain"

  # ---------------------------------------------------------------- data and model
  built = build_lib.build(config.model, config.data)
  # The texts put before every query and document (model.query_prompt / model.doc_prompt, else the model's
  # own), wherever the run tokenizes them; a cross-encoder has none.
  prompts = built.description.get("prompts")
  if pretraining:  # pairs from articles, made by the step; no corpus and no evaluation
    batches, data = pretrain_batches.make(config, built.tokenizer, process_index=jax.process_index(),
                                          process_count=jax.process_count(), prompts=prompts)
  else:
    data = pairs.load(primary.data, workdir)
  further = [pairs.load(e.config.data, workdir) for e in mix[1:]]  # data.mixture's other datasets
  model = built.model
  if pretrain_batches.is_masked_lm(config):
    model = model.clone(mlm_head=True)  # trained here, dropped by every reader of the workdir
  query_only = optimizers.query_only(config.model)
  if losses.matryoshka_dims(config.loss) and isinstance(model, TwoTower):  # what it serves (jdr.encode --dim)
    built.description["matryoshka_dims"] = losses.matryoshka_record(config.loss, model.query.dim)
  if is_host0:
    atomic.write_text(workdir / "config.json", config.to_json_best_effort(indent=1))
    atomic.write_text(workdir / "model.json", json.dumps(built.description, indent=1))

  # ---------------------------------------------------------------- optimizer and abstract state
  tx = optimizers.make_optimizer(config.optimizer, config.num_train_steps, config.model.train_towers,
                                 optimizers.uses_lora(config.model))
  init_rng = jax.random.PRNGKey(config.seed)
  abstract_state, state_shardings = step_lib.abstract_train_state(model, tx, config, mesh, rules)

  # ---------------------------------------------------------------- state: resume | init_from | fresh
  mngr = checkpoint.manager(workdir, keep=config.keep_checkpoints)
  restored = checkpoint.restore_latest_good(mngr, abstract_state)  # the newest step that verifies
  if restored is not None:
    state = restored[0]
    print(f"resumed from {workdir / 'checkpoints'} at step {int(state.step)}", file=sys.stderr)
  else:
    params = initial_params(model, built, config, init_rng, state_shardings.params)
    opt_state = jax.jit(tx.init, out_shardings=state_shardings.opt_state)(params)
    state = step_lib.TrainState(step=jax.device_put(jnp.int32(0), state_shardings.step), params=params,
                                opt_state=opt_state,
                                rng=jax.device_put(jax.random.PRNGKey(config.seed + 1), state_shardings.rng))

  # ---------------------------------------------------------------- negatives (may mine with the weights)
  encoder = tower_encoder.TowerEncoder(
      model, built.tokenizer, data, query_max_length=config.data.query_max_length,
      doc_max_length=config.eval.doc_max_length or config.data.doc_max_length,
      tokens_per_batch=config.eval.tokens_per_batch, mesh=mesh, cache_dir=config.eval.corpus_cache,
      prompts=prompts)

  negatives = sources.make(primary, data, workdir, encoder, state.params, mesh,
                           step_lib.make_step_query_vectors(model, config.model.encode_chunk_rows))
  if not pretraining:
    batches = pair_batches(primary, data, negatives, built.tokenizer, prompts, mix[0] if mix else None)
    if is_host0:
      pairs.describe_counts(data, batches)
  if mix:  # every further dataset with its own data, negatives and batches; each step draws one (data.mixture)
    per_dataset = [batches]
    for entry, entry_data in zip(mix[1:], further):
      entry_negatives = sources.make(entry.config, entry_data, workdir, encoder, state.params, mesh)
      per_dataset.append(pair_batches(entry.config, entry_data, entry_negatives, built.tokenizer, prompts, entry))
      if is_host0:
        pairs.describe_counts(entry_data, per_dataset[-1])
    batches = mixture.Mixture(mix, per_dataset, config.data.mixture_sampling, config.seed)
    if is_host0:
      batches.describe(config.num_train_steps)
  distiller = None
  if distill.enabled(config.distill):  # the teacher scores every (query, document) the run can meet, once, cached
    distiller = distill.Distiller(
        config.distill, data, built.tokenizer, batches, negatives.sampler, workdir / "cache",
        query_max_length=config.data.query_max_length, doc_max_length=config.data.doc_max_length,
        per_query=config.negatives.per_query, num_train_steps=config.num_train_steps, mined=config.negatives.mined,
        prompts=prompts)

  host_guide = None  # a frozen guide model masks each batch's false negatives on the host ("self": in the step)
  if guide.on_host(config.negatives.guide):
    host_guide = guide.HostGuide(config.negatives.guide, data, config.data.query_max_length,
                                 config.data.doc_max_length)

  # ---------------------------------------------------------------- the step, jitted once
  train_step = step_lib.make_train_step(model, tx, config, mesh, negatives.candidates, negatives.retrieve_in_step)
  step_fn = step_lib.jit_step(train_step, state_shardings, mesh, negatives.corpus)

  def batch_at(step: int, state) -> dict[str, jax.Array]:
    negatives.prepare(step, state)
    batch = negatives.complete(batches.local(step), state)
    if host_guide is not None:
      batch = host_guide.complete(batch, batches.global_layout(step), batches.host_rows(config.batch_size))
    if distiller is not None:
      batch = distiller.complete(batch, step)
    return parallel.global_batch(batch, mesh)

  # ---------------------------------------------------------------- evaluation
  start = int(state.step)
  writer = metric_writers.MetricWriter(workdir, start_step=start)  # a resume drops the lines it logs again
  evaluator = None
  if data.eval_qrels and negatives.candidates == "pairs":  # a cross-encoder reranks a first stage
    evaluator = periodic.RerankEvaluator(model, built.tokenizer, data, config)
  elif data.eval_qrels:  # periodic: eval.candidates (the corpus, or each query's candidates); final: eval.final
    bm25_index = periodic.BM25IndexOf(data, negatives, workdir / "cache")  # one lookup for both users
    diagnostics = periodic.TrainingDiagnostics(encoder, data, negatives, config, cache_dir=workdir / "cache",
                                                 bm25_index=bm25_index)
    evaluator = periodic.Evaluator(encoder, config, mesh, doc_tower_frozen=query_only,
                                     diagnostics=diagnostics, fixed_doc_emb=negatives.doc_emb,
                                     fixed_corpus=negatives.corpus, cache_dir=workdir / "cache",
                                     bm25_index=bm25_index, matryoshka_dims=built.description.get("matryoshka_dims", ()))
  # eval.suite's tasks of other domains, scored beside the run's own evaluation (alone when it has none)
  evaluator = suite_lib.alongside(evaluator, suite_lib.make(encoder, config, doc_tower_frozen=query_only))
  results = {}
  if evaluator and start == 0 and config.eval_before_training:
    results["before"] = evaluator(state.params)
    writer.write(0, {f"eval/{k}": v for k, v in results["before"].items()})
    periodic.print_metrics(f"before training, eval ({evaluator.describe()})", results["before"])

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
      # A non-finite gradient norm has already put non-finite values in the parameters or moments.
      bad = [k for k in ("loss", "grad_norm") if not math.isfinite(float(step_metrics[k]))]
      if bad:
        checkpoint.wait(mngr)
        raise checkpoint.NonFiniteError(
            f"{bad[0]} is {float(step_metrics[bad[0]])} at step {step + 1}; stopped without saving. The last "
            f"good checkpoint is step {mngr.latest_step()} in {workdir / 'checkpoints'}")
      window.append(step_metrics)
      done = step + 1
      if config.checkpoint_every and done % config.checkpoint_every == 0:
        checkpoint.save(mngr, done, state, _data_position(batches, done), force=True)
      if done % config.log_every == 0 or done == config.num_train_steps:
        elapsed = time.perf_counter() - window_start
        scalars = {k: float(np.mean([m[k] for m in window])) for k in window[0]}
        scalars["examples_per_second"] = len(window) * config.batch_size / elapsed
        scalars.update(negatives.log_scalars(done))
        if isinstance(batches, pairs.Batches):  # pretraining's batches mask nothing
          scalars.update(batches.log_scalars())
        if isinstance(batches, mixture.Mixture):  # each dataset's share of the steps so far: mixture/NAME
          scalars.update(batches.log_scalars(done))
        if host_guide is not None:
          scalars.update(host_guide.log_scalars())
        writer.write(done, {f"train/{k}": v for k, v in scalars.items()})
        bar.set_postfix(loss=f"{scalars['loss']:.4f}", ex_s=f"{scalars['examples_per_second']:.1f}")
        window, window_start = [], time.perf_counter()
      bar.update(1)
      if evaluator and config.eval_every and done % config.eval_every == 0 and done < config.num_train_steps:
        scores = evaluator(state.params)
        writer.write(done, {f"eval/{k}": v for k, v in scores.items()})
        bar.write(periodic.metrics_line(f"step {done}, eval ({evaluator.describe()})", scores))
      if stop.requested():
        break
  finally:
    stop.restore()
    negatives.close(wait=stop.signum is None)
    bar.close()  # also on an error, whose line then starts a line of its own
  if mngr.latest_step() != int(state.step):
    checkpoint.save(mngr, int(state.step), state, _data_position(batches, int(state.step)), force=True)
  checkpoint.wait(mngr)
  if stop.signum is not None:
    writer.close()
    raise preemption.Stopped(stop.signum, int(state.step), workdir)

  finished_before = start >= config.num_train_steps and writer.recorded(start, "eval/")
  if finished_before:  # a re-run of a finished workdir: its final evaluation is on record, not written twice
    results["after"] = finished_before
    periodic.print_metrics(f"{workdir} already finished at step {start}; its final evaluation, on record",
                           finished_before)
  elif evaluator:
    results["after"] = evaluator(state.params, final=True)
    writer.write(int(state.step), {f"eval/{k}": v for k, v in results["after"].items()})
    if "before" in results:
      periodic.print_metrics(f"before training, eval ({evaluator.describe()})", results["before"])
    periodic.print_metrics(f"after {int(state.step)} steps, eval ({evaluator.describe(final=True)})",
                             results["after"])
  writer.close()
  results["state"] = state
  return results


def initial_params(model: TwoTower, built: build_lib.Built, config: ml_collections.ConfigDict,
                   rng: jax.Array, shardings: Any) -> Any:
  """init_from's weights (a jdr model, or a pretrained encoder in every tower), else fresh ones."""
  init = jax.jit(lambda r: nn.unbox(model.init(r, *step_lib.dummy_inputs(config))["params"]),
                 **({"out_shardings": shardings} if shardings is not None else {}))
  if built.params is not None:
    params = built.params
    if getattr(model, "mlm_head", False):  # a trained model's towers under a fresh masked-LM head
      params = {**params, "lm_head": jax.device_get(init(rng))["lm_head"]}
  else:
    params = init(rng)
    if built.tower_params is None:
      return params
    # The fresh values stay on the devices; only those the towers lack (adapters, a new head) are kept.
    params = build_lib.with_tower_params(params, built.tower_params)
  abstract = jax.eval_shape(init, rng)
  expected = jax.tree.map(lambda s: s.shape, abstract)
  got = jax.tree.map(lambda x: x.shape, params)
  if jax.tree.structure(expected) != jax.tree.structure(got) or expected != got:
    raise ValueError(f"{config.model.init_from}: its weights do not fit the configured towers "
                     f"(expected {expected}, got {got})")
  # Stored as the towers store them: a jdr model trained in float32 restarts as a bfloat16 base under LoRA.
  params = jax.tree.map(lambda x, a: x if x.dtype == a.dtype else x.astype(a.dtype), params, abstract)
  return jax.device_put(params, shardings)


def pair_batches(config: ml_collections.ConfigDict, data: pairs.RetrievalData, negatives: sources.Negatives,
                 tokenizer, prompts: dict | None, entry: mixture.Entry | None = None) -> pairs.Batches:
  """The supervised batches `config` asks for, of `data` with `negatives`' sampler; with a mixture's `entry`
  (`config` is its own), in that dataset's query prompt and the mixture's shape."""
  neg, padding_per_query = config.negatives, 0
  if entry is not None:
    prompts, padding_per_query = entry.prompts(prompts), entry.padding_per_query
  return pairs.Batches(
      data, tokenizer, batch_size=config.batch_size,
      query_max_length=config.data.query_max_length, doc_max_length=config.data.doc_max_length,
      negative_source=negatives.sampler, negatives_per_query=neg.per_query, in_batch=neg.in_batch, seed=config.seed,
      process_index=jax.process_index(), process_count=jax.process_count(),
      candidates=negatives.candidates, pair_weighting=neg.pair_weighting, random_weight=neg.random_weight,
      triples_per_query=negatives.triples_per_query, prompts=prompts, mask_duplicate_texts=neg.mask_duplicate_texts,
      padding_per_query=padding_per_query)


def _data_position(batches: pairs.Batches | mixture.Mixture, step: int) -> dict:
  """Where the data stream stands after `step` steps (informational: batches are a function of step)."""
  consumed = step * batches.batch_size
  return {"step": step, "examples_consumed": consumed,
          "epoch": consumed // batches.examples_per_epoch,
          "position_in_epoch": consumed % batches.examples_per_epoch, "seed": batches.seed}
