"""The trainer's evaluation kinds (jdr.evaluation.periodic.Evaluator, jdr.evaluation.eval_candidates): candidates re-ranked
against independent oracles (the full corpus, a brute-force re-rank), the kind each line and metric name says,
a resumable full-corpus evaluation, and a frozen document tower encoded once."""

import json
import types

import jax
import numpy as np
import pytest

from jdr.retrieval import bm25
from jdr.runtime import config_files
from jdr.retrieval import encoder_runtime
from jdr.retrieval import encodings
from jdr.runtime import defaults
from jdr.retrieval import tower_encoder
from jdr.evaluation import periodic
from jdr.evaluation import metrics as metrics_lib
from jdr.training import trainer
from jdr.data import pairs
from jdr.models import build
from conftest import write_tiny_beir


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  """A random-weight tiny model over a 40-document generated dataset (10 test queries)."""
  root = tmp_path_factory.mktemp("tiny")
  config = defaults.get_config()
  config_files.apply_overrides(config, ["model.init_from=", "model.fresh=tiny", "model.pooling=mean",
                                        f"data.dataset={write_tiny_beir(root / 'data')}"])
  built = build.build(config.model, config.data)
  data = pairs.load(config.data, root)
  params = trainer.initial_params(built.model, built, config, jax.random.PRNGKey(0), None)
  return types.SimpleNamespace(config=config, built=built, data=data, params=params, root=root)


def _encoder(tiny):
  return tower_encoder.TowerEncoder(tiny.built.model, tiny.built.tokenizer, tiny.data, query_max_length=16,
                                 doc_max_length=32)


def _config(tiny, **eval_keys):
  config = tiny.config.copy_and_resolve_references()
  for key, value in eval_keys.items():
    config.eval[key] = value
  return config


def _close(a: dict, b: dict):
  assert a.keys() == b.keys()
  for k in a:
    assert abs(a[k] - b[k]) < 1e-6, (k, a[k], b[k])


def test_candidates_that_are_the_whole_corpus_score_as_the_full_corpus(tiny, tmp_path):
  encoder = _encoder(tiny)
  qids = sorted(tiny.data.eval_qrels)
  run = tmp_path / "all.trec"  # every document for every query, in an order unrelated to the model's
  run.write_text("".join(f"{q} Q0 {d} {r + 1} {-r} bm25\n" for q in qids for r, d in enumerate(encoder.doc_ids)))
  full = periodic.Evaluator(encoder, _config(tiny, candidates="full"), None)(tiny.params)
  on_run = periodic.Evaluator(encoder, _config(tiny, candidates="run", candidates_run=str(run),
                                                 candidates_depth=40), None)(tiny.params)
  assert set(on_run) == {f"run-top40/{k}" for k in full}
  _close({k[len("run-top40/"):]: v for k, v in on_run.items()}, full)


def test_bm25_candidates_score_as_a_brute_force_rerank(tiny, tmp_path):
  """BM25 top-5 re-ranked by the model, against numpy over the whole corpus's vectors restricted to the same
  candidates (rows from bm25.search directly)."""
  encoder = _encoder(tiny)
  evaluator = periodic.Evaluator(encoder, _config(tiny, candidates="bm25", candidates_depth=5), None,
                                   cache_dir=tmp_path)
  got = evaluator(tiny.params)
  assert set(got) == {"bm25-top5/ndcg@10", "bm25-top5/mrr@10", "bm25-top5/recall@100"}
  qids = evaluator.qids
  index = bm25.corpus_index(tiny.data.corpus)
  rows, _ = bm25.search(index, [tiny.data.queries[q] for q in qids], 5)
  doc_emb, query_emb = encoder.corpus(tiny.params), encoder.queries(tiny.params, qids)
  run = {}
  for i, q in enumerate(qids):
    cands = [r for r in rows[i] if r >= 0]
    run[q] = {encoder.doc_ids[r]: float(doc_emb[r] @ query_emb[i]) for r in cands}
  oracle = metrics_lib.evaluate({q: tiny.data.eval_qrels[q] for q in qids}, run, evaluator.metric_names)
  _close(got, {f"bm25-top5/{k}": v for k, v in oracle.items()})
  # Only the candidates were encoded, and the mined rows are kept in the cache folder.
  assert len(evaluator.candidates.unique) == len(np.unique(rows[rows >= 0])) < len(encoder.doc_ids)
  assert list((bm25.kept_beside(tiny.data.corpus) or tmp_path).glob("bm25-*-top5"))


