"""The built-in dataset: Python standard-library docstrings, so jdr runs end to end with no download.

Each function, class or module docstring written the PEP 257 way (a one-line summary, a blank line, the rest)
gives one document: title = qualified name, text = signature + "\\n" + the rest of the docstring. The summary
line is held out as that document's query (never left in the document), so answering it means matching a
one-line description to the detailed one: a small but real retrieval task. Docstrings without such a summary
join as distractors. Sources are parsed with `ast` from the stdlib path, never imported. The result is
deterministic for a given Python version: files in sorted order, a hash-based sample.
"""

import ast
import functools
import hashlib
import inspect
import os
import pathlib
import sysconfig
import tempfile

from jdr.data import formats
from jdr.runtime import atomic

_SKIP_DIRS = {"test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "site-packages", "dist-packages",
              "ensurepip", "__pycache__", "__phello__"}
# Sizes that keep encoding the corpus with MiniLM on two CPU cores under about a minute (~100k tokens;
# docs/performance.md, `encode`). Long docstrings cost the most and would be truncated at 256 tokens anyway.
MAX_DOCS = 1200
TEST_QUERIES = 200  # the rest of the judged docstrings (~470 on Python 3.11) form the train split
REST_WORDS = (20, 80)
SUMMARY_WORDS = (4, 25)


def _signature(node: ast.AST, qualname: str, is_method: bool) -> str:
  if isinstance(node, ast.Module):
    return f"module {qualname}"
  if isinstance(node, ast.ClassDef):
    bases = ", ".join(ast.unparse(b) for b in node.bases)
    return f"class {qualname}({bases})" if bases else f"class {qualname}"
  args = node.args
  static = "staticmethod" in {ast.unparse(d) for d in node.decorator_list}
  if is_method and not static and (args.posonlyargs or args.args):
    # Drop self/cls: callers never pass them, and they would be the first words of every method's text.
    args = ast.arguments(**{**vars(args), "posonlyargs": args.posonlyargs[1:],
                            "args": args.args if args.posonlyargs else args.args[1:]})
  returns = f" -> {ast.unparse(node.returns)}" if node.returns else ""
  return f"{qualname}({ast.unparse(args)}){returns}"


def entries(node: ast.AST, qualname: str, is_method: bool = False):
  """(qualified name, signature, docstring) for a node and the public functions/classes directly in it."""
  doc = ast.get_docstring(node)
  if doc:
    yield qualname, _signature(node, qualname, is_method), doc
  if isinstance(node, (ast.Module, ast.ClassDef)):
    for child in node.body:
      if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not child.name.startswith("_"):
        yield from entries(child, f"{qualname}.{child.name}", isinstance(node, ast.ClassDef))


def _split(doc: str) -> tuple[str, str] | None:
  """(summary, rest) when the docstring starts with a one-line summary of sensible length."""
  lines = inspect.cleandoc(doc).splitlines()
  if len(lines) < 3 or lines[1].strip():
    return None  # no blank line after line 1: the summary runs on, and its first line is a fragment
  summary, rest = lines[0].strip(), "\n".join(lines[2:]).strip()
  if not SUMMARY_WORDS[0] <= len(summary.split()) <= SUMMARY_WORDS[1]:
    return None
  return summary, rest


def source_files(stdlib: pathlib.Path) -> list[pathlib.Path]:
  """Public stdlib .py files in sorted order; skipped folders are pruned, not walked (site-packages is big)."""
  files = []
  for root, dirs, names in os.walk(stdlib):
    dirs[:] = [d for d in dirs if d not in _SKIP_DIRS and not d.startswith(("_", "test"))]
    files += [pathlib.Path(root, n) for n in names if n.endswith(".py")
              and (n == "__init__.py" or not n.startswith(("_", "test")))]
  # Private modules (_pydecimal, _pyio) mostly repeat the public ones' docstrings.
  return sorted(files)


