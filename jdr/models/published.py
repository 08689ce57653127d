"""A model directory as its authors published it -> the tower it describes, read from the directory itself.

What a released dense retriever is, besides its encoder, lives in different places per family; each is read
here into one `Published` (encoder config and weights, pooling, head, normalization, prompts), so every path
that loads a model (training's init_from, jdr.encode / retrieve / mine, ADORE's fixed index) sees the same:

  family                 how it is recognised                         pooling  head                    norm.
  bert/roberta/...       config.json model_type, no head tensors        cls      none                    no
  distilbert/modernbert  config.json model_type                         cls      none                    no
  ance (ANCE, DRhard)    `embeddingHead.*` (+ `norm.*`) tensors         cls      Linear + LayerNorm      no
                         (RobertaDot_NLL_LN, RobertaDot, pyserini's AnceEncoder)
  dpr                    model_type "dpr" (DPRQuestionEncoder /         cls      `encode_proj` if        no
                         DPRContextEncoder; `*_encoder.bert_model.*`)            projection_dim > 0
  sentence-transformers  modules.json: Transformer, Pooling, Dense,     its own  its Dense layer         its own
                         Normalize; prompts in config_sentence_transformers.json

A directory whose tensors fit none of these is refused by `jdr.models.hf.HFWeightsError`, which names the
family the directory looked like and every tensor that did not fit.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from jdr.models import architectures
from jdr.models import hf
from jdr.models import towers
from jdr.models.towers import TowerConfig

# sentence-transformers' prompt names: encode_query reads "query"; encode_document the first of these.
_DOC_PROMPT_NAMES = ("document", "passage", "corpus", "doc")
_POOLING_FLAGS = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                  "pooling_mode_max_tokens": "max", "pooling_mode_lasttoken": "last"}
# torch.nn.LayerNorm's default, which ANCE's and DRhard's `norm` use whatever the encoder's epsilon.
TORCH_LAYER_NORM_EPS = 1e-5
_ACTIVATIONS = {"torch.nn.modules.activation.Tanh": "tanh", "torch.nn.modules.linear.Identity": "identity",
                "torch.nn.Tanh": "tanh", "torch.nn.Identity": "identity"}


@dataclasses.dataclass
class Published:
  path: str
  family: str  # what the directory was read as (FAMILIES' first column)
  tower: TowerConfig  # encoder config, pooling, head, normalization
  params: dict  # Tower params: {"encoder": ...} plus {"projection"[, "projection_norm"]} with a head
  prompts: dict  # {"query": str, "doc": str}: texts put before every query / document
  max_length: int | None  # the max_seq_length a sentence-transformers directory declares
  tokenizer_path: str  # where the tokenizer files are
  side: str | None = None  # "query" / "doc" for an encoder published for one side only (DPR)
  # The widths a Matryoshka model was trained to serve, where its directory says (a jdr export's
  # config_sentence_transformers.json); () = not recorded.
  matryoshka_dims: tuple[int, ...] = ()

  @property
  def encoder(self):
    return self.tower.encoder


def no_prompts() -> dict:
  return {"query": "", "doc": ""}


def _json(path: Path) -> dict:
  try:
    return json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None


def read(path: str | Path, *, pooling: str | None = None, normalize: bool | None = None,
         **overrides) -> Published:
  """The tower a published directory describes. `pooling` / `normalize` replace what it declares;
  `overrides` set encoder config fields config.json does not hold (dtype, remat, dropout...)."""
  path = Path(path)
  if not (path / "config.json").exists() and not (path / "modules.json").exists():
    raise FileNotFoundError(f"{path}: not a model (no config.json): give a Hugging Face model directory or hub "
                            "id, a jdr export or training workdir, or `minilm`")
  if (path / "modules.json").exists():
    published = _sentence_transformers(path, overrides, pooling)
  else:
    published = _transformers(path, _json(path / "config.json"), overrides)
  tower = published.tower
  if pooling:
    tower = tower.replace(pooling=pooling)
  if normalize is not None:
    tower = tower.replace(normalize=bool(normalize))
  return dataclasses.replace(published, tower=tower)


# ---------------------------------------------------------------------------------------------- transformers


def _transformers(path: Path, config: dict, overrides: dict) -> Published:
  """A transformers directory: a base model, a head model built on one, ANCE / DRhard's RobertaDot or DPR."""
  model_type = config.get("model_type", "bert")
  if not architectures.known_hf_type(model_type):
    raise ValueError(f"{path}/config.json: model_type {model_type!r} is not one jdr reads (BERT, RoBERTa, "
                     "XLM-R, DistilBERT, ModernBERT, DPR, and ANCE / DRhard's RobertaDot on RoBERTa)")
  tensors = hf.read_state_dict(path)
  if model_type == "dpr":
    return _dpr(path, config, tensors, overrides)
  encoder = architectures.config_from_hf(config, **overrides)
  head_names = [n for n in tensors if n.split(".")[0] in ("embeddingHead", "norm")]
  if "embeddingHead.weight" in tensors:
    family = "ance"  # ANCE's RobertaDot_NLL_LN, DRhard's RobertaDot, pyserini's AnceEncoder
    rest = {n: t for n, t in tensors.items() if n not in head_names}
    params = {"encoder": hf.params_from_state_dict(encoder, rest, str(path), family="ance (RobertaDot: "
                                                   "an encoder + embeddingHead + norm)")}
    params.update(_linear_head(tensors, "embeddingHead", str(path)))
    has_norm = "norm.weight" in tensors
    if has_norm:
      params["projection_norm"] = {"scale": _f32(tensors["norm.weight"]), "bias": _f32(tensors["norm.bias"])}
    tower = TowerConfig(encoder=encoder, pooling="cls", projection_dim=int(tensors["embeddingHead.weight"].shape[0]),
                        projection_norm=has_norm, projection_norm_eps=TORCH_LAYER_NORM_EPS)
  else:
    family = model_type
    params = {"encoder": hf.params_from_state_dict(encoder, tensors, str(path), family=model_type)}
    # A decoder's summary of a text is at its last token (RepLLaMA, E5-Mistral); an encoder's at [CLS].
    tower = TowerConfig(encoder=encoder, pooling="last" if architectures.is_decoder(encoder) else "cls")
  return Published(str(path), family, tower, params, no_prompts(), None, str(path))


