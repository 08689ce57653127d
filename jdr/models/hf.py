"""Hugging Face checkpoints <-> jdr encoder params.

`load_hf` reads a local transformers directory (config.json + model.safetensors, a sharded safetensors index,
or pytorch_model.bin) of a BertModel / RobertaModel (or any head model built on one: the "bert." / "roberta."
prefix is stripped and pooler / MLM / classifier heads are skipped) into `jdr.models.bert.Encoder` params.
`export_hf` writes the reverse, loadable by `transformers.AutoModel.from_pretrained`. Both go through one
name table, so a name or shape that does not fit is reported, all at once, by `HFWeightsError`.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np

from jdr.runtime import paths
from jdr.models import architectures
from jdr.models import weight_names
from jdr.models.bert import EncoderConfig

_IGNORED_NAMES = ("embeddings.position_ids",)  # a non-persistent buffer that old checkpoints still saved
_SAFETENSORS_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64,
                       "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


HFWeightsError = weight_names.HFWeightsError  # where every family's reader raises it from



# ---------------------------------------------------------------------------------------------- reading


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
  # Parsed directly (the format is an 8-byte header length, a JSON header, raw bytes) because
  # safetensors' numpy reader rejects bfloat16, which many recent checkpoints use.
  import ml_dtypes  # a jax dependency
  dtypes = dict(_SAFETENSORS_DTYPES, BF16=ml_dtypes.bfloat16)
  with open(path, "rb") as f:
    try:
      (header_len,) = struct.unpack("<Q", f.read(8))
      header = json.loads(f.read(header_len))
    except (struct.error, ValueError, MemoryError, OverflowError):
      raise ValueError(f"{path}: not a safetensors file (its header does not parse: a truncated download?)") from None
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


def strip(tensors: dict[str, np.ndarray], cfg) -> tuple[dict[str, np.ndarray], list[str]]:
  """Drops the architecture's head-model prefix (bert., roberta., distilbert., model.), legacy gamma/beta
  names and the heads a retrieval tower never uses; returns (encoder tensors, duplicates)."""
  kind = cfg.model_type
  out, duplicates = {}, []
  for name, value in tensors.items():
    key = name
    for prefix in architectures.BASE_PREFIXES[kind]:
      if key.startswith(prefix):
        key = key[len(prefix):]
        break
    key = key.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
    if key.startswith(architectures.IGNORED_HEADS[kind]) or key in _IGNORED_NAMES:
      continue
    if key in out:
      duplicates.append(name)
    out[key] = value
  return out, duplicates


def params_from_state_dict(cfg, tensors: dict[str, np.ndarray], source: str = "state dict",
                           family: str | None = None) -> dict[str, Any]:
  """Converts HF-named tensors to the nested encoder param dict (float32 numpy). `family` names what the
  checkpoint was read as, for the error when its tensors do not fit."""
  if architectures.is_decoder(cfg):  # its own reader: bfloat16 kept bfloat16, rotary buffers of old checkpoints
    from jdr.models import decoder  # pylint: disable=g-import-not-at-top
    return decoder.params_from_state_dict(cfg, tensors, source, family=family)
  tensors, duplicates = strip(tensors, cfg)
  return weight_names.params_from_table(architectures.hf_table(cfg), tensors, source, duplicates=duplicates,
                                        family=family or cfg.model_type)


def load_hf(path: str | Path, **overrides) -> tuple[Any, dict[str, Any]]:
  """Loads a local HF encoder directory (any jdr.models.architectures model_type) -> (encoder config,
  encoder params as float32 numpy). Heads other than the encoder's are ignored: jdr.models.published reads
  a directory whole (retrieval heads, pooling, prompts).

  `overrides` set EncoderConfig fields that config.json does not hold (dtype="bfloat16", remat=True...).
  Use the params as `Encoder(config).apply({"params": params}, ...)`.
  """
  path = Path(path)
  config_file = path / "config.json"
  if not config_file.exists():
    raise FileNotFoundError(f"{path}: not a model (no config.json): give a Hugging Face model directory, a jdr "
                            "export or training workdir, or `minilm`")
  cfg = architectures.config_from_hf(json.loads(config_file.read_text()), **overrides)
  return cfg, params_from_state_dict(cfg, read_state_dict(path), str(path))


# ---------------------------------------------------------------------------------------------- writing


def state_dict_from_params(cfg, params: dict[str, Any]) -> dict[str, np.ndarray]:
  """The reverse of params_from_state_dict: Encoder params -> HF-named float32 numpy tensors."""
  import flax.linen as nn
  params = nn.unbox(params)
  if set(params) == {"params"}:  # a whole variables dict
    params = params["params"]
  if "encoder" in params and "embeddings" not in params:
    raise ValueError("export_hf takes Encoder params: pass tower_params['encoder'] (towers' heads are not "
                     "part of a Hugging Face BertModel)")
  return weight_names.tensors_from_table(architectures.hf_table(cfg), params)


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


def export_hf(config, params: dict[str, Any], path: str | Path, *, tokenizer=None,
              prefix: str = "", extra_tensors: dict[str, np.ndarray] | None = None,
              architecture: str | None = None) -> Path:
  """Writes config.json + model.safetensors (+ the tokenizer, if given) for transformers.AutoModel.

  BERT and RoBERTa safetensors also hold an untrained pooler (see `_untrained_pooler`), which `load_hf`
  skips. `prefix` ("roberta.") and `extra_tensors` (a retrieval head under its own names) write the layout
  of a head model, e.g. ANCE's and DRhard's RobertaDot; `architecture` is then config.json's class name.
  """
  from safetensors.numpy import save_file
  path = Path(path)
  if architectures.is_decoder(config):
    from jdr.models import decoder  # pylint: disable=g-import-not-at-top
    tensors = decoder.state_dict_from_params(config, params)
  else:
    tensors = state_dict_from_params(config, params)
  if config.model_type in ("bert", "roberta"):
    tensors.update(_untrained_pooler(config))
  tensors = {prefix + name: value for name, value in tensors.items()}
  tensors.update(extra_tensors or {})
  path.mkdir(parents=True, exist_ok=True)
  hf_config = dict(architectures.config_to_hf(config), dtype="float32")
  if architecture:
    hf_config["architectures"] = [architecture]
  (path / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
  # transformers reads the "format" metadata to know the tensors are in PyTorch layout.
  save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
  if tokenizer is not None:
    tokenizer.save_pretrained(str(path))
  return path


# ---------------------------------------------------------------------------------------------- towers


minilm_path = paths.minilm_path  # the bundled checkpoint; it lives in jdr/runtime/paths.py, below data/ and models/
