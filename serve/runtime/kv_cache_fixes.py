"""KV-cache fixes for a DFlash drafter beside the hybrid (Gated DeltaNet + attention) target.

Installed by the plugin's ``register()`` in every vLLM process (the engine core is the one that
plans the KV cache and runs the scheduler). Each is a wrapper around one vLLM function, installed
only when that function's source still says what the fix assumes (``Anchor``: texts that must be
there, and texts whose presence means upstream already does it); otherwise it is left out with one
log line, never applied blind. ``tests/serve/runtime/test_kv_cache_fixes.py`` checks every anchor against
the real source of each version and runs the wrappers on vLLM's own KV-cache code on CPU.

The numbers (vLLM 0.25.1 / 0.26.0, Qwen3.5-122B-A10B, bf16, FLASH_ATTN, 12 speculative tokens):
a target attention layer holds 2 x 2 kv heads x 256 x 2 B = 2,048 B per token; a GDN layer's
state is conv 12,288 x (3 + 12) x 2 B + ssm 64 x 128 x 128 x 4 B (the model's config asks for a
float32 ssm state) = 4,562,944 B whatever the context. ``Platform._align_hybrid_block_size``
gives the attention block 16 x ceil(4,562,944 / (16 x 2,048)) = 2,240 tokens (page P =
4,587,520 B) and pads the GDN page to P. The real drafter's layers hold 2 x 8 x 128 x 2 B =
4,096 B per token: its page at 2,240 tokens is 2P.

kv_unify (0.25.1). ``unify_kv_cache_spec_page_size`` grows every smaller page by an integer
ratio of block sizes: the target's attention goes to 4,480 tokens (2P), but a GDN page does not
depend on the block size, so ``replace(block_size=...)`` leaves it at P and ``assert
new_spec.page_size_bytes == max_page_size`` stops the engine, prefix caching on or off. vLLM
0.26.0 pads GDN pages to the largest page instead (its own unify, ``isinstance(layer_spec,
MambaSpec)``); the fix does the same on 0.25.1.

prefix_align and dflash_keep_last_block (0.25.1, 0.26.0), prefix caching on (GDN "align" mode).
With the layout above the
groups' blocks are 4,480 (target attention), 2,240 (GDN) and 2,240 (drafter): a prefix hit must be
a multiple of their LCM (4,480), the scheduler caches GDN states at chunk ends aligned to the
smallest block (2,240), and with DFlash counted as EAGLE (``use_eagle()``) every group drops its
last matching block: at 64k tokens the hit falls back to an earlier chunk end (the simulation in
the tests: 53,760 of 65,568 tokens; measured on the H200 with 0.26.0: warm 1.38 s vs cold 5.34 s).
Two fixes, each switchable alone:
- prefix_align, one block size for every group: with a GDN group in align mode, every attention layer keeps the
  GDN block size and the smaller pages are padded to the largest (attention pages only where the
  backend reads pages by the block stride, as vLLM's own padding requires). The hit unit, the
  scheduler block and the cached GDN states then all sit on the same 2,240-token grid; the cost
  is the padding: the target's attention pages hold 2,048 B of 4,096 B per token (KV bytes per
  token 72 KiB instead of 48 KiB for the 122B with this drafter);
- dflash_keep_last_block, no EAGLE trailing-block drop for DFlash: a DFlash drafter's context K/V
  at a position come from the target's hidden state there alone (``precompute_and_store_context_kv``), not from the next
  token, so nothing in the last block is provisional. vLLM 0.33 says the same
  (``SpeculativeConfig.needs_eagle_block_drop``); 0.25.1 and 0.26.0 drop it for every method that
  ``use_eagle()``. The fix gives the scheduler's KV-cache manager and its GDN chunk split
  ``use_eagle=False`` for DFlash and leaves every other use of the flag alone. With vLLM 0.26.0's
  ``--prefix-match-unit`` (hashes finer than the physical block, copy-on-write partial hits) this
  fix gives hits within one unit of the prefix on vLLM's own pages, without prefix_align's padding
  (the ``fine_grained`` layout; a drafter with sliding-window layers also needs
  ``window_hits.py``'s fix; ``tests/serve/kv_probe.py``, lab/results/prefix_layouts_real_drafter_cpu.json).
"""
from __future__ import annotations

