"""Distillation from a cross-encoder (FGD and document-level KD) through the one trainer."""

import json
import pathlib

import numpy as np
import pytest

from test_cross import CROSS


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  """A tiny BEIR dataset and a one-step cross-encoder teacher on it, shared by the module's tests."""
  from conftest import write_tiny_beir  # pylint: disable=g-import-not-at-top
  root = tmp_path_factory.mktemp("distill")
  beir = write_tiny_beir(root / "beir")
  return beir, _teacher(root, beir)


def _teacher(tmp_path, beir):
  from jdr.training import trainer  # pylint: disable=g-import-not-at-top
  from jdr.runtime import config_files
  from jdr.runtime import defaults
  config = defaults.get_config()
  config_files.apply_overrides(config, CROSS + [f"data.dataset={beir}", "num_train_steps=1",
                                                "data.doc_max_length=64", "eval_before_training=False"])
  config.data.eval_split = ""
  trainer.train_and_evaluate(config, tmp_path / "teacher")
  return tmp_path / "teacher"


def _student_config(beir, teacher, extra=()):
  from jdr.runtime import config_files  # pylint: disable=g-import-not-at-top
  from jdr.runtime import defaults
  config = defaults.get_config()
  config_files.apply_overrides(config, [
      "model.init_from=", "model.fresh=tiny", "model.pooling=cls", "model.normalize=0", f"data.dataset={beir}",
      "data.query_max_length=12", "data.doc_max_length=32", "batch_size=4", "negatives.source=bm25",
      "negatives.bm25.top_k=3", "negatives.per_query=2", "num_train_steps=2", "log_every=1",
      "optimizer.warmup_steps=1", "eval_before_training=False", "eval.diagnostic_queries=0",
      f"distill.teacher={teacher}", "distill.passage_tokens=8", "distill.sentence_tokens=4",
      *extra])
  return config


def _distiller_inputs(tmp_path, setup):
  """(config, data, tokenizer, sampler, batches) of the tiny student: BM25 pools of 3, 2 negatives a query."""
  from jdr import negatives  # pylint: disable=g-import-not-at-top
  from jdr.data import pairs  # pylint: disable=g-import-not-at-top
  from jdr.models import build  # pylint: disable=g-import-not-at-top
  beir, teacher = setup
  config = _student_config(beir, teacher)
  data = pairs.load(config.data, tmp_path)
  tokenizer = build.build(config.model, config.data).tokenizer
  sampler = negatives.BM25Negatives(data.corpus, data.queries, data.train_qrels, top_k=3)
  batches = pairs.Batches(data, tokenizer, batch_size=4, query_max_length=12, doc_max_length=32,
                          negative_source=sampler, negatives_per_query=2, seed=0)
  return config, data, tokenizer, sampler, batches


def _distiller(config, data, tokenizer, batches, sampler, cache):
  """The trainer's Distiller of `config`: its distill section and the settings of the run it needs."""
  from jdr.training import distill  # pylint: disable=g-import-not-at-top
  return distill.Distiller(config.distill, data, tokenizer, batches, sampler, cache,
                           query_max_length=config.data.query_max_length, doc_max_length=config.data.doc_max_length,
                           per_query=config.negatives.per_query, num_train_steps=config.num_train_steps,
                           mined=config.negatives.mined)


