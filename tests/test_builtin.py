import json
import os
import subprocess
import sys
import textwrap

import pytest

from jdr.data import builtin as B
from jdr.data import formats as F

_REST = "This paragraph says enough about the {} to make a document: " + "it explains details " * 4

FAKE_STDLIB = {
    "json/__init__.py": f'''
        """JSON encoder and decoder for Python objects.

        {_REST.format('module')}
        """
        def dumps(obj, *, skipkeys=False, indent=None):
            """Serialize obj to a JSON formatted str.

            {_REST.format('dumps')}
            """
        def _private(x):
            """Private helper is never part of the corpus.

            {_REST.format('private')}
            """
        ''',
    "json/tool.py": f'''
        class Tool(Base):
            """A command line tool class for json.

            {_REST.format('Tool')}
            """
            def run(self, args, /, *, verbose=False) -> int:
                """Run the tool with the given arguments.

                {_REST.format('run')}
                """
            @staticmethod
            def helper(a, b):
                """Serialize obj to a JSON formatted str.

                The same summary again under another name is a duplicate and is dropped here.
                {_REST.format('helper')}
                """
            def short(self):
                """A summary with too little rest.

                Short.
                """
            def runon(self):
                """A summary that runs on
                to a second line, still kept as a distractor: {_REST.format('runon')}
                """
        ''',
    "test/test_json.py": f'def f():\n    """Tests are skipped entirely here.\n\n    {_REST.format("test")}\n    """\n',
    "idlelib/x.py": f'def f():\n    """Idle is skipped entirely here.\n\n    {_REST.format("idle")}\n    """\n',
    "_private.py": f'def f():\n    """Private modules are skipped.\n\n    {_REST.format("private module")}\n    """\n',
    "broken.py": "def (:\n",
}


@pytest.fixture
def fake_stdlib(tmp_path):
  for rel, source in FAKE_STDLIB.items():
    path = tmp_path / "lib" / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source))
  return tmp_path / "lib"


def test_build_on_fake_stdlib(fake_stdlib):
  items = {doc.id: (doc, summary) for doc, summary in B.build(str(fake_stdlib))}
  assert set(items) == {"json", "json.dumps", "json.tool.Tool", "json.tool.Tool.run", "json.tool.Tool.runon"}
  doc, summary = items["json.dumps"]
  assert summary == "Serialize obj to a JSON formatted str."
  assert doc.title == "json.dumps"
  assert doc.text.startswith("json.dumps(obj, *, skipkeys=False, indent=None)\nThis paragraph says enough")
  assert summary not in doc.text  # the query is held out of its document
  assert items["json.tool.Tool.run"][0].text.startswith("json.tool.Tool.run(args, /, *, verbose=False) -> int\n")
  assert items["json.tool.Tool"][0].text.startswith("class json.tool.Tool(Base)\n")
  assert items["json"][0].text.startswith("module json\n")
  assert items["json.tool.Tool.runon"][1] is None  # a run-on summary makes a distractor, not a query


def test_build_is_deterministic_across_processes(fake_stdlib):
  code = ("import sys, json; from jdr.data import builtin as B; "
          "print(json.dumps([[d.id, d.text, s] for d, s in B.build(sys.argv[1])]))")
  outs = [subprocess.run([sys.executable, "-c", code, str(fake_stdlib)], check=True, capture_output=True, text=True,
                         env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ["1", "2"]]
  assert outs[0] == outs[1] and json.loads(outs[0])


@pytest.mark.slow
def test_builtin_dataset_sizes_and_ids():
  corpus, queries, qrels = B.builtin_dataset()
  assert 800 <= len(corpus) <= B.MAX_DOCS
  assert len(queries) == len(qrels) == B.TEST_QUERIES
  assert list(queries) == list(qrels)
  train_corpus, train_queries, train_qrels = B.builtin_dataset("train")
  assert train_corpus == corpus and len(train_queries) >= 300
  assert not set(train_qrels) & set(qrels)  # the splits share no query
  for qid, docs in qrels.items():
    assert len(docs) == 1 and all(d in corpus for d in docs) and qid not in corpus
    (doc_id,) = docs
    assert queries[qid] not in corpus[doc_id].text
  assert len(set(q.lower() for q in queries.values())) == len(queries)
  assert not any(d.id.startswith(("test.", "idlelib.", "tkinter.", "lib2to3.")) for d in corpus.values())
  assert B.builtin_dataset() == (corpus, queries, qrels)


def test_write_builtin_is_idempotent_and_valid_beir(tmp_path):
  B.write_builtin(tmp_path)
  files = sorted(p for p in tmp_path.rglob("*") if p.is_file())
  assert [p.relative_to(tmp_path).as_posix() for p in files] == [
      "corpus.jsonl", "qrels/test.tsv", "qrels/train.tsv", "queries.jsonl"]
  first = [p.read_bytes() for p in files]
  B.write_builtin(tmp_path)
  assert [p.read_bytes() for p in files] == first
  assert F.load_beir(tmp_path, "test") == B.builtin_dataset("test")
  assert F.load_beir(tmp_path, "train") == B.builtin_dataset("train")


def test_writing_the_builtin_again_leaves_the_files_untouched(tmp_path):
  """A second write (another run on the same workdir) changes no file's time, so a prepared corpus made from the
  first copy stays valid; a file that differs is replaced whole."""
  directory = B.write_builtin(tmp_path / "b")
  stamps = {p: os.stat(p).st_mtime_ns for p in directory.rglob("*") if p.is_file()}
  os.utime(directory / "corpus.jsonl", ns=(1, 1))
  stamps[directory / "corpus.jsonl"] = 1
  (directory / "queries.jsonl").write_text("damaged")
  B.write_builtin(tmp_path / "b")
  assert os.stat(directory / "corpus.jsonl").st_mtime_ns == 1  # same bytes: not rewritten
  assert (directory / "queries.jsonl").read_text() != "damaged"
  assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left
