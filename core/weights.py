"""Load one module's weight from any checkpoint this tool reads or writes, dequantized to float32.

Storage is recognised from the module's parts: plain ``weight`` (BF16/FP16/FP32), FP8 block
(``weight`` F8 + ``weight_scale_inv`` or compressed-tensors ``weight_scale``), GPTQ
(``qweight``/``qzeros``/``scales``, 4- or 8-bit by the quantization config), int8 per-row
(``weight`` I8 + ``weight_scale``) and compressed-tensors ``pack-quantized`` INT4. Tensors are read
one at a time through ``safetensors.safe_open`` (memory-mapped), so memory is one module's worth.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
from safetensors import safe_open

from hybrid_build.calibration.fp8_block import dequantize_fp8_block
from hybrid_build.calibration.gptq import dequantize_gptq, unpack_codes
from hybrid_build.calibration.int8_rows import dequantize_int8_rows

from .checkpoint import Checkpoint
from .errors import ArtifactError


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


_TORCH_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def iter_row_chunks(ckpt: Checkpoint, name: str, rows: int) -> Iterator[tuple[int, torch.Tensor]]:
    """(first row, rows [r, K]) of a 2-D float tensor, ``rows`` at a time, read straight from
    the file into one reused buffer (no memory map: its pages would count towards the process's
    resident memory; no per-chunk ``safe_open``). Each chunk is valid until the next is read."""
    t = ckpt.tensors[name]
    dtype = _TORCH_DTYPES.get(t.dtype)
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


def module_storage(ckpt: Checkpoint, module: str) -> str:
    parts = ckpt.modules.get(module)
    if not parts:
        raise ArtifactError(f"{module}: no tensors for this module")
    return next(iter(parts.values())).storage


def load_weight(ckpt: Checkpoint, module: str) -> torch.Tensor:
    """The module's weight [N, K] in float32, whatever its storage."""
    parts = ckpt.modules.get(module)
    if not parts:
        raise ArtifactError(f"{module}: no tensors for this module")
    if "qweight" in parts:
        bits = ckpt.quant.module_bits(module) or 4
        override = ckpt.quant.layer_override(module) or {}
        group = override.get("group_size", ckpt.quant.group_size or 128)
        return dequantize_gptq(read_tensor(ckpt, module + ".qweight"), read_tensor(ckpt, module + ".scales"),
                               bits, group)
    if "weight_packed" in parts:  # compressed-tensors pack-quantized (sym: codes offset by 2^(bits-1))
        bits = ckpt.quant.module_bits(module) or 4
        packed = read_tensor(ckpt, module + ".weight_packed")
        scale = read_tensor(ckpt, module + ".weight_scale").float()
        codes = unpack_codes(packed.t().contiguous(), bits).t().float() - (1 << (bits - 1))  # [N, K]
        g = codes.shape[1] // scale.shape[1]
        return codes * scale.repeat_interleave(g, 1)
    w = read_tensor(ckpt, module + ".weight")
    if w.dtype == torch.float8_e4m3fn:
        key = "weight_scale_inv" if "weight_scale_inv" in parts else "weight_scale"
        return dequantize_fp8_block(w, read_tensor(ckpt, f"{module}.{key}"))
    if w.dtype == torch.int8:
        return dequantize_int8_rows(w, read_tensor(ckpt, module + ".weight_scale"))
    return w.float()