def _records(workdir):
  return [json.loads(l) for l in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_fgd_and_document_kd_train_with_cached_teacher_scores(tmp_path, setup):
  from jdr.training import trainer  # pylint: disable=g-import-not-at-top
  beir, teacher = setup
  config = _student_config(beir, teacher, ["distill.document=True", "distill.contrastive_weight=0.5",
                                           "distill.negative_pieces=2"])
  trainer.train_and_evaluate(config, tmp_path / "s")
  logged = [r for r in _records(tmp_path / "s") if "train/loss" in r]
  assert len(logged) == 2
  for r in logged:
    terms = [r[f"train/loss/{k}"] for k in ("kd_document", "fgd_passage", "fgd_sentence")]
    assert all(np.isfinite(terms)) and all(t >= 0 for t in terms) and terms[1] > 0 and terms[2] > 0
    # The loss is Eq. 13 (plus document KD): lambda * contrastive + the distillation terms.
    np.testing.assert_allclose(r["train/loss"], 0.5 * r["train/loss/contrastive"] + sum(terms), rtol=1e-5)
  assert len(list((tmp_path / "s" / "cache").glob("teacher-*.json"))) == 1


@pytest.mark.slow
def test_teacher_pieces_are_the_students_windows_and_negatives_come_from_negative_documents(tmp_path, setup):
  from jdr.training import distill  # pylint: disable=g-import-not-at-top
  from jdr.data import granularity
  config, data, tokenizer, sampler, batches = _distiller_inputs(tmp_path, setup)
  distiller = _distiller(config, data, tokenizer, batches, sampler, tmp_path / "cache")
  # Scored once: a second distiller on the same data reads the cache and gets the same scores.
  again = _distiller(config, data, tokenizer, batches, sampler, tmp_path / "cache")
  assert again.teacher.scores.keys() == distiller.teacher.scores.keys()
  assert all(np.allclose(np.asarray(again.teacher.pieces(q, d, "sentence"), float),
                         np.asarray(distiller.teacher.pieces(q, d, "sentence"), float), equal_nan=True)
             for q, d in distiller.teacher.scores)
  b = distiller.complete(batches.local(0), 0)
  qids, doc_ids, _ = batches.global_layout(0)
  span, valid = granularity.windows(b["doc_mask"], 8)
  for r in range(4):
    # Column 0 of the teacher's pieces is the query's positive; the negatives' pieces are its sampled docs.
    positive_pieces = distiller.teacher.pieces(qids[r], doc_ids[r], "passage")
    np.testing.assert_array_equal(b["teacher_passage_pos"][r], positive_pieces)
    assert np.isfinite(positive_pieces).sum() == valid[r].sum()  # one teacher score per student window
    negs = doc_ids[4 + 2 * r:4 + 2 * r + 2]
    assert doc_ids[r] not in negs
    for j, d in enumerate(negs):
      np.testing.assert_array_equal(b["teacher_passage_neg"][r, j], distiller.teacher.pieces(qids[r], d, "passage"))
    # The teacher scored exactly the student's window tokens.
    ids = b["doc_ids"][r]
    window = ids[np.flatnonzero(span[r, 0])]
    content = distill.windows_of(ids[:int(b["doc_mask"][r].sum())], 8, 4)[0]
    np.testing.assert_array_equal(window[:len(content)], content)


def test_hierarchical_negatives_keep_the_best_inside_kept_parents():
  """Eq. 14-15: the top m negative passages, then the top m sentences among those inside a kept passage."""
  from jdr.training import distill  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(5)
  b, n, kp, ks, m = 3, 2, 4, 8, 3
  sp, ss = rng.normal(size=(b, n, kp)).astype(np.float32), rng.normal(size=(b, n, ks)).astype(np.float32)
  vp, vs = rng.random((b, n, kp)) < 0.8, rng.random((b, n, ks)) < 0.8
  kept_p, kept_s = [np.asarray(x) for x in distill.hierarchical_negatives([sp, ss], [vp, vs], [128, 64], m)]
  for r in range(b):
    flat = [(sp[r, j, k], j, k) for j in range(n) for k in range(kp) if vp[r, j, k]]
    top = {(j, k) for _, j, k in sorted(flat, reverse=True)[:m]}
    assert {(j, k) for j in range(n) for k in range(kp) if kept_p[r, j, k]} == top
    inside = [(ss[r, j, k], j, k) for j in range(n) for k in range(ks) if vs[r, j, k] and (j, k // 2) in top]
    assert {(j, k) for j in range(n) for k in range(ks) if kept_s[r, j, k]} == \
        {(j, k) for _, j, k in sorted(inside, reverse=True)[:m]}


def test_pairs_outside_the_pools_are_scored_when_a_batch_needs_them(tmp_path, setup):
  """A random top-up of a short pool is a (query, document) pair the up-front pass never saw: `ensure` scores
  it on demand (the GPU ablation's KeyError), exactly as the up-front pass would have, and counts it."""
  from jdr.training import distill  # pylint: disable=g-import-not-at-top
  config, data, tokenizer, sampler, batches = _distiller_inputs(tmp_path, setup)
  scores = _distiller(config, data, tokenizer, batches, sampler, tmp_path / "cache").teacher
  q = next(iter({q for q, _ in scores.scores}))
  outside = next(d for d in data.corpus if (q, d) not in scores.scores)
  scores.ensure([(q, outside)])
  assert scores.late == 1 and (q, outside) in scores.scores
  # The same pair scored in an up-front pass of its own (a fresh cache) gets the same scores.
  alone = distill.TeacherScores(config.distill, data, tokenizer, {}, scores.query_tokens, [(q, outside)],
                                tmp_path / "c2", query_max_length=config.data.query_max_length,
                                doc_max_length=config.data.doc_max_length)
  np.testing.assert_allclose(scores.doc(q, outside), alone.doc(q, outside), rtol=1e-5)
  np.testing.assert_allclose(scores.pieces(q, outside, "passage"), alone.pieces(q, outside, "passage"),
                             rtol=1e-5, equal_nan=True)
  scores.ensure([(q, outside)])
  assert scores.late == 1  # scored once


def test_a_run_shorter_than_an_epoch_has_the_teacher_score_only_the_queries_it_draws(tmp_path, setup):
  """Up front the teacher scores the pools of the queries the run's steps draw (8 of the 30 here, two steps of
  4), not every training query's; and nothing a step needs is missing from them."""
  config, data, tokenizer, sampler, batches = _distiller_inputs(tmp_path, setup)
  steps = config.num_train_steps
  drawn = {q for step in range(steps) for q in batches.global_layout(step)[0]}
  assert len(drawn) == steps * 4 < len(batches.train_qids) == 30
  assert batches.queries_drawn(steps) == sorted(drawn)
  # Seven steps (28 pairs) still fall short of the epoch; eight reach it and draw every query.
  assert batches.queries_drawn(7) == sorted({q for step in range(7) for q in batches.global_layout(step)[0]})
  assert len(batches.queries_drawn(7)) == 28 and batches.queries_drawn(8) == batches.train_qids
  distiller = _distiller(config, data, tokenizer, batches, sampler, tmp_path / "cache")
  positives = {q: {d for d, r in data.train_qrels[q].items() if r > 0} for q in drawn}
  assert set(distiller.teacher.scores) == {(q, d) for q in drawn for d in positives[q] | set(sampler.pool(q))}
  for step in range(steps):
    assert np.isfinite(distiller.complete(batches.local(step), step)["teacher_doc"]).all()
  assert distiller.teacher.late == 0


@pytest.mark.slow
def test_mined_teacher_scores_train_margin_mse_and_listwise_kl(tmp_path, setup):
  """`python -m jdr.mine --cross-encoder` writes the teacher's score beside each negative and positive (the
  scores the cross-encoder gives those pairs when asked again); a student trains on them with MarginMSE and
  listwise KL as loss terms, nothing scored during training."""
  from conftest import run_module  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  from jdr.training import trainer  # pylint: disable=g-import-not-at-top
  from jdr.evaluation import reranking
  from jdr.data import prepared  # pylint: disable=g-import-not-at-top
  from jdr.models import cross  # pylint: disable=g-import-not-at-top
  from jdr.negatives import mining  # pylint: disable=g-import-not-at-top
  beir, teacher = setup
  out = tmp_path / "mined"
  proc = run_module("jdr.mine", ["--data", beir, "--out", out, "--depth", "6", "--cross-encoder", teacher,
                                 "--ce-max-length", "64"])
  assert proc.returncode == 0, proc.stderr[-3000:]
  mined = mining.read(out)
  assert mined.teacher is not None and np.isfinite(mined.positive_teacher[:, 0]).all()
  model, params, tokenizer = cross.load_cross_encoder(teacher)
  score = reranking.make_scorer(model, jax.device_put(params), tokenizer, max_length=64)
  corpus = prepared.prepare(beir / "corpus.jsonl")
  from jdr.data import formats  # pylint: disable=g-import-not-at-top
  queries = formats.read_queries(beir / "queries.jsonl")
  for i in (0, 7):
    q, row = mined.qids[i], int(mined.rows[i, 1])
    pairs = [(queries[q], corpus.texts([row])[0]), (queries[q], corpus.texts([int(mined.positives[i, 0])])[0])]
    np.testing.assert_allclose(score(pairs), [mined.teacher[i, 1], mined.positive_teacher[i, 0]], rtol=1e-4,
                               atol=1e-5)
  config = _student_config(beir, "mined", ["negatives.source=mined", f"negatives.mined.file={out}",
                                            "distill.granularities=", "distill.document=True",
                                            "distill.margin_mse=True", "distill.contrastive_weight=0"])
  trainer.train_and_evaluate(config, tmp_path / "s")
  logged = [r for r in _records(tmp_path / "s") if "train/loss" in r]
  assert len(logged) == 2
  for r in logged:
    terms = [r[f"train/loss/{k}"] for k in ("kd_document", "kd_margin_mse")]
    assert all(np.isfinite(terms)) and terms[1] > 0
    np.testing.assert_allclose(r["train/loss"], sum(terms), rtol=1e-5)  # alone: contrastive weight 0
  assert not list((tmp_path / "s" / "cache").glob("teacher-*.json"))  # nothing scored in training


def test_a_mined_teacher_leaves_out_and_reports_the_pairs_it_holds_no_score_for(capsys):
  """A pair the mined directory lacks (a random top-up of a short pool) is NaN, which the loss terms leave
  out, and the count of such pairs is printed as it doubles, not dropped silently."""
  from jdr.negatives import mining  # pylint: disable=g-import-not-at-top
  from jdr.training import distill  # pylint: disable=g-import-not-at-top

  class Corpus:
    def row_of(self, doc_ids, *, missing=None):
      return np.array([{"a": 0, "b": 1, "c": 2, "d": 3}.get(d, missing) for d in doc_ids])

  mined = mining.Mined(qids=["q1"], rows=np.array([[1, 2, -1]]), scores=np.zeros((1, 3), np.float32),
                       positives=np.array([[0, -1]]), teacher=np.array([[0.5, np.nan, 0.0]], np.float32),
                       positive_teacher=np.array([[3.0, np.nan]], np.float32), meta={})
  teacher = distill.MinedTeacher(mined, Corpus())
  got = teacher.docs([("q1", "a"), ("q1", "b"), ("q1", "c"), ("q1", "d"), ("q2", "a")])
  np.testing.assert_array_equal(got, [3.0, 0.5, np.nan, np.nan, np.nan])
  assert teacher.missing == 3
  assert "3 pairs the mined directory holds no score for" in capsys.readouterr().err
  teacher.docs([("q1", "a"), ("q1", "b")])  # nothing new missing: no second line
  assert capsys.readouterr().err == ""


def test_a_mined_teacher_needs_mined_negatives():
  from jdr.runtime import config_files  # pylint: disable=g-import-not-at-top
  from jdr.runtime import defaults
  from jdr.training import distill
  config = defaults.get_config()
  config_files.apply_overrides(config, ["distill.teacher=mined", "distill.margin_mse=True", "negatives.source=bm25",
                                        "negatives.per_query=1", "distill.granularities="])
  with pytest.raises(ValueError, match="negatives.source=mined"):
    distill.check(config.distill, source=config.negatives.source, per_query=config.negatives.per_query,
                  architecture=config.model.architecture, data_kind=config.data.kind,
                  model_pooling=config.model.pooling, grad_cache_chunk_size=config.grad_cache.chunk_size)
