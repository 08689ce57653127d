"""The whole accelerator picture in one command: peak, bandwidth, encoding, the train step, top-k, ADORE.

  python -m jdr.bench device [--size full|small] [--sections peak,encode,train,topk,adore] [--profile]

jdr and its PyTorch reference run on the same device in the same process: on a GPU host both on the GPU; on
a CPU host both on the CPU (on a TPU host the reference has no TPU and runs on the host CPU, which the output
says). `full` (the default on accelerators) is BERT-base-shaped with random weights built from a config (the
bundled MiniLM's tokenizer), bf16, SciFact's documents at up to 256 tokens, exact top-200 of 32 queries over
1M and 8,841,823 x 768 rows, and the ADORE step (BERT-base query tower, batch 32, top-200) over 1M and 8.84M
rows.
`small` (the default on CPUs) is a 2 x 64 model, float32, 100k rows, and finishes in a few minutes on 2 cores.

--profile also traces jdr's encoder forward (encode, flash) and train steps (train, flash) a few calls each,
after they are timed, and reports where their device time goes (`jdr.bench.kernel_profile`: kernel ms a call by
kind of work, and the largest HLO instructions with the jax operation each came from).

Sections run in the order --sections gives, each printed when it finishes (with its seconds in the last line),
all together as the last JSON line; a section that fails is reported as its error and the rest still run:
  peak    the matmul peak (bf16 on accelerators, float32 on CPUs) in jax and torch, and a device-to-device copy
          bandwidth (read + write bytes per second): the bound of a pass over a matrix is its bytes / that.
  encode  corpus encoding, jdr against sentence-transformers (batch 32, 128, 512; its best for the ratio),
          docs/s and the fraction of peak over real (unpadded) tokens; where jdr's time goes: the tokenizer
          alone, encoding from token ids, and the model alone on one full batch already on the device.
  train   the in-batch train step (AdamW, dropout on), jdr against transformers + torch (SDPA attention, fused
          AdamW and bf16 autocast on a GPU), ms and fraction of peak (3x the forward FLOPs of real tokens);
          jdr again with model.attention_dropout=0 (fused attention): what attention dropout costs.
  flash   (GPUs, not in the default list) jdr's Pallas attention (model.attention=flash): the encode
          section's one-batch forward with it and with the default (cuDNN's kernel), then the train section's
          step with it (attention dropout drawn inside), its speed-up over the default step and its ratio to
          the reference when the train section ran first in the same command. Whether the kernel computes
          what the einsum path does on the card is a test: `pytest tests/test_flash_attention.py -m gpu`.
  topk    exact top-200 of 32 queries: jdr.retrieval.topk (bf16 on accelerators, also int8) against torch.mm +
          torch.topk on the same matrix, with the bound and the two's agreement on the rows; whether jdr's
          rows are those of one lax.top_k over all the scores, and that plain search's time.
  adore   the ADORE recipe's step (configs/adore.py with in-step JAX retrieval) with and without its retrieval,
          at each size; share = (with - without) / with.
  int8-scifact  real vectors: SciFact encoded by MiniLM, top-200 of its test queries from float32, bfloat16
          and int8 storage: Recall@200 against float32 and nDCG@10 of each; and ADORE's loss over its training
          queries' top-200 from each storage, and the loss's gradient for the query vectors, against float32's.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from jdr.training import step as step_lib
from jdr.retrieval import topk
from jdr.bench import peak as peak_lib

SECTIONS = ("peak", "encode", "train", "topk", "adore", "int8-scifact", "flash")
# int8-scifact encodes all of SciFact with MiniLM: seconds on an accelerator, minutes on a CPU. flash is one
# more BERT-base train-step compile, asked for by name (the default list keeps the command's time).
DEFAULT_SECTIONS = {"full": SECTIONS[:-1], "small": SECTIONS[:-2]}
SIZES = {
    "full": dict(model="base", dtype="bfloat16", encode_docs=0, encode_length=256, reference_batches=(32, 128, 512),
                 train_batch=128, train_query_length=32, train_doc_length=256, topk_sizes=(1_000_000, 8_841_823),
                 topk_dim=768, adore_sizes=(1_000_000, 8_841_823), matmul_n=8192, copy_bytes=4 << 30, repeats=20),
    "small": dict(model="tiny", dtype="float32", encode_docs=400, encode_length=128, reference_batches=(32, 128),
                  train_batch=8, train_query_length=16, train_doc_length=64, topk_sizes=(100_000,),
                  topk_dim=768, adore_sizes=(100_000,), matmul_n=1024, copy_bytes=256 << 20, repeats=3),
}
MSMARCO_DOCS = 8_841_823


def median_seconds(run, repeats: int, warmup: int = 2) -> float:
  """Median wall seconds of `run()`, which must return only once its work is done on the device."""
  for _ in range(warmup):
    run()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    run()
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def _waiting(fn, *args):
  """One call of fn(*args) that returns once the device is done, for timing and profiling."""
  return lambda: jax.block_until_ready(fn(*args))


def kernels_if_profiling(size: dict, label: str, jitted, args: tuple, run) -> dict | None:
  """Where the device time of `jitted(*args)` goes (`jdr.bench.kernel_profile`) when --profile asked for it;
  `run()` makes one call and waits for it. The compiled text comes from the executable already built."""
  if not size.get("profile"):
    return None
  from jdr.bench import kernel_profile  # pylint: disable=g-import-not-at-top
  try:
    profile = kernel_profile.profile_calls(run, jitted.lower(*args).compile().as_text())
  except Exception as error:  # pylint: disable=broad-except  (e.g. no CUPTI: the section's timings still count)
    traceback.print_exc()
    profile = {"error": f"{type(error).__name__}: {error}"}
  print(kernel_profile.table(profile, f"kernels of {label}"), file=sys.stderr, flush=True)
  return profile


def _with_profile(row: dict, key: str, profile: dict | None) -> dict:
  if profile is not None:
    row[key] = profile
  return row


def _report(name: str, result: dict) -> dict:
  print(f"[{name}] " + json.dumps(result), file=sys.stderr, flush=True)
  return result


# ------------------------------------------------------------------------------------------------ peak


def section_peak(size: dict, torch_device: str) -> dict:
  import torch  # pylint: disable=g-import-not-at-top
  accelerator = jax.default_backend() != "cpu"
  n, repeats = size["matmul_n"], size["repeats"]
  jdt = jnp.bfloat16 if accelerator else jnp.float32
  a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jdt)
  mm = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32).astype(x.dtype))
  jax_s = median_seconds(lambda: mm(a, a).block_until_ready(), repeats)
  tdt = torch.bfloat16 if torch_device == "cuda" else torch.float32
  ta = torch.randn(n, n, dtype=tdt, device=torch_device)
  torch_s = median_seconds(lambda: (torch.mm(ta, ta), peak_lib.torch_sync(torch_device)), repeats)

  # bf16 on accelerators; float32 on CPUs, whose bf16 arithmetic converts every element and runs far below
  # memory speed.
  elements = size["copy_bytes"] // jnp.dtype(jdt).itemsize
  buf = jnp.zeros((elements,), jdt)
  copy = jax.jit(lambda x: x * jnp.asarray(2, x.dtype))  # reads and writes every byte once
  copy_s = median_seconds(lambda: copy(buf).block_until_ready(), repeats)
  tbuf = torch.zeros(elements, dtype=tdt, device=torch_device)
  tout = torch.empty_like(tbuf)
  tcopy_s = median_seconds(lambda: (tout.copy_(tbuf), peak_lib.torch_sync(torch_device)), repeats)
  del a, ta, buf, tbuf, tout
  return {"dtype": "bfloat16" if accelerator else "float32", "matmul_n": n,
          "jax_tflops": round(2 * n**3 / jax_s / 1e12, 4), "torch_tflops": round(2 * n**3 / torch_s / 1e12, 4),
          "peak_tflops": round(max(2 * n**3 / jax_s, 2 * n**3 / torch_s) / 1e12, 4),
          "copy_bytes": size["copy_bytes"], "jax_copy_gbps": round(2 * size["copy_bytes"] / copy_s / 1e9, 1),
          "torch_copy_gbps": round(2 * size["copy_bytes"] / tcopy_s / 1e9, 1),
          "bandwidth_gbps": round(max(2 * size["copy_bytes"] / copy_s, 2 * size["copy_bytes"] / tcopy_s) / 1e9, 1)}


# ------------------------------------------------------------------------------------------------ models


def random_hf_model(directory: str, model: str) -> dict:
  """Writes a BERT of jdr's `model.fresh` shape with random weights (seed 0) and MiniLM's tokenizer to a
  Hugging Face directory, so jdr and the reference load the very same weights; returns its shape."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  from jdr.models import build, hf  # pylint: disable=g-import-not-at-top
  shape = build.FRESH[model]
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(hf.minilm_path()))
  config = transformers.BertConfig(vocab_size=len(tokenizer), hidden_size=shape["hidden_size"],
                                   num_hidden_layers=shape["num_layers"], num_attention_heads=shape["num_heads"],
                                   intermediate_size=shape["intermediate_size"], max_position_embeddings=512)
  torch.manual_seed(0)
  transformers.BertModel(config, add_pooling_layer=False).save_pretrained(directory)
  tokenizer.save_pretrained(directory)
  return shape


