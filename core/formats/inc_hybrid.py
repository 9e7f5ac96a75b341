"""``inc-hybrid``: an auto-round checkpoint with exact per-layer FP8 and GPTQ int8-head entries.

The INT4 tensors are the source's bytes; each FP8 module is stored as Qwen's FP8 checkpoints store
it (``weight`` + float32 ``weight_scale_inv`` per 128x128 block); the int8 head is GPTQ 8-bit
(``qweight`` int32 [K/4, N], ``qzeros`` all 0x7f7f7f7f, ``scales`` float16 [1, N]). Stock vLLM's
INC parser takes ``data_type`` from the global config only, so serving needs hybrid-build's vLLM
plugin, which honours the ``extra_config`` entries (docs/formats.md).
"""
from __future__ import annotations

import copy
import re

import torch

from hybrid_build.calibration.fp8_block import BLOCK
from hybrid_build.calibration.gptq import SYM_ZERO_WORD, dequantize_gptq, int8_gptq_qzeros
from hybrid_build.calibration.int8_rows import RowChunkQuantizer
from hybrid_build.core.checkpoint import Checkpoint, QuantizationInfo
from hybrid_build.core.safetensors_io import OutTensor
from hybrid_build.core.weights import iter_row_chunks

from .base import HandOver, OutputFormat, Parts, TensorReader, raw

QUANT_METHOD = "auto-round"
FP8_EXTRA = {"bits": 8, "data_type": "fp", "weight_block_size": [BLOCK, BLOCK],
             "act_data_type": "fp", "act_dynamic": True}
INT8_HEAD_EXTRA = {"bits": 8, "group_size": -1, "sym": True, "data_type": "int"}
# what validate requires of an entry (the activation keys and the head's data_type are the plugin's defaults)
FP8_EXTRA_REQUIRED = {"bits": 8, "data_type": "fp", "weight_block_size": [BLOCK, BLOCK]}
HEAD_EXTRA_REQUIRED = {"bits": 8, "group_size": -1, "sym": True}
_REGEX_CHARS = "*+?^$()[]{}|\\"


