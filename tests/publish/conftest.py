"""Fixtures for the publish tests: one real validated artifact built once per session, and the
stand-in Hub of ``hub_standin.py`` (a module of its own, so that test files import it by a name no
other test folder's ``conftest`` shadows)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hub_standin import StandInHub

# ------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="session")
def validated_artifact(tiny_checkpoint, tmp_path_factory) -> Path:
    """A real artifact of the tiny checkpoint, built and validated by the pipeline (read-only)."""
    from hybrid_build.pipeline.build import prepare
    from hybrid_build.pipeline.runner import run_build

    out = tmp_path_factory.mktemp("publish") / "tiny-hybrid"
    run_build(prepare(tiny_checkpoint, out, "tiny"))
    return out


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
