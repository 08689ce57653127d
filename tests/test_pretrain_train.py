"""Pretraining (data.kind="pretrain") through the one trainer: recipes, batches, gradient caching, log-Q."""

import json
import pathlib

import numpy as np
import pytest

from conftest import cpu_devices_env

ROOT = pathlib.Path(__file__).resolve().parents[1]

TINY = ["model.init_from=", "model.fresh=tiny", "model.projection_dim=16", "model.dropout=0.1",
        "optimizer.learning_rate=1e-3", "optimizer.warmup_steps=1", "batch_size=8", "log_every=1",
        "data.query_max_length=16", "data.doc_max_length=32", "checkpoint_every=100"]


def write_articles(directory) -> pathlib.Path:
  """Six tiny Wikispeedia-format articles: leads, bodies of 2-sentence paragraphs, links both ways."""
  names = ["Alpha", "Beta", "Gamma", "Delta", "Epsilon", "Zeta"]
  records = []
  for i, name in enumerate(names):
    other = names[(i + 1) % len(names)]
    records.append({
        "id": name, "title": name,
        "lead": [f"{name} is letter number {i + 1}. It is written in many scripts."],
        "sections": [{"heading": "History", "paragraphs": [
            f"{name} came from an older sign. It was adopted by scribe {i}.",
            f"{name} precedes {other} in the list. Students learn {other} after it.",
            f"The shape of {name} changed. Printers made it uniform."]}],
        "links_out": [other, names[(i + 2) % len(names)]]})
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  (directory / "articles_subset.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  return directory


def _config(recipe: str, overrides):
  from jdr.runtime import config_files  # pylint: disable=g-import-not-at-top
  config = config_files.load_config_file(f"{ROOT / 'configs' / recipe}.py:runlocal")
  config_files.apply_overrides(config, TINY + list(overrides))
  return config


def _losses(workdir, key: str = "train/loss") -> list[float]:
  records = [json.loads(l) for l in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()]
  return [r[key] for r in records if key in r]


def _params(state):
  import jax  # pylint: disable=g-import-not-at-top
  return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(state.params))]


# pretrain_ict_bfs_wlp trains in tests/test_readme.py (the tour) and in the BoW-MLP test below.
@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["pretrain_ict", "pretrain_bfs", "pretrain_wlp"])
def test_every_pretrain_recipe_trains(tmp_path, recipe):
  from jdr.training import trainer  # pylint: disable=g-import-not-at-top
  data = write_articles(tmp_path / "wiki")
  config = _config(recipe, [f"data.dataset={data}", "num_train_steps=2"])
  result = trainer.train_and_evaluate(config, tmp_path / "w")
  losses = _losses(tmp_path / "w")
  assert len(losses) == 2 and all(np.isfinite(losses))
  assert int(result["state"].step) == 2 and "after" not in result  # no evaluation while pretraining


@pytest.mark.slow
def test_builtin_source_bow_mlp_and_fine_tuning_from_the_workdir(tmp_path):
  """Stdlib articles, the BoW-MLP tower from a config, then configs/finetune.py starts from the workdir."""
  from conftest import write_tiny_beir  # pylint: disable=g-import-not-at-top
  from jdr.training import trainer  # pylint: disable=g-import-not-at-top
  config = _config("pretrain_ict_bfs_wlp", ["data.pretrain_source=builtin", "num_train_steps=2",
                                            "model.tower=bow_mlp", "model.pooling=mean"])
  first = trainer.train_and_evaluate(config, tmp_path / "pre")["state"]
  assert "bow" in first.params["tower"] and np.all(np.isfinite(_losses(tmp_path / "pre")))
  beir = write_tiny_beir(tmp_path / "beir")
  config = _config("finetune", [f"model.init_from={tmp_path / 'pre'}", f"data.dataset={beir}",
                                "num_train_steps=2", "eval.doc_max_length=32"])
  config.model.init_from = str(tmp_path / "pre")
  config.model.fresh = "tiny"
  config.model.projection_dim = 0  # the head comes from the checkpoint
  result = trainer.train_and_evaluate(config, tmp_path / "fine")
  assert "after" in result and len(_losses(tmp_path / "fine")) == 2