import contextvars
import inspect
import logging
from dataclasses import dataclass, replace

from .fixes import not_applied_line

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Anchor:
    """What a fix assumes about one vLLM function's source text."""

    modules: tuple[str, ...]        # where the function may live (the first that has it is checked)
    qualname: str
    needs: tuple[str, ...]          # each must occur in the function's source
    upstream: tuple[str, ...] = ()  # any of these: the version already does what the fix does

    def verdict(self, source: str | None) -> str:
        """``apply``, ``upstream`` (the version does it itself) or ``differs`` (not the text the
        fix was written against: refuse)."""
        if source is None:
            return "differs"
        if any(u in source for u in self.upstream):
            return "upstream"
        return "apply" if all(n in source for n in self.needs) else "differs"


UNIFY = ("vllm.v1.core.kv_cache_utils",)
PLANNING = ("vllm.v1.core.kv_cache_utils", "vllm.v1.core.kv_cache_planning")  # 0.33 plans in the latter
SCHEDULER = ("vllm.v1.core.sched.scheduler",)

# vLLM 0.25.1's unify: the ratio branch that cannot grow a GDN page, and the assert it trips
KV_UNIFY = Anchor(PLANNING, "unify_kv_cache_spec_page_size", needs=(
    "new_spec = replace(layer_spec, block_size=new_block_size)",
    "assert new_spec.page_size_bytes == max_page_size",
), upstream=("elif isinstance(layer_spec, MambaSpec):",))
# the unify the block-size layout replaces, in 0.25.1 and 0.26.0 (0.33 plans in kv_cache_planning)
PREFIX_UNIFY = Anchor(UNIFY, "unify_kv_cache_spec_page_size", needs=(
    "max_page_size = max(page_sizes)",
    "new_spec = replace(layer_spec, block_size=new_block_size)",
    "replace(layer_spec, page_size_padded=max_page_size)",
))
# the scheduler hands its EAGLE flag to the KV-cache manager ...
PREFIX_SCHED_INIT = Anchor(SCHEDULER, "Scheduler.__init__", needs=(
    "if speculative_config.use_eagle():",
    "use_eagle=self.use_eagle,",
), upstream=("use_eagle_block_drop",))
# ... and backs the last cached GDN state off one block for it
PREFIX_SCHED_SPLIT = Anchor(SCHEDULER, "Scheduler._mamba_block_aligned_split", needs=(
    "block_size = self.cache_config.block_size",
    "if self.use_eagle:",
    "last_cache_position = max(last_cache_position - block_size, 0)",
), upstream=("use_eagle_block_drop",))

ANCHORS: dict[str, tuple[Anchor, ...]] = {
    "kv_unify": (KV_UNIFY,),
    "prefix_align": (PREFIX_UNIFY,),
    "dflash_keep_last_block": (PREFIX_SCHED_INIT, PREFIX_SCHED_SPLIT),
}


def source_of(obj) -> str | None:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return None


def _resolve(anchor: Anchor):
    """The live object an anchor names (None when the module or attribute is missing)."""
    import importlib

    for module in anchor.modules:
        try:
            obj = importlib.import_module(module)
        except ImportError:
            continue
        for part in anchor.qualname.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        else:
            return getattr(obj, "stock", obj) if getattr(obj, "hybrid_build_fix", False) else obj
    return None


# ------------------------------------------------------------------------------ page layouts


