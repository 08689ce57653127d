"""Hugging Face checkpoints <-> jdr encoder params.

`load_hf` reads a local transformers directory (config.json + model.safetensors, a sharded safetensors index,
or pytorch_model.bin) of a BertModel / RobertaModel (or any head model built on one: the "bert." / "roberta."
prefix is stripped and pooler / MLM / classifier heads are skipped) into `jdr.models.bert.Encoder` params.
`export_hf` writes the reverse, loadable by `transformers.AutoModel.from_pretrained`. Both go through one
name table, so a name or shape that does not fit is reported, all at once, by `HFWeightsError`.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

import numpy as np

from jdr.runtime import paths
from jdr.data import text
from jdr.models.bert import EncoderConfig
from jdr.models.towers import Tower, TowerConfig

# Heads that Hugging Face checkpoints carry on top of the encoder; a retrieval tower never uses them.
_IGNORED_PREFIXES = ("pooler.", "cls.", "lm_head.", "classifier.", "qa_outputs.")
_IGNORED_NAMES = ("embeddings.position_ids",)  # a non-persistent buffer that old checkpoints still saved
_SAFETENSORS_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64,
                       "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


class HFWeightsError(ValueError):
  """A checkpoint's tensors do not fit the encoder: lists every missing, unexpected and mis-shaped tensor."""

  def __init__(self, source: str, missing=(), unexpected=(), mismatched=()):
    self.source, self.missing, self.unexpected = source, list(missing), list(unexpected)
    self.mismatched = list(mismatched)  # (name, shape found, shape expected)
    lines = [f"weights in {source} do not match the encoder config:"]
    lines += [f"  missing tensor: {name}" for name in self.missing]
    lines += [f"  unexpected tensor: {name}" for name in self.unexpected]
    lines += [f"  shape mismatch: {name}: found {tuple(got)}, expected {tuple(want)}"
              for name, got, want in self.mismatched]
    super().__init__("\n".join(lines))


@dataclasses.dataclass(frozen=True)
class _Entry:
  hf_name: str
  path: tuple[str, ...]  # where the tensor lives in the Encoder param tree
  hf_shape: tuple[int, ...]
  to_jdr: Callable[[np.ndarray], np.ndarray]
  to_hf: Callable[[np.ndarray], np.ndarray]


def _table(cfg: EncoderConfig) -> list[_Entry]:
  """The name/shape/layout correspondence between a transformers state dict and Encoder params."""
  h, n, d, m = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.intermediate_size
  same = lambda x: x
  # torch Linear stores [out, in]; Flax kernels are [in, out], with the heads axis split out of `out`
  # (query/key/value) or `in` (attention output) so attention needs no reshapes.
  linear = (lambda w: w.T, lambda k: k.T)
  to_heads = (lambda w: w.T.reshape(h, n, d), lambda k: k.reshape(h, n * d).T)
  heads_bias = (lambda b: b.reshape(n, d), lambda b: b.reshape(n * d))
  from_heads = (lambda w: w.T.reshape(n, d, h), lambda k: k.reshape(n * d, h).T)

  def norm(hf: str, path: tuple[str, ...]) -> list[_Entry]:
    return [_Entry(f"{hf}.weight", path + ("scale",), (h,), same, same),
            _Entry(f"{hf}.bias", path + ("bias",), (h,), same, same)]

  emb = "embeddings"
  table = [
      _Entry(f"{emb}.word_embeddings.weight", (emb, "word_embeddings"), (cfg.vocab_size, h), same, same),
      _Entry(f"{emb}.position_embeddings.weight", (emb, "position_embeddings"),
             (cfg.max_position_embeddings, h), same, same),
      _Entry(f"{emb}.token_type_embeddings.weight", (emb, "token_type_embeddings"),
             (cfg.type_vocab_size, h), same, same),
      *norm(f"{emb}.LayerNorm", (emb, "norm")),
  ]
  for i in range(cfg.num_layers):
    hf, layer = f"encoder.layer.{i}", f"layer_{i}"
    for qkv in ("query", "key", "value"):
      table += [_Entry(f"{hf}.attention.self.{qkv}.weight", (layer, qkv, "kernel"), (h, h), *to_heads),
                _Entry(f"{hf}.attention.self.{qkv}.bias", (layer, qkv, "bias"), (h,), *heads_bias)]
    table += [
        _Entry(f"{hf}.attention.output.dense.weight", (layer, "attention_output", "kernel"), (h, h), *from_heads),
        _Entry(f"{hf}.attention.output.dense.bias", (layer, "attention_output", "bias"), (h,), same, same),
        *norm(f"{hf}.attention.output.LayerNorm", (layer, "attention_norm")),
        _Entry(f"{hf}.intermediate.dense.weight", (layer, "intermediate", "kernel"), (m, h), *linear),
        _Entry(f"{hf}.intermediate.dense.bias", (layer, "intermediate", "bias"), (m,), same, same),
        _Entry(f"{hf}.output.dense.weight", (layer, "output", "kernel"), (h, m), *linear),
        _Entry(f"{hf}.output.dense.bias", (layer, "output", "bias"), (h,), same, same),
        *norm(f"{hf}.output.LayerNorm", (layer, "output_norm")),
    ]
  return table


