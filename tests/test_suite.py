"""The evaluation suite (jdr.evaluation.suite): tasks resolved and refused, corpora capped (every judged document
kept, the same sample every time), metrics against pytrec_eval, prompts applied, a frozen document tower encoded
once, and the trainer logging eval/suite/... at each of its evaluations."""

import json
import pathlib
import types

import jax
import numpy as np
import pytest

from jdr.data import formats
from jdr.data import shared
from jdr.data import text as text_lib
from jdr.retrieval import tower_encoder
from jdr.evaluation import suite as suite_lib
from jdr.models import build
from jdr.runtime import config_files
from jdr.runtime import defaults
from jdr.training import trainer
from conftest import write_tiny_beir

ROOT = pathlib.Path(__file__).resolve().parents[1]
NO_DATA = types.SimpleNamespace(corpus={}, queries={})  # the suite brings its own; the encoder needs none


def write_task(directory, *, num_docs=120, num_queries=24, judged=5, splits=("test",), seed=0):
  """A generated BEIR task: each query judges `judged` documents with grades 0-2 (one at least relevant), the
  query sharing words with its relevant ones so a model has something to rank."""
  rng = np.random.default_rng(seed)
  vocab = [f"{a}{b}" for a in ("alpha", "beta", "gamma", "delta", "omega", "sigma") for b in ("ton", "lith", "vox")]
  corpus = {f"d{i}": formats.Doc(f"d{i}", "", " ".join(rng.choice(vocab, 10))) for i in range(num_docs)}
  queries, qrels = {}, {}
  for q in range(num_queries):
    docs = rng.choice(num_docs, judged, replace=False)
    grades = rng.integers(0, 3, judged)
    grades[0] = max(grades[0], 1)
    qrels[f"q{q}"] = {f"d{int(d)}": int(g) for d, g in zip(docs, grades)}
    queries[f"q{q}"] = " ".join(corpus[f"d{int(docs[0])}"].text.split()[:3])
  for i, split in enumerate(splits):
    formats.write_beir(directory, corpus, queries, qrels if i == 0 else dict(list(qrels.items())[:6]), split=split)
  return pathlib.Path(directory)


def suite_config(suite, **eval_keys):
  config = defaults.get_config()
  config_files.apply_overrides(config, ["model.init_from=", "model.fresh=tiny", "model.pooling=mean",
                                        f"eval.suite={suite}"] + [f"eval.{k}={v}" for k, v in eval_keys.items()])
  return config


@pytest.fixture(scope="module")
def tiny():
  """A random-weight tiny two-tower model and the trainer's encoder of it."""
  config = suite_config("")
  built = build.build(config.model, config.data)
  params = trainer.initial_params(built.model, built, config, jax.random.PRNGKey(0), None)
  encoder = tower_encoder.TowerEncoder(built.model, built.tokenizer, NO_DATA, query_max_length=16, doc_max_length=32)
  return types.SimpleNamespace(built=built, params=params, encoder=encoder)


# ------------------------------------------------------------------------------------------------- resolving


def test_named_tasks_resolve_in_the_shared_data_folder(tmp_path, monkeypatch):
  monkeypatch.setenv("JDR_SHARED_DATA", str(tmp_path))
  write_task(tmp_path / "scifact", splits=("test", "train"))
  write_task(tmp_path / "reqa-squad-sample", splits=("dev",))
  scifact = suite_lib.resolve("scifact")
  assert (scifact.name, pathlib.Path(scifact.path), scifact.split) == ("scifact", tmp_path / "scifact", "test")
  assert suite_lib.resolve("reqa-squad").split == "dev"  # no test split: dev
  assert suite_lib.resolve("scifact:train").split == "train"
  with pytest.raises(config_files.ConfigError) as missing:
    suite_lib.resolve("trec-dl-sample")
  assert str(missing.value).startswith(f"eval.suite: task 'trec-dl-sample': {tmp_path / 'trec-dl-2019-passage-sample'}: "
                                       "directory not found")
  with pytest.raises(config_files.ConfigError, match=r"task 'scifact': no split 'dev': .*qrels/dev.tsv is missing "
                                                     r"\(splits: test, train\)"):
    suite_lib.resolve("scifact:dev")


