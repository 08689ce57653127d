"""ADORE's step against a float64 numpy transcription of the authors' per-query loss.

The oracle is written from the authors' description (DRhard adore/train.py, with JPQ run_train.py's
`compute_loss` for the per-pair weight), not from jdr's code:
  - the candidate list is the query's top n by inner product, in retrieval order;
  - when none of the n is relevant, every positive of the query is appended after them (positions n + 1,
    n + 2, ...); when one is, nothing is appended;
  - every (relevant r, irrelevant u) pair of the list costs |1/p_r - 1/p_u| * log(1 + exp(s_u - s_r)), p the
    1-based list position and 1/p read as 0 beyond the cut K; the query's loss is the sum over its pairs
    divided by their number (pairs of weight 0 included); the batch's loss is the mean over queries.
A slot holding no document (-1 in a short retrieval) keeps its position and forms no pair.
"""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest


def oracle_query(q, corpus, listed, positives, cut):
  """(loss, d loss / d q) of one query, float64. `listed`: its retrieved rows in order (-1 = no document)."""
  q, corpus = np.asarray(q, np.float64), np.asarray(corpus, np.float64)
  positives = [int(p) for p in positives if p >= 0]
  listed = [int(r) for r in listed]
  relevant = [r in positives for r in listed]
  if not any(relevant):
    listed, relevant = listed + positives, relevant + [True] * len(positives)
  reciprocal = [1.0 / p if p <= cut else 0.0 for p in range(1, len(listed) + 1)]
  loss, grad, pairs = 0.0, np.zeros_like(q), 0
  for i, (r, rel_r) in enumerate(zip(listed, relevant)):
    for j, (u, rel_u) in enumerate(zip(listed, relevant)):
      if r < 0 or u < 0 or not rel_r or rel_u:
        continue
      w = abs(reciprocal[i] - reciprocal[j])
      margin = corpus[u] @ q - corpus[r] @ q
      loss += w * np.logaddexp(0.0, margin)
      grad += w / (1.0 + np.exp(-margin)) * (corpus[u] - corpus[r])
      pairs += 1
  return (loss / pairs, grad / pairs) if pairs else (0.0, grad)


def oracle_batch(queries, corpus, lists, positive_rows, cut):
  out = [oracle_query(q, corpus, l, p, cut) for q, l, p in zip(queries, lists, positive_rows)]
  b = len(out)
  return sum(o[0] for o in out) / b, np.stack([o[1] for o in out]) / b


def top_rows(queries, corpus, n):
  scores = np.asarray(queries, np.float64) @ np.asarray(corpus, np.float64).T
  return np.argsort(-scores, axis=1, kind="stable")[:, :n]


class QueryTable:
  """Stands in for the two-tower model: query b's vector is the parameter row b (ids[:, 0] = b), so the
  step's gradient with respect to the parameters is its gradient with respect to the query vectors."""

  def apply(self, variables, ids, mask, **unused):
    del mask, unused
    return variables["params"]["q"][ids[:, 0]]


def _step_loss(corpus, queries, positive_rows, *, cut, n, cand_rows=None, **config_overrides):
  """(loss, d loss / d queries) of `jdr.training.step.corpus_scorer`'s function on the fake tower, as the trainer builds it."""
  from jdr.runtime import defaults  # pylint: disable=g-import-not-at-top
  from jdr.runtime import parallel
  from jdr.training import step
  from jdr.negatives import retrieved  # pylint: disable=g-import-not-at-top
  config = defaults.get_config()
  config.model.train_towers = "query"
  config.negatives.source = "retrieval"
  config.negatives.retrieval.top_n = n
  config.loss.name = "lambdarank"
  config.loss.lambda_metric = f"mrr@{cut}"
  for key, value in config_overrides.items():
    *sections, name = key.split("__")
    node = config
    for section in sections:
      node = node[section]
    node[name] = value
  mesh = parallel.make_mesh((-1, 1, 1))
  score = step.corpus_scorer(QueryTable(), config, mesh, retrieve_in_step=cand_rows is None)
  placed = retrieved.put_corpus(corpus, [str(i) for i in range(len(corpus))], mesh, "float32")
  b = len(queries)
  batch = {"query_ids": jnp.arange(b, dtype=jnp.int32)[:, None], "query_mask": jnp.ones((b, 1), jnp.int32),
           "positive_rows": jnp.asarray(positive_rows, jnp.int32)}
  if cand_rows is not None:
    batch["cand_rows"] = jnp.asarray(cand_rows, jnp.int32)
  rngs = jax.random.split(jax.random.PRNGKey(0))

  @jax.jit
  def value_and_grad(params, batch, rows, bias):
    return jax.value_and_grad(lambda p: score(p, batch, rngs, rows, bias)[0])(params)

  loss, grads = value_and_grad({"q": jnp.asarray(queries, jnp.float32)}, batch, placed.device, placed.bias)
  return float(loss), np.asarray(grads["q"], np.float64)


