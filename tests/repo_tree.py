"""What running the suite may not do: leave the repository with a file or folder it did not have, or
change or remove one it had. Tests write under pytest's temporary folders and the test cache
(``$HYBRID_BUILD_TEST_CACHE``); anything else that lands in the checkout (a log in the current
folder, an output beside the source) is a defect that ``.gitignore`` would hide from ``git status``.

``snapshot`` lists the tree, ignored files included, skipping only what Python and the tools the
README runs make of their own accord: bytecode caches, pytest's and ruff's caches, the editable
install's metadata and virtual environments. ``tests/conftest.py`` takes one before the first test
and compares after the last (the controller only, under xdist).
"""
from __future__ import annotations

import os
from pathlib import Path

TOOL_DIRS = {".git", "__pycache__", ".pytest_cache", ".ruff_cache"}


def _skipped(parent: str, name: str) -> bool:
    return name in TOOL_DIRS or name.endswith(".egg-info") or os.path.exists(os.path.join(parent, name, "pyvenv.cfg"))


def snapshot(root: Path) -> dict[str, tuple[int, int] | None]:
    """Every file (size, mtime) and folder (None) under ``root`` but the tools' own, by relative path."""
    out: dict[str, tuple[int, int] | None] = {}
    for parent, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not _skipped(parent, d)]
        rel = Path(parent).relative_to(root)
        for d in dirs:
            out[(rel / d).as_posix() + "/"] = None
        for f in files:
            try:
                st = os.lstat(os.path.join(parent, f))
            except OSError:  # gone while walking
                continue
            out[(rel / f).as_posix()] = (st.st_size, st.st_mtime_ns)
    return out


def changes(before: dict, after: dict) -> list[str]:
    """``new PATH`` / ``changed PATH`` / ``removed PATH`` lines, sorted."""
    lines = [f"new {p}" for p in after.keys() - before.keys()]
    lines += [f"removed {p}" for p in before.keys() - after.keys()]
    lines += [f"changed {p}" for p in before.keys() & after.keys() if before[p] != after[p]]
    return sorted(lines)