def _dpr(path: Path, config: dict, tensors: dict, overrides: dict) -> Published:
  """DPRQuestionEncoder / DPRContextEncoder: BERT under `question_encoder.bert_model.` (or `ctx_encoder.`),
  [CLS] pooled, then `encode_proj` when config.projection_dim > 0."""
  sides = {"question_encoder": "query", "ctx_encoder": "doc"}
  found = sorted({n.split(".")[0] for n in tensors})
  if len(found) != 1 or found[0] not in sides:
    raise hf.HFWeightsError(str(path), unexpected=[f"{p}.*" for p in found if p not in sides] or
                            ["(a DPR encoder has question_encoder.* or ctx_encoder.* tensors, one of them)"],
                            family="dpr (DPRQuestionEncoder / DPRContextEncoder)")
  prefix = found[0]
  body = f"{prefix}.bert_model."
  encoder = architectures.config_from_hf(config, **overrides)
  rest = {n[len(body):]: t for n, t in tensors.items() if n.startswith(body)}
  rest.update({n: t for n, t in tensors.items() if not n.startswith(body) and not n.startswith(f"{prefix}.encode_proj.")})
  params = {"encoder": hf.params_from_state_dict(encoder, rest, str(path), family=f"dpr ({prefix})")}
  projection = int(config.get("projection_dim") or 0)
  tower = TowerConfig(encoder=encoder, pooling="cls")
  if projection:
    params.update(_linear_head(tensors, f"{prefix}.encode_proj", str(path)))
    tower = tower.replace(projection_dim=projection, projection_norm=False)
  return Published(str(path), "dpr", tower, params, no_prompts(), None, str(path), side=sides[prefix])


