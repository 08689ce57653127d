"""jdr.data.prepared: a corpus prepared on disk gives what reading and tokenizing the file directly gives.

The oracles are independent of the prepared code: `formats.read_corpus` (ids, order, documents, error
messages), a Python dict (id lookups) and the Hugging Face tokenizer's own call (token ids, padding)."""

import copy
import dataclasses
import json
import pathlib
import pickle
import random

import ml_collections
import numpy as np
import pytest

from conftest import write_tiny_beir
from jdr.retrieval import encoder_runtime
from jdr.retrieval import encodings
from jdr.data import formats
from jdr.data import pairs
from jdr.data import prepared
from jdr.data import text as text_lib
from jdr.negatives import sampled

WORDS = ["alpha", "beta", "naïve", "café", "中文", "😀", "x-ray", "U.S.", "don't", "1,000", "zzyzx", "Straße"]


@pytest.fixture(scope="module")
def tok(minilm_tokenizer):
  return minilm_tokenizer


@pytest.fixture
def small_chunks(monkeypatch):
  """Chunks of a few documents, so a small corpus spans many and every chunk boundary is crossed."""
  monkeypatch.setattr(prepared, "INDEX_CHUNK", 23)
  monkeypatch.setattr(prepared, "TOKENS_CHUNK", 17)


def _write_corpus(path: pathlib.Path, n: int = 150, seed: int = 0, tsv: bool = False) -> pathlib.Path:
  """Titles or none, numeric and string ids, non-ASCII and escaped text, U+2028 inside a passage, texts past
  any max_length, blank lines, CRLF endings and (JSONL) a byte-order mark."""
  rng = random.Random(seed)
  out = b"" if tsv else b"\xef\xbb\xbf"
  for i in range(n):
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 70)))
    if i % 37 == 5:
      text += "\u2028" + text
    if tsv:
      line = f"{i}\t{text}"
    else:
      doc_id = i if i % 10 == 7 else f"doc-{i}"
      line = json.dumps({"_id": doc_id, "title": "" if i % 3 == 0 else f"Title {i}", "text": text},
                        ensure_ascii=i % 2 == 0)
    out += line.encode() + (b"\r\n" if i % 13 == 0 else b"\n")
    if i % 50 == 10:
      out += b"\n"
  path.write_bytes(out)
  return path


def _folder_bytes(folder: pathlib.Path) -> dict[str, bytes]:
  return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
          if p.is_file() and p.name != prepared.LOCK}


@pytest.mark.parametrize("tsv", [False, True], ids=["corpus.jsonl", "collection.tsv"])
def test_every_row_is_what_the_tokenizer_gives(tmp_path, tok, small_chunks, tsv):
  path = _write_corpus(tmp_path / ("collection.tsv" if tsv else "corpus.jsonl"), tsv=tsv)
  corpus = prepared.prepare(path, tok, 24, tmp_path / "cache", progress=False)
  expected = formats.read_corpus(path)
  assert len(corpus) == len(expected) and list(corpus) == list(expected)
  rows = range(len(expected))
  texts = [text_lib.doc_text(doc) for doc in expected.values()]
  for row, text in enumerate(texts):
    assert corpus.token_ids([row])[0].tolist() == tok(text, truncation=True, max_length=24)["input_ids"], row
  padded = tok(texts, truncation=True, max_length=24, padding="max_length")
  ids, mask = corpus.tokens(rows)
  np.testing.assert_array_equal(ids, padded["input_ids"])
  np.testing.assert_array_equal(mask, padded["attention_mask"])
  assert ids.dtype == mask.dtype == np.int32 and np.load(corpus.tokens_folder / "tokens.npy").dtype == np.uint16
  wide, wide_mask = corpus.tokens([3, 1], 40)  # padded wider: the same ids, then padding
  np.testing.assert_array_equal(wide[:, :24], ids[[3, 1]])
  assert not wide_mask[:, 24:].any() and (wide[:, 24:] == tok.pad_token_id).all()
  with pytest.raises(ValueError, match="more than 8"):
    corpus.tokens(rows, 8)
  assert corpus.docs(rows) == list(expected.values()) == list(corpus.values())
  assert dict(corpus.items()) == expected
  shuffled = np.random.default_rng(0).permutation(len(expected))
  assert corpus.texts(shuffled) == [texts[i] for i in shuffled]
  assert corpus.ids(shuffled) == [list(expected)[i] for i in shuffled]
  again = pickle.loads(pickle.dumps(corpus))
  np.testing.assert_array_equal(again.tokens([5, 0])[0], ids[[5, 0]])


