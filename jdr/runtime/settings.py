"""The range of every numeric setting, checked before any work: `check(config)`; and the keys that were renamed,
refused under their old names with the new one (`RENAMED`, `check_renamed`).

A range is written as `--help` prints it beside the key's meaning: ">= 1", "> 0", "[0, 1]", "(0, 1]", "[0, 1)",
"any" (every finite value), with alternatives joined by " | " ("-1 | >= 0"). A float is always finite: NaN
and infinities are refused whatever its range. The types are ml_collections' (an override of another type is
refused when it is parsed); the choices of string settings are refused by the code that reads them, before any
data is read.
"""

from __future__ import annotations

import math
import re

import ml_collections

RANGES = {
    "seed": ">= 0",
    "data.train_fraction": "(0, 1]",
    "data.query_max_length": ">= 1",
    "data.doc_max_length": ">= 1",
    "data.keep_sentence_prob": "[0, 1]",
    "model.normalize": "[-1, 1]",
    "model.projection_dim": ">= 0",
    "model.encode_chunk_rows": ">= 0",
    "model.dropout": "[0, 1)",
    "model.attention_dropout": "-1 | [0, 1)",
    "model.lora_rank": ">= 0",
    "model.lora_alpha": "> 0",
    "model.lora_dropout": "[0, 1)",
    "negatives.per_query": ">= 0",
    "negatives.random_weight": ">= 0",
    "negatives.guide.margin": "any",
    "negatives.bm25.top_k": ">= 1",
    "negatives.dense_static.top_n": ">= 1",
    "negatives.dense_static.extra": ">= 0",
    "negatives.dense_static.query_length": ">= 0",
    "negatives.ance.top_n": ">= 1",
    "negatives.ance.refresh_every": ">= 0",
    "negatives.ance.refresh_delay": ">= 0",
    "negatives.ance.refresh_max_wait_s": "-1 | >= 0",
    "negatives.ance.triples_per_query": ">= 0",
    "negatives.ance.refresh_chunks": ">= 1",
    "negatives.ance.triple_readers": ">= 0",
    "negatives.retrieval.top_n": ">= 1",
    "negatives.retrieval.every": ">= 0",
    "negatives.retrieval.top_k_recall_target": "(0, 1]",
    "loss.temperature": "> 0",
    "loss.margin": "any",
    "distill.passage_tokens": ">= 1",
    "distill.sentence_tokens": ">= 1",
    "distill.contrastive_weight": ">= 0",
    "distill.negative_pieces": ">= 0",
    "distill.temperature": "> 0",
    "distill.teacher_batch_size": ">= 0",
    "grad_cache.chunk_size": ">= 0",
    "optimizer.learning_rate": "> 0",
    "optimizer.warmup_steps": ">= 0",
    "optimizer.schedule_steps": ">= 0",
    "optimizer.weight_decay": ">= 0",
    "optimizer.b1": "[0, 1)",
    "optimizer.b2": "[0, 1)",
    "optimizer.eps": "> 0",
    "optimizer.grad_clip_norm": ">= 0",
    "batch_size": ">= 1",
    "num_train_steps": ">= 0",
    "log_every": ">= 1",
    "eval_every": ">= 0",
    "checkpoint_every": ">= 0",
    "keep_checkpoints": ">= 1",
    "eval.top_k": ">= 1",
    "eval.candidates_depth": ">= 1",
    "eval.max_queries": ">= 0",
    "eval.doc_max_length": ">= 0",
    "eval.tokens_per_batch": ">= 0",
    "eval.rerank_depth": ">= 1",
    "eval.rerank_batch_size": ">= 0",
    "eval.diagnostic_queries": ">= 0",
    "eval.suite_max_docs": ">= 0",
    "eval.suite_max_queries": ">= 0",
    "mesh.cpu_devices": ">= -1",
}

