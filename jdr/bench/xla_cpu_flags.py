"""Which kernels XLA's CPU backend gives the encoder's matmuls on this host, and how fast it encodes under each flag.

  python -m jdr.bench xla-flags [--candidates default,onednn,...] [--rounds 2] [--model minilm] [--dtype bfloat16]

XLA reads XLA_FLAGS once, when its backend starts, so each candidate runs in a process of its own: it loads the
model (MiniLM by default), compiles `jdr.encode`'s forward over --rows x --length tokens, names the kernels its
compiled HLO gives the dots (YNN or XNN fusions, oneDNN custom calls, or XLA's own dot), and times batches run
two at once from two threads, as `jdr.encode` runs them on a CPU. The candidates go in turns, forward then
backward each round (a host whose speed drifts slows them alike), and each one's time is the median over its
rounds. The table gives each candidate against the default from the same run.

Why: PyTorch's CPU kernels differ by vendor (oneDNN and MKL on an Intel Xeon), and so may XLA's; a flag only
counts where its kernels actually change (a flag the build ignores compiles the same HLO) and the change
outlasts the host's own spread.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import sys
import threading
import time

from jdr.bench import own_process

# name -> the XLA flags it adds to those already in XLA_FLAGS
CANDIDATES = {
    "default": "",
    "onednn": "--xla_cpu_use_onednn=true --xla_cpu_experimental_onednn_custom_call=true",
    "onednn-without-ynn": ("--xla_cpu_use_onednn=true --xla_cpu_experimental_onednn_custom_call=true "
                           "--xla_cpu_experimental_ynn_fusion_type="),
    "xla-dots": "--xla_cpu_experimental_ynn_fusion_type=",
    "xnnpack": "--xla_cpu_use_xnnpack=true",
    "one-thread-eigen": "--xla_cpu_multi_thread_eigen=false",
}

# Fusions that hand their computation's dot to a library's kernel, by the marker in their backend config.
_LIBRARY_FUSIONS = {"ynn": "__ynn_fusion", "xnn": "__xnn_fusion", "onednn": "__onednn_fusion"}


def dot_kernels(hlo_text: str) -> dict[str, int]:
  """How many of the optimized HLO's dots run on each kind of kernel: a library's (a YNN, XNN or oneDNN fusion
  that calls a computation holding the dot; oneDNN's matmul custom call) or XLA's own ("xla dot")."""
  from jdr.bench import kernel_profile  # pylint: disable=g-import-not-at-top
  _, computations = kernel_profile.parse_hlo(hlo_text)
  dots_in = {name: sum(i.opcode == "dot" for i in instructions) for name, instructions in computations.items()}
  counts, claimed = collections.Counter(), set()
  for instructions in computations.values():
    for instruction in instructions:
      if instruction.opcode == "custom-call" and "__onednn$matmul" in instruction.line:
        counts["onednn"] += 1
      called = re.search(r"calls=%?([^\s,]+)", instruction.line) if instruction.opcode == "fusion" else None
      kind = next((k for k, marker in _LIBRARY_FUSIONS.items() if marker in instruction.line), None)
      if called and kind and dots_in.get(called.group(1)):
        counts[kind] += dots_in[called.group(1)]
        claimed.add(called.group(1))
  counts["xla dot"] = sum(n for name, n in dots_in.items() if name not in claimed)
  return {kind: n for kind, n in counts.items() if n}


def measure(model: str, rows: int, length: int, batches: int, repeats: int, dtype: str = "float32") -> dict:
  """In this process (its XLA flags already read): the forward's dot kernels and ms a batch, two at once."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  from jdr.retrieval import encoder_runtime  # pylint: disable=g-import-not-at-top
  runtime = encoder_runtime.load_runtime(model, max_length=length, dtype=dtype)
  rng = np.random.default_rng(0)
  vocab = len(runtime.tokenizer)
  ids = [rng.integers(min(1000, vocab // 2), vocab, (rows, length)).astype(np.int32) for _ in range(2)]
  mask = np.ones((rows, length), np.int32)
  forward = runtime.apply_fn
  lowered = (forward if hasattr(forward, "lower") else jax.jit(forward)).lower(runtime.params, ids[0], mask)
  kernels = dot_kernels(lowered.compile().as_text())
  for _ in range(2):
    np.asarray(forward(runtime.params, ids[0], mask))

  def worker(k):
    for _ in range(batches):
      np.asarray(forward(runtime.params, ids[k], mask))

  seconds = []
  for _ in range(repeats):
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    start = time.perf_counter()
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    seconds.append((time.perf_counter() - start) / (2 * batches))
  return {"kernels": kernels, "ms_per_batch": 1e3 * statistics.median(seconds)}


def run_candidate(name: str, args) -> dict:
  """`measure` in a process of its own, under the candidate's flags added to XLA_FLAGS."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {CANDIDATES[name]}".strip()
  return own_process.run(["xla-flags", "--measure", "--model", args.model, "--rows", str(args.rows), "--length",
                          str(args.length), "--batches", str(args.batches), "--repeats", str(args.repeats),
                          "--dtype", args.dtype], env=env)


def summarize(runs: dict[str, list[dict]]) -> dict[str, dict]:
  """Each candidate's kernels, median ms a batch over its rounds, their spread, and its ratio to the default."""
  out = {}
  for name, results in runs.items():
    errors = [r["error"] for r in results if "error" in r]
    if errors:
      out[name] = {"error": errors[0]}
      continue
    times = [r["ms_per_batch"] for r in results]
    out[name] = {"flags": CANDIDATES[name], "kernels": results[0]["kernels"],
                 "ms_per_batch": round(statistics.median(times), 1),
                 "rounds_ms": [round(t, 1) for t in times]}
  base = out.get("default", {}).get("ms_per_batch")
  for result in out.values():
    if base and "ms_per_batch" in result:
      result["speed_vs_default"] = round(base / result["ms_per_batch"], 3)
  return out


def table(summary: dict[str, dict]) -> str:
  lines = ["| candidate | XLA flags added | the forward's matmul kernels | ms a batch (rounds) | "
           "speed against default |", "|---|---|---|---|---|"]
  for name, r in summary.items():
    if "error" in r:
      lines.append(f"| {name} | `{CANDIDATES[name]}` | {r['error']} | | |")
      continue
    kernels = ", ".join(f"{n} {kind}" for kind, n in r["kernels"].items()) or "none found"
    rounds = ", ".join(f"{t}" for t in r["rounds_ms"])
    lines.append(f"| {name} | `{r['flags'] or '(none)'}` | {kernels} | {r['ms_per_batch']} ({rounds}) | "
                 f"{r.get('speed_vs_default', '')} |")
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m jdr.bench xla-flags", description=__doc__.splitlines()[0])
  parser.add_argument("--candidates", default=",".join(CANDIDATES), help=f"comma-separated, of {', '.join(CANDIDATES)}")
  parser.add_argument("--model", default="minilm")
  parser.add_argument("--rows", type=int, default=4)
  parser.add_argument("--length", type=int, default=256)
  parser.add_argument("--batches", type=int, default=10, help="batches per thread a repeat")
  parser.add_argument("--repeats", type=int, default=3, help="repeats a round; the round's time is their median")
  parser.add_argument("--rounds", type=int, default=2, help="rounds over the candidates, in turns")
  parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                      help="what the forward computes in (bfloat16: as `jdr.encode --dtype bfloat16`)")
  parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # one candidate's process
  args = parser.parse_args(argv)
  if args.measure:
    print(json.dumps(measure(args.model, args.rows, args.length, args.batches, args.repeats, args.dtype)))
    return
  names = [n for n in args.candidates.split(",") if n]
  unknown = [n for n in names if n not in CANDIDATES]
  if unknown:
    parser.error(f"--candidates: no candidate {', '.join(unknown)} (choose from {', '.join(CANDIDATES)})")
  if "default" not in names:
    names.insert(0, "default")  # every figure is read against the default from the same run
  runs = {name: [] for name in names}
  for r in range(args.rounds):
    for name in (names if r % 2 == 0 else names[::-1]):
      print(f"== round {r + 1}: {name} {CANDIDATES[name]}", file=sys.stderr, flush=True)
      runs[name].append(run_candidate(name, args))
  summary = summarize(runs)
  from jdr.bench import peak as peak_lib  # pylint: disable=g-import-not-at-top
  cpu = peak_lib.cpu_line()
  print(f"host CPU: {cpu}; {args.model}'s forward in {args.dtype} over {args.rows} x {args.length} tokens, two "
        f"batches at once\n{table(summary)}", file=sys.stderr)
  print(json.dumps({"benchmark": "xla-flags", "host_cpu": cpu, "model": args.model, "dtype": args.dtype,
                    "rows": args.rows, "length": args.length, "candidates": summary}))


if __name__ == "__main__":
  main()