def _flops(lengths, shape) -> float:
  return peak_lib.encoder_flops(lengths, layers=shape["num_layers"], hidden=shape["hidden_size"],
                                intermediate=shape["intermediate_size"])


def _scifact_texts(limit: int) -> list[str]:
  from jdr.data import formats, shared, text  # pylint: disable=g-import-not-at-top
  path = shared.shared_dataset("scifact")
  if path is None:
    raise SystemExit(f"jdr.bench device reads SciFact from {shared.shared_data_dir() / 'scifact'} "
                     "(set JDR_SHARED_DATA)")
  docs = list(formats.read_corpus(path / "corpus.jsonl").values())
  return [text.doc_text(d) for d in (docs[:limit] if limit else docs)]


def _full_batch(length: int, tokens_per_batch: int) -> tuple[int, jax.Array, jax.Array]:
  """(rows, ids, mask) of one full batch at `length` already on the device: the model's own rate, no padding."""
  rows = max(1, tokens_per_batch // length)
  return (rows, jax.device_put(np.full((rows, length), 1000, np.int32)),
          jax.device_put(np.ones((rows, length), np.int32)))


def section_encode(size: dict, torch_device: str, model_dir: str, shape: dict, peak_flops: float) -> dict:
  import torch  # pylint: disable=g-import-not-at-top
  from sentence_transformers import SentenceTransformer  # pylint: disable=g-import-not-at-top
  # Not sentence_transformers.models: deprecated since 6.2, and 6.0 already has this path.
  from sentence_transformers.sentence_transformer import modules  # pylint: disable=g-import-not-at-top
  from jdr.retrieval import encoder_runtime  # pylint: disable=g-import-not-at-top
  from jdr.bench import encode_speed  # pylint: disable=g-import-not-at-top
  from jdr.data import text as text_lib  # pylint: disable=g-import-not-at-top
  texts = _scifact_texts(size["encode_docs"])
  length = size["encode_length"]
  runtime = encoder_runtime.load_runtime(model_dir, pooling="mean", normalize=False, max_length=length,
                                    dtype=size["dtype"])
  start = time.perf_counter()
  token_ids = text_lib.tokenize(runtime.tokenizer, texts, length)
  tokenize_s = time.perf_counter() - start
  lengths = [len(t) for t in token_ids]
  flops = _flops(lengths, shape)
  tokens_per_batch = encoder_runtime.default_tokens_per_batch()
  # Padding bounds what packing several documents into a row could save: the share of the cells of the
  # batches encode_texts encodes below that hold no token.
  masks = encode_speed.streamed_masks(runtime, lengths, tokens_per_batch)
  padding = 1 - sum(int(m.sum()) for m in masks) / sum(m.size for m in masks)
  compile_s = encode_speed.warm_up(runtime, lengths, tokens_per_batch)
  start = time.perf_counter()
  jdr_emb = encoder_runtime.encode_texts(runtime, texts, tokens_per_batch=tokens_per_batch)
  jdr_s = time.perf_counter() - start
  # Where the time goes: the same encoding from token ids (no tokenizer), and the model alone on one full
  # batch of the longest length already on the device (no host work, no padding: the kernels' own rate).
  start = time.perf_counter()
  encoder_runtime.encode_tokens(runtime, token_ids, tokens_per_batch=tokens_per_batch)
  from_ids_s = time.perf_counter() - start
  rows, ids, mask = _full_batch(length, tokens_per_batch)
  forward = _waiting(runtime.apply_fn, runtime.params, ids, mask)
  forward_s = median_seconds(forward, size["repeats"])
  forward_kernels = kernels_if_profiling(size, "the encoder's forward", runtime.apply_fn,
                                         (runtime.params, ids, mask), forward)

  transformer = modules.Transformer(model_dir, max_seq_length=length)
  reference = SentenceTransformer(modules=[transformer, modules.Pooling(shape["hidden_size"], "mean")],
                                  device=torch_device)
  if size["dtype"] == "bfloat16":
    reference = reference.to(torch.bfloat16)
  rates = {}
  with torch.inference_mode():
    for batch in size["reference_batches"]:
      reference.encode(texts[:batch], batch_size=batch)
      peak_lib.torch_sync(torch_device)
      start = time.perf_counter()
      ref_emb = reference.encode(texts, batch_size=batch, convert_to_numpy=True)
      peak_lib.torch_sync(torch_device)
      rates[batch] = len(texts) / (time.perf_counter() - start)
  best = max(rates, key=rates.get)
  jdr_rate = len(texts) / jdr_s
  cos = np.sum(jdr_emb * ref_emb, 1) / (np.linalg.norm(jdr_emb, axis=1) * np.linalg.norm(ref_emb, axis=1))
  return {"docs": len(texts), "max_length": length, "real_tokens": int(sum(lengths)), "dtype": size["dtype"],
          "jdr_docs_per_s": round(jdr_rate, 1), "jdr_tokens_per_batch": tokens_per_batch,
          "jdr_padding_fraction": round(padding, 4),
          "jdr_compile_s": round(compile_s, 1),
          "jdr_peak_fraction": round(flops / jdr_s / peak_flops, 3),
          "jdr_s": round(jdr_s, 3), "tokenize_s": round(tokenize_s, 3), "from_ids_s": round(from_ids_s, 3),
          "from_ids_peak_fraction": round(flops / from_ids_s / peak_flops, 3),
          "forward_only": _with_profile(
              {"rows": rows, "length": length, "ms": round(1e3 * forward_s, 2),
               "peak_fraction": round(_flops([length] * rows, shape) / forward_s / peak_flops, 3)},
              "kernels", forward_kernels),
          "reference_docs_per_s": {str(b): round(r, 1) for b, r in rates.items()},
          "reference_best_batch": best,
          "reference_peak_fraction": round(flops * rates[best] / len(texts) / peak_flops, 3),
          "ratio": round(jdr_rate / rates[best], 3), "min_cosine_vs_reference": round(float(np.min(cos)), 4)}


# ------------------------------------------------------------------------------------------------ train step


def _train_config(size: dict, model_dir: str):
  from jdr.runtime import defaults  # pylint: disable=g-import-not-at-top
  c = defaults.get_config()
  c.model.init_from = model_dir
  c.model.pooling = "mean"
  c.model.normalize = False
  c.model.dtype = size["dtype"]
  c.data.query_max_length, c.data.doc_max_length = size["train_query_length"], size["train_doc_length"]
  c.batch_size = size["train_batch"]
  c.optimizer.learning_rate, c.optimizer.warmup_steps = 2e-5, 0
  c.num_train_steps = 10_000
  return c


def _token_batch(b: int, query_length: int, doc_length: int) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(0)
  return {"query_ids": rng.integers(1000, 30000, (b, query_length)).astype(np.int32),
          "query_mask": np.ones((b, query_length), np.int32),
          "doc_ids": rng.integers(1000, 30000, (b, doc_length)).astype(np.int32),
          "doc_mask": np.ones((b, doc_length), np.int32), "valid": np.ones((b, b), bool)}


def jdr_train_step_seconds(config, batch: dict, size: dict, label: str) -> tuple[float, dict | None]:
  """(median seconds of jdr's jitted train step, its kernel breakdown when --profile asked for it)."""
  from jdr.training import trainer  # pylint: disable=g-import-not-at-top
  from jdr.training import optimizers
  from jdr.models import build as build_lib  # pylint: disable=g-import-not-at-top
  built = build_lib.build(config.model, config.data)
  tx = optimizers.make_optimizer(config.optimizer, config.num_train_steps)
  params = trainer.initial_params(built.model, built, config, jax.random.PRNGKey(0), None)
  state = step_lib.TrainState(step=jnp.int32(0), params=params, opt_state=tx.init(params), rng=jax.random.PRNGKey(1))
  step_fn = step_lib.jit(step_lib.make_train_step(built.model, tx, config), donate_argnums=(0,))
  batch = jax.device_put(batch)
  holder = {"state": state}

  def run():
    holder["state"], metrics = step_fn(holder["state"], batch)
    jax.block_until_ready(metrics["loss"])

  seconds = median_seconds(run, size["repeats"])
  return seconds, kernels_if_profiling(size, label, step_fn, (holder["state"], batch), run)


def torch_train_step_seconds(model_dir: str, batch: dict, torch_device: str, bf16: bool, repeats: int) -> float:
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  model = transformers.BertModel.from_pretrained(model_dir, add_pooling_layer=False,
                                                 attn_implementation="sdpa").to(torch_device)
  model.train()
  decay = [p for p in model.parameters() if p.ndim > 1]
  no_decay = [p for p in model.parameters() if p.ndim <= 1]
  cuda = torch_device == "cuda"
  optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                                lr=2e-5, fused=cuda)
  t = {k: torch.from_numpy(np.asarray(v)).long().to(torch_device) for k, v in batch.items() if k != "valid"}
  labels = torch.arange(t["query_ids"].shape[0], device=torch_device)

  def embed(ids, mask):
    hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)

  def run():
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(device_type="cuda" if cuda else "cpu", dtype=torch.bfloat16, enabled=bf16 and cuda):
      q = embed(t["query_ids"], t["query_mask"])
      d = embed(t["doc_ids"], t["doc_mask"])
      loss = torch.nn.functional.cross_entropy((q @ d.T).float(), labels)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    peak_lib.torch_sync(torch_device)

  seconds = median_seconds(run, repeats)
  del model, optimizer
  return seconds


