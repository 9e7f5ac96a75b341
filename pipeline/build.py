"""A build as a library call: source + recipe (+ overrides) -> a planned ``BuildContext``.

``prepare`` opens the source (headers only), chooses the recipe, applies command-line overrides
and plans the conversion; ``runner.dry_run`` describes what a build would write and
``runner.run_build`` runs it. Nothing here parses arguments or prints: ``commands/run.py`` does that, and a notebook
or another tool can call these directly::

    ctx = prepare("./int4", Path("hybrid"), overrides=RecipeOverrides(format="compressed-tensors"))
    run_build(ctx)
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hybrid_build.core import formats
from hybrid_build.core.artifact import WORK_DIR
from hybrid_build.core.checkpoint import Checkpoint
from hybrid_build.core.errors import RecipeError, SourceError, UserError
from hybrid_build.core.progress import ProgressFactory, null_progress
from hybrid_build.core.user_paths import check_output_path
from hybrid_build.recipes.conversion import plan_conversion
from hybrid_build.recipes.schema import Recipe, load_recipe, select_recipe

from .context import BuildContext


@dataclass
class RecipeOverrides:
    """Command-line changes to the recipe; applied before the conversion is planned."""

    format: str | None = None
    observer: str | None = None
    fp8_source: str | None = None

    def apply(self, recipe: Recipe) -> Recipe:
        recipe = recipe.model_copy(deep=True)
        if self.format:
            recipe.output.format = formats.get(self.format).name  # an unknown name: one line listing the valid ones
        if self.observer:
            recipe.shared_experts.observer = self.observer
        if self.fp8_source:
            recipe.shared_experts.source = "checkpoint"
            recipe.shared_experts.fp8_checkpoint = self.fp8_source
        return recipe


def recipe_for_source(source: Checkpoint, recipe_arg: str | None, force: bool = False,
                   how: str = "given") -> tuple[Recipe, str]:
    """The recipe to build with, and a note saying how it was chosen. A recipe given by name or
    file must fit the source's config (its ``match`` block), unless ``force``."""
    if recipe_arg:
        recipe = load_recipe(recipe_arg)
        misfit = recipe.mismatches(source.text_config, source.model_type)
        if misfit and not force:
            raise RecipeError(f"recipe {recipe.name} does not fit this source: {'; '.join(misfit)}. Leave out "
                              f"--recipe to let run choose, or pass --force to build with it anyway")
        note = f"recipe {recipe.name} ({how})" + (f"; does not fit the source ({misfit[0]}), forced" if misfit else "")
        return recipe, note
    recipe = select_recipe(source.text_config, source.model_type)
    return recipe, f"recipe {recipe.name} (chosen from the source's config.json)"


def check_output_folder(out: Path, source_root: Path | None = None) -> None:
    check_output_path(out, "output folder", folder=True)  # a loop of links, a file on the way: one line
    if source_root is not None and (out.resolve() == source_root.resolve()
                                    or source_root.resolve() in out.resolve().parents):
        raise UserError(f"{out}: the output folder must not be the source folder or inside it")
    if out.exists() and not out.is_dir():
        raise UserError(f"{out}: exists and is not a folder")
    if out.exists() and not (out / WORK_DIR).exists() and any(out.iterdir()):
        raise UserError(f"{out}: exists, is not empty and is not a hybrid-build output; choose another folder")


def prepare(source: str | Path | Checkpoint, out: Path, recipe_arg: str | None = None,
            progress: ProgressFactory = null_progress, revision: str | None = None,
            overrides: RecipeOverrides | None = None, force: bool = False,
            in_artifact: str | None = None, recipe_how: str = "given") -> BuildContext:
    """Open the source, pick the recipe, apply ``overrides`` and plan the conversion; nothing is
    written. ``source`` is a folder, a Hub id or an opened ``Checkpoint``. ``force`` accepts a recipe
    whose ``match`` does not fit the source; ``in_artifact`` marks a source that lives inside the
    output folder (the demo's)."""
    ckpt = source if isinstance(source, Checkpoint) else Checkpoint.open(source, revision=revision)
    ckpt.require_clean()
    if ckpt.hybrid_info:
        raise SourceError(f"{source}: already a hybrid-build artifact (config.json has a hybrid_build block)")
    recipe, note = recipe_for_source(ckpt, recipe_arg, force, recipe_how)
    recipe = (overrides or RecipeOverrides()).apply(recipe)
    check_output_folder(Path(out), ckpt.root)
    plan = plan_conversion(ckpt, recipe)
    if not plan.conversions:
        raise SourceError(
            f"{source}: recipe {recipe.name} finds nothing to convert (no BF16 shared experts or lm_head)")
    return BuildContext(ckpt, recipe, note, Path(out), plan, progress, in_artifact)
