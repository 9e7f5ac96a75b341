"""The child process of ``hybrid-build eval``'s Hugging Face backend: lm-eval on the source, then on
the hybrid (the same model object with the artifact's converted modules dequantized into it).

``python -m hybrid_build.validate.eval.task_eval_hf --spec SPEC --out OUT``: the spec names the source,
the artifact, the converted modules and the settings (``accuracy.EvalSettings``); the result is
``{"source": lm-eval results, "hybrid": lm-eval results, "modules_replaced": n, "seconds": s}``,
or ``{"error": sentence, "kind": "user" | "artifact"}`` when it cannot run. Progress goes to
stdout as ``accuracy.PROGRESS_MARK`` lines. A separate process because auto-round's loader patches
transformers (see ``e2e``) and so that the model's memory goes back when it ends.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from .task_eval import PHASE_MARK, PROGRESS_MARK, UNAVAILABLE_EXIT, EvalSettings, counting_lm, run_lm_eval, task_manager

log = logging.getLogger(__name__)


def _emit(label: str, kind: str, n: int, total: int) -> None:
    sys.stdout.write(f"\n{PROGRESS_MARK}{label} {kind} {n} {total}\n")
    sys.stdout.flush()


def _phase(line: str) -> None:
    """What the child does now, for the parent's ``announce`` (a model's loading takes a while)."""
    sys.stdout.write(f"\n{PHASE_MARK}{line}\n")
    sys.stdout.flush()


class _Unavailable(Exception):
    def __init__(self, message: str, kind: str = "user"):
        super().__init__(message)
        self.kind = kind


def _load(source: str, device: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..transformers_forward import TOKENIZER_FILES, _upcast

    folder = Path(source)
    if folder.is_dir() and not any((folder / n).exists() for n in TOKENIZER_FILES):
        raise _Unavailable(f"the source has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])} ...) in {source}: "
                           f"copy the model's tokenizer files into it")
    tok = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16, device_map=device)
    model.eval()
    _upcast(model, torch)  # float32 outside the packed INT4 layers: the difference is the conversion's alone
    return model, tok


def _swap_in(model, artifact: str, modules: list[str]) -> int:
    """Replace each converted module's weight by the artifact's, dequantized (as ``e2e`` does)."""
    from hybrid_build.core.checkpoint import Checkpoint
    from hybrid_build.core.weights import load_weight

    from ..transformers_forward import _find_module

    ckpt = Checkpoint.read_folder(Path(artifact))
    for name in modules:
        mod = _find_module(model, name)
        w = load_weight(ckpt, name)
        if tuple(mod.weight.shape) != tuple(w.shape):
            raise _Unavailable(f"{name}: artifact weight {list(w.shape)} vs model {list(mod.weight.shape)}", "artifact")
        mod.weight.data = w.to(device=mod.weight.device, dtype=mod.weight.dtype)
    return len(modules)


def _child(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hybrid_build.validate.eval.task_eval_hf")
    ap.add_argument("--spec", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    spec = json.loads(Path(args.spec).read_text())
    settings = EvalSettings(**spec["settings"])
    logging.getLogger("lm_eval").setLevel(logging.ERROR)

    import torch
    from lm_eval.models.huggingface import HFLM

    torch.set_grad_enabled(False)
    t0 = time.perf_counter()
    try:
        manager = task_manager(settings.tasks)
        _phase(f"loading the source model ({Path(spec['source']).name}, {settings.device})")
        model, tok = _load(spec["source"], settings.device)

        def run(label: str) -> dict:
            _phase(f"evaluating the {label}")
            lm = HFLM(pretrained=model, tokenizer=tok, batch_size=settings.batch_size, device=settings.device)
            return run_lm_eval(counting_lm(lm, label, _emit, chunk=max(64, 4 * settings.batch_size)), settings, manager)

        result = {"source": run("source")}
        _phase(f"the hybrid: the source with the artifact's {len(spec['modules'])} converted modules dequantized in")
        result["modules_replaced"] = _swap_in(model, spec["artifact"], spec["modules"])
        result["hybrid"] = run("hybrid")
    except _Unavailable as e:
        Path(args.out).write_text(json.dumps({"error": str(e), "kind": e.kind}))
        return UNAVAILABLE_EXIT
    result["seconds"] = round(time.perf_counter() - t0, 2)
    Path(args.out).write_text(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(_child())
