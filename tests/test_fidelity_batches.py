"""STAR's batch weighting and ANCE's triples, against float64 transcriptions of what the authors' code computes
(DRhard `model.py` `inbatch_train`; ANCE `run_ann_data_gen.py` + `GetTripletTrainingDataProcessingFn` +
`rdot_nll`), written from their description, not from jdr's code."""

import collections

import jax.numpy as jnp
import numpy as np
import pytest

from jdr.training import losses
from jdr.data import pairs
from jdr.negatives import candidate_mask


def drhard_inbatch_loss(scores, qids, doc_ids, qrels, num_queries):
  """DRhard's STAR loss: every (query, batch positive) pair and every (query, any row's hard negative) pair
  whose document is not relevant to the query, each -log softmax([s_pos, s_neg])[0], summed over both parts and
  divided by the number of such pairs."""
  total, count = 0.0, 0
  for b, q in enumerate(qids):
    relevant = {d for d, r in qrels[q].items() if r > 0}
    for c, d in enumerate(doc_ids):
      if c == b or d in relevant:
        continue
      total += np.logaddexp(0.0, scores[b, c] - scores[b, b])
      count += 1
  return total / count


def test_star_batch_mean_is_the_authors_one_mean_over_pairs():
  # Rows 0 and 1 share their positive; query b has two positives, the second being row 2's hard negative;
  # query c's positive is row 0's hard negative and another of its positives is row 3's hard negative, so the
  # rows have different numbers of pairs.
  qids = ["a", "a2", "b", "c"]
  docs = ["p1", "p1", "pb", "pc", "pc", "pb2", "h1", "h2"]
  qrels = {"a": {"p1": 1}, "a2": {"p1": 1}, "b": {"pb": 1, "pb2": 1}, "c": {"pc": 1, "h2": 1}}
  valid = candidate_mask(qids, docs, qrels, in_batch=True)
  weights = pairs.pair_weights(valid, 1, "batch_mean")
  rng = np.random.default_rng(0)
  for _ in range(5):
    scores = rng.normal(scale=3.0, size=valid.shape)
    got = float(jnp.mean(losses.ranknet(jnp.asarray(scores, jnp.float32), jnp.asarray(valid),
                                        weights=jnp.asarray(weights))))
    expected = drhard_inbatch_loss(scores, qids, docs, qrels, len(qids))
    np.testing.assert_allclose(got, expected, rtol=2e-6)
  # The per-row mean (what jdr did with alpha 0) is another objective on the same inputs.
  plain = float(jnp.mean(losses.ranknet(jnp.asarray(scores, jnp.float32), jnp.asarray(valid))))
  assert abs(plain - expected) > 1e-3


def test_star_batch_mean_own_hard_negative_weighs_as_any_pair():
  """At batch 256 with one hard negative a row's own hard negative is 1 of its ~510 pairs: the weights give
  every valid pair of the batch the same weight, so the own hard negative carries 1/n_b of its row."""
  b, n = 8, 1
  qids = [f"q{i}" for i in range(b)]
  docs = [f"p{i}" for i in range(b)] + [f"h{i}" for i in range(b * n)]
  qrels = {q: {f"p{i}": 1} for i, q in enumerate(qids)}
  valid = candidate_mask(qids, docs, qrels, in_batch=True)
  weights = pairs.pair_weights(valid, n, "batch_mean")
  negative = valid & ~np.eye(b, len(docs), dtype=bool)
  per_pair = weights / negative.sum(1, keepdims=True) / b  # a pair's share of the batch's mean
  np.testing.assert_allclose(per_pair[negative], 1.0 / negative.sum(), rtol=1e-6)


def test_pair_weighting_refuses_an_ignored_alpha():
  with pytest.raises(ValueError, match="random_weight"):
    pairs.check_pair_weighting("batch_mean", 0.1)
  with pytest.raises(ValueError, match="random_weight"):
    pairs.check_pair_weighting("alpha", 0.0)
  with pytest.raises(ValueError, match="pair_weighting"):
    pairs.check_pair_weighting("mean", 0.0)


