"""A fault that only a prefix-cache hit meets (there, the ``cachefault`` step): the K/V of every block
a request finds cached is overwritten with noise just before the step that resumes it.

A request prefilled from scratch never reads a cached block, so it is untouched: the cold run of
``verify``'s cache path, every prompt-log-probability request (vLLM skips the cache for those) and the
concurrency and decode paths answer as on a sound server. Only the warm run, which resumes from the
blocks the cold run left, reads the noise: its answer must differ, and ``serve``'s verify must stop
the server before READY. This is the failure the cache path exists for (a hit that returns the wrong
context), made certain; the runtime fixes that govern hits (``prefix_align``,
``dflash_keep_last_block``) change how much is hit on this model, not what a hit holds.

Loaded in every Python process of the server through a ``.pth`` file in the site folder
(``install``), and active only where ``HB_CACHE_FAULT=1``: it wraps vLLM 0.26.0's V1
``GPUModelRunner`` (``initialize_kv_cache_tensors`` to keep the per-layer views,
``execute_model`` to perturb), once ``vllm.v1.worker.gpu_model_runner`` is imported. Each
perturbation is one JSON line in ``HB_CACHE_FAULT_LOG``."""
from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import sys
from pathlib import Path

TARGET = "vllm.v1.worker.gpu_model_runner"
ENV, ENV_LOG = "HB_CACHE_FAULT", "HB_CACHE_FAULT_LOG"
PTH = "hb_cache_fault.pth"


def block_dim(shape: tuple[int, ...], num_blocks: int, block_size: int) -> tuple[int, int] | None:
    """The dimension of a layer's K/V view that counts kernel blocks, and how many kernel blocks make
    one cache block: the dimension of a multiple ``r`` of ``num_blocks`` followed by one of
    ``block_size / r`` tokens (vLLM reshapes a cache block into ``r`` kernel blocks where the
    attention kernel takes smaller ones)."""
    for d in range(len(shape) - 1):
        r = shape[d] // num_blocks if shape[d] % num_blocks == 0 else 0
        # the token dimension follows, or follows the K/V pair (num_blocks, 2, block, heads, dim)
        if r and any(r * shape[e] == block_size for e in range(d + 1, min(d + 3, len(shape)))):
            return d, r
    return None


def perturb(runner, scheduler_output) -> list[dict]:
    """Noise over the cached blocks of every request this step resumes from a hit."""
    import torch
    from vllm.v1.kv_cache_interface import AttentionSpec

    kv = getattr(runner, "_hb_fault_kv", None) or {}
    config = runner.kv_cache_config
    done = []
    for req in scheduler_output.scheduled_new_reqs:
        hit = req.num_computed_tokens
        if hit <= 0:
            continue
        entry = {"req": str(req.req_id)[-12:], "hit_tokens": hit, "groups": []}
        for g, group in enumerate(config.kv_cache_groups):
            spec = group.kv_cache_spec
            if not isinstance(spec, AttentionSpec) or g >= len(req.block_ids):
                continue
            blocks = [b for b in req.block_ids[g][: hit // spec.block_size] if b > 0]  # 0: the null block
            layers = 0
            for name in group.layer_names:
                t = kv.get(name)
                where = block_dim(tuple(t.shape), config.num_blocks, spec.block_size) if t is not None else None
                if where is None:
                    continue
                d, r = where
                for b in blocks:
                    view = t.narrow(d, b * r, r)
                    scale = view.float().std().clamp(min=0.05)
                    view.copy_((torch.randn(view.shape, device=view.device) * 4 * scale).to(view.dtype))
                layers += 1
            entry["groups"].append({"group": g, "block_size": spec.block_size, "blocks": len(blocks),
                                    "layers": layers, "of_layers": len(group.layer_names)})
        done.append(entry)
    return done


def _log(entry: dict) -> None:
    path = os.environ.get(ENV_LOG)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")


def patch(module) -> None:
    runner = module.GPUModelRunner
    init, execute = runner.initialize_kv_cache_tensors, runner.execute_model

    def initialize_kv_cache_tensors(self, *args, **kwargs):
        self._hb_fault_kv = init(self, *args, **kwargs)
        return self._hb_fault_kv

    def execute_model(self, scheduler_output, *args, **kwargs):
        try:
            for entry in perturb(self, scheduler_output):
                _log(entry)
        except Exception as e:  # the fault must not be mistaken for a server that broke by itself
            _log({"error": f"{type(e).__name__}: {e}"})
        return execute(self, scheduler_output, *args, **kwargs)

    runner.initialize_kv_cache_tensors = initialize_kv_cache_tensors
    runner.execute_model = execute_model
    _log({"installed": os.getpid()})


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


def activate() -> None:
    """Called by the ``.pth`` line at every Python start: nothing unless ``HB_CACHE_FAULT=1``."""
    if os.environ.get(ENV) == "1" and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def _site() -> Path:
    """The interpreter's first site-packages folder (every start reads its ``.pth`` files; the user
    site is off in a virtual environment); the machine there is a lent one, written as root."""
    import site

    return Path(site.getsitepackages()[0])


def install() -> Path:
    """This module and its ``.pth`` line into the site folder (Python runs the line at start)."""
    import shutil

    where = _site()
    shutil.copy(__file__, where / "hb_cache_fault.py")
    (where / PTH).write_text("import hb_cache_fault; hb_cache_fault.activate()\n")
    return where


def uninstall() -> None:
    for name in (PTH, "hb_cache_fault.py"):
        (_site() / name).unlink(missing_ok=True)
