"""Object storage through the same code as local disk (jdr.runtime.paths, etils.epath): data files, encodings,
indexes, runs and metric logs on a `gs://` bucket served from memory (the `fake_gcs` fixture) equal the same
work on local disk. Orbax checkpoints reach gs:// through orbax's own GCS support, which needs a real bucket."""

import types

import numpy as np
import pytest

from jdr.runtime import atomic
from jdr.retrieval import encodings
from jdr.retrieval import retrievers
from jdr.retrieval import index as index_lib
from jdr.training import metric_writers
from jdr.runtime import paths
from jdr.data import formats
from test_corpus import _fake_runtime


def test_paths_tell_local_from_object_storage(tmp_path):
  assert paths.is_local(tmp_path) and paths.is_local("rel/dir") and not paths.is_local("gs://b/x")
  assert str(paths.absolute("gs://b/x")) == "gs://b/x" and paths.absolute("rel").is_absolute()
  with pytest.raises(ValueError, match="gs://b/x: this needs a local path"):
    paths.local("gs://b/x")


def test_corpus_encoding_index_and_run_on_gs_equal_local(tmp_path, fake_gcs):
  corpus = {f"d{i}": formats.Doc(f"d{i}", "", " ".join(["w"] * (1 + i % 9))) for i in range(25)}
  formats.write_corpus(tmp_path / "corpus.jsonl", corpus)
  formats.write_corpus("gs://bucket/data/corpus.jsonl", corpus)
  assert "gs://bucket/data/corpus.jsonl" in fake_gcs and not list(tmp_path.glob(".*tmp*"))
  remote = formats.read_corpus("gs://bucket/data")  # a BEIR directory on the bucket
  assert remote == formats.read_corpus(tmp_path / "corpus.jsonl") == corpus
  parts = [formats.read_corpus("gs://bucket/data/corpus.jsonl", part=p, parts=3) for p in range(3)]
  assert [d for part in parts for d in part] == list(corpus)

  runtime = _fake_runtime(max_length=8)
  tokenizer = types.SimpleNamespace(pad_token_id=0)
  runtime.tokenizer = tokenizer
  import jdr.data.text as text_lib  # pylint: disable=g-import-not-at-top
  tokenize = text_lib.tokenize
  text_lib.tokenize = lambda tok, texts, n: [np.arange(1, 1 + min(n, len(t.split()))) for t in texts]
  try:
    local_meta = encodings.encode_corpus(runtime, corpus, tmp_path / "enc", shard_size=10)
    remote_meta = encodings.encode_corpus(runtime, corpus, "gs://bucket/enc", shard_size=10)
  finally:
    text_lib.tokenize = tokenize
  assert remote_meta == local_meta and "gs://bucket/enc/emb-00002.npy" in fake_gcs
  emb, ids, _ = encodings.load_embeddings("gs://bucket/enc")
  local_emb, local_ids, _ = encodings.load_embeddings(tmp_path / "enc")
  np.testing.assert_array_equal(emb, local_emb)
  assert ids == local_ids == list(corpus)

  built = retrievers.load_index("gs://bucket/enc", "faiss", "Flat", save=True)
  assert "gs://bucket/enc/index-faiss-Flat/index.faiss" in fake_gcs
  reused = retrievers.load_index("gs://bucket/enc", "faiss", "Flat")
  queries = np.random.default_rng(0).standard_normal((4, emb.shape[1])).astype(np.float32)
  run = retrievers.retrieve_run(reused, ["a", "b", "c", "d"], queries, 5)
  assert run == retrievers.retrieve_run(built, ["a", "b", "c", "d"], queries, 5)
  for q, row in zip("abcd", queries):  # brute force (the fake vectors tie, so the scores are compared)
    np.testing.assert_allclose(list(run[q].values()), np.sort(emb @ row)[::-1][:5], rtol=1e-5)
  formats.write_run("gs://bucket/runs/test.trec", run)
  back = formats.read_run("gs://bucket/runs/test.trec")
  rounded = lambda r: {q: {d: round(v, 4) for d, v in docs.items()} for q, docs in r.items()}
  assert rounded(back) == rounded(run)

  jax_index = retrievers.build_index(emb, ids, "jax")
  jax_index.save("gs://bucket/jax-index")
  assert index_lib.load_retriever("gs://bucket/jax-index").search(queries, 3)[1] == jax_index.search(queries, 3)[1]


def test_metric_log_and_atomic_files_on_gs(fake_gcs):
  writer = metric_writers.MetricWriter("gs://bucket/work", tensorboard=False)
  writer.write(10, {"loss": 1.5})
  writer.write(20, {"loss": 1.25})
  again = metric_writers.MetricWriter("gs://bucket/work", tensorboard=False)  # a resumed run appends
  again.write(30, {"loss": 1.0})
  assert [(r["step"], r["loss"]) for r in metric_writers.read("gs://bucket/work")] == [(10, 1.5), (20, 1.25),
                                                                                        (30, 1.0)]
  # A run resumed from step 20 drops what was logged after it (step 30), then logs it again once.
  resumed = metric_writers.MetricWriter("gs://bucket/work", tensorboard=False, start_step=20)
  resumed.write(30, {"loss": 0.5})
  assert [(r["step"], r["loss"]) for r in metric_writers.read("gs://bucket/work")] == [(10, 1.5), (20, 1.25),
                                                                                        (30, 0.5)]
  atomic.write_text("gs://bucket/work/config.json", "{}")
  assert paths.as_path("gs://bucket/work/config.json").read_text() == "{}"
  arr = np.arange(6, dtype=np.float32).reshape(2, 3)
  atomic.write_atomic("gs://bucket/work/a.npy", lambda f: np.save(f, arr))
  np.testing.assert_array_equal(paths.load_npy("gs://bucket/work/a.npy"), arr)

  def half_then_fail(f):
    f.write(b"\x93NUMPY half a header")
    raise OSError("preempted mid-write")
  with pytest.raises(OSError, match="preempted"):
    atomic.write_atomic("gs://bucket/work/b.npy", half_then_fail)
  assert not paths.as_path("gs://bucket/work/b.npy").exists()  # no truncated object that looks finished


