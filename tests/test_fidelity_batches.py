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


# ------------------------------------------------------------------ STAR's epochs over queries (DRhard dataset.py)


def drhard_epoch_positives(qids, reldict, epochs, rng):
  """DRhard's `TrainInbatchWithHardDataset` under the Trainer's random sampler: each epoch every training query
  once, in a random order, with `random.choice` of its positives; the rows of `epochs` epochs, in order."""
  rows = []
  for _ in range(epochs):
    for i in rng.permutation(len(qids)):
      q = qids[i]
      rows.append((q, reldict[q][rng.integers(len(reldict[q]))]))
  return rows


def _several_positives_data(epoch_over):
  qrels = {f"q{i}": {f"d{i}": 1} for i in range(10)}
  qrels["q3"].update({"d30": 1, "d31": 1})  # three positives
  qrels["q7"]["d70"] = 1  # two
  qrels["q5"]["d50"] = 0  # judged, not a positive
  corpus = {d: None for q in qrels.values() for d in q}
  return pairs.RetrievalData(corpus, {q: q for q in qrels}, qrels, None, "tiny", epoch_over=epoch_over)


def _batches(data, batch_size, seed=0):
  return pairs.Batches(data, _Tokenizer(), batch_size=batch_size, query_max_length=4, doc_max_length=4, seed=seed,
                       mask_duplicate_texts=False)  # documents are ids only


