"""Supervised training data: (query, positive document) pairs and the batches built from them.

A batch is a pure function of (seed, step): the pair order is a per-epoch permutation drawn from
(seed, epoch) and the negatives are drawn from (seed, step). A resumed run therefore sees exactly the
batches it would have seen, with no data-loader state to checkpoint, and every host can build the same
global batch layout and keep only its own rows.
"""

import dataclasses
import hashlib
import pathlib
import sys
import zlib
from collections.abc import Mapping
from typing import Any, Sequence

import jax
import ml_collections
import numpy as np

from jdr.data import batch as batch_lib
from jdr.data import builtin
from jdr.data import corpus_by_host
from jdr.data import formats
from jdr.data import msmarco
from jdr.data import prepared
from jdr.data import refresh_triples
from jdr.data import text as text_lib


@dataclasses.dataclass
class RetrievalData:
  # doc id -> formats.Doc, in corpus order: a prepared.PreparedCorpus (ids, rows and token ids memory-mapped,
  # documents read from the file when asked) wherever the corpus file can be prepared, else a dict
  corpus: Mapping
  queries: dict  # query id -> text (train and eval queries)
  train_qrels: dict  # query id -> {doc id: relevance}
  eval_qrels: dict | None
  name: str
  files: msmarco.Files | None = None  # where they were read from (None: not from a dataset directory)
  # What an epoch goes over, `data.epoch_over`: it says what one training example is (DRhard's STAR dataset is
  # its queries), so it travels with the data to the batches, each mixture dataset's with its own
  epoch_over: str = "pairs"


def load(data_cfg: ml_collections.ConfigDict, workdir: str | pathlib.Path) -> RetrievalData:
  """Reads the dataset a config names, validated; every problem is raised before training starts.

  The directory is BEIR's layout or MS MARCO's own (jdr.data.msmarco). On one host a local corpus file
  (corpus.jsonl or collection.tsv) is prepared once (jdr.data.prepared: validated, indexed, memory-mapped, in
  `data.prepared_dir` when the config has one, else the user's cache folder) and read from the map after that:
  at MS MARCO's size a dict of documents was slow to read and large to hold (docs/performance-history.md, "MS
  MARCO stages before the prepared corpus"). Several hosts each parse their own part (jdr.data.corpus_by_host);
  a gzip or object-storage corpus is read whole."""
  if data_cfg.dataset == "builtin":
    directory = pathlib.Path(workdir) / "data" / "stdlib-docstrings"
    builtin.write_builtin(directory)
  else:
    directory = pathlib.Path(data_cfg.dataset)
    if not directory.is_dir():
      from jdr.runtime import config_files  # pylint: disable=g-import-not-at-top  (the refusal's one wording)
      raise FileNotFoundError(config_files.not_found("data.dataset", data_cfg.dataset,
                                                     data_cfg.get("description") or config_files.DATASET))
  where = msmarco.files(directory, data_cfg.train_split, data_cfg.eval_split)
  eval_qrels = None
  if data_cfg.source == "tfds":
    corpus, queries, train_qrels = _load_tfds(directory, data_cfg, workdir)
  elif data_cfg.source == "files":
    msmarco.check_layout(directory)
    corpus = None
    if jax.process_count() > 1 and corpus_by_host.readable_by_parts(where.corpus):
      # Each host parses only its own part; documents are read from the file when asked.
      corpus = corpus_by_host.read_by_hosts(where.corpus, workdir)
    elif jax.process_count() == 1 and prepared.can_prepare(where.corpus):
      corpus = prepared.prepare(where.corpus, out_dir=data_cfg.get("prepared_dir") or None)
    if where.layout == "msmarco":
      if corpus is None:
        corpus = formats.read_corpus(where.corpus)
      queries, train_qrels, eval_qrels = msmarco.read_splits(where, corpus)
    else:
      corpus, queries, train_qrels = formats.load_beir(directory, data_cfg.train_split, corpus=corpus)
      queries = formats.read_queries(where.train_queries)
  else:
    raise ValueError(f"data.source must be 'files' or 'tfds', got {data_cfg.source!r}")
  if data_cfg.eval_split and eval_qrels is None:
    eval_qrels = formats.read_qrels(where.eval_qrels, doc_ids=corpus, query_ids=queries)
  train_qrels = keep_fraction(train_qrels, data_cfg.get("train_fraction", 1.0))
  data = RetrievalData(corpus, queries, train_qrels, eval_qrels, directory.name, where,
                       epoch_over=data_cfg.get("epoch_over", "pairs"))
  check(data, directory, data_cfg)
  return data


