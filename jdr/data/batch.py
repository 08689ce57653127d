"""The batch contract: what every data kind hands the train step (host numpy in, global jax arrays out).

Leading axes: B = global batch of queries (split over the data-parallel devices), C = candidates.

  query_ids, query_mask   int32 [B, Lq]   the queries' token ids and attention mask

and the candidates, in one of three forms (`Negatives.candidates` names it; jdr/training/step.py scores each):

  tokens (documents encoded in the step by the document tower; DPR-style, STAR, ANCE):
    doc_ids, doc_mask     int32 [C, L]    C = B * (1 + negatives.per_query): docs[0:B] are the positives
                                          (doc b belongs to query b), then query b's sampled negatives
    doc_index             int32 [C]       corpus row of each document (informational)
    valid                 bool  [B, C]    may doc c be a candidate of query b (`candidate_mask`)
    labels                float [B, C]    optional relevance; absent = identity (column b is row b's positive)
    weights               float [B, C]    optional per-pair weights (STAR's alpha on the random part)
    doc_logq              float [C]       optional log sampling probability of each document (with
                                          loss.logq_correction the step scores s(q, d) - doc_logq[d])

  pretraining (data.kind="pretrain", jdr/data/pretrain_batches.py) is the tokens form with C = B: doc b is
  row b's (ICT / BFS / WLP) document, and valid is False only on other columns holding the same document.

  corpus (candidates are rows of a fixed corpus matrix, on the devices or the host; ADORE / LTRe):
    positive_rows         int32 [B, P]    the query's relevant corpus rows, its batch positive first, -1 padded
    query_index           int32 [B]       row of the query in the sorted training queries
    cand_rows             int32 [B, n]    optional: retrieved top-n rows (host retrieval); absent = the step
                                          retrieves them itself (JAX back-end). The step then applies the
                                          `negatives.retrieval.missing_positive` rule (positives appended: n + P
                                          columns; or the last replaced: n) and builds labels and valid.
    cand_vectors          float32 [B, n, D]  with host retrieval: the vectors of cand_rows, and
    positive_vectors      float32 [B, P, D]  those of positive_rows (the matrix then stays on the host and
                                          the step reads the candidates' vectors from the batch)

  pairs (a cross-encoder, model.architecture=cross_encoder: no query tower, each query joined with each of
  its own candidates; `jdr.data.text.pair_tokens` builds [CLS] q [SEP] d [SEP]):
    pair_ids, pair_mask, pair_types  int32 [B, 1 + n, L]   column 0 the positive, then the sampled negatives
    valid                 bool  [B, 1 + n]
    labels                float [B, 1 + n]  1 in column 0
  (no query_ids: the query is inside every pair)

Masked-LM pretraining (jdr/data/pretrain_batches.MLMBatches) hands `mlm_*` fields instead; see there.

Losses are built by `jdr.training.losses.make_loss(config.loss)` and take `(scores [B, C], fields)` with `valid`,
optional `labels` and `weights`, so a new method adds fields, never a new step.
"""

from collections.abc import Callable, Mapping, Sequence

import numpy as np

TOKENS_FIELDS = ("query_ids", "query_mask", "doc_ids", "doc_mask", "valid")
PAIRS_FIELDS = ("pair_ids", "pair_mask", "pair_types", "valid", "labels")
CORPUS_FIELDS = ("query_ids", "query_mask", "positive_rows")