def section_train(size: dict, torch_device: str, model_dir: str, shape: dict, peak_flops: float) -> dict:
  b, lq, ld = size["train_batch"], size["train_query_length"], size["train_doc_length"]
  batch = _token_batch(b, lq, ld)
  flops = 3 * (_flops([lq] * b, shape) + _flops([ld] * b, shape))
  config = _train_config(size, model_dir)
  jdr_s, jdr_kernels = jdr_train_step_seconds(config, batch, size, "the train step")
  config.model.attention_dropout = 0.0
  jdr_no_attention_dropout_s, no_attention_dropout_kernels = jdr_train_step_seconds(
      config, batch, size, "the train step, attention dropout 0")
  gc.collect()
  torch_s = torch_train_step_seconds(model_dir, batch, torch_device, size["dtype"] == "bfloat16", size["repeats"])
  out = {"batch": b, "query_length": lq, "doc_length": ld, "dtype": size["dtype"],
         "jdr_ms": round(1e3 * jdr_s, 2), "jdr_peak_fraction": round(flops / jdr_s / peak_flops, 3),
         "jdr_attention_dropout_0_ms": round(1e3 * jdr_no_attention_dropout_s, 2),
         "jdr_attention_dropout_0_peak_fraction": round(flops / jdr_no_attention_dropout_s / peak_flops, 3),
         "reference_ms": round(1e3 * torch_s, 2), "reference_peak_fraction": round(flops / torch_s / peak_flops, 3),
         "ratio": round(torch_s / jdr_s, 3)}
  _with_profile(out, "jdr_kernels", jdr_kernels)
  return _with_profile(out, "jdr_attention_dropout_0_kernels", no_attention_dropout_kernels)


