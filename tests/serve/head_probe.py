"""Run the plugin's two int8 lm-head methods on real vLLM base classes, on CPU (a subprocess).

Usage: ``PYTHONPATH=<vllm src>:<cpu deps> python head_probe.py OUT.json``

For each engine dtype (bf16, fp16: the kernel's own; float32: cast to bf16 at the boundary):
- quantize-at-load: the method subclasses vLLM's ``UnquantizedLinearMethod``; its real
  ``create_weights`` registers the head in the engine's dtype, a random head is loaded into it,
  then ``process_weights_after_loading`` and ``apply`` run as vLLM would call them.
- Triton head: the method wraps an inner GPTQ method; here the inner one is a stand-in that
  registers what INC's 8-bit GPTQ method registers (``qweight`` [K/4, N] int32, ``scales`` [1, N]
  in the engine's dtype, ``qzeros``, ``g_idx``), filled with our own packing of the same head and
  its scales as the artifact stores them (fp16), converted to the engine's dtype as vLLM's loader
  does.
Writes, per method and dtype, the largest error over its bound against two float64 references
(the same int8 math, and the float head), and norm-relative errors; the test checks them.

The bounds, per logit n of a batch row x (exact float64, no statistics):
- kernel vs the int8 math ``x . (s'_n q_n)`` with s'_n the scale the kernel is given: products of
  a bf16/fp16 value and an int8 code are exact in fp32 (<= 11 + 8 significant bits), the K-term
  fp32 sum plus the scale multiply err by at most E = gamma(K + 2) * M with
  M = s'_n sum_k |x_k q_nk|, gamma(m) = m u / (1 - m u) and u = 2^-23 (fp32's 2^-24, doubled for
  tensor cores that truncate); the store into the output dtype adds u_out * (|v| + E) + a_out:
  fp16 (10-bit mantissa, round to nearest) u_out = 2^-11 and a_out = 2^-25 (half the spacing of
  fp16's subnormals, below 2^-14); bf16 u_out = 2^-7 (one ulp: Triton 3.9's interpreter
  truncates, a GPU rounds to 2^-8) and a_out = 2^-133. A float32 engine adds
  s'_n sum_k |x_k - bf16(x_k)| |q_nk| for its boundary cast.
- int8 math vs the float head W (in the engine's dtype): q = clamp(round(fl(W / s))) with
  s = fl(absmax / 127) gives |W_nk - s_n q_nk| <= s_n (1/2 + 2^-16) (the fp32 division and the
  clamp move W / s by at most 128 * 2^-23 = 2^-16), and the scale the kernel gets adds
  |s_n - s'_n| |q_nk|; summed against |x_k| this bounds the rest of the error against x . W_n.
"""
from __future__ import annotations

import json
import sys

U32 = 2.0**-24


def out_rounding(dtype) -> tuple[float, float]:
    """(relative, absolute) error of storing a float32 value in ``dtype`` (see the module doc)."""
    import torch

    return {torch.float16: (2.0**-11, 2.0**-25), torch.bfloat16: (2.0**-7, 2.0**-133),
            torch.float32: (U32, 2.0**-150)}[dtype]


def bounds(x, x_kernel, head, q, s_kernel, s_quant, kernel_out_dtype):
    """float64 int8-math and float-head references, and the error bound against each."""

    x64, xk64, q64 = x.double(), x_kernel.double(), q.double()
    sk, sq = s_kernel.double().reshape(-1), s_quant.double().reshape(-1)
    int8_math = (x64 @ q64.t()) * sk
    float_math = x64 @ head.double().t()
    k = x.shape[-1]
    gamma = 2 * (k + 2) * U32 / (1 - 2 * (k + 2) * U32)
    fp32_err = gamma * (xk64.abs() @ q64.abs().t()) * sk
    u_out, a_out = out_rounding(kernel_out_dtype)
    cast_in = ((x64 - xk64).abs() @ q64.abs().t()) * sk  # zero unless the engine casts x
    vs_int8 = u_out * (int8_math.abs() + fp32_err + cast_in) + a_out + fp32_err + cast_in
    quant = x64.abs().sum(dim=1, keepdim=True) * sq * (0.5 + 2.0**-16) + (x64.abs() @ q64.abs().t()) * (sq - sk).abs()
    return int8_math, vs_int8, float_math, vs_int8 + quant


