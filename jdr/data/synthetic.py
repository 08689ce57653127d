"""An MS MARCO-shaped dataset of any size, to measure jdr at its users' scale without the real data.

  python -m jdr.data.synthetic --passages 100000 [--seed 0] [--out runs/synthetic] [--layout beir|msmarco]

`dataset(root, passages, seed=seed)` returns root/msmarco-synthetic-N{passages}-seed{seed}-v{VERSION}, a BEIR
directory (corpus.jsonl with _id / title / text, queries.jsonl, qrels/train.tsv, qrels/dev.tsv), generating it
the first time and reusing it after. With `layout="msmarco"` (`--layout msmarco`; the name ends in -msmarco) it
writes the same passages, queries and judgments as MS MARCO distributes them instead: collection.tsv,
queries.train.tsv (with unjudged queries too, as MS MARCO's 808,731 for 502,939 judged), queries.dev.small.tsv,
qrels.train.tsv and qrels.dev.small.tsv (TREC), triples.train.small.tsv (each training query's text, a positive's
and a random passage's, TRIPLES_PER_QUERY lines a query) and top1000.dev.tsv (each dev query's positives and
random passages, TOP1000 lines a query: `qid\tpid\tquery\tpassage`). What it copies of MS MARCO passage ranking
(8,841,823 passages, 502,939 training queries, 6,980 dev queries):

  counts     training and dev queries in MS MARCO's proportion to the passages (at least MIN_QUERIES each), as
             many positives a query as its qrels have on average (1.06), one relevance level (1); ids are
             decimal numbers, passages without titles, as in BEIR's copy
  lengths    passages of 56 words on average, log-normally spread (MS MARCO's shape: a bulk of 30-90 words,
             a thin tail of long ones); queries of 6
  words      Zipf-distributed over a vocabulary of VOCABULARY words: the most frequent are real English
             function words (so stopword removal and BM25's term statistics see text-like frequencies), the
             rest made of syllables, shorter for more frequent ranks, as in real text
  queries    about half their words drawn from their positives' words that are not function words (a
             question names its topic), the rest from the same Zipf law; so BM25 finds most positives at small
             sizes, and fewer as the corpus grows and more passages share the words

What it does not copy: meaning (a dense model learns nothing transferable from it), punctuation, numbers and
names, passages that near-duplicate each other, and word pieces: a made word is in no tokenizer's vocabulary
and splits into more pieces than an English word does, so a passage has more tokens than an MS MARCO passage
of as many words (`python -m jdr.bench scale` reports how many). Use it for time and memory, never for quality.

The same (passages, seed) gives the same bytes (with the same NumPy, whose generators' streams may change
between versions): every random draw comes from a generator seeded with (seed, purpose, block), in blocks of
BLOCK passages whatever the size. Passages are built with
vectorized numpy and streamed to disk a block at a time, so memory does not grow with their number; only the
queries and the words they take from their positives are kept between blocks. The dataset is written into a
hidden temporary folder beside its final name and renamed once complete, so a killed run never leaves a folder
that looks finished (a hidden `.NAME.*.tmp` folder that a killed run leaves can be deleted); synthetic.json,
written last, is the completion mark.
"""

from jdr.runtime import host_memory

# `python -m` this module: glibc's malloc on huge pages, by re-executing before anything heavy is imported.
host_memory.reexec_if_command(__name__)

import argparse
import functools
import itertools
import json
import math
import mmap
import os
import pathlib
import shutil
import sys
import tempfile
import time

import numpy as np
import tqdm

# Bump when the output for a given (passages, seed) changes: it is part of the folder name, so a dataset made
# by another version is never mistaken for this one's.
VERSION = 1
MANIFEST = "synthetic.json"

MSMARCO_PASSAGES = 8_841_823
MSMARCO_TRAIN_QUERIES = 502_939
MSMARCO_DEV_QUERIES = 6_980
MSMARCO_TRAIN_PAIRS = 532_761  # qrels.train.tsv
MSMARCO_DEV_PAIRS = 7_437  # qrels.dev.small.tsv
MSMARCO_TRAIN_QUERIES_ALL = 808_731  # queries.train.tsv, judged or not
MSMARCO_TRIPLES = 39_780_811  # triples.train.small.tsv
TRIPLES_PER_QUERY = round(MSMARCO_TRIPLES / MSMARCO_TRAIN_QUERIES)  # 79
TOP1000 = 1000  # top1000.dev.tsv's candidates a query (at most the corpus)
LAYOUTS = ("beir", "msmarco")
MIN_QUERIES = 5  # per split: a tiny corpus still has something to train and evaluate on
MIN_PASSAGES = 100

