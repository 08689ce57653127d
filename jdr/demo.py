"""The built-in default, end to end with no download: `python -m jdr.demo [--workdir DIR]`.

Writes the standard-library docstring dataset (jdr.data.builtin) in BEIR layout, encodes its corpus
with the bundled all-MiniLM-L6-v2, retrieves for its queries and prints the metrics: the same three
command lines a user runs on real data (jdr.encode, jdr.retrieve, jdr.evaluate).
"""

from jdr.runtime import host_memory

# `python -m` this module: glibc's malloc on huge pages, by re-executing before anything heavy is imported.
host_memory.reexec_if_command(__name__)

import argparse
import pathlib
import sys

from jdr.runtime import cli
from jdr import encode
from jdr import evaluate
from jdr import retrieve
from jdr.data import builtin


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m jdr.demo", description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", default="runs/pipeline-demo", help="where data, embeddings and the run go")
  parser.add_argument("--model", default="minilm")
  args = parser.parse_args(argv)
  work = pathlib.Path(args.workdir)
  data_dir = work / "stdlib-docstrings"
  with cli.reporting_errors():  # the steps below report their own errors the same way
    builtin.write_builtin(data_dir)
  print(f"[1/3] encode {data_dir}/corpus.jsonl with {args.model}", file=sys.stderr)
  encode.main(["--model", args.model, "--corpus", str(data_dir), "--out", str(work / "embeddings")])
  print("[2/3] retrieve the test queries", file=sys.stderr)
  run = work / "run.trec"
  retrieve.main(["--index", str(work / "embeddings"), "--queries", str(data_dir), "--split", "test",
                 "--run", str(run)])
  print("[3/3] evaluate", file=sys.stderr)
  evaluate.main(["--qrels", str(data_dir / "qrels" / "test.tsv"), "--run", str(run),
                 "--metrics", "ndcg@10,mrr@10,recall@100"])


if __name__ == "__main__":
  main()
