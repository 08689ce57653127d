"""Shared defaults of every jdr recipe (they live in jdr/defaults.py). Recipes start from `base.get_config()`
and change what differs; each declares the arguments it takes (`ARGS`, read by `base.parse_arg`). Not a
recipe by itself; each recipe's docstring gives its run command.
"""

from jdr.config_files import parse_arg  # noqa: F401  (re-exported for the recipes)
from jdr.defaults import get_config  # noqa: F401
