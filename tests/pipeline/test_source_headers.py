"""The plan refuses what the build would crash on: a source shard whose header safetensors refuses
(overlapping or gapped ``data_offsets``, bytes after the last tensor) or a tensor stored in a dtype its
class never has (an FP8 or integer norm of consistent size). ``inspect`` and ``run --dry-run`` say it
in one line naming the file and the tensor, exit 2; a full ``run`` refuses before any stage runs.

Each malformed file is a real shard of the tiny checkpoint with its header bytes rewritten.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from safetensors import SafetensorError, safe_open

from hybrid_build.core.artifact import WORK_DIR
from hybrid_build.pipeline.cli import main


def _rewrite(path: Path, edit, data=lambda header, d: d) -> None:
    """``path``'s header through ``edit``, its data bytes through ``data`` (given the original header)."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    original = json.loads(raw[8:8 + n])
    edit(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data(original, raw[8 + n:]))


def _by_offset(header: dict) -> list[str]:
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


def _overlap(header: dict) -> str:
    """The second tensor moved 8 bytes back, into the first (the same length)."""
    name = _by_offset(header)[1]
    lo, hi = header[name]["data_offsets"]
    header[name]["data_offsets"] = [lo - 8, hi - 8]
    return name


def _gap(header: dict) -> str:
    """Every tensor after the first moved 8 bytes on: 8 bytes no tensor covers."""
    names = _by_offset(header)
    for name in names[1:]:
        header[name]["data_offsets"] = [o + 8 for o in header[name]["data_offsets"]]
    return names[1]


def _shard(src: Path) -> Path:
    return sorted(src.glob("model-*.safetensors"))[0]


def _make(case: str, src: Path) -> tuple[Path, str, str]:
    """The damaged file, the tensor the line must name, and what it must say."""
    shard = _shard(src)
    if case == "overlap":
        box = []
        _rewrite(shard, lambda h: box.append(_overlap(h)))
        return shard, box[0], "overlapping data_offsets"
    if case == "gap":
        box = []

        def eight_zeros_after_the_first(header, d):
            cut = header[_by_offset(header)[0]]["data_offsets"][1]
            return d[:cut] + b"\0" * 8 + d[cut:]
        _rewrite(shard, lambda h: box.append(_gap(h)), eight_zeros_after_the_first)
        return shard, box[0], "a gap in the data_offsets"
    if case == "trailing":
        last = []
        _rewrite(shard, lambda h: last.append(_by_offset(h)[-1]), lambda h, d: d + b"\0" * 24)
        return shard, last[0], "24 byte(s) after the last tensor"
    if case in ("fp8-norm", "int-norm"):
        box = []

        def edit(h):
            name = next(k for k in _by_offset(h) if k.endswith("layernorm.weight") and h[k]["dtype"] == "BF16")
            # the same bytes: twice the elements at one byte (FP8), half at four (int32)
            h[name]["dtype"], h[name]["shape"] = (("F8_E4M3", [h[name]["shape"][0] * 2]) if case == "fp8-norm"
                                                  else ("I32", [h[name]["shape"][0] // 2]))
            box.append(name)
        _rewrite(shard, edit)
        return shard, box[0], "F8_E4M3: a norm" if case == "fp8-norm" else "I32: a norm"
    raise AssertionError(case)


CASES = ["overlap", "gap", "trailing", "fp8-norm", "int-norm"]


@pytest.mark.parametrize("case", CASES)
def test_safetensors_agrees_where_it_checks(tiny_copy, case):
    """The three header cases are files safetensors itself refuses; the dtype cases it reads."""
    shard, _, _ = _make(case, tiny_copy)
    if case in ("overlap", "gap", "trailing"):
        with pytest.raises(SafetensorError):
            with safe_open(str(shard), "np") as f:
                list(f.keys())
    else:
        with safe_open(str(shard), "pt") as f:
            assert list(f.keys())


@pytest.mark.parametrize("case", CASES)
def test_inspect_and_the_dry_run_refuse_in_one_line(tiny_copy, tmp_path, case, capsys):
    shard, tensor, says = _make(case, tiny_copy)
    out = tmp_path / "out"
    for argv in (["inspect", str(tiny_copy)], ["run", str(tiny_copy), "-o", str(out), "--dry-run"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        assert err[0].startswith(f"error: {shard.name}: ") and tensor in err[0] and says in err[0], err
    assert not out.exists()


@pytest.mark.parametrize("case", ["overlap", "fp8-norm"])
def test_the_full_run_never_starts(tiny_copy, tmp_path, case, capsys):
    shard, tensor, _ = _make(case, tiny_copy)
    out = tmp_path / "out"
    assert main(["run", str(tiny_copy), "-o", str(out), "--recipe", "tiny"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and shard.name in err[0] and tensor in err[0], err
    assert not (out / WORK_DIR / "calibrate.json").exists() and not list(out.glob("*.safetensors"))
