"""Loading recipe files (`configs/X.py[:arg]`), their typed arguments, and `--config.key=value` overrides.

A recipe is a Python file whose `get_config(arg)` returns a ConfigDict; it reads `arg` ("runlocal,seed=1")
with `parse_arg`, declaring each argument it takes with its default. Arguments and overrides are typed by
the value they replace, and an unknown name is an error that lists the valid ones, so a typo never
silently trains the default; a renamed key is refused under its old name with the new one (settings.RENAMED).

A recipe names its inputs (data.dataset, model.init_from, distill.teacher) with what they should hold
(data.description, model.description); `check_inputs` refuses a run whose input is not there in one line that
says which key to set, so nothing is substituted for a missing folder.
"""

import ast
import difflib
import importlib.util
import pathlib
import re
import sys
from typing import Sequence

import ml_collections

from jdr.runtime import hub
from jdr.runtime import paths
from jdr.runtime import settings


class ConfigError(ValueError):
  pass


# What each input key holds, for the refusal when a recipe leaves data.description / model.description empty.
DATASET = ("a BEIR directory (corpus.jsonl, queries.jsonl, qrels/SPLIT.tsv) or MS MARCO's own files (collection.tsv, "
           "queries.SPLIT.tsv, qrels.SPLIT.tsv)")
ARTICLES = "a MediaWiki XML dump: .xml, .xml.bz2 or .xml.gz"
MODEL = "a Hugging Face model directory, a jdr workdir or export, or minilm"
TEACHER = "a cross-encoder: configs/cross_encoder.py's workdir or export, or a Hugging Face directory"


def not_found(key: str, value: str, what: str, kind: str = "directory") -> str:
  """The one line a missing input is refused with: the key, its value, the override to set and what it holds.

    data.dataset=data/msmarco-passage: directory not found; set --config.data.dataset=DIR (MS MARCO ...)
  """
  placeholder = "FILE" if kind == "file" else "DIR"
  return f"{key}={value}: {kind} not found; set --config.{key}={placeholder} ({what})"


def check_inputs(config: ml_collections.ConfigDict) -> None:
  """Refuses a run whose dataset, starting model or teacher is not where the config names it: a ConfigError
  whose text is `not_found`'s one line, for the first missing one. A negatives source's own files are its
  check's (jdr.negatives.sources.check).

  Only existence is checked (a stat per path), so this runs before a workdir, a device or a file is touched;
  what is inside is checked by the loaders. Names that are not paths ("builtin", "minilm", "" for fresh
  weights or no teacher) pass.
  """
  data, model = config.data, config.model
  data_what = data.description
  if data.kind == "pretrain":
    source = data.pretrain_source
    if source not in ("wikispeedia", "builtin") and not paths.as_path(source).is_file():
      raise ConfigError(not_found("data.pretrain_source", source, data_what or ARTICLES, kind="file"))
    if source == "wikispeedia" and data.dataset not in ("", "builtin") and not paths.as_path(data.dataset).is_dir():
      raise ConfigError(not_found("data.dataset", data.dataset, data_what or "the Wikispeedia directory"))
  elif data.dataset != "builtin" and not paths.as_path(data.dataset).is_dir():
    raise ConfigError(not_found("data.dataset", data.dataset, data_what or DATASET))
  for key, name in (("model.init_from", model.init_from), ("model.doc_init_from", model.get("doc_init_from", ""))):
    if name in ("", "minilm") or paths.as_path(name).exists():
      continue
    if hub.looks_like_hub_id(name):
      try:
        hub.resolve(name)  # downloads now, or says in one line why it cannot, before any work
        continue
      except FileNotFoundError as e:
        # A recipe's local default (models/roberta-base) reads as a hub id too: both readings, one line.
        raise ConfigError(f"{not_found(key, name, model.description or MODEL)}; as a Hugging Face hub id, "
                          f"{str(e).removeprefix(name + ': ')}") from None
    raise ConfigError(not_found(key, name, model.description or MODEL))
  teacher = config.distill.teacher
  if teacher not in ("", "minilm", "mined") and not paths.as_path(teacher).exists():
    raise ConfigError(not_found("distill.teacher", teacher, TEACHER))


