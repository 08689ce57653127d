"""The machine's float32 matrix-multiply peak, measured, so a benchmark can report FLOP/s as a fraction; and the
CPU it ran on, so a figure names its host."""

import os
import platform
import time

import numpy as np


def cpu_info(path: str = "/proc/cpuinfo") -> dict:
  """The CPU's model name and the matmul instruction sets it reports (Linux's /proc/cpuinfo; elsewhere the
  platform's processor name and no instruction sets): {"model", "isa": [...]}."""
  model, flags = platform.processor() or platform.machine(), set()
  try:
    with open(path, encoding="utf-8") as f:
      for line in f:
        key, _, value = line.partition(":")
        if key.strip() == "model name" and not flags:
          model = value.strip()
        elif key.strip() == "flags":
          flags = set(value.split())
          break
  except OSError:
    pass
  isa = []
  if flags:
    isa.append("AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2")
    isa += ["AVX512-BF16"] if "avx512_bf16" in flags else []
    isa.append("AMX" if "amx_tile" in flags else "no AMX")
  return {"model": model, "isa": isa}


def cpu_line() -> str:
  """What a benchmark prints of its host's CPU, e.g. 'AMD EPYC (AVX-512, AVX512-BF16, no AMX), 2 cores usable'."""
  info = cpu_info()
  usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  isa = f" ({', '.join(info['isa'])})" if info["isa"] else ""
  return f"{info['model']}{isa}, {usable} cores usable"


def _best_rate(matmul, a, b, repeats: int) -> float:
  n = a.shape[0]
  matmul(a, b)  # warm-up (and compile, for jax)
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    matmul(a, b)
    best = min(best, time.perf_counter() - start)
  return 2 * n**3 / best


def matmul_peak_flops(n: int = 2048, repeats: int = 5, dtype: str = "float32") -> dict[str, float]:
  """Best GEMM FLOP/s of each library present (jax, torch, numpy), and their max as `peak`. `dtype`
  "bfloat16": bfloat16 operands with float32 accumulation (jax asked for a float32 result, torch's bfloat16
  mm); numpy has none."""
  rng = np.random.default_rng(0)
  a = rng.standard_normal((n, n), dtype=np.float32)
  b = rng.standard_normal((n, n), dtype=np.float32)
  rates = {"numpy": _best_rate(np.matmul, a, b, repeats)} if dtype == "float32" else {}
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  ja, jb = jnp.asarray(a, dtype), jnp.asarray(b, dtype)
  jit_mm = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32))
  rates["jax"] = _best_rate(lambda x, y: jit_mm(x, y).block_until_ready(), ja, jb, repeats)
  try:
    import torch  # pylint: disable=g-import-not-at-top
    ta, tb = (torch.from_numpy(x).to(getattr(torch, dtype)) for x in (a, b))
    with torch.inference_mode():
      rates["torch"] = _best_rate(torch.mm, ta, tb, repeats)
  except ImportError:
    pass
  rates["peak"] = max(rates.values())
  return rates


def encoder_flops(num_tokens: np.ndarray, *, layers: int, hidden: int, intermediate: int,
                  first_position: bool = False) -> float:
  """Forward FLOPs of a BERT encoder over documents of the given (unpadded) lengths.

  Per token and layer: Q, K, V and output projections (8 H^2), the feed-forward pair (4 H I); per
  document and layer: attention scores and the weighted sum (4 n^2 H). Padding is not counted, so
  this is the useful work, the same for every implementation. `first_position`: only the first position's
  output is read ([CLS] pooling), so the last layer's useful work is the keys and values of every token (4
  H^2) and the rest of the layer at the first position alone (4 H^2 + 4 H I, attention 4 n H).
  """
  n = np.asarray(num_tokens, dtype=np.float64)
  per_token = 8 * hidden**2 + 4 * hidden * intermediate
  full = n.sum() * per_token + 4 * hidden * (n**2).sum()
  if not first_position:
    return float(layers * full)
  last = n.sum() * 4 * hidden**2 + len(n) * (4 * hidden**2 + 4 * hidden * intermediate) + 4 * hidden * n.sum()
  return float((layers - 1) * full + last)


def torch_device() -> str:
  """Where a benchmark runs its PyTorch reference: the GPU when jax runs on one (a comparison across devices
  compares nothing), else the CPU (a TPU host's reference has no TPU to run on)."""
  import jax  # pylint: disable=g-import-not-at-top
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except ImportError:
    return "cpu"
  return "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"


def torch_sync(device: str) -> None:
  """Waits for the device's queued work (CUDA launches return before the kernels finish)."""
  if device == "cuda":
    import torch  # pylint: disable=g-import-not-at-top
    torch.cuda.synchronize()