def keep_fraction(qrels: dict, fraction: float) -> dict:
  """round(fraction x n) of the n training queries, those whose ids hash lowest (at least one): a fixed subset,
  the same for every seed, model and run, so a low-data row trains on the same queries everywhere."""
  if not 0.0 < fraction <= 1.0:
    raise ValueError(f"data.train_fraction must be in (0, 1], got {fraction!r}")
  if fraction == 1.0:
    return qrels
  by_hash = sorted(qrels, key=lambda qid: (zlib.crc32(qid.encode("utf-8")), qid))
  kept = by_hash[:max(1, round(fraction * len(qrels)))]
  return {q: qrels[q] for q in sorted(kept)}


def _load_tfds(directory: pathlib.Path, data_cfg: ml_collections.ConfigDict, workdir):
  """The same data through the jdr TFDS builders (array_record files, random access, no TensorFlow)."""
  from jdr.data import tfds as tfds_lib  # pylint: disable=g-import-not-at-top  (tfds imports slowly)
  data_dir = pathlib.Path(data_cfg.tfds_data_dir or pathlib.Path(workdir) / "tfds")
  name = directory.name.replace("-", "_").lower()
  tfds_lib.prepare(directory, data_dir, name=name)
  corpus = {d["doc_id"]: formats.Doc(d["doc_id"], d["title"], d["text"])
            for d in tfds_lib.load_corpus(data_dir, name)}
  queries, qrels = {}, {}
  for example in tfds_lib.load_training_examples(data_dir, name, data_cfg.train_split):
    queries[example["query_id"]] = example["query"]
    qrels.setdefault(example["query_id"], {})[example["doc_id"]] = example["relevance"]
  if data_cfg.eval_split:
    eval_queries, _ = tfds_lib.load_qrels(data_dir, name, data_cfg.eval_split)
    queries.update(eval_queries)
  return corpus, queries, qrels


def check(data: RetrievalData, directory: pathlib.Path, data_cfg: ml_collections.ConfigDict) -> None:
  """Refuses data that would train on nothing, with the file to look at."""
  where = data.files or msmarco.files(directory, data_cfg.train_split, data_cfg.eval_split)
  positives = sum(1 for q in data.train_qrels.values() for r in q.values() if r > 0)
  if not positives:
    raise ValueError(f"{where.train_qrels}: no (query, document) pair with relevance > 0 to train on")
  overlap = set(data.train_qrels) & set(data.queries)
  if not overlap:
    raise ValueError(f"{where.train_qrels}: none of its {len(data.train_qrels)} query ids is in "
                     f"{where.train_queries}; are the qrels from another dataset?")
  if data.eval_qrels is not None and not set(data.eval_qrels) & set(data.queries):
    raise ValueError(f"{where.eval_qrels}: none of its query ids is in {where.eval_queries}")


def training_pairs(qrels: dict) -> list[tuple[str, str]]:
  """Every (query, document) pair with relevance > 0, in a fixed order."""
  return sorted((q, d) for q, docs in qrels.items() for d, rel in docs.items() if rel > 0)


def training_queries(qrels: dict) -> list[str]:
  """The training queries (those with a positive) in the one order every part of jdr indexes them by: the
  batches' `query_index` rows, the negative sources' pools and caches."""
  return sorted({q for q, docs in qrels.items() if any(rel > 0 for rel in docs.values())})


