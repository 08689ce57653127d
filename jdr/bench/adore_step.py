"""Share of an ADORE / LTRe training step spent in retrieval, per corpus size, index and back-end.

  python -m jdr.bench adore-step [--sizes 5000,100000,1000000] [--factories "Flat;OPQ48,IVF1,PQ48"]
      [--backends faiss,jax] [--batch-size 32] [--top-n 200] [--steps 10]

The model and its settings are the ADORE recipe's (configs/adore.py): the bundled MiniLM split into a trained
query tower and a frozen document tower, LambdaRank (M = MRR@10) over the top n, queries of 32 tokens. The corpus is random unit-norm vectors
of the tower's width (384) at each size, on the mesh as `jdr.negatives.retrieved.put_corpus` puts it, and
each query's positive is a random row: retrieval costs the same whatever the vectors mean.

  faiss  per step, (a) the host retrieval exactly as the trainer runs it (`HostRetrieval`: the extra query
         forward with the step's dropout rng, the Faiss search, the candidates' vectors) and (b) the jitted
         step given those `cand_rows` and vectors; share = a / (a + b). Compressed indexes are trained on at
         most 100k vectors (`HostIndex`'s train_size) and the step scores their reconstruction, as in training.
  jax    (exact, so Flat only) the jitted step retrieving inside itself (`sharded_top_k`) vs the same step
         given precomputed `cand_rows`; share = (t_in_step - t_given) / t_in_step.

Times are medians over --steps after two warm-up steps, each ended by block_until_ready, and include putting
the batch on the devices. LTRe reports retrieval at ~20% of a step on GPUs at 8.8M documents; the goal here
is below 10%. --factories is ';'-separated; a plain comma list also works ("Flat,OPQ48,IVF1,PQ48" is read as
Flat and OPQ48,IVF1,PQ48: OPQ/PCA/IVF parts join the factory that follows them).
"""

import argparse
import gc
import json
import re
import sys
import time
from typing import NamedTuple

import jax
import ml_collections
import numpy as np

from jdr.training import step as step_lib
from jdr.models.build import FRESH
from jdr.bench import recipes

_PREFIX = re.compile(r"(OPQ|PCA|ITQ|RR|IVF|IMI|L2norm)", re.IGNORECASE)


def parse_factories(text: str) -> list[str]:
  """'Flat;OPQ48,IVF1,PQ48' or 'Flat,OPQ48,IVF1,PQ48' -> ['Flat', 'OPQ48,IVF1,PQ48']."""
  if ";" in text:
    return [f.strip() for f in text.split(";") if f.strip()]
  out, pending = [], []
  for part in (p.strip() for p in text.split(",")):
    if not part:
      continue
    pending.append(part)
    if not _PREFIX.match(part):  # a terminal part (Flat, PQ48, SQ8, HNSW32...) closes the factory
      out.append(",".join(pending))
      pending = []
  if pending:
    raise ValueError(f"--factories {text!r}: {','.join(pending)} needs a terminal part (Flat, PQm, ...)")
  return out


def recipe_config(args) -> ml_collections.ConfigDict:
  """The ADORE recipe (configs/adore.py), with the benchmark's model, sizes and in-step retrieval."""
  c = recipes.load("adore")
  if args.model == "minilm":
    c.model.init_from = "minilm"
  elif args.model in FRESH:  # fresh weights of that shape (tiny: smoke tests; base: jdr.bench compiled)
    c.model.init_from, c.model.fresh, c.model.pooling = "", args.model, "mean"
  else:  # a Hugging Face directory (jdr.bench device writes a random BERT-base there)
    c.model.init_from, c.model.pooling, c.model.normalize = args.model, "mean", False
  c.model.dtype = getattr(args, "dtype", c.model.dtype)
  c.negatives.retrieval.top_n = args.top_n
  c.data.query_max_length = args.query_length
  c.batch_size = args.batch_size
  c.optimizer.warmup_steps = 0
  c.num_train_steps = 10_000
  return c


class Placed(NamedTuple):
  """A corpus already on the mesh: rows (`device`) and padding bias, as the step takes them."""
  device: object
  bias: jax.Array