def section_flash(size: dict, model_dir: str, shape: dict, peak_flops: float, train: dict | None) -> dict:
  """The train section's step with model.attention=flash (jdr's Pallas kernel draws the attention dropout),
  against the train section's default step when it ran in this command."""
  if jax.default_backend() != "gpu":
    raise RuntimeError("the flash section times a Triton kernel: GPUs only (elsewhere it runs interpreted)")
  import dataclasses  # pylint: disable=g-import-not-at-top
  from jdr.retrieval import encoder_runtime  # pylint: disable=g-import-not-at-top
  from jdr.models import published  # pylint: disable=g-import-not-at-top
  from jdr.models import towers  # pylint: disable=g-import-not-at-top
  # Inference first (no dropout, where the default is cuDNN's kernel and the transposes jax puts around it):
  # the encode section's forward of one full batch, the tower with each attention.
  length = size["encode_length"]
  rows, ids, mask = _full_batch(length, encoder_runtime.default_tokens_per_batch())
  tower, params, _, _ = published.load_tower(model_dir, pooling="mean", normalize=False, max_length=length,
                                      dtype=size["dtype"])
  params = towers.serving_params(params, tower)  # as encoding holds them (load_runtime), so the two compare
  forward, forward_kernels = {}, {}
  for attention in ("auto", "flash"):
    cfg = dataclasses.replace(tower.config, encoder=tower.config.encoder.replace(attention=attention))
    apply = jax.jit(tower.clone(config=cfg).apply)
    run = _waiting(apply, {"params": params}, ids, mask)
    forward[attention] = median_seconds(run, size["repeats"])
    forward_kernels[attention] = kernels_if_profiling(size, f"the encoder's forward, attention={attention}",
                                                      apply, ({"params": params}, ids, mask), run)
  forward_flops = _flops([length] * rows, shape)
  b, lq, ld = size["train_batch"], size["train_query_length"], size["train_doc_length"]
  flops = 3 * (_flops([lq] * b, shape) + _flops([ld] * b, shape))
  config = _train_config(size, model_dir)
  config.model.attention = "flash"
  flash_s, flash_kernels = jdr_train_step_seconds(config, _token_batch(b, lq, ld), size,
                                                 "the train step, attention=flash")
  out = {"forward": {"rows": rows, "length": length,
                     **{f"{a}_ms": round(1e3 * t, 2) for a, t in forward.items()},
                     **{f"{a}_peak_fraction": round(forward_flops / t / peak_flops, 3) for a, t in forward.items()},
                     **{f"{a}_kernels": k for a, k in forward_kernels.items() if k is not None}},
         "jdr_flash_attention_ms": round(1e3 * flash_s, 2),
         "jdr_flash_attention_peak_fraction": round(flops / flash_s / peak_flops, 3)}
  _with_profile(out, "jdr_flash_attention_kernels", flash_kernels)
  if train and "jdr_ms" in train:
    out["speedup_over_default"] = round(train["jdr_ms"] / out["jdr_flash_attention_ms"], 3)
    if "reference_ms" in train:
      out["ratio"] = round(train["reference_ms"] / out["jdr_flash_attention_ms"], 3)
  return out


