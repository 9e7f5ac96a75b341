"""CPU reference for the H200 correctness check: transformers prompt logprobs of the tiny source and
of the same model with the artifact's converted weights (shared experts FP8, int8 head) in place.

Runs here (no GPU): the INT4 source needs auto-round's transformers loader, which the GPU image
lacks. Writes one .pt with the prompt token ids and full-vocab log-softmax rows (float32 compute,
as the validate stage does), which the GPU driver compares against vLLM's prompt logprobs.

    python scripts/gpu/reference.py SOURCE INC_ARTIFACT CT_ARTIFACT OUT.pt
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from hybrid_build.core.checkpoint import Checkpoint
from hybrid_build.core.weights import load_weight
from hybrid_build.validate.transformers_forward import _find_module, _forward, _upcast, bundled_texts

MAX_TOKENS = 64  # per prompt: enough positions for a KL estimate, small enough to carry


def prompts(tok) -> dict[str, list[int]]:
    texts = dict(bundled_texts())
    texts["short"] = "The capital of France is Paris. The capital of Italy is"
    return {k: tok(v)["input_ids"][:MAX_TOKENS] for k, v in texts.items()}


def main(source: str, inc: str, ct: str, out: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_grad_enabled(False)
    ids = prompts(AutoTokenizer.from_pretrained(source))
    ids_t = [torch.tensor(v) for v in ids.values()]
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16, device_map="cpu").eval()
    _upcast(model, torch)
    result = {"prompts": ids, "source": _forward(model, ids_t, torch)}
    for label, folder in (("inc-hybrid", inc), ("compressed-tensors", ct)):
        art = Checkpoint.read_folder(Path(folder))
        import json
        modules = json.loads((Path(inc) / "config.json").read_text())["hybrid_build"]["fp8_modules"] + ["lm_head"]
        for name in modules:
            mod = _find_module(model, name)
            mod.weight.data = load_weight(art, name).to(mod.weight.dtype)
        result[label] = _forward(model, ids_t, torch)
    torch.save(result, out)
    for label in ("inc-hybrid", "compressed-tensors"):
        kl = [(p.exp() * (p - q)).sum(-1).mean().item() for p, q in zip(result["source"], result[label])]
        print(label, "KL(source||artifact) per prompt:", [f"{k:.2e}" for k in kl])


if __name__ == "__main__":
    main(*sys.argv[1:5])
