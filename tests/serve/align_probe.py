"""vLLM's own Scheduler and KV-cache manager driven through multi-turn conversations with speculative
decoding, prefix caching in GDN "align" mode and the 122B's KV layout, checking the block-table
invariants on every step (run as a subprocess with a vLLM version's sources on PYTHONPATH).

Usage: ``python align_probe.py CASES WORK OUT.json [SEED]``; CASES: ``shape[@N]:fixes[:UNIT]`` joined by
``;`` (shapes: ``full6``, ``mixed``, ``sliding6`` DFlash drafters, ``mtp`` the model's own MTP layer;
``@N``: N speculative tokens instead of the shape's default; fixes: ``none`` or fix ids joined by
commas, installed as the plugin installs them; ``UNIT``: the launch's ``--block-size UNIT
--prefix-match-unit UNIT``, fine-grained hits), run in that order in one process, each case's fixes
including the previous case's.

What is vLLM's here: ``VllmConfig`` with its ``SchedulerConfig``, ``CacheConfig`` (prefix caching,
``mamba_cache_mode="align"``) and the ``SpeculativeConfig`` vLLM builds: DFlash (12 tokens) read from
a config-only drafter of the real drafter's shape, or MTP (2 tokens, the ``mtp`` profile) converted
from the target's own config; ``get_kv_cache_groups``; the real ``Scheduler.__init__`` (which
builds the ``KVCacheManager``, its coordinator and block pool); ``schedule`` / ``update_from_output``
/ ``update_draft_token_ids`` every step; ``Request`` with vLLM's block hasher; and, for the state
column the V2 model runner seeds on a resumed request, the real ``MambaHybridModelState.add_request``
on an object holding the fields it reads. What stands in: the target's ``ModelConfig`` is a
config-only Qwen3-Next model of the 122B's shapes (``TARGET``: the Qwen3.5 class needs torchvision's
compiled ops on CPU; the scheduler reads only lengths from it), the KV specs are those
``kv_probe.specs`` builds for the 122B (its GDN state, ``Platform._align_hybrid_block_size``'s block),
and the model: each step accepts a random number of the drafts (1 to all of them plus one, varying
step by step) and emits random token ids.

Invariants, every step: for every scheduled request, each group's block list covers the tokens
computed after the step, and the block at the running GDN column is a real block; for a request
that starts from a prefix-cache hit, every group's hit ends at the same token (the hit is a multiple
of each group's block, or with fine-grained hits of the hash unit; each full-attention block inside
it, and each sliding-window block its window reaches, is a block that was cached before this step;
a block the hit ends inside is a private copy this step's output copies from such a block; the GDN
state of the hit sits at column ``(hit - 1) // block``: a cached block or such a copy, never a null
block); the column the V2 runner seeds (``add_request``) is that one.
"""
from __future__ import annotations

import json
import random
import sys
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import kv_probe  # noqa: E402

BUDGET, MAX_SEQS, MAX_LEN = kv_probe.BUDGET, 4, 131072
# the drafter shapes (kv_probe.specs) -> the speculative method and its token count: DFlash as the
# profiles `dense` / `dflash` run it (12), MTP as the profile `mtp` runs it (2)
SHAPES = {"full6": ("dflash", kv_probe.SPEC_TOKENS), "mixed": ("dflash", kv_probe.SPEC_TOKENS),
          "sliding6": ("dflash", kv_probe.SPEC_TOKENS), "mtp": ("mtp", 2)}
# the real drafter's shape (docs/serve.md; FACTS.md), 6 full-attention layers: what the scheduler reads
DRAFTER = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 3072,
           "intermediate_size": 9728, "num_hidden_layers": 6, "num_attention_heads": 32, "num_key_value_heads": 8,
           "head_dim": 128, "vocab_size": 248320, "hidden_act": "silu", "rms_norm_eps": 1e-6,
           "max_position_embeddings": 262144, "rope_theta": 10000000, "tie_word_embeddings": False,
           "torch_dtype": "bfloat16", "block_size": 16, "target_hidden_size": 3072,
           "dflash_config": {"mask_token_id": 248077, "target_layer_ids": [1, 7, 14, 20, 26, 32, 39, 45]}}
