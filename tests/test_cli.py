"""Command lines on bad input: one `error: FILE:LINE: reason` line (no traceback) and exit status 2."""

import json
import pathlib

import pytest

from jdr import demo
from jdr import encode
from jdr import evaluate
from jdr import export
from jdr import retrieve
from jdr import train

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _exit_code_and_stderr(capsys, main, argv):
  capsys.readouterr()
  with pytest.raises(SystemExit) as exit_info:
    main([str(a) for a in argv])
  return exit_info.value.code, capsys.readouterr().err


def _assert_reported(code, err, where, skip_hint=True):
  lines = [line for line in err.splitlines() if line.strip()]
  assert code == 2, err
  assert "Traceback" not in err
  errors = [i for i, line in enumerate(lines) if line.startswith("error: ")]
  assert len(errors) == 1 and lines[errors[0]].startswith(f"error: {where}"), err
  if skip_hint:
    assert "--skip-invalid" in lines[errors[0] + 1], err


def _write_lines(path, lines):
  path.write_text("".join(line + "\n" for line in lines))
  return path


def test_encode_reports_a_bad_corpus_line(tmp_path, capsys):
  corpus = _write_lines(tmp_path / "corpus.jsonl", [
      json.dumps({"_id": "d1", "title": "", "text": "one"}),
      json.dumps({"_id": "d2", "title": "", "text": "two"}),
      '{"_id": "d3", "text": ',
  ])
  # The corpus is read before the model is loaded: no model is needed to find the bad line.
  code, err = _exit_code_and_stderr(capsys, encode.main, ["--model", tmp_path / "no-model", "--corpus", corpus,
                                                          "--out", tmp_path / "emb"])
  _assert_reported(code, err, f"{corpus}:3: malformed line")
  assert not (tmp_path / "emb").exists()


def test_encode_reports_a_missing_model(tmp_path, tiny_beir, capsys):
  code, err = _exit_code_and_stderr(capsys, encode.main, ["--model", tmp_path / "no-model", "--corpus", tiny_beir,
                                                          "--out", tmp_path / "emb"])
  _assert_reported(code, err, "", skip_hint=False)
  assert str(tmp_path / "no-model") in err
  assert "load_hf" not in err and "no such directory, and not a Hugging Face hub id" in err  # what it is, not where it failed


def test_messages_read_as_sentences(tmp_path, capsys):
  corpus = _write_lines(tmp_path / "corpus.jsonl", ['{"_id": "d1", "text": "never closed'])
  code, err = _exit_code_and_stderr(capsys, encode.main, ["--model", "minilm", "--corpus", corpus, "--out",
                                                          tmp_path / "emb"])
  _assert_reported(code, err, f"{corpus}:1: malformed line: bad JSON (Unterminated string starting at column 23)")
  assert "at at" not in err
  # Each command's --help opens with its docstring's whole first sentence, not a line cut mid-sentence.
  from jdr import rerank, train  # pylint: disable=g-import-not-at-top
  for module in (demo, encode, evaluate, export, rerank, retrieve, train):
    first = module.__doc__.splitlines()[0]
    assert first.endswith("."), (module.__name__, first)


def test_bm25_says_nothing_below_warning(tmp_path):
  """bm25s turns its own logger to DEBUG; a program with a logging handler must not print its debug lines."""
  import logging  # pylint: disable=g-import-not-at-top
  from jdr.negatives import sampled  # pylint: disable=g-import-not-at-top
  records = []
  handler = logging.Handler()
  handler.emit = records.append
  logging.getLogger().addHandler(handler)
  try:
    sampled.BM25Negatives({"d1": {"title": "", "text": "alpha beta"}, "d2": {"title": "", "text": "gamma"}},
                          {"q1": "alpha"}, {"q1": {"d1": 1}}, top_k=1, cache_dir=tmp_path, show_progress=False)
  finally:
    logging.getLogger().removeHandler(handler)
  assert not [r.getMessage() for r in records if r.name.startswith("bm25s") and r.levelno < logging.WARNING]


def test_retrieve_reports_bad_queries_and_qrels(tmp_path, tiny_beir, capsys):
  queries = _write_lines(tmp_path / "queries.tsv", ["q1\tfirst query", "q2 no tab here"])
  code, err = _exit_code_and_stderr(capsys, retrieve.main, ["--index", tmp_path / "emb", "--queries", queries,
                                                            "--run", tmp_path / "run.trec"])
  _assert_reported(code, err, f"{queries}:2: malformed line")

  qrels = tiny_beir / "qrels" / "test.tsv"
  qrels.write_text(qrels.read_text() + "q31\td31\tnot-a-number\n")
  line = len(qrels.read_text().splitlines())
  code, err = _exit_code_and_stderr(capsys, retrieve.main, ["--index", tmp_path / "emb", "--queries", tiny_beir,
                                                            "--split", "test", "--run", tmp_path / "run.trec"])
  _assert_reported(code, err, f"{qrels}:{line}: malformed line: relevance 'not-a-number'")


