"""Distillation from a cross-encoder teacher into two towers: FGD (Zhou et al., fine-grained distillation for
long documents) and its document-level baseline.

What a config turns on (`distill.*`, see jdr/runtime/defaults.py):

  teacher          a cross-encoder (jdr workdir / export, Hugging Face sequence classifier), or "mined": the
                   cross-encoder scores a `python -m jdr.mine` directory holds for its negatives and positives
                   (negatives.source=mined); "" = off
  document         document-level KD (Eq. 5, the "brute-force" baseline; listwise KL): KL between the teacher's
                   and the student's distributions over each query's own candidates (its positive and negatives)
  margin_mse       MarginMSE (Hofstaetter et al., 2020): the squared difference of the student's and the
                   teacher's margins (positive minus each negative) over the same candidates
  granularities    FGD's levels, "passage,sentence": each a window of `passage_tokens` / `sentence_tokens`
                   tokens of the document (the paper's 128 / 64); for every piece k of the positive
                   document a distribution over it and the pieces of the query's negative documents at the
                   same level (Eq. 10, 14-15: negative pieces come only from negative documents), KL averaged
                   over k (Eq. 12)
  pooling          student piece vectors: "attention" (Eq. 7, global-consistent) or "mean" ("FG pooling")
  contrastive_weight   lambda of Eq. 13 on the document-level contrastive NLL

Teacher scores are computed once per stage, before step 0, for every training query with each document it
can meet (its positives and its negative pool): the document (FirstP, the student's document tokens) and
each of its pieces, as `[CLS] query [SEP] piece [SEP]` built from the student's own token ids (the teacher
must share the student's tokenizer). A student with prompts (model.query_prompt / model.doc_prompt) reads
its queries and documents after them; the teacher takes none: its query, document and pieces are the
student's token ids with the prompt's tokens left out (a piece keeps its place among the student's windows).
They are cached in the workdir (keyed by teacher, data and settings), so a resumed run reads them back.
`complete(batch, step)` adds the teacher fields of the step's rows.

Each function here takes the `distill` section alone and, by name, the few settings of other sections it depends
on (the lengths, the negatives, the model): what distillation needs of a run's config is in its signatures.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import sys
from typing import Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import tqdm

from jdr.runtime import atomic
from jdr.training import losses
from jdr.runtime import paths
from jdr.evaluation import reranking
from jdr.data import text as text_lib
from jdr.models import cross
from jdr.negatives import mining
from jdr.negatives import sources
from jdr.negatives import training_files


MINED = "mined"  # distill.teacher: the scores of negatives.mined.file


def enabled(distill: ml_collections.ConfigDict) -> bool:
  return bool(distill.teacher)


def levels(distill: ml_collections.ConfigDict) -> list[tuple[str, int]]:
  """(name, window tokens) of the FGD granularities the section asks for, in order."""
  sizes = {"passage": distill.passage_tokens, "sentence": distill.sentence_tokens}
  names = [g.strip() for g in distill.granularities.split(",") if g.strip()]
  unknown = [g for g in names if g not in sizes]
  if unknown:
    raise ValueError(f"distill.granularities: unknown {unknown}; choose from passage, sentence")
  return [(g, int(sizes[g])) for g in names]


def piece_counts(distill: ml_collections.ConfigDict, doc_max_length: int) -> dict[str, int]:
  """K per level: the pieces of a document of `doc_max_length` tokens (data.doc_max_length; the [CLS] left
  out), the width of the batch's teacher_<level>_pos / _neg fields."""
  return {name: max(1, -(-(doc_max_length - 1) // size)) for name, size in levels(distill)}


def check(distill: ml_collections.ConfigDict, *, source: str, per_query: int, architecture: str, data_kind: str,
          model_pooling: str, grad_cache_chunk_size: int) -> None:
  """Refuses distillation settings the trainer cannot run, before anything is loaded. Beside the section, what
  it must agree with: negatives.source and negatives.per_query (the teacher scores each query's own fixed
  pool), model.architecture, data.kind, model.pooling and grad_cache.chunk_size."""
  if not enabled(distill):
    return
  levels(distill)
  if not distill.document and not distill.margin_mse and not levels(distill):
    raise ValueError("distill.teacher is set but none of distill.document, distill.margin_mse and "
                     "distill.granularities asks for a distillation term")
  if distill.teacher == MINED and (source != "mined" or levels(distill)):
    raise ValueError("distill.teacher=mined reads the document-level scores of negatives.mined.file: set "
                     "negatives.source=mined and distill.granularities=\"\" (pieces need a cross-encoder)")
  if architecture != "two_tower" or data_kind != "pairs":
    raise ValueError("distillation trains two towers on supervised pairs (model.architecture=two_tower, "
                     "data.kind=pairs)")
  pools = sources.named(lambda s: s.fixed_pool)
  if source not in pools or per_query < 1:
    raise ValueError("distillation scores each query's own negatives with the teacher once per stage: use a "
                     f"fixed pool (negatives.source = {' | '.join(pools)}) and negatives.per_query >= 1")
  if distill.pooling not in ("attention", "mean"):
    raise ValueError(f"distill.pooling must be 'attention' or 'mean', got {distill.pooling!r}")
  if distill.pooling == "attention" and levels(distill) and model_pooling not in ("", "cls"):
    raise ValueError("distill.pooling=attention (Eq. 7) needs [CLS] pooling: set model.pooling=cls")
  sizes = [size for _, size in levels(distill)]
  if distill.negative_pieces and any(a % b for a, b in zip(sizes, sizes[1:])):
    raise ValueError(f"distill.negative_pieces (hierarchical negatives) needs the levels coarse to fine, each "
                     f"window dividing the one before; got {levels(distill)}")
  if grad_cache_chunk_size:
    raise ValueError("distillation and gradient caching do not combine yet: set grad_cache.chunk_size=0")


def hierarchical_negatives(scores: Sequence, valid: Sequence, sizes: Sequence[int], keep: int) -> list:
  """FGD's hierarchical hard negatives (Eq. 14-15) as masks, in the step: level 0's negative pieces are the
  `keep` highest-scoring valid ones; each finer level's candidates are the pieces inside a kept piece of the
  level above, of which again the `keep` highest-scoring are kept.

  scores[j], valid[j]: [B, n, K_j] student scores and validity of the negative documents' windows at level j
  (coarse to fine; window sizes `sizes` nested, each dividing the one before). Returns the kept masks [B, n, K_j].
  Only the negative documents' windows come in, so a piece of the positive document is never a negative."""
  out = []
  allowed = None
  for j, (s, v) in enumerate(zip(scores, valid)):
    b, n, k = s.shape
    ok = v.astype(bool)
    if allowed is not None:
      parent = (jnp.arange(k) * sizes[j]) // sizes[j - 1]  # the coarser window holding window k
      ok = ok & jnp.take(allowed, parent, axis=2)
    flat = jnp.where(ok, jax.lax.stop_gradient(s), -jnp.inf).reshape(b, n * k)
    m = min(keep, n * k)
    threshold = jax.lax.top_k(flat, m)[0][:, -1:]
    chosen = (flat >= threshold) & jnp.isfinite(flat)
    # Ties at the threshold could keep more than m: keep the first m of them in index order.
    chosen = chosen & (jnp.cumsum(chosen, axis=1) <= m)
    kept = chosen.reshape(b, n, k)
    out.append(kept)
    allowed = kept
  return out


def loss_terms(distill: ml_collections.ConfigDict, student_temperature: float):
  """The step's distillation terms (jdr/training/step.py adds them to the contrastive loss):
  (q [B, D], spans [C, sum K, D], scores [B, C], valid [B, C], batch) -> {"kd_document": .., "kd_margin_mse": ..,
  "fgd_<level>": ..}, document-level KD, MarginMSE and FGD's per-level KD over each query's own candidates (its positive, then its own
  negatives: batch columns B + b * n ...). `student_temperature`: loss.temperature."""
  doc_level, level_sizes, keep = distill.document, levels(distill), distill.negative_pieces
  margin = distill.margin_mse
  # The student's scores on the scale its contrastive loss uses (loss.temperature: cosine towers need
  # ~0.05), the teacher's logits at distill.temperature (the paper's 1).
  s_scale, t_scale = student_temperature, distill.temperature

  def terms(q, spans, scores, valid, batch):
    num_q, num_d = scores.shape
    per = (num_d - num_q) // num_q
    own = jnp.concatenate([jnp.arange(num_q)[:, None],
                           num_q + jnp.arange(num_q)[:, None] * per + jnp.arange(per)[None, :]], axis=1)
    own_valid = jnp.take_along_axis(valid, own, axis=1)
    out = {}
    if doc_level or margin:
      teacher = batch["teacher_doc"]
      ok = own_valid & jnp.isfinite(teacher)
      student, teacher = jnp.take_along_axis(scores, own, axis=1) / s_scale, jnp.where(ok, teacher, 0.0) / t_scale
      if doc_level:
        out["kd_document"] = jnp.mean(losses.distillation_kl(student, teacher, ok))
      if margin:
        out["kd_margin_mse"] = jnp.mean(losses.margin_mse(student, teacher, ok))
    per_level = _level_scores(q, spans, batch, level_sizes, num_q, per, own_valid)
    if keep:
      kept = hierarchical_negatives([lv[5] for lv in per_level], [lv[6] for lv in per_level],
                                    [size for _, size in level_sizes], keep)
      per_level = [lv[:6] + (lv[6] & k,) for lv, k in zip(per_level, kept)]
    for name, k, t_pos, t_neg, s_pos, s_neg, neg_ok in per_level:
      out[f"fgd_{name}"] = _level_kl(k, t_pos, t_neg, s_pos, s_neg, neg_ok, num_q, per, s_scale, t_scale)
    return out

  return terms


def _level_scores(q, spans, batch, level_sizes, num_q: int, per: int, own_valid) -> list[tuple]:
  """Per level: (name, K, teacher positive [B, K], teacher negatives [B, n, K], student positive [B, K],
  student negatives [B, n, K], which negative pieces count [B, n, K])."""
  start = 0
  out = []
  for name, _ in level_sizes:
    t_pos, t_neg = batch[f"teacher_{name}_pos"], batch[f"teacher_{name}_neg"]  # [B, K], [B, n, K]
    k = t_pos.shape[1]
    piece = spans[:, start:start + k]  # [C, K, D]
    start += k
    s_pos = jnp.einsum("bd,bkd->bk", q, piece[:num_q])
    s_neg = jnp.einsum("bd,bnkd->bnk", q, piece[num_q:].reshape(num_q, per, k, -1))
    neg_ok = jnp.isfinite(t_neg) & own_valid[:, 1:, None]  # pieces of negative documents only (Eq. 15)
    out.append((name, k, t_pos, t_neg, s_pos, s_neg, neg_ok))
  return out


def _level_kl(k, t_pos, t_neg, s_pos, s_neg, neg_ok, num_q, per, s_scale, t_scale):
  """Eq. 12: for each piece of the positive, KL over it and the negative documents' pieces, averaged."""
  pos_ok = jnp.isfinite(t_pos)
  student = jnp.concatenate([s_pos[:, :, None], jnp.broadcast_to(
      s_neg.reshape(num_q, 1, per * k), (num_q, k, per * k))], axis=2)
  teacher = jnp.concatenate([t_pos[:, :, None], jnp.broadcast_to(
      t_neg.reshape(num_q, 1, per * k), (num_q, k, per * k))], axis=2)
  ok = jnp.concatenate([pos_ok[:, :, None], jnp.broadcast_to(
      neg_ok.reshape(num_q, 1, per * k), (num_q, k, per * k))], axis=2) & pos_ok[:, :, None]
  return jnp.mean(losses.granular_distillation(student / s_scale, jnp.where(ok, teacher, 0.0) / t_scale, ok))


def windows_of(token_ids: np.ndarray, size: int, count: int) -> list[np.ndarray]:
  """The content tokens (no [CLS] / [SEP]) of windows 0..count-1 over positions 1.. of one document's ids,
  the windows jdr.data.granularity.windows makes for the student; [] for a window past the document's end."""
  content = token_ids[1:-1] if len(token_ids) >= 2 else token_ids[:0]
  return [content[s * size:(s + 1) * size] for s in range(count)]


def prompt_length(tokenizer) -> int:
  """Content tokens a `text.Prompted` tokenizer's prompt takes at the start of every text's ids (0 for none):
  the prompt's own tokens, its trailing whitespace left out (a byte-level BPE joins it to the next word)."""
  bare, prompt = text_lib.unprompted(tokenizer)
  if not prompt.strip():
    return 0
  return len(bare(prompt.rstrip(), add_special_tokens=False)["input_ids"])


def joined(tokenizer, query: np.ndarray, piece: np.ndarray) -> tuple[list[int], list[int]]:
  """`[CLS] query [SEP] piece [SEP]` (RoBERTa: `<s> q </s></s> d </s>`) from content token ids."""
  cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
  q, d = [int(t) for t in query], [int(t) for t in piece]
  if tokenizer.num_special_tokens_to_add(pair=True) == 4:
    ids = [cls, *q, sep, sep, *d, sep]
    return ids, [0] * len(ids)
  return [cls, *q, sep, *d, sep], [0] * (len(q) + 2) + [1] * (len(d) + 1)


class TeacherScores:
  """The teacher's scores for (query, document): "doc" and, per level, one score per window (NaN past the
  document's end), computed once and cached.

  The pairs named up front (each drawn query's positives and negative pool) are scored in one pass and cached in
  the workdir; a pair a batch needs beyond them (a random top-up of a short pool) is scored when first
  asked for, counted in `late`, and kept for the rest of the run.

  `doc_tokens` / `query_tokens` are the student's ids; `prompts` ({"query", "doc"}) the student's prompts,
  whose tokens they start with and the teacher does not see (`prompt_length`); `query_max_length` /
  `doc_max_length` the student's (data.*), the longest inputs the teacher's pairs are built from.
  """

  def __init__(self, distill: ml_collections.ConfigDict, data, tokenizer, doc_tokens: dict[str, np.ndarray],
               query_tokens: dict[str, np.ndarray], pairs: Sequence[tuple[str, str]], cache: pathlib.Path, *,
               query_max_length: int, doc_max_length: int, prompts: dict | None = None):
    self.distill, self.data, self.tokenizer = distill, data, tokenizer
    self.query_max_length, self.doc_max_length = query_max_length, doc_max_length
    self.doc_tokens, self.query_tokens = dict(doc_tokens), dict(query_tokens)
    prompts = {side: text for side, text in (prompts or {}).items() if text}
    self.doc_tokenizer = text_lib.prompted(tokenizer, prompts.get("doc"))  # the student's documents
    self.skip = {side: prompt_length(text_lib.prompted(tokenizer, prompts.get(side))) for side in ("query", "doc")}
    self.levels = levels(distill)
    self.counts = piece_counts(distill, doc_max_length)
    self._score_fn = None
    self.late = 0
    what = [str(paths.absolute(distill.teacher)), data.name, query_max_length, doc_max_length, self.levels,
            sorted(pairs)]
    if prompts:  # only then: an unprompted run's cache keeps its name
      what.append({"prompts": prompts})
    key = hashlib.sha256(json.dumps(what).encode()).hexdigest()[:16]
    path = cache / f"teacher-{key}.json"
    if path.exists():
      self.scores = {tuple(k.split("\t")): v for k, v in json.loads(path.read_text()).items()}
      print(f"teacher scores: {len(self.scores)} (query, document) pairs read from {path}", file=sys.stderr)
      return
    self.scores = {}
    self._score(pairs, progress=True)
    atomic.write_text(path, json.dumps({f"{q}\t{d}": v for (q, d), v in self.scores.items()}))

  def _scorer(self):
    if self._score_fn is None:
      teacher = self.distill.teacher
      try:
        model, params, teacher_tokenizer = cross.load_cross_encoder(teacher)
      except ValueError as e:
        raise ValueError(f"distill.teacher={teacher} is not a cross-encoder: {e}") from e
      if teacher_tokenizer.get_vocab() != self.tokenizer.get_vocab():
        raise ValueError(f"distill.teacher={teacher}: its tokenizer differs from the student's; pieces are token "
                         "windows of the student's documents, so both must share one vocabulary")
      self.longest = min(self.query_max_length + self.doc_max_length + 2, model.config.max_length)
      self._score_fn = reranking.make_token_scorer(model, params, self.tokenizer.pad_token_id or 0,
                                                   max_length=self.longest,
                                                   batch_size=self.distill.teacher_batch_size)
    return self._score_fn

  def _score(self, pairs: Sequence[tuple[str, str]], progress: bool = False) -> None:
    score, tokenizer = self._scorer(), self.tokenizer
    specials = tokenizer.num_special_tokens_to_add(pair=True)
    missing_docs = sorted({d for _, d in pairs if d not in self.doc_tokens})
    texts = [text_lib.doc_text(self.data.corpus[d]) for d in missing_docs]
    self.doc_tokens.update(zip(missing_docs, text_lib.tokenize(self.doc_tokenizer, texts, self.doc_max_length)))
    skip_query, skip_doc = self.skip["query"], self.skip["doc"]
    jobs, where = [], []
    for q, d in pairs:
      query = self.query_tokens[q][1:-1][skip_query:]  # the teacher takes no prompt
      ids = self.doc_tokens[d]
      # The whole document may not fit beside the query in the teacher's positions (512 for BERT): its
      # document-level score is then the teacher's FirstP, as a cross-encoder reranker would see it.
      jobs.append(joined(tokenizer, query, ids[1:-1][skip_doc:][:self.longest - len(query) - specials]))
      where.append((q, d, "doc", 0))
      for name, size in self.levels:
        for s, piece in enumerate(windows_of(ids, size, self.counts[name])):
          piece = piece[max(0, skip_doc - s * size):]  # the prompt's tokens, in the windows they fall in
          if len(piece):
            jobs.append(joined(tokenizer, query, piece))
            where.append((q, d, name, s))
    for q, d in pairs:
      self.scores[(q, d)] = {"doc": 0.0, **{name: [None] * self.counts[name] for name, _ in self.levels}}
    chunk = 4096
    with tqdm.tqdm(total=len(jobs), desc="teacher scores", unit="pair", mininterval=5.0,
                   disable=not progress) as bar:
      for start in range(0, len(jobs), chunk):
        values = score(jobs[start:start + chunk])
        for (q, d, name, s), v in zip(where[start:start + chunk], values):
          if name == "doc":
            self.scores[(q, d)]["doc"] = float(v)
          else:
            self.scores[(q, d)][name][s] = float(v)
        bar.update(len(values))

  def ensure(self, pairs: Sequence[tuple[str, str]]) -> None:
    """Scores whichever of `pairs` have no scores yet (see the class note)."""
    missing = sorted({p for p in pairs if p not in self.scores})
    if missing:
      self._score(missing)
      self.late = _count_pairs(self.late, len(missing), "outside the pools (random top-ups of short pools) "
                               "scored during training so far")

  def doc(self, q: str, d: str) -> float:
    return self.scores[(q, d)]["doc"]

  def docs(self, pairs: Sequence[tuple[str, str]]) -> np.ndarray:
    return np.array([self.scores[p]["doc"] for p in pairs], np.float32)

  def pieces(self, q: str, d: str, name: str) -> np.ndarray:
    return np.array([np.nan if v is None else v for v in self.scores[(q, d)][name]], np.float32)


def _count_pairs(count: int, more: int, what: str) -> int:
  """count + more, with a line on the terminal each time the total doubles (not each step)."""
  total = count + more
  if total.bit_length() > count.bit_length():
    print(f"teacher scores: {total} pairs {what}", file=sys.stderr)
  return total


class MinedTeacher:
  """The cross-encoder scores of a `python -m jdr.mine` directory: each query's mined negatives and labeled
  positives, looked up by corpus row. A pair it lacks (a random top-up of a short pool) is NaN, which the loss
  terms leave out, and is counted in `missing`."""

  def __init__(self, mined: mining.Mined, corpus):
    if mined.teacher is None:
      raise ValueError(f"distill.teacher=mined: {mined.meta.get('data') or mined.meta.get('source')} holds no "
                       "teacher scores (mine with --cross-encoder, or give a file with a 'scores' column)")
    if not hasattr(corpus, "row_of"):
      raise ValueError("distill.teacher=mined looks documents up by corpus row: it needs a prepared corpus")
    self.mined, self.corpus, self.missing = mined, corpus, 0
    self._index = {q: i for i, q in enumerate(mined.qids)}
    self._tables: dict[str, dict[int, float]] = {}

  def _table(self, qid: str) -> dict[int, float]:
    if qid not in self._tables:
      i, table = self._index.get(qid), {}
      if i is not None:
        for rows, scores in ((self.mined.rows[i], self.mined.teacher[i]),
                             (self.mined.positives[i], self.mined.positive_teacher[i])):
          table.update((r, s) for r, s in zip(rows.tolist(), scores.tolist()) if r >= 0 and np.isfinite(s))
      self._tables[qid] = table
    return self._tables[qid]

  def ensure(self, pairs) -> None:
    del pairs  # the scores are what the directory holds

  def docs(self, pairs: Sequence[tuple[str, str]]) -> np.ndarray:
    rows = self.corpus.row_of([d for _, d in pairs], missing=-1).tolist()
    out = np.array([self._table(q).get(r, np.nan) for (q, _), r in zip(pairs, rows)], np.float32)
    self.missing = _count_pairs(self.missing, int(np.isnan(out).sum()), "the mined directory holds no score "
                                "for (random top-ups of short pools) left out of the distillation terms so far")
    return out


class Distiller:
  """Adds the teacher's fields to a tokens batch: `teacher_doc` [B, 1 + n] over each query's own candidates
  (its positive, then its n negatives) and, per level, `teacher_<level>_pos` [B, K] (the positive's
  pieces) and `teacher_<level>_neg` [B, n, K] (the negatives' pieces); NaN marks a piece that does not exist."""

  def __init__(self, distill: ml_collections.ConfigDict, data, tokenizer, batches, sampler, cache: pathlib.Path, *,
               query_max_length: int, doc_max_length: int, per_query: int, num_train_steps: int,
               mined: ml_collections.ConfigDict | None = None, prompts: dict | None = None):
    """`query_max_length` / `doc_max_length` (data.*), `per_query` (negatives.per_query) and `num_train_steps`:
    the run's batches, whose queries the teacher scores; `mined`: the negatives.mined group, whose file holds
    the scores of distill.teacher=mined; `prompts`: the student's {"query", "doc"} prompts (its description's),
    which its token ids start with and the teacher's inputs leave out."""
    self.batches = batches
    self.per_query = per_query
    if distill.teacher == MINED:
      scored = training_files.load(mined.file, data.corpus, data.queries, data.train_qrels)
      self.teacher, self.levels = MinedTeacher(scored, data.corpus), []
      return
    # Only the queries the run's steps draw: a run shorter than an epoch (2,000 steps of 64 on MS MARCO's
    # 503k queries) would otherwise score every pool. Steps from 0, resumed or not, so the cache key holds.
    qids = batches.queries_drawn(num_train_steps)
    docs_of = {q: sorted({d for d, r in data.train_qrels[q].items() if r > 0} | set(sampler.pool(q))) for q in qids}
    pairs = [(q, d) for q in qids for d in docs_of[q]]
    needed = sorted({d for _, d in pairs})
    # The student's token ids (after its prompts): its document windows are what the teacher's pieces follow.
    prompts = prompts or {}
    doc_tokenizer = text_lib.prompted(tokenizer, prompts.get("doc"))
    query_tokenizer = text_lib.prompted(tokenizer, prompts.get("query"))
    doc_texts = [text_lib.doc_text(data.corpus[d]) for d in needed]
    doc_tokens = dict(zip(needed, text_lib.tokenize(doc_tokenizer, doc_texts, doc_max_length)))
    query_tokens = dict(zip(qids, text_lib.tokenize(query_tokenizer, [data.queries[q] for q in qids],
                                                    query_max_length)))
    self.teacher = TeacherScores(distill, data, tokenizer, doc_tokens, query_tokens, pairs, cache,
                                 query_max_length=query_max_length, doc_max_length=doc_max_length, prompts=prompts)
    self.levels = self.teacher.levels

  def complete(self, batch: dict, step: int) -> dict:
    qids, doc_ids, _ = self.batches.global_layout(step)
    num, n = len(qids), self.per_query
    lo, hi = self.batches.host_rows(num)
    own = [[doc_ids[b]] + doc_ids[num + b * n:num + (b + 1) * n] for b in range(lo, hi)]
    self.teacher.ensure([(qids[b], d) for b, cols in zip(range(lo, hi), own) for d in cols])
    batch = dict(batch)
    batch["teacher_doc"] = self.teacher.docs([(qids[b], d) for b, cols in zip(range(lo, hi), own) for d in cols]
                                             ).reshape(hi - lo, 1 + n)
    for name, _ in self.levels:
      batch[f"teacher_{name}_pos"] = np.stack([self.teacher.pieces(qids[b], cols[0], name)
                                               for b, cols in zip(range(lo, hi), own)])
      batch[f"teacher_{name}_neg"] = np.stack([np.stack([self.teacher.pieces(qids[b], d, name) for d in cols[1:]])
                                               for b, cols in zip(range(lo, hi), own)])
    return batch