class Bench:
  """The model, its state and the two jitted steps, built once and reused for every corpus."""

  def __init__(self, args, mesh=None):
    from jdr.training import trainer  # pylint: disable=g-import-not-at-top
    from jdr.training import optimizers
    from jdr.runtime import parallel
    from jdr.models import build as build_lib  # pylint: disable=g-import-not-at-top
    from jdr.retrieval import host_search  # pylint: disable=g-import-not-at-top
    from jdr.negatives import retrieved  # pylint: disable=g-import-not-at-top
    self.args, self.parallel, self.retrieved, self.host_search = args, parallel, retrieved, host_search
    config = recipe_config(args)
    self.mesh = mesh = mesh if mesh is not None else parallel.make_mesh(config.mesh.shape)
    parallel.check_batch_size(config.batch_size, mesh)
    built = build_lib.build(config.model, config.data)
    model = built.model
    tx = optimizers.make_optimizer(config.optimizer, config.num_train_steps, config.model.train_towers)
    params = trainer.initial_params(model, built, config, jax.random.PRNGKey(0), None)
    rep = parallel.replicated(mesh)
    state = step_lib.TrainState(step=jax.numpy.int32(0), params=params, opt_state=tx.init(params),
                             rng=jax.random.PRNGKey(1))
    self.holder = {"state": jax.device_put(state, rep)}
    corpus_sh, bias_sh = retrieved.corpus_shardings(mesh)
    shardings = dict(in_shardings=(rep, parallel.batch_sharding(mesh), corpus_sh, bias_sh),
                     out_shardings=(rep, rep), donate_argnums=(0,))
    self.step_given = step_lib.jit(step_lib.make_train_step(model, tx, config, mesh, "corpus", False), **shardings)
    self.step_in_step = step_lib.jit(step_lib.make_train_step(model, tx, config, mesh, "corpus", True), **shardings)

    query_vectors = step_lib.make_step_query_vectors(model)
    self.query_vectors = query_vectors
    b, length = args.batch_size, args.query_length
    self.dim = int(jax.eval_shape(query_vectors, self.holder["state"], jax.ShapeDtypeStruct((b, length), np.int32),
                                  jax.ShapeDtypeStruct((b, length), np.int32)).shape[-1])
    rng = np.random.default_rng(0)
    self.queries = {"query_ids": rng.integers(1000, 30000, (b, length)).astype(np.int32),
                    "query_mask": np.ones((b, length), np.int32)}

  def _run(self, fn, batch: dict, corpus) -> float:
    start = time.perf_counter()
    self.holder["state"], metrics = fn(self.holder["state"], self.parallel.global_batch(batch, self.mesh),
                                       corpus.device, corpus.bias)
    jax.block_until_ready(metrics["loss"])
    return time.perf_counter() - start

  def faiss(self, emb: np.ndarray, positives: np.ndarray, factory: str) -> dict:
    start = time.perf_counter()
    index = self.host_search.HostIndex(emb, factory, seed=0, train_size=self.args.train_size)
    build_s = time.perf_counter() - start
    # The jitted step takes a corpus argument; with the batch's candidate vectors (what the host retrieval
    # adds, as in training) it scores those and never reads it.
    corpus = self.retrieved.put_corpus(emb[:1], ["0"], self.mesh)
    host = self.retrieved.HostRetrieval(index, self.args.top_n, self.query_vectors, self.mesh)
    batch = {**self.queries, "positive_rows": positives}
    retrieval, step = [], []
    for i in range(2 + self.args.steps):
      start = time.perf_counter()
      with_rows = host(batch, self.holder["state"])
      a = time.perf_counter() - start
      b = self._run(self.step_given, with_rows, corpus)
      if i >= 2:
        retrieval.append(a)
        step.append(b)
    a, b = float(np.median(retrieval)), float(np.median(step))
    return {"retrieval_share": a / (a + b), "retrieval_s": a, "step_s": b, "index_build_s": build_s,
            "faiss_gpu": bool(getattr(index.retriever, "_want_gpu", False))}

  def jax(self, corpus, num_docs: int, positives: np.ndarray) -> dict:
    """`corpus`: anything with the step's `device` rows and `bias` (retrieved.put_corpus, or Placed)."""
    rng = np.random.default_rng(1)
    batch = {**self.queries, "positive_rows": positives}
    in_step, given = [], []
    for i in range(2 + self.args.steps):
      rows = rng.integers(0, num_docs, (len(positives), self.args.top_n)).astype(np.int32)
      t_in = self._run(self.step_in_step, batch, corpus)
      t_given = self._run(self.step_given, {**batch, "cand_rows": rows}, corpus)
      if i >= 2:
        in_step.append(t_in)
        given.append(t_given)
    t_in, t_given = float(np.median(in_step)), float(np.median(given))
    return {"retrieval_share": (t_in - t_given) / t_in, "step_in_step_s": t_in, "step_given_s": t_given}


