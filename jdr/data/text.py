"""Text to token ids, and token ids to padded batches of a few fixed shapes.

A jitted encoder compiles once per input shape, and on CPU every padded position costs as much as a real one.
So sequences are sorted by length, packed into batches, and each batch is padded to the smallest length of a
small fixed set (`default_bucket_lengths`) that holds its longest sequence: a handful of compiled shapes and
little padding. The token-budget mode (`max_tokens`) picks a larger batch for shorter buckets so every batch
costs about the same.
"""

import json
import math
import pathlib
import queue
import re
import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import NamedTuple

import numpy as np

from jdr.runtime import paths


def load_tokenizer(path: str | pathlib.Path, append_eos: bool = False):
  """The Hugging Face tokenizer saved in directory `path` (local or remote), as AutoTokenizer would load it;
  with `append_eos`, one that puts its EOS token after every text (`eos_appended`).

  The class tokenizer_config.json names is the one AutoTokenizer picks; imported by itself it leaves torch
  unloaded, where AutoTokenizer's import pulls torch in through transformers' model configs, a cost in every
  process that only needs to tokenize (docs/performance.md, `encode`). A directory that names no class, or one
  this transformers lacks, goes through AutoTokenizer.
  """
  import transformers  # pylint: disable=g-import-not-at-top  (slow to import; only loaders need it)
  with paths.local_copy(path) as local_path:  # transformers reads local directories only
    config = pathlib.Path(local_path) / "tokenizer_config.json"
    name = json.loads(config.read_text()).get("tokenizer_class") if config.exists() else None
    try:
      named = getattr(transformers, name) if name else None
    except (AttributeError, ImportError):  # not in this transformers, or its backend is not installed
      named = None
    tokenizer = (named or transformers.AutoTokenizer).from_pretrained(str(local_path))
  return eos_appended(tokenizer, str(path)) if append_eos else tokenizer


def eos_appended(tokenizer, source: str = "the tokenizer"):
  """`tokenizer` (changed in place) putting its EOS token after every text, after any special tokens it adds
  already: RepLLaMA's `[BOS] text [EOS]`, the EOS being the token a decoder tower pools. Truncation keeps room
  for it, so a text cut at max_length still ends with EOS. A tokenizer that ends texts with EOS already (E5-Mistral's
  add_eos_token) is left as it is."""
  eos, eos_id = getattr(tokenizer, "eos_token", None), getattr(tokenizer, "eos_token_id", None)
  if eos is None or eos_id is None:
    raise ValueError(f"{source}: model.append_eos needs a tokenizer with an EOS token, and this one has none")
  rust = getattr(tokenizer, "backend_tokenizer", None)
  if rust is None or not getattr(tokenizer, "is_fast", False):
    raise ValueError(f"{source}: model.append_eos needs a fast (Rust-backed) tokenizer")
  if rust.encode("a").ids[-1:] == [eos_id]:
    return tokenizer
  from tokenizers import processors  # pylint: disable=g-import-not-at-top  (present wherever a fast tokenizer is)
  existing = json.loads(rust.to_str()).get("post_processor")
  if existing is not None and existing.get("type") == "TemplateProcessing":
    # One template with EOS added (tokenizers' Sequence of two templates repeats the first's tokens).
    single, pair = _template_pieces(existing["single"]), _template_pieces(existing["pair"])
    specials = [(t, spec["ids"][0]) for t, spec in existing["special_tokens"].items() if len(spec["ids"]) == 1]
    if len(specials) != len(existing["special_tokens"]):
      raise ValueError(f"{source}: model.append_eos cannot extend a post-processor whose special tokens are "
                       "several ids each")
  elif existing is None or existing.get("type") == "ByteLevel":  # ByteLevel's post-processing moves offsets only
    single, pair, specials = ["$A:0"], ["$A:0", "$B:1"], []
  else:
    raise ValueError(f"{source}: model.append_eos cannot extend a {existing.get('type')} post-processor")
  # TemplateProcessing names special tokens by their text; "$A" and "$B" are the texts.
  append = processors.TemplateProcessing(
      single=single + [f"{eos}:0"], pair=pair + [f"{eos}:1"],
      special_tokens=[s for s in specials if s[0] != eos] + [(eos, eos_id)])
  rust.post_processor = append
  return tokenizer


