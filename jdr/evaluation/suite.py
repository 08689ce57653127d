"""The evaluation suite: a fixed set of small retrieval tasks scored at each of the trainer's evaluations, beside
its own, so a run shows whether it over-fits its own domain (NanoBEIR's idea for sentence-transformers users).

  eval.suite = "scifact,trec-dl-sample,reqa-squad"     the shared data folder's tasks (`NAMED`, jdr.data.shared)
  eval.suite = "scifact:train,/data/nfcorpus"           NAME:SPLIT picks a task's qrels; a path is a BEIR directory

A task is its test split's qrels (dev where it has no test split), its queries capped at eval.suite_max_queries
and its corpus at eval.suite_max_docs: the evaluated queries' judged documents, every one of them, plus a fixed
sample of the others (`choose_queries`, `sample_rows`). Both samples are drawn with `SAMPLE_SEED`, not the run's
seed, so every evaluation of every run scores the same queries against the same documents, and curves compare.
Each task is read, capped and tokenized once per run (`load_task`: arrays of token ids, nothing kept per
document but its id); every evaluation encodes them with the trainer's towers (`tower_encoder.TowerEncoder`: its
prompts, batching and compiled shapes), searches exactly on the host and scores with `jdr.evaluation.metrics`.

Metrics (eval.metrics' names): "suite/TASK/ndcg@10" for each task and "suite/mean/ndcg@10", the mean over tasks
(each task counts once, as NanoBEIR averages); the trainer logs them under "eval/".
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Mapping, Sequence

import jax
import ml_collections
import numpy as np

from jdr.data import formats
from jdr.data import prepared
from jdr.data import shared
from jdr.data import text as text_lib
from jdr.evaluation import metrics as metrics_lib
from jdr.retrieval import tower_encoder
from jdr.retrieval import host_search
from jdr.runtime import config_files
from jdr.runtime import paths

# The names eval.suite resolves in the shared data folder ($JDR_SHARED_DATA, else ../shared/data beside the
# project), and the folder each one is.
NAMED = {"scifact": "scifact", "trec-dl-sample": "trec-dl-2019-passage-sample", "reqa-squad": "reqa-squad-sample"}
# A task's split when eval.suite does not name one: the first of these its qrels folder holds.
DEFAULT_SPLITS = ("test", "dev")
# The mean over tasks is logged as a task of this name.
MEAN = "mean"
# Fixed, not config.seed: a run of any seed scores the same queries and documents, so runs compare.
SAMPLE_SEED = 0


@dataclasses.dataclass(frozen=True)
class TaskSpec:
  """One entry of eval.suite, resolved: the name its metrics carry, its BEIR directory and split."""
  name: str
  path: paths.epath.Path
  split: str


def parse_entry(entry: str) -> tuple[str, str | None]:
  """"scifact:dev" -> ("scifact", "dev"); a path keeps its colons ("gs://b/nfcorpus" has no split)."""
  head, sep, tail = entry.rpartition(":")
  if sep and head and tail and "/" not in tail:
    return head, tail
  return entry, None


def resolve(entry: str) -> TaskSpec:
  """The task an eval.suite entry names, checked on disk (a stat per file): a ConfigError naming the task, the
  path and the key when its directory, its files or its split are missing."""
  spec, split = parse_entry(entry.strip())
  if spec in NAMED:
    name, path = spec, paths.as_path(shared.shared_data_dir() / NAMED[spec])
    where = f"the shared data folder's {NAMED[spec]} ($JDR_SHARED_DATA, else ../shared/data beside the project)"
  else:
    path = paths.as_path(spec)
    name, where = path.name, "a BEIR directory: corpus.jsonl, queries.jsonl, qrels/SPLIT.tsv"
  known = ", ".join(NAMED)
  if not path.is_dir():
    raise config_files.ConfigError(f"eval.suite: task {name!r}: {path}: directory not found ({where}; the named "
                                   f"tasks are {known}, any other entry is a BEIR directory's path)")
  for needed in ("corpus.jsonl", "queries.jsonl"):
    if not (path / needed).is_file():
      raise config_files.ConfigError(f"eval.suite: task {name!r}: {path / needed}: file not found ({where})")
  qrels = path / "qrels"
  splits = sorted(p.stem for p in qrels.glob("*.tsv")) if qrels.is_dir() else []
  if split is None:
    split = next((s for s in DEFAULT_SPLITS if s in splits), None)
    if split is None:
      raise config_files.ConfigError(
          f"eval.suite: task {name!r}: {qrels} holds no {' or '.join(f'{s}.tsv' for s in DEFAULT_SPLITS)} (splits: "
          f"{', '.join(splits) or 'none'}); name one in eval.suite as {name}:SPLIT")
  elif split not in splits:
    raise config_files.ConfigError(f"eval.suite: task {name!r}: no split {split!r}: {qrels / (split + '.tsv')} is "
                                   f"missing (splits: {', '.join(splits) or 'none'})")
  return TaskSpec(name, path, split)


def check(config: ml_collections.ConfigDict) -> list[TaskSpec]:
  """eval.suite's tasks, resolved, before anything is read or trained ([] when the suite is off); a ConfigError
  for a missing task, an unknown split, two tasks of one name or a model the suite cannot encode with (the caps'
  ranges are jdr.runtime.settings')."""
  ev = config.eval
  entries = [e.strip() for e in ev.suite.split(",") if e.strip()]
  if not entries:
    return []
  if config.model.architecture != "two_tower":
    raise config_files.ConfigError(f"eval.suite={ev.suite!r}: the suite ranks each task's corpus with the towers' "
                                   f"vectors; model.architecture={config.model.architecture!r} has none (set "
                                   "eval.suite=\"\")")
  specs = [resolve(e) for e in entries]
  names = [s.name for s in specs]
  for name in names:
    if names.count(name) > 1 or name == MEAN:
      why = "is the name of the mean over tasks" if name == MEAN else "names two tasks"
      raise config_files.ConfigError(f"eval.suite={ev.suite!r}: {name!r} {why}; their metrics would share keys "
                                     "(copy or link one directory under another name)")
  return specs


# ----------------------------------------------------------------------------------------------------------- capping


def choose_queries(qrels: Mapping[str, Mapping[str, int]], max_queries: int, max_docs: int,
                   seed: int = SAMPLE_SEED) -> list[str]:
  """The queries a task scores: those with a relevant document, in an order drawn with `seed`, the longest run of
  that order (at most `max_queries`) whose judged documents together fit in `max_docs` (0: no limit, for either).
  Stopping at the first that does not fit, rather than skipping it, keeps the sample from favouring shallowly judged
  queries (TREC DL's sample judges ~95 passages a query: 16 queries fill a 2,000-document cap). Sorted by id."""
  eligible = sorted(q for q, docs in qrels.items() if any(r > 0 for r in docs.values()))
  order = np.random.default_rng(seed).permutation(len(eligible))
  chosen, judged = [], set()
  for i in order:
    qid = eligible[int(i)]
    if max_queries and len(chosen) == max_queries:
      break
    new = set(qrels[qid]) - judged
    if max_docs and len(judged) + len(new) > max_docs:
      break
    chosen.append(qid)
    judged |= new
  return sorted(chosen)


def sample_rows(num_docs: int, judged_rows: np.ndarray, max_docs: int, seed: int = SAMPLE_SEED) -> np.ndarray:
  """int64 rows, ascending, of a corpus of `num_docs` capped at `max_docs`: every judged row, then other rows drawn
  with `seed` up to the cap (the whole corpus when it fits, or when `max_docs` is 0). A pure function of its
  arguments: the same rows at every evaluation and in every run."""
  judged_rows = np.unique(np.asarray(judged_rows, np.int64))
  if not max_docs or num_docs <= max_docs:
    return np.arange(num_docs, dtype=np.int64)
  if len(judged_rows) > max_docs:
    raise ValueError(f"{len(judged_rows)} judged documents do not fit in a cap of {max_docs}")
  wanted = max_docs - len(judged_rows)
  # Drawing wanted + judged rows without replacement leaves at least `wanted` unjudged ones (numpy draws a few
  # rows of a large corpus without a permutation of all of it).
  drawn = np.random.default_rng(seed).choice(num_docs, size=min(num_docs, max_docs + len(judged_rows)), replace=False)
  others = drawn[~np.isin(drawn, judged_rows)][:wanted]
  return np.sort(np.concatenate([judged_rows, others.astype(np.int64)]))


def token_rows(token_ids: Sequence[np.ndarray]) -> prepared.TokenRows:
  """Unpadded token id arrays as one table (ids back to back, offsets): one array, not an object a text."""
  lengths = np.fromiter((len(t) for t in token_ids), np.int64, len(token_ids))
  offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
  tokens = np.concatenate(token_ids).astype(np.int32) if len(token_ids) else np.zeros(0, np.int32)
  return prepared.TokenRows(tokens, offsets)


@dataclasses.dataclass
class Task:
  """A task read, capped and tokenized: what each evaluation encodes and scores."""
  spec: TaskSpec
  qids: list[str]  # the evaluated queries
  qrels: dict  # their judgments, every judged document of which is in `doc_ids`
  doc_ids: list[str]  # the kept documents (at most eval.suite_max_docs ids), in corpus order
  doc_tokens: prepared.TokenRows  # their token ids (the document prompt first), rows as doc_ids
  query_tokens: prepared.TokenRows  # the queries' (the query prompt first), rows as qids
  all_queries: int  # queries of the split with a relevant document
  all_docs: int  # documents of the whole corpus
  judged_docs: int  # documents judged for the evaluated queries (all kept)

  @property
  def capped(self) -> bool:
    return len(self.doc_ids) < self.all_docs

  def describe(self) -> str:
    """"scifact 50 of 300 queries, 2,000 of 5,183 documents (capped)" or "reqa-squad 50 of 231 queries, 382
    documents"."""
    docs = (f"{len(self.doc_ids):,} of {self.all_docs:,} documents (capped)" if self.capped else
            f"{self.all_docs:,} documents")
    return f"{self.spec.name} {len(self.qids):,} of {self.all_queries:,} queries, {docs}"

  def details(self) -> str:
    """What was kept and why, for the line printed once when the task is loaded."""
    line = f"eval.suite: {self.spec.name} ({self.spec.path}, split {self.spec.split}): {self.describe()}"
    if self.capped:
      line += (f": the queries' {self.judged_docs:,} judged documents and {len(self.doc_ids) - self.judged_docs:,} "
               f"drawn from the rest (seed {SAMPLE_SEED})")
    return line


def load_task(spec: TaskSpec, *, max_docs: int, max_queries: int, doc_tokenizer, query_tokenizer,
              doc_max_length: int, query_max_length: int) -> Task:
  """Reads a task's files (validated: formats.DataFormatError names a bad file's line), caps it and tokenizes
  what is kept. A local corpus file is read through its prepared index (jdr.data.prepared: ids and line offsets
  memory-mapped, only the kept documents' lines read), so a large BEIR corpus costs its cap, not its size."""
  corpus_path = spec.path / "corpus.jsonl"
  if jax.process_count() == 1 and prepared.can_prepare(corpus_path):
    corpus = prepared.prepare(corpus_path, progress=False)
  else:  # several hosts would prepare one folder at once; a remote or gzip corpus cannot be prepared
    corpus = formats.read_corpus(corpus_path)
  queries = formats.read_queries(spec.path / "queries.jsonl")
  qrels_path = spec.path / "qrels" / f"{spec.split}.tsv"
  qrels = formats.read_qrels(qrels_path, doc_ids=corpus, query_ids=queries)
  all_queries = sum(1 for docs in qrels.values() if any(r > 0 for r in docs.values()))
  if not all_queries:
    raise ValueError(f"eval.suite: task {spec.name!r}: {qrels_path} judges no document relevant (score > 0)")
  qids = choose_queries(qrels, max_queries, max_docs)
  if not qids:
    raise config_files.ConfigError(
        f"eval.suite: task {spec.name!r}: the first query drawn judges more documents than eval.suite_max_docs="
        f"{max_docs} ({qrels_path}); raise eval.suite_max_docs")
  qrels = {q: dict(qrels[q]) for q in qids}
  judged = sorted({d for q in qids for d in qrels[q]})
  if isinstance(corpus, prepared.PreparedCorpus):
    rows = sample_rows(len(corpus), corpus.row_of(judged), max_docs)
    doc_ids, texts = corpus.ids(rows), corpus.texts(rows)
  else:
    all_ids = list(corpus)
    row = {d: i for i, d in enumerate(all_ids)}
    rows = sample_rows(len(all_ids), np.array([row[d] for d in judged], np.int64), max_docs)
    doc_ids = [all_ids[i] for i in rows]
    texts = [text_lib.doc_text(corpus[d]) for d in doc_ids]
  return Task(spec, qids, qrels, doc_ids,
              doc_tokens=token_rows(text_lib.tokenize(doc_tokenizer, texts, doc_max_length)),
              query_tokens=token_rows(text_lib.tokenize(query_tokenizer, [queries[q] for q in qids], query_max_length)),
              all_queries=all_queries, all_docs=len(corpus), judged_docs=len(judged))


# ----------------------------------------------------------------------------------------------------------- scoring


class Suite:
  """The suite's tasks, loaded once; `suite(params)` scores them all with the towers' params.

  `encoder` is the trainer's `tower_encoder.TowerEncoder`: its tokenizers (the model's prompts), lengths, batching and
  jitted encoders, so the suite compiles no shape the run's own evaluation has not. With a frozen document tower
  (ADORE / LTRe) each task's documents are encoded once. The search is exact, in float32, on the host (faiss):
  corpora of a few thousand vectors, searched faster than the devices would be set up for them, and the same
  numbers on every platform. `seconds` holds the last call's time a task (encoding, search and metrics)."""

  def __init__(self, encoder: tower_encoder.TowerEncoder, config: ml_collections.ConfigDict, *,
               doc_tower_frozen: bool = False):
    ev = config.eval
    self.encoder = encoder
    self.metric_names = [m.strip() for m in ev.metrics.split(",") if m.strip()]
    for name in self.metric_names:
      metrics_lib.parse_metric(name)
    self.top_k = ev.top_k
    self.doc_tower_frozen = doc_tower_frozen
    self.tasks = []
    for spec in check(config):
      start = time.perf_counter()
      task = load_task(spec, max_docs=ev.suite_max_docs, max_queries=ev.suite_max_queries,
                       doc_tokenizer=encoder.doc_tokenizer, query_tokenizer=encoder.query_tokenizer,
                       doc_max_length=encoder.doc_max_length, query_max_length=encoder.query_max_length)
      if jax.process_index() == 0:
        print(f"{task.details()}; read and tokenized in {time.perf_counter() - start:.1f} s", file=sys.stderr)
      self.tasks.append(task)
    self._fixed_docs: dict[str, np.ndarray] = {}
    self.seconds: dict[str, float] = {}

  def describe(self, final: bool = False) -> str:
    del final  # every evaluation scores the same tasks
    return "suite: " + "; ".join(t.describe() for t in self.tasks)

  def doc_vectors(self, params, task: Task) -> np.ndarray:
    if not self.doc_tower_frozen:
      return self.encoder.documents(params, task.doc_tokens)
    if task.spec.name not in self._fixed_docs:
      self._fixed_docs[task.spec.name] = self.encoder.documents(params, task.doc_tokens)
    return self._fixed_docs[task.spec.name]

  def ranking(self, params, task: Task) -> dict[str, dict[str, float]]:
    """{qid: {doc id: score}}: each evaluated query's top eval.top_k of the task's kept documents."""
    query_emb = self.encoder.query_vectors(params, task.query_tokens)
    doc_emb = self.doc_vectors(params, task)
    k = min(self.top_k, len(task.doc_ids))
    rows, scores = host_search.exact_top_rows(doc_emb, query_emb, k, "faiss", "float32")
    return {q: {task.doc_ids[int(r)]: float(s) for r, s in zip(row, score) if r >= 0}
            for q, row, score in zip(task.qids, rows, scores)}

  def __call__(self, params, final: bool = False) -> dict[str, float]:
    del final
    results, per_task = {}, []
    for task in self.tasks:
      start = time.perf_counter()
      scored = metrics_lib.evaluate(task.qrels, self.ranking(params, task), self.metric_names)
      self.seconds[task.spec.name] = time.perf_counter() - start
      results.update({f"suite/{task.spec.name}/{k}": v for k, v in scored.items()})
      per_task.append(scored)
    results.update({f"suite/{MEAN}/{k}": float(np.mean([s[k] for s in per_task])) for k in self.metric_names})
    return results


def make(encoder: tower_encoder.TowerEncoder, config: ml_collections.ConfigDict, *,
         doc_tower_frozen: bool = False) -> Suite | None:
  """eval.suite's Suite, loaded now (before training: a bad task fails here); None when eval.suite is ""."""
  return Suite(encoder, config, doc_tower_frozen=doc_tower_frozen) if check(config) else None


class WithSuite:
  """The run's own evaluator and the suite as one evaluator: each call runs both and returns both's metrics,
  and its description names both, so the trainer evaluates, logs and prints them where it did one."""

  def __init__(self, evaluator, suite: Suite):
    self.evaluator, self.suite = evaluator, suite

  def describe(self, final: bool = False) -> str:
    return f"{self.evaluator.describe(final)}; {self.suite.describe(final)}"

  def __call__(self, params, final: bool = False) -> dict[str, float]:
    return {**self.evaluator(params, final=final), **self.suite(params, final=final)}


def alongside(evaluator, suite: Suite | None):
  """The evaluator the trainer runs: its own with the suite beside it, either alone, or None."""
  if suite is None or evaluator is None:
    return suite if evaluator is None else evaluator
  return WithSuite(evaluator, suite)