def test_token_rows_feed_batches_as_the_tokenizer_would(tmp_path, tok, small_chunks):
  path = _write_corpus(tmp_path / "corpus.jsonl", n=60)
  corpus = prepared.prepare(path, tok, 24, tmp_path / "cache", progress=False)
  texts = [text_lib.doc_text(doc) for doc in formats.read_corpus(path).values()]
  rows = encoder_runtime.document_tokens(tok, corpus, 24, 7, 31)
  expected = tok(texts[7:31], truncation=True, max_length=24)["input_ids"]
  assert [r.tolist() for r in rows] == expected and rows.lengths.tolist() == [len(e) for e in expected]
  assert [r.tolist() for r in rows[2:5]] == expected[2:5] and rows[-1].tolist() == expected[-1]
  unprepared = encoder_runtime.document_tokens(tok, formats.read_corpus(path), 24, 7, 31)
  assert [r.tolist() for r in unprepared] == expected
  for plan_rows in (rows, unprepared):
    batches = list(text_lib.bucketed_batches(plan_rows, max_tokens=64, pad_id=0))
    assert sorted(i for b in batches for i in b[0]) == list(range(24))


def test_an_interrupted_prepare_resumes_to_the_same_files(tmp_path, tok, small_chunks, monkeypatch):
  path = _write_corpus(tmp_path / "corpus.jsonl")
  clean = prepared.prepare(path, tok, 24, tmp_path / "clean", progress=False)
  n = len(clean)

  class Killed(Exception):
    pass

  real_records, read, die_at = formats.iter_corpus_records, [], {"records": 60, "tokenize": None}

  def records(*args, **kwargs):  # dies after 60 documents: two chunks of 23 are written
    for record in real_records(*args, **kwargs):
      if len(read) == die_at["records"]:
        raise Killed
      read.append(record[0])
      yield record

  monkeypatch.setattr(formats, "iter_corpus_records", records)
  with pytest.raises(Killed):
    prepared.prepare(path, tok, 24, tmp_path / "resumed", progress=False)
  (folder,) = (tmp_path / "resumed").iterdir()
  assert not (folder / prepared.MANIFEST).exists()
  with pytest.raises(FileNotFoundError, match="not a finished prepared corpus"):
    prepared.PreparedCorpus(folder)
  assert len(list((folder / prepared.PARTIAL).glob("index-*.npz"))) == 2

  read.clear()
  die_at.update(records=None, tokenize=3)
  real_tokenize, calls = text_lib.tokenize, []

  def tokenize(*args, **kwargs):  # the index finishes; tokenizing dies in its third chunk
    calls.append(1)
    if len(calls) == die_at["tokenize"]:
      raise Killed
    return real_tokenize(*args, **kwargs)

  monkeypatch.setattr(text_lib, "tokenize", tokenize)
  with pytest.raises(Killed):
    prepared.prepare(path, tok, 24, tmp_path / "resumed", progress=False)
  assert read[0] > 46 and len(read) == n - 46  # read on from the third chunk's first line, not from the start
  (tokens_folder,) = (folder / "tokens").iterdir()
  assert not (tokens_folder / prepared.MANIFEST).exists()
  with pytest.raises(FileNotFoundError):
    prepared.PreparedCorpus(folder, tokens_folder)

  calls.clear()
  die_at["tokenize"] = None
  resumed = prepared.prepare(path, tok, 24, tmp_path / "resumed", progress=False)
  assert len(calls) == -(-n // 17) - 2  # the two finished chunks are not tokenized again
  assert resumed.folder.name == clean.folder.name
  assert _folder_bytes(resumed.folder) == _folder_bytes(clean.folder)
  assert not (resumed.folder / prepared.PARTIAL).exists()


def test_a_changed_corpus_tokenizer_or_length_prepares_again(tmp_path, tok, monkeypatch):
  path = _write_corpus(tmp_path / "corpus.jsonl", n=40)
  cache = tmp_path / "cache"
  first = prepared.prepare(path, tok, 24, cache, progress=False)

  def no_tokenizing(*args, **kwargs):
    raise AssertionError("tokenized again")

  with monkeypatch.context() as patch:
    patch.setattr(text_lib, "tokenize", no_tokenizing)
    again = prepared.prepare(path, tok, 24, cache, progress=False)
  assert (again.folder, again.tokens_folder) == (first.folder, first.tokens_folder)

  shorter = prepared.prepare(path, tok, 16, cache, progress=False)
  assert shorter.folder == first.folder and shorter.tokens_folder != first.tokens_folder
  assert shorter.tokens(range(40))[0].shape == (40, 16)

  other = copy.deepcopy(tok)
  other.add_tokens(["zzyzx"])  # a word of the corpus: it is one token now
  changed = prepared.prepare(path, other, 24, cache, progress=False)
  assert changed.tokens_folder not in (first.tokens_folder, shorter.tokens_folder)
  texts = first.texts(range(40))
  assert [changed.token_ids([r])[0].tolist() for r in range(40)] == other(texts, truncation=True,
                                                                         max_length=24)["input_ids"]
  assert [r.tolist() for r in changed.token_ids(range(40))] != [r.tolist() for r in first.token_ids(range(40))]

  with open(path, "ab") as f:
    f.write(json.dumps({"_id": "new", "text": "a new passage"}).encode() + b"\n")
  with pytest.raises(ValueError, match="has changed or gone since"):
    prepared.PreparedCorpus(first.folder)
  grown = prepared.prepare(path, tok, 24, cache, progress=False)
  assert grown.folder != first.folder and len(grown) == 41 and "new" in grown
  assert not first.folder.exists()  # stale: its offsets no longer read the file it was made from


@pytest.mark.parametrize("collide", [False, True], ids=["fnv", "four-hashes"])
def test_id_lookups_agree_with_a_dict(tmp_path, small_chunks, monkeypatch, collide):
  if collide:  # every id shares its hash with a quarter of the corpus: lookups must compare the ids
    real_many, real_one = prepared.hash_ids, prepared.hash_one
    monkeypatch.setattr(prepared, "hash_ids", lambda blob, offsets: real_many(blob, offsets) & np.uint64(3))
    monkeypatch.setattr(prepared, "hash_one", lambda data: real_one(data) & 3)
  path = _write_corpus(tmp_path / "corpus.jsonl")
  corpus = prepared.prepare(path, out_dir=tmp_path / "cache", progress=False)
  expected = formats.read_corpus(path)
  row = {doc_id: i for i, doc_id in enumerate(expected)}
  ids = list(expected)
  random.Random(1).shuffle(ids)
  np.testing.assert_array_equal(corpus.row_of(ids), [row[d] for d in ids])
  assert corpus.ids(corpus.row_of(ids)) == ids
  assert all(d in corpus and corpus[d] == expected[d] for d in ids)
  assert corpus.id_sequence()[5] == list(expected)[5] and corpus.id_sequence()[-3:] == list(expected)[-3:]
  unknown = ["doc-1000", "doc-", "doc-10 ", "", "7.0", "DOC-1"]  # near misses of real ids
  assert not any(d in corpus for d in unknown) and 7 not in corpus and None not in corpus
  np.testing.assert_array_equal(corpus.row_of(unknown + ["doc-1"], missing=-1), [-1] * 6 + [row["doc-1"]])
  np.testing.assert_array_equal(corpus.contains(["doc-1", "doc-1000"]), [True, False])
  with pytest.raises(KeyError, match=r"doc id 'doc-1000', 'doc-', .* and 1 more not in the corpus .*corpus.jsonl"):
    corpus.row_of(["doc-1"] + unknown)
  with pytest.raises(KeyError):
    corpus["doc-1000"]  # pylint: disable=pointless-statement


def _bad_corpora():
  good = [json.dumps({"_id": f"d{i}", "text": f"text {i}"}) for i in range(40)]
  with_line = lambda i, line: "\n".join(good[:i] + [line] + good[i:]) + "\n"
  return [
      ("bad JSON", "corpus.jsonl", with_line(30, '{"_id": "x", "text": ')),
      ("missing _id", "corpus.jsonl", with_line(3, json.dumps({"text": "x"}))),
      ("empty text", "corpus.jsonl", with_line(25, json.dumps({"_id": "e", "title": " ", "text": ""}))),
      ("duplicate in a chunk", "corpus.jsonl", with_line(5, json.dumps({"_id": "d2", "text": "again"}))),
      ("duplicate across chunks", "corpus.jsonl", with_line(35, json.dumps({"_id": "d1", "text": "again"}))),
      ("duplicate before a bad line", "corpus.jsonl",
       with_line(33, json.dumps({"_id": "d2", "text": "again"})).replace(good[36], "{oops")),
      ("bad UTF-8", "corpus.jsonl", with_line(12, '{"_id": "u", "text": "caf\udce9"}')),
      ("TSV columns", "collection.tsv", "1\tone\n2\ttwo\n3\tthree\tfour\n"),
  ]


@pytest.mark.parametrize("name, file_name, content", _bad_corpora(), ids=[c[0] for c in _bad_corpora()])
def test_a_bad_line_is_named_as_formats_names_it(tmp_path, small_chunks, name, file_name, content):
  del name
  path = tmp_path / file_name
  path.write_bytes(content.encode("utf-8", "surrogateescape"))
  with pytest.raises(formats.DataFormatError) as expected:
    formats.read_corpus(path)
  with pytest.raises(formats.DataFormatError) as got:
    prepared.prepare(path, out_dir=tmp_path / "cache", progress=False)
  assert str(got.value) == str(expected.value) and got.value.line == expected.value.line
  assert str(got.value).startswith(f"{path}:{expected.value.line}: ")
  skipped = prepared.prepare(path, out_dir=tmp_path / "cache", skip_invalid=True, progress=False)
  assert list(skipped) == list(formats.read_corpus(path, skip_invalid=True))


def test_training_batches_read_document_tokens_from_the_map(tmp_path, tok, monkeypatch):
  """Batches over the prepared corpus equal batches over the dict read as before, and the documents' ids and
  mask are the tokenizer's own padded output; no document is tokenized while batching."""
  monkeypatch.setenv("JDR_CACHE", str(tmp_path / "cache"))
  write_tiny_beir(tmp_path / "data", num_docs=60)
  cfg = ml_collections.ConfigDict({"dataset": str(tmp_path / "data"), "source": "files", "train_split": "train",
                                   "eval_split": "test", "train_fraction": 1.0})
  data = pairs.load(cfg, tmp_path / "work")
  assert isinstance(data.corpus, prepared.PreparedCorpus)
  assert data.corpus.folder.parent == tmp_path / "cache" / "prepared"
  expected = formats.read_corpus(tmp_path / "data" / "corpus.jsonl")
  dict_data = dataclasses.replace(data, corpus=expected)
  negatives = sampled.RandomNegatives(list(expected), data.train_qrels)
  make = lambda d, **kw: pairs.Batches(d, tok, batch_size=4, query_max_length=12, doc_max_length=20,
                                       negative_source=negatives, negatives_per_query=2, seed=3, **kw)
  from_map, from_dict = make(data), make(dict_data)
  order = list(expected)
  lengths = []
  real_tokenize = text_lib.tokenize
  monkeypatch.setattr(text_lib, "tokenize", lambda t, texts, n, **kw: (lengths.append(n), real_tokenize(t, texts, n,
                                                                                                        **kw))[1])
  for step in range(6):
    lengths.clear()
    batch = from_map.local(step)
    assert set(lengths) == {12}  # queries only
    _, doc_ids, _ = from_map.global_layout(step)
    padded = tok([text_lib.doc_text(expected[d]) for d in doc_ids], truncation=True, max_length=20,
                 padding="max_length")
    np.testing.assert_array_equal(batch["doc_ids"], padded["input_ids"])
    np.testing.assert_array_equal(batch["doc_mask"], padded["attention_mask"])
    np.testing.assert_array_equal(batch["doc_index"], [order.index(d) for d in doc_ids])
    before = from_dict.local(step)
    assert batch.keys() == before.keys()
    for key in batch:
      np.testing.assert_array_equal(batch[key], before[key], err_msg=key)
  # The duplicate-text keys are the same read from the map's file or from the dict, one per distinct text.
  assert from_map.text_keys(order) == from_dict.text_keys(order)
  assert len(set(from_map.text_keys(order))) == len({text_lib.doc_text(doc) for doc in expected.values()})
  corpus_batches = [make(d, candidates="corpus", in_batch=False) for d in (data, dict_data)]
  for step in range(3):
    np.testing.assert_array_equal(*(b.local(step)["positive_rows"] for b in corpus_batches))


def test_encode_corpus_reads_token_ids_from_the_map(tmp_path, tok, monkeypatch):
  def apply_fn(params, input_ids, attention_mask):  # a 'tower' whose vector says which ids it was given
    del params
    ids = np.asarray(input_ids) * np.asarray(attention_mask)
    return np.stack([attention_mask.sum(1), ids.sum(1), (ids * np.arange(ids.shape[1])).sum(1)], 1).astype(np.float32)

  runtime = encoder_runtime.EncoderRuntime(apply_fn, None, tok, 24, {})
  path = _write_corpus(tmp_path / "corpus.jsonl", n=50)
  corpus = prepared.prepare(path, tok, 24, tmp_path / "cache", progress=False)
  with monkeypatch.context() as patch:
    patch.setattr(text_lib, "tokenize", lambda *a, **k: (_ for _ in ()).throw(AssertionError("tokenized")))
    encodings.encode_corpus(runtime, corpus, tmp_path / "from-map", shard_size=16, tokens_per_batch=96)
  encodings.encode_corpus(runtime, formats.read_corpus(path), tmp_path / "from-dict", shard_size=16,
                           tokens_per_batch=96)
  got, got_ids, _ = encodings.load_embeddings(tmp_path / "from-map")
  want, want_ids, _ = encodings.load_embeddings(tmp_path / "from-dict")
  np.testing.assert_array_equal(got, want)
  assert got_ids == want_ids == list(corpus)


def test_two_processes_preparing_one_corpus_at_once_leave_one_finished_copy(tmp_path):
  """Two runs sharing the prepared-corpus cache start on a new corpus together: both succeed, on one folder."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  data = write_tiny_beir(tmp_path / "d", num_docs=3000)
  code = ("import sys\nfrom jdr.data import prepared\n"
          "c = prepared.prepare(sys.argv[1], out_dir=sys.argv[2], progress=False)\nprint(c.folder, len(c))\n")
  procs = [subprocess.Popen([sys.executable, "-c", code, str(data / "corpus.jsonl"), str(tmp_path / "cache")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
  outs = [p.communicate(timeout=300) for p in procs]
  assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
  folders = {out.split()[0] for out, _ in outs}
  assert len(folders) == 1 and {out.split()[1] for out, _ in outs} == {"3000"}
  assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.startswith(".")] == [pathlib.Path(*folders).name]