@pytest.mark.slow
def test_mlm_recipe_trains_and_its_workdir_reads_as_a_retrieval_model(tmp_path):
  """The masked-LM baseline trains through the one trainer; its head stays out of what readers load, so
  fine-tuning starts from the pretrained tower alone."""
  from conftest import write_tiny_beir  # pylint: disable=g-import-not-at-top
  from jdr.training import trainer  # pylint: disable=g-import-not-at-top
  from jdr.models import build  # pylint: disable=g-import-not-at-top
  config = _config("pretrain_mlm", [f"data.dataset={write_articles(tmp_path / 'wiki')}", "num_train_steps=3"])
  state = trainer.train_and_evaluate(config, tmp_path / "pre")["state"]
  losses = _losses(tmp_path / "pre")
  assert len(losses) == 3 and all(np.isfinite(losses)) and "lm_head" in state.params
  # A fresh head predicts about uniformly over the vocabulary: the loss starts near log V.
  assert abs(losses[0] - np.log(_tokenizer().vocab_size)) < 1.0
  model, params, _, _ = build.load_jdr_model(tmp_path / "pre")
  assert "lm_head" not in params and not model.mlm_head
  np.testing.assert_array_equal(params["tower"]["encoder"]["layer_0"]["query"]["kernel"],
                                np.asarray(state.params["tower"]["encoder"]["layer_0"]["query"]["kernel"]))
  beir = write_tiny_beir(tmp_path / "beir")
  config = _config("finetune", [f"data.dataset={beir}", "num_train_steps=2", "eval.doc_max_length=32"])
  config.model.init_from = str(tmp_path / "pre")
  config.model.projection_dim = 0
  result = trainer.train_and_evaluate(config, tmp_path / "fine")
  assert "after" in result and "lm_head" not in result["state"].params


def test_mlm_refuses_settings_it_cannot_run(tmp_path):
  from jdr.data import pretrain_batches  # pylint: disable=g-import-not-at-top
  for bad, match in (("model.shared=False", "shared"), ("model.tower=bow_mlp", "transformer"),
                     ("grad_cache.chunk_size=4", "chunk_size")):
    config = _config("pretrain_mlm", [bad])
    with pytest.raises(ValueError, match=match):
      pretrain_batches.check(config)


