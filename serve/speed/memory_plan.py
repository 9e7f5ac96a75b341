"""How much context the KV cache holds, computed as vLLM plans it: the one memory model ``plan``,
``serve`` and the model card share.

API (everything else here is a helper):

- ``MemoryInputs``: the model's text config, the drafter's config (or None), the speculative
  method and ``num_speculative_tokens``, the KV dtype, prefix caching and the prefix-cache layout
  (``LAYOUTS``: ``stock``, ``prefix_align`` or ``fine_grained`` with its ``prefix_match_unit``),
  ``gpu_memory_utilization``, ``max_model_len``, the engine
  version, and the bytes: the device's total, the served weights, the drafter's weights and the
  reserve (activation peak, CUDA graphs, allocator; ``reserve_basis`` says whether it is measured
  or stated). ``kv_cache_memory_bytes`` replaces the whole subtraction (vLLM's own flag).
- ``plan_memory(inputs) -> MemoryPlan``: the KV groups vLLM forms (``KVGroup``: layers, block
  size, page bytes after hybrid alignment and page unification, the real bytes under the padding,
  the pages a request holds whatever its length: GDN state + speculative pages), the number of
  blocks, ``kv_pool_bytes``, ``pool_tokens`` (the figure vLLM logs as "GPU KV cache size: N
  tokens"), ``max_context_tokens`` (the longest context one stream can hold) and
  ``streams_that_fit(context)`` (``StreamFit``: whole streams, the tokens the next one gets).
- ``log_pool_tokens(text)``: the pool vLLM logged; ``compare_with_log(plan, text)``: a warning
  when it differs from the plan by more than 2%.

What is vLLM's here, per version (0.23.0, 0.25.1, 0.26.0, 0.33.0, 0.34.0; the code paths named are
vLLM's): the GDN state shapes (``MambaStateShapeCalculator.gated_delta_net_state_shape``: conv
``(conv_dim, kernel - 1 + num_spec)`` in the model dtype, ssm ``(v_heads, dv, dk)`` in the
config's ``mamba_ssm_dtype``); the attention block from ``Platform._align_hybrid_block_size`` (the
smallest kernel-aligned block whose attention page covers the GDN page; kernel blocks of 16 for
FLASH_ATTN, and in 0.33.0+'s align mode a multiple of FlashInfer's GDN checkpoint grid, 64); the
sliding-window block (0.25.1+: the smallest kernel block; 0.23.0: the engine block);
``unify_kv_cache_spec_page_size`` (smaller attention pages grow their block by the page ratio,
GDN pages are padded, 0.26.0+ or with the ``kv_unify`` fix on 0.25.1); the grouping of
``_get_kv_cache_groups_uniform_page_size`` (group size = the fewest layers of one spec, or the
most where that is under 1.5x the fewest); ``num_blocks = available // (page x group size)``;
the logged capacity ``int(num_blocks / blocks per max_model_len request x max_model_len)``, where a
sliding-window layer counts ``cdiv(min(window - 1 + in-flight tokens, max_model_len), block) + 1``
blocks (0.26.0+: ``max_in_flight_tokens``, two batches under async scheduling, vLLM's default). The
layout ``prefix_align`` is the runtime fix of ``serve/runtime/kv_cache_fixes.py`` (every group at
the GDN block, pages padded to the largest); ``fine_grained`` is the stock layout with vLLM's
``--block-size U --prefix-match-unit U`` (the hybrid alignment takes the block size as its kernel
alignment where it is larger, so every group's block is a multiple of U; warm hits end within U tokens
of a cached prompt; with a sliding-window drafter this needs the runtime fix
``sliding_window_partial_hits``). ``tests/serve/speed/test_memory_plan.py`` checks all of it against
vLLM's own functions run on CPU.

What a stream of ``C`` tokens takes (``KVCacheManager`` on CPU checks it): per attention group
``ceil((C + lookahead) / block)`` blocks (lookahead: the speculative tokens + 1, as the scheduler
asks), the same per sliding group (the manager admits a prompt whole and frees blocks behind the window
only once computed), per GDN group ``1 + num_speculative_tokens`` pages (the pool vLLM logs counts
one more in align mode, the page written while the last is kept). The pool's first block is vLLM's null block.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace

ENGINE_VERSIONS = ("0.23.0", "0.25.1", "0.26.0", "0.33.0", "0.34.0")
KERNEL_BLOCK = 16  # FLASH_ATTN's smallest kernel block (MultipleOf(16))
FLASHINFER_GDN_GRID = 64  # 0.33.0: align-mode blocks are multiples of FlashInfer's GDN checkpoint alignment
DEFAULT_BATCHED_TOKENS = 8192  # vLLM's max_num_batched_tokens for the API server on a large GPU
LOG_DRIFT = 0.02  # serve warns when vLLM's logged pool differs from the plan by more than this
DTYPE_BYTES = {"auto": None, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "fp8": 1, "fp8_e4m3": 1,
               "fp8_e5m2": 1, "float32": 4, "fp32": 4}
# z-lab/Qwen3.5-122B-A10B-DFlash's KV shape (what the plan reads of a drafter): 6 layers, 5 sliding
# (window 4096) + 1 full, 8 KV heads of 128; the 35B's drafter is taken to have the same shape
DFLASH_DRAFTER = {"num_hidden_layers": 6, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                  "hidden_size": 3072, "sliding_window": 4096,
                  "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}
LOG_POOL = re.compile(r"(?:GPU|CUDA) KV cache size: ([\d,]+) tokens")
# vLLM's KV budget at start ("Available KV cache memory: %s GiB", round(bytes / GiB, 2); 0.23.0-0.34.0's gpu_worker.py)
LOG_BUDGET = re.compile(r"Available KV cache memory: ([0-9]+(?:\.[0-9]+)?) GiB")
GIB = 1 << 30
# how far past the plan's pools for the budget vLLM logged (rounded to 0.01 GiB) its logged pool may sit: a real
# start measured 0.008% past; the layouts a check must tell apart differ by 0.65% (fine_grained against vLLM's
# own pages) or more
BUDGET_SLACK = 0.001
# the prefix-cache layouts: vLLM's own; every group at the GDN block with padded pages (runtime fix
# prefix_align); vLLM's own pages with --block-size U --prefix-match-unit U (partial hits every U tokens)
LAYOUTS = ("stock", "prefix_align", "fine_grained")


@dataclass(frozen=True)
class KVGroup:
    """One KV-cache group as vLLM forms it (``KVCacheGroupSpec``)."""

    kind: str  # full_attention | sliding_window | mamba
    owner: str  # target | drafter | mtp
    layers: int  # real layers in the group (padding layers are not counted)
    block_size: int  # tokens per block after alignment and unification
    page_bytes: int  # bytes per block per layer, padded
    real_page_bytes: int  # bytes the layer's own data takes in that page
    state_pages: int = 0  # mamba: pages per request whatever its length (1 + speculative [+1 in align])
    window: int = 0  # sliding_window: tokens


@dataclass(frozen=True)
class StreamFit:
    """How many streams of ``context`` tokens the pool holds at once."""

    context: int
    blocks_per_stream: int
    whole: int  # streams that get their whole context
    next_tokens: int  # the context the next stream can still get (0: none)

    def fits(self, streams: int) -> bool:
        return self.whole >= streams


@dataclass(frozen=True)
class MemoryInputs:
    """What the plan is computed from (see the module docstring)."""

    text_config: dict
    drafter_config: dict | None = None
    method: str | None = None  # dflash | mtp | None
    num_speculative_tokens: int = 0
    kv_cache_dtype: str = "auto"
    prefix_caching: bool = True
    layout: str = "stock"  # one of LAYOUTS
    prefix_match_unit: int | None = None  # fine_grained: vLLM's --prefix-match-unit and --block-size
    gpu_memory_utilization: float = 0.82
    max_model_len: int = 262144
    engine: str = "0.26.0"
    total_bytes: int = 0
    weights_bytes: int = 0
    drafter_bytes: int = 0
    reserve_bytes: int = 0
    reserve_basis: str = "stated"
    kv_cache_memory_bytes: int | None = None
    tensor_parallel: int = 1
    max_num_batched_tokens: int = DEFAULT_BATCHED_TOKENS
    # vLLM's default: on with no drafter or an EAGLE-family one (dflash, mtp); --no-async-scheduling turns it off
    async_scheduling: bool = True


@dataclass
class MemoryPlan:
    """The KV cache vLLM would build (``plan_memory``)."""

    inputs: MemoryInputs
    groups: list[KVGroup]
    group_size: int
    num_blocks: int
    kv_pool_bytes: int
    pool_tokens: int
    max_context_tokens: int
    lookahead: int
    notes: list[str] = field(default_factory=list)

    @property
    def weights_bytes(self) -> int:
        return self.inputs.weights_bytes

    @property
    def drafter_bytes(self) -> int:
        return self.inputs.drafter_bytes

    @property
    def reserve_bytes(self) -> int:
        return self.inputs.reserve_bytes

    @property
    def page_bytes(self) -> int:
        return self.groups[0].page_bytes if self.groups else 0

    @property
    def block_bytes(self) -> int:
        """One block of the pool: a page in each of the group-size shared tensors."""
        return self.page_bytes * self.group_size

    @property
    def hit_unit(self) -> int:
        """The grid a warm prefix hit lands on, in tokens: the unit (``fine_grained``), the GDN block
        (``prefix_align``), else the common multiple of the groups' blocks (vLLM's scheduler block)."""
        if self.inputs.layout == "fine_grained" and self.inputs.prefix_match_unit:
            return self.inputs.prefix_match_unit
        return math.lcm(*(g.block_size for g in self.groups)) if self.groups else 0

    @property
    def kv_bytes_per_token(self) -> float:
        """Pool bytes per token of context (attention groups, padding included)."""
        return sum(self.block_bytes / g.block_size for g in self.groups if g.kind == "full_attention")

    @property
    def state_bytes_per_stream(self) -> int:
        """Pool bytes one stream holds whatever its length (GDN state and its speculative pages)."""
        return sum(g.state_pages - self._align_extra for g in self.groups if g.kind == "mamba") * self.block_bytes

    def blocks_for(self, context: int) -> int:
        """Blocks one stream of ``context`` tokens holds (with the scheduler's lookahead)."""
        n = 0
        for g in self.groups:
            if g.kind in ("full_attention", "sliding_window"):
                # a sliding layer frees blocks behind its window only once they are computed: a stream
                # is admitted (its prompt allocated) with the whole context, as a full layer is
                n += math.ceil((context + self.lookahead) / g.block_size)
            else:
                n += g.state_pages - self._align_extra
        return n

    @property
    def _align_extra(self) -> int:
        """Align mode counts one more GDN page per request in the pool vLLM logs (the state being
        written while the last one is kept); the manager admits a stream without it."""
        return 1 if self.inputs.prefix_caching and self.inputs.engine else 0

    def streams_that_fit(self, context: int) -> StreamFit:
        usable = max(self.num_blocks - 1, 0)  # block 0 is the null block
        need = self.blocks_for(context)
        whole = usable // need if need else 0
        left = usable - whole * need
        return StreamFit(context, need, whole, self._context_in(left))

    def _context_in(self, blocks: int) -> int:
        """The longest context a stream can hold in ``blocks`` blocks."""
        if self.blocks_for(0) > blocks:
            return 0
        lo, hi = 0, 1
        while self.blocks_for(hi) <= blocks and hi < 1 << 40:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.blocks_for(mid) <= blocks else (lo, mid)
        return lo

    def to_json(self) -> dict:
        i = self.inputs
        return {
            "engine": i.engine, "layout": i.layout, "prefix_caching": i.prefix_caching,
            "prefix_match_unit": i.prefix_match_unit if i.layout == "fine_grained" else None,
            "hit_unit": self.hit_unit if i.prefix_caching else None,
            "kv_cache_dtype": i.kv_cache_dtype, "num_speculative_tokens": i.num_speculative_tokens,
            "gpu_memory_utilization": i.gpu_memory_utilization, "max_model_len": i.max_model_len,
            "total_bytes": i.total_bytes, "weights_bytes": i.weights_bytes, "drafter_bytes": i.drafter_bytes,
            "reserve_bytes": i.reserve_bytes, "reserve_basis": i.reserve_basis,
            "groups": [g.__dict__ for g in self.groups], "group_size": self.group_size,
            "num_blocks": self.num_blocks, "block_bytes": self.block_bytes, "kv_pool_bytes": self.kv_pool_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token, "state_bytes_per_stream": self.state_bytes_per_stream,
            "pool_tokens": self.pool_tokens, "max_context_tokens": self.max_context_tokens,
            "lookahead": self.lookahead, "notes": list(self.notes),
        }


class MemoryPlanError(ValueError):
    """The engine would refuse this layout (vLLM raises or asserts while planning it)."""


# ------------------------------------------------------------------------------ specs


def _layer_types(tc: dict) -> list[str]:
    n = int(tc["num_hidden_layers"])
    types = tc.get("layer_types")
    if types:
        return list(types)
    interval = tc.get("full_attention_interval") or 4
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]


