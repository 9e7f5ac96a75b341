"""Partial (fine-grained) prefix-cache hits for sliding-window KV groups: the runtime fix
``sliding_window_partial_hits``.

vLLM 0.26.0+ hashes prompts every ``--prefix-match-unit`` tokens and lets a hit end inside a
physical block: the shared tail block is copied on write (``SingleTypeKVCacheManager``'s
``_partial_hit_reqs`` / ``_apply_cow``, the worker's ``copy_kv_cache_blocks_inplace``), the GDN
state is checkpointed at the prompt's last unit boundary. Full attention and GDN "align" take part;
``SlidingWindowManager`` does not: 0.26.0 asserts at its first lookup with a unit finer than its
block, the engine's first request ("SlidingWindowManager does not support fine-grained (partial)
cache hits"), and 0.33.0 / 0.34.0 turn partial hits off for the whole model
(``partial_hash_hits_enabled``: "Disabling fine-grained prefix-cache hits ...").
The real DFlash drafter of Qwen3.5-122B-A10B has five sliding-window layers (window 4096), so with it
a warm prefix hits only on the coarse block grid unless every attention page is padded
(``prefix_align``, which costs 38% of the pool at 6 speculative tokens on a GB10).

A sliding-window layer needs only the blocks its window reaches: a hit at ``L`` tokens needs the
blocks holding ``[L - window + 1, L)``, of which only the last may be partial. The fix gives
``SlidingWindowManager`` what the full-attention manager has:

- ``find_longest_cache_hit`` at hash granularity: from the longest candidate down, the block holding
  the candidate's end (a full block, or the partial entry registered at that boundary) and every
  full block the window reaches back to must be cached; the blocks before the window are null, as
  vLLM's own sliding hits are; a hit ending inside a block returns that block last, which vLLM's
  base class then copies on write;
- ``cache_blocks`` registers the prompt's last unit boundary as a partial entry (vLLM's own
  ``FullAttentionManager._cache_partial_tail_block``, called on the sliding manager) and caches
  every full block (no sparse mask: a fine-grained hit may end in any block);
- ``supports_fine_grained_hash_lookup = True``, which is what 0.33.0's ``partial_hash_hits_enabled``
  and the coordinators' EAGLE margin read.

Outside fine-grained lookups (the alignment is the block or coarser) vLLM's own code runs. Installed
only where the class's source still says what the fix assumes (``ANCHORS``): the CoW bookkeeping of
the base class, the partial-entry registration of the full-attention manager, and a sliding
manager that neither supports fine-grained lookups nor overrides the CoW path.
``tests/serve/runtime/test_window_hits.py`` checks the anchors against each version's source and
runs vLLM's own planning, ``KVCacheManager`` and scheduler with it on CPU.
"""
from __future__ import annotations

import contextvars
import logging

from .fixes import not_applied_line
from .kv_cache_fixes import Anchor, _resolve, source_of

log = logging.getLogger(__name__)

FIX_ID = "sliding_window_partial_hits"
MODULE = ("vllm.v1.core.single_type_kv_cache_manager",)

ANCHORS: tuple[Anchor, ...] = (
    # the sliding manager as 0.26.0 (asserts) and 0.33.0 / 0.34.0 (block-granular view) write it
    Anchor(MODULE, "SlidingWindowManager", needs=(
        "def find_longest_cache_hit(",
        "resolve_block_hashes(",
        "cls._contiguous_blocks_for_hit(",
        "def get_num_skipped_tokens(",
        "def reachable_block_mask(",  # replaced by the dense mask while a fine-grained group caches
    ), upstream=("supports_fine_grained_hash_lookup: ClassVar[bool] = True",)),
    # the base class's caching, which asks the mask the fix makes dense
    Anchor(MODULE, "SingleTypeKVCacheManager.cache_blocks", needs=("self.reachable_block_mask(",)),
    # the base class's copy-on-write of a partial tail, which a sliding group inherits
    Anchor(MODULE, "SingleTypeKVCacheManager.add_local_computed_blocks", needs=(
        "self._partial_hit_reqs[request_id] = (block_idx, new_computed_blocks[-1])",)),
    Anchor(MODULE, "SingleTypeKVCacheManager.allocate_new_blocks", needs=(
        "self._apply_cow(request_id, block_idx, source_block, cow_block)",)),
    # the partial-entry registration the sliding manager borrows
    Anchor(MODULE, "FullAttentionManager._cache_partial_tail_block", needs=(
        "self.block_pool.cache_partial_block(",)),
)
# what 0.26.0 / 0.33.0 / 0.34.0 do not define on the sliding manager (it would bypass the base's CoW)
NOT_OVERRIDDEN = ("add_local_computed_blocks", "allocate_new_blocks", "cache_blocks")

_DENSE: contextvars.ContextVar[bool] = contextvars.ContextVar("hybrid_build_dense_window_mask", default=False)