@pytest.mark.slow
def test_mlm_logits_equal_hugging_face_bert_for_masked_lm():
  """jdr's masked-LM head on its encoder against transformers' BertForMaskedLM with the same weights."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  from jdr.models import hf  # pylint: disable=g-import-not-at-top
  from jdr.models.bert import EncoderConfig  # pylint: disable=g-import-not-at-top
  from jdr.models.towers import TowerConfig, TwoTower  # pylint: disable=g-import-not-at-top
  enc = EncoderConfig(vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64)
  tower = TowerConfig(encoder=enc, pooling="cls")
  model = TwoTower(tower, tower, shared=True, mlm_head=True)
  rng = np.random.default_rng(0)
  ids = jnp.asarray(rng.integers(1, 97, (3, 11)), jnp.int32)
  mask = jnp.asarray(np.arange(11)[None, :] < np.array([[11], [7], [4]]), jnp.int32)
  params = nn.unbox(model.init(jax.random.PRNGKey(1), ids, mask, ids, mask)["params"])
  # Non-trivial head weights (the init's zero biases and unit scales would hide a transposition).
  params = jax.tree.map(lambda x: x + 0.05 * rng.standard_normal(x.shape).astype(np.float32), params)
  positions = jnp.asarray([[0, 3, 10], [1, 2, 6], [0, 1, 3]], jnp.int32)
  ours = np.asarray(model.apply({"params": params}, ids, mask, positions, method=TwoTower.mlm_logits))

  tensors = hf.state_dict_from_params(enc, params["tower"]["encoder"])
  head = jax.tree.map(np.asarray, params["lm_head"])
  tensors = {("bert." + k if not k.startswith("bert.") else k): v for k, v in tensors.items()}
  tensors.update({"cls.predictions.transform.dense.weight": head["transform"]["kernel"].T,
                  "cls.predictions.transform.dense.bias": head["transform"]["bias"],
                  "cls.predictions.transform.LayerNorm.weight": head["norm"]["scale"],
                  "cls.predictions.transform.LayerNorm.bias": head["norm"]["bias"],
                  "cls.predictions.bias": head["bias"]})
  reference = transformers.BertForMaskedLM(transformers.BertConfig(**enc.to_hf())).eval()
  missing, unexpected = reference.load_state_dict({k: torch.from_numpy(np.array(v, np.float32))
                                                   for k, v in tensors.items()}, strict=False)
  assert not unexpected and set(missing) <= {"cls.predictions.decoder.weight", "cls.predictions.decoder.bias",
                                             "bert.pooler.dense.weight", "bert.pooler.dense.bias"}
  reference.tie_weights()
  with torch.no_grad():
    theirs = reference(input_ids=torch.from_numpy(np.asarray(ids, np.int64)),
                       attention_mask=torch.from_numpy(np.asarray(mask, np.int64))).logits.numpy()
  expected = np.take_along_axis(theirs, np.asarray(positions)[:, :, None], axis=1)
  np.testing.assert_allclose(ours, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_mlm_batches(tmp_path):
  """Masked-LM batches: labels are the original tokens at the scored positions, everything else unchanged,
  80/10/10 overall, a pure function of (seed, step), and split over processes by rows."""
  from jdr.data import articles as A  # pylint: disable=g-import-not-at-top
  from jdr.data import pretrain  # pylint: disable=g-import-not-at-top
  from jdr.data.pretrain_batches import MLMBatches, max_predictions  # pylint: disable=g-import-not-at-top
  articles, _ = A.read_wikispeedia(write_articles(tmp_path / "wiki"))
  gen = pretrain.PretrainPairs(articles, "ict", seed=5)
  tok = _tokenizer()
  make = lambda i=0, n=1: MLMBatches(gen, tok, batch_size=8, max_length=32, seed=5, process_index=i,
                                     process_count=n)
  assert max_predictions(128) == 32 and max_predictions(32) >= 0.15 * 32
  batches, kinds = make(), {"mask": 0, "random": 0, "same": 0}
  for step in range(40):
    b = batches.local(step)
    plain = np.asarray(tok([p[1] for p in (gen.passage(step * 8 + r) for r in range(8))],
                           [p[2] for p in (gen.passage(step * 8 + r) for r in range(8))], truncation="longest_first",
                           max_length=32, padding="max_length")["input_ids"])
    for r in range(8):
      w = b["mlm_weights"][r] > 0
      pos, labels = b["mlm_positions"][r][w], b["mlm_labels"][r][w]
      np.testing.assert_array_equal(labels, plain[r, pos])
      assert not np.isin(labels, tok.all_special_ids).any()
      others = np.setdiff1d(np.arange(32), pos)
      np.testing.assert_array_equal(b["mlm_ids"][r, others], plain[r, others])
      got = b["mlm_ids"][r, pos]
      kinds["mask"] += int(np.sum(got == tok.mask_token_id))
      kinds["same"] += int(np.sum(got == labels))
      kinds["random"] += int(np.sum((got != labels) & (got != tok.mask_token_id)))
    again = make().local(step)
    for k in b:
      np.testing.assert_array_equal(b[k], again[k])
    halves = [make(i, 2).local(step) for i in range(2)]
    for k in b:
      np.testing.assert_array_equal(np.concatenate([h[k] for h in halves]), b[k])
  total = sum(kinds.values())
  assert total > 500
  assert abs(kinds["mask"] / total - 0.8) < 0.06 and abs(kinds["random"] / total - 0.1) < 0.04

def _tokenizer():
  from jdr.models import hf  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  return transformers.AutoTokenizer.from_pretrained(str(hf.minilm_path()))


def test_pretrain_batches_follow_the_contract(tmp_path):
  from jdr.data import articles as A  # pylint: disable=g-import-not-at-top
  from jdr.data import batch as batch_lib  # pylint: disable=g-import-not-at-top
  from jdr.data import pretrain  # pylint: disable=g-import-not-at-top
  from jdr.data.pretrain_batches import PretrainBatches  # pylint: disable=g-import-not-at-top
  articles, _ = A.read_wikispeedia(write_articles(tmp_path / "wiki"))
  gen = pretrain.PretrainPairs(articles, "bfs", seed=3)  # 6 articles x 3 body passages: duplicates likely
  tok = _tokenizer()
  make = lambda i, n: PretrainBatches(gen, tok, batch_size=16, query_max_length=16, doc_max_length=32,
                                      seed=3, process_index=i, process_count=n, logq=True)
  whole = make(0, 1)
  for step in range(3):
    b = whole.local(step)
    assert batch_lib.check(b) == "tokens" and b["doc_ids"].shape[0] == 16 and b["valid"].shape == (16, 16)
    docs = [(d.pair.doc_title, d.pair.doc_text) for d in whole.global_pairs(step)]
    expected = np.array([[r == c or docs[r] != docs[c] for c in range(16)] for r in range(16)])
    np.testing.assert_array_equal(b["valid"], expected)
    again = make(0, 1).local(step)  # a pure function of (seed, step)
    for k in b:
      np.testing.assert_array_equal(b[k], again[k])
    halves = [make(i, 2).local(step) for i in range(2)]
    for k in ("query_ids", "doc_ids", "doc_logq"):
      np.testing.assert_array_equal(np.concatenate([h[k] for h in halves]), b[k])
    np.testing.assert_array_equal(np.concatenate([h["valid"] for h in halves]), b["valid"])
  assert not np.all(b["valid"]), "some batch should hold a duplicate document"
  # BFS draws body passages uniformly: log Q is one constant, the correction a no-op.
  np.testing.assert_allclose(b["doc_logq"], np.log(1 / gen.units["bfs"]), rtol=1e-6)


def test_logq_probabilities_sum_to_one():
  from jdr.data import pretrain  # pylint: disable=g-import-not-at-top
  from jdr.data import pretrain_batches  # pylint: disable=g-import-not-at-top
  import test_pretrain_data  # pylint: disable=g-import-not-at-top
  for task in ("ict", "bfs", "wlp", "mixed"):
    gen = pretrain.PretrainPairs(test_pretrain_data.tiny_articles(), task)
    logq = pretrain_batches.passage_log_probs(gen)
    assert np.isclose(sum(np.exp(list(logq.values()))), 1.0), task
    for i in range(30):
      d = gen.draw(i)
      assert (d.pair.article_id,) + tuple(d.doc_place) in logq


@pytest.mark.slow
def test_logq_correction_against_brute_force():
  """The step's loss with loss.logq_correction equals sum_b -log softmax_c(s_bc - log Q_c)[b] by loops."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from jdr.runtime import defaults  # pylint: disable=g-import-not-at-top
  from jdr.training import step
  from jdr.models.bert import EncoderConfig  # pylint: disable=g-import-not-at-top
  from jdr.models.towers import TowerConfig, TwoTower  # pylint: disable=g-import-not-at-top
  tower = TowerConfig(EncoderConfig(vocab_size=50, hidden_size=16, num_layers=1, num_heads=2,
                                    intermediate_size=32, hidden_dropout=0.0, attention_dropout=0.0),
                      pooling="mean")
  model = TwoTower(tower, tower)
  rng = np.random.default_rng(0)
  b = 5
  batch = {"query_ids": rng.integers(1, 50, (b, 6)).astype(np.int32), "query_mask": np.ones((b, 6), np.int32),
           "doc_ids": rng.integers(1, 50, (b, 9)).astype(np.int32), "doc_mask": np.ones((b, 9), np.int32),
           "valid": np.ones((b, b), bool), "doc_logq": np.log(rng.dirichlet(np.ones(b))).astype(np.float32)}
  batch["valid"][1, 3] = False  # a duplicate of row 1's document
  params = model.init(jax.random.PRNGKey(0), batch["query_ids"], batch["query_mask"], batch["doc_ids"],
                      batch["doc_mask"])["params"]
  q, d = model.apply({"params": params}, batch["query_ids"], batch["query_mask"], batch["doc_ids"],
                     batch["doc_mask"])
  s = np.asarray(q, np.float64) @ np.asarray(d, np.float64).T
  tx = optax.sgd(0.0)

  def step_loss(correct: bool, logq):
    config = defaults.get_config()
    config.loss.logq_correction = correct
    state = step.TrainState(step=jnp.int32(0), params=params, opt_state=tx.init(params),
                            rng=jax.random.PRNGKey(1))
    _, metrics = jax.jit(step.make_train_step(model, tx, config))(state, {**batch, "doc_logq": logq})
    return float(metrics["loss"])

  def brute(logq):
    total = 0.0
    for r in range(b):
      cols = [c for c in range(b) if c == r or batch["valid"][r, c]]
      logits = {c: s[r, c] - logq[c] for c in cols}
      total += -(logits[r] - np.log(sum(np.exp(v) for v in logits.values())))
    return total / b

  logq = batch["doc_logq"].astype(np.float64)
  assert np.isclose(step_loss(True, batch["doc_logq"]), brute(logq), rtol=1e-5)
  assert np.isclose(step_loss(False, batch["doc_logq"]), brute(np.zeros(b)), rtol=1e-5)
  assert not np.isclose(brute(logq), brute(np.zeros(b)), rtol=1e-3)
  uniform = np.full(b, np.log(1 / b), np.float32)  # uniform sampling: the correction changes nothing
  assert np.isclose(step_loss(True, uniform), step_loss(False, uniform), rtol=1e-6)


