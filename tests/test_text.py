import numpy as np
import pytest

from jdr.data import formats as F
from jdr.data import text as T


def test_doc_text_follows_beir():
  assert T.doc_text(F.Doc("1", "Title", " body ")) == "Title  body"
  assert T.doc_text(F.Doc("1", "", " body ")) == "body"
  assert T.doc_text({"title": "T", "text": ""}) == "T"
  assert T.doc_text({"text": "only"}) == "only"


def test_tokenize_unpadded_and_truncated(minilm_tokenizer):
  tok = minilm_tokenizer
  texts = ["hello world", "a " * 100, "x"]
  ids = T.tokenize(tok, texts, max_length=16, chunk_size=2)
  assert [len(x) for x in ids] == [4, 16, 3]
  assert all(x.dtype == np.int32 and x[0] == tok.cls_token_id and x[-1] == tok.sep_token_id for x in ids)
  assert ids[0].tolist() == tok("hello world")["input_ids"]


def _lengths(n=1000, seed=0):
  return np.random.default_rng(seed).integers(3, 257, size=n)


def _check_cover_and_content(token_ids, batches, buckets, pad_id):
  seen = []
  for indices, input_ids, mask in batches:
    assert input_ids.dtype == mask.dtype == np.int32 and input_ids.shape == mask.shape
    assert input_ids.shape[1] in buckets
    for row, i in enumerate(indices):
      n = len(token_ids[i])
      assert np.array_equal(input_ids[row, :n], token_ids[i]) and (input_ids[row, n:] == pad_id).all()
      assert mask[row].sum() == n and mask[row, :n].all()
    assert not mask[len(indices):].any()  # filler rows are all padding
    seen.extend(indices.tolist())
  assert sorted(seen) == list(range(len(token_ids)))  # every index exactly once


@pytest.mark.parametrize("kwargs", [dict(batch_size=32), dict(batch_size=24, multiple_of=8),
                                    dict(max_tokens=4096, multiple_of=4)])
def test_bucketed_batches_cover_every_index_with_few_shapes(kwargs):
  lengths = _lengths()
  token_ids = [np.arange(1, n + 1, dtype=np.int32) for n in lengths]
  buckets = T.default_bucket_lengths(256)
  batches = list(T.bucketed_batches(token_ids, pad_id=-1, **kwargs))
  _check_cover_and_content(token_ids, batches, buckets, pad_id=-1)
  shapes = {ids.shape for _, ids, _ in batches}
  assert len(shapes) <= len(buckets) + 1
  multiple_of = kwargs.get("multiple_of", 1)
  assert all(ids.shape[0] % multiple_of == 0 for _, ids, _ in batches)
  if "max_tokens" in kwargs:
    assert all(ids.size <= kwargs["max_tokens"] for _, ids, _ in batches)
  plans = T.plan_batches(lengths, bucket_lengths=buckets, **kwargs)
  # Sorted by length, only the bucket rounding pads (two buckets per octave: ~1/6 for uniform lengths), far
  # less than padding every batch to the longest length.
  padding = 1 - sum(int(lengths[p.indices].sum()) for p in plans) / sum(p.rows * p.length for p in plans)
  assert padding < 0.2  # filler rows count as padding too
  assert 1 - lengths.mean() / 256 > 0.45


def test_bucketed_batches_explicit_buckets_and_edges():
  token_ids = [np.ones(n, np.int32) for n in [5, 17, 9, 33, 1]]
  batches = list(T.bucketed_batches(token_ids, batch_size=2, bucket_lengths=[8, 40, 16]))
  assert [(b[0].tolist(), b[1].shape) for b in batches] == [([3, 1], (2, 40)), ([2, 0], (2, 16)), ([4], (1, 8))]
  with pytest.raises(ValueError, match="sequence 3 has 33 tokens"):
    list(T.bucketed_batches(token_ids, batch_size=2, bucket_lengths=[16, 32]))
  with pytest.raises(ValueError, match="batch_size or max_tokens"):
    T.plan_batches([3])
  assert list(T.bucketed_batches([], batch_size=4)) == []


