"""The suite's own guard (``tests/repo_tree.py``): what it sees of a tree, what it leaves to the
tools, and that it names every new, changed and removed path."""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from repo_tree import changes, snapshot  # noqa: E402


def test_a_log_left_in_the_checkout_is_named(tmp_path):
    (tmp_path / "serve").mkdir()
    (tmp_path / "serve" / "a.py").write_text("x = 1\n")
    (tmp_path / "README.md").write_text("r\n")
    before = snapshot(tmp_path)
    (tmp_path / "hybrid-build-serve-base.log").write_text("started\n")  # ignored or not, it is new
    (tmp_path / "out").mkdir()
    (tmp_path / "README.md").write_text("rewritten\n")
    os.utime(tmp_path / "README.md", ns=(1, 1))
    (tmp_path / "serve" / "a.py").unlink()
    assert changes(before, snapshot(tmp_path)) == ["changed README.md", "new hybrid-build-serve-base.log",
                                                   "new out/", "removed serve/a.py"]


def test_the_tools_own_folders_are_not_the_suites_doing(tmp_path):
    (tmp_path / "core").mkdir()
    before = snapshot(tmp_path)
    for d in ("core/__pycache__", ".pytest_cache/v", ".ruff_cache", "hybrid_build.egg-info", ".git/objects"):
        (tmp_path / d).mkdir(parents=True)
        (tmp_path / d / "f").write_text("x")
    (tmp_path / ".venv-ci").mkdir()
    (tmp_path / ".venv-ci" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    assert changes(before, snapshot(tmp_path)) == []
    assert changes(before, before) == []
