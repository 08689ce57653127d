"""jdr against the PyTorch tools on this CPU, every comparison one after the other: one command for a host's rows.

  python -m jdr.bench cpu [--only encode,encode-bf16,train-step,pretrain,xla-flags,xla-flags-bf16] [--out FILE]

Runs each benchmark as `python -m jdr.bench NAME` in a process of its own, one at a time (two at once would share
the cores and halve both figures), with its defaults:

  encode        MiniLM over 2,000 SciFact documents at 256 tokens, float32, against sentence-transformers
  encode-bf16   the same in bfloat16 on both sides (sentence-transformers under torch.autocast), with each side's
                cosine to its own float32 vectors and nDCG@10 on SciFact test in both precisions
  train-step    the MiniLM training step against transformers + torch AdamW
  pretrain      pretraining pairs/s with gradient caching against sentence-transformers' CachedMNRL
  xla-flags     the kernels XLA's CPU backend gives the encoder's matmuls under each candidate flag set (oneDNN,
                XNNPACK, XLA's own dots) and MiniLM's forward time under each, against the default in the same run
  xla-flags-bf16  the same with the forward in bfloat16 (where oneDNN would bring AMX's bfloat16 products)

then prints the host's CPU line and one table: each figure, its reference's from the same run, the ratio, the
fractions of the matmul peak, and the goal each ratio is held to in float32 (encoding 1.3, the train step 1.2,
cached pretraining 1.2), with the flags' own table below it. `--out` also writes every benchmark's JSON line,
keyed by name, with the CPU line.
"""

import argparse
import json
import sys

from jdr.bench import own_process
from jdr.bench import peak as peak_lib
from jdr.bench import xla_cpu_flags

# name -> (the benchmark's own arguments, the float32 goal for its ratio or None)
RUNS = {
    "encode": (["encode"], 1.3),
    "encode-bf16": (["encode", "--dtype", "bfloat16", "--scifact-test"], None),
    "train-step": (["train-step"], 1.2),
    "pretrain": (["pretrain"], 1.2),
    "xla-flags": (["xla-flags"], None),
    "xla-flags-bf16": (["xla-flags", "--dtype", "bfloat16"], None),
}


def _fraction(value) -> str:
  return f"{value:.0%}" if isinstance(value, (int, float)) else ""


def row(name: str, result: dict) -> str:
  """One markdown row: benchmark | jdr | reference | ratio | goal | jdr / reference share of the matmul peak."""
  if "error" in result:
    return f"| {name} | {result['error']} | | | | |"
  if result["benchmark"] == "xla-flags":  # not a comparison with PyTorch: the fastest flags against none
    timed = {n: r for n, r in result["candidates"].items() if "ms_per_batch" in r}
    if not timed:
      return f"| {name} | no candidate ran | | | | |"
    best = min(timed, key=lambda n: timed[n]["ms_per_batch"])
    default = timed.get("default", {}).get("ms_per_batch", "no")
    return (f"| {name} | fastest: {best}, {timed[best]['ms_per_batch']} ms a batch | default {default} ms a batch | "
            f"{timed[best].get('speed_vs_default', '')} | | |")
  goal = RUNS[name][1]
  ratio = result["ratio"]
  met = "" if goal is None else f"{goal} ({'met' if ratio >= goal else 'not met'})"
  if result["benchmark"] == "encode":
    dtype = result["dtype"]
    share = (f"{_fraction(result.get(f'jdr_{dtype}_peak_fraction', result['jdr_peak_fraction']))} / "
             f"{_fraction(result.get(f'reference_{dtype}_peak_fraction', result['reference_peak_fraction']))}")
    figures = f"{result['jdr']} docs/s | {result['reference']} docs/s"
  elif result["benchmark"] == "train-step":
    share = f"{_fraction(result['jdr_peak_fraction'])} / {_fraction(result['reference_peak_fraction'])}"
    figures = f"{result['jdr']} s/step ({result['jdr_setting']}) | {result['reference']} s/step"
  else:  # pretrain: the cached systems, the ratio the goal reads
    share = ""
    figures = f"{result['jdr_cached']} pairs/s | {result['st_cached']} pairs/s (CachedMNRL)"
  return f"| {name} | {figures} | {ratio} | {met} | {share} |"


def table(results: dict) -> str:
  lines = ["| benchmark | jdr | reference, same run | ratio | float32 goal | jdr / reference, share of the peak |",
           "|---|---|---|---|---|---|"]
  lines += [row(name, result) for name, result in results.items()]
  extra = results.get("encode-bf16", {})
  if "jdr_cosine_to_float32" in extra:
    lines.append(f"\nbfloat16 against float32: cosine jdr {extra['jdr_cosine_to_float32']}, reference "
                 f"{extra['reference_cosine_to_float32']}; SciFact test nDCG@10 "
                 f"{extra.get('scifact_test_ndcg@10', 'not measured')}")
  for name in ("xla-flags", "xla-flags-bf16"):
    if "candidates" in results.get(name, {}):
      flags = results[name]
      lines.append(f"\nXLA's CPU flags, MiniLM's forward in {flags.get('dtype', 'float32')} over {flags['rows']} x "
                   f"{flags['length']} tokens, two batches at once:\n{xla_cpu_flags.table(flags['candidates'])}")
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m jdr.bench cpu", description=__doc__.splitlines()[0])
  parser.add_argument("--only", default=",".join(RUNS), help=f"comma-separated, of {', '.join(RUNS)}")
  parser.add_argument("--out", default="", help="also write every benchmark's JSON here")
  args = parser.parse_args(argv)
  names = [n for n in args.only.split(",") if n]
  unknown = [n for n in names if n not in RUNS]
  if unknown:
    parser.error(f"--only: no benchmark {', '.join(unknown)} (choose from {', '.join(RUNS)})")
  results = {}
  for name in names:
    print(f"== {name}: python -m jdr.bench {' '.join(RUNS[name][0])}", file=sys.stderr, flush=True)
    results[name] = own_process.run(RUNS[name][0])
  cpu = peak_lib.cpu_line()
  print(f"host CPU: {cpu}\n{table(results)}")
  if args.out:
    with open(args.out, "w", encoding="utf-8") as f:
      json.dump({"host_cpu": cpu, **results}, f, indent=1)


if __name__ == "__main__":
  main()
