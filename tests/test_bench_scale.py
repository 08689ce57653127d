"""jdr.data.synthetic writes MS MARCO-shaped BEIR data (counts, lengths, ids that resolve, queries BM25 can
answer), the same bytes for the same seed, whole or not at all; `python -m jdr.bench scale` runs its stages in
processes of their own and reports each one, failed and timed-out ones included, in a last JSON line."""

import collections
import hashlib
import json
import re
import subprocess
import sys

import numpy as np
import pytest

from jdr.bench import scale
from jdr.data import formats
from jdr.data import synthetic

PASSAGES = 2000


@pytest.fixture(scope="module")
def root(tmp_path_factory):
  """A folder holding the PASSAGES-passage dataset of seed 0 (the bench test reuses it)."""
  folder = tmp_path_factory.mktemp("scale")
  synthetic.dataset(folder, PASSAGES, progress=False)
  return folder


@pytest.fixture(scope="module")
def small(root):
  return root / synthetic.name(PASSAGES)


def _digest(directory):
  files = ["corpus.jsonl", "queries.jsonl", "qrels/train.tsv", "qrels/dev.tsv"]
  return hashlib.sha256(b"".join((directory / f).read_bytes() for f in files)).hexdigest()


def test_query_counts_are_msmarco_proportions():
  assert synthetic.query_counts(synthetic.MSMARCO_PASSAGES) == (502_939, 6_980)
  assert synthetic.query_counts(100_000) == (5_688, 79)
  assert synthetic.query_counts(PASSAGES) == (114, synthetic.MIN_QUERIES)  # 1.6 dev queries round up to a few


def test_files_have_the_counts_and_every_judgment_resolves(small):
  # load_beir refuses a qrels line naming a passage or query the files lack.
  corpus, queries, train = formats.load_beir(small, "train")
  all_queries = formats.read_queries(small / "queries.jsonl")
  dev = formats.read_qrels(small / "qrels" / "dev.tsv", doc_ids=corpus, query_ids=all_queries)
  manifest = synthetic.manifest(small)
  assert len(corpus) == PASSAGES and list(corpus)[:3] == ["0", "1", "2"]
  assert len(train) == manifest["train_queries"] == 114 and len(dev) == manifest["dev_queries"] == 5
  assert len(all_queries) == 119 and not set(train) & set(dev)
  assert sum(map(len, train.values())) == manifest["train_pairs"]
  assert sum(map(len, dev.values())) == manifest["dev_pairs"]
  assert all(rel == 1 for docs in [*train.values(), *dev.values()] for rel in docs.values())
  positives = [d for docs in [*train.values(), *dev.values()] for d in docs]
  assert len(set(positives)) == len(positives)  # no passage answers two queries
  assert all(doc.title == "" and re.fullmatch("[a-z]+( [a-z]+)*", doc.text) for doc in corpus.values())
  assert all(re.fullmatch("[a-z]+( [a-z]+)*", text) for text in all_queries.values())
  assert abs(manifest["words_per_passage"] - synthetic.PASSAGE_WORDS) < 3
  assert abs(manifest["words_per_query"] - synthetic.QUERY_WORDS) < 1


def test_lengths_and_positives_have_msmarcos_shape():
  lengths = synthetic.passage_lengths(np.random.default_rng(0), 200_000)
  assert abs(lengths.mean() - synthetic.PASSAGE_WORDS) < 0.5
  assert 15 < lengths.std() < 40 and lengths.min() >= 3 and lengths.max() > 150  # spread, with a long tail
  plan = synthetic.Plan(1_000_000, seed=0)  # queries without a corpus
  per_query = plan.positives_per_query[:plan.train]
  assert abs(per_query.mean() - synthetic.MSMARCO_TRAIN_PAIRS / synthetic.MSMARCO_TRAIN_QUERIES) < 0.005
  assert per_query.min() == 1 and per_query.max() >= 2
  assert abs(plan.query_words.mean() - synthetic.QUERY_WORDS) < 0.05 and plan.query_words.min() >= 2


