"""Published checkpoints read as the towers their authors built, against transformers' / sentence-transformers'
PyTorch models and a float64 transcription of ANCE / DRhard's head, on tiny random-weight configs."""

import json
import pathlib
import shutil

import jax
import numpy as np
import pytest

from jdr.models import hf
from jdr.models import published

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY_BERT = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
                 max_position_embeddings=40)


def perturbed(model):
  """Every tensor moved off its initial value (LayerNorms off 1/0, biases off 0), so each one matters."""
  torch.manual_seed(1)
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.1 * torch.randn_like(p))
  return model.eval()


def batch(pad_id: int, vocab: int = 99, seed: int = 0):
  """Three rows of 11, 7 and 3 real tokens, padded on the right."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(3, vocab, size=(3, 11))
  mask = np.ones_like(ids)
  for row, n in ((1, 7), (2, 3)):
    ids[row, n:], mask[row, n:] = pad_id, 0
  ids[:, 0] = 2 if pad_id == 1 else 1  # a start token that is not padding (RoBERTa's positions count it)
  return ids, mask


def ours(path, ids, mask, **kw):
  tower, params, _, info = published.load_tower(str(path), max_length=ids.shape[1], **kw) if _has_tokenizer(path) \
      else _tower_without_tokenizer(path, **kw)
  return np.asarray(jax.jit(tower.apply)({"params": params}, ids, mask)), info


def _has_tokenizer(path) -> bool:
  return any((path / n).exists() for n in ("tokenizer.json", "vocab.txt", "tokenizer_config.json"))


def _tower_without_tokenizer(path, **kw):
  from jdr.models.towers import Tower
  pub = published.read(path, **kw)
  return Tower(pub.tower), pub.params, None, {"family": pub.family, "pooling": pub.tower.pooling,
                                               "normalize": pub.tower.normalize, "side": pub.side}


def rows_alone(path, ids, mask, **kw):
  """Each row encoded alone, unpadded: what a batch of mixed lengths must equal."""
  out = []
  for i in range(len(ids)):
    n = int(mask[i].sum())
    out.append(ours(path, ids[i:i + 1, :n], mask[i:i + 1, :n], **kw)[0][0])
  return np.stack(out)


# ----------------------------------------------------------------------------------------------- DistilBERT


@pytest.mark.parametrize("sinusoidal", [False, True])
def test_distilbert_matches_transformers(tmp_path, sinusoidal):
  config = transformers.DistilBertConfig(vocab_size=99, dim=32, n_layers=2, n_heads=4, hidden_dim=37,
                                         max_position_embeddings=40, sinusoidal_pos_embds=sinusoidal)
  model = perturbed(transformers.DistilBertModel(config))
  model.save_pretrained(tmp_path)
  ids, mask = batch(0)
  with torch.no_grad():
    expected = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).last_hidden_state[:, 0].numpy()
  got, info = ours(tmp_path, ids, mask)
  diff = float(np.abs(got - expected).max())
  print(f"distilbert (sinusoidal={sinusoidal}) CLS vectors max abs diff: {diff:.2e}")
  assert info["family"] == "distilbert" and diff < 1e-5
  assert np.abs(rows_alone(tmp_path, ids, mask) - got).max() < 1e-5


# ----------------------------------------------------------------------------------------------- ANCE / DRhard


def ance_dir(tmp_path, with_norm: bool = True):
  """A checkpoint laid out as ANCE's RobertaDot_NLL_LN and DRhard's RobertaDot save it: roberta.* +
  embeddingHead (Linear 32->24) + norm (LayerNorm, torch's eps), config.json of model_type roberta."""
  roberta = perturbed(transformers.RobertaModel(transformers.RobertaConfig(**TINY_BERT, pad_token_id=1),
                                                add_pooling_layer=False))
  rng = np.random.default_rng(3)
  head = {"embeddingHead.weight": rng.normal(0, 0.2, (24, 32)), "embeddingHead.bias": rng.normal(0, 0.1, 24)}
  if with_norm:
    head.update({"norm.weight": 1 + rng.normal(0, 0.1, 24), "norm.bias": rng.normal(0, 0.1, 24)})
  state = {f"roberta.{k}": v for k, v in roberta.state_dict().items()}
  state.update({k: torch.tensor(v, dtype=torch.float32) for k, v in head.items()})
  config = roberta.config.to_dict()
  config["architectures"] = ["RobertaDot_NLL_LN"]
  (tmp_path / "config.json").write_text(json.dumps(config))
  torch.save(state, tmp_path / "pytorch_model.bin")  # the released checkpoints are pickles
  return roberta, head


def float64_ance_head(cls: np.ndarray, head: dict) -> np.ndarray:
  """ANCE / DRhard: norm(embeddingHead(h_cls)), in float64 (torch.nn.LayerNorm, eps 1e-5)."""
  x = cls.astype(np.float64) @ head["embeddingHead.weight"].T + head["embeddingHead.bias"]
  if "norm.weight" not in head:
    return x
  mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
  return (x - mu) / np.sqrt(var + 1e-5) * head["norm.weight"] + head["norm.bias"]


@pytest.mark.parametrize("with_norm", [True, False])
def test_ance_drhard_head_matches_float64_transcription(tmp_path, with_norm):
  roberta, head = ance_dir(tmp_path, with_norm)
  ids, mask = batch(1)
  with torch.no_grad():
    cls = roberta(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).last_hidden_state[:, 0].double().numpy()
  expected = float64_ance_head(cls, head)
  got, info = ours(tmp_path, ids, mask)
  diff = float(np.abs(got - expected).max())
  print(f"ance head (norm={with_norm}) vectors max abs diff vs float64: {diff:.2e}")
  assert info["family"] == "ance" and info["pooling"] == "cls" and not info["normalize"]
  assert got.shape == (3, 24) and diff < 1e-5
  assert np.abs(rows_alone(tmp_path, ids, mask) - got).max() < 1e-5


# ----------------------------------------------------------------------------------------------- DPR


@pytest.mark.parametrize("projection_dim", [0, 16])
@pytest.mark.parametrize("kind", ["question", "ctx"])
def test_dpr_encoders_match_transformers(tmp_path, kind, projection_dim):
  config = transformers.DPRConfig(**TINY_BERT, projection_dim=projection_dim)
  cls = transformers.DPRQuestionEncoder if kind == "question" else transformers.DPRContextEncoder
  model = perturbed(cls(config))
  model.save_pretrained(tmp_path)
  ids, mask = batch(0)
  with torch.no_grad():
    expected = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).pooler_output.numpy()
  got, info = ours(tmp_path, ids, mask)
  diff = float(np.abs(got - expected).max())
  print(f"dpr {kind} (projection {projection_dim}) vectors max abs diff: {diff:.2e}")
  assert info["family"] == "dpr" and info["side"] == ("query" if kind == "question" else "doc")
  assert got.shape[1] == (projection_dim or 32) and diff < 1e-5


