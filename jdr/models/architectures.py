"""The encoder architectures a tower can have, by model_type: one place that knows each one's config class,
Flax module, Hugging Face names and config.json.

  bert, roberta   jdr.models.bert (RoBERTa: padding-offset positions)
  distilbert      jdr.models.bert's blocks without token types; names and config in jdr.models.distilbert
  modernbert      jdr.models.modernbert (rotary positions, GeGLU, local and global attention)
  llama, mistral, qwen2, qwen3
                  jdr.models.decoder (causal decoders as towers: RMSNorm, rotary, SwiGLU, grouped-query attention)

Every caller that builds, loads, exports or sizes an encoder asks here, so a new architecture is one entry.
"""

from __future__ import annotations

from typing import Any

from jdr.models import bert
from jdr.models import distilbert
from jdr.models.bert import EncoderConfig

# transformers model_type values and the architecture that reads them.
_HF_TYPES = {"bert": "bert", "roberta": "roberta", "xlm-roberta": "roberta", "camembert": "roberta",
             "dpr": "bert", "distilbert": "distilbert", "modernbert": "modernbert",
             "llama": "decoder", "mistral": "decoder", "qwen2": "decoder", "qwen3": "decoder"}
DECODER_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def _modernbert():
  from jdr.models import modernbert  # pylint: disable=g-import-not-at-top  (only its users pay its import)
  return modernbert


def _decoder():
  from jdr.models import decoder  # pylint: disable=g-import-not-at-top
  return decoder


def decoder_config(**fields):
  """A decoder encoder's config (jdr.models.decoder.DecoderConfig) from its fields."""
  return _decoder().DecoderConfig(**fields)


def merged_lora(params: dict, cfg) -> dict:
  """A decoder encoder's params with its LoRA adapters folded into the kernels (jdr.models.decoder.merged)."""
  return _decoder().merged(params, cfg)[0]


def base_without_adapters(params: dict) -> dict:
  """A decoder encoder's params less its LoRA adapters (jdr.models.decoder.without_adapters)."""
  return _decoder().without_adapters(params)


def is_decoder(cfg) -> bool:
  return getattr(cfg, "model_type", None) in DECODER_TYPES


def is_modernbert(cfg) -> bool:
  return getattr(cfg, "model_type", None) == "modernbert"


def known_hf_type(model_type: str) -> bool:
  return model_type in _HF_TYPES


def config_from_hf(config: dict[str, Any], **overrides):
  """An encoder config from a transformers config.json dict; `overrides` set jdr-only fields (dtype, remat...)."""
  model_type = config.get("model_type", "bert")
  kind = _HF_TYPES.get(model_type)
  if kind is None:
    raise ValueError(f"unsupported Hugging Face model_type {model_type!r}: jdr reads "
                     f"{', '.join(sorted(_HF_TYPES))}")
  if kind == "decoder":
    return _decoder().DecoderConfig.from_hf(config, **overrides)
  # How weights are stored is a decoder's setting; the encoders keep float32 (build refuses bfloat16 for them).
  overrides.pop("param_dtype", None)
  if kind == "distilbert":
    return distilbert.config_from_hf(config, **overrides)
  if kind == "modernbert":
    return _modernbert().ModernBertConfig.from_hf(config, **overrides)
  return EncoderConfig.from_hf(config, **overrides)


def config_from_saved(d: dict[str, Any]):
  """The encoder config a saved model's description holds (dataclasses.asdict of one)."""
  if d.get("model_type") == "modernbert":
    return _modernbert().ModernBertConfig.from_saved(d)
  if d.get("model_type") in DECODER_TYPES:
    return _decoder().DecoderConfig.from_saved(d)
  return EncoderConfig.from_saved(d)


def config_to_hf(cfg) -> dict[str, Any]:
  """The transformers config.json dict of an encoder config."""
  if cfg.model_type == "distilbert":
    return distilbert.config_to_hf(cfg)
  return cfg.to_hf()


def hf_table(cfg) -> list:
  """weight_names.Entry per tensor of the architecture's transformers base model (no prefix)."""
  if cfg.model_type == "distilbert":
    return distilbert.hf_table(cfg)
  if is_modernbert(cfg):
    return _modernbert().hf_table(cfg)
  if is_decoder(cfg):
    return _decoder().hf_table(cfg)
  return bert.hf_table(cfg)


def module(cfg):
  """The Flax encoder module class for `cfg`: token ids -> float32 [B, L, H]."""
  if is_decoder(cfg):
    return _decoder().DecoderEncoder
  return _modernbert().ModernBertEncoder if is_modernbert(cfg) else bert.Encoder


def computes_first_position_alone(cfg) -> bool:
  """Whether the encoder for `cfg` can compute its last layer at the first position alone (a BERT-family
  `bert.Encoder`'s `first_token_only`), which is all [CLS] pooling reads."""
  return module(cfg) is bert.Encoder


def serving_params(params: dict, cfg) -> dict:
  if is_decoder(cfg):
    return _decoder().serving_params(params, cfg)
  return (_modernbert().serving_params if is_modernbert(cfg) else bert.serving_params)(params, cfg)


# The prefix a transformers head model puts before its base model's names, per architecture; a checkpoint
# saved from such a model (e.g. RobertaForSequenceClassification, ANCE's RobertaDot) reads the same.
BASE_PREFIXES = {"bert": ("bert.",), "roberta": ("roberta.",), "distilbert": ("distilbert.",),
                 "modernbert": ("model.",)}
# Heads that transformers checkpoints carry on top of the encoder, which a retrieval tower never uses.
IGNORED_HEADS = {"bert": ("pooler.", "cls.", "classifier.", "qa_outputs."),
                 "roberta": ("pooler.", "lm_head.", "classifier.", "qa_outputs."),
                 "distilbert": ("vocab_transform.", "vocab_layer_norm.", "vocab_projector.", "pre_classifier.",
                                "classifier.", "qa_outputs."),
                 "modernbert": ("head.", "decoder.", "classifier.", "qa_outputs.")}
# Decoders strip their own (jdr.models.decoder.strip: "model.", lm_head, and old rotary buffers).
