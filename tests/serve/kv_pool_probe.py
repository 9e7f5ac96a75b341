"""vLLM's own KV-pool planning and ``KVCacheManager`` for many model / drafter / profile cases in one
process, on CPU (run with a vLLM version's sources on PYTHONPATH; kv_probe.py's sibling).

Usage: ``python kv_pool_probe.py CASES.json OUT.json``. Each case: ``text_config``,
``drafter_config`` (or null), ``method`` (dflash | mtp | null), ``num_speculative_tokens``,
``kv_bytes``, ``caching``, ``fixes`` (ids of ``serve/runtime/kv_cache_fixes``), ``max_model_len``,
``available_memory``, ``contexts``, optionally ``async_scheduling`` (vLLM's default, on, where absent) and
``block_size`` (vLLM's --block-size, which the fine_grained layout passes).

What is vLLM's: the spec classes and their page sizes, the GDN state shape
(``MambaStateShapeCalculator``), ``get_kv_cache_groups`` (page unification, grouping; the
project's kv_unify / prefix_align installed as the plugin installs them),
``get_kv_cache_config_from_groups`` (``num_blocks``), the capacity vLLM logs
(``get_max_concurrency_for_kv_cache_config`` x ``max_model_len``), and the ``KVCacheManager`` that
allocates streams. What stands in for the engine: the layer list built from the configs (what
the model's ``get_kv_cache_spec`` returns for each layer), the attention block by
``Platform._align_hybrid_block_size``'s formula (it needs the model class and a GPU backend), and
the engine core's ``block_size = min(group block sizes)``.
"""
from __future__ import annotations

import json
import math
import sys
import types

KERNEL_ALIGN = 16


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "?")


def build_specs(case: dict, version: str) -> dict:
    import torch
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    tc = case["text_config"]
    kv_dtype = torch.float8_e4m3fn if case["kv_bytes"] == 1 else torch.bfloat16
    spec_n = case["num_speculative_tokens"] if case["method"] else 0
    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(
        1, tc["linear_num_key_heads"], tc["linear_num_value_heads"], tc["linear_key_head_dim"],
        tc["linear_value_head_dim"], tc.get("linear_conv_kernel_dim", 4), spec_n)
    ssm = torch.float32 if tc.get("mamba_ssm_dtype") == "float32" else torch.bfloat16
    dtypes = (torch.bfloat16, ssm)
    mamba_page = sum(math.prod(s) * torch.tensor([], dtype=d).element_size() for s, d in zip(shapes, dtypes))
    attn_token = FullAttentionSpec(block_size=1, num_kv_heads=tc["num_key_value_heads"], head_size=tc["head_dim"],
                                   dtype=kv_dtype).page_size_bytes
    align = max(KERNEL_ALIGN, case.get("block_size") or 0)  # --block-size: the alignment where it is larger
    mode = "align" if case["caching"] else "none"
    if mode == "align" and version >= "0.33":
        align = math.lcm(align, 64)  # FlashInfer's GDN checkpoint alignment
    block = align * math.ceil(mamba_page / (align * attn_token))
    import dataclasses

    # FLASH_ATTN reads pages by the block stride (0.25.1 / 0.26.0 say so on the spec; 0.23.0 / 0.33.0 have no field)
    stride = ({"indexes_kv_by_block_stride": True}
              if "indexes_kv_by_block_stride" in {f.name for f in dataclasses.fields(FullAttentionSpec)} else {})
    out: dict = {}
    n = tc["num_hidden_layers"]
    kinds = tc.get("layer_types") or ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
    for i, kind in enumerate(kinds):
        if kind == "full_attention":
            out[f"model.layers.{i}.self_attn.attn"] = FullAttentionSpec(
                block_size=block, num_kv_heads=tc["num_key_value_heads"], head_size=tc["head_dim"], dtype=kv_dtype,
                **stride)
        else:
            out[f"model.layers.{i}.linear_attn"] = MambaSpec(
                shapes=tuple(shapes), dtypes=dtypes, block_size=block, page_size_padded=block * attn_token,
                mamba_cache_mode=mode, num_speculative_blocks=spec_n)
    if case["method"] == "mtp":
        out[f"mtp.layers.{n}.self_attn.attn"] = FullAttentionSpec(
            block_size=block, num_kv_heads=tc["num_key_value_heads"], head_size=tc["head_dim"], dtype=kv_dtype,
                **stride)
    elif case["method"] == "dflash":
        d = case["drafter_config"]
        kw = dict(num_kv_heads=d["num_key_value_heads"], head_size=d["head_dim"], dtype=kv_dtype, **stride)
        kinds = d.get("layer_types") or ["full_attention"] * d["num_hidden_layers"]
        if version < "0.25":  # 0.23.0's qwen3_dflash.py builds every layer as full attention
            kinds = ["full_attention"] * d["num_hidden_layers"]
        for i, kind in enumerate(kinds):
            name = f"draft_model.layers.{i}.self_attn.attn"
            if kind == "sliding_attention":
                sw_block = KERNEL_ALIGN if version >= "0.25" else block
                out[name] = SlidingWindowSpec(block_size=sw_block, sliding_window=d["sliding_window"], **kw)
            else:
                out[name] = FullAttentionSpec(block_size=block, **kw)
    return out


