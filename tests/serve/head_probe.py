"""Run the plugin's two int8 lm-head methods on real vLLM base classes, on CPU (a subprocess).

Usage: ``PYTHONPATH=<vllm src>:<cpu deps> python head_probe.py OUT.json``

- quantize-at-load: the method subclasses vLLM's ``UnquantizedLinearMethod``; its real
  ``create_weights`` registers the BF16 weight, a random head is loaded into it, then
  ``process_weights_after_loading`` and ``apply`` run as vLLM would call them.
- Triton head: the method wraps an inner GPTQ method; here the inner one is a stand-in that
  registers what INC's 8-bit GPTQ method registers (``qweight`` [K/4, N] int32, ``scales`` [1, N],
  ``qzeros``, ``g_idx``), filled with our own packing of the same head.
Writes the relative errors of both outputs against float64 references; the test bounds them.
"""
from __future__ import annotations

import json
import sys


def main(out: str) -> int:
    import torch
    import vllm.model_executor.parameter as vllm_parameter
    from vllm.model_executor.layers.linear import LinearMethodBase, UnquantizedLinearMethod

    from hybrid_build.calibration.gptq import int8_gptq_qzeros, pack_int8_gptq
    from hybrid_build.calibration.int8_rows import quantize_int8_rows
    from hybrid_build.serve import vllm_plugin

    # one rank, no process group: vLLM's parameters ask for their tensor-parallel rank and size
    vllm_parameter.get_tensor_model_parallel_rank = lambda: 0
    vllm_parameter.get_tensor_model_parallel_world_size = lambda: 1
    torch.manual_seed(0)
    n, k = 1024, 256
    head = (torch.randn(n, k) * 0.02).to(torch.bfloat16)
    x = torch.randn(3, k).to(torch.bfloat16)
    exact = x.double() @ head.double().t()
    q, scale = quantize_int8_rows(head)
    int8_ref = x.double() @ (q.double() * scale.double()[:, None]).t()

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a.double() - b).norm() / b.norm()).item()

    result: dict = {}
    at_load = vllm_plugin._load_time_int8_head_method()
    layer = torch.nn.Module()
    at_load.create_weights(layer, k, [n], k, n, torch.bfloat16, weight_loader=lambda p, w: p.data.copy_(w))
    layer.weight.weight_loader(layer.weight, head)
    at_load.process_weights_after_loading(layer)
    y = at_load.apply(layer, x)
    result["at_load"] = {"base": UnquantizedLinearMethod in type(at_load).__mro__,
                         "params": sorted(name for name, p in layer.named_parameters() if p.numel()),
                         "codes_equal": bool(torch.equal(layer.weight_int8, q)),
                         "rel_vs_int8_math": rel(y, int8_ref), "rel_vs_bf16_head": rel(y, exact)}

    class StandInGPTQ:  # registers what INC's 8-bit GPTQ method registers for a head
        def create_weights(self, layer, input_size_per_partition, output_partition_sizes, *args, **kwargs):
            rows = sum(output_partition_sizes)
            layer.register_parameter("qweight", torch.nn.Parameter(
                torch.empty(input_size_per_partition // 4, rows, dtype=torch.int32), requires_grad=False))
            layer.register_parameter("scales", torch.nn.Parameter(torch.empty(1, rows, dtype=torch.bfloat16),
                                                                  requires_grad=False))
            layer.register_parameter("qzeros", torch.nn.Parameter(int8_gptq_qzeros(rows), requires_grad=False))
            layer.register_parameter("g_idx", torch.nn.Parameter(torch.zeros(input_size_per_partition,
                                                                             dtype=torch.int32), requires_grad=False))

    triton_head = vllm_plugin._triton_int8_head_method(StandInGPTQ())
    layer = torch.nn.Module()
    triton_head.create_weights(layer, k, [n], k, n, torch.bfloat16)
    layer.qweight.data.copy_(pack_int8_gptq(q))
    layer.scales.data.copy_(scale.to(torch.bfloat16)[None])
    triton_head.process_weights_after_loading(layer)
    y = triton_head.apply(layer, x)
    int8_ref_bf16_scales = x.double() @ (q.double() * scale.to(torch.bfloat16).double()[:, None]).t()
    result["triton_head"] = {"base": LinearMethodBase in type(triton_head).__mro__,
                             "params": sorted(name for name, _ in layer.named_parameters()),
                             "codes_equal": bool(torch.equal(layer.weight_int8, q)),
                             "rel_vs_int8_math": rel(y, int8_ref_bf16_scales), "rel_vs_bf16_head": rel(y, exact)}
    with open(out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
