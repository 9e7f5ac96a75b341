"""Fixes for the align-mode crash family: prefix caching on a hybrid GDN model (``mamba_cache_mode
"align"``) with speculative decoding, where the running GDN state is copied from block column to
block column and a resumed request starts from a cached state. Three upstream defects end in a
state read from the wrong block (``precopy_mamba_align_fused_kernel`` illegal address, Xid 31; or
silently wrong output). Each fix here is a wrapper around one vLLM function, installed only where
the function's source is the text it was written against (``Anchor``, shared with
``kv_cache_fixes``); an anchor that finds an upstream fix leaves it out, one that finds other text
refuses it, each with one log line.

mamba_eagle_drop (vLLM 0.25.1; 0.23.0 as a source patch). With an EAGLE-style drafter the
coordinator looks one block past the candidate hit in every group that drops its last matching
block, and each manager pops that block. ``MambaManager.find_longest_cache_hit`` takes the
``drop_eagle_block`` flag and never reads it, so the GDN group's hit grows one block past the
attention groups', and 0.25.1's coordinator returns that longer hit: the attention groups keep one
block less, and the resumed request gets a fresh block inside its context whose KV was never
computed (wrong output; upstream PR 48375). ``tests/serve/align_probe.py`` shows it with the ``mtp``
profile's layout, where every group has the GDN block and MTP drops the last block. vLLM 0.26.0 gives the
GDN group no margin instead (``drop_eagle_block and not isinstance(spec, MambaSpec)`` in the
coordinator): the anchor reads that as upstream. The fix searches one block less when the flag is
set, which lands the GDN hit back on the candidate, as 0.26.0's coordinator does.

mamba_state_seed (0.25.1, 0.26.0; the V2 model runner). ``MambaHybridModelState.add_request`` seeds a
resumed request's running state column with ``(num_computed_tokens - 1) //
cache_config.block_size``; the engine core has set ``block_size`` to the smallest block of the
prefix-cacheable groups, which a drafter's sliding-window group (16 tokens) pulls far below the GDN
block: the pre-copy then reads ``block_table[column]`` past the row (upstream 53142, PR 55601). vLLM
0.33.0 divides by ``cache_config.mamba_block_size``; the fix does the same after the stock seed.
0.26.0 runs the V2 runner for the real (mixed sliding/full) drafter; 0.25.1 only when told to.
Unreachable on 0.25.1 and 0.26.0 as far as their own code shows: a group below the GDN block makes
``resolve_kv_cache_block_sizes`` take the LCM as the hash block, and the coordinator then refuses to
start (``block_size must be divisible by hash_block_size``); the fix stays for a vLLM that starts.

align_accept_snapshot (0.25.1, 0.26.0, 0.33.0; the V2 runner). ``preprocess_state`` launches the
align preprocess kernel on the live ``num_accepted_tokens_gpu`` buffer, which the kernel both reads
(the accepted-token bias of the pre-copy) and resets; under async scheduling a racing update of that
buffer gives the pre-copy an out-of-range source offset (upstream 56736; PR 56756 snapshots it,
closed unmerged; main still reads the live buffer). The fix hands the kernel a snapshot taken just
before the launch and writes its resets back into the live buffer from the state columns the kernel
advanced (the kernel resets exactly where a column moved). Only a GPU kernel shows this one.
"""
from __future__ import annotations

import inspect
import logging

from .fixes import not_applied_line
from .kv_cache_fixes import Anchor, _resolve, source_of

log = logging.getLogger(__name__)

SINGLE_TYPE = ("vllm.v1.core.single_type_kv_cache_manager",)
COORDINATOR = ("vllm.v1.core.kv_cache_coordinator",)
MAMBA_STATE = ("vllm.v1.worker.gpu.model_states.mamba_hybrid",)

# the GDN manager's lookup: takes the flag, searches whole blocks up to max_length ...
DROP_MANAGER = Anchor(SINGLE_TYPE, "MambaManager.find_longest_cache_hit", needs=(
    "drop_eagle_block: bool,",
    "max_num_blocks = max_length // block_size",
), upstream=("if drop_eagle_block", "drop_eagle_block and"))
# ... and the coordinator gives every dropping group, the GDN one included, one block of margin
DROP_COORDINATOR = Anchor(COORDINATOR, "HybridKVCacheCoordinator.find_longest_cache_hit", needs=(
    "if drop_eagle_block:",
    "curr_hit_length + spec.block_size, max_cache_hit_length",
), upstream=("not isinstance(spec, MambaSpec)",))
SEED = Anchor(MAMBA_STATE, "MambaHybridModelState.add_request", needs=(
    "if self._align_mode:",
    ") // self.cache_config.block_size",
), upstream=("mamba_block_size",))
SNAPSHOT = Anchor(MAMBA_STATE, "MambaHybridModelState.preprocess_state", needs=(
    "preprocess_mamba_align_fused_kernel[grid](",
    "self.num_accepted_tokens_gpu,",
    "self._mamba_state_idx_gpu,",
), upstream=("snapshot", "num_accepted_tokens_in"))