def _f32(x) -> np.ndarray:
  return np.ascontiguousarray(np.asarray(x, np.float32))


def _linear_head(tensors: dict, name: str, source: str) -> dict:
  """A torch Linear [out, in] (+ bias) as the tower's "projection" Dense params."""
  if f"{name}.weight" not in tensors:
    raise hf.HFWeightsError(source, missing=[f"{name}.weight"])
  head = {"kernel": _f32(tensors[f"{name}.weight"]).T.copy()}
  if f"{name}.bias" in tensors:
    head["bias"] = _f32(tensors[f"{name}.bias"])
  return {"projection": head}


# ---------------------------------------------------------------------------------------------- sentence-transformers


def _sentence_transformers(path: Path, overrides: dict, pooling: str | None = None) -> Published:
  """A sentence-transformers directory: its modules in order (Transformer, Pooling, [Dense], [Normalize])."""
  modules = _json(path / "modules.json")
  kinds = [m.get("type", "").rsplit(".", 1)[-1] for m in modules]
  supported = ("Transformer", "Pooling", "Dense", "LayerNorm", "Normalize")
  unknown = [m.get("type") for m, k in zip(modules, kinds) if k not in supported]
  if unknown:
    raise ValueError(f"{path}/modules.json: sentence-transformers module(s) {unknown} are not ones jdr applies "
                     f"(it reads {', '.join(supported)})")
  head = [k for k in kinds[2:] if k != "Normalize"]
  if kinds[:2] != ["Transformer", "Pooling"] or head not in ([], ["Dense"], ["Dense", "LayerNorm"]) or (
      "Normalize" in kinds and kinds.index("Normalize") != len(kinds) - 1):
    raise ValueError(f"{path}/modules.json: modules {kinds}: jdr applies Transformer, Pooling, at most one "
                     "Dense (and a LayerNorm after it), then Normalize, in that order")
  by_kind = {k: path / m.get("path", "") for m, k in zip(modules, kinds)}
  inner_dir = by_kind["Transformer"]
  inner = _transformers(inner_dir, _json(inner_dir / "config.json"), overrides)
  # A Transformer folder that also holds ANCE's head tensors (jdr's exports write both layouts): the
  # sentence-transformers modules after it are what sentence-transformers applies, so they decide.
  tower = inner.tower.replace(projection_dim=None, projection_norm=True, projection_norm_eps=None)
  params = {"encoder": inner.params["encoder"]}
  pooling = pooling or _pooling(by_kind["Pooling"] / "config.json")
  tower = tower.replace(pooling=pooling, normalize="Normalize" in kinds)
  if "Dense" in kinds:
    dense, dense_tower = _dense(by_kind["Dense"])
    tower = tower.replace(**dense_tower)
    params["projection"] = dense
  if "LayerNorm" in kinds:
    norm = hf.read_state_dict(by_kind["LayerNorm"])
    if sorted(norm) != ["norm.bias", "norm.weight"]:
      raise hf.HFWeightsError(str(by_kind["LayerNorm"]), missing=sorted({"norm.weight", "norm.bias"} - set(norm)),
                              unexpected=sorted(set(norm) - {"norm.weight", "norm.bias"}),
                              family="sentence-transformers LayerNorm")
    params["projection_norm"] = {"scale": _f32(norm["norm.weight"]), "bias": _f32(norm["norm.bias"])}
    tower = tower.replace(projection_norm=True, projection_norm_eps=TORCH_LAYER_NORM_EPS)
  settings = {}
  for name in ("sentence_bert_config.json",):
    if (inner_dir / name).exists():
      settings = _json(inner_dir / name)
  max_length = int(settings["max_seq_length"]) if settings.get("max_seq_length") else None
  config = _json(path / "config_sentence_transformers.json") if (
      path / "config_sentence_transformers.json").exists() else {}
  # A saved truncate_dim is the width sentence-transformers serves the model at, so jdr serves it there too
  # (re-normalized where the model normalizes: the same ranking as sentence-transformers' cosine).
  if config.get("truncate_dim"):
    tower = tower.replace(truncate_dim=int(config["truncate_dim"]))
  return Published(str(path), "sentence-transformers", tower, params, _prompts(path), max_length, str(inner_dir),
                   matryoshka_dims=tuple(int(d) for d in config.get("matryoshka_dims") or ()))