def test_faiss_gpu_options_and_their_record(tmp_path):
  """How an index spreads over a host's GPUs (the faiss GPU build is not installed here: the cloner options
  are checked against a stand-in for faiss' options class, and the choice travels with a saved index)."""
  fake = types.SimpleNamespace(GpuMultipleClonerOptions=types.SimpleNamespace)
  sharded = index_lib.gpu_cloner_options(fake, "shard", False)
  replicated = index_lib.gpu_cloner_options(fake, "replicate", True)
  assert sharded.shard and not sharded.useFloat16
  assert not replicated.shard and replicated.useFloat16 and replicated.useFloat16CoarseQuantizer
  with pytest.raises(ValueError, match="gpu_layout must be"):
    index_lib.FaissRetriever(4, gpu_layout="spread")
  r = index_lib.FaissRetriever(4, use_gpu=False, gpu_layout="replicate", gpu_float16=True)
  r.add(np.eye(4, dtype=np.float32), ["a", "b", "c", "d"])
  r.save(tmp_path / "idx")
  back = index_lib.load_retriever(tmp_path / "idx", use_gpu=False)
  assert (back.gpu_layout, back.gpu_float16) == ("replicate", True)
  assert index_lib.load_retriever(tmp_path / "idx", use_gpu=False, gpu_layout="shard").gpu_layout == "shard"


def test_local_copy_and_upload_of_directories(tmp_path, fake_gcs):
  """What readers of local directories only (transformers' from_pretrained) and writers of them (exports) get."""
  src = tmp_path / "model"
  (src / "sub").mkdir(parents=True)
  (src / "config.json").write_text('{"a": 1}')
  (src / "sub" / "w.bin").write_bytes(b"\x00\x01")
  paths.upload_dir(src, "gs://bucket/model")
  assert {"gs://bucket/model/config.json", "gs://bucket/model/sub/w.bin"} <= set(fake_gcs)
  with paths.local_copy("gs://bucket/model") as copy:
    assert (copy / "config.json").read_text() == '{"a": 1}' and (copy / "sub" / "w.bin").read_bytes() == b"\x00\x01"
    kept = copy
  assert not kept.exists()  # the temporary copy is gone
  with paths.local_copy(src) as same:
    assert same == src  # local paths are used in place


def test_faiss_gpu_path_with_a_stand_in_for_the_gpus(tmp_path, monkeypatch):
  """jdr's side of Faiss on GPUs, run on the CPU: faiss' GPU calls are replaced by a stand-in whose "GPU clone"
  is a separate CPU index (what index_cpu_to_all_gpus returns is a copy too). With 2 "GPUs" the retriever
  clones with the chosen options, adds to and searches the clone (results equal brute force), saves the
  clone's contents (not the empty CPU original), and a load without GPUs gets them back."""
  import faiss  # pylint: disable=g-import-not-at-top
  calls = []

  def to_gpus(cpu, options):
    calls.append(("to_gpus", options.shard, options.useFloat16))
    return faiss.clone_index(cpu)

  def to_cpu(index):
    calls.append(("to_cpu",))
    return faiss.clone_index(index)

  stand_in = types.SimpleNamespace(**{k: getattr(faiss, k) for k in dir(faiss) if not k.startswith("__")})
  stand_in.get_num_gpus = lambda: 2
  stand_in.GpuMultipleClonerOptions = types.SimpleNamespace
  stand_in.index_cpu_to_all_gpus = to_gpus
  stand_in.index_gpu_to_cpu = to_cpu
  stand_in.GpuParameterSpace = faiss.ParameterSpace
  monkeypatch.setattr(index_lib, "import_faiss", lambda: stand_in)
  rng = np.random.default_rng(0)
  emb = rng.standard_normal((300, 16)).astype(np.float32)
  ids = [f"d{i}" for i in range(300)]
  queries = rng.standard_normal((5, 16)).astype(np.float32)
  r = index_lib.FaissRetriever(16, gpu_layout="replicate", gpu_float16=True)
  r.add(emb, ids)
  assert r.on_gpu and calls[0] == ("to_gpus", False, True)
  scores, found = r.search(queries, 4)
  best = np.argsort(-(queries @ emb.T), axis=1)[:, :4]
  assert found == [[ids[j] for j in row] for row in best]
  r.save(tmp_path / "idx")
  assert ("to_cpu",) in calls
  monkeypatch.setattr(stand_in, "get_num_gpus", lambda: 0)
  back = index_lib.load_retriever(tmp_path / "idx")
  assert not back.on_gpu and back.search(queries, 4)[1] == found
  np.testing.assert_allclose(back.search(queries, 4)[0], scores, rtol=1e-5)
  with pytest.raises(RuntimeError, match="faiss sees no GPU"):
    index_lib.FaissRetriever(16, use_gpu=True)