ANCHORS: dict[str, tuple[Anchor, ...]] = {
    "mamba_eagle_drop": (DROP_MANAGER, DROP_COORDINATOR),
    "mamba_state_seed": (SEED,),
    "align_accept_snapshot": (SNAPSHOT,),
}


def verdicts(fix_id: str) -> list[str]:
    return [a.verdict(source_of(_resolve(a))) for a in ANCHORS[fix_id]]


def state_of(found: list[str]) -> str:
    """One fix's state from its anchors' verdicts: an upstream fix anywhere leaves it out."""
    if "upstream" in found:
        return "upstream"
    return "applied" if all(v == "apply" for v in found) else "refused"


# ------------------------------------------------------------------------------ wrappers


def drop_honoured(stock):
    """``MambaManager.find_longest_cache_hit`` (a classmethod's function) searching one block
    less when the coordinator asks for the EAGLE drop."""
    signature = inspect.signature(stock)

    def find_longest_cache_hit(cls, *args, **kwargs):
        bound = signature.bind(cls, *args, **kwargs)
        if bound.arguments.get("drop_eagle_block"):
            block = bound.arguments["kv_cache_spec"].block_size
            bound.arguments["max_length"] = max(bound.arguments["max_length"] - block, 0)
        return stock(*bound.args, **bound.kwargs)

    find_longest_cache_hit.hybrid_build_fix = True
    find_longest_cache_hit.stock = stock
    return find_longest_cache_hit


def seed_by_mamba_block(stock):
    def add_request(self, req_index, new_req_data):
        stock(self, req_index, new_req_data)
        block = getattr(self.cache_config, "mamba_block_size", None)
        if getattr(self, "_align_mode", False) and block and block != self.cache_config.block_size:
            self._mamba_state_idx_gpu[req_index] = (new_req_data.num_computed_tokens - 1) // block

    add_request.hybrid_build_fix = True
    add_request.stock = stock
    return add_request


def snapshot_accepted(stock):
    def preprocess_state(self, input_batch, *args, **kwargs):
        if not getattr(self, "_align_mode", False) or input_batch.num_reqs == 0:
            return stock(self, input_batch, *args, **kwargs)
        live = self.num_accepted_tokens_gpu
        columns = self._mamba_state_idx_gpu
        saved = getattr(self, "_hybrid_build_align_saved", None)
        if saved is None:
            saved = self._hybrid_build_align_saved = (live.clone(), columns.clone())
        snapshot, before = saved
        snapshot.copy_(live)
        before.copy_(columns)
        self.num_accepted_tokens_gpu = snapshot  # the kernel reads and resets the snapshot
        try:
            stock(self, input_batch, *args, **kwargs)
        finally:
            self.num_accepted_tokens_gpu = live
        # the kernel resets a request's count where its column moved: the same resets, live
        live.masked_fill_((before >= 0) & (before != columns), 1)

    preprocess_state.hybrid_build_fix = True
    preprocess_state.stock = stock
    return preprocess_state


# ------------------------------------------------------------------------------ install


def _install_method(cls, name: str, wrap, classmethod_: bool = False) -> None:
    current = inspect.getattr_static(cls, name)
    func = current.__func__ if isinstance(current, classmethod) else current
    if getattr(func, "hybrid_build_fix", False):
        return
    wrapped = wrap(func)
    setattr(cls, name, classmethod(wrapped) if classmethod_ else wrapped)


def install(enabled: frozenset[str]) -> dict[str, str]:
    """Install the named fixes where this vLLM's source is the one they were written against; per
    fix ``applied``, ``upstream`` (this vLLM does it itself), ``refused: ...`` or ``absent`` (a vLLM
    without the module). Idempotent."""
    state: dict[str, str] = {}
    for fix_id in sorted(enabled & set(ANCHORS)):
        anchors = ANCHORS[fix_id]
        if any(_resolve(a) is None for a in anchors) and all(
                not _module_present(a) for a in anchors):
            state[fix_id] = "absent"
            continue
        found = verdicts(fix_id)
        what = state_of(found)
        if what == "refused":
            names = [a.qualname for a, v in zip(anchors, found) if v == "differs"]
            what = (f"refused: this vLLM's {', '.join(names)} is not the source the fix was written against")
            log.warning("%s", not_applied_line(fix_id, what[len("refused: "):]))
        state[fix_id] = what
    if state.get("mamba_eagle_drop") == "applied":
        from vllm.v1.core.single_type_kv_cache_manager import MambaManager

        _install_method(MambaManager, "find_longest_cache_hit", drop_honoured, classmethod_=True)
    if state.get("mamba_state_seed") == "applied" or state.get("align_accept_snapshot") == "applied":
        from vllm.v1.worker.gpu.model_states.mamba_hybrid import MambaHybridModelState

        if state.get("mamba_state_seed") == "applied":
            _install_method(MambaHybridModelState, "add_request", seed_by_mamba_block)
        if state.get("align_accept_snapshot") == "applied":
            _install_method(MambaHybridModelState, "preprocess_state", snapshot_accepted)
    return state


def _module_present(anchor: Anchor) -> bool:
    import importlib.util

    for module in anchor.modules:
        try:
            if importlib.util.find_spec(module) is not None:
                return True
        except (ImportError, ValueError):
            continue
    return False
