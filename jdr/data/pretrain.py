"""Pretraining examples for two towers (Chang et al., ICLR 2020): ICT, BFS and WLP pairs, and MLM masking.

  ICT  query = a random sentence of a passage with >= 2 sentences; document = (title, the passage's other
       sentences). With probability `keep_sentence_prob` the sentence stays in the document (Lee et al. 2019
       keep it 10% of the time, so the model also learns word matching; Chang et al. do not say).
  BFS  query = a random sentence of an article's lead; document = a random passage of its body.
  WLP  query = a random sentence of article B's lead; document = a passage of an article A that links to B,
       one of A's passages that mention B (`Article.mentions`, else those containing B's title) when there are
       any, else a random passage of A (counted in stats as wlp_no_mention).
  mixed  each pair from one of the tasks, chosen uniformly.

Documents are (title, text): the tokenizer pair-encodes them, i.e. "title [SEP] text" as in the paper.

A pair is a pure function of (seed, index): its random draws come from `np.random.default_rng([seed, index])`,
so a resumed run sees the same pairs with no loader state to save. Units (ICT: passages, BFS: body passages of
articles with a lead, WLP: links) are drawn with replacement; a drawn unit that cannot give a pair (a passage
with one sentence, a lead without a sentence) is counted in `stats` and another is drawn from the same
stream. Sentences are split lazily and cached on the articles; `survey()` splits everything and counts exactly.
"""

import collections
import dataclasses
import re
from typing import NamedTuple, Sequence

import numpy as np

from jdr.data.articles import LEAD, Article

TASKS = ("ict", "bfs", "wlp")


class Pair(NamedTuple):
  query: str
  doc_title: str
  doc_text: str
  task: str
  article_id: str  # the document's article (for WLP: A, the one that links to the query's article)


@dataclasses.dataclass(frozen=True)
class Draw:
  """A pair with where it came from: (section, paragraph[, sentence]) places, section LEAD for the lead."""
  pair: Pair
  query_article_id: str
  query_place: tuple[int, int, int]
  doc_place: tuple[int, int]
  kept_sentence: bool = False
  mention: bool = True  # WLP: the document mentions the query's article


def _title_variants(title: str) -> list[str]:
  """The title and, as link_passages_subset.tsv does, the title without a trailing parenthetical."""
  bare = re.sub(r"\s*\([^)]*\)\s*$", "", title)
  return [t.lower() for t in {title, bare} if t]


