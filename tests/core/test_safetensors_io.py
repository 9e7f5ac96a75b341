"""The streaming writer: byte-exact round trips, atomic shards, resume, and header validation."""
from __future__ import annotations

import hashlib
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybrid_build.core.checkpoint import Checkpoint
from hybrid_build.core.errors import ArtifactError, SourceError
from hybrid_build.core.safetensors_io import (
    INDEX_NAME,
    ByteRange,
    OutTensor,
    plan_shards,
    read_header,
    write_index,
    write_shard,
)


def _digest(path, t):
    with open(path, "rb") as f:
        f.seek(t.start)
        return hashlib.sha256(f.read(t.nbytes)).hexdigest()


def test_round_trip_of_the_fixture_is_byte_exact(tiny_checkpoint, tmp_path):
    src = Checkpoint.read_folder(tiny_checkpoint)
    tensors = [OutTensor(t.name, t.dtype, t.shape, ByteRange(src.path_of(t), t.start, t.nbytes))
               for t in src.tensors.values()]
    plans = plan_shards(tensors, max_shard_bytes=1_500_000)
    assert len(plans) >= 4
    for p in plans:
        write_shard(p, tmp_path)
    write_index(tmp_path, plans)
    (tmp_path / "config.json").write_text((tiny_checkpoint / "config.json").read_text())
    out = Checkpoint.read_folder(tmp_path)
    assert set(out.tensors) == set(src.tensors)
    for name, t in src.tensors.items():
        o = out.tensors[name]
        assert (o.dtype, o.shape) == (t.dtype, t.shape)
        assert _digest(out.path_of(o), o) == _digest(src.path_of(t), t), name
    # the reference reader agrees with ours on every tensor of one shard
    ref = load_file(tmp_path / plans[0].filename)
    assert set(ref) == {t.name for t in plans[0].tensors}


def test_planned_header_matches_what_the_library_reads(tmp_path):
    a = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    b = torch.arange(5, dtype=torch.int8)
    save_file({"a": a, "b": b}, tmp_path / "ref.safetensors")
    h = read_header(tmp_path / "ref.safetensors")
    tensors = [OutTensor(n, t.dtype, t.shape, ByteRange(tmp_path / "ref.safetensors", t.start, t.nbytes))
               for n, t in h.tensors.items()]
    write_shard(plan_shards(tensors, 1 << 30, prefix="copy")[0], tmp_path)
    back = load_file(tmp_path / "copy.safetensors")
    assert torch.equal(back["a"], a) and torch.equal(back["b"], b)


def test_failed_producer_leaves_no_final_file(tmp_path):
    def broken():
        yield b"\0" * 8
        raise RuntimeError("disk on fire")

    plan = plan_shards([OutTensor("x", "F32", (4,), broken)], 1 << 20)[0]
    with pytest.raises(RuntimeError):
        write_shard(plan, tmp_path)
    assert not (tmp_path / plan.filename).exists()
    assert not (tmp_path / INDEX_NAME).exists()


def test_short_producer_is_an_error(tmp_path):
    plan = plan_shards([OutTensor("x", "F32", (4,), lambda: iter([b"\0" * 12]))], 1 << 20)[0]
    with pytest.raises(ArtifactError, match="producer wrote 12 bytes"):
        write_shard(plan, tmp_path)
    assert not (tmp_path / plan.filename).exists()


def test_resume_keeps_a_complete_shard_and_rewrites_a_damaged_one(tmp_path):
    calls = []

    def data():
        calls.append(1)
        yield torch.ones(4).numpy().tobytes()

    plan = plan_shards([OutTensor("x", "F32", (4,), data)], 1 << 20)[0]
    write_shard(plan, tmp_path)
    write_shard(plan, tmp_path, resume=True)
    assert len(calls) == 1
    path = tmp_path / plan.filename
    path.write_bytes(path.read_bytes()[:-4])  # truncated by a crash
    write_shard(plan, tmp_path, resume=True)
    assert len(calls) == 2 and torch.equal(load_file(path)["x"], torch.ones(4))