# Old key -> where it lives now. Each negatives source reads a group of its own (negatives.SOURCE.key); the keys
# two or three sources shared are each source's own now, so the old name points at every copy. An override, a
# recipe or a config built in code that still uses an old name is refused in one line naming the new one.
RENAMED = {
    "negatives.guide": "negatives.guide.model",
    "negatives.guide_margin": "negatives.guide.margin",
    "negatives.bm25_top_k": "negatives.bm25.top_k",
    "negatives.static_run": "negatives.static.run",
    "negatives.triples_file": "negatives.triples.file",
    "negatives.triples_skip_invalid": "negatives.triples.skip_invalid",
    "negatives.mined": "negatives.mined.file",
    "negatives.top_n": ("negatives.dense_static.top_n, negatives.ance.top_n or negatives.retrieval.top_n (the "
                        "source's own)"),
    "negatives.mine_extra": "negatives.dense_static.extra",
    "negatives.mine_query_length": "negatives.dense_static.query_length",
    "negatives.mine_backend": "negatives.dense_static.backend or negatives.ance.backend (the source's own)",
    "negatives.corpus_dtype": ("negatives.retrieval.corpus_dtype, negatives.dense_static.corpus_dtype or "
                               "negatives.ance.corpus_dtype (the source's own)"),
    "negatives.triples_per_query": "negatives.ance.triples_per_query",
    "negatives.triples_over": "negatives.ance.triples_over",
    "negatives.refresh_chunks": "negatives.ance.refresh_chunks",
    "negatives.triple_readers": "negatives.ance.triple_readers",
    "negatives.refresh_every": "negatives.ance.refresh_every",
    "negatives.refresh_delay": "negatives.ance.refresh_delay",
    "negatives.refresh_max_wait_s": "negatives.ance.refresh_max_wait_s",
    "negatives.retrieve_every": "negatives.retrieval.every",
    "negatives.missing_positive": "negatives.retrieval.missing_positive",
    "negatives.retrieval_backend": "negatives.retrieval.backend",
    "negatives.top_k_recall_target": "negatives.retrieval.top_k_recall_target",
    "negatives.index_factory": "negatives.retrieval.index_factory",
    "negatives.corpus_encoding": "negatives.retrieval.corpus_encoding",
}


def renamed(key: str) -> str | None:
  """The line refusing `key` when it is an old name ("negatives.bm25_top_k is now negatives.bm25.top_k"), else
  None."""
  return f"{key} is now {RENAMED[key]}" if key in RENAMED else None


def check_renamed(config: ml_collections.ConfigDict) -> None:
  """Refuses a config holding a key under its old name (set in code or by a recipe on an unlocked config): a
  ValueError with `renamed`'s line for the first one."""
  for key in RENAMED:
    if _value(config, key) is not None and not isinstance(_value(config, key), ml_collections.ConfigDict):
      raise ValueError(renamed(key))


_BOUND = r"(-?[0-9.e+-]+)"
_INTERVAL = re.compile(rf"([\[(])\s*{_BOUND}\s*,\s*{_BOUND}\s*([\])])")
_COMPARISON = re.compile(rf"(>=|>|<=|<)\s*{_BOUND}")


def _holds(value: float, text: str) -> bool:
  """Whether `value` lies in one range (no alternatives)."""
  text = text.strip()
  if text == "any":
    return True
  if match := _INTERVAL.fullmatch(text):
    lo_bracket, lo, hi, hi_bracket = match.groups()
    lo, hi = float(lo), float(hi)
    above = value >= lo if lo_bracket == "[" else value > lo
    below = value <= hi if hi_bracket == "]" else value < hi
    return above and below
  if match := _COMPARISON.fullmatch(text):
    op, bound = match.group(1), float(match.group(2))
    return {">=": value >= bound, ">": value > bound, "<=": value <= bound, "<": value < bound}[op]
  try:
    return value == float(text)
  except ValueError:
    raise ValueError(f"unreadable range {text!r}") from None


def within(value, spec: str) -> bool:
  """Whether `value` (an int or a finite float) lies in `spec` (alternatives joined by " | ")."""
  if isinstance(value, float) and not math.isfinite(value):
    return False
  return any(_holds(value, part) for part in spec.split("|"))


def _value(config: ml_collections.ConfigDict, key: str):
  value = config
  for part in key.split("."):
    if part not in value:
      return None
    value = value[part]
  return value


def problems(config: ml_collections.ConfigDict) -> list[str]:
  """One line per numeric setting out of its range (key, value, range), in RANGES' order."""
  out = []
  for key, spec in RANGES.items():
    value = _value(config, key)
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
      continue
    if not within(value, spec):
      out.append(f"{key}={value!r} is out of range: {spec}" +
                 ("" if not isinstance(value, float) or math.isfinite(value) else " (and finite)"))
  return out


def check(config: ml_collections.ConfigDict) -> None:
  """Refuses a config with a numeric setting out of its range: a ValueError naming the first such key (and
  how many more there are), before anything is read or written."""
  found = problems(config)
  if found:
    more = f" (and {len(found) - 1} more: {'; '.join(found[1:])})" if len(found) > 1 else ""
    raise ValueError(found[0] + more)
