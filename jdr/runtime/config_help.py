"""The config keys, their defaults and one-line meanings: what `python -m jdr.train --help` lists.

The meanings are the comments beside each key in jdr/runtime/defaults.py, read from its source, so the help and the
defaults cannot drift apart. A recipe (configs/X.py) changes some of the values, never the keys.
"""

import ast
import inspect
import io
import tokenize

from jdr.runtime import defaults
from jdr.runtime import settings


def _key(target: ast.expr) -> str | None:
  """`c.data.kind` -> "data.kind"; None for anything else."""
  parts = []
  while isinstance(target, ast.Attribute):
    parts.append(target.attr)
    target = target.value
  return ".".join(reversed(parts)) if isinstance(target, ast.Name) and target.id == "c" and parts else None


def meanings() -> dict[str, str]:
  """{key: the comment on its line in jdr/runtime/defaults.py} for every key set there."""
  source = inspect.getsource(defaults)
  comments = {tok.start[0]: tok.string.lstrip("#").strip()
              for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
  out = {}
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and (key := _key(node.targets[0])):
      if not isinstance(node.value, ast.Call):  # `c.data = ConfigDict()` opens a section; not a key
        out[key] = comments.get(node.end_lineno, "")
  return out


def describe() -> str:
  """One line per key: `key = default  [range]  meaning`, in the order jdr/runtime/defaults.py sets them (the
  range of a numeric key: jdr.runtime.settings)."""
  config = defaults.get_config()
  lines = []
  for key, meaning in meanings().items():
    value = config
    for part in key.split("."):
      value = value[part]
    limits = f"  [{settings.RANGES[key]}]" if key in settings.RANGES else ""
    lines.append(f"  {key} = {value!r}{limits}" + (f"  # {meaning}" if meaning else ""))
  return "\n".join(lines)