# ----------------------------------------------------------------------------------------------- sentence-transformers


@pytest.fixture(scope="module")
def minilm_dir():
  try:
    return hf.minilm_path()
  except FileNotFoundError as e:
    pytest.skip(f"bundled MiniLM checkpoint unavailable: {e}")


@pytest.mark.parametrize("activation", ["Tanh", "Identity"])
def test_sentence_transformers_dense_and_normalize_match(tmp_path, minilm_dir, activation):
  st = pytest.importorskip("sentence_transformers")
  try:
    from sentence_transformers.sentence_transformer import modules  # sentence-transformers 6
  except ImportError:
    from sentence_transformers import models as modules
  base = modules.Transformer(str(minilm_dir), max_seq_length=64)
  pooling = modules.Pooling(base.get_embedding_dimension(), pooling_mode="mean")
  act = getattr(torch.nn, activation)()
  dense = modules.Dense(base.get_embedding_dimension(), 48, activation_function=act)
  torch.manual_seed(2)
  with torch.no_grad():
    for p in dense.parameters():
      p.normal_(0, 0.1)
  model = st.SentenceTransformer(modules=[base, pooling, dense, modules.Normalize()], device="cpu")
  model.save(str(tmp_path / "st"))
  texts = ["what causes scurvy?", "a lack of vitamin C in the diet", "hi"]
  expected = model.encode(texts, convert_to_numpy=True)
  from jdr.retrieval import encoder_runtime
  runtime = encoder_runtime.load_runtime(str(tmp_path / "st"), dtype="float32")
  got = encoder_runtime.encode_texts(runtime, texts)
  diff = float(np.abs(got - expected).max())
  print(f"sentence-transformers Dense({activation}) + Normalize max abs diff: {diff:.2e}")
  assert runtime.info["family"] == "sentence-transformers" and runtime.info["dim"] == 48
  assert runtime.info["max_length"] == 64 and diff < 1e-5


def test_sentence_transformers_prompts_are_read(tmp_path, minilm_dir):
  shutil.copytree(minilm_dir, tmp_path / "e5")
  (tmp_path / "e5" / "config_sentence_transformers.json").write_text(json.dumps(
      {"prompts": {"query": "query: ", "passage": "passage: "}, "default_prompt_name": None}))
  pub = published.read(tmp_path / "e5")
  assert pub.prompts == {"query": "query: ", "doc": "passage: "}
  (tmp_path / "e5" / "config_sentence_transformers.json").write_text(json.dumps(
      {"prompts": {"retrieval": "Represent this: "}, "default_prompt_name": "retrieval"}))
  assert published.read(tmp_path / "e5").prompts == {"query": "Represent this: ", "doc": "Represent this: "}