def _dtype_bytes(name: str | None, default: int) -> int:
    if name is None:
        return default
    b = DTYPE_BYTES.get(str(name).replace("torch.", ""))
    return default if b is None else b


def gdn_state_bytes(tc: dict, num_spec: int, tp: int = 1) -> int:
    """One GDN layer's state (conv + ssm) per request, as ``MambaStateShapeCalculator`` shapes it."""
    nk, nv = int(tc["linear_num_key_heads"]), int(tc["linear_num_value_heads"])
    dk, dv = int(tc["linear_key_head_dim"]), int(tc["linear_value_head_dim"])
    conv_dim = (dk * nk * 2 + dv * nv) // tp
    conv = conv_dim * (int(tc.get("linear_conv_kernel_dim", 4)) - 1 + num_spec) * _dtype_bytes(tc.get("dtype"), 2)
    ssm = (nv // tp) * dv * dk * _dtype_bytes(tc.get("mamba_ssm_dtype"), 2)
    return conv + ssm


def _attn_token_bytes(kv_heads: int, head_dim: int, kv_bytes: int, tp: int = 1) -> int:
    return 2 * max(kv_heads // tp, 1) * head_dim * kv_bytes


@dataclass(frozen=True)
class _Spec:
    kind: str
    owner: str
    block_size: int
    per_token: int = 0  # attention: bytes per token per layer
    state: int = 0  # mamba: bytes of the state
    padded: int | None = None
    window: int = 0
    state_pages: int = 0

    @property
    def page(self) -> int:
        if self.padded is not None:
            return self.padded
        return self.state if self.kind == "mamba" else self.block_size * self.per_token

    @property
    def real(self) -> int:
        return self.state if self.kind == "mamba" else self.block_size * self.per_token


def _specs(i: MemoryInputs) -> tuple[list[_Spec], int]:
    """Every layer's spec before unification, and the engine block size."""
    tc = i.text_config
    model_bytes = _dtype_bytes(tc.get("dtype") or tc.get("torch_dtype"), 2)
    kv_bytes = _dtype_bytes(i.kv_cache_dtype if i.kv_cache_dtype != "auto" else None, model_bytes)
    types = _layer_types(tc)
    attn_token = _attn_token_bytes(int(tc["num_key_value_heads"]), int(tc["head_dim"]), kv_bytes, i.tensor_parallel)
    num_spec = i.num_speculative_tokens if i.method else 0
    hybrid = "linear_attention" in types
    align = hybrid and i.prefix_caching
    block = KERNEL_BLOCK
    state = 0
    if hybrid:
        state = gdn_state_bytes(tc, num_spec, i.tensor_parallel)
        # --block-size: Platform._align_hybrid_block_size takes it as the alignment where it exceeds the kernel's
        align_unit = max(KERNEL_BLOCK, i.prefix_match_unit or 0) if i.layout == "fine_grained" else KERNEL_BLOCK
        if align and i.engine >= "0.33":
            align_unit = math.lcm(align_unit, FLASHINFER_GDN_GRID)
        block = align_unit * math.ceil(state / (align_unit * attn_token))
    specs: list[_Spec] = []
    state_pages = (1 + num_spec + (1 if align else 0))
    for t in types:
        if t == "linear_attention":
            specs.append(_Spec("mamba", "target", block, state=state, padded=block * attn_token,
                               state_pages=state_pages))
        else:
            specs.append(_Spec("full_attention", "target", block, per_token=attn_token))
    if i.method == "mtp":
        for _ in range(int(tc.get("mtp_num_hidden_layers") or 1)):
            specs.append(_Spec("full_attention", "mtp", block, per_token=attn_token))
    elif i.method == "dflash" and i.drafter_config:
        d = i.drafter_config
        d_token = _attn_token_bytes(int(d["num_key_value_heads"]),
                                    int(d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]),
                                    kv_bytes, i.tensor_parallel)
        d_types = d.get("layer_types") or ["full_attention"] * int(d["num_hidden_layers"])
        if i.engine < "0.25":  # 0.23.0's qwen3_dflash.py reads no layer_types: every layer full attention
            d_types = ["full_attention"] * int(d["num_hidden_layers"])
        window = int(d.get("sliding_window") or 0)
        for t in d_types:
            if t == "sliding_attention" and window:
                sw_block = KERNEL_BLOCK
                specs.append(_Spec("sliding_window", "drafter", sw_block, per_token=d_token, window=window))
            else:
                specs.append(_Spec("full_attention", "drafter", block, per_token=d_token))
    return specs, block


def _unify(specs: list[_Spec], pad_mamba: bool) -> list[_Spec]:
    """``unify_kv_cache_spec_page_size``."""
    top = max(s.page for s in specs)
    out = []
    for s in specs:
        if s.page == top:
            out.append(s)
        elif s.kind == "mamba":
            if not pad_mamba:
                raise MemoryPlanError("vLLM's unify_kv_cache_spec_page_size asserts: a GDN page cannot grow with its "
                                      f"block ({s.page:,} B < {top:,} B; runtime fix kv_unify)")
            out.append(_Spec(**{**s.__dict__, "padded": top}))
        elif top % s.page == 0:
            out.append(_Spec(**{**s.__dict__, "block_size": s.block_size * (top // s.page), "padded": None}))
        else:
            out.append(_Spec(**{**s.__dict__, "padded": top}))
    return out


def _prefix_align(specs: list[_Spec]) -> list[_Spec]:
    """``kv_cache_fixes.uniform_block_layout``: every group at the GDN block, pages padded to the largest."""
    block = next(s.block_size for s in specs if s.kind == "mamba")
    resized = [s if s.kind == "mamba" else _Spec(**{**s.__dict__, "block_size": block}) for s in specs]
    top = max(s.page for s in resized)
    return [s if s.page == top else _Spec(**{**s.__dict__, "padded": top}) for s in resized]


def _key(s: _Spec) -> tuple:
    """What makes two layers' specs equal in vLLM (the owner does not)."""
    return (s.kind, s.block_size, s.per_token, s.state, s.window, s.padded, s.state_pages)


def _groups(specs: list[_Spec]) -> tuple[list[KVGroup], int]:
    """``_get_kv_cache_groups_uniform_page_size``: layers of one spec, split into equal groups."""
    same: dict[tuple, list[_Spec]] = {}
    for s in specs:
        same.setdefault(_key(s), []).append(s)
    counts = [len(v) for v in same.values()]
    size = min(counts)
    if max(counts) < size * 1.5:
        size = max(counts)
    groups = []
    for layers in same.values():
        s = layers[0]
        n = math.ceil(len(layers) / size)
        for j in range(n):
            members = len(layers[j::n])
            groups.append(KVGroup(s.kind, s.owner, members, s.block_size, s.page, s.real, s.state_pages, s.window))
    return groups, size


def in_flight_tokens(i: MemoryInputs) -> int:
    """The tokens a sliding-window layer holds beyond its window: 0.26.0+ ``VllmConfig.max_in_flight_tokens``
    (``max_concurrent_batches`` x ``max_num_batched_tokens``; async scheduling keeps two batches in
    flight at one pipeline stage, on either model runner), 0.23.0 / 0.25.1 ``max_num_batched_tokens``."""
    if i.engine < "0.26":
        return i.max_num_batched_tokens
    return (2 if i.async_scheduling else 1) * i.max_num_batched_tokens


def _max_request_blocks(g: KVGroup, i: MemoryInputs) -> int:
    """Blocks ``max_memory_usage_bytes`` counts for one request of ``max_model_len``."""
    if g.kind == "full_attention":
        return math.ceil(i.max_model_len / g.block_size)
    if g.kind == "sliding_window":
        return math.ceil(min(g.window - 1 + in_flight_tokens(i), i.max_model_len) / g.block_size) + 1
    return g.state_pages


def available_kv_bytes(i: MemoryInputs) -> int:
    """vLLM's KV budget: ``gpu_memory_utilization`` x total minus weights, drafter and reserve."""
    if i.kv_cache_memory_bytes is not None:
        return i.kv_cache_memory_bytes
    return max(int(i.gpu_memory_utilization * i.total_bytes) - i.weights_bytes - i.drafter_bytes - i.reserve_bytes, 0)


def plan_memory(i: MemoryInputs) -> MemoryPlan:
    """The KV cache vLLM ``i.engine`` would build for these inputs (module docstring)."""
    if i.engine not in ENGINE_VERSIONS:
        raise MemoryPlanError(f"engine {i.engine}: the memory plan knows vLLM {', '.join(ENGINE_VERSIONS)}")
    if i.layout not in LAYOUTS:
        raise MemoryPlanError(f"layout {i.layout!r}: one of {', '.join(LAYOUTS)}")
    if i.layout == "fine_grained" and not (i.prefix_match_unit and i.prefix_match_unit > 0):
        raise MemoryPlanError("layout fine_grained needs a prefix_match_unit")
    d = i.drafter_config or {}
    notes = []
    if i.method == "dflash" and "sliding_attention" in (d.get("layer_types") or []) and "0.25" <= i.engine < "0.26":
        raise MemoryPlanError(f"vLLM {i.engine}'s qwen3_dflash.py raises NotImplementedError for a drafter with "
                              "mixed sliding/full attention layers")
    specs, block = _specs(i)
    hybrid = any(s.kind == "mamba" for s in specs)
    if i.layout == "prefix_align" and hybrid and i.prefix_caching:
        specs = _prefix_align(specs)
    elif len({s.page for s in specs}) > 1:
        # 0.25.1 / 0.23.0 pad GDN pages only with the project's kv_unify fix (served with it)
        before = {s.padded for s in specs if s.kind == "mamba"}
        specs = _unify(specs, pad_mamba=True)
        if i.engine < "0.26" and {s.padded for s in specs if s.kind == "mamba"} != before:
            notes.append(f"vLLM {i.engine} needs the runtime fix kv_unify for this drafter (GDN pages padded)")
    groups, size = _groups(specs)
    page = groups[0].page_bytes
    avail = available_kv_bytes(i)
    num_blocks = max(avail // (page * size), 0)
    per_request = sum(_max_request_blocks(g, i) for g in groups)
    pool_tokens = int(num_blocks / per_request * i.max_model_len) if per_request else 0
    lookahead = (i.num_speculative_tokens + 1) if i.method == "dflash" else i.num_speculative_tokens if i.method else 0
    plan = MemoryPlan(i, groups, size, num_blocks, num_blocks * page * size, pool_tokens, 0, lookahead, notes)
    plan.max_context_tokens = min(plan._context_in(max(num_blocks - 1, 0)), i.max_model_len)
    return plan


# ------------------------------------------------------------------------------ vLLM's log


def log_pool_tokens(text: str) -> int | None:
    """The pool vLLM logged at start ("GPU KV cache size: N tokens"; the same words in 0.23.0-0.34.0)."""
    found = LOG_POOL.findall(text)
    return int(found[-1].replace(",", "")) if found else None


def log_budget_gib(text: str) -> float | None:
    """The KV budget vLLM logged at start, in GiB as it rounds it (two decimals), or None."""
    found = LOG_BUDGET.findall(text)
    return float(found[-1]) if found else None


def pool_at_logged_budget(i: MemoryInputs, gib: float) -> tuple[int, int]:
    """The lowest and highest pool ``plan_memory`` gives for the budgets vLLM logs as ``gib`` (it prints
    ``round(bytes / GiB, 2)``: anything within 0.005 GiB of it); the layout's own figure, whatever the
    weights and the reserve were."""
    lo, hi = max(int((gib - 0.005) * GIB), 0), int((gib + 0.005) * GIB)
    return (plan_memory(replace(i, kv_cache_memory_bytes=lo)).pool_tokens,
            plan_memory(replace(i, kv_cache_memory_bytes=hi)).pool_tokens)


def compare_with_log(plan: MemoryPlan, text: str) -> str | None:
    """A warning when vLLM's logged pool differs from the plan's by more than 2%, else None."""
    logged = log_pool_tokens(text)
    if logged is None or not plan.pool_tokens:
        return None
    drift = logged / plan.pool_tokens - 1
    if abs(drift) <= LOG_DRIFT:
        return None
    return (f"vLLM's KV pool is {logged:,} tokens, the plan said {plan.pool_tokens:,} ({drift:+.1%}): the reserve "
            f"({plan.reserve_bytes / 1e9:.1f} GB, {plan.inputs.reserve_basis}) or the layout differs from what vLLM "
            "did; plan's stream counts are off by as much")


# ------------------------------------------------------------------------------ from a serve profile

# where the runtime fix prefix_align is installed by the plugin (serve/launch/engine_check.py)
PREFIX_ALIGN_ENGINES = ("0.25.1", "0.26.0")


def profile_kv_dtype(profile) -> str:
    """The KV dtype a serve profile starts vLLM with (its field, or ``--kv-cache-dtype`` in extra_args)."""
    args = list(getattr(profile, "extra_args", None) or [])
    for k, a in enumerate(args):
        if a == "--kv-cache-dtype" and k + 1 < len(args):
            return args[k + 1]
        if a.startswith("--kv-cache-dtype="):
            return a.split("=", 1)[1]
    return getattr(profile, "kv_cache_dtype", "auto") or "auto"


# where a profile's prefix_match_unit is passed (serve/launch/engine.match_unit): measured there on
# vLLM's own code to hit within one unit with the stock pages (tests/serve/runtime/test_kv_cache_fixes.py,
# test_window_hits.py)
UNIT_ENGINES = ("0.26.0", "0.33.0", "0.34.0")
WINDOW_FIX = "sliding_window_partial_hits"  # a drafter's sliding-window layers take partial hits with it


def uses_match_unit(profile, engine: str, drafter_config: dict | None, disabled: frozenset[str] = frozenset()) -> bool:
    """Whether serve passes the profile's ``prefix_match_unit`` (the ``fine_grained`` layout: vLLM's own
    pages, ``--block-size`` and ``--prefix-match-unit`` both the unit, prefix_align off): a DFlash
    profile caching prefixes, on a version where the unit was measured, with the drafter's config
    known, the last block kept (0.26.0: dflash_keep_last_block; 0.33.0 keeps it itself) and, for a
    drafter with sliding-window layers, the runtime fix that gives them partial hits (without it
    vLLM 0.26.0 asserts at its first prefix-cache lookup and 0.33.0 turns partial hits off)."""
    spec = getattr(profile, "speculative", None)
    sliding = drafter_config is not None and "sliding_attention" in (drafter_config.get("layer_types") or [])
    return bool(getattr(profile, "prefix_match_unit", None) and spec is not None and spec.method == "dflash"
                and profile.enable_prefix_caching and engine in UNIT_ENGINES and drafter_config is not None
                and not (sliding and WINDOW_FIX in disabled)
                and "dflash_keep_last_block" not in disabled)


def profile_layout(profile, engine: str, disabled: frozenset[str] = frozenset(),
                   drafter_config: dict | None = None, unit: bool = True) -> str:
    """``fine_grained`` where serve passes the profile's prefix-match unit (``uses_match_unit``; ``unit``
    False: a launch that does not pass it), else ``prefix_align`` where serve installs it (a DFlash
    drafter, prefix caching on, a version the plugin's fix is written for, not disabled), else ``stock``."""
    spec = getattr(profile, "speculative", None)
    if unit and uses_match_unit(profile, engine, drafter_config, disabled):
        return "fine_grained"
    if (spec is not None and spec.method == "dflash" and profile.enable_prefix_caching
            and engine in PREFIX_ALIGN_ENGINES and "prefix_align" not in disabled):
        return "prefix_align"
    return "stock"


def profile_inputs(text_config: dict, profile, engine: str, drafter_config: dict | None = None,
                   layout: str | None = None, **bytes_) -> MemoryInputs:
    """``MemoryInputs`` for a recipe's serve profile (``recipes.profiles.ServeProfile``); ``bytes_``:
    ``total_bytes``, ``weights_bytes``, ``drafter_bytes``, ``reserve_bytes``, ``reserve_basis``,
    ``kv_cache_memory_bytes``, ``tensor_parallel``."""
    spec = getattr(profile, "speculative", None)
    layout = layout or profile_layout(profile, engine, drafter_config=drafter_config)
    unit = getattr(profile, "prefix_match_unit", None) if layout == "fine_grained" else None
    return MemoryInputs(
        text_config=text_config, drafter_config=drafter_config if spec and spec.method == "dflash" else None,
        method=spec.method if spec else None, num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
        kv_cache_dtype=profile_kv_dtype(profile), prefix_caching=bool(profile.enable_prefix_caching),
        layout=layout, prefix_match_unit=unit,
        gpu_memory_utilization=profile.gpu_memory_utilization,
        max_model_len=profile.max_model_len, engine=engine,
        async_scheduling="--no-async-scheduling" not in (getattr(profile, "extra_args", None) or []), **bytes_)


# ------------------------------------------------------------------------------ hardware and advice

# Device memory as the hardware presets state it (serve/speed/multinode_plan.MEMORY_GB), and the
# reserve: what vLLM's budget loses besides weights and KV cache (activation peak, CUDA graphs,
# allocator). GB10, measured: the public recipe's log of the 122B hybrid + DFlash at 0.82 shows
# 547 blocks x 55,050,240 B = 30,112,481,280 B of KV cache; 0.82 x 128e9 - 66,137,861,088 B of
# weights (the dense hybrid, `plan` of synthetic:qwen3.5-122b-a10b) - 1.6e9 B of drafter - that
# KV cache = 7,109,657,632 B.
GB10_KV_MEASURED = 547 * 55_050_240
RESERVE_BYTES = {"gb10": 7_109_657_632}
RESERVE_BASIS = {"gb10": "measured: the public GB10 log's 547 blocks at 0.82 (122B hybrid + DFlash)"}
CARRIED_BASIS = "not measured on this hardware: GB10's measured reserve carried over"


def reserve_for(hardware: str) -> tuple[int, str]:
    return RESERVE_BYTES.get(hardware, RESERVE_BYTES["gb10"]), RESERVE_BASIS.get(hardware, CARRIED_BASIS)


def device_bytes(hardware: str | None) -> int | None:
    """The device memory of a ``plan`` hardware preset, in bytes (None: not a preset)."""
    from .multinode_plan import MEMORY_GB

    return int(MEMORY_GB[hardware] * 1e9) if hardware in MEMORY_GB else None


def served_weight_bytes(tensors, method: str | None, head_at_load: bool = False) -> int:
    """The weights vLLM loads for a profile, from a checkpoint's tensors (``TensorInfo``): the MTP
    layers only when the profile drafts with them; a BF16 head quantized at load at half its bytes."""
    tensors = list(tensors)
    out = sum(t.nbytes for t in tensors if t.klass != "mtp" or method == "mtp")
    if head_at_load:
        out -= sum(t.nbytes for t in tensors if t.klass == "lm_head") // 2
    return out


def profile_kv_memory_bytes(profile) -> int | None:
    """vLLM's ``--kv-cache-memory-bytes`` in a serve profile's extra_args (it replaces the budget)."""
    args = list(getattr(profile, "extra_args", None) or [])
    for k, a in enumerate(args):
        value = args[k + 1] if a == "--kv-cache-memory-bytes" and k + 1 < len(args) else \
            a.split("=", 1)[1] if a.startswith("--kv-cache-memory-bytes=") else None
        if value is not None:
            try:
                return int(float(value))
            except ValueError:
                return None
    return None


def plan_on(hardware: str, text_config: dict, profile, engine: str, weights_bytes: int,
            drafter_config: dict | None = None, drafter_bytes: int = 0, disabled: frozenset[str] = frozenset(),
            unit: bool = True) -> MemoryPlan:
    """The memory plan of a serve profile on a hardware preset: its memory, its reserve
    (``reserve_for``), the layout serve installs on ``engine`` (``profile_layout``; ``unit`` False: a
    launch that does not pass the profile's prefix-match unit), and a ``--kv-cache-memory-bytes`` in
    its extra_args where it sets one."""
    total = device_bytes(hardware)
    if total is None:
        raise MemoryPlanError(f"hardware {hardware!r}: its memory is not known")
    reserve, basis = reserve_for(hardware)
    return plan_memory(profile_inputs(
        text_config, profile, engine, drafter_config,
        layout=profile_layout(profile, engine, disabled, drafter_config, unit),
        total_bytes=total, weights_bytes=weights_bytes, drafter_bytes=drafter_bytes, reserve_bytes=reserve,
        reserve_basis=basis, kv_cache_memory_bytes=profile_kv_memory_bytes(profile)))


def with_changes(i: MemoryInputs, **changes) -> MemoryPlan:
    return plan_memory(replace(i, **changes))


def mixed_layout(plan: MemoryPlan, context: int, streams: int) -> int:
    """With one stream at ``context``, the longest context each of ``streams - 1`` others can hold (0: none)."""
    usable = max(plan.num_blocks - 1, 0) - plan.blocks_for(context)
    if usable < 0 or streams < 2:
        return 0
    return plan._context_in(usable // (streams - 1))


def fit_advice(plan: MemoryPlan, context: int, streams: int) -> str | None:
    """One sentence where ``streams`` streams of ``context`` tokens do not fit, with what would."""
    fit = plan.streams_that_fit(context)
    if fit.whole >= streams:
        return None
    i = plan.inputs
    ways = []
    other = mixed_layout(plan, context, streams)
    if other >= 1024:
        ways.append(f"1 x {context:,} + {streams - 1} x {other // 1024 * 1024:,}")
    alone = plan._context_in(max(plan.num_blocks - 1, 0) // streams)
    if alone:
        ways.append(f"{streams} x {min(alone, i.max_model_len):,} tokens")
    if not i.kv_cache_dtype.startswith("fp8"):
        alt = with_changes(i, kv_cache_dtype="fp8")
        if alt.streams_that_fit(context).whole >= streams:
            ways.append(f"fp8 KV cache ({alt.streams_that_fit(context).whole} fit)")
    if i.layout == "prefix_align":
        alt = with_changes(i, layout="stock")
        if alt.streams_that_fit(context).whole >= streams:
            ways.append(f"the stock prefix-cache layout ({alt.streams_that_fit(context).whole} fit; coarser warm hits)")
    if i.method and i.num_speculative_tokens > 4:
        for k in (k for k in (8, 6, 4) if k < i.num_speculative_tokens):
            alt = with_changes(i, num_speculative_tokens=k)
            if alt.streams_that_fit(context).whole >= streams:
                ways.append(f"{k} speculative tokens ({alt.streams_that_fit(context).whole} fit)")
                break
    got = f"{fit.whole} fit" + (f", the next gets {fit.next_tokens:,} tokens" if fit.next_tokens else "")
    return (f"{streams} x {context:,} tokens do not fit in the {plan.pool_tokens:,}-token pool ({got}); what fits: "
            + ("; ".join(ways) if ways else "a shorter context or fewer streams"))
