"""vLLM 0.33.0's packed (block-outermost) KV grouping for the 122B with the real DFlash drafter: the
one place in the sources where the drafter's KV could keep a group of its own with its own block size
(``kv_cache_planning._get_packed_kv_cache_groups``; vLLM takes it only when the resolved KV-cache layout
is block-outermost, e.g. ``VLLM_KV_CACHE_LAYOUT=BLNHC``; FLASH_ATTN prefers ``LBNHC``, the layer-outermost
layout every other figure here assumes).

For ``LBNHC`` and ``BLNHC`` it prints the groups vLLM 0.33.0's own ``get_kv_cache_groups`` forms for the
dense profile (6 speculative tokens, bf16, prefix caching in align mode), ``num_blocks`` at the public
GB10 log's KV budget (547 x 55,050,240 B) and the pool vLLM would log. What stands in: the layer specs
and the config object of ``tests/serve/kv_pool_probe.py`` (the engine's own are built from a model on a
GPU). Whether the GDN and attention kernels run on a block-outermost cache is not checked here.

Usage (CPU): PYTHONPATH=<vllm 0.33.0 sources>:<cpu deps>:tests/serve python lab/probes/packed_kv_layout.py
"""
from __future__ import annotations

import sys

from kv_pool_probe import build_specs, config_of

import kv_probe

BUDGET, MAX_LEN = 547 * 55_050_240, 262144


def main() -> int:
    from vllm.v1.core import kv_cache_planning as planning
    from vllm.v1.core import kv_cache_utils as kcu
    from vllm.v1.kv_cache_layout import KVCacheLayout

    case = {"caching": True, "method": "dflash", "num_speculative_tokens": 6, "max_model_len": MAX_LEN, "kv_bytes": 2,
            "text_config": kv_probe.TEXT_122B,
            "drafter_config": dict(kv_probe.DRAFTER, layer_types=kv_probe.DRAFTER_TYPES["mixed"])}
    for layout in ("LBNHC", "BLNHC"):
        cfg = config_of(case, "0.33.0")
        cfg.cache_config.get_resolved_kv_cache_layout = lambda name=layout: KVCacheLayout[name]
        groups = planning.get_kv_cache_groups(cfg, build_specs(case, "0.33.0"))
        sized = planning.get_kv_cache_config_from_groups(cfg, groups, BUDGET)
        pool = int(kcu.get_max_concurrency_for_kv_cache_config(cfg, sized) * MAX_LEN)
        kinds: dict[tuple, int] = {}
        for g in groups:
            s = g.kv_cache_spec
            key = (type(s).__name__, len(g.layer_names), s.block_size, s.page_size_bytes)
            kinds[key] = kinds.get(key, 0) + 1
        print(f"{layout}: {len(groups)} groups, num_blocks {sized.num_blocks:,}, pool {pool:,} tokens")
        for (kind, layers, block, page), n in kinds.items():
            print(f"  {n} x {kind}: {layers} layers, block {block:,} tokens, page {page:,} B")
    return 0


if __name__ == "__main__":
    sys.exit(main())