class _Generations:
  """A refreshed source: pools per generation, generation g in force from step 10 * g."""

  def __init__(self, pools_by_generation, qrels):
    self.pools_by_generation, self.qrels, self.step = pools_by_generation, qrels, 0

  def generation(self, step):
    g = min(step // 10, len(self.pools_by_generation) - 1)
    self.current = g
    return g, 10 * g

  def sample(self, query_ids, positives, rng, n, exclude=None):
    out = []
    for q, p in zip(query_ids, positives):
      pool = [d for d in self.pools_by_generation[self.current][q] if self.qrels[q].get(d, 0) <= 0 and d != p]
      out.append([pool[i] for i in rng.choice(len(pool), size=n, replace=False)])
    return out


def _triples_data(num_queries=6, pool=8):
  corpus = {f"d{i}": None for i in range(40)}
  qrels = {f"q{i}": {f"d{i}": 1} for i in range(num_queries)}
  qrels["q0"]["d1"] = 1  # q0 has two positives: two pairs, and d1 is in q1's pool's reach
  queries = {q: q for q in qrels}
  data = pairs.RetrievalData(corpus, queries, qrels, None, "tiny")
  pools = [{q: [f"d{(i * 3 + j) % 40}" for j in range(pool + 2)] for i, q in enumerate(qrels)},
           {q: [f"d{(i * 5 + j + 7) % 40}" for j in range(pool + 2)] for i, q in enumerate(qrels)}]
  return data, qrels, pools


class _Tokenizer:
  pad_token_id = 0


def test_ance_triples_cover_each_pair_k_times_with_distinct_pool_negatives():
  data, qrels, pools = _triples_data()
  k, batch = 3, 7
  source = _Generations(pools[:1], qrels)
  batches = pairs.Batches(data, _Tokenizer(), batch_size=batch, query_max_length=4, doc_max_length=4,
                          negative_source=source, negatives_per_query=1, in_batch=False, seed=3,
                          triples_per_query=k, mask_duplicate_texts=False)  # documents are ids only
  num_pairs = len(batches.pairs)
  seen = collections.Counter()
  negatives_of = collections.defaultdict(list)
  steps = num_pairs * k // batch
  for step in range(steps):
    qids, doc_ids, valid = batches.global_layout(step)
    assert len(doc_ids) == 2 * batch
    for b in range(batch):
      pair = (qids[b], doc_ids[b])
      seen[pair] += 1
      neg = doc_ids[batch + b]
      negatives_of[pair].append(neg)
      assert neg in pools[0][qids[b]] and qrels[qids[b]].get(neg, 0) <= 0
      # Only the triple's own negative is a candidate: no in-batch negatives.
      assert valid[b].tolist() == [c in (b, batch + b) for c in range(2 * batch)]
  # One pass of the shuffled triples: every pair k times (the last partial batch aside), distinct negatives.
  assert sum(seen.values()) == steps * batch
  assert max(seen.values()) == k
  assert all(len(set(v)) == len(v) for v in negatives_of.values())


def test_ance_triples_are_a_function_of_the_step_and_restart_with_each_generation():
  data, qrels, pools = _triples_data()
  make = lambda: pairs.Batches(data, _Tokenizer(), batch_size=4, query_max_length=4, doc_max_length=4,
                               negative_source=_Generations(pools, qrels), negatives_per_query=1,
                               in_batch=False, seed=1, triples_per_query=2,
                               mask_duplicate_texts=False)  # documents are ids only
  first, resumed = make(), make()
  layouts = [first.global_layout(s)[:2] for s in range(14)]
  assert resumed.global_layout(12)[:2] == layouts[12]  # a resumed run builds the same batch
  # Generation 1 starts at step 10 with its own pools and its own order.
  for s in (10, 11, 12, 13):
    qids, doc_ids = layouts[s]
    assert all(d in pools[1][q] for q, d in zip(qids, doc_ids[4:]))


def test_ance_triple_loss_is_a_two_way_softmax_per_triple():
  batch = 5
  qids = [f"q{i}" for i in range(batch)]
  docs = [f"p{i}" for i in range(batch)] + [f"n{i}" for i in range(batch)]
  qrels = {q: {f"p{i}": 1} for i, q in enumerate(qids)}
  valid = candidate_mask(qids, docs, qrels, in_batch=False)
  scores = np.random.default_rng(2).normal(scale=4.0, size=valid.shape)
  got = float(jnp.mean(losses.softmax_nll(jnp.asarray(scores, jnp.float32), jnp.asarray(valid))))
  expected = np.mean([np.logaddexp(scores[b, b], scores[b, batch + b]) - scores[b, b] for b in range(batch)])
  np.testing.assert_allclose(got, expected, rtol=1e-6)