def test_each_evaluation_says_its_kind(tiny, tmp_path):
  encoder = _encoder(tiny)
  config = _config(tiny, candidates="bm25", candidates_depth=5)
  evaluator = periodic.Evaluator(encoder, config, None, cache_dir=tmp_path)
  assert evaluator.describe() == "candidates: BM25 top-5 of 10 queries, " + (
      f"{len(evaluator.candidates.unique)} documents")
  assert evaluator.describe(final=True) == "full corpus, 40 documents, 10 queries; " + evaluator.describe()
  final = evaluator(tiny.params, final=True)  # the full corpus, and the periodic kind for the curve's last point
  assert {"ndcg@10", "bm25-top5/ndcg@10", "recall@100", "bm25-top5/recall@100"} <= set(final)
  _close({k: v for k, v in final.items() if k.startswith("bm25")}, evaluator(tiny.params))
  config.eval.final = "candidates"
  assert periodic.Evaluator(encoder, config, None, cache_dir=tmp_path).kinds(final=True) == ["bm25"]
  assert periodic.Evaluator(encoder, _config(tiny), None).describe() == "full corpus, 40 documents, 10 queries"


@pytest.mark.parametrize("keys, queries, docs, frozen, kind", [
    ({}, 10, 40, False, "full"),  # 10 x 100 candidates would cover 40 documents: exact and no dearer
    ({}, 10, 5000, False, "bm25"),
    ({}, 10, 5000, True, "full"),  # a frozen document tower is encoded once anyway
    ({"candidates_depth": 1000}, 10, 5000, False, "full"),
    ({"candidates_run": "top1000.dev.tsv"}, 10, 5000, False, "run"),
    ({"candidates": "bm25"}, 10, 40, True, "bm25"),
    ({"candidates": "full"}, 10, 5000, False, "full"),
])
def test_auto_resolves_to_a_kind(keys, queries, docs, frozen, kind):
  config = defaults.get_config()
  config.eval.update(keys)
  assert periodic.periodic_kind(config.eval, queries, docs, frozen) == kind


@pytest.mark.parametrize("keys, message", [
    ({"candidates": "dense"}, "eval.candidates='dense'"),
    ({"final": "never"}, "eval.final='never'"),
    ({"candidates": "run"}, "needs eval.candidates_run"),
    ({"candidates": "bm25", "candidates_run": "x.trec"}, "eval.candidates_run=x.trec is set"),
    ({"candidates_depth": 0}, "eval.candidates_depth=0"),
])
def test_bad_settings_are_refused(keys, message):
  config = defaults.get_config()
  config.eval.update(keys)
  with pytest.raises(ValueError, match=message.replace("(", r"\(")):
    periodic.periodic_kind(config.eval, 10, 40, False)


def test_a_run_lacking_an_evaluation_query_is_refused(tiny, tmp_path):
  run = tmp_path / "some.trec"
  run.write_text("q30 Q0 d30 1 1.0 t\n")
  with pytest.raises(ValueError, match="no line for 9 of the 10 evaluation queries"):
    periodic.Evaluator(_encoder(tiny), _config(tiny, candidates_run=str(run)), None)


def _count(monkeypatch, owner, name):
  calls = []
  real = getattr(owner, name)

  def counted(*args, **kwargs):
    calls.append(name)
    return real(*args, **kwargs)

  monkeypatch.setattr(owner, name, counted)
  return calls


