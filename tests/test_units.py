"""A method is one unit: each negatives source, the guide, the loss and distillation own a group of config keys,
and only their own module reads them. Adding a source then touches its module (its builder and check in
jdr/negatives/sources.py or a module of its own), its keys (jdr/runtime/defaults.py, their ranges in
jdr/runtime/settings.py), its recipe and its test, and no other file of the library.

For each group, `readers` lists the library files (jdr/**, not the benchmarks or the experiments) that read its
keys, found in their syntax trees:
  - an attribute read off the group: `<...>.GROUP.KEY` (config.negatives.retrieval.top_n), `x.KEY` where x was
    bound to `<...>.GROUP` in the file (`ret = config.negatives.retrieval`) or is named after the group (the
    units name the parameter that receives their group so: `def _bm25(bm25, ...)`), or `<...>["GROUP"]["KEY"]`;
  - a string naming one of its keys, "negatives.GROUP.KEY" (for loss and distill "loss.KEY", "distill.KEY"):
    an error message, a table; docstrings and comments are documentation, not reads.
Handing the group over whole (`retrieved.settings(config.negatives.retrieval)`) is not reading it.

What makes it fail: a file outside the unit reading one of its keys. Were jdr/training/step.py to read
`config.negatives.retrieval.top_n` itself rather than through `retrieved.settings`, or jdr/evaluation/periodic.py
`config.negatives.ance.top_n` rather than `sources.depth`, that file would join the group's readers and
`test_each_group_is_read_by_its_own_unit_only` would name it (`test_the_scan_sees_each_way_of_reading` runs the
scan on such code).
"""

import ast
import pathlib
import re

import ml_collections
import pytest

from jdr.runtime import defaults

ROOT = pathlib.Path(__file__).resolve().parents[1]
DECLARED = {"runtime/defaults.py", "runtime/settings.py"}  # the keys, their meanings, ranges and old names

# group -> the files that may read it, each beyond the declarations with the reason.
EXPECTED = {
    "negatives.guide": {"training/guide.py",
                        "data/mixture.py"},  # a mixture refuses a guide model (one dataset's batches)
    "negatives.bm25": {"negatives/sources.py"},
    "negatives.static": {"negatives/sources.py",
                         "data/mixture.py"},  # the mixture option static_run= sets its file
    "negatives.triples": {"negatives/given.py",
                          "data/mixture.py"},  # the mixture option triples_file=
    "negatives.mined": {"negatives/sources.py",
                        "training/distill.py",  # distill.teacher=mined reads the same file's teacher scores
                        "data/mixture.py"},  # the mixture option mined=
    "negatives.dense_static": {"negatives/sources.py"},
    "negatives.ance": {"negatives/sources.py",
                       "data/refresh_triples.py",  # ANCE's triples of a refresh generation (TriplePlan)
                       "data/pairs.py"},  # the batches that lay those triples out refuse what they cannot
    "negatives.retrieval": {"negatives/retrieved.py",
                            "negatives/sources.py"},  # its builder: the fixed corpus encoded or read
    "loss": {"training/losses.py",
             "training/step.py",  # the logQ correction of a sampled softmax, applied to the step's scores
             "data/pretrain_batches.py",  # the batches carry log Q(doc) when it is on
             "models/towers.py", "retrieval/flags.py"},  # --dim names loss.matryoshka_dims, the widths trained
    "distill": {"training/distill.py",
                "training/step.py",  # the student's piece pooling and the contrastive term's weight
                "runtime/config_files.py",  # a missing teacher is refused with the other missing inputs
                "data/mixture.py"},  # a mixture refuses a teacher (it scores one dataset's candidates)
}


def groups() -> dict[str, set[str]]:
  """{"negatives.bm25": {"top_k"}, ..., "loss": {...}, "distill": {...}}: the groups and their keys."""
  config = defaults.get_config()
  out = {f"negatives.{name}": set(value) for name, value in config.negatives.items()
         if isinstance(value, ml_collections.ConfigDict)}
  out["loss"], out["distill"] = set(config.loss), set(config.distill)
  return out


def _docstrings(tree: ast.AST) -> set[int]:
  """ids of the string constants that are docstrings."""
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
      first = node.body[0]
      if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        out.add(id(first.value))
  return out


