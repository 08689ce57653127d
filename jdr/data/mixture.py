"""Several training datasets in one run (`data.mixture`), as E5, BGE, Nomic and sentence-transformers train
general-purpose retrievers: each step's batch comes from ONE dataset, so its in-batch negatives are of one kind
(FlagEmbedding's `same_dataset_within_batch`), and each dataset keeps its own negatives, in-batch choice, query
prompt and training split.

    data.mixture = "data/scifact:weight=2,negatives=bm25;data/nq:split=dev,in_batch=0,prompt='query: '"

Still a pure function of (seed, step), as pairs.Batches is: the dataset of step s comes from a counter-based
draw (`Schedule`), and that dataset's own batch index is the number of earlier steps that drew it, so a resumed
run at step s builds exactly the batch an uninterrupted one would, with no sampler state to checkpoint.

Every dataset's batches have the same shape (batch_size, negatives.per_query, lengths), so one jitted step serves
them all: a dataset trained without sampled negatives fills the columns of the others' with invalid ones
(pairs.Batches' `padding_per_query`), never a second compilation.

The run's keys in a mixture: data.train_split, data.source, negatives.source, negatives.in_batch and the fixed-pool
sources' files (negatives.mined.file, static.run, triples.file) are each dataset's defaults, which its options
replace (the run's own must make a valid run: `jdr.negatives.sources.check` reads them); batch_size,
negatives.per_query, the lengths and everything else are shared. data.dataset is not read (leave it `builtin`,
or the first entry's). The evaluation is the first dataset's `data.eval_split`, with the model's own prompts, as
a plain run's.
Refused: pretraining, a cross-encoder, distillation, a guide model, and the negative sources that mine or
retrieve over one corpus (dense_static, ance, retrieval).
"""

import dataclasses
import difflib
import math
import pathlib
import re
import sys
from collections.abc import Callable, Collection, Sequence

import ml_collections
import numpy as np

from jdr.data import pairs
from jdr.runtime import config_files
from jdr.runtime import paths

SAMPLINGS = ("proportional", "round_robin")

# An entry's options: name -> what it sets and means. The run's value is the default of each.
OPTIONS = {
    "weight": "a number > 0: the dataset's share of the steps is weight / the sum of the weights (default 1)",
    "negatives": "negatives.source of this dataset: none (in-batch only) | random | bm25 | ... ('' = the run's)",
    "in_batch": "1 / 0: the batch's other documents are negatives too (default: negatives.in_batch)",
    "prompt": "the text put before this dataset's queries ('' = the model's own query prompt)",
    "split": "the qrels split trained on (default: data.train_split)",
    "source": "files | tfds: how the directory is read (default: data.source)",
    "mined": "negatives.mined.file for this dataset (source mined: a jdr.mine directory or a training file)",
    "static_run": "negatives.static.run for this dataset (source static: a TREC run)",
    "triples_file": "negatives.triples.file for this dataset (source triples)",
    "name": "the dataset's name in the logs, train/mixture/NAME (default: the directory's name)",
}

# The options naming a source's file: option -> (its source, the group and key it sets under `negatives`).
FILE_OPTIONS = {"mined": ("mined", "mined", "file"), "static_run": ("static", "static", "run"),
                "triples_file": ("triples", "triples", "file")}

_OPTIONS_START = re.compile(r":(?=\s*[A-Za-z_]\w*\s*=)")  # the ':' before the first key=value (not gs://)
_KEY = re.compile(r"\s*([A-Za-z_]\w*)\s*=\s*")
_PLAIN_VALUE = re.compile(r"[^,;]*")
_NAME = re.compile(r"[\w.+-]+")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_DRAW_TAG = 4  # the schedule's numpy streams are [seed, block, 4]; pairs.Batches uses tags 1 to 3


@dataclasses.dataclass
class Entry:
  """One dataset of a mixture, as written; `plan` fills `config` (the run as this dataset sees it) and
  `padding_per_query`."""
  dataset: str
  text: str  # the entry as written, for errors
  weight: float = 1.0
  negatives: str = ""
  in_batch: bool | None = None
  prompt: str = ""
  split: str = ""
  source: str = ""
  mined: str = ""
  static_run: str = ""
  triples_file: str = ""
  name: str = ""
  config: ml_collections.ConfigDict | None = None
  padding_per_query: int = 0  # invalid columns a query, where this dataset samples no negatives and others do

  def prompts(self, model_prompts: dict | None) -> dict | None:
    """The prompts this dataset's batches are tokenized with: the model's, the query's replaced by `prompt`."""
    if not self.prompt:
      return model_prompts
    return {**(model_prompts or {}), "query": self.prompt}