def random_corpus(n: int, dim: int, seed: int) -> np.ndarray:
  rng = np.random.default_rng(seed)
  emb = np.empty((n, dim), np.float32)
  for start in range(0, n, 262144):  # in blocks: no float64 copy of a 1M-row matrix
    block = rng.standard_normal((min(262144, n - start), dim), dtype=np.float32)
    emb[start:start + len(block)] = block / np.linalg.norm(block, axis=1, keepdims=True)
  return emb


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m jdr.bench adore-step", description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", default="5000,100000,1000000", help="corpus sizes, comma-separated")
  parser.add_argument("--factories", default="Flat;OPQ48,IVF1,PQ48", help="Faiss factories, ';'-separated")
  parser.add_argument("--backends", default="faiss,jax", help="faiss, jax or both")
  parser.add_argument("--batch-size", type=int, default=32)
  parser.add_argument("--top-n", type=int, default=200)
  parser.add_argument("--query-length", type=int, default=32)
  parser.add_argument("--steps", type=int, default=10, help="timed steps (after 2 warm-up steps)")
  parser.add_argument("--train-size", type=int, default=100_000,
                      help="vectors a compressed index is trained on (its search speed does not depend on it)")
  parser.add_argument("--model", choices=("minilm", "tiny"), default="minilm",
                      help="tiny: a fresh 2x64 tower, for smoke tests only")
  args = parser.parse_args(argv)
  sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
  factories = parse_factories(args.factories)
  backends = [b.strip() for b in args.backends.split(",") if b.strip()]
  unknown = set(backends) - {"faiss", "jax"}
  if unknown:
    parser.error(f"--backends: unknown {sorted(unknown)} (faiss, jax)")
  if min(sizes) < args.top_n:
    parser.error(f"--sizes: every corpus needs at least --top-n={args.top_n} documents")

  if "jax" in backends and not any(f.strip().lower() == "flat" for f in factories):
    print("adore-step: the jax back-end is exact top-k, so it runs only with the Flat factory", file=sys.stderr)
  bench = Bench(args)
  results = []
  for n in sizes:
    emb = random_corpus(n, bench.dim, seed=n)
    positives = np.random.default_rng(n + 1).integers(0, n, (args.batch_size, 1)).astype(np.int32)
    for factory in factories:
      for backend in backends:
        flat = factory.strip().lower() == "flat"
        if backend == "jax" and not flat:
          continue  # exact top-k: the JAX back-end has no compressed index
        print(f"adore-step: {n} docs, {factory}, {backend}...", file=sys.stderr, flush=True)
        if backend == "faiss":
          row = bench.faiss(emb, positives, factory)
        else:
          row = bench.jax(bench.retrieved.put_corpus(emb, [str(i) for i in range(n)], bench.mesh), n, positives)
        results.append({"size": n, "factory": factory, "backend": backend,
                        **{k: round(v, 5) if isinstance(v, float) else v for k, v in row.items()}})
        gc.collect()
    del emb
    gc.collect()

  print(f"\n{'docs':>9} {'factory':<18} {'backend':<6} {'retrieval s':>11} {'step s':>9} {'share':>7}",
        file=sys.stderr)
  for r in results:
    if r["backend"] == "faiss":
      retrieval, step = r["retrieval_s"], r["retrieval_s"] + r["step_s"]
    else:
      retrieval, step = r["step_in_step_s"] - r["step_given_s"], r["step_in_step_s"]
    print(f"{r['size']:>9} {r['factory']:<18} {r['backend']:<6} {retrieval:>11.4f} {step:>9.4f} "
          f"{r['retrieval_share']:>7.1%}", file=sys.stderr)
  print("(step s = the whole step with its retrieval; share goal < 10%, LTRe ~20% at 8.8M docs)", file=sys.stderr)
  print(json.dumps({
      "benchmark": "adore-step", "units": "seconds per step (medians); share = retrieval / whole step",
      "device": jax.devices()[0].device_kind, "devices": jax.device_count(), "model": args.model,
      "batch_size": args.batch_size, "top_n": args.top_n, "query_length": args.query_length,
      "steps": args.steps, "goal_share": 0.10, "results": results}))


if __name__ == "__main__":
  main()