class IncHybrid(OutputFormat):
    name = "inc-hybrid"
    description = ("auto-round INT4 with per-layer FP8 and GPTQ int8-head entries, served through hybrid-build's "
                   "vLLM plugin")
    fp8_scale_part = "weight_scale_inv"
    head_label = "gptq-int8"
    head_scale_part = "scales"
    hands_over_head = True  # qweight interleaves all rows: it is gathered in memory anyway
    writes_quantization_config_file = True  # auto-round writes this file too

    def head_parts(self, n: int, k: int) -> Parts:
        return {"qweight": ("I32", (k // 4, n)), "qzeros": ("I32", (1, n // 4)), "scales": ("F16", (1, n))}

    def head_problem(self, n: int, k: int) -> str | None:
        if n % 4 or k % 4:
            return (f"the recipe's lm_head storage gptq-int8 packs 4 values to an int32 and needs rows and columns "
                    f"divisible by 4, the shape is {n}x{k}")
        return None

    def head_tensors(self, source: Checkpoint, module: str, n: int, k: int, chunk: int, bar, metrics: dict,
                     hand_over: HandOver | None) -> list[OutTensor]:
        # qweight comes first in the file and interleaves all rows: its producer quantizes the
        # whole head, then the scales' producer yields what it left behind
        scales16 = torch.empty((1, n), dtype=torch.float16)
        zeros = int8_gptq_qzeros(n)

        def qweight_bytes():
            qweight = torch.empty((k // 4, n), dtype=torch.int32)
            qz = RowChunkQuantizer(k, min(chunk, n), torch.float16)  # GPTQ scales are fp16
            for lo, w in iter_row_chunks(source, module + ".weight", chunk):
                hi = lo + w.shape[0]
                words, s16 = qz(w)
                for j in range(0, hi - lo, 64):  # transposed in 64-row blocks: 2.5x faster than at once
                    qweight[:, lo + j:min(hi, lo + j + 64)] = words[j:j + 64].t()
                scales16[0, lo:hi] = s16
                bar.update(hi - lo)
            metrics[module] = qz.metrics.result()
            if hand_over is not None:
                hand_over({module + ".qweight": qweight, module + ".qzeros": zeros, module + ".scales": scales16})
            yield raw(qweight)

        return [OutTensor(module + ".qweight", "I32", (k // 4, n), qweight_bytes),
                OutTensor(module + ".qzeros", "I32", tuple(zeros.shape), lambda: iter([raw(zeros)])),
                OutTensor(module + ".scales", "F16", (1, n), lambda: iter([raw(scales16)]))]

    def quantization_config(self, source: Checkpoint, fp8_modules: list[str], head_modules: list[str],
                            head_stored: bool) -> dict:
        """The source's auto-round config with an exact ``extra_config`` entry per converted module."""
        qc = copy.deepcopy(source.quant.raw)
        extra = qc.setdefault("extra_config", {})
        for key in [k for k in extra if any(c in k for c in _REGEX_CHARS) and
                    any(re.search(k, m) for m in fp8_modules + head_modules)]:
            del extra[key]  # a regex 16-bit entry for converted layers would contradict the exact ones
        for m in fp8_modules:
            extra[m] = dict(FP8_EXTRA)
        if head_stored:
            for m in head_modules:
                extra[m] = dict(INT8_HEAD_EXTRA)
        return qc

    def config_problems(self, quant: QuantizationInfo, fp8_modules: list[str],
                        head_modules: list[str]) -> tuple[list[str], str]:
        out = []
        if quant.method != QUANT_METHOD:
            out.append(f"quantization_config.quant_method is {quant.method!r}, expected {QUANT_METHOD!r}")
        for modules, required in ((fp8_modules, FP8_EXTRA_REQUIRED), (head_modules, HEAD_EXTRA_REQUIRED)):
            for module in modules:
                entry = quant.layer_override(module) or {}
                wrong = {k: entry.get(k) for k, v in required.items() if entry.get(k) != v}
                if wrong:
                    out.append(f"{module}: extra_config entry {wrong} must be {required}")
        return out, "extra_config declares FP8 block-128 and int8 per-row entries"

    def head_rows(self, reader: TensorReader, module: str, lo: int, hi: int) -> torch.Tensor:
        return dequantize_gptq(reader.read(module + ".qweight", slice(lo, hi)),
                               reader.read(module + ".scales", slice(lo, hi)), 8, -1)

    def head_problems(self, reader: TensorReader, module: str) -> list[str]:
        qz = reader.read(module + ".qzeros")
        if not bool((qz.to(torch.int64) & 0xFFFFFFFF).eq(SYM_ZERO_WORD[8]).all()):
            return [f"{module}.qzeros: not every word is 0x7f7f7f7f (symmetric int8, zero 128)"]
        return []

    def serving_note(self, int8_head: bool) -> str:
        # what vLLM's own code does with this layout, as tests/serve/runtime/test_vllm_plugin.py runs it (the real
        # INCConfig of each version on this format's quantization_config, on CPU)
        head = (" The int8 lm-head: 0.25.1 resolves it as an unquantized layer, 0.33.0 as an 8-bit integer GPTQ "
                "layer." if int8_head else "")
        return ("Stock vLLM does not run the FP8 shared experts as FP8. In vLLM 0.25.1 and 0.33.0, "
                "`INCConfigParser.resolve` (`vllm/model_executor/layers/quantization/inc/config_parser.py`) takes a "
                "layer's data type and packing from the checkpoint's global quantization config (`int`, "
                "`auto_round:auto_gptq`); an `extra_config` entry sets only its bits, group size and symmetry. So the "
                "shared experts (`bits: 8, data_type: fp`) resolve to 8-bit integer GPTQ layers with group size 128, "
                "which expect `qweight`, `qzeros` and `scales` where this checkpoint stores an FP8 `weight` and its "
                "`weight_scale_inv`." + head + " Install hybrid-build next to vLLM: its vLLM plugin (entry point "
                "`vllm.general_plugins`) serves the shared experts with vLLM's FP8 block method"
                + (" and the int8 lm-head." if int8_head else "."))


FORMAT = IncHybrid()
