"""Recipes: validated YAML that says what a build converts, how, and how its result is served."""
from .schema import (  # noqa: F401
    HeadSpec,
    OutputSpec,
    Recipe,
    SharedExpertSpec,
    ValidateSpec,
    list_recipes,
    load_recipe,
    select_recipe,
)