def config_of(case: dict, version: str):
    cache = types.SimpleNamespace(
        enable_prefix_caching=case["caching"], hash_block_size=None, prefix_match_unit=None, block_size=None,
        mamba_cache_mode="align" if case["caching"] else "none", num_gpu_blocks_override=None,
        kv_cache_layout="LBNHC", prefix_cache_retention_interval=None)
    if version >= "0.33":
        from vllm.v1.kv_cache_layout import KVCacheLayout

        cache.get_resolved_kv_cache_layout = lambda: KVCacheLayout.LBNHC
    spec = None
    if case["method"]:
        method = case["method"]
        spec = types.SimpleNamespace(method=method, use_eagle=lambda: method in ("dflash", "mtp"),
                                     num_speculative_tokens=case["num_speculative_tokens"])
    sched = types.SimpleNamespace(disable_hybrid_kv_cache_manager=False, max_num_batched_tokens=8192,
                                  async_scheduling=case.get("async_scheduling", True))
    cfg = types.SimpleNamespace(
        scheduler_config=sched, speculative_config=spec, cache_config=cache,
        model_config=types.SimpleNamespace(max_model_len=case["max_model_len"]),
        parallel_config=types.SimpleNamespace(decode_context_parallel_size=1, prefill_context_parallel_size=1,
                                              pipeline_parallel_size=1),
        attention_config=types.SimpleNamespace(hisparse_config=None), kv_transfer_config=None,
        # 0.26.0+ force the V2 runner for a mixed sliding/full DFlash drafter (_dflash_needs_multi_kv_group);
        # at one pipeline stage either runner keeps two batches in flight under async scheduling
        use_v2_model_runner=version >= "0.26" and "sliding_attention" in (
            (case.get("drafter_config") or {}).get("layer_types") or []),
        device_config=types.SimpleNamespace(device_type="cuda"))
    # the batches in flight and their tokens by VllmConfig's own properties (async scheduling, vLLM's
    # default for no drafter or an EAGLE-family one, keeps two batches in flight); 0.23.0 / 0.25.1 have
    # no max_in_flight_tokens (their sliding-window sizing reads max_num_batched_tokens)
    from vllm.config import VllmConfig

    cfg.max_concurrent_batches = VllmConfig.max_concurrent_batches.fget(cfg)
    in_flight = getattr(VllmConfig, "max_in_flight_tokens", None)
    cfg.max_in_flight_tokens = in_flight.fget(cfg) if in_flight is not None else sched.max_num_batched_tokens
    return cfg


