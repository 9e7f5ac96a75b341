"""Apply every runtime patch to the vLLM under ``--site-packages`` (what the docker engine runs
before ``vllm serve``). Idempotent; the first failing anchor stops it with exit code 1 and one
line naming the patch, the anchor and the file. The patches are those ``fixes.FIXES`` names. A
patch whose fix ``HYBRID_BUILD_DISABLE_FIXES`` names is neither checked nor applied (nor are the
files it copies), with one line saying it is off; an unknown id stops it with exit code 2 before
anything is written.

    python -m hybrid_build.serve.runtime.patches.apply --site-packages DIR
    python /opt/hybrid-build/runtime/patches/apply.py --site-packages DIR    # in the container
"""
from __future__ import annotations

import argparse
import importlib
import shutil
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script from the runtime folder, mounted alone (named as it is)
    _runtime = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(_runtime.parent))
    __package__ = f"{_runtime.name}.patches"  # noqa: A001
    importlib.import_module(__package__)

from ..fixes import UnknownFixError, disabled_fixes, off_line, patches  # noqa: E402
from .anchors import AnchorError, Patch, apply_patch, check_patch  # noqa: E402

RUNTIME = Path(__file__).resolve().parent.parent


def patch_of(fix_id: str) -> Patch:
    return importlib.import_module(f"{__package__}.{patches()[fix_id]}").PATCH


def all_patches(skip: frozenset[str] = frozenset()) -> list[Patch]:
    """The patches of ``fixes.FIXES``, less those of the fix ids in ``skip``."""
    return [patch_of(fix_id) for fix_id in patches() if fix_id not in skip]


def apply_all(site_packages: Path, off: frozenset[str] = frozenset()) -> dict[str, list[str]]:
    todo = all_patches(off)
    for p in todo:  # every anchor is checked before any file changes
        check_patch(p, site_packages)
    done = {p.name: apply_patch(p, site_packages) for p in todo}
    for p in todo:
        for source, target in p.copies:
            src, dst = RUNTIME / source, Path(site_packages) / target
            if not dst.exists() or dst.read_bytes() != src.read_bytes():
                shutil.copyfile(src, dst)
    return done


def say_off(off: frozenset[str], site_packages: Path) -> None:
    """One line per patch left out; a file that already carries its edit (a reused install) is named,
    since skipping cannot take an edit back out."""
    for fix_id in patches():
        if fix_id in off:
            patch = patch_of(fix_id)
            path = Path(site_packages) / patch.path
            left = path.exists() and any(e.sentinel in path.read_text() for e in patch.edits)
            print(off_line(fix_id) + (f" (but {patch.path} was patched before: reinstall vLLM to undo it)"
                                      if left else ""))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="apply hybrid-build's runtime patches to an installed vLLM 0.23")
    ap.add_argument("--site-packages", type=Path, required=True, help="folder that holds vllm/")
    a = ap.parse_args(argv)
    try:
        off = disabled_fixes()
    except UnknownFixError as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    say_off(off, a.site_packages)
    try:
        done = apply_all(a.site_packages, off)
    except AnchorError as e:
        sys.stderr.write(f"error: {e}\n")
        return 1
    for name, edits in done.items():
        print(f"{name}: {'applied ' + ', '.join(edits) if edits else 'already applied'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