def load_config_file(spec: str) -> ml_collections.ConfigDict:
  """Loads `path/to/recipe.py[:arg]` and returns its locked ConfigDict."""
  path_str, _, arg = spec.partition(":")
  path = pathlib.Path(path_str)
  if not path.is_file():
    raise ConfigError(f"{path}: config file not found")
  # Recipes import `base` from their own folder.
  folder = str(path.resolve().parent)
  if folder not in sys.path:
    sys.path.insert(0, folder)
  module_spec = importlib.util.spec_from_file_location(f"jdr_recipe_{path.stem}", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  if not hasattr(module, "get_config"):
    raise ConfigError(f"{path}: has no get_config(arg) function")
  try:
    config = module.get_config(arg or None)
  except ConfigError as e:
    raise ConfigError(f"{path}: {e}") from None
  except TypeError as e:
    # A recipe setting an old key that is a group's name now (negatives.guide = "self"): ml_collections refuses
    # the string in the group's place.
    field = re.match(r"Could not override field '(\w+)'", str(e))
    if field and settings.renamed(f"negatives.{field.group(1)}"):
      raise ConfigError(f"{path}: {settings.renamed('negatives.' + field.group(1))}") from None
    raise
  try:
    settings.check_renamed(config)
  except ValueError as e:
    raise ConfigError(f"{path}: {e}") from None
  config.lock()
  return config


def parse_arg(arg: str | None, **spec) -> ml_collections.ConfigDict:
  """A recipe's argument string as a locked ConfigDict of the arguments the recipe declares (the shape of
  big_vision's `parse_arg`): `spec` maps each name to its default, whose type types the value.

    parse_arg("runlocal,seed=1,metric=ndcg", runlocal=False, seed=0, metric="mrr")
      -> runlocal=True, seed=1, metric="ndcg"

  A bare name sets a boolean argument to True; any argument takes `name=value`. A name the recipe does not
  declare, a bare name of a non-boolean or a value of the wrong type is a ConfigError that lists what the
  recipe takes.
  """
  values = dict(spec)
  for item in (arg or "").split(","):
    name, sep, text = (part.strip() for part in item.partition("="))
    if not name and not sep:
      continue
    if name not in spec:
      close = difflib.get_close_matches(name, list(spec), n=1)
      hint = f" (did you mean {close[0]}?)" if close else ""
      raise ConfigError(f"unknown recipe argument {name!r}{hint}; this recipe takes {describe_args(spec)}")
    if not sep and not isinstance(spec[name], bool):
      raise ConfigError(f"recipe argument {name!r} needs a value ({name}=...); this recipe takes "
                        f"{describe_args(spec)}")
    try:
      values[name] = _parse_value(text, spec[name]) if sep else True
    except (ValueError, SyntaxError) as e:
      raise ConfigError(f"recipe argument {name!r}: cannot use {text!r} ({e})") from None
  out = ml_collections.ConfigDict(values)
  out.lock()
  return out


def describe_args(spec: dict) -> str:
  """"runlocal (bool, default False), seed (int, default 0)": what a recipe takes, for error messages."""
  if not spec:
    return "no arguments"
  return ", ".join(f"{name} ({type(default).__name__}, default {default!r})" for name, default in spec.items())


def all_keys(config: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
  keys = []
  for key, value in config.items():
    if isinstance(value, ml_collections.ConfigDict):
      keys.extend(all_keys(value, f"{prefix}{key}."))
    else:
      keys.append(prefix + key)
  return keys


def _parse_value(text: str, old):
  """Parses `text` to the type of the value it replaces."""
  if isinstance(old, bool):
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
      return True
    if lowered in ("0", "false", "no", "off"):
      return False
    raise ValueError(f"expected a boolean, got {text!r}")
  if isinstance(old, int):
    return int(text)
  if isinstance(old, float):
    return float(text)
  if isinstance(old, str):
    return text
  if isinstance(old, (tuple, list)):
    value = ast.literal_eval(text)
    if not isinstance(value, (tuple, list)):
      value = (value,)
    return type(old)(value)
  return ast.literal_eval(text)


def apply_overrides(config: ml_collections.ConfigDict, overrides: Sequence[str]) -> None:
  """Applies `key=value` pairs (keys dotted, e.g. `optimizer.learning_rate=1e-5`) in place."""
  valid = all_keys(config)
  for item in overrides:
    key, sep, text = item.partition("=")
    if not sep:
      raise ConfigError(f"override {item!r} must look like --config.KEY=VALUE")
    if key not in valid and settings.renamed(key):
      raise ConfigError(settings.renamed(key))
    if key not in valid:
      close = difflib.get_close_matches(key, valid, n=3)
      hint = f" Did you mean {', '.join(close)}?" if close else ""
      raise ConfigError(f"unknown config key {key!r}.{hint} Valid keys: {', '.join(sorted(valid))}")
    *parents, leaf = key.split(".")
    node = config
    for parent in parents:
      node = node[parent]
    try:
      value = _parse_value(text, node[leaf])
    except (ValueError, SyntaxError) as e:
      raise ConfigError(f"config key {key!r}: cannot use {text!r} ({e})") from None
    node[leaf] = value  # a locked ConfigDict still takes new values for existing keys


def split_config_args(argv: Sequence[str]) -> tuple[list[str], list[str]]:
  """Separates `--config.KEY=VALUE` / `--config.KEY VALUE` overrides from the other arguments."""
  rest, overrides = [], []
  argv = list(argv)
  i = 0
  while i < len(argv):
    arg = argv[i]
    if arg.startswith("--config."):
      body = arg[len("--config."):]
      if "=" not in body:
        if i + 1 >= len(argv):
          raise ConfigError(f"{arg} needs a value")
        body = f"{body}={argv[i + 1]}"
        i += 1
      overrides.append(body)
    else:
      rest.append(arg)
    i += 1
  return rest, overrides
