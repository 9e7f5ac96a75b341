"""Apply every runtime patch to the vLLM under ``--site-packages`` (what the docker engine runs
before ``vllm serve``). Idempotent; the first failing anchor stops it with exit code 1 and one
line naming the patch, the anchor and the file. A patch whose fix ``HYBRID_BUILD_DISABLE_FIXES``
names (``fixes``: the ids are the module names below) is neither checked nor applied, with
one line saying it is off; an unknown id stops it with exit code 2 before anything is written.

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

from ..fixes import UnknownFixError, disabled_fixes, off_line  # noqa: E402
from .anchors import AnchorError, apply_patch, check_patch  # noqa: E402

PATCH_MODULES = ("kv_unify", "prefix_align", "inc_fp8_dispatch", "int8_lm_head", "fla_smem_sm121")
GEMV_SOURCE = Path(__file__).resolve().parent.parent / "int8_gemv.py"
GEMV_TARGET = "vllm/hybrid_build_int8_gemv.py"


def all_patches(skip: frozenset[str] = frozenset()):
    """The patches, less those of the fix ids in ``skip`` (a patch's fix id is its module's name)."""
    return [importlib.import_module(f"{__package__}.{m}").PATCH for m in PATCH_MODULES if m not in skip]


def apply_all(site_packages: Path, off: frozenset[str] = frozenset()) -> dict[str, list[str]]:
    patches = all_patches(off)
    for p in patches:  # every anchor is checked before any file changes
        check_patch(p, site_packages)
    done = {p.name: apply_patch(p, site_packages) for p in patches}
    target = Path(site_packages) / GEMV_TARGET
    if "int8_lm_head" not in off and GEMV_SOURCE.exists() and \
            (not target.exists() or target.read_bytes() != GEMV_SOURCE.read_bytes()):
        shutil.copyfile(GEMV_SOURCE, target)
    return done


def say_off(off: frozenset[str], site_packages: Path) -> None:
    """One line per patch left out; a file that already carries its edit (a reused install) is named,
    since skipping cannot take an edit back out."""
    for m in PATCH_MODULES:
        if m in off:
            patch = importlib.import_module(f"{__package__}.{m}").PATCH
            path = Path(site_packages) / patch.path
            left = path.exists() and any(e.sentinel in path.read_text() for e in patch.edits)
            print(off_line(m) + (f" (but {patch.path} was patched before: reinstall vLLM to undo it)" if left else ""))


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
