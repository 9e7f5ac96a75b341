"""The vLLM plugin that teaches vLLM's auto-round (INC) loader the ``inc-hybrid`` format.

Stock INC takes ``data_type`` from the global quantization config, so an FP8 shared expert in an
INT4 checkpoint would be read as 8-bit integers. ``register()`` (entry point
``vllm.general_plugins``) replaces the ``inc`` quantization method with a subclass that, per layer:
- FP8: a linear whose ``extra_config`` entry (or every fused sub-entry) is ``bits 8, data_type fp``
  gets vLLM's block-FP8 linear method (reads ``weight`` + ``weight_scale_inv``);
- int8 head: a ``ParallelLMHead`` with an ``lm_head`` entry of 8 bits gets INC's own 8-bit GPTQ
  scheme (GPTQ-Marlin ``uint8b128``), also when the key is the bare ``lm_head`` that vLLM's name
  mapper does not rewrite; with ``quantize-at-load`` the BF16 head is quantized per row when
  loaded and run through ``int8_gemv.int8_linear``; with ``HYBRID_BUILD_INT8_HEAD_KERNEL=triton``
  the stored head is loaded as GPTQ, then unpacked to int8 rows and run through the same kernel
  instead of vLLM's GPTQ kernel (Machete or Marlin). Both run in the engine's dtype: the kernel
  takes bf16 or fp16 activations natively (a source whose config names no dtype may be served
  in fp16) and returns logits in that dtype; any other dtype (a float32 engine) is cast to bf16
  for the kernel and the logits back;
- everything else: INC's own answer, unchanged.
``register()`` installs every fix of ``fixes.FIXES`` that has a plugin hook: the two parts above
(``install_inc``), the upstream bug fixes in ``upstream_fixes`` (Marlin MoE scale layout) and the
KV-cache fixes in ``kv_cache_fixes`` (a DFlash drafter beside the hybrid target; each only where
the vLLM source is the one it was written against). ``HYBRID_BUILD_DISABLE_FIXES`` can turn each
off: it is then not installed (the INC method is not replaced at all when both of its parts are
off) and the process logs one line saying so.
It is inert (pure delegation) unless the checkpoint's config declares FP8 layers, an int8
head, or the launcher set ``HYBRID_BUILD_LM_HEAD=quantize-at-load``. Works with vLLM 0.25.x and
0.33.x; nothing here is imported before vLLM calls ``register``.
"""
from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger(__name__)

ENV_LM_HEAD = "HYBRID_BUILD_LM_HEAD"  # "quantize-at-load": set by `hybrid-build serve`
ENV_HEAD_KERNEL = "HYBRID_BUILD_INT8_HEAD_KERNEL"  # "triton": the project's GEMV for a stored int8 head
FP8_DISPATCH, INT8_HEAD = "inc_fp8_dispatch", "int8_lm_head"  # this module's two fixes (``fixes.FIXES``)
FP8_BLOCK = (128, 128)
_REGEX_CHARS = set(r"*+?^$()[]{}|\\")


def is_fp8_entry(entry: dict | None) -> bool:
    return bool(entry) and entry.get("bits") == 8 and entry.get("data_type") in ("fp", "fp8")


def is_int8_entry(entry: dict | None) -> bool:
    return bool(entry) and entry.get("bits") == 8 and entry.get("data_type", "int") == "int"


def exact_entry(extra: dict, name: str) -> dict | None:
    """An exact (non-regex) extra_config entry for ``name``, or for a suffix of it after a dot
    (``lm_head`` for ``language_model.lm_head``)."""
    if name in extra:
        return extra[name]
    for key, value in extra.items():
        if not any(c in _REGEX_CHARS for c in key) and name.endswith("." + key):
            return value
    return None


def fused_entries(extra: dict, name: str, packed: dict[str, list[str]]) -> list[dict | None] | None:
    """The sub-layer entries of a fused layer (``gate_up_proj`` -> gate_proj, up_proj)."""
    for fused, subs in (packed or {}).items():
        if name.endswith("." + fused) or name == fused:
            base = name[: len(name) - len(fused)]
            return [exact_entry(extra, base + s) for s in subs]
    return None