def test_default_bucket_lengths():
  assert T.default_bucket_lengths(256) == [16, 24, 32, 48, 64, 96, 128, 192, 256]
  assert T.default_bucket_lengths(100)[-1] == 100 and T.default_bucket_lengths(8) == [8]
  # Default buckets come from the fixed grid, not the data's exact longest length.
  plans = T.plan_batches([70, 20], batch_size=1)
  assert [p.length for p in plans] == [96, 24]


def test_short_rows_round_up_to_a_power_of_two():
  """A bucket's short last batch gets a power-of-two row count (never above a full batch); all indices once."""
  def shapes(lengths):
    plans = T.plan_batches(lengths, max_tokens=256, bucket_lengths=[32, 128], short_rows_to_power_of_two=True)
    assert sorted(i for p in plans for i in p.indices) == list(range(len(lengths)))
    assert all(p.rows * p.length <= 256 for p in plans)
    return [(len(p.indices), p.rows, p.length) for p in plans]

  assert shapes([30] * 13) == [(8, 8, 32), (5, 8, 32)]  # 5 -> 8 rows, a full batch
  assert shapes([30] * 11) == [(8, 8, 32), (3, 4, 32)]  # 3 -> 4
  assert shapes([100] * 5) == [(2, 2, 128), (2, 2, 128), (1, 1, 128)]  # never above a full batch


def _chunks(token_ids, sizes):
  start = 0
  for size in sizes:
    yield start, token_ids[start:start + size]
    start += size


@pytest.mark.parametrize("kwargs", [dict(max_tokens=4096, multiple_of=4, short_rows_to_power_of_two=True),
                                    dict(batch_size=24, multiple_of=8)])
def test_streamed_batches_cover_every_index_with_the_planned_shapes(kwargs):
  """Chunks of any size: every sequence once with its own ids, full batches as soon as a bucket fills, and no
  shape or padding that planning all sequences at once would not also give (within one short batch a bucket)."""
  lengths = _lengths()
  token_ids = [np.arange(1, n + 1, dtype=np.int32) for n in lengths]
  buckets = T.default_bucket_lengths(256)
  whole = list(T.bucketed_batches(token_ids, bucket_lengths=buckets, pad_id=-1, **kwargs))
  for sizes in ([1000], [1] * 10 + [990], [7] * 142 + [6], [256, 2048]):
    batches = list(T.streamed_batches(_chunks(token_ids, sizes), bucket_lengths=buckets, pad_id=-1, **kwargs))
    _check_cover_and_content(token_ids, batches, buckets, pad_id=-1)
    assert {ids.shape for _, ids, _ in batches} <= {ids.shape for _, ids, _ in whole} | {
        (r, b) for b in buckets for r in (1, 2, 4, 8, 16, 24, 32, 64, 128, 256)}
    assert all(ids.shape[0] % kwargs["multiple_of"] == 0 for _, ids, _ in batches)
    assert len(batches) <= len(whole) + len(buckets)
    cells = lambda bs: sum(ids.size for _, ids, _ in bs)
    assert cells(batches) <= 1.1 * cells(whole)


def test_streamed_batches_send_a_full_bucket_before_the_rest_arrives():
  token_ids = [np.ones(n, np.int32) for n in [30, 30, 100, 30, 30, 30]]
  seen = []

  def chunks():
    for i, ids in enumerate(token_ids):
      seen.append(i)
      yield i, [ids]

  batches = T.streamed_batches(chunks(), bucket_lengths=[32, 128], batch_size=4)
  indices, ids, _ = next(batches)
  assert indices.tolist() == [0, 1, 3, 4] and ids.shape == (4, 32) and seen == [0, 1, 2, 3, 4]
  assert [(i.tolist(), x.shape) for i, x, _ in batches] == [([2, 5], (2, 128))]
  with pytest.raises(ValueError, match="sequence 2 has 100 tokens"):
    list(T.streamed_batches(chunks(), bucket_lengths=[32, 64], batch_size=4))