def streams(kv_config, case: dict, cfg, lookahead: int, scheduler_block: int, hash_block: int) -> dict:
    """For each context: streams of it the manager admits (one allocation each), then the longest
    context the next one gets."""
    from vllm import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.request import Request

    out = {}
    for ctx in case["contexts"]:
        kw = dict(max_model_len=case["max_model_len"], scheduler_block_size=scheduler_block,
                  hash_block_size=hash_block, enable_caching=False, use_eagle=False)
        try:
            mgr = KVCacheManager(kv_config, max_in_flight_tokens=cfg.max_in_flight_tokens, **kw)
        except TypeError:
            mgr = KVCacheManager(kv_config, **kw)

        def admit(rid: str, n: int, mgr=mgr):
            req = Request(rid, [1] * n, SamplingParams(max_tokens=1), None)
            mgr.new_step_starts() if hasattr(mgr, "new_step_starts") else None
            got = mgr.allocate_slots(req, n, num_lookahead_tokens=lookahead)
            return req if got is not None else None

        whole = 0
        while whole < 64 and admit(f"s{whole}", ctx) is not None:
            whole += 1
        lo, hi = 0, ctx  # the longest prompt the next stream is given (each try freed after)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            req = admit(f"t{mid}", mid)
            if req is not None:
                mgr.free(req)
                lo = mid
            else:
                hi = mid
        out[str(ctx)] = {"whole": whole, "next_tokens": lo}
    return out


def run_case(case: dict, version: str) -> dict:
    from vllm.v1.core import kv_cache_utils as kcu

    from hybrid_build.serve.runtime import kv_cache_fixes

    try:
        from vllm.v1.core import kv_cache_planning as planning  # 0.33
    except ImportError:
        planning = kcu
    current = planning.unify_kv_cache_spec_page_size  # each case starts from vLLM's own unify
    kcu.unify_kv_cache_spec_page_size = planning.unify_kv_cache_spec_page_size = getattr(current, "stock", current)
    res_install = kv_cache_fixes.install(frozenset(case["fixes"]))
    res: dict = {"id": case["id"], "install": res_install}
    cfg = config_of(case, version)
    spec = build_specs(case, version)
    try:
        groups = planning.get_kv_cache_groups(cfg, spec)
    except (AssertionError, NotImplementedError, ValueError) as e:
        res["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        return res
    kv_config = planning.get_kv_cache_config_from_groups(cfg, groups, case["available_memory"])
    res["num_blocks"] = kv_config.num_blocks
    res["groups"] = [[type(g.kv_cache_spec).__name__, len(g.layer_names), g.kv_cache_spec.block_size,
                      g.kv_cache_spec.page_size_bytes] for g in groups]
    conc = kcu.get_max_concurrency_for_kv_cache_config(cfg, kv_config)
    res["pool_tokens"] = int(conc * case["max_model_len"])
    cfg.cache_config.block_size = min(g.kv_cache_spec.block_size for g in groups)
    try:
        sched_block, hash_block = kcu.resolve_kv_cache_block_sizes(kv_config, cfg)
    except (AttributeError, TypeError):
        sched_block = hash_block = cfg.cache_config.block_size
    lookahead = case["num_speculative_tokens"] + (1 if case["method"] == "dflash" else 0) if case["method"] else 0
    res["streams"] = streams(kv_config, case, cfg, lookahead, sched_block, hash_block)
    return res


def main() -> int:
    cases, out = json.load(open(sys.argv[1])), sys.argv[2]
    version = sys.argv[3] if len(sys.argv) > 3 else vllm_version()
    results = []
    for case in cases:
        try:
            results.append(run_case(case, version))
        except Exception as e:  # one case's failure is that case's result
            import traceback

            results.append({"id": case["id"], "crash": f"{type(e).__name__}: {e}",
                            "trace": traceback.format_exc()[-1500:]})
    json.dump(results, open(out, "w"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
