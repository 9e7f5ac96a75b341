"""One reader of an artifact: ``publish --dry-run``, ``serve --dry-run`` and ``status`` open every file
of the artifact folder through the bound artifact (``core.bound``), never by themselves. Counted by
``folder_reads.py`` (Python's audit events, in a process of its own) on a copy of the validated
artifact; ``inspect``, which reads a checkpoint folder as a source, is the control that the count
sees a read made outside."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

COUNTER = Path(__file__).with_name("folder_reads.py")
# the modules whose functions open an artifact's files, all called by core.bound: the folder's layout
# (listings), the bound artifact itself, the headers' reader and the I/O primitives (the bounded reader
# every file from outside goes through included)
READERS = {"core.artifact", "core.bound", "core.bounded_read", "core.checkpoint", "core.integrity",
           "core.safetensors_io"}


@pytest.fixture(scope="module")
def counted(validated_artifact, tmp_path_factory):
    art = tmp_path_factory.mktemp("one-reader") / "art"
    shutil.copytree(validated_artifact, art)

    def count(command: str) -> dict:
        proc = subprocess.run([sys.executable, str(COUNTER), str(art), command, "--json"], capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(proc.stdout)

    return count


@pytest.mark.parametrize("command", ["publish", "serve", "status"])
def test_every_read_of_the_artifact_goes_through_the_bound_artifact(counted, command):
    data = counted(command)
    assert data["exit"] == 0
    assert data["reads"] > 0 and "hybrid_build/provenance.json" in {e["file"] for e in data["events"]}
    outside = [f"{e['site']} ({e['file']})" for e in data["events"] if not e["inside"] and not e["work"]]
    assert outside == [] and data["outside"] == 0, outside
    assert set(data["modules"]) <= READERS, data["modules"]


def test_the_count_sees_a_command_that_reads_the_folder_itself(counted):
    data = counted("inspect")  # a checkpoint folder read as a source: core.checkpoint, not core.bound
    assert data["exit"] == 0
    assert data["outside"] > 0 and "core.checkpoint" in data["outside_modules"], data["outside_modules"]
