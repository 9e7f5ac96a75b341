"""Observer selection: the recipe says ``minmax`` or ``mse``; llm-compressor's registry does the work.

Weights are seen once, so the memoryless variants are the right ones: they compute qparams from
the tensor at hand with no running average.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from compressed_tensors.quantization import QuantizationArgs

OBSERVERS = {"minmax": "memoryless_minmax", "mse": "memoryless_mse"}


def observe(weight: torch.Tensor, args: QuantizationArgs, observer: str) -> dict[str, torch.Tensor]:
    """min/max statistics and qparams of ``weight`` under ``args``, from llm-compressor's observer."""
    # its import configures its own console logger and warns about a missing GPU on every CPU
    # run; what it has to say about observers is not for our users (unless they ask for it)
    os.environ.setdefault("LLM_COMPRESSOR_LOG_LEVEL", "ERROR")
    from llmcompressor.observers import Observer

    if observer not in OBSERVERS:
        raise KeyError(f"unknown observer {observer!r} (valid: {', '.join(OBSERVERS)})")
    obs = Observer.load_from_registry(OBSERVERS[observer], base_name="weight", args=args)
    obs(weight)
    stats = {"min_vals": obs.min_vals.clone(), "max_vals": obs.max_vals.clone()}
    qparams = obs.get_qparams()
    return {**stats, **qparams}