def _run(tmp_path, name, extra):
  from jdr.training import trainer  # pylint: disable=g-import-not-at-top
  # eps=1 makes Adam nearly SGD (update ~ lr * g): its 1/sqrt(v) would blow float rounding of ~0
  # gradients up to a good part of a step, and the weights could not be compared closely.
  config = _config("pretrain_ict", [f"data.dataset={write_articles(tmp_path / 'wiki')}", "num_train_steps=2",
                                    "optimizer.eps=1.0", "optimizer.learning_rate=0.1", *extra])
  state = trainer.train_and_evaluate(config, tmp_path / name)["state"]
  return _losses(tmp_path / name) + _losses(tmp_path / name, "train/grad_norm"), _params(state)


def _assert_same(a, b):
  (logged_a, params_a), (logged_b, params_b) = a, b
  np.testing.assert_allclose(logged_a, logged_b, rtol=1e-4)  # losses and gradient norms of both steps
  for x, y in zip(params_a, params_b):
    np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_grad_cache_without_dropout_equals_the_plain_step(tmp_path):
  """No dropout: chunks of 3 rows (the last one padded) give the losses and weights of grad_cache off."""
  plain = _run(tmp_path, "plain", ["model.dropout=0.0", "grad_cache.chunk_size=0"])
  _assert_same(plain, _run(tmp_path, "cached", ["model.dropout=0.0", "grad_cache.chunk_size=3"]))


