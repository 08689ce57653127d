"""`python -m jdr.bench NAME [args]`: run one benchmark (see `--help` for the names)."""

from jdr.runtime import host_memory

# `python -m` this module: glibc's malloc on huge pages, by re-executing before anything heavy is imported.
host_memory.reexec_if_command(__name__)

import argparse
import importlib
import os
import sys

from jdr.runtime import host_memory

BENCHMARKS = {
    "adore-step": "jdr.bench.adore_step",
    "ance-refresh": "jdr.bench.ance_refresh",
    "compiled": "jdr.bench.compiled_kernels",
    "cpu": "jdr.bench.cpu_suite",
    "cross-encoder": "jdr.bench.cross_encoder",
    "device": "jdr.bench.device",
    "encode": "jdr.bench.encode_speed",
    "eval-candidates": "jdr.bench.eval_candidates",
    "fgd-step": "jdr.bench.fgd_step",
    "fingerprint": "jdr.bench.fingerprint",
    "plan": "jdr.bench.plan",
    "pretrain": "jdr.bench.pretrain_speed",
    "scale": "jdr.bench.scale",
    "sizing": "jdr.bench.sizing_table",
    "suite": "jdr.bench.eval_suite",
    "train-step": "jdr.bench.train_step",
    "xla-flags": "jdr.bench.xla_cpu_flags",
}


def main() -> None:
  parser = argparse.ArgumentParser(prog="python -m jdr.bench", description="Runs one benchmark.")
  parser.add_argument("name", choices=sorted(BENCHMARKS))
  # Everything after the name is the benchmark's own (`NAME --help` is its help, not this one).
  parser.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's arguments; NAME --help lists them")
  print(host_memory.status(), file=sys.stderr)
  args = parser.parse_args()
  from jdr.bench import peak  # pylint: disable=g-import-not-at-top
  print(f"host CPU: {peak.cpu_line()}", file=sys.stderr)
  # jax takes 75% of a GPU's memory at start by default; the PyTorch reference shares the device.
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  importlib.import_module(BENCHMARKS[args.name]).main(args.args)


if __name__ == "__main__":
  sys.exit(main())
