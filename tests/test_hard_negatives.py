"""ADORE / LTRe, STAR and ANCE through the one trainer: the missing-positive rules, in-step and host retrieval
against brute-force numpy, a frozen document side, exact resume, and refusing a mismatched encoding."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import cpu_devices_env, run_module, write_tiny_beir

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = ["model.init_from=", "model.fresh=tiny", "model.pooling=mean", "model.dropout=0.1",
        "optimizer.learning_rate=1e-3", "optimizer.warmup_steps=2", "batch_size=8", "log_every=1",
        "data.query_max_length=16", "data.doc_max_length=32", "eval.doc_max_length=32",
        "negatives.dense_static.top_n=10", "negatives.ance.top_n=10", "negatives.retrieval.top_n=10"]


def _config(recipe: str, data, *overrides):
  from jdr.runtime import config_files  # pylint: disable=g-import-not-at-top
  config = config_files.load_config_file(str(ROOT / "configs" / recipe))
  config_files.apply_overrides(config, TINY + [f"data.dataset={data}", *overrides])
  return config


def test_replace_last_rule():
  """LTRe Algorithm 1 line 4: only a list without any relevant document gets its last entry replaced."""
  from jdr.negatives import retrieved  # pylint: disable=g-import-not-at-top
  rows = jnp.array([[5, 6, 7, 8], [1, 2, 3, 4], [9, 3, 10, 11]])
  positives = jnp.array([[2, 7, -1], [4, -1, -1], [12, 13, 3]])  # column 0 = the batch positive
  new_rows, labels, before = retrieved.replace_last(rows, positives)
  np.testing.assert_array_equal(new_rows, [[5, 6, 7, 8], [1, 2, 3, 4], [9, 3, 10, 11]])
  np.testing.assert_array_equal(labels, [[0, 0, 1, 0], [0, 0, 0, 1], [0, 1, 0, 0]])
  np.testing.assert_array_equal(before, labels)
  missed = jnp.array([[5, 6, 7, 8]])
  new_rows, labels, before = retrieved.replace_last(missed, jnp.array([[42, 43]]))
  np.testing.assert_array_equal(new_rows, [[5, 6, 7, 42]])
  np.testing.assert_array_equal(labels, [[0, 0, 0, 1]])
  np.testing.assert_array_equal(before, [[0, 0, 0, 0]])
  diag = retrieved.retrieval_diagnostics(jnp.array([[0, 1.0, 0, 1.0], [0, 0, 0, 0]]), jnp.array([[1, 2, 3], [4, -1, -1]]))
  np.testing.assert_allclose(diag["retrieval_mrr@10"], (0.5 + 0) / 2)
  np.testing.assert_allclose(diag["retrieval_recall@4"], (2 / 3 + 0) / 2)


def test_append_positives_rule():
  """DRhard's rule: a list without a relevant row gets every positive of its query after it, in P static
  columns that stay -1 for every other list; -1 (no document) in either input never matches."""
  from jdr.negatives import retrieved  # pylint: disable=g-import-not-at-top
  rows = jnp.array([[5, 6, 7, 8],    # none relevant: both positives appended
                    [1, 2, 3, 4],    # one of two retrieved: nothing appended
                    [9, 3, 10, 11],  # several retrieved
                    [20, 21, -1, -1],  # a short retrieval missing its positive
                    [30, 31, -1, -1]])  # padding on both sides, a -1 positive must not match a -1 row
  positives = jnp.array([[12, 13, -1], [4, 40, -1], [3, 11, 9], [22, -1, -1], [31, -1, -1]])
  new_rows, labels, before = retrieved.append_positives(rows, positives)
  np.testing.assert_array_equal(new_rows, [[5, 6, 7, 8, 12, 13, -1],
                                           [1, 2, 3, 4, -1, -1, -1],
                                           [9, 3, 10, 11, -1, -1, -1],
                                           [20, 21, -1, -1, 22, -1, -1],
                                           [30, 31, -1, -1, -1, -1, -1]])
  np.testing.assert_array_equal(labels, [[0, 0, 0, 0, 1, 1, 0],
                                         [0, 0, 0, 1, 0, 0, 0],
                                         [1, 1, 0, 1, 0, 0, 0],
                                         [0, 0, 0, 0, 1, 0, 0],
                                         [0, 1, 0, 0, 0, 0, 0]])
  np.testing.assert_array_equal(before, np.asarray(labels)[:, :4])
  # The step's entry point picks the rule by its config name, and refuses others.
  same = retrieved.candidates(rows, positives, "append")
  for a, b in zip(same, (new_rows, labels, before)):
    np.testing.assert_array_equal(a, b)
  with pytest.raises(ValueError, match="append, replace_last"):
    retrieved.candidates(rows, positives, "replace_first")


_IN_STEP = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from jdr.runtime import parallel
    from jdr.negatives import retrieved
    rng = np.random.default_rng(0)
    corpus = rng.normal(size=(1003, 16)).astype(np.float32)
    queries = rng.normal(size=(8, 16)).astype(np.float32)
    mesh = parallel.make_mesh((-1, 1, 1))
    put = retrieved.put_corpus(corpus, [str(i) for i in range(len(corpus))], mesh)
    rows = jax.jit(lambda q, c, b: retrieved.sharded_top_k(q, c, b, 50, mesh))(queries, put.device, put.bias)
    emb = jax.jit(lambda c, r: retrieved.gather_rows(c, r, mesh))(put.device, rows)
    print(json.dumps({"devices": len(jax.devices()), "rows": np.asarray(rows).tolist(),
                      "emb": np.asarray(emb).tolist()}))
""")