def _template_pieces(template: list[dict]) -> list[str]:
  """A serialized TemplateProcessing template as the strings its constructor takes ("$A:0", "<s>:0")."""
  pieces = []
  for item in template:
    if "Sequence" in item:
      pieces.append(f"${item['Sequence']['id']}:{item['Sequence']['type_id']}")
    else:
      pieces.append(f"{item['SpecialToken']['id']}:{item['SpecialToken']['type_id']}")
  return pieces


def doc_text(doc) -> str:
  """The text a document is encoded as: `title + " " + text`, stripped; just the text when there is no title.

  This is BEIR's convention for sentence-transformers models (what MTEB scores are computed with), so scores
  stay comparable with published ones. `doc` is a `formats.Doc` or a mapping with "title" and "text".
  """
  if isinstance(doc, Mapping):
    title, text = doc.get("title") or "", doc.get("text") or ""
  else:
    title, text = doc.title, doc.text
  return (title + " " + text).strip() if title else text.strip()


class Prompted:
  """A tokenizer that puts `prompt` before every text it is given: a model's query or document prompt (E5's
  "query: " / "passage: ", an instruction, sentence-transformers' "prompts").

  sentence-transformers' meaning: the prompt string is joined to the text, `prompt + text`, and that is
  tokenized, so truncation to max_length counts the prompt's tokens. It behaves as the tokenizer it wraps
  (every attribute is the wrapped one's: special token ids, vocabulary, `len`); its call, `tokenize`,
  `tokenize_in_background`, `passage_tokens` and `TruncatingBackend.of` prepend the prompt, and
  `jdr.data.prepared.tokenizer_fingerprint` names it apart from the bare tokenizer. Made with `prompted`,
  which returns the tokenizer itself for an empty prompt (an unprompted model tokenizes as it always did)."""

  def __init__(self, tokenizer, prompt: str):
    self.tokenizer, self.prompt = tokenizer, prompt

  def __getattr__(self, name):
    if name in ("tokenizer", "prompt"):  # not set yet (a copy being made): never recurse
      raise AttributeError(name)
    return getattr(self.tokenizer, name)

  def __len__(self) -> int:
    return len(self.tokenizer)

  def with_prompt(self, text):
    """`prompt + text` for one text, or for each of a sequence of texts."""
    return self.prompt + text if isinstance(text, str) else [self.prompt + t for t in text]

  def __call__(self, text, *args, **kwargs):
    """The wrapped tokenizer's call on `prompt + text` (a pair's second text, if any, as it is)."""
    return self.tokenizer(self.with_prompt(text), *args, **kwargs)

  def __repr__(self) -> str:
    return f"Prompted({self.prompt!r}, {self.tokenizer!r})"


def prompted(tokenizer, prompt: str | None):
  """`tokenizer` putting `prompt` before every text (a `Prompted`); the tokenizer itself when the prompt is
  empty or None. A Prompted tokenizer's own prompt is replaced, not added to."""
  tokenizer, _ = unprompted(tokenizer)
  return Prompted(tokenizer, prompt) if prompt else tokenizer


def unprompted(tokenizer) -> tuple[object, str]:
  """(the bare tokenizer, its prompt): ("" for a tokenizer that is not a `Prompted`)."""
  if isinstance(tokenizer, Prompted):
    return tokenizer.tokenizer, tokenizer.prompt
  return tokenizer, ""


def prompt_of(tokenizer) -> str:
  """The prompt a tokenizer puts before every text ("" for none)."""
  return unprompted(tokenizer)[1]