def check(batch: dict[str, np.ndarray]) -> str:
  """Returns the batch's form ("tokens", "corpus" or "pairs"); raises ValueError naming what breaks the
  contract."""
  if "pair_ids" in batch:
    missing = [k for k in PAIRS_FIELDS if k not in batch]
    if missing:
      raise ValueError(f"a pairs batch needs the fields {missing}; it has {sorted(batch)}")
    b, n, _ = batch["pair_ids"].shape
    for key in ("pair_mask", "pair_types"):
      if batch[key].shape != batch["pair_ids"].shape:
        raise ValueError(f"{key} {batch[key].shape} != pair_ids {batch['pair_ids'].shape}")
    for key in ("valid", "labels"):
      if batch[key].shape != (b, n):
        raise ValueError(f"{key} has shape {batch[key].shape}, expected [B, 1 + n] = ({b}, {n})")
    return "pairs"
  form = "corpus" if "positive_rows" in batch else "tokens"
  needed = CORPUS_FIELDS if form == "corpus" else TOKENS_FIELDS
  missing = [k for k in needed if k not in batch]
  if missing:
    raise ValueError(f"a {form} batch needs the fields {missing}; it has {sorted(batch)}")
  b = batch["query_ids"].shape[0]
  if batch["query_mask"].shape != batch["query_ids"].shape:
    raise ValueError(f"query_mask {batch['query_mask'].shape} != query_ids {batch['query_ids'].shape}")
  if form == "tokens":
    c = batch["doc_ids"].shape[0]
    if c % b or c < b:
      raise ValueError(f"{c} documents for {b} queries: a tokens batch holds B * (1 + n) documents")
    for key in ("valid", "labels", "weights"):
      if key in batch and batch[key].shape != (b, c):
        raise ValueError(f"{key} has shape {batch[key].shape}, expected [B, C] = ({b}, {c})")
  else:
    for key in ("positive_rows", "cand_rows", "query_index"):
      if key in batch and batch[key].shape[0] != b:
        raise ValueError(f"{key} has {batch[key].shape[0]} rows for {b} queries")
    if np.any(batch["positive_rows"][:, 0] < 0):
      raise ValueError("positive_rows[:, 0] must be each query's batch positive (got -1)")
  return form


def candidate_mask(batch_query_ids: Sequence[str | None], doc_ids_in_batch: Sequence[str | None],
                   qrels: Mapping[str, Mapping[str, int]], in_batch: bool = True, *,
                   doc_index: np.ndarray | None = None,
                   text_keys: Callable[[list[str]], list] | None = None,
                   counts: dict | None = None) -> np.ndarray:
  """valid [B, C]: may column c be a candidate for query b, for the tokens layout above.

  Column b is always valid for row b (its target). Another column c is invalid when
  - doc c is padding (id None, or `doc_index[c] == -1`);
  - doc c is a positive of query b (qrels relevance > 0) or the same doc as column b: scoring a relevant
    doc as a negative would push the query away from it;
  - with `text_keys` (doc ids -> one key per id, e.g. a hash of the text), doc c's text is the text of one of
    those relevant docs under another id: a duplicate, as relevant as its twin (`counts`, if given, gets
    their number added under "duplicate_texts");
  - in_batch is False and c is not one of query b's own sampled negatives (B + b*n_neg ... B + (b+1)*n_neg - 1).
  A padding query (id None) keeps only its target, so softmax and pairwise losses give it 0.
  The same negative doc appearing in two columns stays valid in both (as in DPR).
  """
  num_queries, num_docs = len(batch_query_ids), len(doc_ids_in_batch)
  if num_queries == 0 or num_docs < num_queries or num_docs % num_queries:
    raise ValueError(f"{num_docs} docs for {num_queries} queries: the batch must hold B * (1 + n_neg) docs")
  n_neg = num_docs // num_queries - 1
  padding = np.asarray([d is None for d in doc_ids_in_batch])
  if doc_index is not None:
    doc_index = np.asarray(doc_index)
    if doc_index.shape != (num_docs,):
      raise ValueError(f"doc_index has shape {doc_index.shape}, expected ({num_docs},)")
    padding |= doc_index < 0
  valid = np.zeros((num_queries, num_docs), bool)
  column_keys = None
  if text_keys is not None:
    real = [c for c in range(num_docs) if not padding[c]]
    column_keys = dict(zip(real, text_keys([doc_ids_in_batch[c] for c in real])))
  for b, qid in enumerate(batch_query_ids):
    valid[b, b] = True
    if qid is None:
      continue
    relevant = {d for d, rel in qrels.get(qid, {}).items() if rel > 0}
    relevant.add(doc_ids_in_batch[b])
    relevant_keys = set(text_keys(sorted(relevant))) if column_keys is not None else set()
    columns = range(num_docs) if in_batch else range(num_queries + b * n_neg, num_queries + (b + 1) * n_neg)
    for c in columns:
      if c != b and not padding[c] and doc_ids_in_batch[c] not in relevant:
        valid[b, c] = column_keys is None or column_keys[c] not in relevant_keys
        if counts is not None and not valid[b, c]:
          counts["duplicate_texts"] = counts.get("duplicate_texts", 0) + 1
  return valid
