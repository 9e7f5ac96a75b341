"""Serve-test fixtures: a real hybrid artifact built by `hybrid-build run` from the tiny checkpoint."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_artifact(tiny_checkpoint, tmp_path_factory) -> Path:
    """The inc-hybrid artifact of the tiny checkpoint (FP8 shared experts, stored int8 head)."""
    from hybrid_build.pipeline.cli import main

    out = tmp_path_factory.mktemp("artifact") / "out"
    rc = main(["run", str(tiny_checkpoint), "-o", str(out), "--no-validate", "-q"])
    if rc != 0:
        shutil.rmtree(out, ignore_errors=True)
        pytest.fail(f"hybrid-build run exited {rc}")
    return out
