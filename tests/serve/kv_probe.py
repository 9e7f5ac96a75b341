"""vLLM's own KV-cache planning and prefix-cache bookkeeping for the 122B target with a DFlash
drafter, on CPU (run as a subprocess with a vLLM version's sources on PYTHONPATH).

Usage: ``python kv_probe.py {full6,mixed} FIXES OUT.json [UNIT]`` (FIXES: ``none``, or ids of
``serve/kv_cache_fixes`` joined by commas, installed as the plugin installs them; UNIT: vLLM
0.26.0's ``--prefix-match-unit``, the ``hash_block_size`` of ``resolve_kv_cache_block_sizes``).
Besides the hits it writes the pool vLLM would log for this layout at the KV budget of the public
GB10 log (547 blocks of 55,050,240 B: ``get_kv_cache_config_from_groups`` and
``get_max_concurrency_for_kv_cache_config`` x ``max_model_len``, as ``kv_pool_probe.py``).

What is vLLM's here: the KV-cache spec classes, ``get_kv_cache_groups`` (with its page
unification), ``resolve_kv_cache_block_sizes``, the ``KVCacheManager`` with its coordinator and
block pool, ``Request`` with vLLM's block hasher, and the scheduler's GDN chunk split
(``Scheduler._mamba_block_aligned_split``, called on a scheduler object holding the fields it
reads). What stands in for the engine: the specs are built with the values vLLM computes for this
model (the GDN state shape from vLLM's own ``MambaStateShapeCalculator``; the block size by
``Platform._align_hybrid_block_size``'s formula, which needs the model class and a GPU backend to
run), the engine core's ``block_size = min(group block sizes)``, and the step loop: a request is
prefilled in chunks of at most ``max_num_batched_tokens`` (each clipped by the split, slots
allocated as the scheduler allocates them), gets one token and is freed; then a request with the
same prefix and another suffix asks for its cache hit.
"""
from __future__ import annotations

import json
import math
import sys
import types

# the 122B (FACTS.md): 12 full-attention layers (2 kv heads x 256), 36 GDN layers (16 key / 64
# value heads of 128, conv kernel 4, float32 ssm state); DFlash drafter: 6 layers, 8 kv x 128,
# 12 speculative tokens; FLASH_ATTN (kernel blocks: multiples of 16, pages read by block stride)
TARGET_FULL, TARGET_GDN, KV_HEADS, HEAD_DIM = 12, 36, 2, 256
DRAFT_LAYERS, DRAFT_KV, DRAFT_HD, SPEC_TOKENS = 6, 8, 128, 12
KERNEL_ALIGN, BUDGET, SUFFIX = 16, 8192, 32
CONTEXTS = (8192, 32768, 65536)
POOL_BUDGET, MAX_MODEL_LEN = 547 * 55_050_240, 262144
# the same shapes as configs (kv_pool_probe.build_specs reads these; 0.33's spec classes are built there)
TEXT_122B = {"num_hidden_layers": TARGET_FULL + TARGET_GDN, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
             "linear_num_key_heads": 16, "linear_num_value_heads": 64, "linear_key_head_dim": 128,
             "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "mamba_ssm_dtype": "float32"}
DRAFTER = {"num_hidden_layers": DRAFT_LAYERS, "num_key_value_heads": DRAFT_KV, "head_dim": DRAFT_HD,
           "sliding_window": 4096}
DRAFTER_TYPES = {"full6": ["full_attention"] * DRAFT_LAYERS,
                 "mixed": ["sliding_attention"] * (DRAFT_LAYERS - 1) + ["full_attention"]}


def _spec(cls, **fields):
    """A spec of this vLLM's class, without the fields its version does not have (0.33.0 has no
    ``indexes_kv_by_block_stride``: every page there is read by block stride)."""
    import dataclasses

    known = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in fields.items() if k in known})