def test_other_entries_are_beir_directories(tmp_path):
  task = write_task(tmp_path / "mine", splits=("train",))
  with pytest.raises(config_files.ConfigError, match=r"task 'mine': .*qrels holds no test.tsv or dev.tsv \(splits: "
                                                     r"train\); name one in eval.suite as mine:SPLIT"):
    suite_lib.resolve(str(task))
  spec = suite_lib.resolve(f"{task}:train")
  assert (spec.name, pathlib.Path(spec.path), spec.split) == ("mine", task, "train")
  assert suite_lib.parse_entry("gs://bucket/nfcorpus") == ("gs://bucket/nfcorpus", None)
  assert suite_lib.parse_entry("gs://bucket/nfcorpus:dev") == ("gs://bucket/nfcorpus", "dev")
  with pytest.raises(config_files.ConfigError, match=rf"task 'absent': {tmp_path / 'absent'}: directory not found"):
    suite_lib.resolve(str(tmp_path / "absent"))
  (task / "queries.jsonl").unlink()
  with pytest.raises(config_files.ConfigError, match=r"queries.jsonl: file not found"):
    suite_lib.resolve(f"{task}:train")


def test_check_refuses_what_the_suite_cannot_score(tmp_path):
  one, other = write_task(tmp_path / "a" / "same"), write_task(tmp_path / "b" / "same")
  assert suite_lib.check(suite_config("")) == []
  assert [s.name for s in suite_lib.check(suite_config(f" {one} , "))] == ["same"]
  with pytest.raises(config_files.ConfigError, match="'same' names two tasks"):
    suite_lib.check(suite_config(f"{one},{other}"))
  with pytest.raises(config_files.ConfigError, match="'mean' is the name of the mean over tasks"):
    suite_lib.check(suite_config(str(write_task(tmp_path / "mean"))))
  config = suite_config(str(one))
  config.model.architecture = "cross_encoder"
  with pytest.raises(config_files.ConfigError, match="model.architecture='cross_encoder' has none"):
    suite_lib.check(config)


def test_a_missing_task_stops_the_trainer_before_it_writes_anything(tmp_path):
  config = suite_config(str(tmp_path / "nowhere"))
  config.data.dataset = str(write_tiny_beir(tmp_path / "data"))
  with pytest.raises(config_files.ConfigError, match="eval.suite: task 'nowhere'"):
    trainer.train_and_evaluate(config, tmp_path / "w")
  assert not (tmp_path / "w").exists()


# ------------------------------------------------------------------------------------------------- capping


def test_the_cap_keeps_every_judged_document_and_the_same_sample(tmp_path, tiny):
  spec = suite_lib.resolve(str(write_task(tmp_path / "t", num_docs=300, num_queries=30, judged=5)))
  qrels = formats.read_qrels(pathlib.Path(spec.path) / "qrels" / "test.tsv")
  load = lambda **caps: suite_lib.load_task(spec, doc_tokenizer=tiny.encoder.doc_tokenizer,
                                            query_tokenizer=tiny.encoder.query_tokenizer, doc_max_length=32,
                                            query_max_length=16, **caps)
  task = load(max_docs=60, max_queries=8)
  assert len(task.qids) == 8 and len(task.doc_ids) == 60 and task.capped and task.all_docs == 300
  judged = {d for q in task.qids for d in qrels[q]}
  assert judged <= set(task.doc_ids) and task.judged_docs == len(judged)
  assert task.qrels == {q: qrels[q] for q in task.qids}
  assert task.describe() == "t 8 of 30 queries, 60 of 300 documents (capped)"
  assert len(task.doc_tokens) == 60 and len(task.query_tokens) == 8
  again = load(max_docs=60, max_queries=8)
  assert (again.qids, again.doc_ids) == (task.qids, task.doc_ids)
  np.testing.assert_array_equal(again.doc_tokens.lengths, task.doc_tokens.lengths)
  # The tokens are the kept documents' own, in doc_ids order.
  texts = [text_lib.doc_text(formats.read_corpus(pathlib.Path(spec.path) / "corpus.jsonl")[d]) for d in task.doc_ids]
  expected = text_lib.tokenize(tiny.encoder.doc_tokenizer, texts, 32)
  assert all(np.array_equal(a, b) for a, b in zip(task.doc_tokens, expected))
  # A tight cap takes fewer queries (the longest run of the drawn order whose judged documents fit), never
  # fewer of their judged documents.
  tight = load(max_docs=12, max_queries=8)
  assert len(tight.qids) < 8 and len(tight.doc_ids) == 12
  assert {d for q in tight.qids for d in qrels[q]} <= set(tight.doc_ids)
  assert set(tight.qids) <= set(load(max_docs=60, max_queries=0).qids)
  whole = load(max_docs=0, max_queries=0)
  assert len(whole.qids) == 30 and len(whole.doc_ids) == 300 and not whole.capped
  assert whole.describe() == "t 30 of 30 queries, 300 documents"
  with pytest.raises(config_files.ConfigError, match=r"judges more documents than eval.suite_max_docs=3"):
    load(max_docs=3, max_queries=0)


