"""Artifacts built once per session from the tiny checkpoint, one per output format; for the
publish tests, a validated artifact and the stand-in Hub of ``hub_standin.py`` (a module of its
own, so that test files import it by a name no other test folder's ``conftest`` shadows)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hub_standin import StandInHub

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


# ------------------------------------------------------------------------------------ publish


@pytest.fixture(scope="session")
def validated_artifact(tiny_checkpoint, tmp_path_factory) -> Path:
    """A real artifact of the tiny checkpoint, built and validated by the pipeline (read-only)."""
    out = tmp_path_factory.mktemp("publish") / "tiny-hybrid"
    run_build(prepare(tiny_checkpoint, out, "tiny"))
    return out


@pytest.fixture
def art(validated_artifact, tmp_path) -> Path:
    """A private copy of the validated artifact, its work folder included, that a test may change."""
    dst = tmp_path / "tiny-hybrid"
    shutil.copytree(validated_artifact, dst)
    return dst


@pytest.fixture
def artifact(validated_artifact, tmp_path) -> Path:
    """A private copy (without the work dir) that a test may change."""
    dst = tmp_path / "tiny-hybrid"
    shutil.copytree(validated_artifact, dst, ignore=shutil.ignore_patterns(".hybrid-build"))
    return dst


@pytest.fixture
def hub() -> StandInHub:
    return StandInHub()


@pytest.fixture
def no_sleep():
    """A retry policy that records its waits instead of sleeping."""
    from hybrid_build.pipeline.publish import RetryPolicy

    waits: list[float] = []
    return RetryPolicy(attempts=3, base_delay=1.5, max_delay=60.0, sleep=waits.append), waits
