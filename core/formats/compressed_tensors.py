"""``compressed-tensors``: a mixed-precision compressed-tensors checkpoint that stock vLLM loads.

The INT4 tensors are repacked to ``pack-quantized`` (``weight_packed`` = ``qweight.T``,
``weight_scale`` = ``scales.T``, ``weight_shape``: bit-exact because every source zero word is
0x77777777); FP8 modules store ``weight`` + float32 ``weight_scale`` per 128x128 block; the int8
head is 8-bit ``pack-quantized`` (codes + 128, four to an int32 along K, a float32 scale per row).
Three config groups declare them (docs/formats.md).
"""
from __future__ import annotations

import re

import torch

from hybrid_build.calibration.fp8_block import BLOCK
from hybrid_build.calibration.gptq import dequantize_gptq, zeros_are_symmetric
from hybrid_build.calibration.int8_rows import RowChunkQuantizer
from hybrid_build.core.checkpoint import Checkpoint, QuantizationInfo, TensorInfo
from hybrid_build.core.errors import ArtifactError
from hybrid_build.core.safetensors_io import OutTensor
from hybrid_build.core.tensor_classes import split_module
from hybrid_build.core.weights import iter_row_chunks, read_tensor

from .base import HandOver, OutputFormat, Parts, TensorReader, copied, raw

QUANT_METHOD = "compressed-tensors"
INT4_PARTS = ("weight_packed", "weight_scale", "weight_shape")