def test_a_frozen_document_tower_is_encoded_once(tiny, tmp_path, monkeypatch):
  """ADORE / LTRe: only the query tower trains, so no evaluation after the first encodes a document."""
  encoder = _encoder(tiny)
  corpus_calls = _count(monkeypatch, encodings, "encode_corpus")  # the resumable full-corpus encoding
  memory_calls = _count(monkeypatch, encoder, "_encode_corpus")  # the in-memory one
  document_calls = _count(monkeypatch, encoder, "documents")  # candidates
  full = periodic.Evaluator(encoder, _config(tiny, candidates="full"), None, doc_tower_frozen=True,
                              cache_dir=tmp_path)
  first = full(tiny.params, final=True)
  assert len(corpus_calls) == 1
  moved = jax.tree.map(lambda x: x * 1.01, tiny.params)  # what a step changes (here both towers: it must not matter)
  full(moved)
  full(moved, final=True)
  assert len(corpus_calls) == 1 and not memory_calls
  _close(full(tiny.params), first)

  cands = periodic.Evaluator(encoder, _config(tiny, candidates="bm25", candidates_depth=5), None,
                               doc_tower_frozen=True, cache_dir=tmp_path)
  cands(tiny.params)
  cands(moved)
  assert len(document_calls) == 1 and len(corpus_calls) == 1
  # The fixed index's vectors, when the caller has them (negatives.doc_emb): nothing is encoded at all.
  given = periodic.Evaluator(encoder, _config(tiny, candidates="bm25", candidates_depth=5), None,
                               doc_tower_frozen=True, fixed_doc_emb=encoder.corpus(tiny.params))
  given(tiny.params)
  given(tiny.params, final=True)
  assert len(document_calls) == 1 and len(corpus_calls) == 1 and len(memory_calls) == 1


class Killed(Exception):
  pass


def test_a_killed_full_evaluation_resumes_at_its_last_shard(tiny, tmp_path, monkeypatch):
  encoder = _encoder(tiny)
  expected = periodic.Evaluator(encoder, _config(tiny), None)(tiny.params)  # in memory, no shards
  monkeypatch.setattr(tower_encoder, "SHARD_DOCS", 10)  # 4 shards of the 40 documents
  encode = encoder_runtime.encode_tokens
  encoded = []

  def dies_at_the_third(runtime, token_ids, **kwargs):
    if runtime.max_length == encoder.doc_max_length:  # a shard of documents, not the queries
      if len(encoded) == 2 and not resumed:
        raise Killed
      encoded.append(len(token_ids))
    return encode(runtime, token_ids, **kwargs)

  resumed = False
  monkeypatch.setattr(encoder_runtime, "encode_tokens", dies_at_the_third)
  evaluator = periodic.Evaluator(encoder, _config(tiny), None, cache_dir=tmp_path)
  with pytest.raises(Killed):
    evaluator(tiny.params)
  folder, = (tmp_path / "eval-corpus").iterdir()
  assert len(list(folder.glob("emb-*.npy"))) == 2
  resumed = True
  _close(periodic.Evaluator(encoder, _config(tiny), None, cache_dir=tmp_path)(tiny.params), expected)
  assert encoded == [10, 10, 10, 10]  # two before the kill, the other two after: none twice
  assert not (tmp_path / "eval-corpus").exists()  # finished: nothing is left to resume


def test_shards_of_other_weights_are_not_resumed(tiny, tmp_path):
  encoder = _encoder(tiny)
  stale = tmp_path / "eval-corpus" / "0123"  # left by an evaluation of other weights, killed
  stale.mkdir(parents=True)
  (stale / "emb-00000.npy").write_bytes(b"")
  np.testing.assert_array_equal(encoder.corpus(tiny.params, shards_dir=tmp_path / "eval-corpus"),
                                encoder.corpus(tiny.params))  # one shard: the very batches of the in-memory path
  assert [p.name for p in (tmp_path / "eval-corpus").iterdir()] != ["0123"]


@pytest.mark.slow
def test_training_evaluates_candidates_and_the_full_corpus_at_the_end(tiny, tmp_path, capsys):
  config = _config(tiny, candidates="bm25", candidates_depth=5)
  config.num_train_steps, config.eval_every, config.batch_size, config.checkpoint_every = 2, 1, 4, 0
  config.data.query_max_length, config.data.doc_max_length = 16, 32
  trainer.train_and_evaluate(config, tmp_path / "w")
  records = [json.loads(line) for line in (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records if "eval/bm25-top5/ndcg@10" in r] == [0, 1, 2]
  assert [r["step"] for r in records if "eval/ndcg@10" in r] == [2]
  out = capsys.readouterr().out
  assert "before training, eval (candidates: BM25 top-5 of 10 queries, " in out
  assert "after 2 steps, eval (full corpus, 40 documents, 10 queries; candidates: BM25 top-5 of 10 queries" in out