def window_hit(block_hashes, max_length: int, group_ids, pool, window: int, block: int, unit: int,
               drop_last_unit: bool):
    """The longest hit of a sliding-window group at hash granularity ``unit`` (< ``block``, dividing
    it): per group, the blocks of the hit (null before the window) and its length in tokens.

    A candidate ending at ``end`` tokens needs the block holding ``end - 1`` cached under the hash at
    ``end`` (a full block's own hash, or the partial entry registered there) and every full block from
    the window's first (``max(0, hit - window + 1) // block``) up to it. With ``drop_last_unit`` (an
    EAGLE group) the hit is one unit less than the matched end, as the full-attention manager drops
    one unit in fine-grained mode."""
    per = block // unit
    n_units = min(max_length // unit, len(block_hashes))
    fine = n_units - 1
    while fine >= 0:
        end = (fine + 1) * unit
        tail = pool.get_cached_block(block_hashes[fine], group_ids)
        if not tail:
            fine -= 1
            continue
        hit = end - unit if drop_last_unit else end
        if hit <= 0:
            break
        tail_idx = (end - 1) // block
        first = max(0, hit - window + 1) // block
        found, missing = [], None
        for i in range(first, -(-hit // block)):
            got = tail if i == tail_idx else pool.get_cached_block(block_hashes[(i + 1) * per - 1], group_ids)
            if not got:
                missing = i
                break
            found.append(got)
        if missing is None:
            null = pool.null_block
            return tuple([null] * first + [g[k] for g in found] for k in range(len(group_ids))), hit
        # every shorter candidate whose window still holds the missing block misses too
        fine = min(fine - 1, (missing * block + (unit if drop_last_unit else 0)) // unit - 1)
    return tuple([] for _ in group_ids), 0


def fine_grained_finder(stock):
    """``SlidingWindowManager.find_longest_cache_hit`` (a classmethod) with the fine-grained path."""

    def find_longest_cache_hit(cls, block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec,
                               drop_eagle_block, alignment_tokens, dcp_world_size=1, pcp_world_size=1):
        block = kv_cache_spec.block_size
        if not (alignment_tokens < block and block % alignment_tokens == 0):
            return stock(cls, block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec,
                         drop_eagle_block, alignment_tokens, dcp_world_size, pcp_world_size)
        assert dcp_world_size == 1 and pcp_world_size == 1, "DCP/PCP do not support sliding window attention"
        assert block_pool.hash_block_size == alignment_tokens, (block_pool.hash_block_size, alignment_tokens)
        return window_hit(block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec.sliding_window,
                          block, alignment_tokens, drop_eagle_block)

    find_longest_cache_hit.hybrid_build_fix = True
    find_longest_cache_hit.stock = stock
    return classmethod(find_longest_cache_hit)


def partial_tail_cache(stock, register_tail):
    """``cache_blocks`` that caches every full block (a fine-grained hit may end in any of them) and
    registers the prompt's last unit boundary as a partial entry, as the full-attention manager does."""

    def cache_blocks(self, request, num_tokens, *args, **kwargs):
        fine = self.block_pool.hash_block_size < self.block_size
        token = _DENSE.set(fine)
        try:
            stock(self, request, num_tokens, *args, **kwargs)
        finally:
            _DENSE.reset(token)
        if fine:
            register_tail(self, request, num_tokens)

    cache_blocks.hybrid_build_fix = True
    cache_blocks.stock = stock
    return cache_blocks


def dense_mask(stock):
    """``reachable_block_mask`` (a classmethod): every block while a fine-grained group caches."""

    def reachable_block_mask(cls, *args, **kwargs):
        if _DENSE.get():
            return None
        return stock(cls, *args, **kwargs)

    reachable_block_mask.hybrid_build_fix = True
    reachable_block_mask.stock = stock
    return classmethod(reachable_block_mask)


def verdicts() -> list[str]:
    found = [a.verdict(source_of(_resolve(a))) for a in ANCHORS]
    cls = _resolve(ANCHORS[0])
    own = vars(cls) if cls is not None else {}
    if found[0] == "apply" and any(n in own and not getattr(own[n], "hybrid_build_fix", False) for n in NOT_OVERRIDDEN):
        found[0] = "differs"
    return found


def install(enabled: frozenset[str]) -> dict[str, str]:
    """Install ``sliding_window_partial_hits`` where named in ``enabled`` and where this vLLM's source is
    the one it was written against: ``applied``, ``upstream`` or ``refused: ...``; ``absent`` on a
    vLLM without the module. Idempotent."""
    if FIX_ID not in enabled:
        return {}
    try:
        from vllm.v1.core import single_type_kv_cache_manager as stkm
    except ImportError:
        return {FIX_ID: "absent"}
    found = verdicts()
    if found[0] == "upstream":
        return {FIX_ID: "upstream"}
    if "differs" in found:
        missing = [a.qualname for a, v in zip(ANCHORS, found) if v == "differs"]
        what = (f"refused: this vLLM's {', '.join(missing)} is not the source the fix was written against "
                "(vLLM 0.26.0 / 0.33.0 / 0.34.0)")
        log.warning("%s", not_applied_line(FIX_ID, what[len("refused: "):]))
        return {FIX_ID: what}
    cls = stkm.SlidingWindowManager
    if not getattr(cls.__dict__["find_longest_cache_hit"].__func__, "hybrid_build_fix", False):
        register_tail = stkm.FullAttentionManager._cache_partial_tail_block
        cls.find_longest_cache_hit = fine_grained_finder(cls.__dict__["find_longest_cache_hit"].__func__)
        cls.reachable_block_mask = dense_mask(cls.__dict__["reachable_block_mask"].__func__)
        cls.cache_blocks = partial_tail_cache(stkm.SingleTypeKVCacheManager.cache_blocks, register_tail)
        cls.supports_fine_grained_hash_lookup = True
        log.warning("hybrid-build: sliding-window KV groups take partial prefix-cache hits (copy on write of the "
                    "window's last block; runtime fix %s)", FIX_ID)
    return {FIX_ID: "applied"}
