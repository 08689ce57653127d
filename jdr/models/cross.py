"""Cross-encoder: one BERT / RoBERTa over `[CLS] q [SEP] d [SEP]` with a one-logit head (FGD's teacher, reranker).

The head is the one Hugging Face's sequence classifiers carry, so weights go both ways unchanged:

  BERT     pooler (Dense + tanh over [CLS]) -> dropout -> classifier Dense(1)   (BertForSequenceClassification)
  RoBERTa  <s> -> dropout -> Dense + tanh -> dropout -> out_proj Dense(1)         (RobertaForSequenceClassification)

`load_cross_encoder` reads any checkpoint jdr reads: a sequence classifier keeps its head; a plain encoder
(e.g. the bundled MiniLM) gets a freshly initialised one, said on stderr. `export_cross_encoder` writes a
directory that `transformers.AutoModelForSequenceClassification` and sentence-transformers' `CrossEncoder`
load with num_labels = 1.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jdr.data import text
from jdr.models import hf
from jdr.models import saved
from jdr.models.bert import Encoder, EncoderConfig
from jdr.models.dropout import Dropout

# HF name -> (jdr path, transpose) of each head tensor, per model type.
_HEAD = {
    "bert": {"bert.pooler.dense.weight": (("pooler", "kernel"), True),
             "bert.pooler.dense.bias": (("pooler", "bias"), False),
             "classifier.weight": (("classifier", "kernel"), True),
             "classifier.bias": (("classifier", "bias"), False)},
    "roberta": {"classifier.dense.weight": (("pooler", "kernel"), True),
                "classifier.dense.bias": (("pooler", "bias"), False),
                "classifier.out_proj.weight": (("classifier", "kernel"), True),
                "classifier.out_proj.bias": (("classifier", "bias"), False)},
}


def _dense(features: int, axes: tuple, name: str) -> nn.Dense:
  return nn.Dense(features, kernel_init=nn.with_logical_partitioning(nn.initializers.normal(0.02), axes),
                  bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), axes[1:]), name=name)


class CrossEncoder(nn.Module):
  """Token ids of (query, document) pairs [B, L] -> one float32 relevance logit per pair [B]."""
  config: EncoderConfig

  @nn.compact
  def __call__(self, input_ids, attention_mask, token_type_ids=None, *, deterministic: bool = True):
    cfg = self.config
    # The head reads the first position alone: the last layer computes nothing else.
    x = Encoder(cfg, name="encoder")(input_ids, attention_mask, token_type_ids, deterministic=deterministic,
                                     first_token_only=True)[:, 0]
    drop = Dropout(cfg.hidden_dropout)
    if cfg.model_type == "roberta":
      x = drop(x, deterministic=deterministic)
    x = jnp.tanh(_dense(cfg.hidden_size, ("embed", None), "pooler")(x))
    x = drop(x, deterministic=deterministic)
    return _dense(1, (None, None), "classifier")(x)[:, 0].astype(jnp.float32)


def _model_type(cfg: EncoderConfig) -> str:
  return "roberta" if cfg.model_type == "roberta" else "bert"


def head_from_state_dict(cfg: EncoderConfig, tensors: dict[str, np.ndarray]) -> dict | None:
  """The head's params from HF tensors, or None when the checkpoint has no (complete) classifier head."""
  table = _HEAD[_model_type(cfg)]
  if not all(name in tensors for name in table):
    return None
  head: dict[str, dict] = {}
  for name, ((module, leaf), transpose) in table.items():
    value = np.asarray(tensors[name], np.float32)
    head.setdefault(module, {})[leaf] = np.ascontiguousarray(value.T if transpose else value)
  if head["classifier"]["kernel"].shape != (cfg.hidden_size, 1):
    raise hf.HFWeightsError("classifier head", mismatched=[
        ("classifier", head["classifier"]["kernel"].shape[::-1], (1, cfg.hidden_size))])
  return head


def init_params(cfg: EncoderConfig, seed: int = 0) -> dict:
  ids = jnp.ones((1, 4), jnp.int32)
  return jax.device_get(nn.unbox(CrossEncoder(cfg).init(jax.random.PRNGKey(seed), ids, ids)["params"]))


def load_cross_encoder(model: str | pathlib.Path, *, with_tokenizer: bool = True,
                       **overrides) -> tuple[CrossEncoder, dict, Any]:
  """(CrossEncoder, params, tokenizer or None) from a jdr cross-encoder workdir or export, a Hugging Face
  directory or "minilm"."""
  if str(model) != "minilm" and saved.is_jdr_model(model):
    params, description, tokenizer = saved.load(model)
    if description.get("architecture") != "cross_encoder":
      raise ValueError(f"{model} holds two towers, not a cross-encoder")
    config = EncoderConfig.from_saved(description["encoder"])
    return CrossEncoder(dataclasses.replace(config, **overrides)), params, tokenizer
  path = hf.minilm_path() if str(model) == "minilm" else pathlib.Path(model)
  config_file = path / "config.json"
  if not config_file.exists():
    raise FileNotFoundError(f"{config_file} not found: a cross-encoder needs a local Hugging Face model directory")
  cfg = EncoderConfig.from_hf(json.loads(config_file.read_text()), **overrides)
  tensors = hf.read_state_dict(path)  # once: the encoder and the head come from the same tensors
  encoder_params = hf.params_from_state_dict(cfg, tensors, str(path))
  head = head_from_state_dict(cfg, tensors)
  if head is None:
    print(f"{path}: no sequence-classification head; the cross-encoder's head starts from random weights",
          file=sys.stderr)
    head = {k: v for k, v in init_params(cfg).items() if k != "encoder"}
  tokenizer = text.load_tokenizer(path) if with_tokenizer else None
  return CrossEncoder(cfg), {"encoder": encoder_params, **head}, tokenizer


def export_cross_encoder(cfg: EncoderConfig, params: dict, path: str | pathlib.Path, *, tokenizer=None,
                         max_length: int | None = None) -> pathlib.Path:
  """Writes config.json + model.safetensors (+ tokenizer) for AutoModelForSequenceClassification (1 label)."""
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  path = pathlib.Path(path)
  params = jax.device_get(nn.unbox(params))
  prefix = "roberta." if _model_type(cfg) == "roberta" else "bert."
  tensors = {prefix + k: v for k, v in hf.state_dict_from_params(cfg, params["encoder"]).items()}
  for name, ((module, leaf), transpose) in _HEAD[_model_type(cfg)].items():
    value = np.asarray(params[module][leaf], np.float32)
    tensors[name] = np.ascontiguousarray(value.T if transpose else value)
  path.mkdir(parents=True, exist_ok=True)
  architecture = "RobertaForSequenceClassification" if prefix == "roberta." else "BertForSequenceClassification"
  config = dict(cfg.to_hf(), dtype="float32", architectures=[architecture], num_labels=1,
                id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
  if max_length:
    config["jdr_max_length"] = int(max_length)
  (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
  save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
  if tokenizer is not None:
    tokenizer.save_pretrained(str(path))
  return path