def _pooling(config_file: Path) -> str:
  """A Pooling module's mode: sentence-transformers 6 writes `pooling_mode` ("mean"), earlier versions one
  boolean `pooling_mode_*` flag per mode."""
  config = _json(config_file)
  if config.get("include_prompt") is False:
    raise ValueError(f"{config_file}: include_prompt false (the prompt's tokens left out of the pooling) is not "
                     "something jdr applies")
  if isinstance(config.get("pooling_mode"), str):
    enabled = [config["pooling_mode"]]
    mode = {"cls": "cls", "cls_token": "cls", "mean": "mean", "mean_tokens": "mean", "max": "max",
            "max_tokens": "max", "lasttoken": "last"}.get(enabled[0])
  else:
    enabled = [k for k, v in config.items() if k.startswith("pooling_mode") and v]
    mode = _POOLING_FLAGS.get(enabled[0]) if len(enabled) == 1 else None
  if mode:
    return mode
  raise UnsupportedPooling(f"{config_file}: pooling {enabled}, which jdr does not implement (it pools with one "
                           "of cls, mean, max, lasttoken); set the pooling explicitly (model.pooling / --pooling)")


class UnsupportedPooling(ValueError):
  """A sentence-transformers Pooling config with a mode jdr lacks (mean_sqrt_len, several concatenated)."""


def _dense(folder: Path) -> tuple[dict, dict]:
  """A sentence-transformers Dense module -> (projection params, TowerConfig head fields)."""
  config = _json(folder / "config.json")
  activation = config.get("activation_function", "torch.nn.modules.activation.Tanh")
  if activation not in _ACTIVATIONS:
    raise ValueError(f"{folder}/config.json: Dense activation {activation!r} is not one jdr applies "
                     f"({', '.join(sorted(set(_ACTIVATIONS.values())))})")
  tensors = hf.read_state_dict(folder)
  unexpected = sorted(set(tensors) - {"linear.weight", "linear.bias"})
  if unexpected or "linear.weight" not in tensors:
    raise hf.HFWeightsError(str(folder), missing=[] if "linear.weight" in tensors else ["linear.weight"],
                            unexpected=unexpected, family="sentence-transformers Dense")
  head = _linear_head(tensors, "linear", str(folder))["projection"]
  out, inp = tensors["linear.weight"].shape
  if int(config.get("out_features", out)) != out or int(config.get("in_features", inp)) != inp:
    raise hf.HFWeightsError(str(folder), mismatched=[("linear.weight", (out, inp),
                                                      (config.get("out_features"), config.get("in_features")))],
                            family="sentence-transformers Dense")
  fields = dict(projection_dim=int(out), projection_activation=_ACTIVATIONS[activation],
                projection_bias="linear.bias" in tensors, projection_norm=False)
  return head, fields


def _prompts(path: Path) -> dict:
  """The query and document prompts a sentence-transformers directory declares ({"query": "", ...} if none)."""
  prompts = no_prompts()
  config_file = path / "config_sentence_transformers.json"
  if not config_file.exists():
    return prompts
  config = _json(config_file)
  declared = config.get("prompts") or {}
  default = declared.get(config.get("default_prompt_name") or "", "")
  prompts["query"] = declared.get("query", default)
  prompts["doc"] = next((declared[n] for n in _DOC_PROMPT_NAMES if n in declared), default)
  return prompts