def tokenize(tokenizer, texts: Sequence[str], max_length: int, *, chunk_size: int = 2048) -> list[np.ndarray]:
  """Token ids (int32, unpadded, special tokens included, truncated to `max_length`) for each text.

  Exactly what `tokenizer(texts, truncation=True, max_length=max_length)` returns, in chunks so a large corpus
  never holds two full copies of its ids. A fast tokenizer is run through its own Rust `tokenizers.Tokenizer`
  (`TruncatingBackend`), faster on SciFact's documents (docs/performance.md, `encode`); any other
  callable goes through its `__call__`. Queries and documents are tokenized by separate calls, each with its
  own tower's `max_length`. A `Prompted` tokenizer's ids are those of `prompt + text`, truncated after.
  """
  backend = TruncatingBackend.of(tokenizer, max_length)
  out: list[np.ndarray] = []
  for start in range(0, len(texts), chunk_size):
    chunk = list(texts[start:start + chunk_size])
    if backend is not None:
      out.extend(backend.ids(chunk))
      continue
    enc = tokenizer(chunk, truncation=True, max_length=max_length, padding=False,
                    return_attention_mask=False, return_token_type_ids=False)
    out.extend(np.asarray(ids, dtype=np.int32) for ids in enc["input_ids"])
  return out


# Cut only before a space, tab, newline or return: whitespace to every pre-tokenizer and normalizer here.
# Python's \s also matches characters a tokenizer drops or does not split at (\x0b and \x1c are controls
# that BERT's normalizer deletes, joining the words around them).
_CUT_BEFORE = re.compile(r"[ \t\n\r]")
# A text cut before a whitespace character tokenizes to the first tokens of the whole text's when the
# pre-tokenizer always splits where a non-space character meets whitespace (other members of a Sequence may
# only split further, by a character's own class) and the normalizer maps each character on its own: a BPE
# or WordPiece model encodes each pre-token separately.
_SPLITS_AT_WHITESPACE = {"BertPreTokenizer", "Whitespace", "WhitespaceSplit", "ByteLevel"}
_SPLITS_BY_CHARACTER_CLASS = {"Punctuation", "Digits"}
_LOCAL_NORMALIZERS = {"BertNormalizer", "Lowercase", "NFC", "NFD", "NFKC", "NFKD", "StripAccents", "Strip"}


class TruncatingBackend:
  """A fast tokenizer's Rust tokenizer, copied and set to truncate at `max_length`, with no padding.

  Three things make it faster than the wrapper's call, each without changing an id (tested against the
  wrapper on WordPiece, byte-level BPE and SentencePiece tokenizers): `encode_batch_fast` skips the character
  offsets nobody reads; the ids go to numpy without the wrapper's Python lists; and a text far longer than
  `max_length` tokens is cut before the first space, tab or newline past `CHARS_PER_TOKEN * max_length` characters,
  where the pre-tokenizer splits anyway, so the truncated ids are the same unless the cut text came out
  shorter than `max_length` tokens; such a text is tokenized again whole. 71% of SciFact's documents
  exceed 256 tokens (337 on average), and tokenizing the cut-off part was a fifth of the time. The copy keeps
  the wrapper's own backend untouched: the wrapper resets its truncation at every call, from any thread.
  """
  CHARS_PER_TOKEN = 6  # about 4.5 in English text; a text that falls short is redone whole, never wrong
  _cache = weakref.WeakKeyDictionary()  # tokenizer -> {(max_length, side, vocab size): TruncatingBackend}
  _lock = threading.Lock()

  def __init__(self, backend, max_length: int, cut: bool, prompt: str = ""):
    self.backend, self.max_length, self.cut, self.prompt = backend, max_length, cut, prompt
    self._encode = getattr(backend, "encode_batch_fast", backend.encode_batch)

  @classmethod
  def of(cls, tokenizer, max_length: int) -> "TruncatingBackend | None":
    """The backend for `tokenizer` at `max_length`, made once; None when it is not a fast tokenizer. A
    `Prompted` tokenizer's shares its bare tokenizer's copy and puts the prompt before each text."""
    tokenizer, prompt = unprompted(tokenizer)
    backend = cls._of(tokenizer, max_length)
    if backend is None or not prompt:
      return backend
    return cls(backend.backend, backend.max_length, backend.cut, prompt)

  @classmethod
  def _of(cls, tokenizer, max_length: int) -> "TruncatingBackend | None":
    rust = getattr(tokenizer, "backend_tokenizer", None)
    if rust is None or not getattr(tokenizer, "is_fast", False) or not hasattr(rust, "encode_batch"):
      return None
    with cls._lock:
      try:
        by_length = cls._cache.setdefault(tokenizer, {})
      except TypeError:  # not weakly referenceable: made per call
        by_length = {}
      # Tokens added or the truncation side changed after a first call make a new copy.
      key = (max_length, getattr(tokenizer, "truncation_side", "right"), rust.get_vocab_size(with_added_tokens=True))
      if key not in by_length:
        by_length[key] = cls._make(tokenizer, rust, max_length)
      return by_length[key]

  @classmethod
  def _make(cls, tokenizer, rust, max_length: int) -> "TruncatingBackend":
    import tokenizers  # pylint: disable=g-import-not-at-top  (present wherever a fast tokenizer is)
    serialized = rust.to_str()
    spec, copy = json.loads(serialized), tokenizers.Tokenizer.from_str(serialized)
    copy.no_padding()
    side = getattr(tokenizer, "truncation_side", "right")
    copy.enable_truncation(max_length, direction=side)
    cut = (side == "right" and _splits_at_whitespace(spec.get("pre_tokenizer"))
           and _maps_each_character(spec.get("normalizer"))
           and not any(re.search(r"\s", t.get("content", "")) for t in spec.get("added_tokens") or []))
    return cls(copy, max_length, cut)

  def ids(self, texts: list[str]) -> list[np.ndarray]:
    if self.prompt:
      texts = [self.prompt + t for t in texts]
    limit = self.CHARS_PER_TOKEN * self.max_length
    cut = [_cut_before_whitespace(t, limit) for t in texts] if self.cut else texts
    out = [np.asarray(e.ids, dtype=np.int32) for e in self._encode(cut)]
    short = [i for i, (ids, c, t) in enumerate(zip(out, cut, texts))
             if len(ids) < self.max_length and len(c) < len(t)]
    if short:  # cut texts that fell short of max_length tokens: their whole text decides
      for i, enc in zip(short, self._encode([texts[i] for i in short])):
        out[i] = np.asarray(enc.ids, dtype=np.int32)
    return out