class MixtureError(ValueError):
  """A bad `data.mixture`: one line naming the entry and the reason."""


def _error(number: int, text: str, reason: str) -> MixtureError:
  return MixtureError(f"data.mixture entry {number} ({text.strip()!r}): {reason}")


def parse(text: str) -> list[Entry]:
  """The entries of a `data.mixture` string; "" (or only blanks) = no mixture.

  Grammar: entries separated by ';', each DATASET or DATASET:key=value,key=value,...

    DATASET  a directory jdr reads (BEIR, MS MARCO's files, a TFDS-prepared one) or "builtin"; it ends at the
             first ':' followed by key=, so "gs://bucket/dir" is one dataset
    key      one of OPTIONS (weight, negatives, in_batch, prompt, split, source, mined, static_run,
             triples_file, name); each at most once
    value    up to the next ',' or ';', blanks around it dropped; or quoted with ' or " to hold ',', ';', ':'
             or blanks (prompt='query: '), the quote itself not included (no escapes: a value holding one
             kind of quote is quoted with the other)

  A string on the command line and in a config file alike (ml_collections overrides take it verbatim), where a
  list of ConfigDicts would need a type of its own in every recipe. Each problem is a MixtureError naming the
  entry (its number, from 1, and its text) and the reason, raised before any data is read."""
  entries, i, n, number = [], 0, len(text), 0
  while i < n:
    start, number = i, number + 1
    semi = text.find(";", i)
    options_at = _OPTIONS_START.search(text, i, semi if semi >= 0 else n)
    end = options_at.start() if options_at else (semi if semi >= 0 else n)
    dataset, options = text[i:end].strip(), []
    i = end
    if options_at:
      i = options_at.end()
      while True:
        key = _KEY.match(text, i)
        if not key:
          raise _error(number, _up_to_next(text, start), f"expected key=value at {text[i:i + 20]!r}")
        i = key.end()
        if i < n and text[i] in "'\"":
          close = text.find(text[i], i + 1)
          if close < 0:
            raise _error(number, text[start:], f"{key.group(1)}: the quote {text[i]} is never closed")
          value, i = text[i + 1:close], close + 1
          while i < n and text[i].isspace():
            i += 1
          if i < n and text[i] not in ",;":
            raise _error(number, _up_to_next(text, start), f"{key.group(1)}: expected ',' or ';' after the quoted "
                                                         f"value, got {text[i:i + 20]!r}")
        else:
          plain = _PLAIN_VALUE.match(text, i)
          value, i = plain.group().strip(), plain.end()
        options.append((key.group(1), value))
        if i < n and text[i] == ",":
          i += 1
          continue
        break
    entry_text = text[start:i]
    if i < n:  # at a ';'
      i += 1
    if not dataset and not options:
      if entry_text.strip():
        raise _error(number, entry_text, "no dataset")
      number -= 1  # blanks between separators, or a trailing ';'
      continue
    entries.append(_entry(number, entry_text, dataset, options))
  return entries


def _up_to_next(text: str, start: int) -> str:
  """The text of the entry at `start`, for an error found inside it: up to the next ';' (or the end)."""
  semi = text.find(";", start)
  return text[start:semi if semi >= 0 else len(text)]


def _entry(number: int, text: str, dataset: str, options: list[tuple[str, str]]) -> Entry:
  if not dataset:
    raise _error(number, text, "no dataset before the ':' (DATASET:key=value,...)")
  if ":" in dataset.replace("://", ""):
    raise _error(number, text, "the ':' after the dataset starts its options: expected key=value after it")
  entry = Entry(dataset=dataset, text=text)
  seen = set()
  for key, value in options:
    if key not in OPTIONS:
      close = difflib.get_close_matches(key, list(OPTIONS), n=1)
      hint = f" (did you mean {close[0]}?)" if close else ""
      raise _error(number, text, f"unknown option {key!r}{hint}; options: {', '.join(OPTIONS)}")
    if key in seen:
      raise _error(number, text, f"{key} is given twice")
    seen.add(key)
    if key == "weight":
      try:
        weight = float(value)
      except ValueError:
        raise _error(number, text, f"weight={value!r} is not a number") from None
      if not (math.isfinite(weight) and weight > 0):
        raise _error(number, text, f"weight={value!r}: must be a finite number > 0")
      entry.weight = weight
    elif key == "in_batch":
      if value.lower() not in _TRUE + _FALSE:
        raise _error(number, text, f"in_batch={value!r}: expected 1 or 0 (true / false, on / off)")
      entry.in_batch = value.lower() in _TRUE
    elif key == "source" and value not in ("", "files", "tfds"):
      raise _error(number, text, f"source={value!r}: expected files or tfds")
    else:
      setattr(entry, key, value)
  entry.name = entry.name or pathlib.PurePosixPath(dataset.rstrip("/")).name or dataset
  if not _NAME.fullmatch(entry.name):
    raise _error(number, text, f"name {entry.name!r}: the logs' key train/mixture/NAME takes letters, digits and "
                               "._+- only; set name=...")
  return entry


