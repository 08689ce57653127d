"""Sizing jobs before they run: `--compile-only` figures for two models, two batches and three meshes, and
the per-device corpus matrix of an 8.8M-document corpus.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m jdr.bench sizing [--batches 32,1024]
      [--models minilm,base] [--meshes "8,1,1;2,4,1;4,1,2"]
  python -m jdr.bench sizing --topology v5e:2x4   # the same rows compiled for a TPU slice (needs libtpu)

Each row compiles the in-batch training step (queries of 32 tokens, documents of 128, AdamW) for the mesh on
simulated CPU devices, exactly as `python -m jdr.train ... --compile-only` does (jdr.training.sizing.size_step), and
prints XLA's per-device bytes. Rules follow the mesh: (8,1,1) data parallel (dp), (2,4,1) fully sharded
(fsdp), (4,1,2) fsdp plus tensor parallel (fsdp_tp). `minilm` is the bundled all-MiniLM-L6-v2 (6 x 384),
`base` a fresh BERT-base (12 x 768, the MiniLM vocabulary of 30,522). The corpus rows are
jdr.training.sizing.corpus_matrix_bytes: ceil(8,841,823 / devices) x 768 x (4 or 2) bytes. Then the ADORE step's exact
retrieval (jdr.retrieval.topk.sharded_top_k: top-200 of 32 queries over 8,841,823 x 768 rows split over the devices) is
compiled alone for bfloat16, int8 and float32 storage: per-device corpus bytes, temporaries and FLOPs.
"""

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jdr.retrieval import topk

MSMARCO_PASSAGES = 8_841_823
RULES = {(8, 1, 1): "dp", (2, 4, 1): "fsdp", (4, 1, 2): "fsdp_tp"}


def size_retrieval(devices, num_docs: int = MSMARCO_PASSAGES, dim: int = 768, k: int = 200, queries: int = 32,
                   dtype: str = "bfloat16") -> dict:
  """Compiles the exact per-step retrieval (jdr.retrieval.topk.sharded_top_k, as the ADORE step runs it) for the corpus
  rows split over `devices`, without data; returns XLA's per-device bytes and FLOPs."""
  from jdr.training import sizing  # pylint: disable=g-import-not-at-top
  mesh = jax.sharding.Mesh(np.array(devices), ("docs",))
  rows, bias = topk.abstract_corpus(num_docs, dim, mesh, dtype)
  whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  q = jax.ShapeDtypeStruct((queries, dim), jnp.float32, sharding=whole)
  search = jax.jit(lambda q, r, b: topk.sharded_top_k(q, r, b, k, mesh))
  compiled = search.lower(q, rows, bias).compile()
  memory = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return {"docs": num_docs, "dim": dim, "k": k, "queries": queries, "dtype": dtype, "devices": len(devices),
          "corpus_bytes_per_device": sizing.per_device_bytes(rows),
          "temp_bytes": int(memory.temp_size_in_bytes),
          "flops_per_device": float(cost.get("flops", 0.0)) if cost else 0.0,
          "bytes_accessed_per_device": float(cost.get("bytes accessed", 0.0)) if cost else 0.0}


def main(argv=None) -> None:
  from jdr.runtime import defaults  # pylint: disable=g-import-not-at-top
  from jdr.runtime import parallel
  from jdr.training import sizing
  parser = argparse.ArgumentParser(prog="python -m jdr.bench sizing", description=__doc__.splitlines()[0])
  parser.add_argument("--models", default="minilm,base", help="comma-separated; empty: the retrieval rows only")
  parser.add_argument("--batches", default="32,1024")
  parser.add_argument("--meshes", default="8,1,1;2,4,1;4,1,2")
  parser.add_argument("--topology", default=None,
                      help="compile for this TPU slice ahead of time (e.g. v5e:2x4; needs libtpu) instead of the "
                           "local devices")
  args = parser.parse_args(argv)
  meshes = [tuple(int(x) for x in m.split(",")) for m in args.meshes.split(";")]
  needed = max(a * b * c for a, b, c in meshes)
  if args.topology:
    available = len(sizing.topology_devices(args.topology))
    if available < needed:
      raise SystemExit(f"these meshes need {needed} devices and {args.topology} has {available}")
  elif jax.device_count() < needed:
    raise SystemExit(f"these meshes need {needed} devices and {jax.device_count()} are present: run with "
                     f"XLA_FLAGS=--xla_force_host_platform_device_count={needed}")
  rows = []
  mib = lambda b: b / 2**20
  print(f"{'model':<7} {'batch':>5} {'mesh':<9} {'rules':<8} {'params':>9} {'optimizer':>9} {'batch in':>9} "
        f"{'temps':>10} {'total':>10}  MiB per device; TFLOP per device", file=sys.stderr)
  for model in [m for m in args.models.split(",") if m.strip()]:
    for batch in (int(b) for b in args.batches.split(",")):
      for mesh in meshes:
        c = defaults.get_config()
        if model == "minilm":
          c.model.init_from = "minilm"
        else:
          c.model.init_from, c.model.fresh = "", model
        c.batch_size = batch
        c.mesh.shape = mesh
        c.mesh.rules = RULES.get(mesh, "fsdp_tp")
        s = sizing.size_step(c, topology=args.topology)
        rows.append({"model": model, **s})
        print(f"{model:<7} {batch:>5} {str(mesh):<9} {c.mesh.rules:<8} {mib(s['params_bytes_per_device']):>9.1f} "
              f"{mib(s['optimizer_bytes_per_device']):>9.1f} {mib(s['batch_bytes_per_device']):>9.2f} "
              f"{mib(s['temp_bytes']):>10.1f} {mib(s['total_bytes_per_device']):>10.1f}  "
              f"{s['flops_per_device'] / 1e12:.3f}", file=sys.stderr, flush=True)
  # The ADORE step's retrieval over the whole 8.8M x 768 corpus, compiled for the same devices.
  devices = (sizing.topology_devices(args.topology) if args.topology else jax.devices())[:needed]
  retrieval = []
  for dtype in ("bfloat16", "int8", "float32"):
    if args.topology:
      with parallel.compiling_for("tpu"):
        r = size_retrieval(devices, dtype=dtype)
    else:
      r = size_retrieval(devices, dtype=dtype)
    retrieval.append(r)
    print(f"top-{r['k']} of {r['queries']} queries over {r['docs']:,} x {r['dim']} {dtype} on {r['devices']} devices: "
          f"corpus {mib(r['corpus_bytes_per_device']):,.1f} MiB, temporaries {mib(r['temp_bytes']):,.1f} MiB, "
          f"{r['flops_per_device'] / 1e9:.2f} GFLOP, {r['bytes_accessed_per_device'] / 2**30:.2f} GiB accessed "
          "per device", file=sys.stderr, flush=True)
  corpus = {f"{dtype}_{devices}": sizing.corpus_matrix_bytes(MSMARCO_PASSAGES, 768, devices, dtype)
            for dtype in ("float32", "bfloat16") for devices in (8, 64)}
  for key, value in corpus.items():
    print(f"8.8M x 768 corpus matrix, {key.replace('_', ' on ')} devices: {value / 2**30:.2f} GiB per device",
          file=sys.stderr)
  print(json.dumps({"benchmark": "sizing", "topology": args.topology, "rows": rows, "retrieval": retrieval,
                    "corpus_matrix_bytes": corpus,
                    "corpus_docs": MSMARCO_PASSAGES}))


if __name__ == "__main__":
  main()