@pytest.mark.slow
def test_word_frequencies_are_zipf_like(small):
  counts = collections.Counter(w for doc in formats.iter_corpus(small) for w in doc.text.split())
  total = sum(counts.values())
  ranked = [n for _, n in counts.most_common()]
  assert counts.most_common(1)[0][0] == "the"
  assert 0.4 < sum(counts[w] for w in synthetic.FUNCTION_WORDS) / total < 0.65  # function words: about half
  assert 5 < ranked[0] / ranked[9] < 30  # rank 1 against rank 10: about 10 ** 1.1 under Zipf
  assert len(counts) > total / 10  # a long tail of rare words
  vocabulary, _ = synthetic.vocabulary()
  assert len(np.unique(vocabulary.view(f"S{vocabulary.shape[1]}"))) == synthetic.VOCABULARY  # one rank a word


def test_queries_share_words_with_their_positives_and_bm25_finds_them(small):
  from jdr.negatives import sampled  # pylint: disable=g-import-not-at-top
  corpus, queries, train = formats.load_beir(small, "train")
  for qid, docs in train.items():
    positive_words = {w for d in docs for w in corpus[d].text.split()} - set(synthetic.FUNCTION_WORDS)
    assert set(queries[qid].split()) & positive_words, qid
  run = sampled.bm25_run(corpus, queries, sorted(train), 10)
  found = sum(any(d in run[q] for d in docs) for q, docs in train.items())
  assert found >= 0.8 * len(train)


def test_same_seed_same_bytes_other_seed_other_data(small, tmp_path):
  again = synthetic.dataset(tmp_path, PASSAGES, progress=False)
  other = synthetic.dataset(tmp_path, PASSAGES, seed=1, progress=False)
  assert again != small and _digest(again) == _digest(small)
  assert _digest(other) != _digest(small)


def test_a_dataset_is_reused_and_never_left_half_written(small, tmp_path, monkeypatch):
  def broken(*args, **kwargs):
    raise RuntimeError("killed while writing the queries")

  monkeypatch.setattr(synthetic, "query_texts", broken)
  with pytest.raises(RuntimeError, match="killed"):
    synthetic.dataset(tmp_path, PASSAGES, progress=False)
  assert not list(tmp_path.iterdir())  # neither the dataset nor its temporary folder
  monkeypatch.setattr(synthetic, "generate", broken)
  assert synthetic.dataset(small.parent, PASSAGES, progress=False) == small  # finished: not generated again
  (tmp_path / synthetic.name(PASSAGES)).mkdir()
  (tmp_path / synthetic.name(PASSAGES) / "corpus.jsonl").write_text("")
  with pytest.raises(FileExistsError, match=synthetic.MANIFEST):
    synthetic.dataset(tmp_path, PASSAGES, progress=False)


def test_plan_adds_the_stages_a_stage_reads():
  assert scale.plan(["load"]) == ["generate", "load"]
  assert scale.plan(["dense_mine", "load"]) == ["generate", "load", "tiny_model", "encode_corpus", "dense_mine"]
  assert scale.plan(["first_step_prepared"]) == ["generate", "train_first_step", "first_step_prepared"]


def test_random_vectors_read_back_as_an_encoding_of_the_corpus(small, tmp_path):
  from jdr.retrieval import encodings  # pylint: disable=g-import-not-at-top
  meta = scale.random_encoding(str(small), tmp_path / "a", seed=3, dim=16)
  emb, ids, read = encodings.load_embeddings(tmp_path / "a")
  assert read == meta and meta["vectors"] == "random" and meta["num_shards"] == 1
  corpus_ids = [json.loads(line)["_id"] for line in (small / "corpus.jsonl").read_text().splitlines()]
  assert ids == corpus_ids  # corpus order: rows pair with the documents they stand for
  emb = np.asarray(emb)
  assert emb.shape == (PASSAGES, 16) and emb.dtype == np.float32
  np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, rtol=1e-5)
  again, _, _ = encodings.load_embeddings(scale.random_encoding(str(small), tmp_path / "b", seed=3, dim=16)
                                           and tmp_path / "b")
  np.testing.assert_array_equal(np.asarray(again), emb)  # seeded
  other, _, _ = encodings.load_embeddings(scale.random_encoding(str(small), tmp_path / "c", seed=4, dim=16)
                                           and tmp_path / "c")
  assert not np.allclose(np.asarray(other), emb)


