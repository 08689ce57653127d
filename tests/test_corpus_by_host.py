"""jdr.data.corpus_by_host: hosts that each parse a part of the corpus end with the whole corpus, read lazily.

The hosts are threads here (a barrier as the job's sync); tests/test_train.py::test_two_processes_equal_one runs
the trainer on two real processes through it.
"""

import json
import threading

import pytest

from jdr.data import corpus_by_host
from jdr.data import formats


def _write(path, lines, newline="\n", bom=False):
  text = newline.join(lines) + newline
  path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + text.encode("utf-8"))
  return path


def _docs(n):
  return [json.dumps({"_id": f"d{i}", "title": f"título {i}" if i % 3 else "", "text": f"text of doc {i} " * (i % 7 + 1)},
                     ensure_ascii=False) for i in range(n)]


def _by_hosts(path, tmp_path, parts, **kwargs):
  barrier = threading.Barrier(parts)
  results, errors = [None] * parts, [None] * parts

  def host(k):
    synced = []

    def sync(name):
      barrier.wait(timeout=60)
      synced.append(name)

    try:
      results[k] = corpus_by_host.read_by_hosts(path, tmp_path / "exchange", part=k, parts=parts, sync=sync,
                                                **kwargs)
    except Exception as e:  # pylint: disable=broad-except
      errors[k] = e
      if not synced:  # failed before the sync: release the others (a job's hosts all raise then)
        barrier.abort()

  threads = [threading.Thread(target=host, args=(k,)) for k in range(parts)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  return results, errors


@pytest.mark.parametrize("newline,bom", [("\n", False), ("\r\n", True)])
@pytest.mark.parametrize("parts", [1, 3, 7])
def test_every_host_gets_the_whole_corpus_equal_to_reading_it_whole(tmp_path, parts, newline, bom):
  path = _write(tmp_path / "corpus.jsonl", _docs(40), newline, bom)
  whole = formats.read_corpus(path)
  results, errors = _by_hosts(path, tmp_path, parts)
  assert errors == [None] * parts
  for corpus in results:
    assert list(corpus) == list(whole) and len(corpus) == 40 and "d3" in corpus and "d40" not in corpus
    assert {d: corpus[d] for d in corpus} == whole
    with pytest.raises(KeyError):
      corpus["nope"]


def test_a_tsv_collection_too(tmp_path):
  path = _write(tmp_path / "collection.tsv", [f"{i}\tpassage {i}" for i in range(25)])
  results, errors = _by_hosts(path, tmp_path, 4)
  assert errors == [None] * 4
  assert dict(results[2]) == formats.read_corpus(path)


def test_an_id_in_two_parts_names_both_lines_or_is_skipped(tmp_path):
  lines = _docs(30)
  lines[25] = json.dumps({"_id": "d2", "title": "", "text": "again"})
  path = _write(tmp_path / "corpus.jsonl", lines)
  _, errors = _by_hosts(path, tmp_path, 3)
  assert all(isinstance(e, formats.DataFormatError) for e in errors), errors
  assert str(errors[0]) == f"{path}:26: duplicate id: doc id 'd2' already on line 3"
  results, errors = _by_hosts(path, tmp_path / "skip", 3, skip_invalid=True)
  assert errors == [None] * 3 and len(results[0]) == 29 and results[0]["d2"].text.startswith("text of doc 2")


def test_a_bad_line_in_one_part_names_the_files_own_line(tmp_path):
  lines = _docs(30)
  lines[20] = '{"_id": "d20", "text": '
  path = _write(tmp_path / "corpus.jsonl", lines)
  _, errors = _by_hosts(path, tmp_path, 3)
  messages = [str(e) for e in errors if e is not None]
  assert any(m.startswith(f"{path}:21: malformed") for m in messages), messages


def test_only_local_uncompressed_files_are_read_by_parts(tmp_path):
  path = _write(tmp_path / "corpus.jsonl", _docs(3))
  assert corpus_by_host.readable_by_parts(path)
  assert not corpus_by_host.readable_by_parts(tmp_path / "corpus.jsonl.gz")
  assert not corpus_by_host.readable_by_parts("gs://bucket/corpus.jsonl")
  assert not corpus_by_host.readable_by_parts(tmp_path / "missing.jsonl")