def test_tokenize_in_background_equals_tokenize(minilm_tokenizer):
  texts = [f"text number {i} " + "word " * (i % 40) for i in range(300)]
  want = T.tokenize(minilm_tokenizer, texts, 32)
  chunks = list(T.tokenize_in_background(minilm_tokenizer, texts, 32, first_chunk=7, chunk_size=50, ahead=2))
  assert [start for start, _ in chunks] == [0] + list(range(7, 300, 50))
  got = [ids for _, part in chunks for ids in part]
  assert len(got) == 300 and all(np.array_equal(a, b) for a, b in zip(got, want))


def test_tokenize_in_background_raises_the_tokenizers_error_and_stops_when_dropped():
  import threading  # pylint: disable=g-import-not-at-top

  class Failing:
    def __call__(self, texts, **kwargs):
      if "bad" in texts:
        raise RuntimeError("cannot tokenize this")
      return {"input_ids": [[1, 2]] * len(texts)}

  texts = ["ok"] * 10 + ["bad"]
  with pytest.raises(RuntimeError, match="cannot tokenize this"):
    list(T.tokenize_in_background(Failing(), texts, 8, first_chunk=4, chunk_size=4))
  stream = T.tokenize_in_background(Failing(), ["ok"] * 1000, 8, first_chunk=1, chunk_size=1, ahead=1)
  assert next(stream)[0] == 0
  stream.close()  # a consumer that stops early ends the thread
  assert not any(t.name == "jdr-tokenize" for t in threading.enumerate())


def _random_texts(seed: int, count: int = 400) -> list[str]:
  """Texts around and far past a small max_length: words of 1-20 characters (some one long token), accents,
  CJK, punctuation, digits, runs of spaces, tabs and newlines, and texts without any whitespace."""
  rng = np.random.default_rng(seed)
  words = ["the", "a", "international", "organization", "café", "naïve", "東京", "2024", "x" * 20, "(see", "fig.",
           "3b);", "don't", "ÉCOLE", "über-long", "q"]
  # Python's \s also matches characters a tokenizer drops (\x0b, \x1c: controls to BERT's normalizer) or does
  # not split at: a cut there would change the word it falls in.
  spaces = [" ", " ", " ", "  ", "\n", "\t", " \n ", "\x0b", "\x1c", "\xa0", "\u3000"]
  texts = []
  for _ in range(count):
    n = int(rng.integers(0, 200))
    parts = []
    for _ in range(n):
      parts += [words[rng.integers(len(words))], spaces[rng.integers(len(spaces))]]
    text = "".join(parts)
    texts.append(text.replace(" ", "") if rng.random() < 0.05 else text)
  # A cut at \x1c would keep "x" * 60 as a word where BERT's normalizer drops \x1c and joins the two halves
  # into one word of 120 characters, past WordPiece's 100: [UNK].
  joined = "a a a a a " + "x" * 60 + "\x1c" + "y" * 60 + " end " * 40
  return texts + ["", " ", "international " * 300, "y" * 5000, "word " * 2000, joined]


def _wrapper_ids(tokenizer, texts, max_length):
  enc = tokenizer(texts, truncation=True, max_length=max_length)
  return [list(ids) for ids in enc["input_ids"]]


