"""The embedded default is the same checkpoint on every machine: auto-round turns bf16 off on a CPU
without AVX512-BF16 (and writes its unquantized tensors as float32) unless the demo asks for bf16."""
from __future__ import annotations

import hashlib
from pathlib import Path

from hybrid_build.core.checkpoint import Checkpoint


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())
            if p.suffix in (".safetensors", ".json")}


def test_a_cpu_without_bf16_builds_the_same_demo(tiny_checkpoint, tmp_path, monkeypatch):
    from auto_round.utils.device_manager import get_ar_device

    from hybrid_build.pipeline.generators.demo import MTP_FILE, build_demo_checkpoint

    cpu = get_ar_device("cpu")
    monkeypatch.setattr(cpu, "_bf16_supported", False, raising=False)  # what CPUID says on such a CPU
    built = build_demo_checkpoint(tmp_path / "demo", drafter=False)
    assert cpu._bf16_supported is False  # the demo's request ends with the build
    dtypes = {t.dtype for t in Checkpoint.read_folder(built).tensors.values()}
    assert "F32" not in dtypes and "BF16" in dtypes
    assert _digests(built) == _digests(tiny_checkpoint)
    assert (built / MTP_FILE).stat().st_mode & 0o777 == \
        (built / "config.json").stat().st_mode & 0o777