def plan(config: ml_collections.ConfigDict, samplers: Collection[str],
         check_negatives: Callable[[ml_collections.ConfigDict], None]) -> list[Entry]:
  """`config.data.mixture`'s entries, each with `config`: the run as that dataset sees it (its directory, split,
  negatives, in-batch choice, and `seed + its index`, so two datasets never share an order); [] = no mixture.

  Everything a mixture cannot run with is refused here, one line naming the entry and the reason, before any
  data is read (a directory or file is only looked for). `samplers` are the negatives.source names a dataset may take (those sampled on the
  host from fixed pools, jdr.negatives.sources.SAMPLERS: the others mine or retrieve over one corpus);
  `check_negatives` is the negatives' own check (jdr.negatives.sources.check), run on each dataset's config.

  The run's evaluation is the first dataset's `data.eval_split` (the others read no evaluation split)."""
  entries = parse(config.data.mixture)
  if not entries:
    return []
  sampling = config.data.mixture_sampling
  if sampling not in SAMPLINGS:
    raise MixtureError(f"data.mixture_sampling must be one of {', '.join(SAMPLINGS)}; got {sampling!r}")
  for refused, why in (
      (config.data.kind != "pairs", f"data.kind={config.data.kind!r}: a mixture mixes supervised pair datasets"),
      (config.model.get("architecture", "two_tower") != "two_tower",
       "model.architecture=cross_encoder: a mixture trains two towers"),
      (bool(config.distill.teacher), "distill.teacher: the teacher scores one dataset's candidates"),
      (config.negatives.guide.model not in ("", "self"),
       "negatives.guide.model: a guide model masks one dataset's batches (negatives.guide.model=self works)"),
      (config.data.dataset not in ("builtin", entries[0].dataset),
       f"data.dataset={config.data.dataset} would not be read: a mixture names every dataset (the first is "
       "evaluated); put it in data.mixture and leave data.dataset=builtin")):
    if refused:
      raise MixtureError(f"data.mixture: {why}")
  names = {}
  for number, entry in enumerate(entries, 1):
    if entry.name in names:
      raise _error(number, entry.text, f"the name {entry.name!r} is entry {names[entry.name]}'s too; set name=...")
    names[entry.name] = number
    entry.config = _entry_config(config, entry, number - 1)
    source = entry.config.negatives.source
    if source not in samplers:
      raise _error(number, entry.text, f"negatives={source!r}: a mixture's datasets take the sources sampled from "
                                       f"fixed pools ({' | '.join(samplers)}); the others mine or retrieve over "
                                       "one corpus")
    if source == "none":
      if not entry.config.negatives.in_batch:
        raise _error(number, entry.text, "in_batch=0 with no negatives source leaves each query nothing to score "
                                         "its positive against; set negatives=... or in_batch=1")
      entry.padding_per_query = config.negatives.per_query
    for option in ("mined", "static_run"):  # (triples have a default: the dataset's own file)
      needs, group, key = FILE_OPTIONS[option]
      if source == needs and not entry.config.negatives[group][key]:  # else refused only once the data is read
        raise _error(number, entry.text, f"negatives={source} needs its file: {option}=... (or "
                                         f"negatives.{group}.{key})")
    if entry.dataset != "builtin" and not paths.as_path(entry.dataset).is_dir():
      raise _error(number, entry.text, f"{entry.dataset}: directory not found ({config_files.DATASET})")
    try:
      config_files.check_inputs(entry.config)
      check_negatives(entry.config)  # its own negatives, their mined / triples files too
    except ValueError as e:
      raise _error(number, entry.text, str(e)) from None
  return entries