PASSAGE_WORDS = 56.0  # mean
PASSAGE_SIGMA = 0.45  # of log(words): MS MARCO's spread, most passages between 30 and 90 words
PASSAGE_RANGE = (3, 360)
QUERY_WORDS = 6.0  # mean
QUERY_RANGE = (2, 24)
QUERY_FROM_POSITIVE = 0.5  # expected share of a query's words taken from its positives

VOCABULARY = 1 << 21
ZIPF_EXPONENT = 1.1  # Zipf-Mandelbrot p(rank) ~ 1 / (rank + ZIPF_OFFSET) ** ZIPF_EXPONENT
ZIPF_OFFSET = 1.0
BLOCK = 50_000  # passages generated, and random streams seeded, per block

# The most frequent English words, most frequent first: the head of the Zipf law. Every word of the English
# stopword list jdr's BM25 removes (Lucene's, as bm25s') is among them, so stopword removal drops a share of
# the text as it does of real text.
FUNCTION_WORDS = tuple("""
the of and to a in is that for it as was with be by on not he i this are or his from at which but have an
they you were their one all we can her has there been if more when will would who so no she other its may
these what them than some him time into only do also about out new two first up like could most over after
then any my our me years used should because each many well where such how those state through use very
people both between during same make water number made high even under part called long known did three
world found back us life while your just must since being off down here against own city year work last
still way get without before take great day said small end large much school often
""".split())

_ONSETS = ("b c d f g h j k l m n p r s t v w z ch sh th st br tr pl gr cl fr sp").split()
_VOWELS = ("a e i o u ai ea ou").split()
_CODAS = ("", "n", "r", "s", "l", "t", "m", "nd", "st", "ck")


def query_counts(passages: int) -> tuple[int, int]:
  """(training queries, dev queries) for a corpus of `passages`: MS MARCO's proportions, at least MIN_QUERIES."""
  train = max(MIN_QUERIES, round(passages * MSMARCO_TRAIN_QUERIES / MSMARCO_PASSAGES))
  dev = max(MIN_QUERIES, round(passages * MSMARCO_DEV_QUERIES / MSMARCO_PASSAGES))
  return train, dev


def name(passages: int, seed: int = 0, layout: str = "beir") -> str:
  return f"msmarco-synthetic-N{passages}-seed{seed}-v{VERSION}" + ("" if layout == "beir" else f"-{layout}")


def _letters(texts: list[str], width: int) -> np.ndarray:
  """uint8 [len(texts), width]: each text's bytes, zeros after."""
  return np.array([t.encode("ascii") for t in texts], dtype=f"S{width}").view(np.uint8).reshape(len(texts), width)


def _key(text: str) -> int:
  """An integer equal only for equal words: the letters as digits 1-26 of a base-27 number."""
  return functools.reduce(lambda key, letter: key * 27 + ord(letter) - 96, text, 0)


