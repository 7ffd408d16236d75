"""One module per training method (a recipe), found by name: `trainer.TrainConfig.recipe = 'dpo'` → recipes/dpo.py.

Each recipe module defines `CONFIG`, its config dataclass, bound in gin under the module's own name
(`dpo.DpoConfig.beta`, `grpo.GrpoConfig.kl_beta`, `distill.DistillConfig.alpha`), whose `make_objective(run, *,
loss_scaled)` builds the method's objective over the run's model after checking the settings against the run
(its DATA_DIR's format, batch, sequence length). The modules are discovered here, so a new method is a new
file in this folder (and its objective and gin file), with no list to edit.
"""

import importlib
import pkgutil

# {recipe name: its module}, every module of this package (discovered, imported once).
RECIPES = {info.name: importlib.import_module(f"{__name__}.{info.name}")
           for info in pkgutil.iter_modules(__path__)
           if not info.name.startswith("_") and info.name not in ("base", "experiment")}  # experiment: the assembly


def get(name: str):
  """The recipe module `name` (TrainConfig.recipe).

  Raises:
    ValueError: one line naming the value and the recipes there are.
  """
  if name not in RECIPES:
    raise ValueError(f"TrainConfig.recipe={name!r} is not a recipe (t5x_like/recipes/: {', '.join(sorted(RECIPES))})")
  return RECIPES[name]


def gin_configs() -> dict:
  """{gin module name: config class} of every recipe, for cli to register before gin parses."""
  return {name: module.CONFIG for name, module in RECIPES.items()}
