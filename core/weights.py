"""Read a checkpoint's tensors back, and one module's weight in float32, whatever its storage.

Storage is recognised from the module's parts (``read_stored``, the one place that dispatches on
it): plain ``weight`` (BF16/FP16/FP32), FP8 block (``weight`` F8 + ``weight_scale_inv`` or
compressed-tensors ``weight_scale``), GPTQ (``qweight``/``qzeros``/``scales``, 4- or 8-bit by the
quantization config), int8 per-row (``weight`` I8 + ``weight_scale``) and compressed-tensors
``pack-quantized`` INT4. ``RangeReader`` reads tensors, or row / column ranges of them, by byte
range from the headers ``Checkpoint`` already parsed, so memory is one module's worth (or the rows
asked for); ``read_tensor`` reads one whole tensor through ``safetensors.safe_open``.
"""
from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from safetensors import safe_open

from hybrid_build.calibration.fp8_block import BLOCK as FP8_BLOCK
from hybrid_build.calibration.fp8_block import dequantize_fp8_block
from hybrid_build.calibration.gptq import dequantize_gptq
from hybrid_build.calibration.int8_rows import dequantize_int8_rows

from .checkpoint import Checkpoint, TensorInfo
from .errors import ArtifactError

TORCH_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
                "F8_E4M3": torch.float8_e4m3fn, "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16,
                "I32": torch.int32, "I64": torch.int64}


def read_tensor(ckpt: Checkpoint, name: str) -> torch.Tensor:
    t = ckpt.tensors.get(name)
    if t is None:
        raise ArtifactError(f"{name}: not in the checkpoint")
    with safe_open(str(ckpt.path_of(t)), framework="pt") as f:
        return f.get_tensor(name)


def read_rows(ckpt: Checkpoint, name: str, start: int, stop: int) -> torch.Tensor:
    """Rows ``start:stop`` of a tensor, without reading the rest."""
    t = ckpt.tensors[name]
    with safe_open(str(ckpt.path_of(t)), framework="pt") as f:
        return f.get_slice(name)[start:stop]


def iter_row_chunks(ckpt: Checkpoint, name: str, rows: int) -> Iterator[tuple[int, torch.Tensor]]:
    """(first row, rows [r, K]) of a 2-D float tensor, ``rows`` at a time, read straight from
    the file into one reused buffer (no memory map: its pages would count towards the process's
    resident memory; no per-chunk ``safe_open``). Each chunk is valid until the next is read."""
    t = ckpt.tensors[name]
    dtype = TORCH_DTYPES.get(t.dtype) if t.dtype in ("BF16", "F16", "F32") else None
    if dtype is None or len(t.shape) != 2:
        n = t.shape[0]
        for lo in range(0, n, rows):
            yield lo, read_rows(ckpt, name, lo, min(n, lo + rows))
        return
    n, k = t.shape
    item = torch.empty((), dtype=dtype).element_size()
    buf = torch.empty(min(rows, n) * k * item, dtype=torch.uint8)
    view = memoryview(buf.numpy())
    with open(ckpt.path_of(t), "rb", buffering=0) as f:
        f.seek(t.start)
        for lo in range(0, n, rows):
            r = min(rows, n - lo)
            want = r * k * item
            got = 0
            while got < want:
                m = f.readinto(view[got:want])
                if not m:
                    raise ArtifactError(f"{name}: file ends inside the tensor")
                got += m
            yield lo, buf[:want].view(dtype).view(r, k)


