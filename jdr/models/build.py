"""Two-tower models from a config, and jdr's own saved-model format.

A jdr model is described by a small JSON-able dict (`describe`): both towers' configs, whether they are
shared, the tokenizer directory and the query / document lengths. It travels with every checkpoint and
export, so `jdr.encode --model DIR` rebuilds exactly the towers that were trained.
"""

import dataclasses
import pathlib
import sys
from typing import Any, NamedTuple

import jax
import ml_collections
import numpy as np

from jdr.runtime import config_files
from jdr.runtime import parallel
from jdr.runtime import hub
from jdr.runtime import paths
from jdr.data import text
from jdr.models import architectures
from jdr.models import cross
from jdr.models import hf
from jdr.models import published
from jdr.models import saved
from jdr.models.bert import EncoderConfig
from jdr.models.towers import TowerConfig, TwoTower

# Architectures for freshly initialised models (model.init_from=""); they use the BERT uncased vocab of the
# bundled MiniLM tokenizer.
FRESH = {
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128),
    "small": dict(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=1024),
    "mini": dict(hidden_size=384, num_layers=6, num_heads=12, intermediate_size=1536),
    "base": dict(hidden_size=768, num_layers=12, num_heads=12, intermediate_size=3072),
}
# Decoder shapes for model.fresh (random weights: tests, runlocal, and sizing a pod before any weights exist).
# The 7B shapes are Llama-2-7B's and Mistral-7B-v0.1's config.json; their vocabularies are fixed, the tiny
# one takes the tokenizer's.
FRESH_DECODERS = {
    "llama-tiny": dict(model_type="llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                       intermediate_size=128),
    "llama-small": dict(model_type="llama", hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4,
                        intermediate_size=688),
    "llama-7b": dict(model_type="llama", vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32,
                     intermediate_size=11008, max_position_embeddings=4096, rms_norm_eps=1e-5),
    "mistral-7b": dict(model_type="mistral", vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32,
                       num_kv_heads=8, intermediate_size=14336, max_position_embeddings=32768,
                       rms_norm_eps=1e-5, sliding_window=4096),
}


class Built(NamedTuple):
  model: TwoTower
  tokenizer: Any
  description: dict  # see `describe`
  tower_params: dict | None  # {"query", "doc"}: published towers' params (encoder, head) to start from, or None
  params: dict | None  # a whole TwoTower param tree (init from a jdr model), or None


def describe(model: TwoTower, tokenizer_path: str, query_max_length: int, doc_max_length: int,
             base_max_length: int | None = None, prompts: dict | None = None, append_eos: bool = False) -> dict:
  """`base_max_length`: the max_seq_length the pretrained checkpoint declares (sentence-transformers), if any;
  a Hugging Face export declares the longer of it and doc_max_length. `prompts`: {"query", "doc"}, the texts
  put before every query and document (E5's "query: " / "passage: ", an instruction). `append_eos`: the
  tokenizer puts its EOS token after every text (jdr.data.text.load_tokenizer)."""
  description = {"query": dataclasses.asdict(model.query), "doc": dataclasses.asdict(model.doc),
                 "shared": model.shared, "tokenizer": tokenizer_path,
                 "query_max_length": query_max_length, "doc_max_length": doc_max_length,
                 "prompts": dict(prompts or published.no_prompts())}
  if base_max_length:
    description["base_max_length"] = int(base_max_length)
  if append_eos:
    description["append_eos"] = True
  return description


def _tower_config(d: dict) -> TowerConfig:
  d = dict(d)
  if d.get("encoder") is not None:
    d["encoder"] = architectures.config_from_saved(d["encoder"])
  return TowerConfig(**d)


def from_description(description: dict):
  """The model a description names: a TwoTower, or a CrossEncoder when architecture is cross_encoder."""
  if description.get("architecture") == "cross_encoder":
    return cross.CrossEncoder(EncoderConfig.from_saved(description["encoder"]))
  return TwoTower(query=_tower_config(description["query"]), doc=_tower_config(description["doc"]),
                  shared=description["shared"])


is_jdr_model = saved.is_jdr_model  # what the loaders ask before reading a path as a jdr model


def load_jdr_model(path: str | pathlib.Path) -> tuple[TwoTower, dict, Any, dict]:
  """(model, params, tokenizer, description) from a jdr export or the latest checkpoint of a workdir."""
  params, description, tokenizer = saved.load(path)
  return from_description(description), params, tokenizer, description


MAX_SERVING_LENGTH = 512


def supported_length(tower: dict | None) -> int:
  """The longest input a tower's encoder takes, capped at 512 (a BoW-MLP tower has no limit of its own)."""
  encoder = (tower or {}).get("encoder")
  limit = architectures.config_from_saved(encoder).max_length if encoder else MAX_SERVING_LENGTH
  return min(limit, MAX_SERVING_LENGTH)


def serving_length(description: dict, side: str) -> tuple[int, str]:
  """(tokens, where that comes from) to serve one side ("query" | "doc") of a saved two-tower model with: the
  length recorded at export, else what the encoder supports (up to 512). Never the training length: a model
  trained on 32-token queries still reads a longer query whole."""
  if f"serve_{side}_max_length" in description:
    return int(description[f"serve_{side}_max_length"]), "the export's serving length"
  return supported_length(description[side]), "what the encoder supports, up to 512"


def build(model_cfg: ml_collections.ConfigDict, data_cfg: ml_collections.ConfigDict) -> Built:
  """The TwoTower (or CrossEncoder) a config asks for, with the pretrained weights it starts from (if any)."""
  init_from = model_cfg.init_from
  if init_from and init_from != "minilm" and not paths.as_path(init_from).exists():
    raise FileNotFoundError(config_files.not_found("model.init_from", init_from,
                                                   model_cfg.get("description") or config_files.MODEL))
  architecture = model_cfg.get("architecture", "two_tower")
  if architecture == "cross_encoder":
    return _cross_encoder(model_cfg, data_cfg)
  if architecture != "two_tower":
    raise ValueError(f"model.architecture must be 'two_tower' or 'cross_encoder', got {architecture!r}")
  if (init_from and saved.is_jdr_model(init_from)
      and saved.description(init_from).get("architecture") == "cross_encoder"):
    raise ValueError(f"model.init_from={init_from} is a cross-encoder; set model.architecture=cross_encoder")
  if init_from and saved.is_jdr_model(init_from):
    if model_cfg.get("doc_init_from", ""):
      raise ValueError(f"model.init_from={init_from} is a jdr model, which holds its document tower already; "
                       "model.doc_init_from pairs two published directories")
    return _from_jdr_model(model_cfg, data_cfg, *load_jdr_model(init_from))
  kind = model_cfg.get("tower", "transformer")
  if kind == "bow_mlp":
    return _bow_mlp(model_cfg, data_cfg)
  if kind != "transformer":
    raise ValueError(f"model.tower must be 'transformer' or 'bow_mlp', got {kind!r}")

  # A decoder checkpoint is read straight into model.param_dtype (a bfloat16 7B never exists in float32 here).
  overrides = {**_encoder_overrides(model_cfg), "param_dtype": param_dtype(model_cfg)}
  doc_init_from = model_cfg.get("doc_init_from", "")
  if doc_init_from and model_cfg.shared:
    raise ValueError(f"model.doc_init_from={doc_init_from} gives the document tower weights of its own: set "
                     "model.shared=False")
  if init_from:
    sides = {"query": _published(init_from, model_cfg, overrides)}
    sides["doc"] = _published(doc_init_from, model_cfg, overrides) if doc_init_from else sides["query"]
    towers_ = {side: with_decoder_settings(_run_tower(model_cfg, pub, side), model_cfg, str(pub.path))
               for side, pub in sides.items()}
    tokenizer_path = (resolve_model(model_cfg.tokenizer) if model_cfg.tokenizer
                      else published.tokenizer_dir(sides["query"], "model.init_from"))
    if doc_init_from and not model_cfg.tokenizer:
      _same_tokenizer(tokenizer_path, published.tokenizer_dir(sides["doc"], "model.doc_init_from"))
    tower_params = {side: pub.params for side, pub in sides.items()}
    prompts = {"query": sides["query"].prompts["query"], "doc": sides["doc"].prompts["doc"]}
    base_max_length = sides["doc"].max_length
  else:
    if doc_init_from:
      raise ValueError("model.doc_init_from needs model.init_from (the query tower's directory)")
    tokenizer_path = model_cfg.tokenizer or str(hf.minilm_path())
    encoder_config = _fresh_encoder_config(model_cfg, tokenizer_path)
    decoder = architectures.is_decoder(encoder_config)
    tower = TowerConfig(encoder=encoder_config, pooling=model_cfg.pooling or ("last" if decoder else "cls"),
                        projection_dim=model_cfg.projection_dim or None, normalize=model_cfg.normalize > 0,
                        projection_norm_eps=published.TORCH_LAYER_NORM_EPS if model_cfg.projection_dim else None)
    tower = with_decoder_settings(tower, model_cfg, f"model.fresh={model_cfg.fresh}")
    towers_ = {"query": tower, "doc": tower}
    tower_params, prompts, base_max_length = None, published.no_prompts(), None
  model = TwoTower(query=towers_["query"], doc=towers_["doc"], shared=model_cfg.shared)
  append_eos = bool(model_cfg.get("append_eos", False))
  description = describe(model, tokenizer_path, data_cfg.query_max_length, data_cfg.doc_max_length,
                         base_max_length, prompts=run_prompts(model_cfg, prompts), append_eos=append_eos)
  return Built(model, text.load_tokenizer(tokenizer_path, append_eos=append_eos), description, tower_params, None)


def _published(name: str, model_cfg: ml_collections.ConfigDict, overrides: dict) -> published.Published:
  """The published directory `name` (a path, a hub id or "minilm") read as a tower, pooled as the run says."""
  path = hf.minilm_path() if name == "minilm" else resolve_model(name)
  with paths.local_copy(path) as local_path:  # a Hugging Face directory on gs:// is read through a copy
    pub = published.read(local_path, pooling=model_cfg.pooling or None, **overrides)
  if not paths.is_local(path):
    pub = dataclasses.replace(pub, path=str(path), tokenizer_path=str(path))
  return pub


# Files that hold a model's weights, for `weight_bytes`.
_WEIGHT_FILES = ("*.safetensors", "*.bin", "*.msgpack", "*.pt", "*.pth", "*.h5", "*.npy", "*.npz")


def weight_bytes(model_cfg: ml_collections.ConfigDict) -> int | None:
  """float32 bytes of the run's starting parameters, told before anything is loaded (so before JAX starts):
  a fresh architecture's from its shape, a directory's from its weight files (a jdr workdir's checkpoints
  included, an over-count), both towers' when the document tower has weights of its own. None where they
  cannot be told (a hub id not downloaded yet, a directory on object storage)."""
  def of(name: str) -> int | None:
    if not name:
      shape = {**FRESH, **FRESH_DECODERS}.get(model_cfg.fresh)
      if shape is None:
        return None
      h, f = shape["hidden_size"], shape["intermediate_size"]
      per_layer = 4 * h * h + (3 if shape.get("model_type") else 2) * h * f
      return 4 * (shape.get("vocab_size", 30522) * h + shape["num_layers"] * per_layer)
    path = pathlib.Path(hf.minilm_path() if name == "minilm" else name)
    if not path.is_dir():
      return None
    patterns = ("*",) if saved.is_jdr_model(str(path)) else _WEIGHT_FILES  # a workdir's checkpoints: every file
    return sum(f.stat().st_size for pattern in patterns for f in path.rglob(pattern) if f.is_file()) or None
  sizes = [of(model_cfg.init_from)]
  if model_cfg.get("doc_init_from", ""):
    sizes.append(of(model_cfg.doc_init_from))
  elif not model_cfg.shared:
    sizes.append(sizes[0])
  return None if None in sizes else sum(sizes)


def resolve_model(name: str) -> str:
  """A model name as a user types it (a path, or a Hugging Face hub id) -> a path to read."""
  return str(hub.resolve(str(name)))


def _run_tower(model_cfg: ml_collections.ConfigDict, pub: published.Published, side: str) -> TowerConfig:
  """The tower a published directory describes, with the run's model.normalize and model.projection_dim."""
  tower = pub.tower
  if model_cfg.normalize >= 0:
    tower = tower.replace(normalize=bool(model_cfg.normalize))
  asked = model_cfg.projection_dim or None
  if tower.projection_dim is None and asked:
    # A fresh jdr head on the published encoder: Dense + LayerNorm as ANCE's, torch's epsilon included.
    tower = tower.replace(projection_dim=asked, projection_norm_eps=published.TORCH_LAYER_NORM_EPS)
  elif asked and asked != tower.projection_dim:
    raise ValueError(f"{pub.path} ({pub.family}) has a {tower.projection_dim}-wide head of its own, but "
                     f"model.projection_dim={asked}; drop the override or start from another checkpoint")
  if pub.side and pub.side != side and model_cfg.shared is False:
    print(f"note: {pub.path} is published as a {pub.side} encoder; it is the {side} tower here",
          file=sys.stderr)
  return tower


def _same_tokenizer(query_dir: str, doc_dir: str) -> None:
  a, b = text.load_tokenizer(query_dir), text.load_tokenizer(doc_dir)
  if a.get_vocab() != b.get_vocab():
    raise ValueError(f"the query tower's tokenizer ({query_dir}) and the document tower's ({doc_dir}) differ; "
                     "two towers of one model read one tokenizer (set model.tokenizer to choose it)")


PROMPT_KEYS = {"query": "query_prompt", "doc": "doc_prompt"}


def run_prompts(model_cfg: ml_collections.ConfigDict, prompts: dict) -> dict:
  """The prompts a run uses: the model's own, each replaced by model.query_prompt / model.doc_prompt unless
  that is "auto" (an empty string means no prompt)."""
  out = dict(prompts)
  for side, key in PROMPT_KEYS.items():
    value = model_cfg.get(key, "auto")
    if value != "auto":
      out[side] = value
  return out


def compute_dtype(name: str) -> str:
  """model.dtype: "float32", "bfloat16", or "auto" = bfloat16 on GPUs and TPUs (their matrix units' fast
  type; parameters, LayerNorm statistics, softmax and the encoder's output stay float32) and float32 on CPUs,
  where bfloat16 has no fast path."""
  if name == "auto":
    return "float32" if parallel.platform() == "cpu" else "bfloat16"
  if name not in ("float32", "bfloat16"):
    raise ValueError(f"model.dtype must be float32, bfloat16 or auto, got {name!r}")
  return name


def _encoder_overrides(model_cfg: ml_collections.ConfigDict) -> dict:
  """What a run's model.* settings change in any encoder it starts from."""
  return dict(dtype=compute_dtype(model_cfg.dtype), remat=model_cfg.remat, hidden_dropout=model_cfg.dropout,
              attention_dropout=attention_dropout(model_cfg), attention=model_cfg.get("attention", "auto"))


def attention_dropout(model_cfg: ml_collections.ConfigDict) -> float:
  """model.attention_dropout, where -1 (the default) means model.dropout."""
  value = model_cfg.get("attention_dropout", -1.0)
  return model_cfg.dropout if value < 0 else value


def _fresh_encoder_config(model_cfg: ml_collections.ConfigDict, tokenizer_path: str):
  """model.fresh's architecture over the tokenizer's vocabulary (a 7B decoder's own), with the run's settings."""
  tokenizer = text.load_tokenizer(model_cfg.tokenizer or tokenizer_path)
  if model_cfg.fresh in FRESH_DECODERS:
    shape = {"vocab_size": len(tokenizer), **FRESH_DECODERS[model_cfg.fresh]}
    if len(tokenizer) > shape["vocab_size"]:
      raise ValueError(f"model.fresh={model_cfg.fresh} has {shape['vocab_size']} token ids, but the tokenizer "
                       f"{model_cfg.tokenizer or tokenizer_path} has {len(tokenizer)}")
    return architectures.decoder_config(**shape, **_encoder_overrides(model_cfg))
  if model_cfg.fresh not in FRESH:
    raise ValueError(f"model.fresh must be one of {sorted(FRESH) + sorted(FRESH_DECODERS)}, got {model_cfg.fresh!r}")
  return EncoderConfig(vocab_size=tokenizer.vocab_size, **FRESH[model_cfg.fresh], **_encoder_overrides(model_cfg))


def lora_fields(model_cfg: ml_collections.ConfigDict) -> dict:
  """model.lora_*: what a decoder encoder's config takes."""
  return dict(lora_rank=int(model_cfg.lora_rank), lora_alpha=float(model_cfg.lora_alpha),
              lora_dropout=float(model_cfg.lora_dropout), lora_targets=model_cfg.lora_targets)


def param_dtype(model_cfg: ml_collections.ConfigDict) -> str:
  """model.param_dtype for a decoder tower: "float32", "bfloat16", or "auto" = bfloat16 for a base that LoRA
  freezes when the run computes in bfloat16 (a 7B base is then 13.5 GB, not 27: nothing updates it, so float32
  storage buys nothing), float32 otherwise (updates of a trained weight would round away in bfloat16)."""
  name = model_cfg.param_dtype
  if name == "auto":
    frozen = int(model_cfg.lora_rank) > 0
    return "bfloat16" if frozen and compute_dtype(model_cfg.dtype) == "bfloat16" else "float32"
  if name not in ("float32", "bfloat16"):
    raise ValueError(f"model.param_dtype must be float32, bfloat16 or auto, got {name!r}")
  return name


def with_decoder_settings(tower: TowerConfig, model_cfg: ml_collections.ConfigDict, source: str) -> TowerConfig:
  """The tower with the run's LoRA settings and model.param_dtype on its decoder encoder; either asked of any
  other tower is refused."""
  fields = lora_fields(model_cfg)
  if tower.encoder is None or not architectures.is_decoder(tower.encoder):
    kind = "BoW-MLP" if tower.encoder is None else type(tower.encoder).__name__
    if fields["lora_rank"]:
      raise ValueError(f"model.lora_rank={fields['lora_rank']}: LoRA adapters are for decoder towers (Llama, "
                       f"Mistral, Qwen2, Qwen3); {source} is a {kind} tower, which trains all its weights "
                       "(set model.lora_rank=0)")
    refuse_param_dtype(model_cfg, f"{source} is a {kind} tower")
    return tower
  return tower.replace(encoder=tower.encoder.replace(**fields, param_dtype=param_dtype(model_cfg)))


def refuse_param_dtype(model_cfg: ml_collections.ConfigDict, what: str) -> None:
  """model.param_dtype=bfloat16 is for decoder towers; other encoders keep float32 weights."""
  if model_cfg.param_dtype == "bfloat16":
    raise ValueError(f"model.param_dtype=bfloat16 stores a decoder tower's weights (Llama, Mistral, Qwen2, "
                     f"Qwen3) in bfloat16; {what}, whose weights stay float32 (set model.param_dtype=auto)")


def _cross_encoder(model_cfg: ml_collections.ConfigDict, data_cfg: ml_collections.ConfigDict) -> Built:
  """A cross-encoder over (query, document) pairs of data.doc_max_length tokens: from a jdr cross-encoder
  workdir or export, a Hugging Face directory / "minilm" (a sequence classifier keeps its head), or fresh."""
  refuse_param_dtype(model_cfg, "a cross-encoder is a BERT-family encoder")
  overrides = _encoder_overrides(model_cfg)
  init_from = model_cfg.init_from
  params = None
  if init_from and saved.is_jdr_model(init_from):
    model, params, _, description = load_jdr_model(init_from)
    if not isinstance(model, cross.CrossEncoder):
      raise ValueError(f"model.init_from={init_from} holds two towers, not a cross-encoder; start from its "
                       "Hugging Face export (jdr.export) to reuse the encoder")
    encoder_config = dataclasses.replace(model.config, **overrides)
    tokenizer_path = description["tokenizer"]
  elif init_from:
    model, params, _ = cross.load_cross_encoder(init_from, with_tokenizer=False, **overrides)
    encoder_config = model.config
    tokenizer_path = str(hf.minilm_path() if init_from == "minilm" else init_from)
  else:
    tokenizer_path = str(hf.minilm_path())
    encoder_config = _fresh_encoder_config(model_cfg, tokenizer_path)
  tokenizer_path = model_cfg.tokenizer or tokenizer_path
  if data_cfg.doc_max_length > encoder_config.max_length:
    raise ValueError(f"data.doc_max_length={data_cfg.doc_max_length} (the pair length of a cross-encoder) "
                     f"exceeds the model's {encoder_config.max_length} positions")
  description = {"architecture": "cross_encoder", "encoder": dataclasses.asdict(encoder_config),
                 "tokenizer": tokenizer_path, "max_length": data_cfg.doc_max_length}
  return Built(cross.CrossEncoder(encoder_config), text.load_tokenizer(tokenizer_path), description, None, params)


def _bow_mlp(model_cfg: ml_collections.ConfigDict, data_cfg: ml_collections.ConfigDict) -> Built:
  """Chang et al.'s BoW-MLP towers, fresh weights, over the (MiniLM) tokenizer's vocabulary."""
  refuse_param_dtype(model_cfg, "model.tower=bow_mlp is a BoW-MLP tower")
  if model_cfg.init_from:
    raise ValueError(f"model.tower=bow_mlp starts from fresh weights or a jdr workdir, not "
                     f"model.init_from={model_cfg.init_from!r}")
  tokenizer_path = model_cfg.tokenizer or str(hf.minilm_path())
  tokenizer = text.load_tokenizer(tokenizer_path)
  normalize = bool(model_cfg.normalize) if model_cfg.normalize >= 0 else False
  tower = TowerConfig(kind="bow_mlp", vocab_size=len(tokenizer), pooling=model_cfg.pooling or "mean",
                      projection_dim=model_cfg.projection_dim or None, normalize=normalize)
  model = TwoTower(query=tower, doc=tower, shared=model_cfg.shared)
  description = describe(model, tokenizer_path, data_cfg.query_max_length, data_cfg.doc_max_length)
  return Built(model, tokenizer, description, None, None)


def with_tower_params(params: dict, tower_params: dict) -> dict:
  """Puts published towers' params ({"query", "doc"}: encoder and any head) into a freshly initialised
  TwoTower param tree; what they lack (a fresh jdr head on a plain encoder) keeps its initial values."""
  params = dict(params)
  for name, side in (("tower", "query"), ("query_tower", "query"), ("doc_tower", "doc")):
    if name in params:
      params[name] = _filled(params[name], tower_params[side])
  return params


def _filled(fresh: Any, given: Any) -> Any:
  """`given` where it has a value, `fresh` below it where it has none (LoRA adapters beside published kernels)."""
  if isinstance(fresh, dict) and isinstance(given, dict):
    return {**fresh, **{k: _filled(fresh[k], v) if k in fresh else v for k, v in given.items()}}
  return given


def _from_jdr_model(model_cfg: ml_collections.ConfigDict, data_cfg: ml_collections.ConfigDict,
                    model: TwoTower, params: dict, tokenizer, description: dict) -> Built:
  """A trained jdr model as the start of a new run, with the run's own model.* settings applied.

  What training may change is taken from the config (dropout, dtype, remat, shared or separate towers,
  the lengths); what the weights fix (pooling, normalization, the head) must match or be left at its
  default, since silently ignoring either would train another model than the one asked for. A shared
  tower split into two starts both towers from it (ADORE: a trainable query tower over a frozen copy).
  """
  towers = {}
  for side in ("query", "doc"):
    tower = getattr(model, side)
    fixed = {"pooling": (model_cfg.pooling, tower.pooling),
             "normalize": (None if model_cfg.normalize < 0 else bool(model_cfg.normalize), tower.normalize),
             "projection_dim": (model_cfg.projection_dim or None, tower.projection_dim)}
    for key, (asked, trained) in fixed.items():
      if asked not in (None, "") and asked != trained:
        raise ValueError(f"model.init_from={model_cfg.init_from}: its {side} tower was trained with "
                         f"{key}={trained!r}, but model.{key}={asked!r}; drop the override or start from "
                         "another checkpoint")
    if tower.encoder is not None:
      tower = tower.replace(encoder=dataclasses.replace(tower.encoder, **_encoder_overrides(model_cfg)))
    towers[side] = with_decoder_settings(tower, model_cfg, f"model.init_from={model_cfg.init_from}")
  if model.shared and not model_cfg.shared:
    # Two owned copies: one buffer in both towers would be donated twice by the train step.
    copy = lambda tree: jax.tree.map(lambda x: np.array(x, copy=True), tree)
    params = {"query_tower": copy(params["tower"]), "doc_tower": copy(params["tower"])}
  elif not model.shared and model_cfg.shared:
    raise ValueError(f"model.init_from={model_cfg.init_from} has separate query and document towers; it "
                     "cannot start a shared-tower run (set model.shared=False)")
  new_model = TwoTower(query=towers["query"], doc=towers["doc"], shared=model_cfg.shared)
  new_description = describe(new_model, description["tokenizer"], data_cfg.query_max_length,
                             data_cfg.doc_max_length, description.get("base_max_length"),
                             prompts=run_prompts(model_cfg, description.get("prompts") or published.no_prompts()),
                             append_eos=bool(description.get("append_eos")))
  if any(_adapters(getattr(model, side)) != _adapters(towers[side]) for side in ("query", "doc")):
    # Other adapters than the saved ones: the saved ones are folded into the weights, and the run's start fresh.
    # (A shared tower split into two is already under query_tower / doc_tower here.)
    key = lambda side: "tower" if "tower" in params else f"{side}_tower"
    tower_params = {side: _merged_tower(params[key(side)], getattr(model, side)) for side in ("query", "doc")}
    return Built(new_model, tokenizer, new_description, tower_params, None)
  return Built(new_model, tokenizer, new_description, None, params)


def _adapters(tower: TowerConfig) -> tuple | None:
  """What of a tower's LoRA decides its adapter params: (rank, targets), None without LoRA."""
  encoder = tower.encoder
  if encoder is None or not architectures.is_decoder(encoder) or not encoder.lora_rank:
    return None
  return encoder.lora_rank, tuple(encoder.lora_targets)


def _merged_tower(params: dict, tower: TowerConfig) -> dict:
  """A saved tower's params with its LoRA adapters (if any) folded into its encoder's kernels."""
  if _adapters(tower) is None:
    return params
  return {**params, "encoder": architectures.merged_lora(params["encoder"], tower.encoder)}