def specs(shape: str, block: int | None = None, spec_tokens: int = SPEC_TOKENS,
          block_flag: int | None = None) -> tuple[dict, int]:
    """The layers' KV specs: the target's, then the drafter's (``full6``: the DFlash drafter with 6
    full-attention layers; ``mixed``: 5 sliding-window layers of 4096 + 1 full, the real drafter;
    ``sliding6``: all 6 sliding, a drafter of that width that ships nowhere; ``mtp``: the model's own
    MTP layer, a full-attention layer of the target's shape, which vLLM builds with the target's
    config and cache config)."""
    import torch
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(1, 16, 64, 128, 128, 4, spec_tokens)
    dtypes = (torch.bfloat16, torch.float32)
    mamba_page = sum(math.prod(s) * torch.tensor([], dtype=d).element_size() for s, d in zip(shapes, dtypes))
    attn_token = FullAttentionSpec(block_size=1, num_kv_heads=KV_HEADS, head_size=HEAD_DIM,
                                   dtype=torch.bfloat16).page_size_bytes
    # Platform._align_hybrid_block_size, align mode: the smallest kernel-aligned block whose
    # attention page covers the GDN state; the GDN page is padded to that page. ``block_flag``: vLLM's
    # --block-size, which that formula takes as the alignment where it exceeds the kernel's
    align = max(KERNEL_ALIGN, block_flag or 0)
    block = block or align * math.ceil(mamba_page / (align * attn_token))
    out: dict = {}
    layer = 0
    for i in range(TARGET_FULL + TARGET_GDN):
        name = f"model.layers.{i}"
        if (i + 1) % 4 == 0:
            out[name + ".self_attn.attn"] = _spec(FullAttentionSpec,
                block_size=block, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.bfloat16,
                indexes_kv_by_block_stride=True)
        else:
            out[name + ".linear_attn"] = _spec(MambaSpec,
                shapes=tuple(shapes), dtypes=dtypes, block_size=block, page_size_padded=block * attn_token,
                mamba_cache_mode="align", num_speculative_blocks=spec_tokens)
        layer += 1
    if shape == "mtp":
        out["mtp.layers.0.self_attn.attn"] = _spec(FullAttentionSpec,
            block_size=block, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.bfloat16,
            indexes_kv_by_block_stride=True)
        return out, mamba_page
    for i in range(DRAFT_LAYERS):
        name = f"draft_model.layers.{i}.self_attn.attn"
        if (shape == "mixed" and i < DRAFT_LAYERS - 1) or shape == "sliding6":  # sliding-window layers of 4096
            out[name] = _spec(SlidingWindowSpec, block_size=KERNEL_ALIGN, num_kv_heads=DRAFT_KV, head_size=DRAFT_HD,
                                          dtype=torch.bfloat16, sliding_window=4096,
                                          indexes_kv_by_block_stride=True)
        else:
            out[name] = _spec(FullAttentionSpec, block_size=block, num_kv_heads=DRAFT_KV, head_size=DRAFT_HD,
                                          dtype=torch.bfloat16, indexes_kv_by_block_stride=True)
    return out, mamba_page


def scheduler_object(block_size: int, hash_block_size: int, scheduler_block: int, eagle: bool, no_drop: bool):
    """A Scheduler instance (no __init__) with the fields its GDN chunk split reads, as the real
    __init__ sets them for this configuration."""
    from vllm.v1.core.sched.scheduler import Scheduler

    obj = object.__new__(Scheduler)
    obj.cache_config = types.SimpleNamespace(block_size=block_size)
    obj.use_eagle = eagle
    obj.block_size = scheduler_block
    obj.hash_block_size = hash_block_size
    obj.need_mamba_block_aligned_split = True
    obj.mamba_partial_cache_hit = hash_block_size < scheduler_block
    if no_drop:
        obj.hybrid_build_no_block_drop = True
    return obj


