"""The layers of jdr, read from the imports of its modules (ast, nothing imported): the library stands below
the command lines, in folders by stage, the data package below models and negatives, and no module reaches
into another's private names."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
# `python -m jdr.X` front ends: thin argument parsing over library modules, which never import them.
COMMAND_LINES = ("jdr.encode", "jdr.retrieve", "jdr.rerank", "jdr.evaluate", "jdr.export", "jdr.demo", "jdr.train",
                 "jdr.mine")


def module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: pathlib.Path) -> set[str]:
  """Every jdr module `path` imports, at the top or inside a function ("from jdr import x" counts as
  jdr.x when x is a module)."""
  out = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      out.update(a.name for a in node.names if a.name.startswith("jdr"))
    elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jdr") and not node.level:
      out.update(f"{node.module}.{a.name}" for a in node.names)
      out.add(node.module)
  return out


def modules() -> dict[str, set[str]]:
  return {module_name(p): imported(p) for p in sorted((ROOT / "jdr").rglob("*.py"))}


def names(imports: set[str], prefixes) -> list[str]:
  return sorted(i for i in imports if any(i == p or i.startswith(p + ".") for p in prefixes))


def test_the_reader_sees_every_module_and_its_imports():
  found = modules()
  assert {"jdr.train", "jdr.training.step", "jdr.data.pairs", "jdr.models.build", "jdr.evaluation.reranking"} <= set(found)
  assert "jdr.training.step" in found["jdr.training.trainer"] and "jdr.training.step" in found["jdr.training.sizing"]
  # A function-level import is found too (jdr.retrieval.encoder_runtime loads model code only when it builds a model).
  assert "jdr.models.build" in found["jdr.retrieval.encoder_runtime"]


def test_no_library_module_imports_a_command_line():
  # The command lines themselves may call one another (jdr.demo runs encode, retrieve and evaluate as a user
  # would), and so may the benchmarks and the experiment runner, which are command lines too (python -m
  # jdr.bench NAME, python -m jdr.reproduce: a table's mined rows run jdr.mine as a user would).
  offenders = {m: names(imps, COMMAND_LINES) for m, imps in modules().items()
               if m not in COMMAND_LINES and not m.startswith(("jdr.bench", "jdr.reproduce"))}
  assert {m: bad for m, bad in offenders.items() if bad} == {}


def test_the_library_imports_neither_benchmarks_nor_experiments():
  """jdr.bench and jdr.reproduce ship inside the package, so `python -m jdr.bench` and `python -m jdr.reproduce`
  run from an installed jdr; they stand above the library like the command lines: it never imports them, and
  they use only its public names (test_no_private_name_crosses_a_module_boundary)."""
  offenders = {m: names(imps, ("jdr.bench", "jdr.reproduce")) for m, imps in modules().items()
               if not m.startswith(("jdr.bench", "jdr.reproduce")) and m not in COMMAND_LINES}
  assert {m: bad for m, bad in offenders.items() if bad} == {}
  found = modules()
  found["jdr.training.trainer"] = found["jdr.training.trainer"] | {"jdr.bench.recipes"}
  assert names(found["jdr.training.trainer"], ("jdr.bench", "jdr.reproduce")) == ["jdr.bench.recipes"]


def test_data_imports_neither_models_nor_negatives():
  offenders = {m: names(imps, ("jdr.models", "jdr.negatives")) for m, imps in modules().items()
               if m.startswith("jdr.data")}
  assert {m: bad for m, bad in offenders.items() if bad} == {}


def test_no_import_circles_between_jdr_modules():
  """No cycle in the module graph (top-level and function-level imports alike)."""
  found = modules()
  graph = {m: {i for i in imps if i in found and i != m and not m.startswith(i + ".")} for m, imps in found.items()}
  # A package's __init__ re-exporting its submodules is not a circle with them.
  graph = {m: {i for i in deps if not i.startswith(m + ".")} for m, deps in graph.items()}
  state, cycles = {}, []

  def visit(m, stack):
    state[m] = "open"
    for i in sorted(graph[m]):
      if state.get(i) == "open":
        cycles.append(stack[stack.index(i):] + [i])
      elif i not in state:
        visit(i, stack + [i])
    state[m] = "done"

  for m in sorted(graph):
    if m not in state:
      visit(m, [m])
  assert cycles == []


def test_the_top_level_holds_only_command_lines():
  """What a user runs sits at the top of jdr/; the library lives in the stage folders below it."""
  top = {p.stem for p in (ROOT / "jdr").glob("*.py") if p.stem != "__init__"}
  assert {f"jdr.{m}" for m in top} == set(COMMAND_LINES)
  for name in top:
    text = (ROOT / "jdr" / f"{name}.py").read_text()
    assert "def main(" in text and 'if __name__ == "__main__":' in text, name


def identifiers(path: pathlib.Path) -> set[str]:
  """Every name a module defines, takes or reads (functions, arguments, variables, attributes, keywords)."""
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
      out.add(node.name)
    elif isinstance(node, ast.arg):
      out.add(node.arg)
    elif isinstance(node, ast.Name):
      out.add(node.id)
    elif isinstance(node, ast.Attribute):
      out.add(node.attr)
    elif isinstance(node, ast.keyword) and node.arg:
      out.add(node.arg)
  return out


def test_the_models_know_no_training_method(tmp_path):
  """Methods plug in around the encoder: FGD's span pooling lives in jdr.retrieval.span_embeddings, on what the
  encoder hands out, and no model module takes or names a span."""
  found = {p.relative_to(ROOT).as_posix(): sorted(n for n in identifiers(p) if "span" in n.lower())
           for p in sorted((ROOT / "jdr" / "models").rglob("*.py"))}
  assert {path: names for path, names in found.items() if names} == {}
  # The check reads what it should: the old threading would be caught.
  old = tmp_path / "threaded.py"
  old.write_text("def layer(x, span_mask=None):\n  return x.span_pooling\n")
  assert identifiers(old) >= {"span_mask", "span_pooling"}


def private_crossings(path: pathlib.Path) -> list[str]:
  """`alias._name` where alias is an imported jdr module or class, `from jdr.x import _name`, and
  `setattr(alias, "_name", ...)`: a private name used outside the module that defines it."""
  tree = ast.parse(path.read_text(), str(path))
  aliases, found = {}, []
  private = lambda name: name.startswith("_") and not name.startswith("__")
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jdr") and not node.level:
      for a in node.names:
        if private(a.name):
          found.append(f"{path.name}:{node.lineno}: from {node.module} import {a.name}")
        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    elif isinstance(node, ast.Import):
      aliases.update({a.asname or a.name.split(".")[0]: a.name for a in node.names if a.name.startswith("jdr")})
  for node in ast.walk(tree):
    owner = None
    if isinstance(node, ast.Attribute) and private(node.attr):
      owner, name = node.value, node.attr
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "setattr"
          and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
          and private(node.args[1].value)):
      owner, name = node.args[0], node.args[1].value
    while isinstance(owner, ast.Attribute) and owner.attr[:1].isupper():  # module.Class._name
      owner = owner.value
    if isinstance(owner, ast.Name) and owner.id in aliases:
      found.append(f"{path.name}:{node.lineno}: {owner.id}.{name}")
  return found


def test_no_private_name_crosses_a_module_boundary():
  files = sorted((ROOT / "jdr").rglob("*.py")) + sorted((ROOT / "tests").glob("*.py"))
  assert [c for f in files for c in private_crossings(f)] == []


def test_the_crossing_check_sees_each_form(tmp_path):
  """The check above can fail: each form of crossing is reported."""
  example = tmp_path / "example.py"
  example.write_text("from jdr.data import formats\nfrom jdr.data.formats import _hidden\nformats._x()\n"
                     "formats.Doc._y\nmonkeypatch.setattr(formats, '_z', 1)\nself._fine = formats.Doc\n")
  assert len(private_crossings(example)) == 4


# The stage folders, lowest first: a module imports only from its own floor or the ones below it. The command
# lines, the benchmarks, the experiment runner and the launchers stand above all of them.
FLOORS = ("runtime", "data", "models", "retrieval", "negatives", "evaluation", "training")


def climbing(found: dict[str, set[str]]) -> dict[str, list[str]]:
  """{module: the modules it imports from a higher floor}, for modules inside the stage folders."""
  rank = {f"jdr.{floor}": i for i, floor in enumerate(FLOORS)}
  floor_of = lambda name: next((r for prefix, r in rank.items() if name == prefix or name.startswith(prefix + ".")),
                               None)
  out = {}
  for module, imports in found.items():
    own = floor_of(module)
    if own is None:
      continue
    above = sorted(i for i in imports if (f := floor_of(i)) is not None and f > own)
    if above:
      out[module] = above
  return out


def test_floors_only_go_down():
  assert climbing(modules()) == {}


def test_the_floor_check_sees_a_climbing_import():
  found = modules()
  found["jdr.models.saved"] = found["jdr.models.saved"] | {"jdr.training.checkpoint"}
  assert climbing(found) == {"jdr.models.saved": ["jdr.training.checkpoint"]}


def cited_files(path: pathlib.Path) -> list[str]:
  """The `.md` files a module's text names (docstrings and comments), as written."""
  import re  # pylint: disable=g-import-not-at-top
  return re.findall(r"(?<![\w/.-])((?:[\w-]+/)*[\w-]+\.md)\b", path.read_text())


def test_docstrings_cite_files_inside_the_repository():
  """A module points its reader only at files the repository holds (docs/, README.md); a recipe's experiment
  output (`table.md` under OUT/) is named as such, never as a bare file."""
  missing = {}
  for path in sorted((ROOT / "jdr").rglob("*.py")) + sorted((ROOT / "configs").glob("*.py")):
    bad = [name for name in cited_files(path)
           if not (ROOT / name).is_file() and not name.endswith("table.md")]
    if bad:
      missing[path.relative_to(ROOT).as_posix()] = sorted(set(bad))
  assert missing == {}


def test_the_citation_check_sees_a_file_outside(tmp_path):
  example = tmp_path / "example.py"
  example.write_text('"""See DESIGN.md and docs/performance.md."""\n')
  assert cited_files(example) == ["DESIGN.md", "docs/performance.md"]
