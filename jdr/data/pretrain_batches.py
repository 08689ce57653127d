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

MLM (data.pretrain_task="mlm", `MLMBatches`): the masked-LM baseline on the same text, B passages drawn
uniformly ("title [SEP] passage", the ICT document before a sentence is taken out), 15% of their tokens
chosen with BERT's 80/10/10 rule (pretrain.mask_tokens). Predictions are gathered at `mlm_positions [B, P]`
with P = `max_predictions(L)` (32 at 128 tokens, three standard deviations above the mean count): the rare
rows with more chosen tokens keep the first P, and the others are restored to their own token (not left masked without
a label); `MLMBatches.capped` counts them.
"""

from __future__ import annotations

import math
import pathlib
import sys
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from jdr.data import articles as articles_lib
from jdr.data import pairs as pairs_lib
from jdr.data import pretrain
from jdr.data import shared
from jdr.data import text as text_lib

SOURCES = ("wikispeedia", "builtin")  # or the path of a MediaWiki XML dump
TASKS = ("ict", "bfs", "wlp", "mixed")
MLM_PROB = 0.15


def check(config: ml_collections.ConfigDict) -> None:
  """Refuses pretraining settings the trainer cannot run, before anything is read."""
  d = config.data
  if d.kind not in ("pairs", "pretrain"):
    raise ValueError(f"data.kind must be 'pairs' or 'pretrain', got {d.kind!r}")
  if d.kind != "pretrain":
    return
  if d.pretrain_task == "mlm":
    m = config.model
    if not m.shared or m.get("tower", "transformer") != "transformer":
      raise ValueError("data.pretrain_task='mlm' trains one shared transformer tower: set model.shared=True "
                       "and model.tower=transformer")
    if config.grad_cache.chunk_size or config.loss.logq_correction:
      raise ValueError("data.pretrain_task='mlm' has no batch softmax: set grad_cache.chunk_size=0 and "
                       "loss.logq_correction=False")
    return
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
  """Global pretraining batches as a pure function of the step; `local(step)` is this process's rows.

  `prompts` ({"query", "doc"}; None = none): pseudo-queries are tokenized after the query prompt, passages
  (title, text) after the document prompt, before the title (`text.Prompted`)."""

  def __init__(self, generator: pretrain.PretrainPairs, tokenizer: Any, *, batch_size: int,
               query_max_length: int, doc_max_length: int, seed: int = 0, process_index: int = 0,
               process_count: int = 1, logq: bool = False, prompts: dict | None = None):
    self.generator = generator
    self.tokenizer = tokenizer
    self.query_tokenizer = text_lib.prompted(tokenizer, (prompts or {}).get("query"))
    self.doc_tokenizer = text_lib.prompted(tokenizer, (prompts or {}).get("doc"))
    self.batch_size = batch_size
    self.query_max_length, self.doc_max_length = query_max_length, doc_max_length
    self.seed = seed
    self.process_index, self.process_count = process_index, process_count
    self.pad_id = tokenizer.pad_token_id or 0
    self.logq = logq
    if logq:
      self._passage_logq = passage_log_probs(generator)

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
    query_ids, query_mask = pairs_lib.pad(
        [np.asarray(t, np.int32) for t in self.query_tokenizer(
            [d.pair.query for d in mine], truncation=True, max_length=self.query_max_length,
            return_attention_mask=False, return_token_type_ids=False)["input_ids"]],
        self.query_max_length, self.pad_id)
    doc_ids, doc_mask = pairs_lib.pad(
        [np.asarray(t, np.int32) for t in self.doc_tokenizer(
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


def passage_log_probs(gen: pretrain.PretrainPairs) -> dict[tuple, float]:
  """log of P(document passage) = sum over the generator's tasks of P(task) P(passage | task)."""
  probs: dict[tuple, float] = {}
  p_task = 1.0 / len(gen.tasks)

  def add(key, p):
    probs[key] = probs.get(key, 0.0) + p

  for task in gen.tasks:
    units = gen.units[task]
    if task == "ict":
      for a, places in zip(gen.articles, gen.passage_places):
        for s, p in places:
          add((a.id, s, p), p_task / units)
    elif task == "bfs":
      for a, places in zip(gen.articles, gen.body_places):
        if a.lead:
          for s, p in places:
            add((a.id, s, p), p_task / units)
    else:  # wlp: a uniform link, then (approximately) a uniform passage of the linking article
      for i, _ in gen.link_units.tolist():
        places = gen.passage_places[i]
        for s, p in places:
          add((gen.articles[i].id, s, p), p_task / units / len(places))
  return {k: float(np.log(v)) for k, v in probs.items()}


def max_predictions(length: int) -> int:
  """Masked positions scored per row (BERT's max_predictions_per_seq): the mean 15% of the length plus three
  standard deviations of the binomial count, so about 1 row in 700 is capped (32 at 128 tokens)."""
  mean = MLM_PROB * length
  return max(1, math.ceil(mean + 3 * math.sqrt(mean * (1 - MLM_PROB))))


