"""Training step time: jdr's jitted step vs an equivalent PyTorch step, same model, same shapes, one process.

  python -m jdr.bench train-step [--batch-size 32] [--query-length 32] [--doc-length 128] [--steps 10]
                                 [--cpu-devices N] [--pooling mean|cls] [--model minilm|llama-lora]
                                 [--shape small|tiny]

Both sides train the bundled all-MiniLM-L6-v2 as one shared tower (mean pooling, L2-normalized) on a batch of
B queries and B positive documents with in-batch softmax NLL, dropout on, AdamW (lr 2e-5, weight decay 0.01,
gradient clipping at 1.0). The PyTorch step is transformers' BertModel + torch.optim.AdamW. Inputs are
random token ids at full length (no padding), so both compute exactly the same work; FLOP/s count forward
plus backward as 3x the forward FLOPs and are given as a fraction of the float32 matmul peak measured in
the same run. jdr's step is split into parts: towers (forward + backward: the step without dropout, less
the next two), dropout masks (the step with dropout less the step without), loss (in-batch softmax NLL and
its gradient on [B, 384] vectors) and update (AdamW with clipping on the parameters), each jitted and timed
alone. jdr's step is also timed data-parallel over --cpu-devices XLA CPU devices (default one per core: the
trainer's mesh.cpu_devices, parameters replicated, the batch split); "jdr" is the faster of the two, named in
"jdr_setting", and both are printed. The PyTorch step uses all cores through its own intra-op threads. jdr's
steps and PyTorch's are timed in turns of several steps each, so both see the same minutes of the host.
--pooling cls pools both sides' [CLS] vectors instead (the pooling of the seed papers' towers): PyTorch still
computes every position of the last layer, jdr its first only, and the FLOP fractions count the work [CLS]
pooling needs (`peak.encoder_flops`).

--model llama-lora: a random Llama decoder (--shape small: 4 layers x 256 hidden, 8 heads, 4 KV heads, 688
intermediate; tiny: model.fresh=llama-tiny, 2 x 64) over the MiniLM tokenizer's vocabulary, trained through LoRA
adapters only (r 8, alpha 16, dropout 0.1 on all seven projections; the base frozen: make_optimizer(lora=True)),
last-token pooling, L2-normalized, softmax NLL at temperature 0.01 over the in-batch documents plus one hard
negative per query (B queries against 2B documents), no other dropout (transformers' Llama has none). The
reference is transformers' LlamaModel of the same config under peft.get_peft_model(LoraConfig(...,
task_type=FEATURE_EXTRACTION)) with torch.optim.AdamW on the trainable params only (lr 2e-5, weight decay
0.01, clipping at 1.0). No step parts or FLOP fractions are given for this model.
"""

import argparse
import json
import sys

import jax
import ml_collections
import numpy as np

from jdr.runtime import defaults
from jdr.training import step as step_lib
from jdr.bench import peak as peak_lib
from jdr.bench import turns
from jdr.models import hf


