"""One resolver for what a command may name as its source: a folder, a Hub id, or
``synthetic:NAME`` (a named model's real layout written as sparse files: headers only)."""
from __future__ import annotations

from pathlib import Path

from hybrid_build.core.checkpoint import Checkpoint
from hybrid_build.core.errors import UserError

SYNTHETIC_PREFIX = "synthetic:"


def synthetic_models() -> dict:
    from .synthetic import qwen35_122b_config, qwen35_397b_config

    # compact extra_config: same meaning, and reading 112k headers takes seconds instead of ~30 s
    return {"qwen3.5-122b-a10b": lambda: qwen35_122b_config(compact_extra_config=True),
            "qwen3.5-397b-a17b": lambda: qwen35_397b_config(compact_extra_config=True)}


def open_source(source: str, revision: str | None, workdir: Path, require_clean: bool = True,
                headers_only: bool = False) -> Checkpoint:
    """A checkpoint from a folder or Hub id; ``synthetic:NAME`` writes NAME's sparse headers into
    ``workdir`` first. A Hub id is downloaded whole, or with ``headers_only`` read remotely, headers
    only (``Checkpoint.open_headers``). Problems that make it unreadable raise ``SourceError``."""
    if source.startswith(SYNTHETIC_PREFIX):
        from .synthetic import write_synthetic_checkpoint

        name = source[len(SYNTHETIC_PREFIX):]
        models = synthetic_models()
        if name not in models:
            known = ", ".join(SYNTHETIC_PREFIX + m for m in models)
            raise UserError(f"{source}: unknown synthetic model (known: {known})")
        folder = write_synthetic_checkpoint(workdir / name, models[name](), sparse=True)
        ckpt = Checkpoint.read_folder(folder, source_id=source)
    elif headers_only:
        ckpt = Checkpoint.open_headers(source, revision=revision)
    else:
        ckpt = Checkpoint.open(source, revision=revision)
    if require_clean:
        ckpt.require_clean()
    return ckpt
