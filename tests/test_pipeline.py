"""The command lines end to end on a tiny random BERT: encode (with resume), retrieve, evaluate, export."""

import contextlib
import dataclasses
import json
import logging
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers

from conftest import write_tiny_beir
from jdr.retrieval import encoder_runtime
from jdr.retrieval import encodings
from jdr import encode
from jdr import retrieve
from jdr.data import formats
from jdr.data import text as text_lib
from jdr.models import hf
from jdr.models import published
from jdr.models.bert import Encoder, EncoderConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def logged_warnings(*loggers):
  """Warnings logged by these loggers (transformers' do not propagate to the root, so caplog misses them)."""
  records = []
  handler = logging.Handler(logging.WARNING)
  handler.emit = records.append
  for name in loggers:
    logging.getLogger(name).addHandler(handler)
  try:
    yield records
  finally:
    for name in loggers:
      logging.getLogger(name).removeHandler(handler)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
  """A random 2-layer BERT saved as a Hugging Face directory with the MiniLM tokenizer."""
  path = tmp_path_factory.mktemp("tiny-bert")
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(hf.minilm_path()))
  cfg = EncoderConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_layers=2, num_heads=2,
                      intermediate_size=64)
  params = Encoder(cfg).init(jax.random.PRNGKey(0), jnp.ones((1, 8), jnp.int32), jnp.ones((1, 8), jnp.int32))
  hf.export_hf(cfg, jax.device_get(params["params"]), path, tokenizer=tokenizer)
  return path


def _direct_embeddings(model_dir, texts, max_length, pooling=None, normalize=None):
  """The oracle: one padded batch through the tower, no bucketing, no shards."""
  tower, params, tokenizer, _ = published.load_tower(str(model_dir), pooling=pooling, normalize=normalize,
                                              max_length=max_length)
  enc = tokenizer(texts, truncation=True, max_length=max_length, padding=True, return_tensors="np")
  return np.asarray(tower.apply({"params": params}, enc["input_ids"], enc["attention_mask"]))


def test_batches_encoded_at_once_match_one_at_a_time_and_the_direct_batch(tiny_model, monkeypatch):
  """On a CPU several batches run at once, each from its own thread: the vectors are those of one batch at a
  time, bitwise, in the texts' order, and the direct single batch's (the oracle) to float tolerance."""
  texts = [f"document {i} " + "word " * (i % 13) for i in range(37)]
  runtime = encoder_runtime.load_runtime(str(tiny_model), max_length=24, pooling="mean", normalize=True)
  monkeypatch.setattr(encoder_runtime, "batches_at_once", lambda: 1)
  one = encoder_runtime.encode_texts(runtime, texts, tokens_per_batch=48)
  calls = []
  apply_fn = runtime.apply_fn
  concurrent_runtime = dataclasses.replace(runtime, apply_fn=lambda *a: calls.append(1) or apply_fn(*a))
  monkeypatch.setattr(encoder_runtime, "batches_at_once", lambda: 3)
  several = encoder_runtime.encode_texts(concurrent_runtime, texts, tokens_per_batch=48)
  assert len(calls) > 3  # more batches than run at once, so the queue turned over
  np.testing.assert_array_equal(several, one)
  np.testing.assert_allclose(several, _direct_embeddings(tiny_model, texts, 24, "mean", True), atol=1e-5)
  ids = text_lib.tokenize(runtime.tokenizer, texts, 24)
  np.testing.assert_array_equal(encoder_runtime.encode_tokens(concurrent_runtime, ids, tokens_per_batch=48), one)


def test_batches_at_once_is_one_per_usable_core_up_to_the_cap(monkeypatch):
  monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
  assert encoder_runtime.batches_at_once() == 3
  monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
  assert encoder_runtime.batches_at_once() == encoder_runtime.MAX_CPU_BATCHES_AT_ONCE
  monkeypatch.setattr(encoder_runtime.jax, "default_backend", lambda: "gpu")
  assert encoder_runtime.batches_at_once() == 1