# --model llama-lora's --shape: model.fresh shapes of jdr.models.build (llama-small sits between llama-tiny and a
# real decoder, so the CPU time is not all overhead).
LORA_SHAPES = {"small": "llama-small", "tiny": "llama-tiny"}
LORA = dict(rank=8, alpha=16.0, dropout=0.1,
            targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
LORA_TEMPERATURE = 0.01


def is_lora(args) -> bool:
  return getattr(args, "model", "minilm") == "llama-lora"


def bench_config(args) -> ml_collections.ConfigDict:
  c = defaults.get_config()
  if is_lora(args):
    c.model.init_from = ""
    c.model.fresh = LORA_SHAPES[args.shape]
    c.model.pooling, c.model.normalize = "last", 1
    c.model.dropout = 0.0
    c.model.lora_rank, c.model.lora_alpha, c.model.lora_dropout = LORA["rank"], LORA["alpha"], LORA["dropout"]
    c.model.lora_targets = ",".join(LORA["targets"])
    c.loss.temperature = LORA_TEMPERATURE
  else:
    c.model.init_from = "minilm"
    c.model.pooling = getattr(args, "pooling", "mean")
  c.data.query_max_length, c.data.doc_max_length = args.query_length, args.doc_length
  c.batch_size = args.batch_size
  c.optimizer.learning_rate, c.optimizer.warmup_steps = 2e-5, 0
  c.num_train_steps = 10_000
  c.model.encode_chunk_rows = getattr(args, "encode_chunk_rows", 0)
  return c


def _time_steps(run_step, steps: int) -> float:
  return turns.median_seconds({"step": run_step}, steps, turns=1)["step"]


def compiled_on_devices(step, state, batch: dict, devices: int):
  """(step_fn, state, batch) for `step` jitted on one device, or for `devices` > 1 data-parallel over that
  many: a (devices, 1, 1) mesh, parameters replicated, each batch array's rows split (the trainer's
  mesh.rules=dp with mesh.cpu_devices on a CPU host); state and batch are put where the step reads them."""
  from jdr.runtime import parallel  # pylint: disable=g-import-not-at-top
  if devices == 1:
    return step_lib.jit(step, donate_argnums=(0,)), state, batch
  mesh = parallel.make_mesh((devices, 1, 1), jax.devices()[:devices])
  rows, whole = parallel.batch_sharding(mesh), parallel.replicated(mesh)
  batch_shardings = {k: whole if k == "valid" else rows for k in batch}
  state = jax.device_put(state, whole)
  batch = {k: jax.device_put(v, batch_shardings[k]) for k, v in batch.items()}
  with parallel.activations_on(mesh):
    step_fn = step_lib.jit(step, donate_argnums=(0,), in_shardings=(whole, batch_shardings),
                           out_shardings=(whole, whole)).lower(state, batch).compile()
  return step_fn, state, batch


def jdr_step_runner(args, batch, dropout: float | None = None, devices: int = 1):
  """A function that runs one of jdr's jitted steps and returns when it is done; `dropout` overrides the
  model's rates (0.0: the step without masks);
  `devices` > 1 splits the batch over that many devices (a (devices, 1, 1) mesh, parameters replicated: the
  trainer's mesh.rules=dp), as the trainer does with mesh.cpu_devices on a CPU host."""
  from jdr.training import trainer  # pylint: disable=g-import-not-at-top
  from jdr.training import optimizers
  from jdr.models import build as build_lib  # pylint: disable=g-import-not-at-top
  config = bench_config(args)
  if dropout is not None:
    config.model.dropout = dropout
  built = build_lib.build(config.model, config.data)
  tx = optimizers.make_optimizer(config.optimizer, config.num_train_steps, lora=optimizers.uses_lora(config.model))
  params = trainer.initial_params(built.model, built, config, jax.random.PRNGKey(0), None)
  state = step_lib.TrainState(step=jax.numpy.int32(0), params=params, opt_state=tx.init(params),
                           rng=jax.random.PRNGKey(1))
  step_fn, state, batch = compiled_on_devices(step_lib.make_train_step(built.model, tx, config), state, batch,
                                              devices)
  holder = {"state": state}

  def run_step(_=0):
    holder["state"], metrics = step_fn(holder["state"], batch)
    jax.block_until_ready(metrics["loss"])

  return run_step


def jdr_part_seconds(args, batch) -> dict[str, float]:
  """The optimizer update and the loss alone, jitted like the step: with the step with and without dropout,
  the step splits into towers (forward + backward), dropout masks, loss and update."""
  import optax  # pylint: disable=g-import-not-at-top
  from jdr.training import trainer  # pylint: disable=g-import-not-at-top
  from jdr.training import losses
  from jdr.training import optimizers
  from jdr.models import build as build_lib  # pylint: disable=g-import-not-at-top
  config = bench_config(args)
  built = build_lib.build(config.model, config.data)
  tx = optimizers.make_optimizer(config.optimizer, config.num_train_steps)
  params = trainer.initial_params(built.model, built, config, jax.random.PRNGKey(0), None)
  grads = jax.tree_util.tree_map(lambda p: jax.numpy.full_like(p, 1e-3), params)
  holder = {"params": params, "opt": tx.init(params)}

  @jax.jit
  def update(params, opt_state, grads):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  def run_update(_=0):
    holder["params"], holder["opt"] = update(holder["params"], holder["opt"], grads)
    jax.block_until_ready(holder["params"])

  b = args.batch_size
  rng = np.random.default_rng(1)
  q, d = (rng.standard_normal((b, 384)).astype(np.float32) for _ in range(2))
  valid = np.asarray(batch["valid"])

  @jax.jit
  def loss_and_grads(q, d):
    def loss(q, d):
      return jax.numpy.mean(losses.softmax_nll(q @ d.T, valid, temperature=config.loss.temperature))
    return jax.value_and_grad(loss, argnums=(0, 1))(q, d)

  def run_loss(_=0):
    jax.block_until_ready(loss_and_grads(q, d))

  return {"update": _time_steps(run_update, args.steps), "loss": _time_steps(run_loss, args.steps)}


def torch_step_runner(args, batch):
  """A function that runs one step of the PyTorch reference (transformers' BertModel + torch AdamW)."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  # The reference runs where jdr runs (the GPU on a GPU host).
  device = peak_lib.torch_device()
  model = transformers.BertModel.from_pretrained(str(hf.minilm_path()), add_pooling_layer=False).to(device)
  model.train()
  decay = [p for n, p in model.named_parameters() if p.ndim > 1]
  no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1]
  optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=2e-5)
  t = {k: torch.from_numpy(np.asarray(v)).long().to(device) for k, v in batch.items() if k != "valid"}

  def embed(ids, mask):
    hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
    m = mask.unsqueeze(-1).float()
    if getattr(args, "pooling", "mean") == "cls":
      pooled = hidden[:, 0]
    else:
      pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, dim=-1)

  def run_step(_=0):
    optimizer.zero_grad(set_to_none=True)
    q = embed(t["query_ids"], t["query_mask"])
    d = embed(t["doc_ids"], t["doc_mask"])
    loss = torch.nn.functional.cross_entropy(q @ d.T, torch.arange(q.shape[0], device=device))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    peak_lib.torch_sync(device)

  return run_step


def lora_encoder_config(args):
  """The jdr decoder config the llama-lora case trains (the reference builds transformers' LlamaConfig from it)."""
  from jdr.models import build as build_lib  # pylint: disable=g-import-not-at-top
  config = bench_config(args)
  return build_lib.build(config.model, config.data).model.query.encoder


def torch_lora_step_runner(args, batch):
  """One step of transformers' LlamaModel under PEFT LoRA, the same shape, pooling, loss and optimizer as jdr's step."""
  import peft  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  device = peak_lib.torch_device()
  enc = lora_encoder_config(args)
  torch.manual_seed(0)
  hf_config = {k: v for k, v in enc.replace(lora_rank=0).to_hf().items() if k != "architectures"}
  base = transformers.LlamaModel(transformers.LlamaConfig(**{**hf_config, "use_cache": False}))
  model = peft.get_peft_model(base, peft.LoraConfig(
      r=LORA["rank"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"], target_modules=list(LORA["targets"]),
      task_type=peft.TaskType.FEATURE_EXTRACTION)).to(device)
  model.train()
  trainable = [p for p in model.parameters() if p.requires_grad]
  optimizer = torch.optim.AdamW(trainable, lr=2e-5, weight_decay=0.01)
  t = {k: torch.from_numpy(np.asarray(v)).long().to(device) for k, v in batch.items() if k != "valid"}

  def embed(ids, mask):
    hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
    last = mask.sum(1) - 1  # right padding: each row's last real token
    pooled = hidden[torch.arange(hidden.shape[0], device=device), last]
    return torch.nn.functional.normalize(pooled, dim=-1)

  def run_step(_=0):
    optimizer.zero_grad(set_to_none=True)
    q = embed(t["query_ids"], t["query_mask"])
    d = embed(t["doc_ids"], t["doc_mask"])  # B positives, then B hard negatives
    loss = torch.nn.functional.cross_entropy(q @ d.T / LORA_TEMPERATURE, torch.arange(q.shape[0], device=device))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(trainable, 1.0)
    optimizer.step()
    peak_lib.torch_sync(device)

  return run_step


def timed_steps(args, batch, reference) -> tuple[float, float | None, float]:
  """(jdr's step on one device, on --cpu-devices devices or None, the reference's step), median seconds, the
  three timed in turns (`jdr.bench.turns`)."""
  runners = {"one": jdr_step_runner(args, batch)}
  if args.cpu_devices > 1:
    runners["split"] = jdr_step_runner(args, batch, devices=args.cpu_devices)
  runners["reference"] = reference(args, batch)
  seconds = turns.median_seconds(runners, args.steps)
  return seconds["one"], seconds.get("split"), seconds["reference"]


def lora_main(args, batch) -> None:
  b = args.batch_size
  enc = lora_encoder_config(args)
  one_device_s, split_s, torch_s = timed_steps(args, batch, torch_lora_step_runner)
  jdr_s = min(one_device_s, split_s or one_device_s)
  result = {
      "benchmark": "train-step", "host_cpu": peak_lib.cpu_line(), "model": "llama-lora", "shape": args.shape,
      "units": "seconds/step (ratio = reference / jdr)",
      "jdr": round(jdr_s, 4), "reference": round(torch_s, 4), "ratio": round(torch_s / jdr_s, 3),
      "jdr_ms": round(jdr_s * 1e3, 1), "reference_ms": round(torch_s * 1e3, 1),
      "jdr_over_reference": round(jdr_s / torch_s, 3),
      "reference_name": "transformers LlamaModel + peft LoRA + torch AdamW",
      "reference_device": peak_lib.torch_device(),
      "decoder": {"layers": enc.num_layers, "hidden": enc.hidden_size, "heads": enc.num_heads,
                  "kv_heads": enc.num_kv_heads, "intermediate": enc.intermediate_size, "vocab": enc.vocab_size},
      "lora": {k: list(v) if isinstance(v, tuple) else v for k, v in LORA.items()},
      "temperature": LORA_TEMPERATURE, "hard_negatives_per_query": 1,
      "batch_size": b, "query_length": args.query_length, "doc_length": args.doc_length, "steps": args.steps,
      "jdr_one_device": round(one_device_s, 4), "cpu_devices": args.cpu_devices,
      "jdr_cpu_devices": round(split_s, 4) if split_s else None,
      "jdr_setting": (f"{args.cpu_devices} CPU devices (mesh.cpu_devices={args.cpu_devices})"
                      if jdr_s == split_s else "1 device"),
  }
  split = f"; on {args.cpu_devices} CPU devices {split_s * 1e3:.1f} ms" if split_s else ""
  print(f"jdr, 1 device: {one_device_s * 1e3:.1f} ms/step{split}", file=sys.stderr)
  print(f"llama-lora ({args.shape}): jdr {jdr_s * 1e3:.1f} ms/step ({result['jdr_setting']}), PyTorch + PEFT "
        f"{torch_s * 1e3:.1f} ms/step: ratio {result['ratio']:.2f} (jdr / torch {result['jdr_over_reference']:.2f})",
        file=sys.stderr)
  print(json.dumps(result))


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m jdr.bench train-step", description=__doc__.splitlines()[0])
  parser.add_argument("--batch-size", type=int, default=32)
  parser.add_argument("--query-length", type=int, default=32)
  parser.add_argument("--doc-length", type=int, default=128)
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--encode-chunk-rows", type=int, default=0,
                      help="model.encode_chunk_rows: the towers encode this many rows at a time (0: all)")
  parser.add_argument("--cpu-devices", type=int, default=None,
                      help="on a CPU host, also time jdr's step data-parallel over this many XLA CPU devices (the "
                           "trainer's mesh.cpu_devices; default: one per core, at most 8, dividing the batch); "
                           "1: one device only")
  parser.add_argument("--pooling", choices=("mean", "cls"), default="mean",
                      help="minilm's pooling on both sides (mean: the model's own)")
  parser.add_argument("--model", choices=("minilm", "llama-lora"), default="minilm",
                      help="minilm: all-MiniLM-L6-v2, every weight trained; llama-lora: a random Llama decoder "
                           "trained through LoRA adapters, against transformers + PEFT (see the module docstring)")
  parser.add_argument("--shape", choices=sorted(LORA_SHAPES), default="small",
                      help="--model llama-lora's decoder: small (4 layers x 256) or tiny (model.fresh=llama-tiny)")
  args = parser.parse_args(argv)
  from jdr.runtime import parallel  # pylint: disable=g-import-not-at-top
  if args.cpu_devices is None:
    cores = min(parallel.usable_cores(), parallel.MAX_AUTO_CPU_DEVICES)
    args.cpu_devices = parallel.devices_that_split(cores, args.batch_size)
  elif args.batch_size % args.cpu_devices:
    parser.error(f"--batch-size {args.batch_size} does not split over --cpu-devices {args.cpu_devices}")
  parallel.use_cpu_devices(args.cpu_devices if args.cpu_devices > 1 else 0)
  if jax.default_backend() != "cpu":
    args.cpu_devices = 1  # an accelerator host: the step runs on the accelerator, as the trainer's would

  rng = np.random.default_rng(0)
  b = args.batch_size
  batch = {
      "query_ids": rng.integers(1000, 30000, (b, args.query_length)).astype(np.int32),
      "query_mask": np.ones((b, args.query_length), np.int32),
      "doc_ids": rng.integers(1000, 30000, (b, args.doc_length)).astype(np.int32),
      "doc_mask": np.ones((b, args.doc_length), np.int32),
      "valid": np.ones((b, b), bool),
  }
  if is_lora(args):
    # One hard negative per query: the documents are the B positives, then B negatives; every query scores
    # all 2B (in-batch + hard negatives).
    batch["doc_ids"] = rng.integers(1000, 30000, (2 * b, args.doc_length)).astype(np.int32)
    batch["doc_mask"] = np.ones((2 * b, args.doc_length), np.int32)
    batch["valid"] = np.ones((b, 2 * b), bool)
    lora_main(args, batch)
    return
  peak = peak_lib.matmul_peak_flops()
  shape = dict(layers=6, hidden=384, intermediate=1536, first_position=args.pooling == "cls")
  flops = 3 * (peak_lib.encoder_flops([args.query_length] * b, **shape)
               + peak_lib.encoder_flops([args.doc_length] * b, **shape))
  one_device_s, split_s, torch_s = timed_steps(args, batch, torch_step_runner)
  jdr_s = min(one_device_s, split_s or one_device_s)
  no_dropout_s = _time_steps(jdr_step_runner(args, batch, dropout=0.0), args.steps)
  parts = jdr_part_seconds(args, batch)
  parts = {"towers": no_dropout_s - parts["update"] - parts["loss"], "dropout": one_device_s - no_dropout_s, **parts}
  result = {
      "benchmark": "train-step", "host_cpu": peak_lib.cpu_line(), "units": "seconds/step (ratio = reference / jdr)",
      "jdr": round(jdr_s, 4), "reference": round(torch_s, 4), "ratio": round(torch_s / jdr_s, 3),
      "reference_name": "transformers BertModel + torch AdamW", "reference_device": peak_lib.torch_device(),
      "batch_size": b, "query_length": args.query_length, "doc_length": args.doc_length,
      "pooling": args.pooling,
      "encode_chunk_rows": args.encode_chunk_rows,
      "peak_gflops": round(peak["peak"] / 1e9, 1),
      "jdr_peak_fraction": round(flops / jdr_s / peak["peak"], 3),
      "reference_peak_fraction": round(flops / torch_s / peak["peak"], 3),
      "jdr_parts_seconds": {k: round(v, 4) for k, v in parts.items()},
      "jdr_one_device": round(one_device_s, 4),
      "jdr_one_device_peak_fraction": round(flops / one_device_s / peak["peak"], 3),
      "cpu_devices": args.cpu_devices,
      "jdr_cpu_devices": round(split_s, 4) if split_s else None,
      "jdr_cpu_devices_peak_fraction": round(flops / split_s / peak["peak"], 3) if split_s else None,
      "jdr_setting": (f"{args.cpu_devices} CPU devices (mesh.cpu_devices={args.cpu_devices})"
                      if jdr_s == split_s else "1 device"),
  }
  split = (f"; on {args.cpu_devices} CPU devices {split_s:.3f} s ({result['jdr_cpu_devices_peak_fraction']:.0%})"
           if split_s else "")
  print(f"jdr, 1 device: {one_device_s:.3f} s/step ({result['jdr_one_device_peak_fraction']:.0%}; "
        + ", ".join(f"{k} {v:.3f}" for k, v in parts.items()) + f"){split}", file=sys.stderr)
  print(f"jdr {jdr_s:.3f} s/step ({result['jdr_setting']}), PyTorch "
        f"{torch_s:.3f} s/step: ratio {result['ratio']:.2f}; jdr at {result['jdr_peak_fraction']:.0%} of the "
        f"float32 matmul peak ({result['peak_gflops']:.0f} GFLOP/s), PyTorch at "
        f"{result['reference_peak_fraction']:.0%}", file=sys.stderr)
  print(json.dumps(result))


if __name__ == "__main__":
  main()
