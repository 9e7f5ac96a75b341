"""What an output format is: ``OutputFormat``, the questions every stage, check and card asks of one.

A format decides how the converted tensors are stored (the FP8 shared experts, the int8 head), how
the source's INT4 tensors are carried (byte copy or repack), the ``quantization_config`` that
declares them, how ``validate`` reads them back, and what the card says about serving them. The
transforms themselves are ``calibration/``'s; a format only arranges their results.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from hybrid_build.calibration.fp8_block import BLOCK
from hybrid_build.core.checkpoint import Checkpoint, QuantizationInfo, TensorInfo
from hybrid_build.core.safetensors_io import ByteRange, OutTensor, tensor_nbytes

Parts = dict[str, tuple[str, tuple[int, ...]]]  # part name -> (safetensors dtype, shape)

# How a recipe keeps its int8 head (``lm_head.storage``), and what the artifact's config.json says
# of it (``hybrid_build.lm_head``). Code outside this package asks the format (``stores_head``,
# ``head_label_for``) or the registry (``formats.head_quantized_at_load``, ``formats.head_stored``)
# and never compares these strings.
HEAD_STORED = "gptq-int8"  # stored int8, in the output format's own layout (the recipe's spelling)
HEAD_AT_LOAD = "bf16"  # left BF16 on disk; the server quantizes it per row when it loads
AT_LOAD_LABEL = "quantize-at-load"  # config.json's label of a head left BF16 for the server
HandOver = Callable[[dict[str, torch.Tensor]], None]  # receives computed head tensors in memory


class TensorReader(Protocol):
    """How a check reads an artifact's tensor: whole, a column block, or a row block."""

    def read(self, name: str, cols: slice | None = None) -> torch.Tensor: ...

    def rows(self, name: str, lo: int, hi: int) -> torch.Tensor: ...


class OutputFormat:
    """One output format. Subclasses set the attributes and implement the methods that differ."""

    name: str
    description: str  # one line, for --help, the card and ``plan``
    fp8_scale_part: str  # the FP8 block scale's part name (the weight is always ``weight``)
    head_label: str  # ``config.json``'s ``hybrid_build.lm_head`` for an int8 head stored in the artifact
    head_scale_part: str  # the stored head's per-row scale
    hands_over_head: bool  # quantize-head may hand its tensors to assemble in memory while it runs
    writes_quantization_config_file: bool  # a quantization_config.json beside config.json, always
    card_tags: tuple[str, ...] = ()

    # ------------------------------------------------------------------ what the tensors look like
    def fp8_parts(self, n: int, k: int) -> Parts:
        """An FP8 module [n, k]: E4M3 weight and one float32 scale per [BLOCK, BLOCK] tile."""
        return {"weight": ("F8_E4M3", (n, k)), self.fp8_scale_part: ("F32", (-(-n // BLOCK), -(-k // BLOCK)))}

    def head_parts(self, n: int, k: int) -> Parts:
        """The int8 head [n, k] as stored."""
        raise NotImplementedError

    def int4_parts(self, src_parts: dict[str, TensorInfo]) -> Parts | None:
        """The artifact parts of a source INT4 module, or None when its tensors are copied as they are."""
        return None

    def fp8_bytes(self, n: int, k: int) -> int:
        return parts_bytes(self.fp8_parts(n, k))

    def stores_head(self, storage: str) -> bool:
        """A recipe's ``lm_head.storage`` puts the int8 head in the artifact (else it stays BF16 and
        the server quantizes it at load)."""
        return storage != HEAD_AT_LOAD

    def head_label_for(self, storage: str) -> str:
        """``config.json``'s ``hybrid_build.lm_head`` for a head converted with ``storage``."""
        return self.head_label if self.stores_head(storage) else AT_LOAD_LABEL

    def head_bytes(self, n: int, k: int, storage: str = HEAD_STORED) -> int:
        """Bytes of the head on disk; a head left BF16 is as it was (two bytes a weight)."""
        return parts_bytes(self.head_parts(n, k)) if self.stores_head(storage) else n * k * 2

    def head_problem(self, n: int, k: int) -> str | None:
        """Why this format cannot store an int8 head of [n, k], or None."""
        return None

    # ------------------------------------------------------------------ building
    def check_source(self, source: Checkpoint) -> None:
        """Refuse a source this format cannot carry (raises ``ArtifactError``)."""

    def int4_tensors(self, source: Checkpoint, t: TensorInfo) -> list[OutTensor]:
        """What an INT4 source tensor becomes in the artifact (here: its bytes, unchanged)."""
        return [copied(source, t)]

    def head_tensors(self, source: Checkpoint, module: str, n: int, k: int, chunk: int, bar, metrics: dict,
                     hand_over: HandOver | None) -> list[OutTensor]:
        """The int8 head's tensors as producers: writing them quantizes ``module`` in row chunks of
        ``chunk``, updates ``bar`` per row and puts the error metrics in ``metrics[module]``."""
        raise NotImplementedError

    def quantization_config(self, source: Checkpoint, fp8_modules: list[str], head_modules: list[str],
                            head_stored: bool) -> dict:
        """The ``quantization_config`` block of the artifact's config.json."""
        raise NotImplementedError

    # ------------------------------------------------------------------ reading back (validate)
    def config_problems(self, quant: QuantizationInfo, fp8_modules: list[str],
                        head_modules: list[str]) -> tuple[list[str], str]:
        """Failure lines for an artifact's quantization config, and the check's detail when it passes.
        ``head_modules`` are the int8 heads stored in the artifact (none for a BF16 head)."""
        raise NotImplementedError

    def head_rows(self, reader: TensorReader, module: str, lo: int, hi: int) -> torch.Tensor:
        """Rows lo:hi of the stored int8 head, dequantized to float32."""
        raise NotImplementedError

    def head_problems(self, reader: TensorReader, module: str) -> list[str]:
        """Structural problems of the stored head beyond its scales (e.g. zero points)."""
        return []

    def int4_matches(self, artifact: TensorReader, source: TensorReader, module: str,
                     qweight_shape: tuple[int, ...]) -> bool:
        """A repacked INT4 module holds the source's codes and scales bit for bit (copies are
        compared byte for byte by the check itself)."""
        return True

    # ------------------------------------------------------------------ the card
    def serving_note(self, int8_head: bool) -> str:
        """What plain vLLM needs to load this artifact (one paragraph of the model card)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<output format {self.name}>"


def parts_bytes(parts: Parts) -> int:
    return sum(tensor_nbytes(dtype, shape) for dtype, shape in parts.values())


def copied(source: Checkpoint, t: TensorInfo, name: str | None = None) -> OutTensor:
    """A source tensor as a byte range: never materialised."""
    return OutTensor(name or t.name, t.dtype, t.shape, ByteRange(source.path_of(t), t.start, t.nbytes))


def raw(t: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy (``tobytes`` would double the 763 MB packed head)."""
    return memoryview(t.contiguous().numpy()).cast("B")