class MLMBatches:
  """Masked-LM batches as a pure function of the step: `mlm_ids`, `mlm_mask` [B, L] (the masked passages),
  `mlm_positions`, `mlm_labels` [B, P] (int32) and `mlm_weights` [B, P] (1.0 where a prediction counts)."""

  def __init__(self, generator: pretrain.PretrainPairs, tokenizer: Any, *, batch_size: int, max_length: int,
               seed: int = 0, process_index: int = 0, process_count: int = 1):
    self.generator, self.tokenizer = generator, tokenizer
    self.batch_size, self.max_length, self.seed = batch_size, max_length, seed
    self.process_index, self.process_count = process_index, process_count
    self.pad_id = tokenizer.pad_token_id or 0
    self.predictions = max_predictions(max_length)
    self.special_ids = sorted(set(tokenizer.all_special_ids))
    self.capped = 0  # tokens chosen beyond `predictions` in a row and restored (counted, logged)

  @property
  def examples_per_epoch(self) -> int:
    return self.generator.units["ict"]

  def local(self, step: int) -> dict[str, np.ndarray]:
    per = self.batch_size // self.process_count
    first = step * self.batch_size + self.process_index * per
    passages = [self.generator.passage(i) for i in range(first, first + per)]
    ids, mask = pairs_lib.pad(
        [np.asarray(t, np.int32) for t in self.tokenizer(
            [p[1] for p in passages], [p[2] for p in passages], truncation="longest_first",
            max_length=self.max_length, return_attention_mask=False, return_token_type_ids=False)["input_ids"]],
        self.max_length, self.pad_id)
    p = self.predictions
    out = {"mlm_ids": np.empty_like(ids), "mlm_mask": mask, "mlm_positions": np.zeros((per, p), np.int32),
           "mlm_labels": np.zeros((per, p), np.int32), "mlm_weights": np.zeros((per, p), np.float32)}
    for r in range(per):
      rng = np.random.default_rng([self.seed, first + r, 2])
      masked, labels = pretrain.mask_tokens(ids[r], rng, self.tokenizer.vocab_size, self.tokenizer.mask_token_id,
                                            self.special_ids, MLM_PROB)
      chosen = np.flatnonzero(labels >= 0)
      if len(chosen) > p:
        self.capped += len(chosen) - p
        masked[chosen[p:]] = ids[r, chosen[p:]]
        chosen = chosen[:p]
      out["mlm_ids"][r] = masked
      out["mlm_positions"][r, :len(chosen)] = chosen
      out["mlm_labels"][r, :len(chosen)] = labels[chosen]
      out["mlm_weights"][r, :len(chosen)] = 1.0
    return out


def is_masked_lm(config: ml_collections.ConfigDict) -> bool:
  return config.data.kind == "pretrain" and config.data.pretrain_task == "mlm"


def masked_lm_loss(model, params, batch: dict[str, jax.Array], rng: jax.Array) -> tuple[jax.Array, dict]:
  """The loss the step trains on `MLMBatches` (Chang et al. 2020's baseline): BERT's token cross-entropy at
  the chosen positions only, through the tower's masked-LM head (`mlm_logits`)."""
  logits = model.apply({"params": params}, batch["mlm_ids"], batch["mlm_mask"], batch["mlm_positions"],
                       deterministic=False, rngs={"dropout": rng}, method="mlm_logits")
  weights = batch["mlm_weights"]
  per_token = optax.softmax_cross_entropy_with_integer_labels(logits, batch["mlm_labels"])
  total = jnp.maximum(jnp.sum(weights), 1.0)
  hits = (jnp.argmax(logits, axis=-1) == batch["mlm_labels"]) * weights
  return jnp.sum(per_token * weights) / total, {"train_accuracy": jnp.sum(hits) / total}


def make(config: ml_collections.ConfigDict, tokenizer: Any, *, process_index: int = 0,
         process_count: int = 1, prompts: dict | None = None) -> tuple[PretrainBatches | MLMBatches,
                                                                        pairs_lib.RetrievalData]:
  """The batches of a pretraining config and the (empty) RetrievalData the rest of the trainer expects.
  `prompts`: the model's {"query", "doc"} prompts, for the retrieval tasks' pairs (masked LM takes none)."""
  check(config)
  d = config.data
  articles, report = load_articles(d)
  print(report, file=sys.stderr)
  if d.pretrain_task == "mlm":
    generator = pretrain.PretrainPairs(articles, "ict", seed=config.seed)
    batches = MLMBatches(generator, tokenizer, batch_size=config.batch_size, max_length=d.doc_max_length,
                         seed=config.seed, process_index=process_index, process_count=process_count)
    print(f"pretraining mlm on {len(articles)} articles from {d.pretrain_source}: {generator.units['ict']} "
          f"passages, {batches.predictions} predictions per row at most", file=sys.stderr)
    return batches, retrieval_data(f"pretrain-{d.pretrain_source}")
  generator = pretrain.PretrainPairs(articles, d.pretrain_task, seed=config.seed,
                                     keep_sentence_prob=d.keep_sentence_prob)
  batches = PretrainBatches(generator, tokenizer, batch_size=config.batch_size,
                            query_max_length=d.query_max_length, doc_max_length=d.doc_max_length,
                            seed=config.seed, process_index=process_index, process_count=process_count,
                            logq=bool(config.loss.logq_correction), prompts=prompts)
  print(f"pretraining {d.pretrain_task} on {len(articles)} articles from {d.pretrain_source}: units "
        f"{generator.units}, nominal epoch {len(generator)} pairs", file=sys.stderr)
  return batches, retrieval_data(f"pretrain-{d.pretrain_source}")