# ---------------------------------------------------------------------------------------------- one tower


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "spiece.model",
                    "sentencepiece.bpe.model")


ROBERTA_BASE_TOKENIZER = "FacebookAI/roberta-base"


def tokenizer_dir(pub: Published, key: str) -> str:
  """Where a published model's tokenizer is. DRhard's and ANCE's released folders hold none (their code loads
  roberta-base's): a RoBERTa of roberta-base's vocabulary without one reads roberta-base's, through the
  Hugging Face cache, saying so; anything else without one is one line naming the remedy."""
  import sys  # pylint: disable=g-import-not-at-top
  from jdr.runtime import hub  # pylint: disable=g-import-not-at-top
  from jdr.runtime import paths  # pylint: disable=g-import-not-at-top
  where = paths.as_path(pub.tokenizer_path)
  if any((where / name).exists() for name in _TOKENIZER_FILES):
    return pub.tokenizer_path
  remedy = "copy a tokenizer's files into it, or set model.tokenizer"
  if pub.encoder.model_type == "roberta" and pub.encoder.vocab_size == 50265:
    try:
      found = hub.resolve(ROBERTA_BASE_TOKENIZER)
      print(f"{pub.path}: no tokenizer files; reading {ROBERTA_BASE_TOKENIZER}'s, as the authors' code does",
            file=sys.stderr)
      return found
    except FileNotFoundError as e:
      remedy = f"{ROBERTA_BASE_TOKENIZER}'s, which its authors' code loads, is not at hand: {e}"
  raise FileNotFoundError(f"{key}={pub.path}: no tokenizer files in {where} (DRhard's and ANCE's released "
                          f"checkpoints have none); {remedy}")


def load_tower(model: str, pooling: str | None = None, normalize: bool | None = None,
               max_length: int | None = None, dtype: str = "float32", dim: int | None = None):
  """A ready-to-encode tower from a published directory or "minilm" -> (Tower, params, tokenizer, info).

  Pooling, head, normalisation, prompts and max_length are the directory's own (MiniLM: mean, normalized,
  256), else CLS pooling, no normalisation and the model's maximum length; `pooling` / `normalize` /
  `max_length` replace them; `dim` serves the first `dim` dimensions (a Matryoshka model's; within the widths
  a directory records it was trained at). `params` is the Tower's param tree as device arrays:
  `tower.apply({"params": params}, ids, mask)`. info["prompts"] holds the query and document prompts.
  """
  import jax  # pylint: disable=g-import-not-at-top
  from jdr.data import text  # pylint: disable=g-import-not-at-top
  from jdr.models.towers import Tower  # pylint: disable=g-import-not-at-top
  path = hf.minilm_path() if model == "minilm" else Path(model)
  published = read(path, pooling=pooling, normalize=normalize, dtype=dtype)
  cfg = published.encoder
  tokenizer = text.load_tokenizer(tokenizer_dir(published, "--model"))
  source = "--max-length"
  if max_length is None:
    source = "the sentence-transformers config" if published.max_length else "what the model supports"
    max_length = published.max_length or min(int(tokenizer.model_max_length), cfg.max_length)
  if max_length > cfg.max_length:
    raise ValueError(f"max_length {max_length} exceeds the model's {cfg.max_length} positions")
  tower = published.tower
  if dim is not None:
    tower = towers.truncated(tower, dim, published.matryoshka_dims, str(path))
  info = {"path": str(path), "model_type": cfg.model_type, "family": published.family, "pooling": tower.pooling,
          "normalize": tower.normalize, "max_length": max_length, "max_length_from": source, "dim": tower.dim,
          "dtype": dtype, "prompts": dict(published.prompts)}  # JSON-able; tower.config has the rest
  if published.side:
    info["side"] = published.side
  return Tower(tower), jax.device_put(published.params), tokenizer, info