@pytest.mark.slow
def test_encode_matches_direct_and_resumes(tmp_path, tiny_model, capsys):
  data = write_tiny_beir(tmp_path / "data", num_docs=23)
  out = tmp_path / "emb"
  args = ["--model", str(tiny_model), "--corpus", str(data), "--out", str(out), "--pooling", "mean",
          "--normalize", "--max-length", "32", "--shard-size", "5", "--tokens-per-batch", "64"]
  encode.main(args)
  emb, ids, meta = encodings.load_embeddings(out)
  corpus = formats.read_corpus(data / "corpus.jsonl")
  assert ids == list(corpus) and meta["num_shards"] == 5 and meta["complete"]
  expected = _direct_embeddings(tiny_model, [text_lib.doc_text(corpus[i]) for i in ids], 32, "mean", True)
  np.testing.assert_allclose(emb, expected, atol=1e-5)

  # What a kill leaves: two finished shards gone, a half-written temp file, meta not complete.
  for shard in (3, 4):
    (out / f"emb-{shard:05d}.npy").unlink()
  (out / "emb-00003.npy.tmp").write_bytes(b"partial")
  meta_file = out / "meta.json"
  meta_file.write_text(json.dumps({**json.loads(meta_file.read_text()), "complete": False}))
  with pytest.raises(ValueError, match="unfinished"):
    encodings.load_embeddings(out)
  untouched = (out / "emb-00000.npy").stat().st_mtime_ns
  encode.main(args)
  assert (out / "emb-00000.npy").stat().st_mtime_ns == untouched  # finished shards are not redone
  emb2, ids2, _ = encodings.load_embeddings(out)
  assert ids2 == ids
  np.testing.assert_array_equal(emb2, emb)

  # Resuming with other settings would mix two models' vectors in one index: refused.
  capsys.readouterr()
  with pytest.raises(SystemExit) as exit_info:
    encode.main([*args[:-2], "--max-length", "16"])
  assert exit_info.value.code == 2
  assert f"error: {out / 'meta.json'}: the existing encoding was made with other settings" in capsys.readouterr().err
  runtime = encoder_runtime.load_runtime(str(tiny_model), max_length=16)
  with pytest.raises(ValueError, match="other settings"):  # the library raises, never exits
    encodings.encode_corpus(runtime, corpus, out, shard_size=5, settings={"max_length": 16})
  # A key only the old encoding has differs too: a FirstP resume of a MaxP directory is refused.
  maxp = tmp_path / "maxp"
  encodings.encode_corpus(runtime, corpus, maxp, shard_size=50, settings={"max_length": 16}, passages=2)
  with pytest.raises(ValueError, match="'passages': \\(2, None\\)"):
    encodings.encode_corpus(runtime, corpus, maxp, shard_size=50, settings={"max_length": 16})


@pytest.mark.slow
def test_retrieve_backends_agree_and_evaluate(tmp_path, tiny_model):
  data = write_tiny_beir(tmp_path / "data")
  emb_dir = tmp_path / "emb"
  encode.main(["--model", str(tiny_model), "--corpus", str(data), "--out", str(emb_dir), "--max-length", "32"])
  runs = {}
  for backend in ("faiss", "jax"):
    run_file = tmp_path / f"{backend}.trec"
    retrieve.main(["--index", str(emb_dir), "--queries", str(data), "--split", "test", "--top-k", "10",
                   "--backend", backend, "--run", str(run_file)])
    runs[backend] = formats.read_run(run_file)
  assert set(runs["faiss"]) == {f"q{i}" for i in range(30, 40)}  # only the test split's queries

  # Brute-force numpy over the saved embeddings is the oracle. A random tiny model scores some documents
  # within float noise of each other, so rankings are compared by score: every back-end's k-th score is
  # the k-th best, and every returned document carries its true score.
  emb, ids, _ = encodings.load_embeddings(emb_dir)
  runtime = encoder_runtime.load_runtime(str(tiny_model), max_length=32)
  queries = formats.load_beir(data, "test")[1]
  q_emb = encoder_runtime.encode_texts(runtime, list(queries.values()))
  for qid, scores in zip(queries, q_emb @ emb.T):
    best = np.sort(scores)[::-1][:10]
    true_score = dict(zip(ids, scores))
    for backend, run in runs.items():
      np.testing.assert_allclose(list(run[qid].values()), best, atol=1e-5, err_msg=backend)
      np.testing.assert_allclose([true_score[d] for d in run[qid]], best, atol=1e-5, err_msg=backend)

  proc = subprocess.run([sys.executable, "-m", "jdr.evaluate", "--qrels", str(data / "qrels" / "test.tsv"),
                         "--run", str(tmp_path / "faiss.trec"), "--metrics", "ndcg@10,mrr@10", "--json"],
                        capture_output=True, text=True, check=True, cwd=ROOT)
  scores = json.loads(proc.stdout.strip().splitlines()[-1])
  assert set(scores) == {"ndcg@10", "mrr@10"} and all(0 <= v <= 1 for v in scores.values())