@pytest.mark.slow
@pytest.mark.parametrize("devices", [1, 8])
def test_in_step_retrieval_equals_brute_force(devices):
  """The JAX back-end's top-k and row gather over a row-sharded corpus return what numpy returns."""
  env = cpu_devices_env(devices, JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", _IN_STEP], env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  result = json.loads(out.stdout.splitlines()[-1])
  assert result["devices"] == devices
  rng = np.random.default_rng(0)
  corpus = rng.normal(size=(1003, 16)).astype(np.float32)
  queries = rng.normal(size=(8, 16)).astype(np.float32)
  expected = np.argsort(-(queries.astype(np.float64) @ corpus.T.astype(np.float64)), axis=1, kind="stable")[:, :50]
  np.testing.assert_array_equal(result["rows"], expected)
  np.testing.assert_allclose(result["emb"], corpus[expected], rtol=0, atol=0)


@pytest.mark.slow
def test_host_retrieval_equals_brute_force():
  """Faiss on the host (flat) gives the brute-force top-n as corpus rows, and the reconstruction of a flat
  index is the embeddings themselves; a PQ index's reconstruction reproduces its own search scores."""
  from jdr.retrieval import host_search  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(1)
  corpus = rng.normal(size=(2000, 32)).astype(np.float32)
  queries = rng.normal(size=(16, 32)).astype(np.float32)
  retriever, recon = host_search.reconstruct(corpus, "Flat")
  np.testing.assert_array_equal(recon, corpus)
  rows = host_search.top_rows(retriever, queries, 100)
  expected = np.argsort(-(queries.astype(np.float64) @ corpus.T.astype(np.float64)), axis=1)[:, :100]
  np.testing.assert_array_equal(rows, expected)
  pq, recon = host_search.reconstruct(corpus, "OPQ8,IVF1,PQ8", train_size=2000)
  assert np.abs(recon - corpus).max() > 1e-3  # compressed: not the original vectors
  scores, ids = pq.search(queries, 10)
  rows = np.array([[int(i) for i in r] for r in ids])
  np.testing.assert_allclose(scores, np.einsum("qd,qkd->qk", queries, recon[rows]), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["faiss", "jax"])
def test_adore_trains_query_tower_only(tmp_path, backend):
  """ADORE: the document tower and the corpus vectors are bitwise unchanged; the query tower learns."""
  from jdr.training import trainer  # pylint: disable=g-import-not-at-top
  from jdr.retrieval.tower_encoder import TowerEncoder  # pylint: disable=g-import-not-at-top
  data = write_tiny_beir(tmp_path / "data")
  config = _config(f"adore.py:runlocal{',jax' if backend == 'jax' else ''}", data, "num_train_steps=4",
                   "checkpoint_every=100", "eval_before_training=false")
  workdir = tmp_path / "w"
  result = trainer.train_and_evaluate(config, workdir)
  end = jax.device_get(result["state"].params)
  records = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert any("train/retrieval_mrr@10" in r for r in records)
  from jdr.retrieval import encodings  # pylint: disable=g-import-not-at-top
  (encoding,) = (workdir / "cache" / "encoding").iterdir()  # the starting tower's shards, kept for a resume
  cached = np.asarray(encodings.load_embeddings(encoding)[0])
  from jdr.models import build as build_lib  # pylint: disable=g-import-not-at-top
  built = build_lib.build(config.model, config.data)
  start = trainer.initial_params(built.model, built, config, jax.random.PRNGKey(config.seed), None)
  start = jax.device_get(start)
  for a, b in zip(jax.tree.leaves(start["doc_tower"]), jax.tree.leaves(end["doc_tower"])):
    np.testing.assert_array_equal(a, b)
  assert max(float(np.abs(a - b).max()) for a, b in
             zip(jax.tree.leaves(start["query_tower"]), jax.tree.leaves(end["query_tower"]))) > 0
  from jdr.data import pairs  # pylint: disable=g-import-not-at-top
  encoder = TowerEncoder(built.model, built.tokenizer, pairs.load(config.data, workdir),
                         query_max_length=16, doc_max_length=32)
  # Another encoder than the run's (its own batching): another program, so equal to a float32 tolerance.
  np.testing.assert_allclose(encoder.corpus(end), cached, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_faiss_and_jax_retrieval_train_alike(tmp_path):
  """The retrieval back-end is a config value: host Faiss and in-step JAX give the same training."""
  from jdr.training import trainer  # pylint: disable=g-import-not-at-top
  data = write_tiny_beir(tmp_path / "data")
  losses = {}
  for backend in ("faiss", "jax"):
    config = _config("adore.py:runlocal", data, "num_train_steps=5", "checkpoint_every=100",
                     "data.eval_split=", f"negatives.retrieval.backend={backend}")
    trainer.train_and_evaluate(config, tmp_path / backend)
    records = [json.loads(l) for l in (tmp_path / backend / "metrics.jsonl").read_text().splitlines()]
    losses[backend] = [r["train/loss"] for r in records if "train/loss" in r]
  np.testing.assert_allclose(losses["faiss"], losses["jax"], rtol=1e-4, atol=1e-6)


def test_mismatched_encoding_is_refused_before_step_0(tmp_path):
  from jdr.training import trainer  # pylint: disable=g-import-not-at-top
  data = write_tiny_beir(tmp_path / "data")
  enc = tmp_path / "enc"
  enc.mkdir()
  other = write_tiny_beir(tmp_path / "other", num_docs=44)
  ids = [json.loads(l)["_id"] for l in (other / "corpus.jsonl").read_text().splitlines()]
  np.save(enc / "emb-00000.npy", np.zeros((len(ids), 64), np.float32))
  (enc / "ids-00000.txt").write_text("".join(i + "\n" for i in ids))
  (enc / "meta.json").write_text(json.dumps({"num_docs": len(ids), "shard_size": 10_000, "num_shards": 1,
                                             "complete": True, "dim": 64}))
  config = _config("adore.py:runlocal", data, "num_train_steps=3", "data.eval_split=",
                   f"negatives.retrieval.corpus_encoding={enc}")
  with pytest.raises(ValueError) as e:
    trainer.train_and_evaluate(config, tmp_path / "w")
  assert str(enc) in str(e.value) and "data.dataset" in str(e.value)
  assert not (tmp_path / "w" / "checkpoints").exists() or not any((tmp_path / "w" / "checkpoints").iterdir())


def _env(devices: int = 1) -> dict:
  env = cpu_devices_env(devices, JAX_PLATFORMS="cpu")
  env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
  return env


def _cmd(recipe, workdir, data, extra):
  return [sys.executable, "-m", "jdr.train", "--config", str(ROOT / "configs" / recipe), "--workdir",
          str(workdir), *[f"--config.{o}" for o in TINY + [f"data.dataset={data}", *extra]]]


# ANCE's refreshed negatives are restored from the workdir in tests/test_train.py's SIGTERM resume test.
@pytest.mark.long
@pytest.mark.parametrize("recipe,extra", [("adore.py:runlocal", [])])
def test_killed_and_resumed_equals_uninterrupted(tmp_path, recipe, extra):
  """SIGKILL after the step-12 checkpoint, resume to 24: parameters bitwise equal to a straight run
  (ADORE: per-step retrieval against the fixed index)."""
  data = write_tiny_beir(tmp_path / "data")
  common = extra + ["num_train_steps=24", "checkpoint_every=4", "data.eval_split="]
  # The straight run and the resume run in this process (conftest.run_module); the killed one is a process.
  assert run_module("jdr.train", _cmd(recipe, tmp_path / "straight", data, common)[3:]).returncode == 0
  workdir = tmp_path / "killed"
  proc = subprocess.Popen(_cmd(recipe, workdir, data, common), env=_env(), stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  deadline = time.time() + 300
  while not (workdir / "checkpoints" / "12").is_dir() and proc.poll() is None and time.time() < deadline:
    time.sleep(0.005)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  saved = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
  assert 12 in saved and 24 not in saved, saved
  rerun = run_module("jdr.train", _cmd(recipe, workdir, data, common)[3:])
  assert rerun.returncode == 0, rerun.stderr[-3000:]
  from jdr.runtime import checkpoint  # pylint: disable=g-import-not-at-top
  straight = jax.tree.leaves(checkpoint.latest_params(tmp_path / "straight"))
  resumed = jax.tree.leaves(checkpoint.latest_params(workdir))
  for a, b in zip(straight, resumed):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_star_weights_make_the_two_parts():
  """STAR Eq. 13: with the weights, the mean pairwise loss is L_s (own hard negatives) + alpha * L_r."""
  from jdr.training import losses  # pylint: disable=g-import-not-at-top
  from jdr.data import pairs  # pylint: disable=g-import-not-at-top
  from jdr.negatives import candidate_mask  # pylint: disable=g-import-not-at-top
  qids = ["a", "b", "c"]
  docs = ["pa", "pb", "pc", "ha1", "ha2", "hb1", "hb2", "hc1", "hc2"]
  qrels = {"a": {"pa": 1}, "b": {"pb": 1}, "c": {"pc": 1}}
  valid = candidate_mask(qids, docs, qrels, in_batch=True)
  weights = pairs.star_weights(valid, 2, 0.1)
  scores = np.random.default_rng(0).normal(size=valid.shape).astype(np.float32)
  got = np.asarray(losses.ranknet(jnp.asarray(scores), jnp.asarray(valid), weights=jnp.asarray(weights)))
  for b in range(3):
    own = list(range(3 + 2 * b, 5 + 2 * b))
    others = [c for c in range(9) if c != b and c not in own]
    pair = lambda c: np.log1p(np.exp(scores[b, c] - scores[b, b]))
    expected = np.mean([pair(c) for c in own]) + 0.1 * np.mean([pair(c) for c in others])
    np.testing.assert_allclose(got[b], expected, rtol=1e-5)


@pytest.mark.slow
def test_failing_refresh_keeps_training_on_previous_negatives(tmp_path, monkeypatch, capsys):
  """An ANCE re-mine that dies (here: raises in the worker) is logged; training goes on, on generation 0."""
  from jdr.training import trainer  # pylint: disable=g-import-not-at-top
  from jdr.negatives import sources  # pylint: disable=g-import-not-at-top
  real = sources.mine_rows
  calls = []

  def flaky(*args, **kwargs):
    calls.append(1)
    if len(calls) > 1:
      raise RuntimeError("disk full while re-encoding")
    return real(*args, **kwargs)

  monkeypatch.setattr(sources, "mine_rows", flaky)
  data = write_tiny_beir(tmp_path / "data")
  config = _config("ance.py:runlocal", data, "num_train_steps=8", "checkpoint_every=100", "data.eval_split=",
                   "negatives.ance.refresh_every=2", "negatives.ance.refresh_delay=1")
  trainer.train_and_evaluate(config, tmp_path / "w")
  records = [json.loads(l) for l in (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()]
  losses = [r["train/loss"] for r in records if "train/loss" in r]
  assert len(losses) == 8 and all(np.isfinite(losses))
  assert max(r.get("train/negatives/failed", 0) for r in records) >= 1
  assert all(r.get("train/negatives/generation", 0) == 0 for r in records)
  assert "disk full while re-encoding" in capsys.readouterr().err


@pytest.mark.long
def test_adore_on_8_devices_equals_one(tmp_path):
  """ADORE with the corpus sharded over 8 simulated devices (in-step JAX retrieval, and host Faiss) trains
  like the single-device run: one code path from one CPU to a pod."""
  data = write_tiny_beir(tmp_path / "data")
  script = textwrap.dedent(f"""
      import numpy as np, jax
      from jdr.training import trainer
      from jdr.runtime import config_files
      base = {TINY!r} + ["data.dataset={data}", "data.eval_split=", "num_train_steps=6", "checkpoint_every=100"]
      for name, extra in {{"single": ["mesh.shape=(1,1,1)"], "jax8": ["mesh.shape=(8,1,1)"],
                          "faiss8": ["mesh.shape=(2,4,1)", "mesh.rules=fsdp",
                                     "negatives.retrieval.backend=faiss"]}}.items():
        config = config_files.load_config_file("{ROOT / 'configs' / 'adore.py'}:runlocal,jax")
        config_files.apply_overrides(config, base + extra)
        trainer.train_and_evaluate(config, "{tmp_path}/" + name)
  """)
  proc = subprocess.run([sys.executable, "-c", script], env=_env(8), capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]

  def losses(name):
    records = [json.loads(l) for l in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return [r["train/loss"] for r in records if "train/loss" in r]

  assert len(losses("single")) == 6
  for name in ("jax8", "faiss8"):
    np.testing.assert_allclose(losses(name), losses("single"), rtol=3e-5, atol=1e-6)
