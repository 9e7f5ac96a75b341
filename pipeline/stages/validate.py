"""The ``validate`` stage: check the assembled artifact against its source (``hybrid_build.validate``).

The report lands in ``OUT/hybrid_build/validation.{json,md,png}``; a failed check fails the stage
(``StageFailed``, exit 1) with the first failures in its message. The report is a report, not a
build output: the stage's manifest lists no file, so a later ``hybrid-build validate`` that rewrites
it never makes the stage stale; the stage's result holds while the build's validation passed
(``current``: ``core.artifact.validation_outcome``).
"""
from __future__ import annotations

from pathlib import Path

from hybrid_build.core.artifact import REPORTS, validation_outcome
from hybrid_build.core.errors import ArtifactError, StageFailed

from ..context import BuildContext
from .base import Stage, StageIO


def inputs(ctx: BuildContext) -> dict:
    return {"validate": ctx.recipe.validate_.model_dump(mode="json")}


def check(ctx: BuildContext) -> None:
    try:
        import hybrid_build.validate.report  # noqa: F401
    except ImportError as e:
        raise ArtifactError(f"the validate stage is not available in this installation ({e})")


def run(ctx: BuildContext, io: StageIO) -> tuple[list[Path], dict]:
    from hybrid_build.validate.report import validate_artifact

    report = validate_artifact(ctx.out, ctx.source.root, recipe=ctx.recipe, progress=ctx.progress,
                               announce=ctx.announce)
    details = {"passed": report.passed, "outcome": report.outcome, "failures": list(report.failures),
               "report": str(report.where.relative_to(ctx.out)) if report.where else None}
    if report.outcome == "could not run":  # the stage does not pass on a check it could not make
        undone = [f"{c.name}: {c.detail}" for c in report.checks if c.state == "could not run"]
        raise StageFailed(f"validation could not run: {'; '.join(undone)}", details)
    if not report.passed:
        failures = report.failures
        more = f" (and {len(failures) - 3} more)" if len(failures) > 3 else ""
        raise StageFailed(f"validation failed: {'; '.join(failures[:3])}{more}; report in "
                          f"{report.where or ctx.out / REPORTS['validation'].named('.md')}", details)
    return [], details


def writes(ctx: BuildContext) -> int:
    """The report, its picture and the reference: counted in the build's space check before a shard
    is written, so that a disk too small for them refuses the build instead of filling while the
    reference is written."""
    from hybrid_build.validate.end_to_end import load_texts
    from hybrid_build.validate.report import planned_bytes

    return planned_bytes(load_texts(None), len(ctx.plan.conversions), ctx.recipe.validate_.e2e)


def current(out: Path, bound=None) -> str | None:
    """Why the stage's finished result no longer holds: the build's validation is not a pass now (as
    ``bound``, the artifact ``status`` opened, found it, where there is one)."""
    outcome = bound.validation if bound is not None else validation_outcome(out)
    return None if outcome.passed else f"validation {outcome.state}: {outcome.reason}"


STAGE = Stage("validate", run, inputs=inputs, reads=("record",), check=check, current=current, writes=writes)