def pad_mamba_pages(kv_cache_spec: dict, mamba_cls) -> dict:
    """kv_unify: every GDN/Mamba page smaller than the largest page padded up to it (vLLM
    0.26.0's rule); the rest is left for vLLM's own unify."""
    pages = {s.page_size_bytes for s in kv_cache_spec.values()}
    if len(pages) <= 1:
        return kv_cache_spec
    top = max(pages)
    return {name: replace(spec, page_size_padded=top)
            if isinstance(spec, mamba_cls) and spec.page_size_bytes < top else spec
            for name, spec in kv_cache_spec.items()}


def uniform_block_layout(kv_cache_spec: dict, mamba_cls, attention_cls) -> dict | None:
    """prefix_align: with GDN/Mamba layers cached in align mode (prefix caching on), every layer
    at the GDN block size and every page padded to the largest; None where that cannot be done
    (no align-mode GDN layers, several GDN block sizes, an attention page already padded, or one
    whose backend cannot read padded pages): vLLM's own layout is kept then."""
    mamba = [s for s in kv_cache_spec.values() if isinstance(s, mamba_cls)]
    if not mamba or any(getattr(s, "mamba_cache_mode", None) != "align" for s in mamba):
        return None
    blocks = {s.block_size for s in mamba}
    if len(blocks) != 1:
        return None
    block = blocks.pop()
    resized = {}
    for name, spec in kv_cache_spec.items():
        if isinstance(spec, mamba_cls):
            resized[name] = spec
        elif isinstance(spec, attention_cls) and spec.page_size_padded is None:
            resized[name] = replace(spec, block_size=block)
        else:
            return None
    top = max(s.page_size_bytes for s in resized.values())
    out = {}
    for name, spec in resized.items():
        if spec.page_size_bytes == top:
            out[name] = spec
        elif isinstance(spec, mamba_cls) or spec.indexes_kv_by_block_stride:
            out[name] = replace(spec, page_size_padded=top)
        else:
            return None
    return out


def layout_unify(stock, mamba_cls, attention_cls, pad_mamba: bool, uniform_blocks: bool):
    """The unify function with the enabled parts in front of vLLM's own."""

    def unify_kv_cache_spec_page_size(kv_cache_spec):
        if uniform_blocks:
            uniform = uniform_block_layout(kv_cache_spec, mamba_cls, attention_cls)
            if uniform is not None:
                if uniform != kv_cache_spec and not unify_kv_cache_spec_page_size.said:
                    unify_kv_cache_spec_page_size.said = True
                    block = next(s.block_size for s in uniform.values() if isinstance(s, mamba_cls))
                    log.warning("hybrid-build: every KV-cache group at %d tokens a block, pages padded to %d B "
                                "(prefix caching with a drafter on a hybrid model; runtime fix prefix_align)",
                                block, next(iter(uniform.values())).page_size_bytes)
                return uniform
        if pad_mamba:
            kv_cache_spec = pad_mamba_pages(kv_cache_spec, mamba_cls)
        return stock(kv_cache_spec)

    unify_kv_cache_spec_page_size.hybrid_build_fix = True
    unify_kv_cache_spec_page_size.said = False
    unify_kv_cache_spec_page_size.stock = stock
    return unify_kv_cache_spec_page_size


# ------------------------------------------------------------------------------ DFlash block drop

_NO_BLOCK_DROP: contextvars.ContextVar[bool] = contextvars.ContextVar("hybrid_build_no_block_drop", default=False)


def is_dflash(vllm_config) -> bool:
    spec = getattr(vllm_config, "speculative_config", None)
    return spec is not None and getattr(spec, "method", None) == "dflash"


def no_drop_manager(stock_cls):
    """The scheduler's KV-cache manager class, built with ``use_eagle=False`` while a DFlash
    scheduler is being made."""

    class KVCacheManager(stock_cls):  # type: ignore[misc, valid-type]
        hybrid_build_fix = True

        def __init__(self, *args, **kwargs):
            if _NO_BLOCK_DROP.get():
                kwargs["use_eagle"] = False
            super().__init__(*args, **kwargs)

    KVCacheManager.__qualname__ = stock_cls.__qualname__
    KVCacheManager.__module__ = stock_cls.__module__
    return KVCacheManager


