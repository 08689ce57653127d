"""Pretraining throughput with and without gradient caching, against sentence-transformers' GradCache.

  python -m jdr.bench pretrain [--budget-mib 2048] [--chunk-size 32] [--steps 6] [--batch-size 0]

The model and data are those of configs/pretrain_ict_bfs_wlp.py:runlocal: a 4-layer, 256-wide BERT from
random weights with the MiniLM vocabulary, [CLS] pooling, Dense(512) + LayerNorm, one shared tower; ICT + BFS
+ WLP pairs from the shared Wikispeedia articles (the built-in stdlib articles when they are absent), query 32
and document 128 tokens; in-batch sampled softmax on raw dot products, dropout 0.1, Adam 1e-4, gradient
clipping at 1.0.

1. The batch B is the largest whose un-cached step fits `--budget-mib` of XLA's compiled memory on this
   backend (`jdr.training.gradcache.largest_batch`; `--batch-size` sets it instead). The largest batch the cached step
   reaches within the same budget is reported too.
2. jdr trains B pairs a step through `jdr.step_lib.make_train_step`, without caching and with
   grad_cache.chunk_size = `--chunk-size`.
3. The reference is the same objective in sentence-transformers on the same weights (jdr's initialization,
   exported to Hugging Face) and the very same token ids: Transformer + Pooling(cls) + Dense(512, identity)
   + LayerNorm modules, MultipleNegativesRankingLoss (no caching) and CachedMultipleNegativesRankingLoss
   (mini_batch_size = `--chunk-size`) with scale 1 and dot-product similarity, torch AdamW.

Pairs/s are B over the median step time of `--steps` steps after one warm-up (compilation) step, every
system's steps timed in three turns so all see the same minutes of the host (`jdr.bench.turns`). The last
line is JSON; its `ratio` is jdr cached over sentence-transformers cached (goal >= 1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import jax
import ml_collections
import numpy as np

from jdr.runtime import defaults
from jdr.training import step as step_lib
from jdr.bench import peak as peak_lib
from jdr.bench import turns


def _config(batch_size: int, chunk_size: int) -> ml_collections.ConfigDict:
  from jdr.data import shared  # pylint: disable=g-import-not-at-top
  c = defaults.get_config()
  c.data.kind, c.data.pretrain_task = "pretrain", "mixed"
  c.data.pretrain_source = "wikispeedia" if shared.shared_dataset("wikispeedia") else "builtin"
  c.data.dataset = ""
  c.data.query_max_length, c.data.doc_max_length = 32, 128
  c.model.init_from, c.model.fresh = "", "small"
  c.model.pooling, c.model.normalize, c.model.projection_dim, c.model.shared = "cls", 0, 512, True
  c.optimizer.learning_rate, c.optimizer.warmup_steps, c.optimizer.weight_decay = 1e-4, 0, 0.0
  c.batch_size, c.num_train_steps = batch_size, 10_000
  c.grad_cache.chunk_size = chunk_size
  return c


def largest_batches(model, budget_bytes: int, chunk_size: int, max_batch: int) -> dict:
  from jdr.training import gradcache  # pylint: disable=g-import-not-at-top
  out = {}
  for name, chunk in (("uncached", None), ("cached", chunk_size)):
    best, stats = gradcache.largest_batch(model, budget_bytes, query_len=32, doc_len=128, chunk_size=chunk,
                                          max_batch=max_batch)
    out[name] = {"batch": best, "mib": round(stats["total"] / 2**20, 1) if stats else None}
    print(f"largest batch {name} within {budget_bytes / 2**20:.0f} MiB: {best}", file=sys.stderr, flush=True)
  return out


def jdr_runner(built, config, batches, devices: int = 1):
  """A function that runs jdr's step on batches[s] and returns when it is done: on one device, or
  data-parallel over `devices` CPU devices (the trainer's mesh.cpu_devices)."""
  from jdr.training import trainer  # pylint: disable=g-import-not-at-top
  from jdr.training import optimizers
  from jdr.bench import train_step  # pylint: disable=g-import-not-at-top
  tx = optimizers.make_optimizer(config.optimizer, config.num_train_steps)
  params = trainer.initial_params(built.model, built, config, jax.random.PRNGKey(config.seed), None)
  state = step_lib.TrainState(step=jax.numpy.int32(0), params=params, opt_state=tx.init(params),
                              rng=jax.random.PRNGKey(1))
  step_fn, state, first = train_step.compiled_on_devices(step_lib.make_train_step(built.model, tx, config), state,
                                                         batches[0], devices)
  placed = [first] + ([jax.device_put(b, {k: v.sharding for k, v in first.items()}) for b in batches[1:]]
                      if devices > 1 else list(batches[1:]))
  holder = {"s": state}

  def run_step(s):
    holder["s"], metrics = step_fn(holder["s"], placed[s])
    jax.block_until_ready(metrics["loss"])

  return run_step


def sentence_transformers_runner(hf_dir: str, params, batches, chunk_size: int | None):
  """A function that runs sentence-transformers' step on batches[s]: MNRL, or CachedMNRL with `chunk_size`."""
  import torch  # pylint: disable=g-import-not-at-top
  from sentence_transformers import SentenceTransformer  # pylint: disable=g-import-not-at-top
  from sentence_transformers.sentence_transformer import losses  # pylint: disable=g-import-not-at-top
  from sentence_transformers.sentence_transformer import modules  # pylint: disable=g-import-not-at-top
  from sentence_transformers.util import dot_score  # pylint: disable=g-import-not-at-top
  torch.manual_seed(0)
  transformer = modules.Transformer(hf_dir, max_seq_length=128)
  dense = modules.Dense(256, 512, activation_function=torch.nn.Identity())
  norm = modules.LayerNorm(512)
  head = jax.tree.map(np.asarray, params["tower"])
  with torch.no_grad():  # jdr's head initialization, so both sides train the same network
    dense.linear.weight.copy_(torch.from_numpy(head["projection"]["kernel"].T.copy()))
    dense.linear.bias.copy_(torch.from_numpy(head["projection"]["bias"].copy()))
    norm.norm.weight.copy_(torch.from_numpy(head["projection_norm"]["scale"].copy()))
    norm.norm.bias.copy_(torch.from_numpy(head["projection_norm"]["bias"].copy()))
    norm.norm.eps = 1e-12
  device = peak_lib.torch_device()  # where jdr runs: the GPU on a GPU host
  model = SentenceTransformer(modules=[transformer, modules.Pooling(256, pooling_mode="cls"), dense, norm],
                              device=device)
  model.train()
  if chunk_size:
    loss_fn = losses.CachedMultipleNegativesRankingLoss(model, scale=1.0, similarity_fct=dot_score,
                                                        mini_batch_size=chunk_size)
  else:
    loss_fn = losses.MultipleNegativesRankingLoss(model, scale=1.0, similarity_fct=dot_score)
  optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)

  def features(batch, side):
    ids = torch.from_numpy(np.asarray(batch[f"{side}_ids"], np.int64)).to(device)
    mask = torch.from_numpy(np.asarray(batch[f"{side}_mask"], np.int64)).to(device)
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}

  def run_step(s):
    optimizer.zero_grad(set_to_none=True)
    b = batches[s]
    loss = loss_fn([features(b, "query"), features(b, "doc")], None)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    peak_lib.torch_sync(device)

  return run_step


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m jdr.bench pretrain", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--budget-mib", type=float, default=2048.0,
                      help="compiled-memory budget that sets the batch (XLA's memory analysis)")
  parser.add_argument("--chunk-size", type=int, default=32, help="rows encoded at once when caching")
  parser.add_argument("--steps", type=int, default=6,
                      help="timed steps per system, after one warm-up, in three turns (jdr.bench.turns)")
  parser.add_argument("--batch-size", type=int, default=0, help="0 = the largest un-cached batch in budget")
  parser.add_argument("--max-batch", type=int, default=1 << 16, help="search cap for the cached batch")
  parser.add_argument("--cpu-devices", type=int, default=None,
                      help="on a CPU host, also time jdr's steps data-parallel over this many XLA CPU devices (the "
                           "trainer's mesh.cpu_devices; default: one per core, at most 8, dividing the batch and "
                           "its chunks); 1: one device only")
  args = parser.parse_args(argv)
  from jdr.runtime import parallel  # pylint: disable=g-import-not-at-top
  if args.cpu_devices is None:
    args.cpu_devices = min(parallel.usable_cores(), parallel.MAX_AUTO_CPU_DEVICES)
  parallel.use_cpu_devices(args.cpu_devices if args.cpu_devices > 1 else 0)
  if jax.default_backend() != "cpu":
    args.cpu_devices = 1  # an accelerator host: the steps run on the accelerator, as the trainer's would
  import torch  # pylint: disable=g-import-not-at-top
  torch.set_num_threads(os.cpu_count() or 1)
  from jdr.data import pretrain_batches  # pylint: disable=g-import-not-at-top
  from jdr.models import build as build_lib  # pylint: disable=g-import-not-at-top
  from jdr.models import hf  # pylint: disable=g-import-not-at-top
  from jdr.training import trainer  # pylint: disable=g-import-not-at-top

  config = _config(args.batch_size or 8, args.chunk_size)
  built = build_lib.build(config.model, config.data)
  budget = int(args.budget_mib * 2**20)
  largest = largest_batches(built.model, budget, args.chunk_size, args.max_batch)
  batch_size = args.batch_size or largest["uncached"]["batch"]
  if batch_size % args.chunk_size:
    batch_size = batch_size // args.chunk_size * args.chunk_size  # whole chunks on both sides
  if not batch_size:
    raise SystemExit(f"error: no batch fits {args.budget_mib} MiB without caching; raise --budget-mib")
  config = _config(batch_size, 0)
  maker, _ = pretrain_batches.make(config, built.tokenizer)
  batches = [maker.local(s) for s in range(args.steps + 1)]
  params = jax.device_get(trainer.initial_params(built.model, built, config, jax.random.PRNGKey(config.seed), None))

  result = {"benchmark": "pretrain", "host_cpu": peak_lib.cpu_line(), "units": "pairs/s", "batch_size": batch_size,
            "chunk_size": args.chunk_size, "budget_mib": args.budget_mib, "largest_batch": largest,
            "device": jax.devices()[0].device_kind, "source": config.data.pretrain_source}
  cached = _config(batch_size, args.chunk_size)
  # Devices must split the batch and each cached chunk: the most that do, up to --cpu-devices.
  devices = parallel.devices_that_split(args.cpu_devices, batch_size, args.chunk_size)
  runners = {"jdr_uncached": jdr_runner(built, config, batches), "jdr_cached": jdr_runner(built, cached, batches)}
  if devices > 1:
    runners["jdr_uncached_split"] = jdr_runner(built, config, batches, devices)
    runners["jdr_cached_split"] = jdr_runner(built, cached, batches, devices)
  with tempfile.TemporaryDirectory() as hf_dir:
    hf.export_hf(built.model.query.encoder, params["tower"]["encoder"], hf_dir, tokenizer=built.tokenizer)
    runners["st_uncached"] = sentence_transformers_runner(hf_dir, params, batches, None)
    runners["st_cached"] = sentence_transformers_runner(hf_dir, params, batches, args.chunk_size)
    seconds = turns.median_seconds(runners, args.steps)
  if devices > 1:
    result["cpu_devices"] = devices
    for name in ("uncached", "cached"):  # jdr's figure is the faster setting, each named
      s = seconds.pop(f"jdr_{name}_split")
      result[f"jdr_{name}_one_device"] = round(batch_size / seconds[f"jdr_{name}"], 2)
      result[f"jdr_{name}_cpu_devices"] = round(batch_size / s, 2)
      print(f"jdr_{name} on {devices} CPU devices: {s:.2f} s/step, one device {seconds[f'jdr_{name}']:.2f} s/step",
            file=sys.stderr)
      result[f"jdr_{name}_setting"] = (f"{devices} CPU devices (mesh.cpu_devices={devices})"
                                       if s < seconds[f"jdr_{name}"] else "one device")
      seconds[f"jdr_{name}"] = min(s, seconds[f"jdr_{name}"])
  for name, s in seconds.items():
    result[name] = round(batch_size / s, 2)
    print(f"{name:13s} {s:8.2f} s/step  {batch_size / s:8.2f} pairs/s", file=sys.stderr)
  result["ratio_uncached"] = round(seconds["st_uncached"] / seconds["jdr_uncached"], 3)
  result["ratio"] = round(seconds["st_cached"] / seconds["jdr_cached"], 3)
  print(json.dumps(result))


if __name__ == "__main__":
  main()