def _cut_before_whitespace(text: str, limit: int) -> str:
  if len(text) <= limit:
    return text
  space = _CUT_BEFORE.search(text, limit)
  return text[:space.start()] if space else text


def _members(part: Mapping, key: str) -> list[Mapping]:
  return (part.get(key) or []) if part.get("type") == "Sequence" else [part]


def _splits_at_whitespace(pre_tokenizer: Mapping | None) -> bool:
  """Whether a tokenizer.json pre-tokenizer always splits before whitespace (ByteLevel: with its regex on)."""
  if pre_tokenizer is None:
    return False
  kinds = [(p.get("type"), p.get("use_regex", True)) for p in _members(pre_tokenizer, "pretokenizers")]
  return (any(kind in _SPLITS_AT_WHITESPACE and regex for kind, regex in kinds)
          and all(kind in _SPLITS_AT_WHITESPACE | _SPLITS_BY_CHARACTER_CLASS for kind, _ in kinds))


def _maps_each_character(normalizer: Mapping | None) -> bool:
  return normalizer is None or all(n.get("type") in _LOCAL_NORMALIZERS for n in _members(normalizer, "normalizers"))


FIRST_CHUNK, CHUNK_SIZE = 256, 2048  # tokenize_in_background's chunks: a small first one, then large ones


def chunk_bounds(count: int, first_chunk: int = FIRST_CHUNK, chunk_size: int = CHUNK_SIZE) -> list[tuple[int, int]]:
  """[start, end) of each chunk `tokenize_in_background` cuts `count` texts into."""
  bounds, start, size = [], 0, max(1, first_chunk)
  while start < count:
    bounds.append((start, min(count, start + size)))
    start, size = start + size, max(1, chunk_size)
  return bounds