# the target: a Qwen3-Next config of the 122B's text shapes (FACTS.md). Qwen3-Next is the GDN hybrid
# Qwen3.5's text model grew from; vLLM's SpeculativeConfig turns it into its MTP drafter
# (qwen3_next -> qwen3_next_mtp) exactly as it turns qwen3_5_moe into qwen3_5_mtp, and its model
# class is inspected on CPU, where Qwen3.5's (through qwen3_vl) needs torchvision's compiled ops
TARGET = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 3072,
          "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 256,
          "vocab_size": 248320, "linear_num_key_heads": 16, "linear_num_value_heads": 64, "linear_key_head_dim": 128,
          "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
          "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 1024,
          "shared_expert_intermediate_size": 1024, "intermediate_size": 1024, "num_nextn_predict_layers": 1,
          "max_position_embeddings": 262144, "torch_dtype": "bfloat16", "rope_theta": 10000000,
          "partial_rotary_factor": 0.25}


def install(enabled: frozenset[str]) -> dict[str, str]:
    """Each plugin hook (``fixes.hooks()``) called with the ids of ``enabled`` it installs, as the
    plugin's ``register`` calls them."""
    from hybrid_build.serve.runtime import plugin
    from hybrid_build.serve.runtime.fixes import hooks

    state: dict[str, str] = {}
    for hook, ids in hooks().items():
        if enabled & set(ids):
            state.update(plugin._hook(hook)(enabled & frozenset(ids)))
    return state


def target_config(work: Path):
    from vllm.config import ModelConfig

    for name, cfg in (("target", TARGET), ("drafter", DRAFTER)):
        (work / name).mkdir(parents=True, exist_ok=True)
        (work / name / "config.json").write_text(json.dumps(cfg))
    return ModelConfig(model=str(work / "target"), skip_tokenizer_init=True, max_model_len=MAX_LEN, dtype="bfloat16")


def vllm_config(model, work: Path, method: str, tokens: int, unit: int | None = None):
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        ParallelConfig,
        SchedulerConfig,
        SpeculativeConfig,
        VllmConfig,
    )

    drafter = {"model": str(work / "drafter")} if method == "dflash" else {}
    spec = SpeculativeConfig(method=method, num_speculative_tokens=tokens, target_model_config=model,
                             target_parallel_config=ParallelConfig(), **drafter)
    fine = {"prefix_match_unit": unit} if unit else {}  # 0.25.1's CacheConfig has no such field
    return VllmConfig(model_config=model, speculative_config=spec, device_config=DeviceConfig(device="cpu"),
                      cache_config=CacheConfig(block_size=unit or 16, enable_prefix_caching=True,
                                               mamba_cache_mode="align", **fine),
                      scheduler_config=SchedulerConfig(max_num_seqs=MAX_SEQS, max_num_batched_tokens=BUDGET,
                                                       max_model_len=MAX_LEN, is_encoder_decoder=False))


def model_state(cache_config):
    """The V2 runner's hybrid model state with the fields its ``add_request`` reads (CPU tensors)."""
    import torch
    from vllm.v1.worker.gpu.model_states.mamba_hybrid import MambaHybridModelState

    obj = object.__new__(MambaHybridModelState)
    obj.cache_config, obj._align_mode, obj.rope_state = cache_config, True, None
    obj.prompt_embeds_state = None  # 0.33.0 reads it too
    obj.num_accepted_tokens_gpu = torch.ones(MAX_SEQS * 4, dtype=torch.int32)
    obj._mamba_state_idx_gpu = torch.zeros(MAX_SEQS * 4, dtype=torch.int32)
    return obj


class Violation(AssertionError):
    pass


def cached_blocks(sched) -> dict[int, object]:
    """The pool's cached blocks (id -> hash) before a step: a hit may only use these."""
    return {b.block_id: b.block_hash for b in sched.kv_cache_manager.block_pool.blocks if b.block_hash is not None}