@pytest.mark.parametrize("payload,message", [
    (b"abc", "not a safetensors file"),
    (struct.pack("<Q", 400) + b"{}", "truncated safetensors header"),
    (struct.pack("<Q", 4) + b"abcd", "header is not JSON"),
    (struct.pack("<Q", 2**40) + b"{}", "implausible"),
])
def test_bad_headers_are_named(tmp_path, payload, message):
    p = tmp_path / "bad.safetensors"
    p.write_bytes(payload)
    with pytest.raises(SourceError, match=message):
        read_header(p)


def test_tensor_past_end_of_file_is_truncation(tmp_path):
    save_file({"a": torch.zeros(1000)}, tmp_path / "t.safetensors")
    p = tmp_path / "t.safetensors"
    p.write_bytes(p.read_bytes()[:-100])
    with pytest.raises(SourceError, match="truncated"):
        read_header(p)


def _mixed_plan(tmp_path):
    """Ranges at odd offsets and lengths plus producer chunks, ~40 KB: with 8 KB staging buffers
    every kind of piece crosses a buffer boundary."""
    blob = tmp_path / "blob.bin"
    blob.write_bytes(torch.randint(0, 256, (50_000,), dtype=torch.uint8).numpy().tobytes())

    def produced():
        for i in range(5):
            yield torch.full((777,), i, dtype=torch.int8).numpy().tobytes()
        yield memoryview(torch.arange(1, dtype=torch.int32).numpy()).cast("B")  # 4 more bytes

    return plan_shards([
        OutTensor("a", "U8", (13_333,), ByteRange(blob, 3, 13_333)),
        OutTensor("p", "I8", (5 * 777 + 4,), produced),
        OutTensor("b", "U8", (20_001,), ByteRange(blob, 17_001, 20_001)),
        OutTensor("c", "U8", (1,), ByteRange(blob, 49_999, 1)),
    ], 1 << 30, prefix="mixed")[0]


@pytest.mark.parametrize("direct", [True, False])
def test_hashed_writer_writes_and_hashes_the_same_bytes(tmp_path, monkeypatch, direct):
    """The assemble path (O_DIRECT through staging buffers, or copy_file_range + hashing the
    source ranges) writes exactly what the plain writer writes, and its sha256 is the file's."""
    from hybrid_build.core import safetensors_io as sio

    plan = _mixed_plan(tmp_path)
    ref_dir, out_dir = tmp_path / "ref", tmp_path / "out"
    ref_dir.mkdir(), out_dir.mkdir()
    write_shard(plan, ref_dir)
    expected = (ref_dir / plan.filename).read_bytes()
    monkeypatch.setattr(sio, "DIRECT_BUFFER", 8192)
    opened = []
    real_open = sio._open_direct
    monkeypatch.setattr(sio, "_open_direct", lambda *a: opened.append(real_open(*a)) or opened[-1])
    if not direct:
        monkeypatch.setenv("HYBRID_BUILD_NO_DIRECT_IO", "1")
    hasher = sio.ShardHasher()
    write_shard(plan, out_dir, hasher=hasher)
    if direct and opened[0] is None:
        pytest.skip("this filesystem refuses O_DIRECT")
    assert (opened[0] is not None) == direct
    assert (out_dir / plan.filename).read_bytes() == expected
    assert hasher.hexdigest() == hashlib.sha256(expected).hexdigest()
    assert not list(out_dir.glob("*.partial"))


def test_hashed_writer_failure_leaves_no_final_file(tmp_path):
    from hybrid_build.core import safetensors_io as sio

    def broken():
        yield b"\0" * 8
        raise RuntimeError("disk on fire")

    plan = plan_shards([OutTensor("x", "F32", (4,), broken)], 1 << 20)[0]
    with pytest.raises(RuntimeError):
        write_shard(plan, tmp_path, hasher=sio.ShardHasher())
    assert not (tmp_path / plan.filename).exists()