def pad(rows: Sequence[np.ndarray], length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  ids = np.full((len(rows), length), pad_id, np.int32)
  mask = np.zeros((len(rows), length), np.int32)
  for i, row in enumerate(rows):
    ids[i, :len(row)] = row
    mask[i, :len(row)] = 1
  return ids, mask


EPOCHS_OVER = ("pairs", "queries")  # data.epoch_over


class Batches:
  """Global batches as a pure function of the step; `local(step)` is this process's rows.

  `prompts` ({"query", "doc"}, a model's description["prompts"]; None = none): queries are tokenized after the
  query prompt, documents (positives and negatives) after the document prompt (`text.Prompted`). A
  cross-encoder's pairs take none."""

  def __init__(self, data: RetrievalData, tokenizer: Any, *, batch_size: int, query_max_length: int,
               doc_max_length: int, negative_source=None, negatives_per_query: int = 0,
               in_batch: bool = True, seed: int = 0, process_index: int = 0, process_count: int = 1,
               candidates: str = "tokens", pair_weighting: str = "none", random_weight: float = 0.0,
               triples_per_query: int = 0, prompts: dict | None = None, mask_duplicate_texts: bool = True,
               padding_per_query: int = 0):
    self.data = data
    self.tokenizer = tokenizer
    prompts = prompts or {}
    self.query_tokenizer = text_lib.prompted(tokenizer, prompts.get("query"))
    self.doc_tokenizer = text_lib.prompted(tokenizer, prompts.get("doc"))
    self.pairs = training_pairs(data.train_qrels)
    self.batch_size = batch_size
    self.query_max_length = query_max_length
    self.doc_max_length = doc_max_length
    self.negative_source = negative_source
    self.per_query = negatives_per_query if negative_source is not None else 0
    self.in_batch = in_batch
    # A dataset without sampled negatives in a mixture whose other datasets sample n a query (jdr/data/mixture.py)
    # takes their shape, n invalid columns a query, so one jitted step serves them all (`_make_layout`).
    if padding_per_query and (self.per_query or candidates != "tokens"):
      raise ValueError("padding_per_query fills a token batch without sampled negatives to the shape of one with them")
    self.padding_per_query = padding_per_query
    self.seed = seed
    self.process_index, self.process_count = process_index, process_count
    self.pad_id = tokenizer.pad_token_id or 0
    # A prepared corpus gives rows and token ids from its map; any other mapping a {doc id: row} dict and
    # documents tokenized a batch at a time.
    self._prepared = isinstance(data.corpus, prepared.PreparedCorpus)
    self._doc_tokens = None
    if self._prepared and prepared.can_tokenize(self.doc_tokenizer):
      self._doc_tokens = data.corpus.tokenized(self.doc_tokenizer, doc_max_length, progress=process_index == 0)
    self._doc_row = None
    self._perms: dict[int, np.ndarray] = {}
    self._layout = None  # (step, global_layout(step))
    if candidates not in ("tokens", "corpus", "pairs"):
      raise ValueError(f"candidates must be 'tokens', 'corpus' or 'pairs', got {candidates!r}")
    if candidates == "pairs" and (not self.per_query or in_batch):
      raise ValueError("a cross-encoder scores each query with its own candidates: set negatives.per_query >= 1 "
                       "(and a negatives.source) and negatives.in_batch=False")
    self.candidates = candidates
    check_pair_weighting(pair_weighting, random_weight)
    self.pair_weighting, self.random_weight = pair_weighting, random_weight
    if triples_per_query and (self.per_query != 1 or in_batch or candidates != "tokens"):
      raise ValueError("negatives.ance.triples_per_query > 0 (ANCE's triples) needs negatives.per_query=1 and "
                       "negatives.in_batch=False: each triple is scored against its own negative only")
    self.triples_per_query = triples_per_query
    # How a refresh generation becomes triples (ANCE's chunks, one positive a query, readers): the source's.
    self.triple_plan = getattr(negative_source, "triple_plan", None) or refresh_triples.TriplePlan()
    if triples_per_query and self.triple_plan.readers and batch_size % self.triple_plan.readers:
      raise ValueError(f"batch_size={batch_size} must be a multiple of negatives.ance.triple_readers="
                       f"{self.triple_plan.readers}: each reader gives a batch the same number of triples")
    self._lines: tuple[int, np.ndarray] | None = None  # (generation, its lines): refresh_triples.lines
    if data.epoch_over not in EPOCHS_OVER:
      raise ValueError(f"data.epoch_over must be one of {', '.join(EPOCHS_OVER)}, got {data.epoch_over!r}")
    self.epoch_over = data.epoch_over
    # Negatives that are a positive's text under another id are masked like the positive (batch.candidate_mask).
    self._text_keys = self.text_keys if mask_duplicate_texts else None
    self._positives = {d for q in data.train_qrels.values() for d, rel in q.items() if rel > 0}
    self._positive_keys: dict[str, bytes] = {}
    self._masked: dict[str, int] = {}  # negatives masked as duplicates of a positive, since the last log line
    self._layouts_built = 0
    self._triple_perms: dict[tuple[int, int], np.ndarray] = {}
    # Training queries in a fixed order: `query_index` rows of a batch point into it.
    self.train_qids = training_queries(data.train_qrels)
    self.query_row = {q: i for i, q in enumerate(self.train_qids)}
    # Every query's positives, its batch positive first (the missing-positive rules put them in the list).
    self.max_positives = max(sum(1 for r in data.train_qrels[q].values() if r > 0) for q in self.train_qids)

  @property
  def examples_per_epoch(self) -> int:
    return len(self.train_qids) if self.epoch_over == "queries" else len(self.pairs)

  def _permutation(self, epoch: int) -> np.ndarray:
    """The rows of `self.pairs` epoch `epoch` trains on, in order: every pair once, or with epoch_over=queries
    every training query once with one of its pairs drawn uniformly (DRhard's `random.choice` of a query's
    positives), so a query fills one row of a batch at most; where each query has one positive the two agree."""
    if epoch not in self._perms:
      rng = np.random.default_rng([self.seed, epoch])
      order = rng.permutation(self.examples_per_epoch)
      if self.epoch_over == "queries":
        first, count = self._query_pairs()
        order = first[order] + (rng.random(len(order)) * count[order]).astype(np.int64)
      self._perms = {epoch: order}
    return self._perms[epoch]

  def _query_pairs(self) -> tuple[np.ndarray, np.ndarray]:
    """(first row, number of rows) of each training query's pairs in `self.pairs`, in `train_qids` order."""
    starts = [i for i in range(len(self.pairs)) if i == 0 or self.pairs[i][0] != self.pairs[i - 1][0]]
    return np.array(starts, np.int64), np.diff(np.array(starts + [len(self.pairs)], np.int64))

  def queries_drawn(self, steps: int) -> list[str]:
    """The training queries the batches of steps 0 .. steps - 1 hold, sorted: every one once an epoch is
    reached (and with ANCE's triples, whose order depends on the refresh), else the first steps x batch_size
    pairs of epoch 0's order. What a teacher must score up front for a run shorter than an epoch."""
    if self.triples_per_query or steps * self.batch_size >= self.examples_per_epoch:
      return list(self.train_qids)
    return sorted({self.pairs[i][0] for i in self._permutation(0)[:steps * self.batch_size].tolist()})

  def pair_indices(self, step: int) -> np.ndarray:
    positions = step * self.batch_size + np.arange(self.batch_size)
    epochs, within = np.divmod(positions, self.examples_per_epoch)
    return np.array([self._permutation(int(e))[i] for e, i in zip(epochs, within)])

  def global_layout(self, step: int) -> tuple[list[str], list[str], np.ndarray]:
    """(query ids [B], document ids [C], valid [B, C]) of the batch at `step`; see jdr/data/batch.py.

    The last step's layout is kept: the distiller asks for the step `local` just built, and sampling it again
    would redo the work and count the sampler's statistics twice."""
    if self._layout is not None and self._layout[0] == step:
      return self._layout[1]
    self._layout = (step, self._make_layout(step))
    return self._layout[1]

  def log_scalars(self) -> dict[str, float]:
    """What the batches since the last call masked, per batch: negatives that duplicate a positive's text."""
    if self._text_keys is None or not self._layouts_built:
      return {}
    out = {"masked_duplicate_texts": self._masked.get("duplicate_texts", 0) / self._layouts_built}
    self._masked.clear()
    self._layouts_built = 0
    return out

  def _make_layout(self, step: int) -> tuple[list[str], list[str], np.ndarray]:
    self._layouts_built += 1
    if self.triples_per_query:
      return self._triples_layout(step)
    chosen = [self.pairs[i] for i in self.pair_indices(step)]
    qids = [q for q, _ in chosen]
    doc_ids = [d for _, d in chosen]
    if self.per_query:
      rng = np.random.default_rng([self.seed, step, 1])
      sampled = self.negative_source.sample(qids, doc_ids, rng, self.per_query)
      doc_ids = doc_ids + [d for row in sampled for d in row]
    valid = batch_lib.candidate_mask(qids, doc_ids, self.data.train_qrels, in_batch=self.in_batch,
                                     text_keys=self._text_keys, counts=self._masked)
    if self.padding_per_query:
      # The columns repeat the batch's positives, so every column holds a real document's tokens (a pooling
      # over no token at all is not defined for every tower), and are invalid for every row: never scored.
      doc_ids = doc_ids + [d for d in doc_ids for _ in range(self.padding_per_query)]
      valid = np.concatenate([valid, np.zeros((len(qids), len(doc_ids) - valid.shape[1]), bool)], axis=1)
    return qids, doc_ids, valid

  def _triples_layout(self, step: int) -> tuple[list[str], list[str], np.ndarray]:
    """ANCE's batches of triples (`run_ann_data_gen.py`, `GetTripletTrainingDataProcessingFn`): each refresh
    generation turns its lines (`refresh_triples.lines`: (query, positive) pairs) into `triples_per_query`
    (query, positive, negative) triples each, the negatives drawn without replacement from the query's pool of
    that generation, read in the order `self.triple_plan` gives; a batch row sees one triple's one negative.

    Still a pure function of (seed, step): the generation in force at `step` and the step its schedule puts
    it in force come from the negative source (`generation(step)`), the triples of pair i from
    (seed, generation, i) and their order from (seed, generation) (and, shuffled, the pass over them)."""
    k, plan = self.triples_per_query, self.triple_plan
    generation, since = self.negative_source.generation(step)
    lines = self._generation_lines(generation)
    if plan.readers:
      at, slots = refresh_triples.reader_rows(step - since, self.batch_size, len(lines), k, plan.readers)
    else:
      positions = (step - since) * self.batch_size + np.arange(self.batch_size)
      passes, within = np.divmod(positions, len(lines) * k)
      picked = np.array([self._triple_order(generation, int(e), len(lines))[i] for e, i in zip(passes, within)])
      at, slots = np.divmod(picked, k)
    pair_rows = lines[at]
    chosen = [self.pairs[i] for i in pair_rows]
    qids, positives = [q for q, _ in chosen], [d for _, d in chosen]
    negatives = [self._pair_negatives(generation, int(i))[j] for i, j in zip(pair_rows, slots)]
    doc_ids = positives + negatives
    # A line's own positive is its only one (triples_over=queries: ANCE trains its query's other positives as
    # negatives, so they are not masked); else every positive of the query is masked.
    qrels = {q: {d: 1} for q, d in chosen} if plan.over == "queries" else self.data.train_qrels
    valid = batch_lib.candidate_mask(qids, doc_ids, qrels, in_batch=False,
                                     text_keys=self._text_keys, counts=self._masked)
    return qids, doc_ids, valid

  def _generation_lines(self, generation: int) -> np.ndarray:
    if self._lines is None or self._lines[0] != generation:
      self._lines = (generation, refresh_triples.lines(self.pairs, self.data.train_qrels, self.triple_plan,
                                                       generation, self.seed))
    return self._lines[1]

  def _triple_order(self, generation: int, epoch: int, num_lines: int) -> np.ndarray:
    key = (generation, epoch)
    if key not in self._triple_perms:
      size = num_lines * self.triples_per_query
      self._triple_perms = {key: np.random.default_rng([self.seed, generation, epoch, 2]).permutation(size)}
    return self._triple_perms[key]

  def _pair_negatives(self, generation: int, pair_row: int) -> list[str]:
    q, d = self.pairs[pair_row]
    rng = np.random.default_rng([self.seed, generation, pair_row, 3])
    if self.triple_plan.over == "queries":  # only the line's positive is skipped (ANCE's GenerateNegativePassaageID)
      return self.negative_source.sample([q], [d], rng, self.triples_per_query, keep_other_positives=True)[0]
    return self.negative_source.sample([q], [d], rng, self.triples_per_query)[0]

  def text_keys(self, doc_ids: Sequence[str]) -> list[bytes]:
    """A 16-byte hash per document of the text it is encoded as (`text.doc_text`): equal texts, equal keys.
    The training positives' keys are kept (as many as the qrels hold), every other one read again."""
    missing = sorted({d for d in doc_ids if d not in self._positive_keys})
    if self._prepared:
      texts = self.data.corpus.texts(self.doc_rows(missing)) if missing else []
    else:
      texts = [text_lib.doc_text(self.data.corpus[d]) for d in missing]
    read = {d: hashlib.blake2b(t.encode(), digest_size=16).digest() for d, t in zip(missing, texts)}
    self._positive_keys.update((d, k) for d, k in read.items() if d in self._positives)
    return [self._positive_keys.get(d) or read[d] for d in doc_ids]

  def _tokens(self, tokenizer, texts: list[str], max_length: int) -> tuple[np.ndarray, np.ndarray]:
    return pad(text_lib.tokenize(tokenizer, texts, max_length), max_length, self.pad_id)

  def _query_batch(self, qids: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, mask) [n, query_max_length] of queries, each after the query prompt."""
    return self._tokens(self.query_tokenizer, [self.data.queries[q] for q in qids], self.query_max_length)

  def doc_rows(self, doc_ids: Sequence[str]) -> np.ndarray:
    """int32 corpus rows of `doc_ids` (a KeyError names an id the corpus lacks)."""
    if self._prepared:
      return self.data.corpus.row_of(doc_ids).astype(np.int32)
    if self._doc_row is None:
      self._doc_row = {d: i for i, d in enumerate(self.data.corpus)}
    return np.array([self._doc_row[d] for d in doc_ids], np.int32).reshape(-1)

  def _doc_batch(self, doc_ids: Sequence[str], rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, mask) [n, doc_max_length] of documents: read from the prepared map, else tokenized."""
    if self._doc_tokens is not None:
      return self._doc_tokens.tokens(rows, self.doc_max_length)
    return self._tokens(self.doc_tokenizer, [text_lib.doc_text(self.data.corpus[d]) for d in doc_ids],
                        self.doc_max_length)

  def local(self, step: int) -> dict[str, np.ndarray]:
    """This process's rows of the global batch at `step`, as numpy arrays (see jdr/data/batch.py)."""
    if self.candidates == "corpus":
      return self._local_corpus(step)
    if self.candidates == "pairs":
      return self._local_pairs(step)
    qids, doc_ids, valid = self.global_layout(step)
    q_lo, q_hi = self.host_rows(len(qids))
    d_lo, d_hi = self.host_rows(len(doc_ids))
    query_ids, query_mask = self._query_batch(qids[q_lo:q_hi])
    doc_index = self.doc_rows(doc_ids[d_lo:d_hi])
    doc_tokens, doc_mask = self._doc_batch(doc_ids[d_lo:d_hi], doc_index)
    batch = {"query_ids": query_ids, "query_mask": query_mask, "doc_ids": doc_tokens, "doc_mask": doc_mask,
             "doc_index": doc_index, "valid": valid[q_lo:q_hi]}
    weights = pair_weights(valid, self.per_query, self.pair_weighting, self.random_weight)
    if weights is not None:
      batch["weights"] = weights[q_lo:q_hi]
    return batch

  def _local_corpus(self, step: int) -> dict[str, np.ndarray]:
    """Queries and their positives as corpus rows; the candidates come from retrieval (ADORE / LTRe)."""
    chosen = [self.pairs[i] for i in self.pair_indices(step)]
    lo, hi = self.host_rows(len(chosen))
    chosen = chosen[lo:hi]
    query_ids, query_mask = self._query_batch([q for q, _ in chosen])
    positive_rows = np.full((len(chosen), self.max_positives), -1, np.int32)
    positives = [[d] + [o for o, r in self.data.train_qrels[q].items() if r > 0 and o != d] for q, d in chosen]
    rows, at = self.doc_rows([d for docs in positives for d in docs]), 0
    for b, docs in enumerate(positives):
      positive_rows[b, :len(docs)] = rows[at:at + len(docs)]
      at += len(docs)
    return {"query_ids": query_ids, "query_mask": query_mask, "positive_rows": positive_rows,
            "query_index": np.array([self.query_row[q] for q, _ in chosen], np.int32)}

  def _local_pairs(self, step: int) -> dict[str, np.ndarray]:
    """Cross-encoder batches: each query joined with its positive (column 0) and its own sampled negatives,
    `pair_ids` / `pair_mask` / `pair_types` [B, 1 + n, L] with L = doc_max_length (the query truncated to
    query_max_length first), `valid` [B, 1 + n] (a sampled negative that is a positive of the query is not a
    negative) and `labels` [B, 1 + n] (1 in column 0)."""
    qids, doc_ids, valid = self.global_layout(step)
    num, per = len(qids), self.per_query
    lo, hi = self.host_rows(num)
    columns = [[b] + [num + b * per + j for j in range(per)] for b in range(lo, hi)]
    length, n = self.doc_max_length, 1 + per
    ids = np.full((hi - lo, n, length), self.pad_id, np.int32)
    types = np.zeros((hi - lo, n, length), np.int32)
    mask = np.zeros((hi - lo, n, length), np.int32)
    cells = [(r, c) for r, cols in enumerate(columns) for c in range(len(cols))]
    tokenized = text_lib.pairs_tokens(
        self.tokenizer, [(self.data.queries[qids[lo + r]], text_lib.doc_text(self.data.corpus[doc_ids[columns[r][c]]]))
                         for r, c in cells], length, self.query_max_length)
    for (r, c), (tokens, token_types) in zip(cells, tokenized):
      ids[r, c, :len(tokens)], types[r, c, :len(tokens)], mask[r, c, :len(tokens)] = tokens, token_types, 1
    labels = np.zeros((hi - lo, n), np.float32)
    labels[:, 0] = 1.0
    pair_valid = np.stack([valid[b, cols] for b, cols in zip(range(lo, hi), columns)])
    return {"pair_ids": ids, "pair_mask": mask, "pair_types": types, "valid": pair_valid, "labels": labels}

  def host_rows(self, n: int) -> tuple[int, int]:
    per = n // self.process_count
    return self.process_index * per, (self.process_index + 1) * per


PAIR_WEIGHTINGS = ("none", "batch_mean", "alpha")


def check_pair_weighting(weighting: str, alpha: float) -> None:
  """Refuses a `negatives.pair_weighting` / `negatives.random_weight` combination that would be ignored."""
  if weighting not in PAIR_WEIGHTINGS:
    raise ValueError(f"negatives.pair_weighting must be one of {', '.join(PAIR_WEIGHTINGS)}; got {weighting!r}")
  if (weighting == "alpha") != bool(alpha):
    raise ValueError("negatives.random_weight (STAR's alpha) is read only with negatives.pair_weighting=alpha, "
                     f"which needs it > 0; got pair_weighting={weighting!r}, random_weight={alpha!r}")


def pair_weights(valid: np.ndarray, per_query: int, weighting: str, alpha: float = 0.0) -> np.ndarray | None:
  """Pair weights [B, C] for the pairwise losses (which average each row over its pairs, then the rows), or
  None for their plain per-row mean.

  batch_mean: one mean over every (query, negative) pair of the batch, a query's own hard negatives in the same
    pool as the other rows' documents: STAR as its authors ran it (DRhard `model.py`, `inbatch_train`: the
    summed losses of both parts over their summed counts). Row b's pairs get B * n_b / N (n_b its negatives,
    N the batch's), so the mean over rows of each row's weighted mean is the sum over pairs / N.
  alpha: STAR's Eq. 13, L_s + alpha * L_r on per-row means of each part (`star_weights`).
  """
  if weighting == "none":
    return None
  if weighting == "alpha":
    return star_weights(valid, per_query, alpha)
  num_queries, num_docs = valid.shape
  negative = valid & ~np.eye(num_queries, num_docs, dtype=bool)
  count = negative.sum(1, keepdims=True).astype(np.float64)
  total = max(float(count.sum()), 1.0)
  return np.where(negative, num_queries * count / total, 0.0).astype(np.float32)


def star_weights(valid: np.ndarray, per_query: int, alpha: float) -> np.ndarray:
  """Pair weights [B, C] that make the mean pairwise loss STAR's L_s + alpha * L_r (Eq. 13).

  Row b's own sampled (static hard) negatives form L_s; every other valid column of the batch (the other
  queries' positives and hard negatives, reused as random negatives, STAR Fig. 1b) forms L_r. The losses
  divide a row's weighted sum by its number of valid negatives, so each part is rescaled to its own mean.
  """
  num_queries, num_docs = valid.shape
  own = np.zeros_like(valid)
  for b in range(num_queries):
    own[b, num_queries + b * per_query:num_queries + (b + 1) * per_query] = True
  negative = valid & ~np.eye(num_queries, num_docs, dtype=bool)
  hard, rand = negative & own, negative & ~own
  count = negative.sum(1, keepdims=True).astype(np.float32)
  n_hard = np.maximum(hard.sum(1, keepdims=True), 1)
  n_rand = np.maximum(rand.sum(1, keepdims=True), 1)
  return np.where(hard, count / n_hard, np.where(rand, alpha * count / n_rand, 0.0)).astype(np.float32)


def describe_counts(data: RetrievalData, batches: Batches, file=None) -> None:
  # sys.stderr is looked up at call time: a default bound at import would outlive a replaced stream.
  print(f"data {data.name}: {len(data.corpus)} documents, {len(batches.pairs)} training pairs, "
        f"{len(data.eval_qrels or {})} evaluation queries", file=file or sys.stderr)