# ---------------------------------------------------------------------------------------------- reading


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
  # Parsed directly (the format is an 8-byte header length, a JSON header, raw bytes) because
  # safetensors' numpy reader rejects bfloat16, which many recent checkpoints use.
  import ml_dtypes  # a jax dependency
  dtypes = dict(_SAFETENSORS_DTYPES, BF16=ml_dtypes.bfloat16)
  with open(path, "rb") as f:
    (header_len,) = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(header_len))
  data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len)
  tensors = {}
  for name, info in header.items():
    if name == "__metadata__":
      continue
    if info["dtype"] not in dtypes:
      raise HFWeightsError(str(path), unexpected=[f"{name} (unsupported dtype {info['dtype']})"])
    start, end = info["data_offsets"]
    tensors[name] = data[start:end].view(dtypes[info["dtype"]]).reshape(info["shape"])
  return tensors


def _read_torch(path: Path) -> dict[str, np.ndarray]:
  try:
    import torch  # optional: only old-style checkpoints need it
  except ImportError as e:
    raise ImportError(f"{path} is a PyTorch pickle; reading it needs torch (or convert it to safetensors)") from e
  # weights_only=True: a checkpoint must not be able to run code while being read.
  state = torch.load(path, map_location="cpu", weights_only=True)
  return {name: t.detach().to(torch.float32).numpy() for name, t in state.items()}


def read_state_dict(path: str | Path) -> dict[str, np.ndarray]:
  """All tensors of a local HF checkpoint directory, as numpy arrays (safetensors preferred)."""
  path = Path(path)
  for index_name, reader in (("model.safetensors.index.json", _read_safetensors),
                             ("pytorch_model.bin.index.json", _read_torch)):
    if (path / index_name).exists():
      shards = sorted(set(json.loads((path / index_name).read_text())["weight_map"].values()))
      tensors = {}
      for shard in shards:
        tensors.update(reader(path / shard))
      return tensors
  if (path / "model.safetensors").exists():
    return _read_safetensors(path / "model.safetensors")
  if (path / "pytorch_model.bin").exists():
    return _read_torch(path / "pytorch_model.bin")
  raise FileNotFoundError(f"no model.safetensors or pytorch_model.bin (or sharded index) in {path}")


def _strip(tensors: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], list[str]]:
  """Drops model prefixes, legacy gamma/beta names and head tensors; returns (encoder tensors, duplicates)."""
  out, duplicates = {}, []
  for name, value in tensors.items():
    key = name
    for prefix in ("bert.", "roberta."):
      if key.startswith(prefix):
        key = key[len(prefix):]
        break
    key = key.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
    if key.startswith(_IGNORED_PREFIXES) or key in _IGNORED_NAMES:
      continue
    if key in out:
      duplicates.append(name)
    out[key] = value
  return out, duplicates