def tokenize_in_background(tokenizer, texts: Sequence[str], max_length: int, *, first_chunk: int = FIRST_CHUNK,
                           chunk_size: int = CHUNK_SIZE, ahead: int = 4) -> Iterator[tuple[int, list[np.ndarray]]]:
  """`tokenize`'s ids in chunks, (index of the chunk's first text, its ids), made by a background thread up to
  `ahead` chunks before they are taken.

  An accelerator encodes faster than one host tokenizes (on an NVIDIA H200 tokenizing SciFact took most of
  the time of encoding it with a BERT-base: docs/performance.md, `device`), and the fast tokenizer's batch call
  runs outside the GIL, so the two overlap. The first chunk is small so the device starts early. Stopping
  the iteration early stops the thread; a tokenizer error is raised here, in the caller's thread.
  """
  done = object()
  chunks: queue.Queue = queue.Queue(maxsize=ahead)
  stop = threading.Event()

  def put(item) -> bool:
    while not stop.is_set():
      try:
        chunks.put(item, timeout=0.1)
        return True
      except queue.Full:
        continue
    return False

  def work():
    try:
      for start, end in chunk_bounds(len(texts), first_chunk, chunk_size):
        ids = tokenize(tokenizer, texts[start:end], max_length)
        if not put((start, ids)):
          return
      put(done)
    except BaseException as error:  # pylint: disable=broad-except  (handed to the consumer)
      put(error)

  thread = threading.Thread(target=work, name="jdr-tokenize", daemon=True)
  thread.start()
  try:
    while True:
      item = chunks.get()
      if item is done:
        return
      if isinstance(item, BaseException):
        raise item
      yield item
  finally:
    stop.set()
    thread.join()


def passage_tokens(tokenizer, texts: Sequence[str], max_length: int, passages: int,
                   *, chunk_size: int = 2048) -> list[list[np.ndarray]]:
  """Each text as up to `passages` consecutive passages of at most `max_length` tokens, every passage
  wrapped in the model's own [CLS] ... [SEP] (ANCE's MaxP: the first passages * (max_length - 2) content
  tokens; passages=1 is FirstP, the text truncated to max_length). A `Prompted` tokenizer's prompt goes before
  the text, so it is in the first passage only, as the document's text is."""
  if passages < 1:
    raise ValueError(f"passages must be >= 1, got {passages}")
  width = max_length - 2
  out: list[list[np.ndarray]] = []
  cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
  for start in range(0, len(texts), chunk_size):
    enc = tokenizer(list(texts[start:start + chunk_size]), add_special_tokens=False, truncation=True,
                    max_length=passages * width, return_attention_mask=False, return_token_type_ids=False)
    for ids in enc["input_ids"]:
      chunks = [ids[i:i + width] for i in range(0, len(ids), width)] or [[]]
      out.append([np.asarray([cls, *chunk, sep], np.int32) for chunk in chunks])
  return out


def pair_tokens(tokenizer, query: str, doc: str, max_length: int, query_max_length: int | None = None
                ) -> tuple[list[int], list[int]]:
  """(token ids, token type ids) of `[CLS] query [SEP] doc [SEP]` (the model's own special tokens) in at most
  `max_length` tokens: the query keeps up to `query_max_length` tokens (its specials included), the
  document fills the rest; an empty document keeps the pair template (its [SEP]), as sentence-transformers'
  CrossEncoder builds it. One function for training, evaluation and reranking, so they see the same input;
  `pairs_tokens` makes many at once."""
  return pairs_tokens(tokenizer, [(query, doc)], max_length, query_max_length)[0]


def pairs_tokens(tokenizer, pairs: Sequence[tuple[str, str]], max_length: int, query_max_length: int | None = None,
                 *, chunk_size: int = 2048) -> list[tuple[list[int], list[int]]]:
  """`pair_tokens` of each (query, document), in batch calls of the tokenizer: a cross-encoder scores a query
  against many documents, and one call a pair (single-threaded) would bound scoring on an accelerator; a batch
  call runs on every core (docs/performance.md, `cross-encoder`)."""
  specials = tokenizer.num_special_tokens_to_add(pair=True)
  query_room = max_length - specials - 1
  if query_max_length is not None:
    query_room = min(query_max_length - 2, query_room)
  # Cut each query's text after its last kept token, then let the tokenizer's own pair template join it to the
  # document (special tokens, token types); only the document is truncated there.
  # A token covers at least one character, so a query no longer than the room in characters fits as it is.
  long_queries = sorted({q for q, _ in pairs if len(q) > query_room})
  cut = {}
  if long_queries:
    enc = tokenizer(long_queries, add_special_tokens=False, return_offsets_mapping=True)
    for query, ids, offsets in zip(long_queries, enc["input_ids"], enc["offset_mapping"]):
      if len(ids) > query_room:
        cut[query] = query[:offsets[max(query_room, 1) - 1][1]]
  out = []
  for start in range(0, len(pairs), chunk_size):
    chunk = pairs[start:start + chunk_size]
    enc = tokenizer([cut.get(q, q) for q, _ in chunk], [d for _, d in chunk], truncation="only_second",
                    max_length=max_length, return_token_type_ids=True)
    types = enc.get("token_type_ids") or [None] * len(chunk)
    out.extend((list(ids), list(t) if t is not None else [0] * len(ids)) for ids, t in zip(enc["input_ids"], types))
  return out