class CompressedTensors(OutputFormat):
    name = "compressed-tensors"
    description = ("mixed-precision compressed-tensors (INT4 repacked, FP8 block, int8 head) that stock vLLM loads "
                   "without a plugin")
    fp8_scale_part = "weight_scale"
    head_label = "int8-channel"
    head_scale_part = "weight_scale"
    hands_over_head = False  # row-major codes: the head file is streamed chunk by chunk instead
    writes_quantization_config_file = False  # only when the source had one
    card_tags = ("compressed-tensors",)

    def head_parts(self, n: int, k: int) -> Parts:
        return {"weight_packed": ("I32", (n, k // 4)), "weight_scale": ("F32", (n, 1)), "weight_shape": ("I64", (2,))}

    def int4_parts(self, src_parts: dict[str, TensorInfo]) -> Parts | None:
        if "qweight" not in src_parts:
            return None
        qw, sc = src_parts["qweight"], src_parts["scales"]
        k, n = qw.shape[0] * 8, qw.shape[1]
        return {"weight_packed": ("I32", (n, k // 8)), "weight_scale": (sc.dtype, (n, sc.shape[0])),
                "weight_shape": ("I64", (2,))}

    def check_source(self, source: Checkpoint) -> None:
        """The repack is bit-exact only for symmetric zeros (every word 0x77777777)."""
        for module, parts in source.modules.items():
            if "qzeros" in parts and parts["qweight"].storage == "int4":
                if not zeros_are_symmetric(read_tensor(source, module + ".qzeros"), 4):
                    raise ArtifactError(
                        f"{module}: asymmetric INT4 zeros; compressed-tensors repack needs symmetric GPTQ")

    def int4_tensors(self, source: Checkpoint, t: TensorInfo) -> list[OutTensor]:
        """``qweight`` becomes the three pack-quantized tensors; ``scales`` go with it, ``qzeros`` are
        implied (symmetric); the one transpose in assemble, one tensor at a time."""
        module, part = split_module(t.name)
        if part == "qweight":
            shape = torch.tensor([t.shape[1], t.shape[0] * 8], dtype=torch.int64)
            return [_transposed(source, t, module + ".weight_packed"),
                    _transposed(source, source.tensors[module + ".scales"], module + ".weight_scale"),
                    OutTensor(module + ".weight_shape", "I64", (2,), lambda: iter([shape.numpy().tobytes()]))]
        if part in ("scales", "qzeros"):
            return []
        return [copied(source, t)]

    def head_tensors(self, source: Checkpoint, module: str, n: int, k: int, chunk: int, bar, metrics: dict,
                     hand_over: HandOver | None) -> list[OutTensor]:
        # weight-only int8 is "pack-quantized" at 8 bits: codes + 128, four to an int32 along K.
        # Row-major, so it streams chunk by chunk (vLLM 0.25 rejects an "int-quantized" int8
        # weight without int8 activations).
        scales = torch.empty((n, 1), dtype=torch.float32)
        qz = RowChunkQuantizer(k, min(chunk, n), torch.float32)

        def rows():
            for lo, w in iter_row_chunks(source, module + ".weight", chunk):
                words, s = qz(w)
                scales[lo:lo + w.shape[0], 0] = s
                bar.update(w.shape[0])
                yield raw(words)
            metrics[module] = qz.metrics.result()

        shape = torch.tensor([n, k], dtype=torch.int64)
        return [OutTensor(module + ".weight_packed", "I32", (n, k // 4), rows),
                OutTensor(module + ".weight_scale", "F32", (n, 1), lambda: iter([raw(scales)])),
                OutTensor(module + ".weight_shape", "I64", (2,), lambda: iter([raw(shape)]))]

    def quantization_config(self, source: Checkpoint, fp8_modules: list[str], head_modules: list[str],
                            head_stored: bool) -> dict:
        from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

        int4 = sorted({split_module(t.name)[0] for t in source.tensors.values()
                       if t.storage == "int4" and t.name.endswith(".qweight")})
        group_size = source.quant.group_size or 128
        groups = {
            "int4": QuantizationScheme(
                targets=_regex_for(int4, source.lm_prefix), format="pack-quantized", weights=QuantizationArgs(
                    num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size)),
            "fp8": QuantizationScheme(
                targets=_regex_for(fp8_modules, source.lm_prefix), format="float-quantized", weights=QuantizationArgs(
                    num_bits=8, type="float", symmetric=True, strategy="block", block_structure=[BLOCK, BLOCK]),
                input_activations=QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="group",
                                                   group_size=BLOCK, dynamic=True)),
        }
        if head_modules and head_stored:
            groups["int8_head"] = QuantizationScheme(
                targets=["re:.*lm_head$"], format="pack-quantized",
                weights=QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel"))
        qc = QuantizationConfig(config_groups=groups, format="mixed-precision", quantization_status="compressed",
                                ignore=["re:.*mtp\\..*", "re:.*visual\\..*"])
        return qc.model_dump(mode="json", exclude_none=True)

    def config_problems(self, quant: QuantizationInfo, fp8_modules: list[str],
                        head_modules: list[str]) -> tuple[list[str], str]:
        out = []
        if quant.method != QUANT_METHOD:
            out.append(f"quantization_config.quant_method is {quant.method!r}, expected {QUANT_METHOD!r}")
        for module in fp8_modules + head_modules:
            if quant.module_bits(module) != 8:
                out.append(f"{module}: no 8-bit config group targets it in quantization_config")
        return out, "compressed-tensors config groups target every converted module"

    def head_rows(self, reader: TensorReader, module: str, lo: int, hi: int) -> torch.Tensor:
        packed = reader.rows(module + ".weight_packed", lo, hi)  # [rows, K/4], codes + 128
        s = reader.read(module + ".weight_scale")[lo:hi]
        return dequantize_gptq(packed.t().contiguous(), s.reshape(1, -1), 8, -1)

    def int4_matches(self, artifact: TensorReader, source: TensorReader, module: str,
                     qweight_shape: tuple[int, ...]) -> bool:
        """The source's qweight and scales transposed, bit for bit, and the right ``weight_shape``."""
        return (torch.equal(artifact.read(module + ".weight_packed"), source.read(module + ".qweight").t())
                and torch.equal(artifact.read(module + ".weight_scale"), source.read(module + ".scales").t())
                and artifact.read(module + ".weight_shape").tolist() == [qweight_shape[1], qweight_shape[0] * 8])

    def serving_note(self, int8_head: bool) -> str:
        return ("This is a compressed-tensors mixed-precision checkpoint, written for vLLM 0.33.0's "
                "compressed-tensors support, which resolves each of its groups without a plugin (read in vLLM "
                "0.33.0's source; not yet served on a GPU).")


def _transposed(source: Checkpoint, t: TensorInfo, name: str) -> OutTensor:
    def produce():
        yield read_tensor(source, t.name).t().contiguous().numpy().tobytes()
    return OutTensor(name, t.dtype, (t.shape[1], t.shape[0]), produce)


def _regex_for(modules: list[str], prefix: str) -> list[str]:
    """Generalise module names over layer and expert indices into compressed-tensors ``re:``
    targets. The language-model prefix is replaced by ``.*`` because engines rename it (vLLM's
    VL class calls it ``language_model.model.``)."""
    pats = sorted({re.sub(r"\\\.(\d+)\\\.", r"\\.\\d+\\.", re.escape(m[len(prefix):] if m.startswith(prefix) else m))
                   for m in modules})
    return [f"re:.*{p}$" for p in pats]


FORMAT = CompressedTensors()