def no_drop_init(stock_init):
    def __init__(self, *args, **kwargs):
        config = kwargs.get("vllm_config", args[0] if args else None)
        if not is_dflash(config):
            return stock_init(self, *args, **kwargs)
        token = _NO_BLOCK_DROP.set(True)
        try:
            stock_init(self, *args, **kwargs)
        finally:
            _NO_BLOCK_DROP.reset(token)
        self.hybrid_build_no_block_drop = True
        log.warning("hybrid-build: DFlash keeps the last prefix-cache block (no EAGLE block drop; runtime fix "
                    "dflash_keep_last_block)")

    __init__.hybrid_build_fix = True
    __init__.stock = stock_init
    return __init__


def no_drop_split(stock_split):
    def _mamba_block_aligned_split(self, *args, **kwargs):
        if not getattr(self, "hybrid_build_no_block_drop", False):
            return stock_split(self, *args, **kwargs)
        kept = self.use_eagle
        self.use_eagle = False  # only here: encoder scheduling still sees the real flag
        try:
            return stock_split(self, *args, **kwargs)
        finally:
            self.use_eagle = kept

    _mamba_block_aligned_split.hybrid_build_fix = True
    _mamba_block_aligned_split.stock = stock_split
    return _mamba_block_aligned_split


# ------------------------------------------------------------------------------ install


def verdicts(fix_id: str) -> list[str]:
    return [a.verdict(source_of(_resolve(a))) for a in ANCHORS[fix_id]]


def install(enabled: frozenset[str]) -> dict[str, str]:
    """Install ``kv_unify``, ``prefix_align`` and ``dflash_keep_last_block`` where named in
    ``enabled`` and where this vLLM's source is the one they were written against; per fix:
    ``applied``, ``upstream`` (not needed here) or ``refused: ...``. Idempotent. A vLLM without
    these modules: ``absent``."""
    try:
        from vllm.v1.core import kv_cache_utils
        from vllm.v1.core.sched import scheduler
        from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec
    except ImportError:
        return {f: "absent" for f in enabled & set(ANCHORS)}
    state: dict[str, str] = {}
    for fix_id in sorted(enabled & set(ANCHORS)):
        found = verdicts(fix_id)
        if "differs" in found:
            missing = [f"{a.qualname}" for a, v in zip(ANCHORS[fix_id], found) if v == "differs"]
            state[fix_id] = (f"refused: this vLLM's {', '.join(missing)} is not the source the fix was written "
                             "against (vLLM 0.25.1 / 0.26.0)")
        elif all(v == "upstream" for v in found):
            state[fix_id] = "upstream"
        else:
            state[fix_id] = "applied"
    pad = state.get("kv_unify") == "applied"
    uniform = state.get("prefix_align") == "applied"
    keep_last = state.get("dflash_keep_last_block") == "applied"
    if pad or uniform:  # applied means the anchors found the function in this module
        current = kv_cache_utils.unify_kv_cache_spec_page_size
        stock = getattr(current, "stock", current)
        kv_cache_utils.unify_kv_cache_spec_page_size = layout_unify(stock, MambaSpec, AttentionSpec, pad, uniform)
    if keep_last:
        cls = scheduler.Scheduler
        if not getattr(cls.__init__, "hybrid_build_fix", False):
            cls.__init__ = no_drop_init(cls.__init__)
            cls._mamba_block_aligned_split = no_drop_split(cls._mamba_block_aligned_split)
        if not getattr(scheduler.KVCacheManager, "hybrid_build_fix", False):
            scheduler.KVCacheManager = no_drop_manager(scheduler.KVCacheManager)
    for fix_id, what in state.items():
        if what.startswith("refused"):
            log.warning("%s", not_applied_line(fix_id, what[len("refused: "):]))
    return state
