"""A long-document benchmark built from a short-document one (FGD's "scope hypothesis" in miniature).

  python -m jdr.data.longdocs --source ../shared/data/scifact --out runs/scifact-long [--seed 0]
      [--max-tokens 0]

The source's abstracts are shuffled with a fixed seed and grouped, in that order, into documents of 2 or 3
whole abstracts (the size drawn with the same seed), so every document covers several unrelated topics.
With `--max-tokens N` a group shrinks (3, then 2, then 1) until it fits N tokens of the MiniLM tokenizer
(specials included). SciFact's abstracts average about 300 such tokens, so a 512-token cap leaves 85% of its
documents a single abstract (measured: 3,818 of 4,499); the default is therefore no cap, and documents run
past 512 tokens, which is what FirstP truncates and MaxP covers with up to 4 passages. A query's relevant documents are those holding one of its relevant
abstracts (the highest grade wins); train and test queries are the source's. An abstract longer than the
budget on its own, or a last one left over, becomes a document alone: counted in the statistics, never
dropped. Writes a BEIR directory (corpus.jsonl: title "", text the abstracts as "title. text" paragraphs
separated by blank lines; queries.jsonl; qrels/SPLIT.tsv for each source split) plus `pieces.jsonl`
(document id -> its abstracts' ids, in order) and `stats.json`.
"""

from __future__ import annotations

from jdr.runtime import host_memory

# `python -m` this module: glibc's malloc on huge pages, by re-executing before anything heavy is imported.
host_memory.reexec_if_command(__name__)

import argparse
import json
import pathlib
import sys

import numpy as np

from jdr.runtime import cli
from jdr.runtime import paths
from jdr.data import formats
from jdr.data import text as text_lib


def abstract_text(doc: formats.Doc) -> str:
  title = doc.title.strip()
  return f"{title}. {doc.text.strip()}" if title else doc.text.strip()


def group(lengths: dict[str, int], *, seed: int, max_tokens: int = 0, specials: int = 2) -> list[list[str]]:
  """Abstract ids grouped into documents: in a seeded order, 2 or 3 per document (seeded); with max_tokens
  > 0 a group shrinks until its token counts plus `specials` fit."""
  ids = sorted(lengths)
  rng = np.random.default_rng(seed)
  order = [ids[i] for i in rng.permutation(len(ids))]
  groups, i = [], 0
  while i < len(order):
    size = int(rng.integers(2, 4))
    while size > 1 and max_tokens and sum(lengths[a] for a in order[i:i + size]) + specials > max_tokens:
      size -= 1
    groups.append(order[i:i + size])  # the last group may be shorter: what is left
    i += size
  return groups


def build(source: str | pathlib.Path, out: str | pathlib.Path, *, seed: int = 0, max_tokens: int = 0,
          tokenizer=None) -> dict:
  """Writes the long-document BEIR directory `out` from `source`; returns its statistics."""
  source, out = pathlib.Path(source), pathlib.Path(out)
  corpus = formats.read_corpus(source / "corpus.jsonl")
  queries = formats.read_queries(source / "queries.jsonl")
  if tokenizer is None:
    tokenizer = text_lib.load_tokenizer(paths.minilm_path())
  texts = {d: abstract_text(doc) for d, doc in corpus.items()}
  ids = sorted(texts)
  counts = tokenizer([texts[d] for d in ids], add_special_tokens=False, return_attention_mask=False)["input_ids"]
  lengths = {d: len(c) for d, c in zip(ids, counts)}
  groups = group(lengths, seed=seed, max_tokens=max_tokens)
  docs, pieces, home = {}, {}, {}
  for i, members in enumerate(groups):
    doc_id = f"L{i:05d}"
    docs[doc_id] = formats.Doc(doc_id, "", "\n\n".join(texts[a] for a in members))
    pieces[doc_id] = members
    home.update({a: doc_id for a in members})
  out.mkdir(parents=True, exist_ok=True)
  formats.write_corpus(out / "corpus.jsonl", docs)
  formats.write_queries(out / "queries.jsonl", queries)
  splits = sorted(p.stem for p in (source / "qrels").glob("*.tsv"))
  judged = {}
  for split in splits:
    qrels = formats.read_qrels(source / "qrels" / f"{split}.tsv", doc_ids=corpus, query_ids=queries)
    mapped: dict[str, dict[str, int]] = {}
    for q, rels in qrels.items():
      for a, grade in rels.items():
        d = home[a]
        mapped.setdefault(q, {})[d] = max(grade, mapped.get(q, {}).get(d, grade))
    formats.write_qrels(out / "qrels" / f"{split}.tsv", mapped)
    judged[split] = {"queries": len(mapped), "pairs": sum(len(v) for v in mapped.values())}
  (out / "pieces.jsonl").write_text("".join(json.dumps({"_id": d, "pieces": p}) + "\n" for d, p in pieces.items()))
  sizes = np.array([len(p) for p in pieces.values()])
  tokens = np.array([sum(lengths[a] for a in p) + 2 for p in pieces.values()])
  stats = {"source": str(source), "seed": seed, "max_tokens": max_tokens, "abstracts": len(ids),
           "documents": len(docs), "abstracts_per_document": {str(k): int(v) for k, v in
                                                               zip(*np.unique(sizes, return_counts=True))},
           "mean_abstracts_per_document": round(float(sizes.mean()), 3),
           "mean_tokens": round(float(tokens.mean()), 1), "max_tokens_seen": int(tokens.max()),
           "documents_over_512_tokens": int(np.sum(tokens > 512)), "qrels": judged}
  (out / "stats.json").write_text(json.dumps(stats, indent=1) + "\n")
  return stats


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m jdr.data.longdocs", description=__doc__.splitlines()[0])
  parser.add_argument("--source", required=True, help="a BEIR directory of short documents (e.g. SciFact)")
  parser.add_argument("--out", required=True, help="the long-document BEIR directory to write")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--max-tokens", type=int, default=0, help="0 = no cap (2-3 abstracts whatever their length)")
  args = parser.parse_args(argv)
  with cli.reporting_errors():
    stats = build(args.source, args.out, seed=args.seed, max_tokens=args.max_tokens)
  print(json.dumps(stats), file=sys.stdout)


if __name__ == "__main__":
  main()