def params_from_state_dict(cfg: EncoderConfig, tensors: dict[str, np.ndarray],
                           source: str = "state dict") -> dict[str, Any]:
  """Converts HF-named tensors to the nested Encoder param dict (float32 numpy)."""
  tensors, duplicates = _strip(tensors)
  table = _table(cfg)
  known = {e.hf_name for e in table}
  missing = [e.hf_name for e in table if e.hf_name not in tensors]
  unexpected = duplicates + sorted(set(tensors) - known)
  mismatched = [(e.hf_name, tensors[e.hf_name].shape, e.hf_shape) for e in table
                if e.hf_name in tensors and tuple(tensors[e.hf_name].shape) != e.hf_shape]
  if missing or unexpected or mismatched:
    raise HFWeightsError(source, missing, unexpected, mismatched)
  params: dict[str, Any] = {}
  for e in table:
    node = params
    for part in e.path[:-1]:
      node = node.setdefault(part, {})
    node[e.path[-1]] = np.ascontiguousarray(e.to_jdr(np.asarray(tensors[e.hf_name], np.float32)))
  return params


def load_hf(path: str | Path, **overrides) -> tuple[EncoderConfig, dict[str, Any]]:
  """Loads a local HF BERT/RoBERTa directory -> (EncoderConfig, Encoder params as float32 numpy).

  `overrides` set EncoderConfig fields that config.json does not hold (dtype="bfloat16", remat=True...).
  Use the params as `Encoder(config).apply({"params": params}, ...)`.
  """
  path = Path(path)
  config_file = path / "config.json"
  if not config_file.exists():
    raise FileNotFoundError(f"{path}: not a model (no config.json): give a Hugging Face model directory, a jdr "
                            "export or training workdir, or `minilm`")
  cfg = EncoderConfig.from_hf(json.loads(config_file.read_text()), **overrides)
  return cfg, params_from_state_dict(cfg, read_state_dict(path), str(path))


# ---------------------------------------------------------------------------------------------- writing


def state_dict_from_params(cfg: EncoderConfig, params: dict[str, Any]) -> dict[str, np.ndarray]:
  """The reverse of params_from_state_dict: Encoder params -> HF-named float32 numpy tensors."""
  import flax.linen as nn
  params = nn.unbox(params)
  if set(params) == {"params"}:  # a whole variables dict
    params = params["params"]
  if "encoder" in params and "embeddings" not in params:
    raise ValueError("export_hf takes Encoder params: pass tower_params['encoder'] (towers' heads are not "
                     "part of a Hugging Face BertModel)")
  flat = {}

  def walk(node, prefix):
    for key, value in node.items():
      if isinstance(value, Mapping):
        walk(value, prefix + (key,))
      else:
        flat[prefix + (key,)] = value

  walk(params, ())
  table = _table(cfg)
  name = lambda p: "/".join(p)
  missing = [name(e.path) for e in table if e.path not in flat]
  unexpected = sorted(name(p) for p in set(flat) - {e.path for e in table})
  tensors, mismatched = {}, []
  for e in table:
    if e.path not in flat:
      continue
    value = np.asarray(flat[e.path], np.float32)
    # The jdr-side shape, derived from the HF shape through the same layout function (a zero-cost view).
    want = e.to_jdr(np.broadcast_to(np.float32(0), e.hf_shape)).shape
    if value.shape != want:
      mismatched.append((name(e.path), value.shape, want))
    else:
      tensors[e.hf_name] = np.ascontiguousarray(e.to_hf(value))
  if missing or unexpected or mismatched:
    raise HFWeightsError("params", missing, unexpected, mismatched)
  return tensors


def _untrained_pooler(cfg: EncoderConfig, seed: int = 0) -> dict[str, np.ndarray]:
  """BertModel's / RobertaModel's pooler (Dense + tanh over [CLS]) as transformers initialises it.

  A jdr tower pools the hidden states itself and has no such layer, but transformers.AutoModel always
  builds one (`add_pooling_layer` is a constructor argument, not a config field), so without these
  tensors every load reports them missing. Written here, with a fixed seed, they are what a load would
  have drawn anyway: `pooler_output` of an export is untrained; `last_hidden_state` is the model.
  """
  h = cfg.hidden_size
  rng = np.random.default_rng(seed)
  return {"pooler.dense.weight": (0.02 * rng.standard_normal((h, h))).astype(np.float32),
          "pooler.dense.bias": np.zeros((h,), np.float32)}


