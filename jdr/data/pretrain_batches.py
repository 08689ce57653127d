"""Pretraining batches (data.kind="pretrain"): ICT / BFS / WLP pairs as the tokens form of jdr/data/batch.py.

A batch is B pairs `PretrainPairs.pair(step * B + i)`: B queries and their C = B documents, the other rows'
documents serving as negatives (sampled softmax over the global batch). `valid[b, c]` is False only where
document c is the very same text as row b's own document (c != b): a duplicate of the positive is not a
negative. Like `pairs.Batches`, a batch is a pure function of (seed, step) and `local(step)` returns this
process's rows, so a resumed run sees the same pairs with no loader state.

Documents are pair-encoded "title [SEP] text" (Chang et al. 2020); queries are single sentences.

`doc_logq [C]` (with `loss.logq_correction`): log of each document's sampling probability under the pair
generator, for the sampled-softmax correction s - log Q (Yi et al. 2019). It is the generator's marginal over
(task, passage) with these approximations: rejected draws are ignored, and a WLP document is taken to be a
uniform passage of the linking article (the generator prefers the passages that mention the target). ICT and
BFS draw passages uniformly, so for them the correction is a constant and changes nothing.

MLM (data.pretrain_task="mlm") is not built here yet; see the report of issue 7.
"""

from __future__ import annotations

import pathlib
import sys
from typing import Any

import ml_collections
import numpy as np

from jdr.data import articles as articles_lib
from jdr.data import pairs as pairs_lib
from jdr.data import pretrain
from jdr.data import shared

SOURCES = ("wikispeedia", "builtin")  # or the path of a MediaWiki XML dump
TASKS = ("ict", "bfs", "wlp", "mixed")


def check(config: ml_collections.ConfigDict) -> None:
  """Refuses pretraining settings the trainer cannot run, before anything is read."""
  d = config.data
  if d.kind not in ("pairs", "pretrain"):
    raise ValueError(f"data.kind must be 'pairs' or 'pretrain', got {d.kind!r}")
  if d.kind != "pretrain":
    return
  if d.pretrain_task == "mlm":
    raise NotImplementedError("data.pretrain_task='mlm' (the masked-LM baseline) is not implemented yet")
  if d.pretrain_task not in TASKS:
    raise ValueError(f"data.pretrain_task must be one of {TASKS} or 'mlm', got {d.pretrain_task!r}")
  if config.negatives.source != "none" or config.negatives.per_query:
    raise ValueError("data.kind='pretrain' trains on in-batch negatives only: set negatives.source=none and "
                     "negatives.per_query=0")
  if not config.negatives.in_batch:
    raise ValueError("data.kind='pretrain' needs negatives.in_batch=True (sampled softmax over the batch)")


def load_articles(data_cfg: ml_collections.ConfigDict) -> tuple[list[articles_lib.Article], Any]:
  """The articles `data.pretrain_source` names: wikispeedia (data.dataset or the shared copy), builtin
  (the standard library) or a MediaWiki XML dump path."""
  source = data_cfg.pretrain_source
  if source == "builtin":
    return articles_lib.builtin_articles(check_sentences=False)
  if source == "wikispeedia":
    directory = None
    if data_cfg.dataset and data_cfg.dataset != "builtin":
      directory = pathlib.Path(data_cfg.dataset)
    else:
      directory = shared.shared_dataset("wikispeedia")
    if directory is None or not (directory / "articles_subset.jsonl").exists():
      raise FileNotFoundError(f"data.pretrain_source=wikispeedia: no articles_subset.jsonl in "
                              f"{directory or shared.shared_data_dir() / 'wikispeedia'}; set data.dataset")
    return articles_lib.read_wikispeedia(directory, check_sentences=False)
  path = pathlib.Path(source)
  if not path.is_file():
    raise FileNotFoundError(f"data.pretrain_source: {source!r} is neither wikispeedia, builtin nor a file")
  return articles_lib.read_wikipedia_xml(path, check_sentences=False)


def retrieval_data(name: str) -> pairs_lib.RetrievalData:
  """An empty RetrievalData (no corpus, no evaluation) for the parts of the trainer that expect one."""
  return pairs_lib.RetrievalData(corpus={}, queries={}, train_qrels={}, eval_qrels=None, name=name)