def layer_fp8_block(extra: dict, name: str, packed: dict[str, list[str]]) -> tuple[int, int] | None:
    """The FP8 block of a layer the checkpoint stores as FP8, else None. A fused layer whose
    parts disagree (some FP8, some not) cannot be served: that raises ValueError."""
    entries = fused_entries(extra, name, packed)
    if entries is None:
        entries = [exact_entry(extra, name)]
    fp8 = [is_fp8_entry(e) for e in entries]
    if not any(fp8):
        return None
    if not all(fp8):
        raise ValueError(f"hybrid-build: fused layer {name} mixes FP8 and non-FP8 parts in extra_config")
    blocks = {tuple(e.get("weight_block_size") or FP8_BLOCK) for e in entries}  # type: ignore[union-attr]
    if len(blocks) != 1:
        raise ValueError(f"hybrid-build: fused layer {name} has parts with different FP8 blocks {sorted(blocks)}")
    return blocks.pop()


def declares_hybrid(quant_config: dict) -> bool:
    extra = quant_config.get("extra_config") or {}
    return any(is_fp8_entry(v) for v in extra.values()) or os.environ.get(ENV_LM_HEAD) == "quantize-at-load"


def _fp8_linear_method(prefix: str, block: tuple[int, int]):
    try:  # vLLM >= 0.33: INC's own block-FP8 scheme
        from vllm.model_executor.layers.quantization.inc.inc_linear import INCLinearMethod
        from vllm.model_executor.layers.quantization.inc.schemes.inc_fp8_linear import INCFp8LinearScheme
    except ImportError:
        from vllm.model_executor.layers.quantization.fp8 import Fp8Config, Fp8LinearMethod

        return Fp8LinearMethod(Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="dynamic",
                                         weight_block_size=list(block)))
    return INCLinearMethod(INCFp8LinearScheme(prefix=prefix, weight_block_size=block))


def _int8_head_method(config, layer, prefix: str):
    """INC's own 8-bit GPTQ scheme for a stored int8 head (per-channel, symmetric)."""
    from vllm.model_executor.layers.quantization.inc.config_parser import INCLayerConfig
    from vllm.model_executor.layers.quantization.inc.schemes.factory import resolve_scheme

    fields = dict(bits=8, group_size=-1, sym=True, packing_format=config.packing_format,
                  backend=config.backend, data_type="int", quantized=True)
    if config.packing_format not in ("auto_round:auto_gptq", "auto_round:auto_awq"):
        fields["packing_format"] = "auto_round:auto_gptq"
    layer_config = INCLayerConfig(**fields)
    return resolve_scheme(layer_config).get_linear_method(config, layer, prefix, layer_config)


def gptq_int8_rows(qweight, scales):
    """A stored 8-bit GPTQ head -> (int8 rows [N, K], per-row scales [N]) for ``int8_linear``.

    ``qweight`` int32 [K/4, N] holds ``code + 128`` for k = 4j..4j+3 in the bytes of word j, low
    byte first (``calibration.gptq.pack_int8_gptq``); ``scales`` is [1, N] (one group). Runs on the
    weight's device, N in slices so the temporary stays small."""
    import sys

    import torch

    if sys.byteorder != "little":
        raise RuntimeError("the int8 head unpacking assumes a little-endian host")
    k4, n = qweight.shape
    if scales.numel() != n:
        raise ValueError(f"scales have {scales.numel()} elements for {n} output rows (one group expected)")
    rows = torch.empty((n, 4 * k4), dtype=torch.int8, device=qweight.device)
    step = 16384
    for lo in range(0, n, step):
        part = qweight[:, lo:lo + step].contiguous().view(torch.uint8).view(k4, -1, 4)  # [K/4, n', 4]
        rows[lo:lo + step] = (part.permute(1, 0, 2) ^ 0x80).reshape(-1, 4 * k4).view(torch.int8)
    return rows, scales.reshape(-1).float().contiguous()


