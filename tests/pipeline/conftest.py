"""Artifacts built once per session from the tiny checkpoint, one per output format."""
from __future__ import annotations

import pytest

from hybrid_build.pipeline.build import RecipeOverrides, prepare
from hybrid_build.pipeline.runner import run_build
from hybrid_build.pipeline.stages import STAGES

BUILD_STAGES = [s for s in STAGES if s != "validate"]


def build(source, out, fmt=None, recipe="tiny", stages=BUILD_STAGES):
    ctx = prepare(source, out, recipe, overrides=RecipeOverrides(format=fmt))
    run_build(ctx, stages)
    return ctx


@pytest.fixture(scope="session")
def builder():
    """``build(source, out, fmt=None, recipe="tiny", stages=BUILD_STAGES)`` for tests that build their own."""
    return build


@pytest.fixture(scope="session")
def build_stages():
    return list(BUILD_STAGES)


@pytest.fixture(scope="session")
def inc_artifact(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("inc") / "out"
    build(tiny_checkpoint, out)
    return out


@pytest.fixture(scope="session")
def ct_artifact(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("ct") / "out"
    build(tiny_checkpoint, out, fmt="compressed-tensors")
    return out