class PretrainPairs:
  """(query, doc_title, doc_text, task, article_id) pairs from a list of articles; `pair(index)`, `len()`.

  `len()` is a nominal epoch: the number of units of the task (for mixed, of all its tasks together).
  `stats` counts skipped candidates per reason: units left out when building (e.g. bfs_no_lead: articles) and
  draws rejected so far (e.g. ict_short_passage), plus wlp_no_mention (documents that do not mention B).
  """

  def __init__(self, articles: Sequence[Article], task: str = "mixed", seed: int = 0, *,
               keep_sentence_prob: float = 0.1, tasks: Sequence[str] = TASKS, wlp_require_mention: bool = False,
               max_tries: int = 100):
    if task != "mixed" and task not in TASKS:
      raise ValueError(f"task must be one of {TASKS} or 'mixed', got {task!r}")
    if unknown := set(tasks) - set(TASKS):
      raise ValueError(f"tasks: unknown {sorted(unknown)}; known: {TASKS}")
    if not 0.0 <= keep_sentence_prob <= 1.0:
      raise ValueError(f"keep_sentence_prob must be in [0, 1], got {keep_sentence_prob}")
    self.articles = list(articles)
    self.task, self.seed, self.max_tries = task, seed, max_tries
    self.tasks = tuple(tasks) if task == "mixed" else (task,)
    self.keep_sentence_prob = keep_sentence_prob
    self.wlp_require_mention = wlp_require_mention
    self.build_stats = collections.Counter()  # units left out when building, counted once
    self._index = {a.id: i for i, a in enumerate(self.articles)}
    self.passage_places = [a.passages() for a in self.articles]
    self.body_places = [a.passages(body_only=True) for a in self.articles]
    self._mentions = {}  # (a, b) -> passages of a that mention b, cached

    # ICT: every passage; BFS: body passages of articles with a lead.
    self._ict_ends = np.cumsum([len(p) for p in self.passage_places], dtype=np.int64)
    bfs_counts = []
    for a, body in zip(self.articles, self.body_places):
      if not a.lead:
        self.build_stats["bfs_no_lead"] += 1
      elif not body:
        self.build_stats["bfs_no_body"] += 1
      bfs_counts.append(len(body) if a.lead else 0)
    self._bfs_ends = np.cumsum(bfs_counts, dtype=np.int64)
    # WLP: links A -> B with B's lead and A's passages.
    links = []
    for i, a in enumerate(self.articles):
      for target in a.links:
        j = self._index.get(target)
        if j is None:
          self.build_stats["wlp_unknown_target"] += 1
        elif j == i:
          self.build_stats["wlp_self_link"] += 1
        elif not self.articles[j].lead:
          self.build_stats["wlp_target_no_lead"] += 1
        elif not self.passage_places[i]:
          self.build_stats["wlp_source_no_passage"] += 1
        else:
          links.append((i, j))
    self.stats = collections.Counter(self.build_stats)  # plus draws rejected so far
    self.link_units = np.asarray(links, dtype=np.int64).reshape(-1, 2)
    self.units = {"ict": int(self._ict_ends[-1]) if len(self._ict_ends) else 0,
                  "bfs": int(self._bfs_ends[-1]) if len(self._bfs_ends) else 0,
                  "wlp": len(self.link_units)}
    if empty := [t for t in self.tasks if not self.units[t]]:
      raise ValueError(f"no candidates for {empty} among {len(self.articles)} articles "
                       f"(skipped so far: {dict(self.stats)}); pass tasks= without them")

  def __len__(self) -> int:
    return sum(self.units[t] for t in self.tasks)

  def pair(self, index: int) -> Pair:
    return self.draw(index).pair

  def draw(self, index: int) -> Draw:
    """The pair at `index` with its provenance; a pure function of (seed, index)."""
    if index < 0:
      raise IndexError(f"pair index must be >= 0, got {index}")
    rng = np.random.default_rng([self.seed, index])
    task = self.tasks[rng.integers(len(self.tasks))] if len(self.tasks) > 1 else self.tasks[0]
    make = {"ict": self._ict, "bfs": self._bfs, "wlp": self._wlp}[task]
    for _ in range(self.max_tries):
      result = make(rng, rng.integers(self.units[task]))
      if result is not None:
        return result
    raise RuntimeError(f"{task}: no usable candidate in {self.max_tries} draws for pair {index} "
                       f"(skipped: {dict(self.stats)}); check the articles with survey()")

  def passage(self, index: int) -> tuple[str, str, str]:
    """(article id, title, passage text) of a passage drawn uniformly, a pure function of (seed, index): the
    text of the masked-LM baseline, the same passages ICT draws from."""
    if index < 0:
      raise IndexError(f"passage index must be >= 0, got {index}")
    rng = np.random.default_rng([self.seed, index, 1])  # a stream apart from the pairs' own
    i, k = self._locate(self._ict_ends, int(rng.integers(self.units["ict"])))
    a = self.articles[i]
    return a.id, a.title, a.paragraph(*self.passage_places[i][k])

  # ------------------------------------------------------------------------------------------------ tasks

  def _locate(self, ends: np.ndarray, unit: int) -> tuple[int, int]:
    i = int(np.searchsorted(ends, unit, side="right"))
    return i, int(unit - (ends[i - 1] if i else 0))

  def _ict(self, rng, unit):
    i, k = self._locate(self._ict_ends, unit)
    a = self.articles[i]
    s, p = self.passage_places[i][k]
    sentences = a.sentences(s, p)
    if len(sentences) < 2:
      self.stats["ict_short_passage"] += 1
      return None
    q = int(rng.integers(len(sentences)))
    keep = bool(rng.random() < self.keep_sentence_prob)
    doc = " ".join(sentences if keep else sentences[:q] + sentences[q + 1:])
    return Draw(Pair(sentences[q], a.title, doc, "ict", a.id), a.id, (s, p, q), (s, p), kept_sentence=keep)

  def _lead_query(self, rng, a: Article, reason: str):
    lead = a.lead_sentences()
    if not lead:
      self.stats[reason] += 1
      return None
    return lead[int(rng.integers(len(lead)))]

  def _bfs(self, rng, unit):
    i, k = self._locate(self._bfs_ends, unit)
    a = self.articles[i]
    query = self._lead_query(rng, a, "bfs_no_lead_sentence")
    if query is None:
      return None
    p, q, sentence = query
    s, d = self.body_places[i][k]
    return Draw(Pair(sentence, a.title, a.paragraph(s, d), "bfs", a.id), a.id, (LEAD, p, q), (s, d))

  def mention_passages(self, i: int, j: int) -> list[tuple[int, int]]:
    """Passages of article i that hold its link to article j, else that contain j's title (case-insensitive)."""
    key = (i, j)
    if key not in self._mentions:
      a, b = self.articles[i], self.articles[j]
      places = a.mentions.get(b.id)
      if not places:
        variants = _title_variants(b.title)
        places = [pl for pl in self.passage_places[i] if any(v in a.paragraph(*pl).lower() for v in variants)]
      self._mentions[key] = list(places)
    return self._mentions[key]

  def _wlp(self, rng, unit):
    i, j = (int(x) for x in self.link_units[unit])
    a, b = self.articles[i], self.articles[j]
    query = self._lead_query(rng, b, "wlp_no_lead_sentence")
    if query is None:
      return None
    places = self.mention_passages(i, j)
    if not places:
      self.stats["wlp_no_mention"] += 1
      if self.wlp_require_mention:
        return None
    p, q, sentence = query
    s, d = (places or self.passage_places[i])[int(rng.integers(len(places or self.passage_places[i])))]
    return Draw(Pair(sentence, a.title, a.paragraph(s, d), "wlp", a.id), b.id, (LEAD, p, q), (s, d),
                mention=bool(places))

  # ------------------------------------------------------------------------------------------------ survey

  def survey(self) -> dict:
    """Exact counts over every unit (splits every paragraph: about a minute for 48k paragraphs on one core).

    Returns {task: {"units", "usable", "pairs"}} where pairs counts distinct (query sentence, document)
    combinations (ICT: sentences of usable passages; BFS: lead sentences x body passages; WLP: lead sentences of
    B x documents of A), and "skipped": the reasons, with each unit counted once.
    """
    saved, self.stats = self.stats, collections.Counter()
    out = {}
    try:
      usable = pairs = 0
      for i, a in enumerate(self.articles):
        for s, p in self.passage_places[i]:
          n = len(a.sentences(s, p))
          if n >= 2:
            usable, pairs = usable + 1, pairs + n
          else:
            self.stats["ict_short_passage"] += 1
      out["ict"] = {"units": self.units["ict"], "usable": usable, "pairs": pairs}
      usable = pairs = 0
      for i, a in enumerate(self.articles):
        if a.lead and self.body_places[i]:
          n = len(a.lead_sentences())
          if n:
            usable, pairs = usable + len(self.body_places[i]), pairs + n * len(self.body_places[i])
          else:
            self.stats["bfs_no_lead_sentence"] += len(self.body_places[i])
      out["bfs"] = {"units": self.units["bfs"], "usable": usable, "pairs": pairs}
      usable = pairs = mentioned = 0
      for i, j in self.link_units.tolist():
        n = len(self.articles[j].lead_sentences())
        places = self.mention_passages(i, j)
        if not n:
          self.stats["wlp_no_lead_sentence"] += 1
          continue
        self.stats["wlp_no_mention"] += not places
        if places or not self.wlp_require_mention:
          usable, mentioned = usable + 1, mentioned + bool(places)
          pairs += n * len(places or self.passage_places[i])
      out["wlp"] = {"units": self.units["wlp"], "usable": usable, "pairs": pairs, "with_mention": mentioned}
      out["skipped"] = dict(self.build_stats + self.stats)
    finally:
      self.stats = saved
    return out