# ------------------------------------------------------------------------------------------------ top-k


def random_corpus_on_mesh(n: int, dim: int, mesh, dtype: str, seed: int) -> topk.ShardedCorpus:
  """A ShardedCorpus of n random rows (normal, scaled by dim^-1/2) generated on the devices, block by block,
  so neither the host nor the device ever holds a float32 copy of 8.8M x 768. The same seed gives the same
  float32 rows whatever the storage, so an int8 corpus is the quantization of the bfloat16 one's source."""
  block = topk.DEFAULT_BLOCK_ROWS
  padded = topk.padded_size(n, int(mesh.devices.size), block)
  rows_sharding, bias_sharding = topk.row_shardings(mesh)
  key = jax.random.PRNGKey(seed)

  def one_block(index):
    x = jax.random.normal(jax.random.fold_in(key, index), (block, dim), jnp.float32) * (dim ** -0.5)
    x = jnp.where((index * block + jnp.arange(block))[:, None] < n, x, 0.0)
    if dtype == "int8":
      return topk.quantize_int8(x)
    return x.astype(jnp.bfloat16 if dtype == "bfloat16" else jnp.float32)

  @jax.jit
  def make():
    out = jax.lax.map(one_block, jnp.arange(padded // block), batch_size=8192)
    return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a.reshape(padded, -1), rows_sharding), out)

  rows = make()
  if dtype == "int8":
    rows = topk.QuantizedRows(*rows)
  bias = jax.device_put(np.where(np.arange(padded) < n, 0.0, -np.inf).astype(np.float32), bias_sharding)
  return topk.ShardedCorpus(rows, bias, n, dtype, block)


def section_topk(size: dict, torch_device: str, bandwidth: float, mesh, k: int = 200, batch: int = 32) -> dict:
  dim = size["topk_dim"]
  dtype = topk.resolve_dtype("auto")
  queries = jax.random.normal(jax.random.PRNGKey(7), (batch, dim), jnp.float32)
  out = {"k": k, "queries": batch, "dim": dim, "dtype": dtype, "rows": []}
  for n in size["topk_sizes"]:
    row = {"size": n}
    try:
      _topk_row(row, n, dim, dtype, k, queries, size, torch_device, bandwidth, mesh)
    except Exception as error:  # pylint: disable=broad-except  (keep this size's figures so far, try the next)
      traceback.print_exc()
      row["error"] = f"{type(error).__name__}: {error}"
    gc.collect()
    out["rows"].append(_report(f"topk {n}", row))
  return out


