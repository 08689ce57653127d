"""Shared defaults of every jdr recipe (they live in jdr/runtime/defaults.py). Recipes start from `base.get_config()`
and change what differs; each declares the arguments it takes (`ARGS`, read by `base.parse_arg`). Not a
recipe by itself; each recipe's docstring gives its run command.

The inputs recipes name, each as (path, what it holds): `c.data.dataset, c.data.description = base.X` (or
`c.model.init_from, c.model.description`). jdr.train refuses a path that is not there with one line naming the
key to set and what it should hold, so no recipe trains on something else because a folder is missing.
Relative paths are read from where jdr.train runs.
"""

from jdr.runtime.config_files import parse_arg  # noqa: F401  (re-exported for the recipes)
from jdr.data import shared as shared_lib
from jdr.runtime.defaults import get_config  # noqa: F401

BEIR = "corpus.jsonl, queries.jsonl, qrels/train.tsv, qrels/dev.tsv"
MSMARCO_PASSAGE = ("data/msmarco-passage", f"MS MARCO passage ranking, BEIR layout ({BEIR}) or MS MARCO's own "
                   "files (collection.tsv, queries.train.tsv, qrels.train.tsv, ...; then data.eval_split=dev.small)")
MSMARCO_DOC = ("data/msmarco-doc", f"MS MARCO document ranking, BEIR layout: {BEIR}")
# MS MARCO passage's training queries with a positive in qrels.train.tsv (532,761 pairs): what the authors'
# loaders count their epochs over (DRhard preprocess.py's train-query, ANCE msmarco_data.py's)
MSMARCO_TRAIN_QUERIES = 502_939
REQA_SQUAD = ("data/reqa-squad", "ReQA SQuAD, BEIR layout: corpus.jsonl of sentences with their paragraph, "
              "queries.jsonl, qrels/train.tsv and qrels/test.tsv of a question split")
WIKIPEDIA = ("data/enwiki-pages-articles.xml.bz2",
             "English Wikipedia, a MediaWiki pages-articles XML dump: .xml, .xml.bz2 or .xml.gz")
SCIFACT_LONG = ("runs/scifact-long", "long-document SciFact: python -m jdr.data.longdocs --source "
                "../shared/data/scifact --out runs/scifact-long")

ROBERTA_BASE = ("models/roberta-base", "RoBERTa-base, a Hugging Face directory (config.json, weights, tokenizer)")
BM25_WARMUP = ("runs/msmarco-bm25-warmup", "the BM25-negative warm-up: the workdir of configs/bm25_neg.py")
STAR = ("runs/msmarco-star", "a STAR model: the workdir of configs/star.py")

_SHARED = {
    "scifact": "BEIR SciFact: corpus.jsonl, queries.jsonl, qrels/train.tsv, qrels/test.tsv",
    "wikispeedia": "the Wikispeedia articles: articles_subset.jsonl, graph/links.tsv",
}


def shared(name: str) -> tuple[str, str]:
  """(path, what it holds) of a dataset of the shared data folder ($JDR_SHARED_DATA, else ../shared/data
  beside the checkout), named whether or not this host has it."""
  return str(shared_lib.shared_data_dir() / name), f"{_SHARED[name]}, as ../shared/data/{name} holds it"