def _candidates(stdlib: pathlib.Path):
  for path in source_files(stdlib):
    parts = path.relative_to(stdlib).with_suffix("").parts
    module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    try:
      tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError):
      continue
    yield from entries(tree, module)


@functools.lru_cache(maxsize=1)
def build(stdlib: str) -> tuple[tuple[formats.Doc, str | None], ...]:
  """(doc, summary query or None) pairs in a deterministic hash order."""
  seen_names, seen_summaries, seen_rests, items = set(), set(), set(), []
  for qualname, signature, doc in _candidates(pathlib.Path(stdlib)):
    split = _split(doc)
    # Docstrings without a usable summary still make good distractors when they say enough.
    summary, rest = split or (None, inspect.cleandoc(doc))
    first = (summary or rest.splitlines()[0]).lower()
    if summary and first in rest.lower():
      summary = None  # the body repeats its summary (turtle does): as a query it would be a give-away
    # A repeated summary would be a query with several right answers and one judged; a repeated rest (copied
    # docstrings) a duplicate document. Keep the first of each.
    if (qualname in seen_names or first in seen_summaries or rest in seen_rests
        or not REST_WORDS[0] <= len(rest.split()) <= REST_WORDS[1]):
      continue
    seen_names.add(qualname), seen_summaries.add(first), seen_rests.add(rest)
    items.append((formats.Doc(qualname, qualname, f"{signature}\n{rest}"), summary))
  # A hash order is a deterministic sample spread over the whole library, not its alphabetically first modules.
  items.sort(key=lambda item: hashlib.sha1(item[0].id.encode()).hexdigest())
  return tuple(items[:MAX_DOCS])


def builtin_dataset(split: str = "test") -> tuple[formats.Corpus, formats.Queries, formats.Qrels]:
  """(corpus, queries, qrels) of one split: "test" (the first 200 judged docstrings) or "train" (the rest).

  All 1,200 documents are in the corpus of both splits; the unjudged ones are distractors. Query ids are
  "q:" + the doc id, so they never equal a doc id (BEIR's evaluator drops retrieved docs whose id equals the
  query's).
  """
  items = build(sysconfig.get_paths()["stdlib"])
  corpus = {doc.id: doc for doc, _ in items}
  judged = [(doc, summary) for doc, summary in items if summary is not None]
  if split not in ("test", "train"):
    raise ValueError(f"the built-in dataset has splits 'train' and 'test', not {split!r}")
  judged = judged[:TEST_QUERIES] if split == "test" else judged[TEST_QUERIES:]
  queries = {f"q:{doc.id}": summary for doc, summary in judged}
  qrels = {f"q:{doc.id}": {doc.id: 1} for doc, _ in judged}
  return corpus, queries, qrels


def write_builtin(directory) -> pathlib.Path:
  """Writes the built-in dataset in BEIR layout (corpus.jsonl, queries.jsonl, qrels/{train,test}.tsv).

  Idempotent and safe beside a reader: each file is written whole (atomically), and only when it is missing or
  differs, so a run already reading it (its prepared corpus records the file's size and time) never sees it
  change, and two runs writing it at once leave one finished copy.
  """
  directory = pathlib.Path(directory)
  corpus, test_queries, test_qrels = builtin_dataset("test")
  _, train_queries, train_qrels = builtin_dataset("train")
  directory.parent.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=directory.parent, prefix=f".{directory.name}.") as staging:
    staging = pathlib.Path(staging)
    formats.write_beir(staging, corpus, {**test_queries, **train_queries}, test_qrels, split="test")
    formats.write_qrels(staging / "qrels" / "train.tsv", train_qrels)
    for source in sorted(p for p in staging.rglob("*") if p.is_file()):
      target, content = directory / source.relative_to(staging), source.read_bytes()
      if not target.is_file() or target.read_bytes() != content:
        atomic.write_atomic(target, lambda f, content=content: f.write(content))
  return directory