def test_sample_rows_is_a_pure_function_of_its_arguments():
  judged = np.array([5, 900, 77, 5])
  rows = suite_lib.sample_rows(1000, judged, 50)
  assert len(rows) == 50 and np.all(np.diff(rows) > 0) and {5, 77, 900} <= set(rows.tolist())
  np.testing.assert_array_equal(rows, suite_lib.sample_rows(1000, judged, 50))
  assert not np.array_equal(rows, suite_lib.sample_rows(1000, judged, 50, seed=1))  # the seed draws them
  np.testing.assert_array_equal(suite_lib.sample_rows(40, judged[:1], 50), np.arange(40))
  with pytest.raises(ValueError, match="3 judged documents do not fit in a cap of 2"):
    suite_lib.sample_rows(1000, judged, 2)


# ------------------------------------------------------------------------------------------------- scoring


def _pytrec_means(qrels, run, top_k):
  pytrec_eval = pytest.importorskip("pytrec_eval")
  cut10 = {q: dict(sorted(r.items(), key=lambda kv: (kv[1], kv[0]), reverse=True)[:10]) for q, r in run.items()}
  per_query = pytrec_eval.RelevanceEvaluator(qrels, {"ndcg_cut.10", "recall.100"}).evaluate(run)
  mrr = pytrec_eval.RelevanceEvaluator(qrels, {"recip_rank"}).evaluate(cut10)
  assert len(run) == len(qrels) and all(len(r) == top_k for r in run.values())
  return {"ndcg@10": np.mean([v["ndcg_cut_10"] for v in per_query.values()]),
          "mrr@10": np.mean([v["recip_rank"] for v in mrr.values()]),
          "recall@100": np.mean([v["recall_100"] for v in per_query.values()])}