@pytest.mark.slow
def test_train_export_then_encode_with_the_trained_towers(trained, tmp_path):
  """jdr.export writes a params checkpoint that jdr.encode loads, and a HF dir that transformers loads."""
  from jdr import export as export_command  # pylint: disable=g-import-not-at-top
  export_command.main(["--workdir", str(trained), "--out", str(tmp_path / "export")])  # what `python -m` runs
  export = tmp_path / "export"
  assert (export / "jdr_model.json").exists() and (export / "model.safetensors").exists()

  corpus = formats.read_corpus(trained.parent / "data" / "corpus.jsonl")
  texts = [text_lib.doc_text(d) for d in corpus.values()][:6]
  from_export = encoder_runtime.encode_texts(encoder_runtime.load_runtime(str(export)), texts)
  from_workdir = encoder_runtime.encode_texts(encoder_runtime.load_runtime(str(trained)), texts)
  np.testing.assert_array_equal(from_export, from_workdir)
  # The Hugging Face export with its sentence-transformers pooling files gives the same vectors.
  np.testing.assert_allclose(from_export, _direct_embeddings(export, texts, None), atol=1e-5)  # its serving length
  with logged_warnings("transformers") as records:
    hf_model = transformers.AutoModel.from_pretrained(str(export))
  assert hf_model.config.hidden_size == 64
  assert not [r.getMessage() for r in records if "pooler" in r.getMessage()]

  # sentence-transformers loads it with the document serving length (not the query length, 16), no pooler
  # warning, and embeds as jdr does.
  sentence_transformers = pytest.importorskip("sentence_transformers")
  with logged_warnings("transformers", "sentence_transformers") as records:
    st_model = sentence_transformers.SentenceTransformer(str(export), device="cpu")
  assert not [r.getMessage() for r in records if "pooler" in r.getMessage()]
  assert st_model.max_seq_length == json.loads((export / "jdr_model.json").read_text())["serve_doc_max_length"]
  np.testing.assert_allclose(st_model.encode(texts), from_export, atol=1e-5)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A tiny random two-tower model trained 2 steps on 16-token queries: its workdir (beside its data/), shared
  by the module's export tests, which only read it."""
  from jdr.training import trainer  # pylint: disable=g-import-not-at-top
  from jdr.runtime import config_files
  root = tmp_path_factory.mktemp("trained")
  data = write_tiny_beir(root / "data")
  config = config_files.load_config_file(str(ROOT / "configs" / "demo.py:tiny"))
  config_files.apply_overrides(config, [f"data.dataset={data}", "num_train_steps=2", "batch_size=4",
                                        "data.eval_split=", "data.query_max_length=16", "data.doc_max_length=32"])
  trainer.train_and_evaluate(config, root / "w")
  return root / "w"


