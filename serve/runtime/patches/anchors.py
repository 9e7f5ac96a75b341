"""A small anchor-edit framework: find an exact text once, insert or replace, mark it done.

An edit fails loudly (``AnchorError`` naming the patch, the anchor and the file) when its anchor
is missing or found more than once; a sentinel comment written with the edit makes applying it
again a no-op. The edited file must still compile, or nothing is written.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


class AnchorError(RuntimeError):
    pass


@dataclass(frozen=True)
class Edit:
    name: str        # the anchor's name, shown in errors
    anchor: str      # exact text that must occur once in the file
    new: str         # replacement for the anchor (use the anchor inside it to insert around it)

    @property
    def sentinel(self) -> str:
        return f"# hybrid-build patch: {self.name}"


@dataclass(frozen=True)
class Patch:
    name: str
    path: str        # relative to site-packages, e.g. "vllm/v1/core/kv_cache_utils.py"
    edits: tuple[Edit, ...]
    why: str = ""
    # files of the runtime folder the patched code imports, copied beside it: (source relative to
    # the runtime folder, target relative to site-packages)
    copies: tuple[tuple[str, str], ...] = ()


def apply_to_text(patch: Patch, text: str, where: str) -> tuple[str, list[str]]:
    """The edited text and the names of the edits applied now (already-applied ones are skipped)."""
    applied = []
    for edit in patch.edits:
        if edit.sentinel in text:
            continue
        n = text.count(edit.anchor)
        if n != 1:
            raise AnchorError(f"patch {patch.name}: anchor {edit.name!r} found {n} times in {where} (expected once); "
                              "this vLLM is not the version the patch was written for")
        if edit.sentinel not in edit.new:
            raise AnchorError(f"patch {patch.name}: edit {edit.name!r} does not carry its sentinel")
        text = text.replace(edit.anchor, edit.new, 1)
        applied.append(edit.name)
    return text, applied


def check_patch(patch: Patch, site_packages: Path) -> None:
    """Raise AnchorError if the patch would not apply (nothing is written)."""
    path = Path(site_packages) / patch.path
    if not path.exists():
        raise AnchorError(f"patch {patch.name}: {patch.path} not found under {site_packages}")
    apply_to_text(patch, path.read_text(), str(path))


def apply_patch(patch: Patch, site_packages: Path) -> list[str]:
    path = Path(site_packages) / patch.path
    if not path.exists():
        raise AnchorError(f"patch {patch.name}: {patch.path} not found under {site_packages}")
    text = path.read_text()
    new, applied = apply_to_text(patch, text, str(path))
    if applied:
        try:
            compile(new, str(path), "exec")
        except SyntaxError as e:
            raise AnchorError(
                f"patch {patch.name}: the edited {patch.path} does not compile ({e.msg}, line {e.lineno})")
        tmp = path.with_suffix(path.suffix + ".hybrid-build.tmp")
        tmp.write_text(new)
        tmp.replace(path)
    return applied