def results() -> dict:
    """Per method and engine dtype, what the module docstring says is written."""
    import torch
    import vllm.model_executor.parameter as vllm_parameter
    from vllm.model_executor.layers.linear import LinearMethodBase, UnquantizedLinearMethod

    from hybrid_build.calibration.gptq import int8_gptq_qzeros, pack_int8_gptq
    from hybrid_build.calibration.int8_rows import quantize_int8_rows
    from hybrid_build.serve.runtime import plugin as vllm_plugin
    from hybrid_build.serve.runtime.int8_gemv import untile_weight

    def untile(w, n_, k_):
        return untile_weight(w, n_, k_) if w.dim() == 4 else w

    # one rank, no process group: vLLM's parameters ask for their tensor-parallel rank and size
    vllm_parameter.get_tensor_model_parallel_rank = lambda: 0
    vllm_parameter.get_tensor_model_parallel_world_size = lambda: 1
    n, k = 1024, 256

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a.double() - b).norm() / b.norm()).item()

    def record(method, layer, y, x, head, q, s_kernel, s_quant, base) -> dict:
        kernel_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        x_kernel = x.to(kernel_dtype)
        int8_math, b_int8, float_math, b_float = bounds(x, x_kernel, head, q, s_kernel, s_quant, kernel_dtype)
        return {"base": base in type(method).__mro__,
                "params": sorted(name for name, p in layer.named_parameters() if p.numel()),
                # the codes, tiled by prepare_weight where the Triton kernel runs (interpreter too)
                "codes_equal": bool(torch.equal(untile(layer.weight_int8, *q.shape), q)),
                "weight_layout": "tiled" if layer.weight_int8.dim() == 4 else "rows",
                "out_dtype": str(y.dtype).replace("torch.", ""), "finite": bool(torch.isfinite(y).all()),
                "max_err_over_bound_int8": ((y.double() - int8_math).abs() / b_int8).max().item(),
                "max_err_over_bound_float": ((y.double() - float_math).abs() / b_float).max().item(),
                # the bounds are not vacuous: far below the logits themselves
                "bound_int8_over_max_logit": (b_int8.max() / int8_math.abs().max()).item(),
                "rel_vs_int8_math": rel(y, int8_math), "rel_vs_float_head": rel(y, float_math)}

    result: dict = {}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        name = str(dtype).replace("torch.", "")
        torch.manual_seed(0)
        head = (torch.randn(n, k) * 0.02).to(dtype)
        x = torch.randn(3, k).to(dtype)
        q, scale = quantize_int8_rows(head)

        at_load = vllm_plugin._load_time_int8_head_method()
        layer = torch.nn.Module()
        at_load.create_weights(layer, k, [n], k, n, dtype, weight_loader=lambda p, w: p.data.copy_(w))
        layer.weight.weight_loader(layer.weight, head)
        at_load.process_weights_after_loading(layer)
        y = at_load.apply(layer, x)
        result[f"at_load/{name}"] = record(at_load, layer, y, x, head, q, layer.weight_scale_row, scale,
                                           UnquantizedLinearMethod)

        class StandInGPTQ:  # registers what INC's 8-bit GPTQ method registers for a head
            def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size,
                               output_size, params_dtype, **kwargs):
                rows = sum(output_partition_sizes)
                layer.register_parameter("qweight", torch.nn.Parameter(
                    torch.empty(input_size_per_partition // 4, rows, dtype=torch.int32), requires_grad=False))
                layer.register_parameter("scales", torch.nn.Parameter(torch.empty(1, rows, dtype=params_dtype),
                                                                      requires_grad=False))
                layer.register_parameter("qzeros", torch.nn.Parameter(int8_gptq_qzeros(rows), requires_grad=False))
                layer.register_parameter("g_idx", torch.nn.Parameter(torch.zeros(input_size_per_partition,
                                                                                 dtype=torch.int32),
                                                                     requires_grad=False))

        triton_head = vllm_plugin._triton_int8_head_method(StandInGPTQ())
        layer = torch.nn.Module()
        triton_head.create_weights(layer, k, [n], k, n, dtype)
        layer.qweight.data.copy_(pack_int8_gptq(q))
        layer.scales.data.copy_(scale.to(torch.float16)[None])  # stored fp16, loaded into the engine's dtype
        served_scale = scale.to(torch.float16).to(dtype)
        triton_head.process_weights_after_loading(layer)
        y = triton_head.apply(layer, x)
        rec = record(triton_head, layer, y, x, head, q, served_scale, scale, LinearMethodBase)
        rec["params"] = sorted(name for name, _ in layer.named_parameters())
        result[f"triton_head/{name}"] = rec
    return result


def main(out: str) -> int:
    with open(out, "w") as f:
        json.dump(results(), f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