@pytest.mark.slow
def test_a_copied_export_loads_anywhere_and_serves_past_the_training_length(trained, tmp_path):
  """Copy an export, delete the original and the workdir: jdr, transformers and sentence-transformers load the
  copy from its own folder; and a query longer than the 16 training tokens is read whole, not cut at 16."""
  import shutil  # pylint: disable=g-import-not-at-top
  from jdr import export  # pylint: disable=g-import-not-at-top
  workdir = shutil.copytree(trained, tmp_path / "w")  # this test deletes it
  original = export.export(workdir, tmp_path / "export")
  assert json.loads((original / "jdr_model.json").read_text())["tokenizer"] == "."
  copy = tmp_path / "elsewhere" / "model"
  shutil.copytree(original, copy)
  shutil.rmtree(original)
  shutil.rmtree(workdir)

  query = encoder_runtime.load_runtime(str(copy), side="query")
  assert query.max_length == 512 and query.info["trained_max_length"] == 16
  long_query = " ".join(["alphaton betalith gammamere deltavox"] * 8)
  n_tokens = len(query.tokenizer(long_query)["input_ids"])
  assert n_tokens > 16
  whole = encoder_runtime.encode_texts(query, [long_query])
  cut = encoder_runtime.encode_texts(encoder_runtime.load_runtime(str(copy), side="query", max_length=16), [long_query])
  exact = encoder_runtime.encode_texts(encoder_runtime.load_runtime(str(copy), side="query", max_length=n_tokens),
                                  [long_query])
  # Padded to other lengths, the two encodes are differently shaped compiled programs, whose sums can round
  # apart in the last bit: equal to float32 rounding, not bitwise, where the cut at 16 tokens is far off.
  np.testing.assert_allclose(whole, exact, rtol=1e-6, atol=1e-6)
  assert np.abs(whole - cut).max() > 1e-3

  texts = ["alphaton zen", long_query]
  docs = encoder_runtime.encode_texts(encoder_runtime.load_runtime(str(copy)), texts)
  hf_model = transformers.AutoModel.from_pretrained(str(copy))
  assert hf_model.config.hidden_size == 64
  sentence_transformers = pytest.importorskip("sentence_transformers")
  st_model = sentence_transformers.SentenceTransformer(str(copy), device="cpu")
  assert st_model.max_seq_length == 512
  np.testing.assert_allclose(st_model.encode(texts), docs, atol=1e-5)


@pytest.mark.slow
def test_export_lengths_are_set_at_export_checked_and_a_full_disk_leaves_nothing(trained, tmp_path):
  from jdr import export  # pylint: disable=g-import-not-at-top
  workdir = trained
  out = export.export(workdir, tmp_path / "export", query_max_length=64, doc_max_length=256)
  described = json.loads((out / "jdr_model.json").read_text())
  assert (described["serve_query_max_length"], described["serve_doc_max_length"]) == (64, 256)
  assert (described["query_max_length"], described["doc_max_length"]) == (16, 32)  # training, kept apart
  assert encoder_runtime.load_runtime(str(out), side="query").max_length == 64
  assert json.loads((out / "sentence_bert_config.json").read_text())["max_seq_length"] == 256
  with pytest.raises(ValueError, match="1 to 512 tokens"):
    export.export(workdir, tmp_path / "too-long", doc_max_length=1024)
  assert not (tmp_path / "too-long").exists() and not list(tmp_path.glob(".too-long*"))

  # A disk that fills up (a file-size limit: writes past 1 MB fail with EFBIG) is one `error:` line naming
  # the export, status 2, and no partial export.
  limited = ("import os, resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20)); "
             "os.execv(sys.executable, [sys.executable, '-m', 'jdr.export', *sys.argv[1:]])")
  proc = subprocess.run([sys.executable, "-c", limited, "--workdir", str(workdir), "--out", str(tmp_path / "full")],
                        capture_output=True, text=True, cwd=ROOT, timeout=300)
  errors = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
  assert proc.returncode == 2 and errors == [f"error: {tmp_path / 'full'}: File too large"], proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr
  assert not (tmp_path / "full").exists() and not list(tmp_path.glob(".full*"))


def test_export_declares_the_document_length_or_the_base_models():
  from jdr import export  # pylint: disable=g-import-not-at-top
  tower = {"encoder": dataclasses.asdict(EncoderConfig(max_position_embeddings=512))}
  description = {"query": tower, "doc": tower, "shared": True, "query_max_length": 32, "doc_max_length": 128}
  assert export.sentence_transformers_max_length(description, "query") == 128  # a shared tower embeds documents
  assert export.sentence_transformers_max_length({**description, "base_max_length": 256}, "query") == 256
  assert export.sentence_transformers_max_length({**description, "doc_max_length": 1024}, "query") == 512
  separate = {**description, "shared": False}
  assert export.sentence_transformers_max_length(separate, "query") == 32
  assert export.sentence_transformers_max_length(separate, "doc") == 128


def test_a_model_built_on_minilm_exports_minilms_max_length():
  from jdr import export  # pylint: disable=g-import-not-at-top
  from jdr.runtime import defaults
  from jdr.models import build  # pylint: disable=g-import-not-at-top
  config = defaults.get_config()  # init_from=minilm, doc_max_length 128
  description = build.build(config.model, config.data).description
  assert description["base_max_length"] == 256  # MiniLM's sentence_bert_config.json
  assert export.sentence_transformers_max_length(description, "doc") == 256