def _retrieval_example(n):
  """300 documents, 4 queries with P = 3 positive columns: query 0 has none of its two positives in its top n,
  query 1 one of two (rank 5; the other far below), query 2 three anywhere in its top n, query 3 one at
  rank 12 with two -1 columns."""
  rng = np.random.default_rng(2)
  corpus = rng.normal(size=(300, 16)).astype(np.float32)
  queries = rng.normal(size=(4, 16)).astype(np.float32)
  order = top_rows(queries, corpus, 300)
  # Neighbouring scores far apart next to float32 rounding, so jdr's top n is numpy's.
  scores = np.sort(queries.astype(np.float64) @ corpus.T.astype(np.float64), axis=1)[:, ::-1][:, :n + 1]
  assert np.min(-np.diff(scores, axis=1)) > 1e-4
  at = lambda b, ranks: [int(order[b, r - 1]) for r in ranks]
  positive_rows = np.array([at(0, [n + 40, n + 90]) + [-1],
                            at(1, [5, n + 60]) + [-1],
                            at(2, [n, 1, 7]),  # the batch positive first: here the last retrieved
                            at(3, [12]) + [-1, -1]], np.int32)
  return corpus, queries, positive_rows


@pytest.mark.parametrize("cut", [10, 200])
def test_in_step_retrieval_equals_drhard(cut):
  """In-step JAX retrieval, the default rule and weights: value and gradient equal the oracle's."""
  n = 200
  corpus, queries, positive_rows = _retrieval_example(n)
  expected, expected_grad = oracle_batch(queries, corpus, top_rows(queries, corpus, n), positive_rows, cut)
  loss, grad = _step_loss(corpus, queries, positive_rows, cut=cut, n=n)
  np.testing.assert_allclose(loss, expected, rtol=2e-5)
  np.testing.assert_allclose(grad, expected_grad, rtol=2e-4, atol=1e-7 * np.abs(expected_grad).max())
  # The example tells the rules apart: LTRe's replacement and the exact swap each give another loss.
  for other in ({"negatives__retrieval__missing_positive": "replace_last"}, {"loss__lambda_delta": "exact"}):
    assert abs(_step_loss(corpus, queries, positive_rows, cut=cut, n=n, **other)[0] - expected) > 1e-3 * expected


def test_given_candidates_with_ties_and_short_lists_equal_drhard():
  """The host path (`cand_rows`): score ties (duplicate document vectors, a relevant one listed after its
  irrelevant twin), a short retrieval padded with -1, and a query whose short list misses its positives."""
  rng = np.random.default_rng(3)
  corpus = rng.normal(size=(40, 8)).astype(np.float32)
  corpus[11] = corpus[10]  # 10 irrelevant, 11 relevant to query 0: equal scores
  corpus[21] = corpus[20] = corpus[22]  # three irrelevant ties for query 1
  queries = rng.normal(size=(3, 8)).astype(np.float32)
  cand_rows = np.array([[3, 10, 11, 4, 5, 6, 7, 8],
                        [20, 21, 22, 30, 2, 1, -1, -1],  # two missing: Faiss's padding
                        [12, 13, 14, 15, 16, -1, -1, -1]], np.int32)
  positive_rows = np.array([[11, 5], [1, -1], [38, 39]], np.int32)
  for cut in (3, 10):
    expected, expected_grad = oracle_batch(queries, corpus, cand_rows, positive_rows, cut)
    loss, grad = _step_loss(corpus, queries, positive_rows, cut=cut, n=8, cand_rows=cand_rows)
    np.testing.assert_allclose(loss, expected, rtol=2e-5)
    np.testing.assert_allclose(grad, expected_grad, rtol=2e-4, atol=1e-7 * np.abs(expected_grad).max())


def test_gradient_is_the_derivative_of_the_loss():
  """The oracle's analytic gradient against its own central finite difference (float64), so the gradient
  comparison above checks against a derivative, not a second transcription of the same slip."""
  corpus, queries, positive_rows = _retrieval_example(200)
  lists = top_rows(queries, corpus, 200)
  _, grad = oracle_batch(queries, corpus, lists, positive_rows, 200)
  eps, q = 1e-6, queries.astype(np.float64)
  for b, d in [(0, 0), (1, 5), (2, 9), (3, 15)]:
    up, down = q.copy(), q.copy()
    up[b, d] += eps
    down[b, d] -= eps
    fd = (oracle_batch(up, corpus, lists, positive_rows, 200)[0]
          - oracle_batch(down, corpus, lists, positive_rows, 200)[0]) / (2 * eps)
    np.testing.assert_allclose(grad[b, d], fd, rtol=1e-5, atol=1e-10)


def test_ltre_keeps_replace_last():
  """configs/ltre.py runs LTRe's Algorithm 1: the n-th retrieved row replaced, no appended columns."""
  from jdr.runtime import config_files  # pylint: disable=g-import-not-at-top
  from jdr.negatives import retrieved  # pylint: disable=g-import-not-at-top
  root = pathlib.Path(__file__).resolve().parents[1] / "configs"
  ltre = config_files.load_config_file(str(root / "ltre.py:runlocal"))
  adore = config_files.load_config_file(str(root / "adore.py:runlocal"))
  assert ltre.negatives.retrieval.missing_positive == "replace_last"
  assert (adore.negatives.retrieval.missing_positive, adore.loss.lambda_delta) == ("append", "positions")
  rows, labels, _ = retrieved.candidates(jnp.array([[5, 6, 7]]), jnp.array([[9, 8]]), "replace_last")
  np.testing.assert_array_equal(rows, [[5, 6, 9]])
  np.testing.assert_array_equal(labels, [[0, 0, 1]])
