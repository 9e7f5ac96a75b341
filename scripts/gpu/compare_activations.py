"""Here, on CPU: feed the inputs that vLLM's modules saw (``activations.py``) to the same modules of
the transformers model and to the checkpoint's own (dequantized) weights; print how far apart the
outputs are, module by module.

    python scripts/gpu/compare_activations.py CHECKPOINT ACTIVATIONS.pt

vLLM's ``shared_expert`` output already carries the sigmoid of ``shared_expert_gate``; its MoE
runner's output is the whole block (routed + gated shared), so the routed part is the difference.

The routed experts are also computed with the gate/up scales laid out as stock vLLM 0.23-0.33 lays
them out for Marlin when ``moe_intermediate_size <= group_size < hidden_size`` (channel-wise
permutation, read by the kernel as grouped; ``serve/runtime/upstream_fixes.py``): a capture made without the
fix matches that line, one made with it matches the line above.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from hybrid_build.calibration.gptq import dequantize_gptq
from hybrid_build.core.checkpoint import Checkpoint
from hybrid_build.core.weights import load_weight, read_tensor


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def swiglu(x, wg, wu, wd):
    return (torch.nn.functional.silu(x @ wg.t()) * (x @ wu.t())) @ wd.t()


def stock_marlin_w13_scales(scales: torch.Tensor, group: int, intermediate: int) -> torch.Tensor:
    """[groups, n] gate/up scales as the Marlin MoE kernel reads them after stock vLLM's preparation:
    permuted by the rule ``group < intermediate`` and read back by the kernel's rule ``groups > 1``."""
    grouped = torch.tensor([i + 8 * j for i in range(8) for j in range(8)])
    single = torch.tensor([2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25)])

    def layout(n: int, use_grouped: bool) -> torch.Tensor:
        perm = grouped if use_grouped else single
        return torch.arange(n).reshape(-1, len(perm))[:, perm].reshape(-1)

    flat = scales.reshape(-1)
    written = layout(flat.numel(), group < intermediate)
    expected = layout(flat.numel(), scales.shape[0] > 1)
    seen = torch.empty_like(flat)
    seen[expected] = flat[written]
    return seen.reshape(scales.shape)


def stock_marlin_expert(ck: Checkpoint, prefix: str, group: int) -> list[torch.Tensor]:
    """(gate, up, down) of one INT4 GPTQ expert (symmetric, zero point 8) with stock-vLLM w13 scales."""
    def raw(name):
        return read_tensor(ck, f"{prefix}.{name}")

    inter = raw("gate_proj.qweight").shape[1]
    s13 = stock_marlin_w13_scales(torch.cat([raw("gate_proj.scales"), raw("up_proj.scales")], 1).float(),
                                  group, inter)
    return [dequantize_gptq(raw("gate_proj.qweight"), s13[:, :inter], 4, group),
            dequantize_gptq(raw("up_proj.qweight"), s13[:, inter:], 4, group),
            dequantize_gptq(raw("down_proj.qweight"), raw("down_proj.scales"), 4, group)]


def main(checkpoint: str, activations: str) -> None:
    from transformers import AutoModelForCausalLM

    torch.set_grad_enabled(False)
    caps = torch.load(activations)["captured"]
    ck = Checkpoint.read_folder(Path(checkpoint))
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16, device_map="cpu").eval()
    cfg = model.config
    w = lambda name: load_weight(ck, "model.language_model." + name).float()  # noqa: E731
    for i, layer in enumerate(model.model.layers):
        p = f"language_model.model.layers.{i}"
        if f"{p}.linear_attn" in caps:
            c = caps[f"{p}.linear_attn"]["kwargs"]
            out = layer.linear_attn(c["hidden_states"].to(torch.bfloat16)[None])[0]
            print(f"layer {i} gated DeltaNet                 rel {rel(out, c['output']):.4f}")
        router = caps[f"{p}.mlp.gate"]
        x = router["args"][0]
        logits = x @ w(f"layers.{i}.mlp.gate").t()
        top = logits.topk(cfg.num_experts_per_tok, -1).indices.sort(-1).values
        same = (top == router["out"][0].topk(cfg.num_experts_per_tok, -1).indices.sort(-1).values).all(-1)
        print(f"layer {i} router logits                  rel {rel(logits, router['out'][0]):.4f}  "
              f"same top-k on {same.float().mean():.0%} of tokens")
        shared = caps[f"{p}.mlp.shared_expert"]
        gate = torch.sigmoid(x @ w(f"layers.{i}.mlp.shared_expert_gate").t())
        mine = gate * swiglu(x, *(w(f"layers.{i}.mlp.shared_expert.{n}")
                                  for n in ("gate_proj", "up_proj", "down_proj")))
        print(f"layer {i} shared expert (gated)          rel {rel(mine, shared['out']):.4f}")
        probs = torch.softmax(logits, -1)
        val, idx = probs.topk(cfg.num_experts_per_tok, -1)
        val = val / val.sum(-1, keepdim=True)
        experts = {j: [w(f"layers.{i}.mlp.experts.{j}.{n}") for n in ("gate_proj", "up_proj", "down_proj")]
                   for j in idx.unique().tolist()}
        routed = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for k in range(idx.shape[1]):
                routed[t] += val[t, k] * swiglu(x[t:t + 1], *experts[int(idx[t, k])])[0]
        routed_vllm = caps[f"{p}.mlp.experts"]["out"] - shared["out"]
        print(f"layer {i} routed experts (INT4)          rel {rel(routed, routed_vllm):.4f}")
        group = ck.quant.group_size or 128
        stock = {j: stock_marlin_expert(ck, f"model.language_model.layers.{i}.mlp.experts.{j}", group)
                 for j in idx.unique().tolist()}
        routed_stock = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for k in range(idx.shape[1]):
                routed_stock[t] += val[t, k] * swiglu(x[t:t + 1], *stock[int(idx[t, k])])[0]
        print(f"layer {i}   as stock vLLM's Marlin scales  rel {rel(routed_stock, routed_vllm):.4f}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
