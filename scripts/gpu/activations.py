"""Per-module activations of one prompt under vLLM, to locate where vLLM and transformers part.

Runs THERE (in-process engine, eager): forward hooks on the decoder layers' mixers, norms, MoE
blocks, routers, routed and shared experts record their inputs and outputs for one prefill; the
tensors go to OUT.pt. ``compare_activations.py`` (here, on CPU) feeds the same inputs to the
transformers modules and reports, module by module, how far the outputs are apart.

    python scripts/gpu/activations.py CHECKPOINT REF.pt PROMPT_NAME OUT.pt ['{"moe_backend": "humming"}']
"""
from __future__ import annotations

import re
import sys

import driver

PATTERN = re.compile(r"layers\.\d+\.(input_layernorm|post_attention_layernorm|linear_attn|self_attn|mlp"
                     r"|mlp\.gate|mlp\.experts|mlp\.shared_expert|mlp\.shared_expert_gate|mlp\.experts\.routed_experts)$"
                     r"|(^|\.)norm$|lm_head$")


def _cpu(x):
    import torch

    if isinstance(x, torch.Tensor):
        return x.detach().float().cpu().clone()
    if isinstance(x, (tuple, list)):
        return [_cpu(v) for v in x]
    return None


def install(model) -> list[str]:
    captured = model._hybrid_build_captured = {}  # on the model: the functions may travel pickled
    names = []
    for name, mod in model.named_modules():
        if PATTERN.search(name):
            def hook(m, args, kwargs, out, name=name):
                if name not in captured:  # the first call: the prompt's prefill
                    captured[name] = {"args": _cpu(list(args)), "kwargs": {k: _cpu(v) for k, v in kwargs.items()},
                                      "out": _cpu(out), "cls": type(m).__name__}
            mod.register_forward_hook(hook, with_kwargs=True)
            names.append(f"{name} ({type(mod).__name__})")
    return names


def fetch(model) -> dict:
    return dict(model._hybrid_build_captured)


def main(checkpoint: str, ref_path: str, prompt: str, out: str, engine_kwargs: str = "{}") -> None:
    import json

    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from hybrid_build.serve.runtime.plugin import register

    register()
    ref = torch.load(ref_path)
    ids = ref["prompts"][prompt]
    llm = driver.make_llm(checkpoint, **json.loads(engine_kwargs))
    hooked = llm.apply_model(install)
    llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=1, temperature=0.0))
    caps = llm.apply_model(fetch)
    caps = caps[0] if isinstance(caps, list) else caps
    torch.save({"prompt": prompt, "ids": ids, "hooked": hooked, "captured": caps}, out)
    print(f"captured {len(caps)} modules")


if __name__ == "__main__":
    main(*sys.argv[1:6])