def default_bucket_lengths(max_length: int, min_length: int = 16) -> list[int]:
  """16, 24, 32, 48, 64, 96, 128, 192, 256, ... up to `max_length` (always included).

  Two lengths per octave: padding a sequence to its bucket wastes at most a third of the batch, while a
  256-token model compiles only nine shapes.
  """
  lengths, n = [], min_length
  while n < max_length:
    lengths += [n, n * 3 // 2] if n * 3 // 2 < max_length else [n]
    n *= 2
  return sorted({x for x in lengths if x < max_length} | {max_length})


class BatchPlan(NamedTuple):
  indices: np.ndarray  # positions in the input, longest sequence first
  rows: int  # batch rows >= len(indices); extra rows are filler (all padding, attention mask 0)
  length: int  # padded sequence length, one of the bucket lengths


def _full_rows(bucket_len: int, *, batch_size: int | None, max_tokens: int | None, multiple_of: int) -> int:
  """Sequences in a full batch of this bucket length (before rounding rows up to `multiple_of`)."""
  if max_tokens is None:
    return batch_size
  rows = max(multiple_of, max_tokens // bucket_len // multiple_of * multiple_of)
  return rows if batch_size is None else max(1, min(rows, batch_size))


def plan_batches(lengths: Sequence[int], *, batch_size: int | None = None, max_tokens: int | None = None,
                 bucket_lengths: Sequence[int] | None = None, multiple_of: int = 1,
                 short_rows_to_power_of_two: bool = False) -> list[BatchPlan]:
  """Groups sequences into batches without touching the ids; `bucketed_batches` fills them in.

  Sequences are taken longest first (a too-large batch fails on the first step, not the last). A batch holds
  `batch_size` sequences, or with `max_tokens` as many as keep rows * bucket length <= max_tokens (at least
  `multiple_of`; `batch_size` then caps it). Rows are rounded up to a multiple of `multiple_of` (e.g. the data
  parallel device count) with filler rows. `bucket_lengths` defaults to `default_bucket_lengths` of the longest
  sequence rounded up to the same grid, so the shapes do not depend on the data.

  `short_rows_to_power_of_two`: a bucket's last batch is usually short, and each odd row count is one more
  compiled shape; padding it to a power of two (capped at a full batch) bounds the shapes at about log2(rows)
  per bucket while wasting less than half of that one batch.
  """
  if batch_size is None and max_tokens is None:
    raise ValueError("give batch_size or max_tokens")
  if multiple_of < 1 or (batch_size is not None and batch_size < 1):
    raise ValueError(f"batch_size and multiple_of must be positive, got {batch_size}, {multiple_of}")
  lengths = np.asarray(lengths, dtype=np.int64)
  if lengths.size == 0:
    return []
  longest = int(lengths.max())
  if bucket_lengths is None:
    bucket_lengths = default_bucket_lengths(max(16, 2 ** math.ceil(math.log2(max(longest, 1)))))
  buckets = np.array(sorted(set(bucket_lengths)), dtype=np.int64)
  if longest > buckets[-1]:
    i = int(np.argmax(lengths))
    raise ValueError(f"sequence {i} has {longest} tokens, more than the largest bucket length {buckets[-1]}")

  def rows_for(bucket_len: int) -> int:
    return _full_rows(bucket_len, batch_size=batch_size, max_tokens=max_tokens, multiple_of=multiple_of)

  order = np.argsort(-lengths, kind="stable")
  plans, start = [], 0
  while start < len(order):
    bucket_len = int(buckets[np.searchsorted(buckets, lengths[order[start]])])
    full = rows_for(bucket_len)
    indices = order[start:start + full]
    start += len(indices)
    rows = len(indices)
    if short_rows_to_power_of_two:
      rows = min(full, 1 << (rows - 1).bit_length())
    plans.append(BatchPlan(indices, -(-rows // multiple_of) * multiple_of, bucket_len))
  return plans


def bucketed_batches(token_ids: Sequence[np.ndarray], *, batch_size: int | None = None, max_tokens: int | None = None,
                     bucket_lengths: Sequence[int] | None = None, pad_id: int = 0,
                     multiple_of: int = 1,
                     short_rows_to_power_of_two: bool = False) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
  """Yields (indices, input_ids int32 [B, L], attention_mask int32 [B, L]); each input index appears once.

  Row i of a batch holds sequence `indices[i]`; rows past `len(indices)` are filler. See `plan_batches` for
  the batching arguments.
  """
  lengths = getattr(token_ids, "lengths", None)  # a prepared corpus's rows know theirs (jdr.data.prepared)
  if lengths is None:
    lengths = [len(ids) for ids in token_ids]
  for plan in plan_batches(lengths, batch_size=batch_size, max_tokens=max_tokens, bucket_lengths=bucket_lengths,
                           multiple_of=multiple_of, short_rows_to_power_of_two=short_rows_to_power_of_two):
    yield plan.indices, *_padded([token_ids[i] for i in plan.indices], plan.rows, plan.length, pad_id)


def _padded(token_ids: Sequence[np.ndarray], rows: int, length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  """(input_ids, attention_mask) int32 [rows, length]: sequence i in row i, filler rows all padding."""
  input_ids = np.full((rows, length), pad_id, dtype=np.int32)
  mask = np.zeros((rows, length), dtype=np.int32)
  for row, ids in enumerate(token_ids):
    input_ids[row, :len(ids)] = ids
    mask[row, :len(ids)] = 1
  return input_ids, mask


def streamed_batches(chunks: Iterable[tuple[int, Sequence[np.ndarray]]], *, bucket_lengths: Sequence[int],
                     batch_size: int | None = None, max_tokens: int | None = None, pad_id: int = 0,
                     multiple_of: int = 1,
                     short_rows_to_power_of_two: bool = False) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
  """`bucketed_batches` over sequences that arrive in chunks ((index of the chunk's first, its ids), in
  order, e.g. from `tokenize_in_background`): a bucket's full batch goes out as soon as that many of its
  sequences have arrived, and what is left at the end is planned as `bucketed_batches` plans it. Full batches
  have the shapes `plan_batches` gives them; only which sequences share a batch differs. The bucket lengths
  are fixed up front (the longest sequence is not known until the end)."""
  buckets = np.array(sorted(set(bucket_lengths)), dtype=np.int64)
  pending: dict[int, list[tuple[int, np.ndarray]]] = {int(b): [] for b in buckets}
  full = {b: _full_rows(b, batch_size=batch_size, max_tokens=max_tokens, multiple_of=multiple_of) for b in pending}
  for first, token_ids in chunks:
    for offset, ids in enumerate(token_ids):
      if len(ids) > buckets[-1]:
        raise ValueError(f"sequence {first + offset} has {len(ids)} tokens, more than the largest bucket length "
                         f"{buckets[-1]}")
      length = int(buckets[np.searchsorted(buckets, len(ids))])
      waiting = pending[length]
      waiting.append((first + offset, ids))
      if len(waiting) == full[length]:
        rows = -(-full[length] // multiple_of) * multiple_of
        yield np.array([i for i, _ in waiting]), *_padded([x for _, x in waiting], rows, length, pad_id)
        waiting.clear()
  rest = [item for b in buckets[::-1] for item in pending[int(b)]]
  if rest:
    where = np.array([i for i, _ in rest])
    for indices, input_ids, mask in bucketed_batches(
        [x for _, x in rest], batch_size=batch_size, max_tokens=max_tokens, bucket_lengths=bucket_lengths,
        pad_id=pad_id, multiple_of=multiple_of, short_rows_to_power_of_two=short_rows_to_power_of_two):
      yield where[indices], input_ids, mask