def test_star_batches_go_over_queries_each_with_one_positive_drawn_at_random():
  batch, epochs = 5, 400
  batches = _batches(_several_positives_data("queries"), batch)
  assert batches.examples_per_epoch == 10
  rows = [r for step in range(epochs * 10 // batch)
          for r in zip(*batches.global_layout(step)[:2])]  # (query, positive) of each row, batch after batch
  qrels = batches.data.train_qrels
  reldict = {q: [d for d, r in docs.items() if r > 0] for q, docs in qrels.items()}
  expected = drhard_epoch_positives(sorted(qrels), reldict, epochs, np.random.default_rng(0))
  for e in range(epochs):  # every epoch holds each query once, as DRhard's does
    assert sorted(q for q, _ in rows[10 * e:10 * e + 10]) == sorted(q for q, _ in expected[10 * e:10 * e + 10])
  for step in range(len(rows) // batch):  # so no batch repeats a query
    assert len({q for q, _ in rows[step * batch:(step + 1) * batch]}) == batch
  assert all(d in reldict[q] for q, d in rows)
  # Each positive of a query as often as DRhard's random.choice draws it: q3's three, 400 draws, about 133 each.
  got, theirs = collections.Counter(d for q, d in rows if q == "q3"), collections.Counter(
      d for q, d in expected if q == "q3")
  assert sorted(got) == sorted(theirs) == ["d3", "d30", "d31"]
  assert all(abs(got[d] - epochs / 3) < 4 * np.sqrt(epochs * 2 / 9) for d in got), got  # 4 sigma
  # The pairs' epochs (jdr's other reading) put q3 in more rows than the other queries, several in a batch at times.
  by_pair = _batches(_several_positives_data("pairs"), batch)
  pair_rows = [q for step in range(130) for q in by_pair.global_layout(step)[0]]  # 50 epochs of 13 pairs
  assert collections.Counter(pair_rows)["q3"] == 3 * collections.Counter(pair_rows)["q0"] == 150
  assert any(len(set(pair_rows[s * batch:(s + 1) * batch])) < batch for s in range(130))


def test_star_query_epochs_equal_pair_epochs_when_each_query_has_one_positive():
  qrels = {f"q{i}": {f"d{i}": 1} for i in range(13)}
  data = {how: pairs.RetrievalData({f"d{i}": None for i in range(13)}, {q: q for q in qrels}, qrels, None, "tiny",
                                   epoch_over=how) for how in ("queries", "pairs")}
  by_query, by_pair = _batches(data["queries"], 4, seed=5), _batches(data["pairs"], 4, seed=5)
  for step in range(12):
    assert by_query.global_layout(step)[:2] == by_pair.global_layout(step)[:2]
  with pytest.raises(ValueError, match="data.epoch_over"):
    _batches(pairs.RetrievalData({}, {}, qrels, None, "tiny", epoch_over="query"), 4)


# ------------------------------------------------------------------ ANCE's refresh (run_ann_data_gen.py, run_ann.py)


def ance_chunk_lines(qids, qrels, generation, chunks):
  """ANCE's data generation for output number `generation`: chunk generation % chunks of the queries (n // chunks
  each, the last the rest), each query once with the one positive `load_positive_ids` keeps (the last line of
  the qrels for it overwrites the others)."""
  per, at = len(qids) // chunks, generation % chunks
  chunk = qids[at * per:len(qids) if at == chunks - 1 else (at + 1) * per]
  return {(q, [d for d, r in qrels[q].items() if r > 0][-1]) for q in chunk}


def ance_reader_batches(lines, per_line, readers, per_reader, steps):
  """ANCE's trainer over one generation's lines in file order: line i goes to rank i % readers
  (`StreamingDataset`), each rank reads its lines' triples in order (`per_line` a line), again from the start at
  the end, `per_reader` a step; a global batch is the ranks' rows one after another. Rows as (query, positive)."""
  streams = [[line for i, line in enumerate(lines) if i % readers == r for _ in range(per_line)]
             for r in range(readers)]
  return [[s[(step * per_reader + j) % len(s)] for s in streams for j in range(per_reader)] for step in range(steps)]


class _Refresher:
  """The refresher's schedule without mining: generation g's pools in force from step every * g."""

  def __init__(self, pools_by_generation, every):
    self.pools_by_generation, self.every = pools_by_generation, every

  def _at(self, step):
    return min(step // self.every, len(self.pools_by_generation) - 1)

  def pools(self, step):
    return self.pools_by_generation[self._at(step)]

  def generation(self, step):
    return self._at(step), self.every * self._at(step)


def _ance_data():
  qids = [f"q{i:02d}" for i in range(12)]
  qrels = {q: {f"d{i}": 1} for i, q in enumerate(qids)}
  qrels["q02"] = {"d2": 1, "d41": 1, "d40": 1}  # ANCE keeps d40, the last listed: not the first nor the largest
  qrels["q05"] = {"d45": 1, "d5": 1}
  qrels["q09"]["d49"] = 0  # judged, not a positive
  corpus = {f"d{i}": None for i in range(60)}
  data = pairs.RetrievalData(corpus, {q: q for q in qids}, qrels, None, "tiny")
  rng = np.random.default_rng(7)
  # Three generations of pools of 12 corpus rows a query; q02's holds all three of its positives.
  pools = []
  for _ in range(3):
    rows = np.stack([rng.choice(np.arange(12, 40), 12, replace=False) for _ in qids]).astype(np.int32)
    rows[2, :3] = [40, 41, 2]
    pools.append(rows)
  return data, qids, qrels, pools


def _ance_batches(plan, k, batch, every, seed=0):
  from jdr.negatives import sources  # pylint: disable=g-import-not-at-top
  data, qids, qrels, pools = _ance_data()
  source = sources.RefreshedNegatives(_Refresher(pools, every), qids, qrels, data.corpus, 12, plan)
  batches = pairs.Batches(data, _Tokenizer(), batch_size=batch, query_max_length=4, doc_max_length=4,
                          negative_source=source, negatives_per_query=1, in_batch=False, seed=seed,
                          triples_per_query=k, mask_duplicate_texts=False)  # documents are ids only

  def layout(step):
    source.step = step  # what Negatives.prepare sets before each batch
    return batches.global_layout(step)
  return layout, qids, qrels, pools


def test_ance_refresh_trains_one_chunk_with_one_positive_a_query_read_in_order():
  from jdr.data import refresh_triples  # pylint: disable=g-import-not-at-top
  k, batch, readers, every = 11, 4, 2, 15  # 4 lines a chunk, 2 a reader: 22 triples, 11 steps a pass
  plan = refresh_triples.TriplePlan("queries", chunks=3, readers=readers)
  layout, qids, qrels, _ = _ance_batches(plan, k, batch, every)
  for generation in range(3):
    rows = [list(zip(*layout(s)[:2]))[:batch] for s in range(every * generation, every * (generation + 1))]
    assert {r for b in rows for r in b} == ance_chunk_lines(qids, qrels, generation, 3)
    # The line order the generation dealt, read back from the readers' first lines, then ANCE's trainer over it.
    streams = [[row for b in rows[:11] for row in b[2 * r:2 * r + 2]] for r in range(readers)]
    order = [streams[r][i * k] for i in range(2) for r in range(readers)]
    assert rows == ance_reader_batches(order, k, readers, batch // readers, every)
  # A fourth generation would be chunk 0 again: ANCE's effective_idx = output_num % chunk_factor.
  assert ance_chunk_lines(qids, qrels, 3, 3) == ance_chunk_lines(qids, qrels, 0, 3)
  assert refresh_triples.chunk_bounds(12, 3, 3) == refresh_triples.chunk_bounds(12, 0, 3) == (0, 4)
  assert refresh_triples.chunk_bounds(14, 2, 3) == (8, 14)  # the last chunk takes the rest
  # jdr's other plan: every (query, positive) pair at every refresh, triples shuffled across queries.
  layout, *_ = _ance_batches(refresh_triples.TriplePlan(), k, batch, every)
  rows = {r for s in range(every) for r in zip(*layout(s)[:2])}
  assert {q for q, _ in rows} == set(qids) and ("q02", "d2") in rows and ("q02", "d41") in rows


def test_ance_negatives_skip_only_the_lines_positive():
  from jdr.data import refresh_triples  # pylint: disable=g-import-not-at-top
  k, batch = 11, 4  # q02's pool less its line's positive is 11 rows: every one is drawn
  layout, qids, qrels, pools = _ance_batches(refresh_triples.TriplePlan("queries", chunks=3, readers=2), k, batch, 11)
  negatives = collections.defaultdict(list)
  for step in range(11):  # one pass over generation 0's triples
    q_ids, doc_ids, valid = layout(step)
    for b, q in enumerate(q_ids):
      negatives[q].append(doc_ids[batch + b])
      assert valid[b].tolist() == [c in (b, batch + b) for c in range(2 * batch)]  # no positive masked
  pool = lambda q: {f"d{r}" for r in pools[0][qids.index(q)]}
  for q, negs in negatives.items():
    line_positive = [d for d, r in qrels[q].items() if r > 0][-1]
    assert len(negs) == k and len(set(negs)) == k and set(negs) <= pool(q) - {line_positive}
  assert {"d2", "d41"} <= set(negatives["q02"])  # ANCE trains q02's other positives as its negatives
  # jdr's other plan skips every positive and masks one that comes back another way.
  layout, *_ = _ance_batches(refresh_triples.TriplePlan(), 9, batch, 11)
  for step in range(11):
    q_ids, doc_ids, _ = layout(step)
    assert not any(doc_ids[batch + b] in qrels[q] for b, q in enumerate(q_ids) if q == "q02")


def test_the_triple_settings_are_refused_where_they_would_be_ignored():
  from jdr.negatives import sources  # pylint: disable=g-import-not-at-top
  from jdr.runtime import defaults  # pylint: disable=g-import-not-at-top
  c = defaults.get_config()
  c.negatives.source, c.negatives.per_query, c.negatives.ance.refresh_every = "ance", 1, 5
  c.negatives.ance.refresh_chunks = 5
  with pytest.raises(ValueError, match="triples_per_query > 0 only"):
    sources.check(c)
  c.negatives.ance.triples_per_query, c.negatives.ance.triple_readers, c.batch_size = 20, 3, 32
  with pytest.raises(ValueError, match="multiple of negatives.ance.triple_readers=3"):
    sources.check(c)
  c.negatives.ance.triple_readers = 4
  sources.check(c)
  c.negatives.ance.triples_over = "query"
  with pytest.raises(ValueError, match="triples_over must be one of queries, pairs"):
    sources.check(c)
  c.negatives.ance.triples_over, c.negatives.dense_static.query_length = "queries", 32
  with pytest.raises(ValueError, match="dense_static.query_length=32.*dense_static only"):
    sources.check(c)