def test_the_suite_scores_as_pytrec_eval_on_an_exact_ranking(tmp_path, tiny):
  capped = write_task(tmp_path / "capped", num_docs=300, num_queries=20, judged=4, seed=1)
  small = write_task(tmp_path / "small", num_docs=60, num_queries=10, judged=3, seed=2)
  suite = suite_lib.Suite(tiny.encoder, suite_config(f"{capped},{small}:test", suite_max_docs=150,
                                                     suite_max_queries=12))
  assert suite.describe() == ("suite: capped 12 of 20 queries, 150 of 300 documents (capped); "
                              "small 10 of 10 queries, 60 documents")
  scores = suite(tiny.params)
  assert set(scores) == {f"suite/{t}/{m}" for t in ("capped", "small", "mean") for m in ("ndcg@10", "mrr@10", "recall@100")}
  assert set(suite.seconds) == {"capped", "small"}
  for task in suite.tasks:
    run = suite.ranking(tiny.params, task)
    # The ranking is the exact top-k of the kept documents by dot product, named by their ids.
    doc_emb = tiny.encoder.documents(tiny.params, task.doc_tokens)
    query_emb = tiny.encoder.query_vectors(tiny.params, task.query_tokens)
    for q, vector in zip(task.qids, query_emb):
      expected = np.sort(doc_emb @ vector)[::-1][:len(run[q])]
      np.testing.assert_allclose(sorted(run[q].values(), reverse=True), expected, rtol=1e-5, atol=1e-6)
      best = task.doc_ids[int(np.argmax(doc_emb @ vector))]
      assert run[q][best] == pytest.approx(max(run[q].values()))
    reference = _pytrec_means(task.qrels, run, min(100, len(task.doc_ids)))
    for metric, value in reference.items():
      assert scores[f"suite/{task.spec.name}/{metric}"] == pytest.approx(value, abs=1e-6), (task.spec.name, metric)
  for metric in ("ndcg@10", "mrr@10", "recall@100"):
    assert scores[f"suite/mean/{metric}"] == pytest.approx(
        (scores[f"suite/capped/{metric}"] + scores[f"suite/small/{metric}"]) / 2)
  assert suite(tiny.params) == pytest.approx(scores)  # the same tasks, the same numbers, at every evaluation


def test_the_models_prompts_come_first(tmp_path, tiny):
  task = write_task(tmp_path / "t")
  prompts = {"query": "query: ", "doc": "passage: "}
  encoder = tower_encoder.TowerEncoder(tiny.built.model, tiny.built.tokenizer, NO_DATA, query_max_length=16,
                                  doc_max_length=32, prompts=prompts)
  (loaded,) = suite_lib.Suite(encoder, suite_config(str(task))).tasks
  tokenizer = tiny.built.tokenizer
  for rows, prompt in ((loaded.doc_tokens, "passage:"), (loaded.query_tokens, "query:")):
    start = [tokenizer.cls_token_id, *tokenizer(prompt, add_special_tokens=False)["input_ids"]]
    assert len(rows) and all(r[:len(start)].tolist() == start for r in rows), prompt


def test_a_frozen_document_tower_encodes_each_task_once(tmp_path, tiny, monkeypatch):
  suite = suite_lib.Suite(tiny.encoder, suite_config(f"{write_task(tmp_path / 'a')},{write_task(tmp_path / 'b')}"),
                          doc_tower_frozen=True)
  calls = []
  documents = tiny.encoder.documents
  monkeypatch.setattr(tiny.encoder, "documents", lambda p, t: calls.append(len(t)) or documents(p, t))
  first, second = suite(tiny.params), suite(tiny.params)
  assert first == second and len(calls) == 2


def test_the_run_and_the_suite_evaluate_as_one():
  class Own:
    def describe(self, final=False):
      return "full corpus" + (" (final)" if final else "")

    def __call__(self, params, final=False):
      return {"ndcg@10": 0.5 if final else 0.25}

  class FakeSuite:
    def describe(self, final=False):
      return "suite: t 1 of 1 queries, 3 documents"

    def __call__(self, params, final=False):
      return {"suite/t/ndcg@10": 1.0, "suite/mean/ndcg@10": 1.0}

  own, suite = Own(), FakeSuite()
  assert suite_lib.alongside(None, None) is None
  assert suite_lib.alongside(own, None) is own and suite_lib.alongside(None, suite) is suite
  both = suite_lib.alongside(own, suite)
  assert both.describe(final=True) == "full corpus (final); suite: t 1 of 1 queries, 3 documents"
  assert both(None, final=True) == {"ndcg@10": 0.5, "suite/t/ndcg@10": 1.0, "suite/mean/ndcg@10": 1.0}


# ------------------------------------------------------------------------------------------------- the trainer


def _train(tmp_path, name, *overrides):
  config = config_files.load_config_file(f"{ROOT / 'configs' / 'demo.py'}:tiny")
  config_files.apply_overrides(config, [
      f"data.dataset={write_tiny_beir(tmp_path / 'data')}", "batch_size=8", "num_train_steps=4", "log_every=2",
      "checkpoint_every=0", "data.query_max_length=16", "data.doc_max_length=32", "eval.diagnostic_queries=0",
      f"eval.suite={write_task(tmp_path / 'other')},{tmp_path / 'data'}", *overrides])
  trainer.train_and_evaluate(config, tmp_path / name)
  return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


