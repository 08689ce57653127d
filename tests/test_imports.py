"""The layers of jdr, read from the imports of its modules (ast, nothing imported): the library stands below
the command lines, and the data package below models and negatives."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
# `python -m jdr.X` front ends: thin argument parsing over library modules, which never import them.
COMMAND_LINES = ("jdr.encode", "jdr.retrieve", "jdr.rerank", "jdr.evaluate", "jdr.export", "jdr.demo")


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
  assert "jdr.training.step" in found["jdr.train"] and "jdr.training.step" in found["jdr.training.sizing"]
  # A function-level import is found too (jdr.retrieval.encoder_runtime loads model code only when it builds a model).
  assert "jdr.models.build" in found["jdr.retrieval.encoder_runtime"]


def test_no_library_module_imports_a_command_line():
  # The command lines themselves may call one another (jdr.demo runs encode, retrieve and evaluate as a user
  # would), and so may the benchmarks, which are command lines too (python -m jdr.bench NAME).
  offenders = {m: names(imps, COMMAND_LINES) for m, imps in modules().items()
               if m not in COMMAND_LINES and not m.startswith("jdr.bench")}
  assert {m: bad for m, bad in offenders.items() if bad} == {}


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