def check_new(sched, groups, state, slot: int, new, step: int, before: dict[int, object], copies: dict[int, int],
              fine: int | None) -> dict:
    """A request scheduled for the first time: every group's hit ends at the same token (each block
    inside it, as far back as the group reads, was a cached block before this step, not one allocated
    and hashed by this step; a block the hit ends inside is copied from such a block), its GDN state is
    such a block at the hit's column, and the V2 runner seeds that column. ``copies``: this step's
    copy-on-write pairs (destination -> source); ``fine``: the hash unit where hits may end inside a
    block."""
    hit = new.num_computed_tokens
    pool = sched.kv_cache_manager.block_pool.blocks
    where = f"step {step}, request {new.req_id}, hit {hit}"

    def cached(i: int) -> bool:  # held this hash before the step
        return i != 0 and before.get(i) is not None and pool[i].block_hash == before[i]

    def copied(i: int) -> bool:  # a private copy, made this step, of a block cached before it
        return i in copies and before.get(copies[i]) is not None

    if fine and hit % fine:
        raise Violation(f"{where}: a fine-grained hit off the hash unit {fine}")
    for g, (kind, block, window) in enumerate(groups):
        ids = new.block_ids[g]
        if hit % block and not fine:
            raise Violation(f"{where}: group {g} ({kind}, block {block}) cannot end a hit there")
        if kind in ("full", "window") and hit:
            first = 0 if kind == "full" else max(0, hit - window + 1) // block
            cold = [j for j in range(first, hit // block) if not cached(ids[j])]
            if cold:
                raise Violation(f"{where}: group {g} ({kind}, block {block}) has {len(cold)} blocks inside the hit "
                                f"that held no cached KV before this step (block indexes {cold[:4]}): its hit ends "
                                f"at {cold[0] * block}")
            if hit % block and not copied(ids[hit // block]):
                raise Violation(f"{where}: group {g} ({kind}, block {block}): the hit ends inside block "
                                f"{hit // block} ({ids[hit // block]}), which is not a copy of a cached block")
        if kind == "mamba" and hit:
            col = (hit - 1) // block
            if col >= len(ids) or not (cached(ids[col]) or copied(ids[col])):
                got = "past the allocation" if col >= len(ids) else f"block {ids[col]} (null, not cached, not a copy)"
                raise Violation(f"{where}: group {g} (GDN) state of the hit at column {col}: {got}; "
                                f"blocks {[i for i in ids[:col + 2]][-4:]}")
    new_req = types.SimpleNamespace(num_computed_tokens=hit, prefill_token_ids=None, mm_features=None)
    state.add_request(slot, new_req)
    seed = int(state._mamba_state_idx_gpu[slot])
    for g, (kind, block, _) in enumerate(groups):
        if kind == "mamba" and hit and seed != (hit - 1) // block:
            raise Violation(f"{where}: the V2 runner seeds GDN column {seed}, the state is at {(hit - 1) // block} "
                            f"(allocation {len(new.block_ids[g])} columns)")
    return {"hit": hit, "seed": seed, "partial": bool(fine) and any(hit % b for _, b, _ in groups)}


def check_step(sched, groups, out, step: int) -> None:
    """Every scheduled request: each group's blocks cover the tokens computed after this step, and
    the running GDN column is a real block."""
    mgr = sched.kv_cache_manager.coordinator.single_type_managers
    for rid in out.num_scheduled_tokens:
        end = sched.requests[rid].num_computed_tokens  # schedule() has counted this step's tokens in
        for g, (kind, block, _) in enumerate(groups):
            blocks = mgr[g].req_to_blocks[rid]
            if len(blocks) * block < end:
                raise Violation(f"step {step}, request {rid}: group {g} ({kind}) holds {len(blocks)} blocks of "
                                f"{block} for {end} tokens")
            if kind == "mamba" and blocks[(end - 1) // block].is_null:
                raise Violation(f"step {step}, request {rid}: running GDN column {(end - 1) // block} is a null block")


def runner_output(sched, out, rng: random.Random):
    """The model's answer: a prefill chunk that does not reach the prompt's end samples nothing; any
    other request accepts a random number of its drafts plus one token."""
    from vllm.v1.outputs import ModelRunnerOutput

    ids, sampled = [], []
    for rid in out.num_scheduled_tokens:
        req = sched.requests[rid]
        drafts = len(out.scheduled_spec_decode_tokens.get(rid, ()))
        ids.append(rid)
        if req.num_computed_tokens - drafts < req.num_tokens:  # already counts this step's n tokens
            sampled.append([])
        else:
            sampled.append([rng.randrange(100, 240000) for _ in range(rng.randint(1, drafts + 1))])
    import dataclasses

    index = ({"req_id_to_index": {r: i for i, r in enumerate(ids)}}  # 0.34.0 indexes by req_ids' order
             if "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)} else {})
    return ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled, **index)


def converse(sched, groups, state, hasher, rng: random.Random, conversations: int, turns: int, tokens: int,
             log: list[dict], fine: int | None = None) -> None:
    """Multi-turn conversations, two at a time: each turn's prompt is the previous turn's prompt and
    answer plus a new message (a resume from the cached prefix); a fork repeats a turn's history with
    another message."""
    from vllm import SamplingParams
    from vllm.v1.outputs import DraftTokenIds
    from vllm.v1.request import Request

    history = {c: [rng.randrange(100, 240000) for _ in range(rng.randint(3000, 6000))] for c in range(conversations)}
    step, slots = 0, {}
    for turn in range(turns):
        for c in range(conversations):
            for fork in (0, 1) if turn == 1 else (0,):
                rid = f"c{c}t{turn}f{fork}"
                prompt = history[c] + [rng.randrange(100, 240000) for _ in range(rng.randint(200, 3000))]
                sched.add_request(Request(rid, prompt, SamplingParams(max_tokens=rng.randint(150, 400),
                                                                      ignore_eos=True), None, block_hasher=hasher))
                if fork == 0:
                    history[c] = prompt
        outputs: dict[str, list[int]] = {}
        while sched.requests:
            before = cached_blocks(sched)
            out = sched.schedule()
            step += 1
            copies = {c.dst_block_id: c.src_block_id for c in getattr(out, "kv_cache_block_copies", None) or ()}
            for new in out.scheduled_new_reqs:
                slots[new.req_id] = len(slots) % (MAX_SEQS * 4)
                prompt = len(sched.requests[new.req_id].prompt_token_ids)
                log.append({"step": step, "request": new.req_id, "prompt": prompt,
                            **check_new(sched, groups, state, slots[new.req_id], new, step, before, copies, fine)})
            check_step(sched, groups, out, step)
            for rid in out.num_scheduled_tokens:
                outputs[rid] = sched.requests[rid].output_token_ids
            outputs = {r: list(t) for r, t in outputs.items()}
            sched.update_from_output(out, runner_output(sched, out, rng))
            decoding = [r for r, q in sched.requests.items()
                        if q.num_output_tokens and q.num_computed_tokens >= q.num_prompt_tokens]
            if decoding:
                sched.update_draft_token_ids(DraftTokenIds(decoding, [[rng.randrange(100, 240000)] * tokens
                                                                      for _ in decoding]))
        for c in range(conversations):
            history[c] = history[c] + outputs.get(f"c{c}t{turn}f0", [])


def run_case(model, work: Path, shape: str, enabled: frozenset[str], seed: int, unit: int | None = None) -> dict:
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core import kv_cache_utils as kcu
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, MambaSpec
    from vllm.v1.structured_output import StructuredOutputManager

    shape, _, n = shape.partition("@")
    method, tokens = SHAPES[shape]
    tokens = int(n) if n else tokens
    res: dict = {"shape": shape, "method": method, "tokens": tokens, "unit": unit, "fixes": sorted(enabled),
                 "install": install(enabled)}
    config = vllm_config(model, work, method, tokens, unit)
    # VllmConfig turns the hybrid manager off on a platform without hybrid KV-cache support (this
    # CPU); the GPU engine keeps it on for the hybrid target
    config.scheduler_config.disable_hybrid_kv_cache_manager = False
    spec, _ = kv_probe.specs(shape, spec_tokens=tokens, block_flag=unit)
    try:  # 0.33: planning has its own module, after the engine core resolves one KV-cache layout
        from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
        from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
        from vllm.v1.core.kv_cache_planning import get_kv_cache_groups

        layouts = [x.name for x in get_supported_kv_cache_layouts([FlashAttentionBackend])]  # what a worker reports
        resolve_kv_cache_layout(config, [layouts], list(spec.values()))
    except ImportError:
        get_kv_cache_groups = kcu.get_kv_cache_groups
    groups = get_kv_cache_groups(config, spec)
    kinds = [("mamba" if isinstance(g.kv_cache_spec, MambaSpec) else
              "full" if type(g.kv_cache_spec) is FullAttentionSpec else "window", g.kv_cache_spec.block_size,
              getattr(g.kv_cache_spec, "sliding_window", None)) for g in groups]
    res["groups"] = sorted({f"{k} {b}" for k, b, _ in kinds})
    kv_config = KVCacheConfig(num_blocks=4000, kv_cache_tensors=[], kv_cache_groups=groups)
    cache = config.cache_config
    cache.block_size = min(b for _, b, _ in kinds)  # the engine core, after planning
    cache.mamba_block_size = next(b for k, b, _ in kinds if k == "mamba")  # the platform, align mode
    cache.num_gpu_blocks = kv_config.num_blocks
    scheduler_block, hash_block = kcu.resolve_kv_cache_block_sizes(kv_config, config)
    kcu.init_none_hash(sha256_cbor)
    hasher = kcu.get_request_block_hasher(hash_block, sha256_cbor)
    res.update(scheduler_block=scheduler_block, hash_block=hash_block, cache_block=cache.block_size,
               mamba_block=cache.mamba_block_size, requests=[], start=None, violation=None, crash=None)
    try:
        sched = Scheduler(vllm_config=config, kv_cache_config=kv_config, block_size=scheduler_block,
                          hash_block_size=hash_block, structured_output_manager=StructuredOutputManager(config))
    except AssertionError as e:  # the engine core stops here: this layout does not start
        res["start"] = f"{type(e).__name__}: {e}"[:300]
        return res
    partial = bool(getattr(sched.kv_cache_manager.coordinator, "enable_partial_hash_hits", False))
    res.update(scheduler_use_eagle=sched.use_eagle, manager_use_eagle=sched.kv_cache_manager.use_eagle,
               partial_hits=partial)
    try:
        converse(sched, kinds, model_state(cache), hasher, random.Random(seed), conversations=2, turns=4,
                 tokens=tokens, log=res["requests"], fine=hash_block if partial else None)
    except Violation as e:
        res["violation"] = str(e)
    except Exception as e:  # vLLM's own code stopped (an assertion of its own): the engine would die here
        res["crash"] = f"{type(e).__name__}: {e}"[:500]
    return res


def main() -> int:
    """``CASES`` (``shape:fixes`` joined by ``;``) run in this order in one process. An installed fix
    stays installed, so each case's fixes must include the previous case's: run a fix off first."""
    from hybrid_build.serve.runtime.fixes import FIX_IDS

    cases, work, out = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    seed = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    model = target_config(work)
    results, before = [], frozenset()
    for case in cases.split(";"):
        shape, _, fixes = case.partition(":")
        fixes, _, unit = fixes.partition(":")
        enabled = frozenset() if fixes in ("", "none") else frozenset(fixes.split(","))
        unknown = enabled - set(FIX_IDS)
        base, _, n = shape.partition("@")
        if base not in SHAPES or unknown or not before <= enabled or not (n.isdigit() or not n) or \
                not (unit.isdigit() or not unit):
            print(f"align_probe: bad case {case!r} (shapes: {', '.join(SHAPES)}; fixes: ids of serve/runtime/fixes.py"
                  f"{', not ' + ', '.join(sorted(unknown)) if unknown else ''}; each case's fixes must include the "
                  f"previous case's)", file=sys.stderr)
            return 2
        before = enabled
        results.append(run_case(model, work, shape, enabled, seed, int(unit) if unit else None))
    tmp = Path(out + ".partial")
    tmp.write_text(json.dumps(results, indent=1))
    tmp.rename(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