@functools.lru_cache(maxsize=1)
def vocabulary() -> tuple[np.ndarray, np.ndarray]:
  """The words by rank, as a uint8 matrix [VOCABULARY, width] of each word's bytes followed by a space (zeros
  after), and their lengths with the space [VOCABULARY]. The same for every seed.

  The function words come first; then the words of one syllable, then of two: rarer words are longer. Each
  group is in a fixed shuffled order, so frequency does not follow the alphabet."""
  syllables = [o + v + c for o, v, c in itertools.product(_ONSETS, _VOWELS, _CODAS)]
  count = len(syllables)
  syl_keys = np.array([_key(x) for x in syllables], np.int64)
  syl_lengths = np.array([len(x) for x in syllables], np.int64)
  order_rng = np.random.default_rng(20240601)
  one = order_rng.permutation(count)
  first, second = np.divmod(order_rng.permutation(count * count), count)
  # A word's key from its syllables' (two syllables are at most 12 letters: 27 ** 12 fits in 63 bits), so
  # duplicates are found before any word is spelled out. Syllables can join into one word two ways ("bas" +
  # "ta", "ba" + "sta"), and a made word can be a function word: each word keeps its first rank only.
  keys = np.concatenate([np.array([_key(w) for w in FUNCTION_WORDS], np.int64), syl_keys[one],
                         syl_keys[first] * 27 ** syl_lengths[second] + syl_keys[second]])
  # The first VOCABULARY distinct keys are the same in any prefix that holds that many: sorting a prefix with
  # some room is enough, and cheaper than sorting them all.
  for size in (VOCABULARY + VOCABULARY // 4, len(keys)):
    _, firsts = np.unique(keys[:size], return_index=True)
    if len(firsts) >= VOCABULARY or size == len(keys):
      break
  if len(firsts) < VOCABULARY:
    raise ValueError(f"VOCABULARY={VOCABULARY} is more than the {len(firsts)} words of up to two syllables")
  kept = np.sort(firsts)[:VOCABULARY]
  # Each kept word as up to two syllables (-1: none), or a function word.
  heads = len(FUNCTION_WORDS)
  made = kept[kept >= heads] - heads
  parts = np.where(made < count, one[np.minimum(made, count - 1)], first[np.maximum(made - count, 0)])
  tails = np.where(made < count, -1, second[np.maximum(made - count, 0)])
  syl_width = int(syl_lengths.max())
  syl_letters = _letters(syllables, syl_width)
  width = max(2 * syl_width, max(map(len, FUNCTION_WORDS))) + 1
  out = np.zeros((VOCABULARY, width), np.uint8)
  out[:heads, :width - 1] = _letters(list(FUNCTION_WORDS), width - 1)
  rows, end = np.arange(heads, VOCABULARY), np.zeros(VOCABULARY - heads, np.int64)
  for digits in (parts, tails):
    has_syllable = digits >= 0
    for j in range(syl_width):
      put = has_syllable & (j < syl_lengths[digits])
      out[rows[put], end[put] + j] = syl_letters[digits[put], j]
    end += np.where(has_syllable, syl_lengths[digits], 0)
  lengths = (out != 0).sum(axis=1)
  out[np.arange(VOCABULARY), lengths] = ord(" ")
  return out, lengths + 1


def word_strings(ranks) -> list[str]:
  """The words of the given ranks."""
  matrix, lengths = vocabulary()
  return [matrix[r, :lengths[r] - 1].tobytes().decode("ascii") for r in np.asarray(ranks).tolist()]


def zipf_ranks(rng: np.random.Generator, n: int) -> np.ndarray:
  """`n` word ranks from the Zipf-Mandelbrot law over the vocabulary, by inverting its continuous CDF (one
  power per word, where a table search would cost a log of the vocabulary each)."""
  s, b = ZIPF_EXPONENT, ZIPF_OFFSET
  lo, hi = b ** (1.0 - s), (VOCABULARY + b) ** (1.0 - s)
  u = rng.random(n)
  ranks = np.floor((lo + u * (hi - lo)) ** (1.0 / (1.0 - s)) - b)
  return np.clip(ranks, 0, VOCABULARY - 1).astype(np.int32)


def passage_lengths(rng: np.random.Generator, n: int) -> np.ndarray:
  mu = math.log(PASSAGE_WORDS) - PASSAGE_SIGMA ** 2 / 2  # so that the mean is PASSAGE_WORDS
  return np.clip(np.rint(rng.lognormal(mu, PASSAGE_SIGMA, n)), *PASSAGE_RANGE).astype(np.int64)


class Plan:
  """What is decided before the corpus is written: the queries, their positives, and which passage each of
  their positive-derived words comes from (filled in while that passage's block is generated)."""

  def __init__(self, passages: int, seed: int):
    rng = np.random.default_rng([seed, 0])
    self.train, self.dev = query_counts(passages)
    n = self.train + self.dev
    extra = np.r_[np.full(self.train, MSMARCO_TRAIN_PAIRS / MSMARCO_TRAIN_QUERIES - 1),
                  np.full(self.dev, MSMARCO_DEV_PAIRS / MSMARCO_DEV_QUERIES - 1)]
    self.positives_per_query = 1 + rng.poisson(extra)
    total = int(self.positives_per_query.sum())
    if total > passages:
      raise ValueError(f"{passages} passages cannot hold {total} distinct positives; ask for more passages")
    # Distinct passages: in MS MARCO a passage is almost never the answer to two queries.
    self.positives = rng.choice(passages, size=total, replace=False).astype(np.int64)
    self.first_positive = np.cumsum(self.positives_per_query) - self.positives_per_query
    self.query_words = np.clip(1 + rng.poisson(QUERY_WORDS - 1, n), *QUERY_RANGE)
    self.from_positive = np.clip(rng.binomial(self.query_words, QUERY_FROM_POSITIVE), 1, self.query_words)
    # One request per positive-derived query word: the query, and the passage (one of its positives) it reads.
    self.request_query = np.repeat(np.arange(n), self.from_positive)
    pick = np.floor(rng.random(len(self.request_query)) * self.positives_per_query[self.request_query])
    self.request_passage = self.positives[self.first_positive[self.request_query] + pick.astype(np.int64)]
    self.by_passage = np.argsort(self.request_passage, kind="stable")
    self.sorted_passages = self.request_passage[self.by_passage]
    self.request_word = np.full(len(self.request_query), -1, np.int32)

  def fill(self, rng: np.random.Generator, lo: int, lengths: np.ndarray, words: np.ndarray) -> None:
    """Takes the requested words of the passages lo .. lo + len(lengths) from their word ranks."""
    a, c = np.searchsorted(self.sorted_passages, [lo, lo + len(lengths)])
    if a == c:
      return
    chosen = self.by_passage[a:c]
    local = self.request_passage[chosen] - lo
    starts = np.cumsum(lengths) - lengths
    # A uniformly drawn word of the passage that is not a function word (a question names its topic): the
    # k-th such word is where the running count of them within the block reaches its count before the
    # passage plus k + 1. A passage of function words only gives any of its words.
    content = np.cumsum(words >= len(FUNCTION_WORDS))
    before = np.where(starts[local] > 0, content[starts[local] - 1], 0)
    available = content[starts[local] + lengths[local] - 1] - before
    u = rng.random(len(chosen))
    anywhere = starts[local] + np.floor(u * lengths[local]).astype(np.int64)
    nth = np.searchsorted(content, before + np.floor(u * available).astype(np.int64) + 1)
    self.request_word[chosen] = words[np.where(available > 0, nth, anywhere)]


def _corpus_block(rng: np.random.Generator, lo: int, n: int, plan: Plan,
                  tsv: bool = False) -> tuple[list[bytes], int]:
  """corpus.jsonl (or, `tsv`, collection.tsv) lines of passages lo .. lo + n - 1, and their number of words."""
  matrix, byte_lengths = vocabulary()
  lengths = passage_lengths(rng, n)
  words = zipf_ranks(rng, int(lengths.sum()))
  plan.fill(rng, lo, lengths, words)
  rows = byte_lengths[words]
  # Each word's bytes and its trailing space, concatenated in order: the block's text in one buffer.
  keep = np.arange(matrix.shape[1])[None, :] < rows[:, None]
  text = matrix[words][keep].tobytes()
  word_end = np.cumsum(rows)
  ends = word_end[np.cumsum(lengths) - 1]  # just past each passage's last space
  starts = np.r_[0, ends[:-1]]
  line = b"%d\t%s\n" if tsv else b'{"_id": "%d", "title": "", "text": "%s"}\n'
  lines = [line % (lo + i, text[s:e - 1]) for i, (s, e) in enumerate(zip(starts.tolist(), ends.tolist()))]
  return lines, int(lengths.sum())


def query_texts(plan: Plan, seed: int) -> list[str]:
  if (plan.request_word < 0).any():
    raise AssertionError("a query word was never filled: its passage was not generated")
  rng = np.random.default_rng([seed, 2])
  n = len(plan.query_words)
  noise_count = plan.query_words - plan.from_positive
  owner = np.r_[plan.request_query, np.repeat(np.arange(n), noise_count)]
  ranks = np.r_[plan.request_word, zipf_ranks(rng, int(noise_count.sum()))]
  order = np.lexsort((rng.random(len(owner)), owner))  # by query, shuffled within each
  text = word_strings(ranks[order])
  bounds = np.r_[0, np.cumsum(plan.query_words)].tolist()
  return [" ".join(text[bounds[q]:bounds[q + 1]]) for q in range(n)]


def generate(directory: str | os.PathLike, passages: int, *, seed: int = 0, progress: bool = True,
             layout: str = "beir", triples_per_query: int = TRIPLES_PER_QUERY, top1000: int = TOP1000) -> dict:
  """Writes the dataset into `directory` (created; used as is, so pass a fresh one: `dataset` does) and returns
  its manifest, which it writes last as synthetic.json. `layout` "msmarco" writes MS MARCO's own files, with
  `triples_per_query` lines of triples.train.small.tsv a training query and `top1000` of top1000.dev.tsv a dev
  query."""
  if passages < MIN_PASSAGES:
    raise ValueError(f"passages must be at least {MIN_PASSAGES}, got {passages}")
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
  start = time.perf_counter()
  directory = pathlib.Path(directory)
  tsv = layout == "msmarco"
  directory.mkdir(parents=True, exist_ok=True)
  plan = Plan(passages, seed)
  vocabulary()  # built before the bar starts, so the bar's rate is the corpus's
  word_count = 0
  line_ends = []  # collection.tsv: where each line ends, to read passages back for the triples
  with open(directory / ("collection.tsv" if tsv else "corpus.jsonl"), "wb") as f, tqdm.tqdm(
      total=passages, unit="passage", unit_scale=True, desc="synthetic corpus", disable=not progress,
      mininterval=1.0 if sys.stderr.isatty() else 30.0) as bar:
    for block, lo in enumerate(range(0, passages, BLOCK)):
      n = min(BLOCK, passages - lo)
      lines, count = _corpus_block(np.random.default_rng([seed, 1, block]), lo, n, plan, tsv)
      f.write(b"".join(lines))
      if tsv:
        sizes = np.fromiter(map(len, lines), np.int64, len(lines))
        line_ends.append(f.tell() - sizes.sum() + np.cumsum(sizes))
      word_count += count
      bar.update(n)
  texts = query_texts(plan, seed)
  qids = [str(q) for q in range(len(texts))]  # training queries first, then dev
  splits = {"train": range(plan.train), "dev": range(plan.train, plan.train + plan.dev)}
  judgments = {split: [(q, p) for q in queries for p in plan.positives[
      plan.first_positive[q]:plan.first_positive[q] + plan.positives_per_query[q]].tolist()]
               for split, queries in splits.items()}
  extra = {}
  if tsv:
    extra = _write_msmarco(directory, plan, texts, judgments, np.concatenate(line_ends), seed, triples_per_query,
                           top1000)
  else:
    (directory / "qrels").mkdir(exist_ok=True)
    _write_queries(directory / "queries.jsonl", qids, texts)
    for split, pairs in judgments.items():
      with open(directory / "qrels" / f"{split}.tsv", "w", encoding="ascii") as f:
        f.write("query-id\tcorpus-id\tscore\n")
        f.writelines(f"{q}\t{p}\t1\n" for q, p in pairs)
  train_pairs = int(plan.positives_per_query[:plan.train].sum())
  manifest = {
      "generator": "jdr.data.synthetic", "version": VERSION, "passages": passages, "seed": seed,
      "train_queries": plan.train, "dev_queries": plan.dev, "train_pairs": train_pairs,
      "dev_pairs": int(plan.positives_per_query.sum()) - train_pairs,
      "words_per_passage": round(word_count / passages, 3),
      "words_per_query": round(float(plan.query_words.mean()), 3),
      "vocabulary": VOCABULARY, "zipf_exponent": ZIPF_EXPONENT, "zipf_offset": ZIPF_OFFSET,
      **({"layout": layout, **extra} if tsv else {}),
      "seconds": round(time.perf_counter() - start, 3),
  }
  (directory / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
  return manifest


def _write_msmarco(directory: pathlib.Path, plan: Plan, texts: list[str], judgments: dict, line_ends: np.ndarray,
                   seed: int, triples_per_query: int, top1000: int) -> dict:
  """MS MARCO's files beside collection.tsv (see the module's docstring); returns the manifest's counts."""
  passages = len(line_ends)
  dev = range(plan.train, plan.train + plan.dev)
  # Queries no qrels judge, as most of queries.train.tsv: words from the Zipf law alone, ids after the dev ones.
  rng = np.random.default_rng([seed, 3])
  unjudged = round(plan.train * (MSMARCO_TRAIN_QUERIES_ALL / MSMARCO_TRAIN_QUERIES - 1))
  lengths = np.clip(1 + rng.poisson(QUERY_WORDS - 1, unjudged), *QUERY_RANGE)
  words = word_strings(zipf_ranks(rng, int(lengths.sum())))
  bounds = np.r_[0, np.cumsum(lengths)].tolist()
  first = len(texts)
  with open(directory / "queries.train.tsv", "w", encoding="ascii") as f:
    f.writelines(f"{q}\t{texts[q]}\n" for q in range(plan.train))
    f.writelines(f"{first + i}\t{' '.join(words[bounds[i]:bounds[i + 1]])}\n" for i in range(unjudged))
  with open(directory / "queries.dev.small.tsv", "w", encoding="ascii") as f:
    f.writelines(f"{q}\t{texts[q]}\n" for q in dev)
  for split, name_ in (("train", "train"), ("dev", "dev.small")):
    with open(directory / f"qrels.{name_}.tsv", "w", encoding="ascii") as f:
      f.writelines(f"{q}\t0\t{p}\t1\n" for q, p in judgments[split])
  with open(directory / "collection.tsv", "rb") as corpus, mmap.mmap(corpus.fileno(), 0, access=mmap.ACCESS_READ) as m:
    starts = np.r_[0, line_ends[:-1]]

    def passage(row: int) -> bytes:  # its text: after the pid's tab, before the newline
      line = m[starts[row]:line_ends[row] - 1]
      return line[line.index(b"\t") + 1:]

    def others(rng: np.random.Generator, q: int, k: int) -> np.ndarray:
      """k distinct random passages that are not q's positives."""
      own = plan.positives[plan.first_positive[q]:plan.first_positive[q] + plan.positives_per_query[q]]
      k = min(k, passages - len(own))
      picked = rng.choice(passages - len(own), size=k, replace=False)
      for p in np.sort(own):  # shift past each positive: uniform over the rest
        picked = picked + (picked >= p)
      return picked

    triples = 0
    with open(directory / "triples.train.small.tsv", "wb") as f:
      for q in range(plan.train):
        rng = np.random.default_rng([seed, 4, q])
        own = plan.positives[plan.first_positive[q]:plan.first_positive[q] + plan.positives_per_query[q]]
        negatives = np.resize(others(rng, q, triples_per_query), triples_per_query)  # repeats only when tiny
        query = texts[q].encode("ascii")
        f.writelines(b"%s\t%s\t%s\n" % (query, passage(own[j % len(own)]), passage(n))
                     for j, n in enumerate(negatives.tolist()))
        triples += triples_per_query
    with open(directory / "top1000.dev.tsv", "wb") as f:
      for q in dev:
        rng = np.random.default_rng([seed, 5, q])
        own = plan.positives[plan.first_positive[q]:plan.first_positive[q] + plan.positives_per_query[q]]
        rows = rng.permutation(np.r_[own, others(rng, q, min(top1000, passages) - len(own))])
        query = texts[q].encode("ascii")
        f.writelines(b"%d\t%d\t%s\t%s\n" % (q, r, query, passage(r)) for r in rows.tolist())
  return {"unjudged_train_queries": unjudged, "triples": triples, "top1000_per_query": min(top1000, passages)}


def _write_queries(path: pathlib.Path, qids: list[str], texts: list[str]) -> None:
  with open(path, "w", encoding="ascii") as f:
    f.writelines(f'{{"_id": "{q}", "text": "{t}"}}\n' for q, t in zip(qids, texts))


def dataset(root: str | os.PathLike, passages: int, *, seed: int = 0, progress: bool = True,
            layout: str = "beir", **options) -> pathlib.Path:
  """The dataset's directory under `root`, generated unless a finished one (with synthetic.json) is there;
  `options` are generate's triples_per_query and top1000 (a dataset made with others is not told apart)."""
  root = pathlib.Path(root)
  final = root / name(passages, seed, layout)
  if (final / MANIFEST).exists():
    return final
  if final.exists() and any(final.iterdir()):
    raise FileExistsError(f"{final} exists but has no {MANIFEST}: not a finished synthetic dataset; delete it")
  root.mkdir(parents=True, exist_ok=True)
  tmp = pathlib.Path(tempfile.mkdtemp(dir=root, prefix=f".{final.name}.", suffix=".tmp"))
  try:
    generate(tmp, passages, seed=seed, progress=progress, layout=layout, **options)
    try:
      os.rename(tmp, final)
    except OSError:
      if not (final / MANIFEST).exists():
        raise
      # Another process finished the same dataset first; it is byte for byte this one.
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  return final


def manifest(directory: str | os.PathLike) -> dict:
  return json.loads((pathlib.Path(directory) / MANIFEST).read_text(encoding="utf-8"))


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m jdr.data.synthetic", description=__doc__.splitlines()[0])
  parser.add_argument("--passages", type=int, required=True)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", default="runs/synthetic", help="the folder to make the dataset's folder in")
  parser.add_argument("--layout", choices=LAYOUTS, default="beir",
                      help="beir: corpus.jsonl, queries.jsonl, qrels/; msmarco: MS MARCO's own files, triples and "
                           "top1000 included")
  args = parser.parse_args(argv)
  print(dataset(args.out, args.passages, seed=args.seed, layout=args.layout))


if __name__ == "__main__":
  main()