@pytest.mark.slow
def test_grad_cache_chunking_does_not_change_dropout(tmp_path):
  """With dropout, keys are per row: chunks of 2 equal one chunk of the whole batch (8 rows), after 2 steps."""
  whole = _run(tmp_path, "whole", ["grad_cache.chunk_size=8"])
  _assert_same(whole, _run(tmp_path, "two", ["grad_cache.chunk_size=2"]))


def test_grad_cache_refuses_corpus_candidates():
  from jdr.runtime import defaults  # pylint: disable=g-import-not-at-top
  from jdr.training import step
  config = defaults.get_config()
  config.grad_cache.chunk_size = 4
  with pytest.raises(ValueError, match="grad_cache"):
    step.check_grad_cache(config, "corpus")


@pytest.mark.long
def test_sharded_grad_cache_equals_one_device(tmp_path):
  """On 2 simulated devices the chunk loops run under shard_map (one all-reduce): same as on one device."""
  import os  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  import textwrap  # pylint: disable=g-import-not-at-top
  script = textwrap.dedent(f"""
      import sys, numpy as np, jax
      sys.path.insert(0, {str(ROOT / 'tests')!r})
      from test_pretrain_train import write_articles, _config, _losses
      from jdr.training import trainer
      data = write_articles({str(tmp_path / 'wiki')!r})
      out = {{}}
      for name, shape in (("one", "(1,1,1)"), ("two", "(2,1,1)")):
        c = _config("pretrain_ict", [f"data.dataset={{data}}", "num_train_steps=2", "optimizer.eps=1.0",
                                     "optimizer.learning_rate=0.1", "grad_cache.chunk_size=2",
                                     f"mesh.shape={{shape}}"])
        st = trainer.train_and_evaluate(c, {str(tmp_path)!r} + "/" + name)["state"]
        out[name] = (_losses({str(tmp_path)!r} + "/" + name),
                     [np.asarray(x) for x in jax.tree.leaves(jax.device_get(st.params))])
      np.testing.assert_allclose(out["one"][0], out["two"][0], rtol=1e-5)
      for a, b in zip(out["one"][1], out["two"][1]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
      print("SAME")
  """)
  env = cpu_devices_env(2, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
  proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0 and "SAME" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.slow
def test_interrupted_pretraining_resumes_exactly(tmp_path, recipe="pretrain_ict_bfs_wlp"):
  """Batches are a function of (seed, step): a run resumed from its step-2 checkpoint ends with the weights
  of the uninterrupted 4-step run, bitwise. (Masked-LM batches are the same kind of pure function:
  test_mlm_batches.)"""
  import shutil  # pylint: disable=g-import-not-at-top
  from jdr.training import trainer  # pylint: disable=g-import-not-at-top
  config = _config(recipe, [f"data.dataset={write_articles(tmp_path / 'wiki')}", "num_train_steps=4",
                            "checkpoint_every=2", "keep_checkpoints=5"])
  straight = _params(trainer.train_and_evaluate(config, tmp_path / "straight")["state"])
  shutil.copytree(tmp_path / "straight", tmp_path / "resumed")
  shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "4")  # as if killed between steps 2 and 4
  resumed = _params(trainer.train_and_evaluate(config, tmp_path / "resumed")["state"])
  assert len(straight) == len(resumed)
  for a, b in zip(straight, resumed):
    np.testing.assert_array_equal(a, b)
