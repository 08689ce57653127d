"""What one evaluation of the suite (eval.suite, jdr.evaluation.suite) costs a run: seconds a task, and in all.

  python -m jdr.bench suite                                    # the three named tasks, MiniLM, the default caps
  python -m jdr.bench suite --tasks scifact --max-docs 1000 --model runs/demo

The suite is loaded as `jdr.train` loads it (read, capped and tokenized once: `setup_seconds`), then evaluated
twice with the model's weights: the first evaluation also compiles the shapes it encodes (what a run's first
evaluation pays), the second is what each later evaluation costs (`seconds` a task, `total_seconds`). Sizes are
the kept documents and evaluated queries of each task, and the documents' mean tokens. The last line is one JSON
object.
"""

import argparse
import json
import sys
import time
import types

import jax
import numpy as np

from jdr.retrieval import tower_encoder  # pylint: disable=g-import-not-at-top

from jdr.evaluation import suite as suite_lib
from jdr.models import build
from jdr.runtime import config_files
from jdr.runtime import defaults
from jdr.training import trainer


def main(argv=None) -> None:
  config = defaults.get_config()
  parser = argparse.ArgumentParser(prog="python -m jdr.bench suite", description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="minilm", help="init_from: minilm, a Hugging Face dir, a jdr model, '' (fresh)")
  parser.add_argument("--tasks", default=",".join(suite_lib.NAMED), help="eval.suite")
  parser.add_argument("--max-docs", type=int, default=config.eval.suite_max_docs, help="eval.suite_max_docs")
  parser.add_argument("--max-queries", type=int, default=config.eval.suite_max_queries, help="eval.suite_max_queries")
  parser.add_argument("--query-max-length", type=int, default=config.data.query_max_length)
  parser.add_argument("--doc-max-length", type=int, default=config.data.doc_max_length)
  parser.add_argument("--tokens-per-batch", type=int, default=0, help="eval.tokens_per_batch (0: the device's)")
  args = parser.parse_args(argv)

  config_files.apply_overrides(config, [
      f"model.init_from={args.model}", f"eval.suite={args.tasks}", f"eval.suite_max_docs={args.max_docs}",
      f"eval.suite_max_queries={args.max_queries}", f"data.query_max_length={args.query_max_length}",
      f"data.doc_max_length={args.doc_max_length}", f"eval.tokens_per_batch={args.tokens_per_batch}"])
  if args.model == "":
    config_files.apply_overrides(config, ["model.fresh=tiny", "model.pooling=mean"])
  built = build.build(config.model, config.data)
  params = trainer.initial_params(built.model, built, config, jax.random.PRNGKey(0), None)
  # The trainer's encoder of the model (its prompts and batching); the suite brings its own texts.
  encoder = tower_encoder.TowerEncoder(built.model, built.tokenizer, types.SimpleNamespace(corpus={}, queries={}),
                                  query_max_length=args.query_max_length, doc_max_length=args.doc_max_length,
                                  tokens_per_batch=args.tokens_per_batch, prompts=built.description.get("prompts"))
  start = time.perf_counter()
  suite = suite_lib.Suite(encoder, config)
  setup_s = time.perf_counter() - start
  suite(params)
  first = dict(suite.seconds)
  scores = suite(params)
  tasks = {}
  for task in suite.tasks:
    name = task.spec.name
    tasks[name] = {
        "seconds": round(suite.seconds[name], 2), "first_seconds": round(first[name], 2), "split": task.spec.split,
        "queries": len(task.qids), "all_queries": task.all_queries, "documents": len(task.doc_ids),
        "all_documents": task.all_docs, "judged_documents": task.judged_docs,
        "mean_doc_tokens": round(float(np.mean(task.doc_tokens.lengths)), 1),
        "ndcg@10": round(scores[f"suite/{name}/ndcg@10"], 4) if f"suite/{name}/ndcg@10" in scores else None}
    print(f"{name}: {task.describe()}: {suite.seconds[name]:.1f} s (first evaluation {first[name]:.1f} s)",
          file=sys.stderr)
  result = {"benchmark": "suite", "units": "seconds an evaluation", "model": args.model, "tasks": tasks,
            "total_seconds": round(sum(suite.seconds.values()), 2), "first_total_seconds": round(sum(first.values()), 2),
            "setup_seconds": round(setup_s, 2), "max_docs": args.max_docs, "max_queries": args.max_queries,
            "query_max_length": args.query_max_length, "doc_max_length": args.doc_max_length,
            "backend": jax.default_backend(), "devices": jax.device_count()}
  print(json.dumps(result))


if __name__ == "__main__":
  main()
