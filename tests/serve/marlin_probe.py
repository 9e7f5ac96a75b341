"""Run vLLM's real Marlin MoE weight preparation (``int_wna16._process_weights_marlin``) on CPU and
record the scale layouts it hands the kernel, stock and after the plugin's ``register()``.

Usage: ``PYTHONPATH=<vllm src>:<cpu deps> python marlin_probe.py OUT.json``

Only the qweight repack is a CUDA op; it does not touch the scales, so it is replaced by the
identity here. Scales are filled with their own flat index, so a layout is a permutation that can be
compared exactly. Shapes: hidden 256, group 128 (two groups for w13), 2 experts, with a MoE
intermediate size of 128 (the tiny fixture's: the bug) and of 256 (stock vLLM is right).
"""
from __future__ import annotations

import inspect
import json
import sys
from types import SimpleNamespace


def prepare_all() -> dict[int, dict[str, list]]:
    """vLLM's Marlin MoE weight prep for experts of 128 and 256 (as ``int_wna16`` holds it now)."""
    import torch
    from vllm.model_executor.layers.fused_moe.oracle import int_wna16

    int_wna16.ops.gptq_marlin_moe_repack = lambda w, *args, **kwargs: w
    params = inspect.signature(int_wna16._process_weights_marlin).parameters
    canonical_n_first = "actorder" not in params  # 0.33: [E, N, K] inputs; 0.25: K-first plus g_idx/actorder
    experts, hidden, group, pack = 2, 256, 128, 8

    def prepare(intermediate: int) -> dict[str, list]:
        w13_s = torch.arange(experts * (hidden // group) * 2 * intermediate, dtype=torch.float32)
        w13_s = w13_s.reshape(experts, hidden // group, 2 * intermediate)
        w2_s = torch.arange(experts * (intermediate // group) * hidden, dtype=torch.float32)
        w2_s = w2_s.reshape(experts, intermediate // group, hidden)
        w13 = torch.zeros(experts, hidden // pack, 2 * intermediate, dtype=torch.int32)
        w2 = torch.zeros(experts, intermediate // pack, hidden, dtype=torch.int32)
        kwargs = dict(layer=SimpleNamespace(intermediate_size_per_partition=intermediate,
                                            num_groups_w13=hidden // group, num_groups_w2=intermediate // group),
                      num_bits=4, pack_factor=pack, group_size=group)
        if "input_dtype" in params:  # 0.23.0-0.33.0
            kwargs["input_dtype"] = None
        if canonical_n_first:
            kwargs.update(w13_qweight=w13.transpose(1, 2), w2_qweight=w2.transpose(1, 2),
                          w13_scales=w13_s.transpose(1, 2), w2_scales=w2_s.transpose(1, 2))
        else:
            empty = torch.empty(experts, 0, dtype=torch.int32)
            kwargs.update(w13_qweight=w13, w2_qweight=w2, w13_scales=w13_s, w2_scales=w2_s,
                          actorder=None, w13_g_idx=empty, w2_g_idx=empty)
        result = int_wna16._process_weights_marlin(**kwargs)
        return {"w13": result[2].flatten().tolist(), "w2": result[3].flatten().tolist(),
                "w13_shape": list(w13_s.shape), "w2_shape": list(w2_s.shape)}

    return {i: prepare(i) for i in (128, 256)}


def report(stock: dict, fixed: dict) -> dict:
    """What the test reads: whether ``register()`` installed the fix, both preps and Marlin's perms."""
    from vllm.model_executor.layers.fused_moe.oracle import int_wna16
    from vllm.model_executor.layers.quantization.utils.marlin_utils import get_scale_perms

    grouped, single = get_scale_perms()
    return {"installed": getattr(int_wna16.marlin_moe_permute_scales, "hybrid_build_fix", False), "stock": stock,
            "fixed": fixed, "perms": {"grouped": grouped, "single": single}}


def main(out: str) -> int:
    from hybrid_build.serve.runtime import plugin as vllm_plugin

    stock = prepare_all()
    vllm_plugin.register()  # what vLLM's plugin loader calls: it must install the fix
    with open(out, "w") as f:
        json.dump(report(stock, prepare_all()), f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