def serve_request(mgr, sched, split, rid: str, prompt: list[int], hasher, lookahead: int) -> int:
    """Prefill ``prompt`` chunk by chunk as the scheduler does, emit one token, free it; the
    cache hit it started from."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    req = Request(rid, prompt, SamplingParams(max_tokens=1), None, block_hasher=hasher)
    mgr.new_step_starts()
    found = mgr.get_computed_blocks(req)  # 0.26 adds the shared-prefix boundary the split reads
    blocks, hit = found[0], found[1]
    if len(found) > 2:
        req.shared_prefix_boundary = found[2]
    first = True
    while req.num_computed_tokens < req.num_tokens:
        mgr.new_step_starts()  # each scheduler step begins so
        want = min(req.num_tokens - req.num_computed_tokens - (hit if first else 0), BUDGET)
        if first:
            n = split(sched, req, want, hit)
            got = mgr.allocate_slots(req, n, num_new_computed_tokens=hit, new_computed_blocks=blocks,
                                     num_lookahead_tokens=lookahead)
            if got is None:
                per = [m.get_num_blocks_to_allocate(rid, hit + n + lookahead, b, hit, hit + n)
                       for m, b in zip(mgr.coordinator.single_type_managers, blocks.blocks)]
                raise AssertionError(f"no slots for {n} tokens after a hit of {hit}: {per}, "
                                     f"{mgr.block_pool.get_num_free_blocks()} free")
            req.num_computed_tokens = hit + n
            first = False
        else:
            n = split(sched, req, want)
            assert n > 0
            got = mgr.allocate_slots(req, n, num_lookahead_tokens=lookahead)
            assert got is not None, f"no slots for {n} tokens ({mgr.block_pool.get_num_free_blocks()} free blocks)"
            req.num_computed_tokens += n
    req.append_output_token_ids(1)
    mgr.free(req)
    return hit


def kv_pool_probe_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "?")


def main() -> int:
    if sys.argv[1] == "--cases":  # many cases in one process: [{"shape", "fixes", "unit", "spec_tokens"?}, ...]
        results = []
        for case in json.load(open(sys.argv[2])):
            try:
                results.append(dict(case, **run_case(case["shape"], case["fixes"], case.get("unit"),
                                                     case.get("spec_tokens", SPEC_TOKENS), case.get("block_flag"))))
            except Exception as e:  # one case's failure is that case's result
                import traceback

                results.append(dict(case, crash=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-1500:]))
        json.dump(results, open(sys.argv[3], "w"))
        return 0
    json.dump(run_case(sys.argv[1], sys.argv[2], int(sys.argv[4]) if len(sys.argv) > 4 else None),
              open(sys.argv[3], "w"))
    return 0


def install(enabled: frozenset[str]) -> dict[str, str]:
    """Each plugin hook (``fixes.hooks()``) called with the ids of ``enabled`` it installs, as the
    plugin's ``register`` calls them; the sliding-window manager first put back to vLLM's own when
    this case does not name ``sliding_window_partial_hits`` (an earlier case may have installed it)."""
    from vllm.v1.core import single_type_kv_cache_manager as stkm

    from hybrid_build.serve.runtime import plugin
    from hybrid_build.serve.runtime.fixes import hooks

    cls = stkm.SlidingWindowManager
    for name in ("find_longest_cache_hit", "reachable_block_mask", "cache_blocks"):
        patched = cls.__dict__.get(name)
        func = getattr(patched, "__func__", patched)
        if "sliding_window_partial_hits" not in enabled and getattr(func, "hybrid_build_fix", False):
            if name == "cache_blocks":
                delattr(cls, name)
            else:
                setattr(cls, name, classmethod(func.stock))
            cls.supports_fine_grained_hash_lookup = False
    state: dict[str, str] = {}
    for hook, ids in hooks().items():
        if enabled & set(ids):
            state.update(plugin._hook(hook)(enabled & frozenset(ids)))
    return state


def run_case(shape: str, fixes: str, unit: int | None, spec_tokens: int = SPEC_TOKENS,
             block_flag: int | None = None) -> dict:
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core import kv_cache_utils as kcu
    from vllm.v1.core.sched import scheduler as sched_mod
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from hybrid_build.serve.runtime import kv_cache_fixes

    try:
        from vllm.v1.core import kv_cache_planning as planning  # 0.33 plans here
    except ImportError:
        planning = kcu
    v33 = planning is not kcu
    current = planning.unify_kv_cache_spec_page_size  # each case starts from vLLM's own unify
    planning.unify_kv_cache_spec_page_size = getattr(current, "stock", current)
    if hasattr(kcu, "unify_kv_cache_spec_page_size"):
        kcu.unify_kv_cache_spec_page_size = planning.unify_kv_cache_spec_page_size
    enabled = frozenset() if fixes == "none" else frozenset(fixes.split(","))
    res: dict = {"shape": shape, "fixes": sorted(enabled), "unit": unit, "spec_tokens": spec_tokens,
                 "install": install(enabled)}
    from kv_pool_probe import build_specs, config_of

    pool_case = {"caching": True, "method": "dflash", "num_speculative_tokens": spec_tokens,
                 "max_model_len": MAX_MODEL_LEN, "kv_bytes": 2, "text_config": TEXT_122B,
                 "drafter_config": dict(DRAFTER, layer_types=DRAFTER_TYPES[shape])}
    if v33:  # 0.33's spec classes and config fields (kv_pool_probe builds both for every version)
        spec, mamba_page = build_specs(pool_case, kv_pool_probe_version()), None
        config = config_of(pool_case, kv_pool_probe_version())
        config.cache_config.prefix_match_unit = unit
        config.speculative_config.use_eagle_block_drop = lambda: False  # 0.33: only EAGLE / MTP drop
        config.speculative_config.needs_eagle_block_drop = lambda: False
    else:
        spec, mamba_page = specs(shape, spec_tokens=spec_tokens, block_flag=block_flag)
        config = types.SimpleNamespace(
            scheduler_config=types.SimpleNamespace(disable_hybrid_kv_cache_manager=False),
            speculative_config=types.SimpleNamespace(method="dflash", use_eagle=lambda: True),
            cache_config=types.SimpleNamespace(enable_prefix_caching=True, hash_block_size=None,
                                               prefix_match_unit=unit, block_size=None),
            parallel_config=types.SimpleNamespace(decode_context_parallel_size=1, prefill_context_parallel_size=1),
            kv_transfer_config=None)
    res["mamba_page_bytes"] = mamba_page
    res["block_size"] = next(iter(spec.values())).block_size
    try:
        groups = planning.get_kv_cache_groups(config, spec)
    except (AssertionError, NotImplementedError, ValueError) as e:
        res["error"] = f"{type(e).__name__}: {e}"
        return res
    res["groups"] = [{"type": type(g.kv_cache_spec).__name__, "layers": len(g.layer_names),
                      "block_size": g.kv_cache_spec.block_size, "page": g.kv_cache_spec.page_size_bytes}
                     for g in groups]
    pool_cfg = config_of(pool_case, kv_pool_probe_version())
    sized = planning.get_kv_cache_config_from_groups(pool_cfg, groups, POOL_BUDGET)
    res["num_blocks"] = sized.num_blocks
    res["pool_tokens"] = int(kcu.get_max_concurrency_for_kv_cache_config(pool_cfg, sized) * MAX_MODEL_LEN)
    kv_config = KVCacheConfig(num_blocks=6000, kv_cache_tensors=[], kv_cache_groups=groups)
    config.cache_config.block_size = min(g.kv_cache_spec.block_size for g in groups)  # EngineCore does this
    try:
        scheduler_block, hash_block = kcu.resolve_kv_cache_block_sizes(kv_config, config)
    except ValueError as e:  # a unit that does not divide every group's block
        res["error"] = f"{type(e).__name__}: {e}"
        return res
    res.update(cache_block_size=config.cache_config.block_size, scheduler_block_size=scheduler_block,
               hash_block_size=hash_block)
    kcu.init_none_hash(sha256_cbor)
    hasher = kcu.get_request_block_hasher(hash_block, sha256_cbor)
    no_drop = res["install"].get("dflash_keep_last_block") == "applied"
    token = kv_cache_fixes._NO_BLOCK_DROP.set(no_drop)  # what the Scheduler.__init__ wrapper sets
    try:
        mgr = sched_mod.KVCacheManager(kv_config, max_model_len=262144, scheduler_block_size=scheduler_block,
                                       hash_block_size=hash_block, enable_caching=True, use_eagle=not v33)
    finally:
        kv_cache_fixes._NO_BLOCK_DROP.reset(token)
    res["manager_use_eagle"] = mgr.use_eagle
    sched = scheduler_object(config.cache_config.block_size, hash_block, scheduler_block, True, no_drop)
    if v33:  # the fields 0.33's split reads, as its Scheduler.__init__ sets them for this configuration
        from vllm.v1.kv_cache_interface import MambaSpec

        sched.use_eagle_block_drop = False
        sched.num_hash_lookahead_tokens = 0
        sched.max_num_scheduled_tokens = BUDGET
        sched.scheduler_config = types.SimpleNamespace(long_prefill_token_threshold=0)
        mamba = [g.kv_cache_spec for g in groups if isinstance(g.kv_cache_spec, MambaSpec)]
        sched.mamba_prefill_checkpoint_alignment = mamba[0].prefill_checkpoint_alignment
        sched.mamba_has_prefill_checkpoint_blocks = all(m.num_prefill_checkpoint_blocks > 0 for m in mamba)
        sched.mamba_partial_cache_hit = (hash_block < scheduler_block
                                         and mgr.coordinator.enable_partial_hash_hits)
        sched.mamba_shared_prefix_checkpoint = False
        res["partial_hits"] = sched.mamba_partial_cache_hit
    split = sched_mod.Scheduler._mamba_block_aligned_split
    lookahead = spec_tokens + 1  # DFlash: a query for the last sampled token plus one per draft
    res["hits"] = {}
    for i, ctx in enumerate(CONTEXTS):
        prefix = [(97 * j + 13 * i) % 240000 + 100 for j in range(ctx)]
        try:
            cold = serve_request(mgr, sched, split, f"cold{ctx}", prefix + [5] * SUFFIX, hasher, lookahead)
            warm = serve_request(mgr, sched, split, f"warm{ctx}", prefix + [7] * SUFFIX, hasher, lookahead)
        except AssertionError as e:  # vLLM's own asserts (a manager that cannot take partial hits)
            if "no slots" in str(e):
                raise
            res["error"] = f"AssertionError: {e}"
            break
        res["hits"][str(ctx)] = {"prompt": ctx + SUFFIX, "cold_hit": cold, "warm_hit": warm,
                                 "recomputed": ctx + SUFFIX - warm}
    return res


if __name__ == "__main__":
    sys.exit(main())