def _is_group(node: ast.AST, leaf: str) -> bool:
  """`<...>.leaf` or `<...>["leaf"]`."""
  if isinstance(node, ast.Attribute):
    return node.attr == leaf
  return isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == leaf


def reads(source: str, group: str, keys: set[str]) -> bool:
  """Whether `source` (a module's text) reads a key of `group` (module docstring)."""
  tree = ast.parse(source)
  leaf = group.rpartition(".")[2]
  imported = {alias.asname or alias.name.split(".")[0] for node in ast.walk(tree)
              if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}
  aliases = {leaf} - imported  # a name given the group: its own name as a parameter, or bound below
  for node in ast.walk(tree):
    if isinstance(node, ast.Assign) and _is_group(node.value, leaf):
      aliases |= {t.id for t in node.targets if isinstance(t, ast.Name)}
  mention = re.compile(rf"(?<![\w.]){re.escape(group)}\.({'|'.join(map(re.escape, sorted(keys)))})\b")
  docstrings = _docstrings(tree)
  for node in ast.walk(tree):
    if isinstance(node, ast.Attribute) and node.attr in keys:
      base = node.value
    elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value in keys:
      base = node.value
    elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
      if mention.search(node.value):
        return True
      continue
    else:
      continue
    if _is_group(base, leaf) or (isinstance(base, ast.Name) and base.id in aliases):
      return True
  return False


def readers(group: str, keys: set[str]) -> set[str]:
  """The library files reading `group` (paths under jdr/), the benchmarks and the experiments left out."""
  out = set()
  for path in sorted((ROOT / "jdr").rglob("*.py")):
    relative = path.relative_to(ROOT / "jdr").as_posix()
    if relative.startswith(("bench/", "reproduce/")):
      continue
    if reads(path.read_text(), group, keys):
      out.add(relative)
  return out


@pytest.mark.parametrize("group", sorted(EXPECTED))
def test_each_group_is_read_by_its_own_unit_only(group):
  assert readers(group, groups()[group]) == EXPECTED[group] | DECLARED


def test_every_group_is_listed():
  assert set(groups()) == set(EXPECTED)


@pytest.mark.parametrize("code", [
    "def f(config):\n  return config.negatives.retrieval.top_n\n",
    "def f(config):\n  ret = config.negatives.retrieval\n  return ret.backend\n",
    "def f(retrieval):\n  return retrieval.every\n",
    "def f(neg):\n  return neg['retrieval']['corpus_dtype']\n",
    "def f():\n  raise ValueError('negatives.retrieval.index_factory must be a Faiss factory')\n",
])
def test_the_scan_sees_each_way_of_reading(code):
  assert reads(code, "negatives.retrieval", groups()["negatives.retrieval"])


@pytest.mark.parametrize("code", [
    "def f(config):\n  return retrieved.settings(config.negatives.retrieval)\n",  # handed over whole
    '"""negatives.retrieval.top_n, documented."""\n',  # a docstring
    "from jdr.negatives import retrieval\n\ndef f():\n  return retrieval.top_n\n",  # a module of that name
    "def f(config):\n  return config.negatives.ance.top_n\n",  # another group's key of the same name
])
def test_the_scan_ignores_what_is_not_a_read(code):
  assert not reads(code, "negatives.retrieval", groups()["negatives.retrieval"])


def test_one_validate_asks_each_unit_before_anything_is_built(tmp_path):
  """train_and_evaluate's one `validate(config)`: a bad group of the chosen source is refused before the
  workdir, a backend or the data, and the run's plain config passes with no mixture."""
  from jdr.training import trainer  # pylint: disable=g-import-not-at-top
  from jdr.training import validate  # pylint: disable=g-import-not-at-top
  assert validate.validate(defaults.get_config()) == []
  config = defaults.get_config()
  config.negatives.source, config.negatives.per_query = "ance", 1  # ance.refresh_every left at 0
  with pytest.raises(ValueError, match=r"negatives\.ance\.refresh_every >= 1"):
    trainer.train_and_evaluate(config, tmp_path / "w")
  assert not (tmp_path / "w").exists()
  source = pathlib.Path(trainer.__file__).read_text()
  assert source.count("validate.validate(config)") == 1
  assert not re.search(r"\b(sources|distill|guide|pretrain_batches|settings)\.check\(", source)