def test_the_trainer_logs_the_suite_at_each_evaluation(tmp_path, capsys):
  records = _train(tmp_path, "w", "eval_every=2")
  suite_keys = {f"eval/suite/{t}/{m}" for t in ("other", "data", "mean") for m in ("ndcg@10", "mrr@10", "recall@100")}
  evaluated = {r["step"]: r for r in records if "eval/ndcg@10" in r}
  assert sorted(evaluated) == [0, 2, 4]  # before training, every eval_every, the end
  for step, record in evaluated.items():
    assert suite_keys <= set(record), step
    assert all(0.0 <= record[k] <= 1.0 for k in suite_keys)
  printed = capsys.readouterr().out
  assert "step 2, eval (full corpus, 40 documents, 10 queries; suite: other 24 of 24 queries, 120 documents; " \
         "data 10 of 10 queries, 40 documents): ndcg@10=" in printed
  assert "suite/other/ndcg@10=" in printed and "suite/mean/ndcg@10=" in printed


def test_a_run_without_an_eval_split_runs_the_suite_alone(tmp_path):
  records = _train(tmp_path, "w", "data.eval_split=")
  evaluated = [r for r in records if any(k.startswith("eval/") for k in r)]
  assert [r["step"] for r in evaluated] == [0, 4]
  assert all("eval/suite/mean/ndcg@10" in r and "eval/ndcg@10" not in r for r in evaluated)


# ------------------------------------------------------------------------------------------------- the shared data


def test_the_named_tasks_at_the_default_caps(tiny):
  missing = [n for n in suite_lib.NAMED.values() if shared.shared_dataset(n) is None]
  if missing:
    pytest.skip(f"real data absent: {', '.join(str(shared.shared_data_dir() / n) for n in missing)} "
                "(set JDR_SHARED_DATA)")
  suite = suite_lib.Suite(tiny.encoder, suite_config(",".join(suite_lib.NAMED)))
  by_name = {t.spec.name: t for t in suite.tasks}
  assert {n: t.spec.split for n, t in by_name.items()} == {"scifact": "test", "trec-dl-sample": "test",
                                                           "reqa-squad": "test"}
  scifact, trec, reqa = by_name["scifact"], by_name["trec-dl-sample"], by_name["reqa-squad"]
  assert (len(scifact.qids), len(scifact.doc_ids), scifact.all_docs) == (50, 2000, 5183)
  # TREC DL judges ~95 passages a query: the queries whose judged passages fill the 2,000-document cap.
  assert 10 < len(trec.qids) < 43 and len(trec.doc_ids) <= 2000 and trec.all_docs == 5000
  assert (len(reqa.qids), len(reqa.doc_ids), reqa.capped) == (50, 382, False)
  for task in suite.tasks:
    assert {d for q in task.qids for d in task.qrels[q]} <= set(task.doc_ids)
  assert "scifact 50 of 300 queries, 2,000 of 5,183 documents (capped)" in suite.describe()


def test_the_bench_measures_a_suite_evaluation(tmp_path, capsys):
  from jdr.bench import eval_suite  # pylint: disable=g-import-not-at-top
  eval_suite.main(["--model", "", "--tasks", f"{write_task(tmp_path / 'a')},{write_task(tmp_path / 'b')}",
                   "--max-docs", "50", "--doc-max-length", "32"])
  result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert result["benchmark"] == "suite" and set(result["tasks"]) == {"a", "b"}
  # 24 queries judge 5 documents each: the 50-document cap holds the judged ones of some of them.
  assert result["tasks"]["a"]["documents"] == 50 and 0 < result["tasks"]["a"]["queries"] < 24
  assert result["total_seconds"] == pytest.approx(sum(t["seconds"] for t in result["tasks"].values()), abs=0.05)