def _topk_row(row: dict, n: int, dim: int, dtype: str, k: int, queries, size: dict, torch_device: str,
              bandwidth: float, mesh) -> None:
  """Fills `row` as each figure is measured, so a failure late in the row keeps the ones before it."""
  import torch  # pylint: disable=g-import-not-at-top
  corpus = random_corpus_on_mesh(n, dim, mesh, dtype, seed=n)
  search = topk.search_fn(corpus, k, mesh)
  row["jdr_ms"] = round(1e3 * median_seconds(lambda: jax.block_until_ready(search(queries)), size["repeats"]), 3)
  _, jdr_rows = search(queries)
  # Exactness at full size: the same rows as one lax.top_k over all the scores (the plain way, timed too).
  single = jax.jit(lambda q, rows, bias: jax.lax.top_k(topk.scores(q, rows) + bias[None, :], k)[1])
  row["single_top_k_ms"] = round(1e3 * median_seconds(
      lambda: jax.block_until_ready(single(queries, corpus.rows, corpus.bias)), size["repeats"]), 3)
  row["same_rows_as_single_top_k"] = bool(np.array_equal(
      np.asarray(jdr_rows), np.asarray(single(queries, corpus.rows, corpus.bias))))
  matrix_bytes = n * topk.storage_bytes_per_row(dim, dtype)
  row["bound_ms"] = round(1e3 * matrix_bytes / bandwidth, 3)
  row["jdr_over_bound"] = round(row["jdr_ms"] / row["bound_ms"], 2)
  # The reference searches the very same matrix (a zero-copy view where DLPack allows).
  try:
    t_matrix = torch.from_dlpack(corpus.rows)[:n]
  except Exception:  # pylint: disable=broad-except  (e.g. a sharded array: fall back to a copy)
    t_matrix = torch.from_numpy(np.asarray(corpus.rows.astype(jnp.float32))[:n]).to(torch_device)
    if dtype == "bfloat16":
      t_matrix = t_matrix.to(torch.bfloat16)
  t_queries = torch.from_numpy(np.array(queries)).to(torch_device).to(t_matrix.dtype)

  def torch_search():
    scores = torch.mm(t_queries, t_matrix.T).float()
    result = torch.topk(scores, k, dim=1)
    peak_lib.torch_sync(torch_device)
    return result

  row["reference_ms"] = round(1e3 * median_seconds(torch_search, size["repeats"]), 3)
  ref_rows = torch_search().indices.cpu().numpy()
  row["ratio"] = round(row["reference_ms"] / row["jdr_ms"], 3)
  row["agreement"] = round(float(np.mean([len(set(a) & set(b)) / k for a, b in zip(np.asarray(jdr_rows), ref_rows)])), 4)
  del t_matrix
  # int8 with one scale per row: a quarter of float32's bytes; recall against jdr's exact search.
  quantized = random_corpus_on_mesh(n, dim, mesh, "int8", seed=n)
  search8 = topk.search_fn(quantized, k, mesh)
  row["int8_ms"] = round(1e3 * median_seconds(lambda: jax.block_until_ready(search8(queries)), size["repeats"]), 3)
  _, rows8 = search8(queries)
  row["int8_recall_vs_exact"] = round(float(np.mean(
      [len(set(a) & set(b)) / k for a, b in zip(np.asarray(rows8), np.asarray(jdr_rows))])), 4)
  del corpus, quantized, search, search8


def section_int8_scifact(mesh, k: int = 200) -> dict:
  """Real vectors: SciFact encoded by the bundled MiniLM, its test queries' top-k from float32 (exact),
  bfloat16 and int8 storage; Recall@k of each against exact, and each one's nDCG@10."""
  from jdr.retrieval import encoder_runtime  # pylint: disable=g-import-not-at-top
  from jdr.evaluation import metrics
  from jdr.data import formats, shared, text  # pylint: disable=g-import-not-at-top
  path = shared.shared_dataset("scifact")
  if path is None:
    raise SystemExit(f"the int8 section reads SciFact from {shared.shared_data_dir() / 'scifact'}")
  corpus, queries, qrels = formats.load_beir(path, "test")
  doc_ids, qids = list(corpus), list(queries)
  runtime = encoder_runtime.load_runtime("minilm")
  docs = encoder_runtime.encode_texts(runtime, [text.doc_text(corpus[d]) for d in doc_ids])
  q = encoder_runtime.encode_texts(encoder_runtime.load_runtime("minilm", side="query"), [queries[i] for i in qids])
  out, exact = {"docs": len(doc_ids), "queries": len(qids), "k": k}, None
  for dtype in ("float32", "bfloat16", "int8"):
    placed = topk.put_corpus(docs, mesh, dtype)
    scores, rows = (np.asarray(x) for x in topk.search_fn(placed, k, mesh)(q))
    exact = rows if exact is None else exact
    run = {qid: {doc_ids[r]: float(s) for r, s in zip(row, score)} for qid, row, score in zip(qids, rows, scores)}
    out[dtype] = {"recall_vs_exact": round(float(np.mean([len(set(a) & set(b)) / k for a, b in zip(rows, exact)])), 4),
                  "ndcg@10": round(metrics.evaluate(qrels, run, ["ndcg@10"])["ndcg@10"], 4),
                  "bytes_per_doc": topk.storage_bytes_per_row(docs.shape[1], dtype)}
  out["adore_loss"] = _adore_loss_by_storage(path, doc_ids, docs, mesh, k)
  return out


