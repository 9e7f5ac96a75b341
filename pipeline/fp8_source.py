"""Take the FP8 shared experts from an official FP8 checkpoint instead of calibrating them.

Qwen publishes ``Qwen/Qwen3.5-*-FP8`` with ``<module>.weight`` float8_e4m3fn and
``<module>.weight_scale_inv`` float32 per [128, 128] block: exactly the inc-hybrid storage. This
module finds those tensors by name (the language-model prefix may differ between the VL and the
text-only forms), checks dtype and shape against the BF16 source, and returns byte-range copies;
from a Hub id it downloads only the index and the shards that hold them. It also measures both
the official tensors and a local calibration against the BF16 source, so the report says how
they differ.
"""
from __future__ import annotations

import logging
import math
import os
from pathlib import Path

from hybrid_build.calibration.fp8_block import dequantize_fp8_block, quantize_fp8_block
from hybrid_build.calibration.metrics import error_metrics
from hybrid_build.core.bounded_read import read_json
from hybrid_build.core.checkpoint import HUB_ID, Checkpoint
from hybrid_build.core.errors import SourceError
from hybrid_build.core.safetensors_io import INDEX_NAME, ByteRange, OutTensor
from hybrid_build.core.weights import read_tensor

log = logging.getLogger(__name__)
PREFIXES = ("model.language_model.", "model.", "language_model.model.")


def _candidates(module: str, source_prefix: str) -> list[str]:
    tail = module[len(source_prefix):] if module.startswith(source_prefix) else module
    return [module] + [p + tail for p in PREFIXES if p + tail != module]


def open_fp8_checkpoint(ref: str, modules: list[str], source_prefix: str) -> Checkpoint:
    """A local folder as is; a Hub id through huggingface_hub, fetching only the needed shards."""
    if Path(ref).expanduser().exists():
        return Checkpoint.read_folder(Path(ref).expanduser())
    if not HUB_ID.match(ref):
        raise SourceError(f"FP8 checkpoint {ref!r}: no such folder, and not a Hub id")
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0", "false")
    try:
        index = read_json(Path(hf_hub_download(ref, INDEX_NAME, local_files_only=offline)), f"{ref} {INDEX_NAME}")
        wanted = set()
        for m in modules:
            for name in _candidates(m, source_prefix):
                for part in (".weight", ".weight_scale_inv"):
                    if name + part in index["weight_map"]:
                        wanted.add(index["weight_map"][name + part])
        root = snapshot_download(ref, allow_patterns=["config.json", INDEX_NAME, *sorted(wanted)],
                                 local_files_only=offline)
    except (LocalEntryNotFoundError, FileNotFoundError):
        raise SourceError(f"FP8 checkpoint {ref}: not in the Hub cache and the Hub is offline")
    except HfHubHTTPError as e:
        raise SourceError(f"FP8 checkpoint {ref}: Hub download failed: {str(e).splitlines()[0]}")
    ckpt = Checkpoint.read_folder(Path(root))
    ckpt.source_id = ref
    return ckpt


def require_named(spec) -> None:
    """A recipe that takes the FP8 tensors from a checkpoint must name it."""
    if spec.source == "checkpoint" and not spec.fp8_checkpoint:
        raise SourceError("shared_experts.source is 'checkpoint' but no fp8_checkpoint is named "
                          "(recipe field shared_experts.fp8_checkpoint, or --fp8-source)")


def take_from_fp8_checkpoint(source: Checkpoint, convs, spec) -> tuple[list[OutTensor], dict]:
    require_named(spec)
    fp8 = open_fp8_checkpoint(spec.fp8_checkpoint, [c.module for c in convs], source.lm_prefix)
    tensors: list[OutTensor] = []
    metrics: dict[str, dict] = {}
    for c in convs:
        n, k = c.shape
        found = next((name for name in _candidates(c.module, source.lm_prefix) if name + ".weight" in fp8.tensors),
                     None)
        if found is None:
            raise SourceError(f"FP8 checkpoint {spec.fp8_checkpoint}: no tensor for {c.module}.weight")
        w, s = fp8.tensors[found + ".weight"], fp8.tensors.get(found + ".weight_scale_inv")
        want_s = (math.ceil(n / 128), math.ceil(k / 128))
        if w.dtype != "F8_E4M3" or w.shape != (n, k):
            raise SourceError(
                f"FP8 checkpoint: {found}.weight is {w.dtype} {list(w.shape)}, expected F8_E4M3 [{n}, {k}]")
        if s is None or s.dtype != "F32" or s.shape != want_s:
            got = "missing" if s is None else f"{s.dtype} {list(s.shape)}"
            raise SourceError(f"FP8 checkpoint: {found}.weight_scale_inv is {got}, expected F32 {list(want_s)}")
        tensors.append(OutTensor(c.module + ".weight", w.dtype, w.shape, ByteRange(fp8.path_of(w), w.start, w.nbytes)))
        tensors.append(OutTensor(c.module + ".weight_scale_inv", s.dtype, s.shape,
                                 ByteRange(fp8.path_of(s), s.start, s.nbytes)))
        ref = read_tensor(source, c.module + ".weight").float()
        official = dequantize_fp8_block(read_tensor(fp8, found + ".weight"),
                                        read_tensor(fp8, found + ".weight_scale_inv"))
        local = dequantize_fp8_block(*quantize_fp8_block(ref, observer=spec.observer))
        metrics[c.module] = {**error_metrics(ref, official),
                             "local_rel_error": error_metrics(ref, local)["rel_error"],
                             "official_vs_local_rel_diff": error_metrics(local, official)["rel_error"]}
    log.info("took %d FP8 shared-expert projections from %s", len(convs), spec.fp8_checkpoint)
    return tensors, metrics