def _trained_tokenizer(kind: str):
  """A small WordPiece-free tokenizer trained here: byte-level BPE (RoBERTa's kind) or a SentencePiece-style
  Unigram with Metaspace, wrapped as transformers would load it."""
  tokenizers = pytest.importorskip("tokenizers")
  transformers = pytest.importorskip("transformers")
  from tokenizers import decoders, models, pre_tokenizers, processors, trainers  # pylint: disable=g-import-not-at-top
  corpus = _random_texts(1, 200) + ["The quick brown fox jumps over the lazy dog."] * 20
  if kind == "bpe":
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>", "<pad>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.RobertaProcessing(("</s>", 1), ("<s>", 0))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>")
  tok = tokenizers.Tokenizer(models.Unigram())
  tok.pre_tokenizer = pre_tokenizers.Metaspace()
  tok.train_from_iterator(corpus, trainers.UnigramTrainer(vocab_size=300, special_tokens=["<pad>", "</s>"]))
  tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
  return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>")


@pytest.mark.parametrize("max_length", [8, 16, 64])
def test_tokenize_equals_the_tokenizers_own_call_wordpiece(minilm_tokenizer, max_length):
  texts = _random_texts(max_length)
  assert T.TruncatingBackend.of(minilm_tokenizer, max_length).cut  # the cut texts are what is checked
  got = T.tokenize(minilm_tokenizer, texts, max_length, chunk_size=97)
  assert [g.tolist() for g in got] == _wrapper_ids(minilm_tokenizer, texts, max_length)
  assert all(g.dtype == np.int32 for g in got)


@pytest.mark.slow
@pytest.mark.parametrize("kind, cuts", [("bpe", True), ("unigram", False)])
def test_tokenize_equals_the_tokenizers_own_call_bpe_and_sentencepiece(kind, cuts):
  tokenizer = _trained_tokenizer(kind)
  assert T.TruncatingBackend.of(tokenizer, 16).cut == cuts  # Metaspace splits only at " ": never cut
  for max_length in (8, 16, 48):
    texts = _random_texts(100 + max_length)
    got = T.tokenize(tokenizer, texts, max_length)
    assert [g.tolist() for g in got] == _wrapper_ids(tokenizer, texts, max_length)


def test_tokenize_truncating_on_the_left_keeps_the_end(minilm_tokenizer):
  transformers = pytest.importorskip("transformers")
  left = transformers.AutoTokenizer.from_pretrained(minilm_tokenizer.name_or_path, truncation_side="left")
  texts = _random_texts(5, 50)
  assert not T.TruncatingBackend.of(left, 16).cut
  assert [g.tolist() for g in T.tokenize(left, texts, 16)] == _wrapper_ids(left, texts, 16)
  text = "first " + "middle " * 100 + "last"
  kept = [left.convert_ids_to_tokens(T.tokenize(tok, [text], 8)[0].tolist()) for tok in (left, minilm_tokenizer)]
  assert kept[0][-2] == "last" and kept[1][1] == "first"


def test_tokenize_leaves_the_tokenizer_as_it_was(minilm_tokenizer):
  before = minilm_tokenizer.backend_tokenizer.to_str()
  T.tokenize(minilm_tokenizer, ["a long text " * 100], 8)
  assert minilm_tokenizer.backend_tokenizer.to_str() == before
  assert len(minilm_tokenizer("a long text " * 100)["input_ids"]) > 8  # its own calls do not truncate


def test_tokenize_sees_tokens_added_after_a_first_call():
  tokenizer = _trained_tokenizer("bpe")
  text = "a brandnewword here " * 3
  T.tokenize(tokenizer, [text], 16)
  tokenizer.add_tokens(["brandnewword"])
  assert [g.tolist() for g in T.tokenize(tokenizer, [text], 16)] == _wrapper_ids(tokenizer, [text], 16)