@pytest.mark.slow
def test_bench_prints_each_stage_and_a_json_line(root):
  proc = subprocess.run([sys.executable, "-m", "jdr.bench", "scale", "--passages", str(PASSAGES), "--stages",
                         "load,bm25_mine", "--out", str(root)], capture_output=True, text=True, timeout=300,
                        check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = proc.stdout.strip().splitlines()
  out = json.loads(lines[-1])
  assert [line.split()[0] for line in lines[:-1]] == ["generate", "load", "bm25_mine"]
  assert list(out["stages"]) == ["generate", "load", "bm25_mine"]
  assert out["stages"]["generate"]["status"] == "reused"  # the fixture's dataset
  assert out["counts"]["train_queries"] == 114 and out["passages"] == PASSAGES
  assert {"cpu", "cores"} <= set(out["hardware"]) and {"jax", "faiss", "bm25s"} <= set(out["versions"])
  for name in ("load", "bm25_mine"):
    stage = out["stages"][name]
    assert stage["status"] == "ok", stage
    assert stage["seconds"] > 0 and stage["process_s"] > stage["seconds"]
    assert stage["peak_rss_gib"] > out["baseline_rss_gib"] > 0
    assert stage["bytes_per_passage"] > 0
  assert out["stages"]["load"]["documents"] == PASSAGES
  assert out["stages"]["load"]["text"]["tokens_per_passage"] > out["stages"]["load"]["text"]["words_per_passage"]
  bm25 = out["stages"]["bm25_mine"]
  assert bm25["queries"] == 114 and bm25["top_k"] == 200 and bm25["bytes_per_query"] > 0
  assert 0 < bm25["index_s"] + bm25["mine_s"] <= bm25["seconds"]  # the library's own timed parts
  assert not list(root.glob("work-*"))  # the run's work is removed


def test_a_failed_or_timed_out_stage_is_a_result_not_a_crash(tmp_path):
  ctx = scale.Context(data=str(tmp_path / "absent"), work=str(tmp_path), passages=PASSAGES, seed=0,
                      train_queries=1, dev_queries=1, overrides=[])
  failed = scale.run_stage("no_such_stage", ctx, timeout=120)
  assert failed["status"] == "failed" and "KeyError: 'no_such_stage'" in failed["error"]
  timed_out = scale.run_stage("load", ctx, timeout=0.01)
  assert timed_out["status"] == "timeout" and "after 0.01 s" in timed_out["error"]


@pytest.mark.slow
def test_a_second_bm25_negative_run_builds_and_mines_nothing(root):
  """bm25_first_step_again: a new workdir over the same corpus reads the BM25 index and the mined lists kept
  beside the prepared corpus: the library's index building and query scoring are never called in it."""
  proc = subprocess.run([sys.executable, "-m", "jdr.bench", "scale", "--passages", str(PASSAGES), "--stages",
                         "bm25_first_step_again", "--out", str(root)], capture_output=True, text=True, timeout=600,
                        check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  stages = json.loads(proc.stdout.strip().splitlines()[-1])["stages"]
  first, again = stages["bm25_first_step"], stages["bm25_first_step_again"]
  assert first["status"] == again["status"] == "ok"
  assert first["bm25_build_s"] > 0 and first["bm25_search_s"] > 0
  assert again["bm25_build_s"] == 0 and again["bm25_search_s"] == 0  # never called: read back


@pytest.mark.slow
def test_the_adore_index_stage_searches_random_vectors(root):
  """adore_index over seeded random vectors: the fixed index built and searched through the library's host
  search, each batch's candidates' vectors gathered (a stage whose imports no other test reaches)."""
  proc = subprocess.run([sys.executable, "-m", "jdr.bench", "scale", "--passages", str(PASSAGES), "--stages",
                         "adore_index", "--vectors", "random", "--out", str(root)], capture_output=True, text=True,
                        timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  stage = json.loads(proc.stdout.strip().splitlines()[-1])["stages"]["adore_index"]
  assert stage["status"] == "ok", stage
  assert stage["index_s"] > 0 and stage["step_s"] > 0