# ---------------------------------------------------------------------------------------------------------------
# MLM

def mask_tokens(token_ids, rng: np.random.Generator, vocab_size: int, mask_id: int, special_ids,
                prob: float = 0.15) -> tuple[np.ndarray, np.ndarray]:
  """BERT's masking: each non-special token is chosen with probability `prob`; a chosen token becomes
  `mask_id` 80% of the time, a random non-special token 10%, and stays 10%.

  Returns (input_ids, labels): labels hold the original id where a token was chosen and -100 elsewhere, the
  ignore index of token cross-entropy. `special_ids` (CLS, SEP, PAD, MASK, ...) are never chosen nor drawn as
  random replacements. Any shape; for a pure function of (seed, step) pass `np.random.default_rng([seed, step])`.
  """
  ids = np.asarray(token_ids)
  special = np.asarray(sorted(set(int(t) for t in special_ids) | {int(mask_id)}), dtype=np.int64)
  chosen = (rng.random(ids.shape) < prob) & ~np.isin(ids, special)
  labels = np.where(chosen, ids, -100)
  r = rng.random(ids.shape)
  allowed = np.setdiff1d(np.arange(vocab_size, dtype=np.int64), special)
  replacements = allowed[rng.integers(len(allowed), size=ids.shape)]
  inputs = np.where(chosen & (r < 0.8), mask_id, np.where(chosen & (r >= 0.8) & (r < 0.9), replacements, ids))
  return inputs.astype(ids.dtype), labels.astype(np.int32)