def _one_pair(tokenizer, query, doc, max_length, query_max_length):
  """A pair by itself: the query cut after its last kept token, then the pair."""
  room = max_length - tokenizer.num_special_tokens_to_add(pair=True) - 1
  if query_max_length is not None:
    room = min(query_max_length - 2, room)
  enc = tokenizer(query, add_special_tokens=False, return_offsets_mapping=True)
  if len(enc["input_ids"]) > room:
    query = query[:enc["offset_mapping"][max(room, 1) - 1][1]]
  # A batch of one: a lone call with an empty document would drop the pair template (and its second [SEP]).
  pair = tokenizer([query], [doc], truncation="only_second", max_length=max_length, return_token_type_ids=True)
  ids = list(pair["input_ids"][0])
  return ids, list(pair["token_type_ids"][0] if pair.get("token_type_ids") else [0] * len(ids))


@pytest.mark.parametrize("kind", ["wordpiece", "bpe"])
def test_pairs_tokens_in_batches_equal_one_call_a_pair(kind, minilm_tokenizer):
  tokenizer = minilm_tokenizer if kind == "wordpiece" else _trained_tokenizer("bpe")
  texts = _random_texts(7, 60)
  queries = [t[:k] for t, k in zip(texts[:12], [0, 3, 10, 40, 80, 200, 500, 5, 60, 90, 1000, 30])]
  pairs = [(queries[i % len(queries)], texts[(5 * i) % len(texts)]) for i in range(90)]
  for max_length, query_max_length in ((32, None), (48, 12), (24, 40)):
    want = [_one_pair(tokenizer, q, d, max_length, query_max_length) for q, d in pairs]
    assert T.pairs_tokens(tokenizer, pairs, max_length, query_max_length, chunk_size=17) == want
    assert T.pair_tokens(tokenizer, *pairs[5], max_length, query_max_length) == want[5]
  empty = T.pair_tokens(tokenizer, "query", "", 32)[0]  # an empty document keeps the pair template
  assert empty == _one_pair(tokenizer, "query", "", 32, None)[0] and len(empty) == len(tokenizer("query")["input_ids"]) + (
      tokenizer.num_special_tokens_to_add(pair=True) - tokenizer.num_special_tokens_to_add(pair=False))


def _llama_like_tokenizer(tmp_path, post_processor="bos"):
  """A tiny fast tokenizer that adds BOS as Llama's does (or ends nothing, ByteLevel, as Qwen's), saved."""
  import transformers  # pylint: disable=g-import-not-at-top
  from tokenizers import Tokenizer, models, pre_tokenizers, processors  # pylint: disable=g-import-not-at-top
  vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate("a b c d e f".split())}}
  tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.post_processor = (processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
                        if post_processor == "bos" else processors.ByteLevel(trim_offsets=False))
  fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                              unk_token="<unk>", pad_token="<unk>")
  fast.save_pretrained(str(tmp_path))
  return tmp_path


@pytest.mark.parametrize("post_processor", ["bos", "bytelevel"])
def test_append_eos_ends_every_text_with_eos_within_max_length(tmp_path, post_processor):
  path = _llama_like_tokenizer(tmp_path, post_processor)
  tok = T.load_tokenizer(path, append_eos=True)
  bos = [1] if post_processor == "bos" else []
  got = T.tokenize(tok, ["a b c d e f", "a"], 5)
  assert [list(x) for x in got] == [bos + [3, 4, 5, 6][:4 - len(bos)] + [2], bos + [3, 2]]
  assert tok(["a b"])["input_ids"] == [bos + [3, 4, 2]]  # the wrapper's call agrees
  assert [list(x) for x in T.tokenize(T.prompted(tok, "f "), ["a"], 8)] == [bos + [8, 3, 2]]
  T.eos_appended(tok)  # a second time changes nothing
  assert [list(x) for x in T.tokenize(tok, ["a"], 5)] == [bos + [3, 2]]
  plain = T.load_tokenizer(path)
  assert [list(x) for x in T.tokenize(plain, ["a"], 5)] == [bos + [3]]


def test_append_eos_needs_an_eos_token():
  from jdr.models import hf  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match="needs a tokenizer with an EOS token"):
    T.load_tokenizer(hf.minilm_path(), append_eos=True)