def _entry_config(config: ml_collections.ConfigDict, entry: Entry, index: int) -> ml_collections.ConfigDict:
  out = config.copy_and_resolve_references()
  out.data.mixture = ""
  out.data.dataset = entry.dataset
  out.data.train_split = entry.split or config.data.train_split
  out.data.eval_split = config.data.eval_split if index == 0 else ""
  out.data.source = entry.source or config.data.source
  out.seed = config.seed + index
  neg = out.negatives
  neg.source = entry.negatives or config.negatives.source
  if entry.in_batch is not None:
    neg.in_batch = entry.in_batch
  if neg.source == "none":
    neg.per_query = 0  # filled with invalid columns instead (`padding_per_query`)
  for option, (_, group, key) in FILE_OPTIONS.items():
    if neg.source != config.negatives.source:  # the run's files are its own source's
      neg[group][key] = ""
    if getattr(entry, option):
      neg[group][key] = getattr(entry, option)
  return out


class Schedule:
  """Which dataset each step draws, and how many earlier steps drew each: a pure function of (seed, step).

  proportional: step s draws dataset i with probability weight_i / sum(weights), independently. Steps are
    drawn a block of BLOCK at a time by numpy's Generator seeded [seed, block, 4]: the uniforms
    `random(BLOCK)` mapped through the normalized cumulative weights (`cdf.searchsorted(u, side="right")`,
    what `Generator.choice(k, p=...)` does).
  round_robin: deterministic; step s goes to the dataset furthest behind its share, the largest
    (s + 1) * weight_i / sum(weights) - count_i (ties to the first), so after n steps each dataset has had
    its share to within one step; equal weights cycle 0, 1, ..., k - 1.

  The count of each dataset at every block's start is kept (k integers a block), so a resumed run finds its
  position by drawing the earlier blocks once, never by replaying batches."""

  BLOCK = 1024

  def __init__(self, weights: Sequence[float], sampling: str, seed: int):
    if sampling not in SAMPLINGS:
      raise ValueError(f"sampling must be one of {', '.join(SAMPLINGS)}; got {sampling!r}")
    weights = np.asarray(weights, np.float64)
    if weights.ndim != 1 or not len(weights) or not np.all(np.isfinite(weights)) or np.any(weights <= 0):
      raise ValueError(f"weights must be finite numbers > 0, got {weights.tolist()}")
    self.weights, self.sampling, self.seed = weights, sampling, seed
    self.shares = weights / weights.sum()
    self._cdf = np.cumsum(self.shares)
    self._cdf /= self._cdf[-1]
    self._starts = [np.zeros(len(weights), np.int64)]  # counts at the start of each block drawn so far
    self._block: tuple[int, np.ndarray] | None = None

  def _draw(self, block: int) -> np.ndarray:
    """The datasets of the steps of `block`, once the counts at its start are known."""
    if self.sampling == "proportional":
      u = np.random.default_rng([self.seed, block, _DRAW_TAG]).random(self.BLOCK)
      return self._cdf.searchsorted(u, side="right").astype(np.int64)
    # Python floats: the same IEEE arithmetic as numpy's, several times faster on a handful of datasets.
    counts, shares, first = self._starts[block].tolist(), self.shares.tolist(), block * self.BLOCK
    out = []
    for t in range(self.BLOCK):
      n = first + t + 1
      behind = [n * share - count for share, count in zip(shares, counts)]
      i = behind.index(max(behind))  # the first of equals
      out.append(i)
      counts[i] += 1
    return np.array(out, np.int64)

  def _blocks(self, block: int) -> np.ndarray:
    while len(self._starts) <= block:
      b = len(self._starts) - 1
      drawn = self._block[1] if self._block is not None and self._block[0] == b else self._draw(b)
      self._starts.append(self._starts[b] + np.bincount(drawn, minlength=len(self.weights)))
    if self._block is None or self._block[0] != block:
      self._block = (block, self._draw(block))
    return self._block[1]

  def position(self, step: int) -> tuple[int, int]:
    """(the dataset of `step`, its own batch index: how many earlier steps drew it)."""
    block, within = divmod(step, self.BLOCK)
    drawn = self._blocks(block)
    i = int(drawn[within])
    return i, int(self._starts[block][i] + np.count_nonzero(drawn[:within] == i))

  def counts(self, steps: int) -> np.ndarray:
    """How many of the steps 0 .. steps - 1 drew each dataset."""
    block, within = divmod(steps, self.BLOCK)
    drawn = self._blocks(block)
    return self._starts[block] + np.bincount(drawn[:within], minlength=len(self.weights))