def _apply_int8_rows(layer, x, bias=None):
    """The head's logits from ``layer.weight_int8`` / ``layer.weight_scale_row`` via the int8 GEMV,
    in x's dtype (the engine's). The kernel takes bf16 and fp16 as they are; another dtype (float32)
    goes through it as bf16 and comes back cast to x's dtype: rounding x to bf16 moves a logit by at
    most 2^-9 sum_k |x_k| absmax_n, half of what the int8 codes themselves may (absmax_n / 254 per
    weight)."""
    import torch

    from .int8_gemv import ACTIVATION_DTYPES, int8_linear

    if x.dtype in ACTIVATION_DTYPES:
        out = int8_linear(x, layer.weight_int8, layer.weight_scale_row)
    else:
        out = int8_linear(x.to(torch.bfloat16), layer.weight_int8, layer.weight_scale_row).to(x.dtype)
    return out if bias is None else out + bias


def _triton_int8_head_method(inner):
    """Wrap vLLM's GPTQ method for the stored head: its parameters load as they are, then the head is
    unpacked to int8 rows and served by ``int8_gemv.int8_linear``."""
    from vllm.model_executor.layers.linear import LinearMethodBase

    class Int8HeadTritonMethod(LinearMethodBase):
        def create_weights(self, layer, *args, **kwargs):
            inner.create_weights(layer, *args, **kwargs)

        def process_weights_after_loading(self, layer) -> None:
            import torch

            if not (hasattr(layer, "qweight") and hasattr(layer, "scales")):
                raise RuntimeError(f"hybrid-build: the int8 head's GPTQ method ({type(inner).__name__}) did not "
                                   f"create qweight/scales; unset {ENV_HEAD_KERNEL} to use vLLM's own kernel")
            from .int8_gemv import prepare_weight

            rows, scale = gptq_int8_rows(layer.qweight.data, layer.scales.data)
            for name in ("qweight", "qzeros", "scales", "g_idx"):
                if hasattr(layer, name):
                    delattr(layer, name)
            layer.weight_int8 = torch.nn.Parameter(prepare_weight(rows), requires_grad=False)
            layer.weight_scale_row = torch.nn.Parameter(scale, requires_grad=False)

        def apply(self, layer, x, bias=None):
            return _apply_int8_rows(layer, x, bias)

    return Int8HeadTritonMethod()


def _load_time_int8_head_method():
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    class Int8HeadAtLoadMethod(UnquantizedLinearMethod):
        """A head in the engine's dtype (bf16, fp16, ...), quantized to int8 per row once loaded
        (in float32: the codes do not depend on the dtype beyond the weight's own rounding); runs
        through the int8 GEMV, logits in the engine's dtype."""

        def process_weights_after_loading(self, layer) -> None:
            import torch

            from .int8_gemv import prepare_weight

            w = layer.weight.data
            scale = (w.float().abs().amax(dim=1) / 127.0).clamp_min(1e-12)
            q = torch.round(w.float() / scale[:, None]).clamp_(-127, 127).to(torch.int8)
            layer.weight_int8 = torch.nn.Parameter(prepare_weight(q), requires_grad=False)
            layer.weight_scale_row = torch.nn.Parameter(scale, requires_grad=False)
            # the embedding of an untied head is separate, so the float copy can go
            layer.weight = torch.nn.Parameter(torch.empty(0, dtype=w.dtype, device=w.device), requires_grad=False)

        def apply(self, layer, x, bias=None):
            return _apply_int8_rows(layer, x, bias)

    return Int8HeadAtLoadMethod()