def export_hf(config: EncoderConfig, params: dict[str, Any], path: str | Path, *, tokenizer=None) -> Path:
  """Writes config.json + model.safetensors (+ the tokenizer, if given) for transformers.AutoModel.

  The safetensors also hold an untrained pooler (see `_untrained_pooler`), which `load_hf` skips.
  """
  from safetensors.numpy import save_file
  path = Path(path)
  tensors = {**state_dict_from_params(config, params), **_untrained_pooler(config)}
  path.mkdir(parents=True, exist_ok=True)
  hf_config = dict(config.to_hf(), dtype="float32")
  (path / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
  # transformers reads the "format" metadata to know the tensors are in PyTorch layout.
  save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
  if tokenizer is not None:
    tokenizer.save_pretrained(str(path))
  return path


# ---------------------------------------------------------------------------------------------- towers


minilm_path = paths.minilm_path  # the bundled checkpoint; it lives in jdr/runtime/paths.py, below data/ and models/


def sentence_transformers_settings(path: str | Path) -> dict[str, Any]:
  """Pooling / normalize / max_length that a sentence-transformers directory declares ({} if none)."""
  path, settings = Path(path), {}
  pooling_file = path / "1_Pooling" / "config.json"
  if pooling_file.exists():
    flags = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_max_tokens": "max"}
    enabled = [k for k, v in json.loads(pooling_file.read_text()).items() if k.startswith("pooling_mode") and v]
    if len(enabled) == 1 and enabled[0] in flags:
      settings["pooling"] = flags[enabled[0]]
    else:
      settings["unsupported_pooling"] = enabled  # e.g. mean_sqrt_len or several modes concatenated
  modules_file = path / "modules.json"
  if modules_file.exists():
    modules = json.loads(modules_file.read_text())
    settings["normalize"] = any(m.get("type", "").endswith(".Normalize") for m in modules)
  bert_file = path / "sentence_bert_config.json"
  if bert_file.exists():
    max_length = json.loads(bert_file.read_text()).get("max_seq_length")
    if max_length:
      settings["max_length"] = int(max_length)
  return settings


def load_tower(model: str, pooling: str | None = None, normalize: bool | None = None,
               max_length: int | None = None, dtype: str = "float32"):
  """A ready-to-encode tower from a HF directory or "minilm" -> (Tower, params, tokenizer, info).

  Pooling, normalisation and max_length default to what a sentence-transformers directory declares (MiniLM:
  mean, normalized, 256), else CLS pooling, no normalisation and the model's maximum length. `params` is the
  Tower's param tree ({"encoder": ...}) as device arrays: `tower.apply({"params": params}, ids, mask)`.
  """
  import jax
  path = minilm_path() if model == "minilm" else Path(model)
  cfg, encoder_params = load_hf(path, dtype=dtype)
  declared = sentence_transformers_settings(path)
  if pooling is None and "unsupported_pooling" in declared:
    raise ValueError(f"{path} declares pooling {declared['unsupported_pooling']}, which jdr does not implement; "
                     "pass pooling='cls' | 'mean' | 'max' explicitly")
  pooling = pooling or declared.get("pooling", "cls")
  normalize = declared.get("normalize", False) if normalize is None else normalize
  tokenizer = text.load_tokenizer(path)
  source = "--max-length"
  if max_length is None:
    source = "the sentence-transformers config" if declared.get("max_length") else "what the model supports"
    max_length = declared.get("max_length") or min(int(tokenizer.model_max_length), cfg.max_length)
  if max_length > cfg.max_length:
    raise ValueError(f"max_length {max_length} exceeds the model's {cfg.max_length} positions")
  tower_config = TowerConfig(encoder=cfg, pooling=pooling, normalize=normalize)
  info = {"path": str(path), "model_type": cfg.model_type, "pooling": pooling, "normalize": normalize,
          "max_length": max_length, "max_length_from": source, "dim": tower_config.dim, "dtype": dtype}  # JSON-able; tower.config has the rest
  return Tower(tower_config), jax.device_put({"encoder": encoder_params}), tokenizer, info