class Mixture:
  """Batches of several datasets, one dataset a step: what the trainer asks of pairs.Batches (`local`,
  `global_layout`, `host_rows`, `log_scalars`, `batch_size`, `examples_per_epoch`, `seed`)."""

  def __init__(self, entries: Sequence[Entry], batches: Sequence[pairs.Batches], sampling: str, seed: int):
    if len(entries) != len(batches) or not batches:
      raise ValueError(f"{len(entries)} entries for {len(batches)} batches")
    first = batches[0]
    shape = lambda b: (b.batch_size, b.per_query + b.padding_per_query, b.query_max_length, b.doc_max_length,
                       b.candidates, b.pair_weighting)
    for entry, b in zip(entries, batches):
      if shape(b) != shape(first):
        raise ValueError(f"data.mixture: {entry.name}'s batches (batch size, columns a query, lengths, candidates, "
                         f"weighting {shape(b)}) differ from {entries[0].name}'s {shape(first)}: one jitted step "
                         "serves every dataset")
      if b.candidates != "tokens" or b.triples_per_query:
        raise ValueError("data.mixture: token batches only (no corpus candidates, pairs or ANCE triples)")
    self.entries, self.batches = list(entries), list(batches)
    self.names = [e.name for e in entries]
    self.schedule = Schedule([e.weight for e in entries], sampling, seed)
    self.batch_size, self.seed = first.batch_size, seed
    self._built = np.zeros(len(batches), np.int64)  # batches built since the last log line, per dataset

  @property
  def examples_per_epoch(self) -> int:
    """Every dataset's pairs (the checkpoint's informational data position)."""
    return sum(b.examples_per_epoch for b in self.batches)

  def position(self, step: int) -> tuple[int, int]:
    return self.schedule.position(step)

  def local(self, step: int) -> dict[str, np.ndarray]:
    i, j = self.position(step)
    self._built[i] += 1
    return self.batches[i].local(j)

  def global_layout(self, step: int):
    i, j = self.position(step)
    return self.batches[i].global_layout(j)

  def host_rows(self, n: int) -> tuple[int, int]:
    return self.batches[0].host_rows(n)

  def log_scalars(self, steps: int) -> dict[str, float]:
    """`mixture/NAME`: the fraction of steps 0 .. steps - 1 that drew each dataset; and the datasets'
    own scalars (negatives masked as duplicates of a positive), averaged over the batches each built since
    the last call."""
    counts = self.schedule.counts(steps)
    out = {f"mixture/{name}": float(c) / max(steps, 1) for name, c in zip(self.names, counts)}
    merged: dict[str, list[tuple[float, int]]] = {}
    for b, built in zip(self.batches, self._built):
      for key, value in b.log_scalars().items():
        merged.setdefault(key, []).append((value, int(built)))
    for key, values in merged.items():
      total = sum(n for _, n in values)
      if total:
        out[key] = sum(v * n for v, n in values) / total
    self._built[:] = 0
    return out

  def describe(self, num_steps: int, file=None) -> None:
    """The plan, once at the start: each dataset's weight, planned share, and the share and epochs this run's
    schedule gives it over `num_steps` steps."""
    file = file or sys.stderr  # looked up at call time, as pairs.describe_counts does
    counts = self.schedule.counts(num_steps)
    print(f"data.mixture: {len(self.entries)} datasets, {self.schedule.sampling}, {num_steps} steps of "
          f"{self.batch_size} (seed {self.seed}); planned = weight share, expected = this run's schedule",
          file=file)
    for entry, b, share, count in zip(self.entries, self.batches, self.schedule.shares, counts):
      neg = entry.config.negatives if entry.config is not None else None
      how = "" if neg is None else (f", negatives {neg.source}, in-batch {'on' if neg.in_batch else 'off'}"
                                    + (f", query prompt {entry.prompt!r}" if entry.prompt else ""))
      epochs = count * self.batch_size / max(b.examples_per_epoch, 1)
      print(f"  {entry.name}: weight {entry.weight:g}, planned {share:.1%}, expected {count / max(num_steps, 1):.1%}"
            f" ({count} steps, {epochs:.2f} epochs of {b.examples_per_epoch} pairs){how}", file=file)