def _adore_loss_by_storage(path, doc_ids: list[str], docs: np.ndarray, mesh, k: int) -> dict:
  """ADORE's loss (configs/adore.py's LambdaRank: its metric and pair weights, every positive appended when none
  is retrieved) for SciFact's training queries, their top-k and the candidates' vectors read from each storage:
  the loss, its gradient with respect to the query vectors (what trains the query tower), and the candidate
  lists, each against float32 storage."""
  from jdr.bench import recipes  # pylint: disable=g-import-not-at-top
  from jdr.data import formats  # pylint: disable=g-import-not-at-top
  from jdr.negatives import retrieved  # pylint: disable=g-import-not-at-top
  from jdr.retrieval import encoder_runtime  # pylint: disable=g-import-not-at-top
  from jdr.training import losses  # pylint: disable=g-import-not-at-top
  loss_cfg = recipes.load("adore").loss
  _, queries, qrels = formats.load_beir(path, "train")
  row_of = {d: i for i, d in enumerate(doc_ids)}
  qids = [q for q in queries if any(d in row_of for d in qrels.get(q, {}))]
  most = max(len(qrels[q]) for q in qids)
  positive_rows = np.full((len(qids), most), -1, np.int32)
  for i, q in enumerate(qids):
    rows_q = [row_of[d] for d, rel in qrels[q].items() if rel > 0 and d in row_of]
    positive_rows[i, :len(rows_q)] = rows_q
  q = encoder_runtime.encode_texts(encoder_runtime.load_runtime("minilm", side="query"), [queries[i] for i in qids])

  def per_query(scores, valid, labels):
    return losses.lambdarank(scores[None], valid[None], labels=labels[None], metric=loss_cfg.lambda_metric,
                             delta=loss_cfg.lambda_delta)

  def loss_and_grad(q, vectors, valid, labels):
    def total(q):
      each = jax.vmap(per_query)(jnp.einsum("bd,bnd->bn", q, vectors), valid, labels)
      return jnp.mean(each), each
    (mean, each), grad = jax.value_and_grad(total, has_aux=True)(q)
    return mean, each, grad

  out, exact = {"queries": len(qids), "metric": loss_cfg.lambda_metric, "delta": loss_cfg.lambda_delta}, None
  for dtype in ("float32", "bfloat16", "int8"):
    placed = topk.put_corpus(docs, mesh, dtype)
    _, top = topk.search_fn(placed, k, mesh)(q)
    rows, labels, _ = retrieved.candidates(top, jnp.asarray(positive_rows), "append")
    vectors = topk.gather_rows(placed.rows, rows, mesh)
    mean, each, grad = (np.asarray(x, np.float64) for x in loss_and_grad(jnp.asarray(q), vectors, rows >= 0, labels))
    if exact is None:
      exact = (np.asarray(top), mean, each, grad)
    cosine = np.sum(grad * exact[3], 1) / np.maximum(np.linalg.norm(grad, axis=1) * np.linalg.norm(exact[3], axis=1),
                                                      1e-30)
    out[dtype] = {"loss": round(float(mean), 6),
                  "loss_relative_difference": float(abs(mean - exact[1]) / abs(exact[1])),
                  "per_query_max_abs_difference": float(np.max(np.abs(each - exact[2]))),
                  "gradient_cosine_mean": float(np.mean(cosine)), "gradient_cosine_min": float(np.min(cosine)),
                  "candidates_vs_exact": round(float(np.mean([len(set(a) & set(b)) / k
                                                              for a, b in zip(np.asarray(top), exact[0])])), 4)}
  return out


# ------------------------------------------------------------------------------------------------ ADORE


def section_adore(size: dict, model_dir: str, mesh) -> dict:
  from jdr.bench import adore_step  # pylint: disable=g-import-not-at-top
  args = argparse.Namespace(model=model_dir, top_n=200, batch_size=32, query_length=32, steps=size["repeats"],
                            train_size=100_000, dtype=size["dtype"])
  bench = adore_step.Bench(args, mesh)
  out = {"dim": bench.dim, "batch": args.batch_size, "top_n": args.top_n, "rows": []}
  for n in size["adore_sizes"]:
    corpus = random_corpus_on_mesh(n, bench.dim, mesh, topk.resolve_dtype("auto"), seed=11)
    placed = adore_step.Placed(corpus.rows, corpus.bias)
    positives = np.random.default_rng(12).integers(0, n, (args.batch_size, 1)).astype(np.int32)
    row = bench.jax(placed, n, positives)
    out["rows"].append(_report(f"adore {n}", {
        "size": n, "corpus_dtype": corpus.dtype,
        **{k: round(v, 5) if isinstance(v, float) else v for k, v in row.items()}}))
    del corpus, placed
    gc.collect()
  return out