class RangeReader:
    """Tensors (or row / column ranges of them) of one checkpoint, read by byte range from the
    headers ``Checkpoint`` already parsed: one descriptor per shard for the reader's life, no memory
    map (its pages would count as the process's memory) and no per-tensor ``safe_open`` (a real
    shard's JSON header is ~1 MB, parsed again on every open). ``close()`` (or ``with``) when done."""

    def __init__(self, ckpt: Checkpoint) -> None:
        self.ckpt = ckpt
        self._fds: dict[str, int] = {}

    def __enter__(self) -> RangeReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def info(self, name: str) -> TensorInfo:
        t = self.ckpt.tensors.get(name)
        if t is None:
            raise ArtifactError(f"{self.ckpt.root.name}: tensor {name} is missing")
        return t

    def _fd(self, t: TensorInfo) -> int:
        fd = self._fds.get(t.file)
        if fd is None:
            fd = self._fds[t.file] = os.open(self.ckpt.path_of(t), os.O_RDONLY)
        return fd

    def _pread(self, t: TensorInfo, out: torch.Tensor, offset: int) -> None:
        """Fill the uint8 tensor ``out`` from byte ``offset`` of ``t``'s data."""
        view, got = memoryview(out.numpy()), 0
        fd = self._fd(t)
        while got < len(view):
            n = os.preadv(fd, [view[got:]], t.start + offset + got)
            if n <= 0:
                raise ArtifactError(f"{t.file}: the file ends inside tensor {t.name}")
            got += n

    def read(self, name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor, or rows ``r0:r1`` (dim 0) and/or columns ``c0:c1`` (dim 1) of it."""
        t = self.info(name)
        dtype = TORCH_DTYPES.get(t.dtype)
        if dtype is None:
            raise ArtifactError(f"{name}: unsupported dtype {t.dtype}")
        item = torch.empty((), dtype=dtype).element_size()
        shape = list(t.shape) or [1]
        r0, r1 = rows or (0, shape[0])
        row_elems = math.prod(shape[1:])
        if cols is None:
            out = torch.empty((r1 - r0) * row_elems * item, dtype=torch.uint8)
            self._pread(t, out, r0 * row_elems * item)
            return out.view(dtype).view(r1 - r0, *shape[1:]) if t.shape else out.view(dtype).view(())
        c0, c1 = cols
        if len(shape) != 2:
            raise ArtifactError(f"{name}: column ranges need a 2-D tensor, shape is {list(t.shape)}")
        out = torch.empty(r1 - r0, (c1 - c0) * item, dtype=torch.uint8)
        for r in range(r0, r1):  # a column range is strided: one read per row
            self._pread(t, out[r - r0], (r * shape[1] + c0) * item)
        return out.view(dtype)

    def gather_rows(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of a 2-D tensor (an embedding), one read per distinct row."""
        uniq, inverse = torch.unique(ids, return_inverse=True)
        rows = torch.stack([self.read(name, rows=(int(i), int(i) + 1))[0] for i in uniq])
        return rows[inverse]


@dataclass
class StoredWeight:
    """A module's stored weight (or output rows of it) in one canonical layout, not yet
    dequantized, so that two checkpoints holding the same codes in different layouts (auto_gptq
    and compressed-tensors pack-quantized) compare equal."""

    kind: str  # "gptq" (auto_gptq or pack-quantized, transposed back), "fp8", "int8", "plain"
    tensors: tuple[torch.Tensor, ...]
    bits: int = 0
    group: int = 0

    def same_as(self, other: StoredWeight) -> bool:
        return (self.kind, self.bits, self.group) == (other.kind, other.bits, other.group) and all(
            a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
            for a, b in zip(self.tensors, other.tensors))

    def dequantize(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """float32 [rows, K] on ``device``, through the project's own dequantizers. The
        ``torch.device`` context makes the tensors they create (GPTQ's shift table) land there."""
        ts = [t.to(device) for t in self.tensors]
        with torch.device(device):
            if self.kind == "gptq":
                return dequantize_gptq(ts[0], ts[1], self.bits, self.group)
            if self.kind == "fp8":
                return dequantize_fp8_block(ts[0], ts[1])
            if self.kind == "int8":
                return dequantize_int8_rows(ts[0], ts[1])
            return ts[0].float()


def read_stored(reader: RangeReader, module: str, rows: tuple[int, int] | None = None) -> StoredWeight:
    """Read ``module``'s weight, or its output rows ``n0:n1``, without dequantizing it."""
    ckpt = reader.ckpt
    parts = ckpt.modules.get(module)
    if not parts:
        raise ArtifactError(f"{ckpt.root.name}: no tensors for module {module}")
    if "qweight" in parts:  # auto_gptq: qweight [K*bits/32, N], scales [K/g, N]: output rows are columns
        qw = parts["qweight"]
        bits = ckpt.quant.module_bits(module) or 4
        k = qw.shape[0] * 32 // bits
        group = (ckpt.quant.layer_override(module) or {}).get("group_size", ckpt.quant.group_size or 128)
        group = k if group in (-1, 0, None) else group
        qweight, scales = reader.read(module + ".qweight", cols=rows), reader.read(module + ".scales", cols=rows)
        return StoredWeight("gptq", (qweight, scales), bits, group)
    if "weight_packed" in parts:  # compressed-tensors pack-quantized: the transpose of the above
        packed = reader.read(module + ".weight_packed", rows=rows)
        scale = reader.read(module + ".weight_scale", rows=rows)
        if "weight_shape" in parts:
            k = int(reader.read(module + ".weight_shape")[1])
            bits = 32 * packed.shape[1] // k
        else:
            bits = ckpt.quant.module_bits(module) or 4
            k = packed.shape[1] * 32 // bits
        return StoredWeight("gptq", (packed.t(), scale.t()), bits, -(-k // scale.shape[1]))
    if parts.get("weight") is None:
        raise ArtifactError(f"{ckpt.root.name}: module {module} has no weight ({', '.join(sorted(parts))})")
    weight = reader.read(module + ".weight", rows=rows)
    if weight.dtype == torch.float8_e4m3fn:
        key = "weight_scale_inv" if "weight_scale_inv" in parts else "weight_scale"
        srows = None
        if rows is not None:
            if rows[0] % FP8_BLOCK:
                raise ValueError(f"{module}: FP8 row ranges must start on a {FP8_BLOCK}-row block")
            srows = (rows[0] // FP8_BLOCK, -(-rows[1] // FP8_BLOCK))
        return StoredWeight("fp8", (weight, reader.read(f"{module}.{key}", rows=srows)))
    if weight.dtype == torch.int8:
        return StoredWeight("int8", (weight, reader.read(module + ".weight_scale", rows=rows)))
    return StoredWeight("plain", (weight,))


def load_weight(ckpt: Checkpoint, module: str) -> torch.Tensor:
    """The module's weight [N, K] in float32, whatever its storage."""
    with RangeReader(ckpt) as reader:
        return read_stored(reader, module).dequantize()
