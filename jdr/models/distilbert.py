"""DistilBERT (and the sentence-transformers models built on it, TAS-B among them) on jdr's BERT encoder.

DistilBERT's blocks are BERT's: post-LayerNorm attention and GELU MLP with biases, the same epsilon. It drops
the token-type table and keeps learned (or frozen sinusoidal, stored all the same) positions 0..L-1. So the
Flax module is `jdr.models.bert.Encoder` with `type_vocab_size=0`; what is DistilBERT's own is its config
names and its state dict's names, both here.
"""

from __future__ import annotations

from typing import Any

from jdr.models import weight_names as names
from jdr.models.bert import EncoderConfig


def config_from_hf(config: dict[str, Any], **overrides) -> EncoderConfig:
  """EncoderConfig from a DistilBertConfig's config.json dict."""
  fields = dict(model_type="distilbert", vocab_size=config["vocab_size"], hidden_size=config["dim"],
                num_layers=config["n_layers"], num_heads=config["n_heads"], intermediate_size=config["hidden_dim"],
                max_position_embeddings=config["max_position_embeddings"], type_vocab_size=0,
                layer_norm_eps=1e-12,  # fixed in transformers' DistilBERT, not a config field
                pad_token_id=config.get("pad_token_id") or 0, hidden_dropout=config.get("dropout", 0.1),
                attention_dropout=config.get("attention_dropout", 0.1),
                hidden_act=config.get("activation", "gelu"))
  fields.update(overrides)
  return EncoderConfig(**fields)


def config_to_hf(cfg: EncoderConfig) -> dict[str, Any]:
  return {"architectures": ["DistilBertModel"], "model_type": "distilbert", "vocab_size": cfg.vocab_size,
          "dim": cfg.hidden_size, "n_layers": cfg.num_layers, "n_heads": cfg.num_heads,
          "hidden_dim": cfg.intermediate_size, "max_position_embeddings": cfg.max_position_embeddings,
          "sinusoidal_pos_embds": False, "dropout": cfg.hidden_dropout,
          "attention_dropout": cfg.attention_dropout, "activation": cfg.hidden_act,
          "initializer_range": 0.02, "pad_token_id": cfg.pad_token_id, "tie_word_embeddings": True}


def hf_table(cfg: EncoderConfig) -> list[names.Entry]:
  """DistilBertModel's state dict names <-> jdr.models.bert.Encoder params."""
  h, n, d, m = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.intermediate_size
  E = names.Entry

  def norm(hf: str, path: tuple[str, ...]) -> list[names.Entry]:
    return [E(f"{hf}.weight", path + ("scale",), (h,), *names.SAME), E(f"{hf}.bias", path + ("bias",), (h,), *names.SAME)]

  table = [E("embeddings.word_embeddings.weight", ("embeddings", "word_embeddings"), (cfg.vocab_size, h), *names.SAME),
           E("embeddings.position_embeddings.weight", ("embeddings", "position_embeddings"),
             (cfg.max_position_embeddings, h), *names.SAME),
           *norm("embeddings.LayerNorm", ("embeddings", "norm"))]
  for i in range(cfg.num_layers):
    hf, layer = f"transformer.layer.{i}", f"layer_{i}"
    for ours, theirs in (("query", "q_lin"), ("key", "k_lin"), ("value", "v_lin")):
      table += [E(f"{hf}.attention.{theirs}.weight", (layer, ours, "kernel"), (h, h), *names.to_heads(h, n, d)),
                E(f"{hf}.attention.{theirs}.bias", (layer, ours, "bias"), (h,), *names.heads_bias(n, d))]
    table += [
        E(f"{hf}.attention.out_lin.weight", (layer, "attention_output", "kernel"), (h, h), *names.from_heads(h, n, d)),
        E(f"{hf}.attention.out_lin.bias", (layer, "attention_output", "bias"), (h,), *names.SAME),
        *norm(f"{hf}.sa_layer_norm", (layer, "attention_norm")),
        E(f"{hf}.ffn.lin1.weight", (layer, "intermediate", "kernel"), (m, h), *names.LINEAR),
        E(f"{hf}.ffn.lin1.bias", (layer, "intermediate", "bias"), (m,), *names.SAME),
        E(f"{hf}.ffn.lin2.weight", (layer, "output", "kernel"), (h, m), *names.LINEAR),
        E(f"{hf}.ffn.lin2.bias", (layer, "output", "bias"), (h,), *names.SAME),
        *norm(f"{hf}.output_layer_norm", (layer, "output_norm")),
    ]
  return table