class PretrainBatches:
  """Global pretraining batches as a pure function of the step; `local(step)` is this process's rows."""

  def __init__(self, generator: pretrain.PretrainPairs, tokenizer: Any, *, batch_size: int,
               query_max_length: int, doc_max_length: int, seed: int = 0, process_index: int = 0,
               process_count: int = 1, logq: bool = False):
    self.generator = generator
    self.tokenizer = tokenizer
    self.batch_size = batch_size
    self.query_max_length, self.doc_max_length = query_max_length, doc_max_length
    self.seed = seed
    self.process_index, self.process_count = process_index, process_count
    self.pad_id = tokenizer.pad_token_id or 0
    self.logq = logq
    if logq:
      self._passage_logq = _passage_log_probs(generator)

  @property
  def examples_per_epoch(self) -> int:
    return len(self.generator)

  def global_pairs(self, step: int) -> list[pretrain.Draw]:
    return [self.generator.draw(step * self.batch_size + i) for i in range(self.batch_size)]

  def local(self, step: int) -> dict[str, np.ndarray]:
    draws = self.global_pairs(step)
    docs = [(d.pair.doc_title, d.pair.doc_text) for d in draws]
    valid = duplicate_mask(docs)
    per = self.batch_size // self.process_count
    lo, hi = self.process_index * per, (self.process_index + 1) * per
    mine = draws[lo:hi]
    query_ids, query_mask = pairs_lib._pad(  # pylint: disable=protected-access
        [np.asarray(t, np.int32) for t in self.tokenizer(
            [d.pair.query for d in mine], truncation=True, max_length=self.query_max_length,
            return_attention_mask=False, return_token_type_ids=False)["input_ids"]],
        self.query_max_length, self.pad_id)
    doc_ids, doc_mask = pairs_lib._pad(  # pylint: disable=protected-access
        [np.asarray(t, np.int32) for t in self.tokenizer(
            [d.pair.doc_title for d in mine], [d.pair.doc_text for d in mine], truncation="longest_first",
            max_length=self.doc_max_length, return_attention_mask=False,
            return_token_type_ids=False)["input_ids"]],
        self.doc_max_length, self.pad_id)
    batch = {"query_ids": query_ids, "query_mask": query_mask, "doc_ids": doc_ids, "doc_mask": doc_mask,
             "valid": valid[lo:hi]}
    if self.logq:
      batch["doc_logq"] = np.array([self.doc_logq(d) for d in mine], np.float32)
    return batch

  def doc_logq(self, draw: pretrain.Draw) -> float:
    """log Q(document): the generator's (approximate, module docstring) probability of this passage."""
    return float(self._passage_logq[(draw.pair.article_id,) + tuple(draw.doc_place)])


def duplicate_mask(docs: list) -> np.ndarray:
  """valid [B, B]: False where column c (c != b) holds the same document as row b's own; True elsewhere."""
  index = {}
  codes = np.array([index.setdefault(d, len(index)) for d in docs])
  same = codes[:, None] == codes[None, :]
  return ~same | np.eye(len(docs), dtype=bool)


def _passage_log_probs(gen: pretrain.PretrainPairs) -> dict[tuple, float]:
  """log of P(document passage) = sum over the generator's tasks of P(task) P(passage | task)."""
  probs: dict[tuple, float] = {}
  p_task = 1.0 / len(gen.tasks)

  def add(key, p):
    probs[key] = probs.get(key, 0.0) + p

  for task in gen.tasks:
    units = gen.units[task]
    if task == "ict":
      for a, places in zip(gen.articles, gen._passages):  # pylint: disable=protected-access
        for s, p in places:
          add((a.id, s, p), p_task / units)
    elif task == "bfs":
      for a, places in zip(gen.articles, gen._body):  # pylint: disable=protected-access
        if a.lead:
          for s, p in places:
            add((a.id, s, p), p_task / units)
    else:  # wlp: a uniform link, then (approximately) a uniform passage of the linking article
      for i, _ in gen._links.tolist():  # pylint: disable=protected-access
        places = gen._passages[i]  # pylint: disable=protected-access
        for s, p in places:
          add((gen.articles[i].id, s, p), p_task / units / len(places))
  return {k: float(np.log(v)) for k, v in probs.items()}


def make(config: ml_collections.ConfigDict, tokenizer: Any, *, process_index: int = 0,
         process_count: int = 1) -> tuple[PretrainBatches, pairs_lib.RetrievalData]:
  """The batches of a pretraining config and the (empty) RetrievalData the rest of the trainer expects."""
  check(config)
  d = config.data
  articles, report = load_articles(d)
  print(report, file=sys.stderr)
  generator = pretrain.PretrainPairs(articles, d.pretrain_task, seed=config.seed,
                                     keep_sentence_prob=d.keep_sentence_prob)
  batches = PretrainBatches(generator, tokenizer, batch_size=config.batch_size,
                            query_max_length=d.query_max_length, doc_max_length=d.doc_max_length,
                            seed=config.seed, process_index=process_index, process_count=process_count,
                            logq=bool(config.loss.logq_correction))
  print(f"pretraining {d.pretrain_task} on {len(articles)} articles from {d.pretrain_source}: units "
        f"{generator.units}, nominal epoch {len(generator)} pairs", file=sys.stderr)
  return batches, retrieval_data(f"pretrain-{d.pretrain_source}")