# ------------------------------------------------------------------------------------------------ main


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m jdr.bench device", description=__doc__.splitlines()[0])
  parser.add_argument("--size", choices=sorted(SIZES), default=None,
                      help="full: BERT-base, 8.84M rows (default on accelerators); small: a tiny model, 100k rows "
                           "(default on CPUs)")
  parser.add_argument("--sections", default=None,
                      help=f"comma-separated: {', '.join(SECTIONS)} (default all; on a CPU all but int8-scifact)")
  parser.add_argument("--profile", action="store_true",
                      help="also trace jdr's encoder forward and train steps (a few calls each, after timing) and "
                           "report where their device time goes: kernel ms by kind of work and the largest HLO "
                           "instructions")
  parser.add_argument("--topk-sizes", default=None, help="override the top-k corpus sizes, comma-separated")
  parser.add_argument("--adore-sizes", default=None, help="override ADORE's corpus sizes, comma-separated")
  args = parser.parse_args(argv)
  platform = jax.default_backend()
  size_name = args.size or ("small" if platform == "cpu" else "full")
  size = dict(SIZES[size_name])
  sections = [s.strip() for s in (args.sections or ",".join(DEFAULT_SECTIONS[size_name])).split(",") if s.strip()]
  unknown = sorted(set(sections) - set(SECTIONS))
  if unknown:
    parser.error(f"--sections: unknown {unknown}; valid: {', '.join(SECTIONS)}")
  size["profile"] = args.profile
  if args.topk_sizes:
    size["topk_sizes"] = tuple(int(s) for s in args.topk_sizes.split(","))
  if args.adore_sizes:
    size["adore_sizes"] = tuple(int(s) for s in args.adore_sizes.split(","))
  torch_device = peak_lib.torch_device()
  if platform != "cpu":
    # Compiling dominates the command's time on a GPU (BERT-base steps at 12 unrolled layers, each matmul
    # fusion autotuned). With a compilation cache directory XLA also keeps its per-fusion autotuning results
    # there, so the sections' later compiles (the step without attention dropout, ADORE's four) reuse what
    # earlier ones tuned. A fresh directory: nothing from another run is trusted.
    cache = tempfile.TemporaryDirectory(prefix="jdr-bench-xla-")
    jax.config.update("jax_compilation_cache_dir", cache.name)
  import transformers  # pylint: disable=g-import-not-at-top
  transformers.logging.set_verbosity_error()  # its load reports would bury the sections' lines
  from jdr.runtime import parallel  # pylint: disable=g-import-not-at-top
  mesh = parallel.make_mesh((-1, 1, 1))
  result = {"benchmark": "device", "device": jax.devices()[0].device_kind, "platform": platform,
            "devices": jax.device_count(), "reference_device": torch_device,
            "size": size_name, "jax": jax.__version__,
            # Flags change what is timed (an optimization level, a device count): the figures carry them.
            "xla_flags": os.environ.get("XLA_FLAGS", "")}
  start = time.perf_counter()
  failed = []

  def run_section(name: str, fn) -> None:
    # One section's failure (a kernel the platform lacks, memory) must not cost the figures of the others: an
    # accelerator hour is scarce, so the rest still run and the exit status says that one failed.
    key = name.replace("-", "_")
    started = time.perf_counter()
    try:
      result[key] = fn()
      result[key]["seconds"] = round(time.perf_counter() - started, 1)
    except Exception as error:  # pylint: disable=broad-except
      traceback.print_exc()
      result[key] = {"error": f"{type(error).__name__}: {error}"}
      failed.append(name)
      _report(name, result[key])

  result["peak"] = _report("peak", section_peak(size, torch_device))
  result["peak"]["seconds"] = round(time.perf_counter() - start, 1)
  peak_flops = result["peak"]["peak_tflops"] * 1e12  # the better library's: fractions are of the device
  bandwidth = result["peak"]["bandwidth_gbps"] * 1e9
  with tempfile.TemporaryDirectory() as model_dir:
    shape = random_hf_model(model_dir, size["model"])
    result["model"] = {"shape": size["model"], **shape}
    runs = {
        "encode": lambda: _report("encode", section_encode(size, torch_device, model_dir, shape, peak_flops)),
        "train": lambda: _report("train", section_train(size, torch_device, model_dir, shape, peak_flops)),
        "flash": lambda: _report("flash", section_flash(size, model_dir, shape, peak_flops, result.get("train"))),
        "topk": lambda: section_topk(size, torch_device, bandwidth, mesh),
        "adore": lambda: section_adore(size, model_dir, mesh),
        "int8-scifact": lambda: _report("int8-scifact", section_int8_scifact(mesh)),
    }
    for name in sections:  # in the order asked: where time is short, what matters most goes first
      if name in runs:
        run_section(name, runs[name])
    if any("error" in row for row in result.get("topk", {}).get("rows", [])):
      failed.append("topk")
  result["seconds"] = round(time.perf_counter() - start, 1)
  print(json.dumps(result))
  if failed:
    raise SystemExit(f"jdr.bench device: section(s) {', '.join(failed)} failed (tracebacks above)")


if __name__ == "__main__":
  main()