def make_config_class(base: type, off: frozenset[str] = frozenset()) -> type:
    """A subclass of vLLM's ``INCConfig`` that honours the hybrid per-layer entries, less the parts
    named in ``off`` (``inc_fp8_dispatch``, ``int8_lm_head``: those layers get INC's own answer)."""

    class HybridINCConfig(base):  # type: ignore[misc, valid-type]
        hybrid_build = True

        @classmethod
        def from_config(cls, config: dict[str, Any]):
            obj = super().from_config(config)
            obj._hybrid = declares_hybrid(config) or any(is_int8_entry(v) for k, v in
                                                         (config.get("extra_config") or {}).items()
                                                         if k.split(".")[-1] == "lm_head")
            return obj

        def get_quant_method(self, layer, prefix: str):
            method = self.hybrid_quant_method(layer, prefix) if getattr(self, "_hybrid", False) else None
            return method if method is not None else super().get_quant_method(layer, prefix)

        def hybrid_quant_method(self, layer, prefix: str):
            from vllm.model_executor.layers.linear import LinearBase
            from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

            extra = self.extra_config or {}
            packed = getattr(self, "packed_modules_mapping", None) or {}
            if isinstance(layer, ParallelLMHead):
                if INT8_HEAD in off:
                    return None
                if is_int8_entry(exact_entry(extra, prefix)):
                    method = _int8_head_method(self, layer, prefix)
                    if os.environ.get(ENV_HEAD_KERNEL) == "triton":
                        return _triton_int8_head_method(method)
                    return method
                if os.environ.get(ENV_LM_HEAD) == "quantize-at-load":
                    return _load_time_int8_head_method()
                return None
            if isinstance(layer, LinearBase) and FP8_DISPATCH not in off:
                block = layer_fp8_block(extra, prefix, packed)
                if block is not None:
                    log.debug("hybrid-build: %s -> FP8 block %s", prefix, block)
                    return _fp8_linear_method(prefix, block)
            return None

    HybridINCConfig.__name__ = HybridINCConfig.__qualname__ = "HybridINCConfig"
    return HybridINCConfig


_registered: type | None = None  # the ``inc`` class registered, if any
_done = False


def register() -> None:
    """vLLM entry point: call the hook of every fix in ``fixes.FIXES`` that has one, with the ids it
    installs less those ``HYBRID_BUILD_DISABLE_FIXES`` turns off (idempotent). An unknown id in that
    variable stops vLLM with one line: a typo must not leave a fix on."""
    global _done
    if _done:
        return
    from .fixes import FIXES, disabled_fixes, hooks, off_line

    off = disabled_fixes() & {f.id for f in FIXES if f.plugin}
    for fix_id in sorted(off):
        log.warning(off_line(fix_id))
    state: dict[str, str] = {}
    for hook, ids in hooks().items():
        enabled = frozenset(ids) - off
        if enabled:
            state.update(_hook(hook)(enabled))
    log.info("hybrid-build plugin: runtime fixes %s", ", ".join(f"{k} {v}" for k, v in sorted(state.items())))
    _done = True


def _hook(name: str):
    """``module:function`` of this package (a ``fixes.Fix.hook``)."""
    import importlib

    module, function = name.split(":")
    return getattr(importlib.import_module(f"{__package__}.{module}"), function)


def install_inc(enabled: frozenset[str]) -> dict[str, str]:
    """The hook of ``inc_fp8_dispatch`` and ``int8_lm_head``: replace the ``inc`` method with the
    subclass that does the enabled parts. ``applied``, or ``absent`` on a vLLM without INC."""
    global _registered
    off = frozenset({FP8_DISPATCH, INT8_HEAD}) - enabled
    try:
        from vllm.model_executor.layers.quantization import register_quantization_config
        from vllm.model_executor.layers.quantization.inc import INCConfig
    except ImportError as e:  # a vLLM without the INC package: nothing to teach
        log.warning("hybrid-build plugin: vLLM's INC quantization is not importable (%s); plugin inactive", e)
        return dict.fromkeys(enabled, "absent")
    if getattr(INCConfig, "hybrid_build", False):
        _registered = INCConfig
        return dict.fromkeys(enabled, "applied")
    _registered = make_config_class(INCConfig, off)
    register_quantization_config("inc")(_registered)
    log.info("hybrid-build plugin: per-layer FP8 and int8 lm-head enabled for auto-round checkpoints")
    return dict.fromkeys(enabled, "applied")


__all__ = ["register", "install_inc", "make_config_class", "layer_fp8_block", "exact_entry", "declares_hybrid",
           "ENV_LM_HEAD", "ENV_HEAD_KERNEL", "gptq_int8_rows"]
