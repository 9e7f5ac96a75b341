"""Recipes: validated YAML that says what a build converts, how, and how its result is served.

The names below are loaded on first use: the schema imports the output formats (torch), and a
command that only builds its parser (``--help``) reads ``recipes.profiles`` without them."""
import importlib

_SCHEMA_NAMES = ("HeadSpec", "OutputSpec", "Recipe", "SharedExpertSpec", "ValidateSpec", "list_recipes", "load_recipe",
                 "select_recipe")
__all__ = list(_SCHEMA_NAMES)


def __getattr__(name: str):
    if name in _SCHEMA_NAMES:
        return getattr(importlib.import_module(f"{__name__}.schema"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