def test_unsupported_sentence_transformers_pooling_is_refused_unless_overridden(tmp_path, minilm_dir):
  shutil.copytree(minilm_dir, tmp_path / "m")
  (tmp_path / "m" / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_sqrt_len_tokens": True}))
  with pytest.raises(ValueError, match=r"1_Pooling/config.json: pooling \['pooling_mode_mean_sqrt_len_tokens'\]"):
    published.read(tmp_path / "m")
  assert published.read(tmp_path / "m", pooling="cls").tower.pooling == "cls"


# ----------------------------------------------------------------------------------------------- refusals


def test_tensors_that_fit_no_family_name_the_family_and_the_tensors(tmp_path):
  roberta, _ = ance_dir(tmp_path)
  state = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
  state["extraHead.weight"] = torch.zeros(3, 3)
  del state["roberta.encoder.layer.1.output.dense.bias"]
  torch.save(state, tmp_path / "pytorch_model.bin")
  with pytest.raises(hf.HFWeightsError) as e:
    published.read(tmp_path)
  message = str(e.value)
  assert "read as ance (RobertaDot" in message
  assert "missing tensor: encoder.layer.1.output.dense.bias" in message
  assert "unexpected tensor: extraHead.weight" in message


def test_unknown_model_type_is_one_line(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5"}))
  (tmp_path / "model.safetensors").write_bytes(b"")
  with pytest.raises(ValueError, match="model_type 't5' is not one jdr reads"):
    published.read(tmp_path)


# ----------------------------------------------------------------------------------------------- hub ids


def _cache_as_huggingface_hub_does(cache, repo_id: str, folder, commit: str = "c0ffee" * 6 + "c0ff") -> None:
  """`folder`'s files as huggingface_hub caches a download: blobs/, snapshots/COMMIT/ links, refs/main."""
  import hashlib
  import os
  root = cache / ("models--" + repo_id.replace("/", "--"))
  for f in sorted(folder.iterdir()):
    data = f.read_bytes()
    blob = root / "blobs" / hashlib.sha256(data).hexdigest()
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    link = root / "snapshots" / commit / f.name
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(blob, link.parent))
  (root / "refs").mkdir(parents=True, exist_ok=True)
  (root / "refs" / "main").write_text(commit)


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
  from huggingface_hub import constants
  from jdr.runtime import hub
  cache = tmp_path / "hf" / "hub"
  cache.mkdir(parents=True)
  monkeypatch.setenv("HF_HUB_CACHE", str(cache))
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
  monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
  hub.forget()
  yield cache
  hub.forget()


def test_a_hub_id_loads_from_the_cache_offline_and_a_missing_one_is_one_line(tmp_path, offline_cache, minilm_dir):
  model = perturbed(transformers.DistilBertModel(transformers.DistilBertConfig(
      vocab_size=30522, dim=32, n_layers=2, n_heads=4, hidden_dim=37, max_position_embeddings=64)))
  model.save_pretrained(tmp_path / "tasb")
  for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt"):
    shutil.copy(minilm_dir / name, tmp_path / "tasb" / name)
  _cache_as_huggingface_hub_does(offline_cache, "someone/tiny-tasb", tmp_path / "tasb")
  from jdr.retrieval import encoder_runtime
  by_id = encoder_runtime.load_runtime("someone/tiny-tasb", dtype="float32")
  by_path = encoder_runtime.load_runtime(str(tmp_path / "tasb"), dtype="float32")
  texts = ["what causes scurvy?", "hi"]
  np.testing.assert_array_equal(encoder_runtime.encode_texts(by_id, texts), encoder_runtime.encode_texts(by_path, texts))
  assert by_id.info["family"] == "distilbert"
  with pytest.raises(FileNotFoundError, match=r"^someone/absent: not in the Hugging Face cache \(HF_HUB_OFFLINE"):
    encoder_runtime.load_runtime("someone/absent")
  # A run names it the same way, refused before any work with the key and the reason.
  from jdr.runtime import config_files, defaults
  config = defaults.get_config()
  config.data.dataset = "builtin"
  config.model.init_from = "someone/absent"
  with pytest.raises(config_files.ConfigError, match=r"^model.init_from=someone/absent: directory not found; .*; "
                                                    r"as a Hugging Face hub id, not in the Hugging Face cache"):
    config_files.check_inputs(config)
  config.model.init_from = "someone/tiny-tasb"
  config_files.check_inputs(config)


def test_last_token_pooling_takes_each_rows_last_real_token_on_either_padding_side():
  from jdr.models.towers import pool
  hidden = np.random.default_rng(0).normal(size=(3, 5, 4)).astype(np.float32)
  mask = np.array([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
  expected = hidden[[0, 1, 2], [2, 4, 4]]
  np.testing.assert_array_equal(np.asarray(pool(hidden, mask, "last")), expected)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_decoder_directory_is_a_last_token_tower(tmp_path, kind):
  config_cls, model_cls = {"llama": (transformers.LlamaConfig, transformers.LlamaModel),
                           "qwen2": (transformers.Qwen2Config, transformers.Qwen2Model)}[kind]
  model = perturbed(model_cls(config_cls(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=40, max_position_embeddings=64)))
  model.save_pretrained(tmp_path)
  ids, mask = batch(0)
  with torch.no_grad():
    hidden = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).last_hidden_state.numpy()
  expected = hidden[np.arange(3), mask.sum(1) - 1]
  got, info = ours(tmp_path, ids, mask)
  diff = float(np.abs(got - expected).max())
  print(f"{kind} tower (last-token pooling) max abs diff: {diff:.2e}")
  assert info["family"] == kind and info["pooling"] == "last" and diff < 1e-5
  assert np.abs(rows_alone(tmp_path, ids, mask) - got).max() < 1e-5


# ----------------------------------------------------------------------------------------------- ModernBERT


@pytest.mark.parametrize("biases", [False, True])
def test_modernbert_matches_transformers(tmp_path, biases):
  """Local attention of 4 tokens (2 each side) on sequences of 11, global every third layer, both rope bases."""
  config = transformers.ModernBertConfig(
      vocab_size=99, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=40,
      max_position_embeddings=64, local_attention=4, global_attn_every_n_layers=3, pad_token_id=0,
      norm_bias=biases, attention_bias=biases, mlp_bias=biases, attn_implementation="eager")
  model = perturbed(transformers.ModernBertModel(config))
  model.save_pretrained(tmp_path)
  ids, mask = batch(0)
  with torch.no_grad():
    hidden = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).last_hidden_state.numpy()
  got, info = ours(tmp_path, ids, mask)
  diff = float(np.abs(got - hidden[:, 0]).max())
  print(f"modernbert (biases={biases}) CLS vectors max abs diff: {diff:.2e}")
  assert info["family"] == "modernbert" and diff < 1e-5
  pub = published.read(tmp_path)
  from jdr.models import modernbert
  tokens = modernbert.ModernBertEncoder(pub.encoder).apply({"params": pub.params["encoder"]}, ids, mask)
  token_diff = float(np.abs(np.asarray(tokens) - hidden)[mask.astype(bool)].max())
  print(f"modernbert (biases={biases}) hidden states max abs diff on real tokens: {token_diff:.2e}")
  assert token_diff < 1e-5
  assert np.abs(rows_alone(tmp_path, ids, mask) - got).max() < 1e-5
  # Exported back, transformers reads the same model.
  hf.export_hf(pub.encoder, pub.params["encoder"], tmp_path / "export")
  again = transformers.AutoModel.from_pretrained(tmp_path / "export").eval()
  with torch.no_grad():
    again_hidden = again(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).last_hidden_state.numpy()
  assert np.abs(again_hidden - hidden)[mask.astype(bool)].max() < 1e-5


def test_a_released_checkpoint_without_tokenizer_files_says_what_to_do(tmp_path):
  ance_dir(tmp_path)  # as DRhard and ANCE release them: config.json and weights, no tokenizer
  with pytest.raises(FileNotFoundError, match=r"--model=.*: no tokenizer files in .*copy a tokenizer's files"):
    published.load_tower(str(tmp_path))  # a tiny vocabulary: not roberta-base's, nothing to fall back to


def test_a_released_roberta_base_without_tokenizer_reads_roberta_base_from_the_cache(tmp_path, offline_cache):
  from jdr.models.towers import Tower
  roberta = transformers.RobertaModel(transformers.RobertaConfig(
      vocab_size=50265, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8,
      max_position_embeddings=40, pad_token_id=1), add_pooling_layer=False)
  roberta.save_pretrained(tmp_path / "star")  # config and weights only, as DRhard releases STAR
  pub = published.read(tmp_path / "star")
  with pytest.raises(FileNotFoundError, match=r"FacebookAI/roberta-base's, which its authors' code loads, is not "
                                              r"at hand: FacebookAI/roberta-base: not in the Hugging Face cache"):
    published.tokenizer_dir(pub, "--model")
  (tmp_path / "tok").mkdir()
  (tmp_path / "tok" / "vocab.json").write_text("{}")
  _cache_as_huggingface_hub_does(offline_cache, "FacebookAI/roberta-base", tmp_path / "tok")
  assert (pathlib.Path(published.tokenizer_dir(pub, "--model")) / "vocab.json").exists()
