"""Runtime fixes for upstream vLLM bugs that the hybrid checkpoints (or their tiny test twins) hit.

Applied by the plugin's ``register()`` in every vLLM process, before any model is built. Each fix
is a small wrapper installed on the module that calls the buggy function; it is idempotent and a
no-op on a vLLM that lacks the module.

Marlin MoE scale layout (vLLM 0.23.0 through 0.34.0 at least)
-------------------------------------------------------------
``fused_moe/oracle/int_wna16.py`` prepares GPTQ/AWQ expert scales for the Marlin MoE kernel with
``marlin_moe_permute_scales(s=w13_scales, size_k=layer.intermediate_size_per_partition, ...)``.
``size_k`` only picks the permutation: grouped (``group_size < size_k``) or channel-wise. For the
gate/up weights (w13) the reduction dimension is the *hidden* size, not the intermediate one, while
the kernel reads the grouped layout whenever the scale tensor has more than one group (the w2 call
already passes ``size_k = groups * group_size``, i.e. that rule). So a model whose
``moe_intermediate_size <= group_size < hidden_size`` gets its w13 scales scattered across columns
and the routed experts compute garbage. The tiny Qwen3.5-MoE fixture (hidden 256, experts of 128,
group 128) is such a model; Qwen3.5-122B-A10B (experts of 1024) is not. Measured on an H200 with
vLLM 0.25.1 (lab/gpu_runs.md, run 3): the routed experts' output differed from the checkpoint's math by
a relative 1.36-1.43 and matched a CPU simulation of the mis-permuted scales to 0.0007.

The fix derives ``size_k`` from the scale tensor itself (``groups * group_size``), which is the
kernel's own rule; for every shape where stock vLLM was right it passes the same decision through.
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def marlin_scale_size_k(s, size_k: int, group_size: int) -> int:
    """The reduction size Marlin's scale layout must be chosen by: the scale tensor's group count
    times the group size ([experts, groups, n] scales); channel-wise scales keep the caller's."""
    return s.shape[-2] * group_size if group_size > 0 else size_k


def fix_marlin_moe_scale_layout() -> bool:
    """Wrap ``int_wna16.marlin_moe_permute_scales``; True when the wrapper is in place."""
    try:
        from vllm.model_executor.layers.fused_moe.oracle import int_wna16
    except ImportError:  # a vLLM without this module: nothing to fix
        return False
    stock = getattr(int_wna16, "marlin_moe_permute_scales", None)
    if stock is None:
        return False
    if getattr(stock, "hybrid_build_fix", False):
        return True

    # 0.34.0 dropped the is_a_8bit parameter: whatever the caller passes after group_size goes on as given
    def marlin_moe_permute_scales(s, size_k, size_n, group_size, *rest, **kw):
        is_a_8bit = rest[0] if rest else kw.get("is_a_8bit", False)
        true_k = marlin_scale_size_k(s, size_k, group_size)
        changed = (group_size < true_k) != (group_size < size_k) and group_size != -1 and not is_a_8bit
        if changed and not marlin_moe_permute_scales.fired:
            marlin_moe_permute_scales.fired = True
            log.warning("hybrid-build: Marlin MoE scales %s get the %s layout (vLLM passed size_k=%d, the "
                        "scales span %d): upstream layout bug worked around", tuple(s.shape),
                        "grouped" if group_size < true_k else "channel-wise", size_k, true_k)
        return stock(s, true_k, size_n, group_size, *rest, **kw)

    marlin_moe_permute_scales.hybrid_build_fix = True
    marlin_moe_permute_scales.fired = False  # set (and logged once) when the fix changed a layout
    int_wna16.marlin_moe_permute_scales = marlin_moe_permute_scales
    return True


def install(enabled: frozenset[str]) -> dict[str, str]:
    """The plugin's hook (``fixes.FIXES``): ``applied``, or ``absent`` on a vLLM without the function."""
    return dict.fromkeys(enabled, "applied" if fix_marlin_moe_scale_layout() else "absent")
