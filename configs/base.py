"""Shared defaults of every jdr recipe (they live in jdr/defaults.py). Recipes start from `base.get_config()`
and change what differs. Not a recipe by itself; each recipe's docstring gives its run command.
"""

from jdr.defaults import get_config, runlocal  # noqa: F401  (re-exported for the recipes)