def test_retrieve_reports_a_missing_index_and_split(tmp_path, tiny_beir, capsys):
  code, err = _exit_code_and_stderr(capsys, retrieve.main, ["--index", tmp_path / "emb", "--queries", tiny_beir,
                                                            "--run", tmp_path / "run.trec"])
  _assert_reported(code, err, f"{tmp_path / 'emb' / 'meta.json'}: no meta.json", skip_hint=False)
  code, err = _exit_code_and_stderr(capsys, retrieve.main, ["--index", tmp_path / "emb", "--queries", tiny_beir,
                                                            "--split", "dev", "--run", tmp_path / "run.trec"])
  _assert_reported(code, err, "--split dev:", skip_hint=False)


def test_evaluate_reports_bad_lines_and_skips_them_when_asked(tmp_path, capsys):
  qrels = _write_lines(tmp_path / "qrels.trec", ["q1 0 d1 1", "q2 0 d2 1"])
  run = _write_lines(tmp_path / "run.trec", ["q1 Q0 d1 1 0.5 t", "q1 Q0 d2 2", "q2 Q0 d2 1 0.4 t"])
  code, err = _exit_code_and_stderr(capsys, evaluate.main, ["--qrels", qrels, "--run", run])
  _assert_reported(code, err, f"{run}:2: malformed line: expected 6 columns")

  bad_qrels = _write_lines(tmp_path / "bad-qrels.trec", ["q1 0 d1 1", "q2 0 d2 high"])
  code, err = _exit_code_and_stderr(capsys, evaluate.main, ["--qrels", bad_qrels, "--run", run])
  _assert_reported(code, err, f"{bad_qrels}:2: malformed line: relevance 'high'")

  capsys.readouterr()
  results = evaluate.main(["--qrels", str(qrels), "--run", str(run), "--metrics", "mrr@10", "--skip-invalid"])
  assert results == {"mrr@10": 1.0}
  assert f"skipped 1 invalid record in {run}" in capsys.readouterr().err

  code, err = _exit_code_and_stderr(capsys, evaluate.main, ["--qrels", tmp_path / "absent.trec", "--run", run])
  _assert_reported(code, err, f"{tmp_path / 'absent.trec'}: No such file", skip_hint=False)
  other = _write_lines(tmp_path / "other.trec", ["zz Q0 d1 1 0.5 t"])
  code, err = _exit_code_and_stderr(capsys, evaluate.main, ["--qrels", qrels, "--run", other])
  _assert_reported(code, err, "no query to evaluate", skip_hint=False)


def test_export_reports_a_missing_or_empty_workdir(tmp_path, capsys):
  code, err = _exit_code_and_stderr(capsys, export.main, ["--workdir", tmp_path / "absent", "--out", tmp_path / "o"])
  _assert_reported(code, err, f"--workdir {tmp_path / 'absent'}: no such directory", skip_hint=False)
  (tmp_path / "w" / "checkpoints").mkdir(parents=True)
  code, err = _exit_code_and_stderr(capsys, export.main, ["--workdir", tmp_path / "w", "--out", tmp_path / "o"])
  _assert_reported(code, err, f"{tmp_path / 'w'}: a jdr workdir needs model.json", skip_hint=False)


def test_demo_reports_an_unusable_workdir(tmp_path, capsys):
  not_a_dir = tmp_path / "file"
  not_a_dir.write_text("")
  code, err = _exit_code_and_stderr(capsys, demo.main, ["--workdir", not_a_dir])
  _assert_reported(code, err, str(not_a_dir), skip_hint=False)


@pytest.mark.parametrize("key,value,valid", [("log_every", 0, ">= 1"), ("log_every", -2, ">= 1"),
                                             ("checkpoint_every", -1, ">= 0"), ("eval_every", -5, ">= 0")])
def test_train_refuses_an_unusable_interval_before_any_work(tmp_path, capsys, key, value, valid):
  """The dataset does not exist either: the interval's error comes first, so it is checked before anything is
  loaded, and no workdir is left behind."""
  code, err = _exit_code_and_stderr(capsys, train.main, [
      "--config", ROOT / "configs" / "demo.py", "--workdir", tmp_path / "w",
      f"--config.data.dataset={tmp_path / 'absent'}", f"--config.{key}={value}"])
  _assert_reported(code, err, f"{key}={value}: must be an integer {valid} (", skip_hint=False)
  assert not (tmp_path / "w").exists()


def test_train_refuses_an_old_key_with_its_new_name(tmp_path, capsys):
  code, err = _exit_code_and_stderr(capsys, train.main, [
      "--config", ROOT / "configs" / "demo.py", "--workdir", tmp_path / "w", "--config.negatives.bm25_top_k=50"])
  _assert_reported(code, err, "negatives.bm25_top_k is now negatives.bm25.top_k", skip_hint=False)
  assert not (tmp_path / "w").exists()


def test_an_error_after_a_progress_bar_starts_a_line_of_its_own():
  """In a log (stderr not a terminal), `grep ^error:` finds the error even when a progress bar was open."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  code = ("import tqdm\nfrom jdr.runtime import cli\nbar = tqdm.tqdm(total=10, desc='work', mininterval=0)\n"
          "bar.update(3)\nwith cli.reporting_errors():\n  raise ValueError('boom')\n")
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
  assert proc.returncode == 2
  assert "error: boom" in proc.stderr.splitlines()
