"""The bandwidth model behind ``hybrid-build plan``: bytes read per decoded token, and tok/s.

Single-stream decode of a MoE model is bound by memory reads where memory is slow, so a profile's
step time is ``bytes per token / (bandwidth x efficiency)`` plus a floor that does not scale with
bytes (``StepFloor``: launching and running the many small kernels of a step, per decoder layer of
each kind and a fixed part). On a DGX Spark (273 GB/s) the bytes dominate and the dense levers pay;
on an H200 the floor is ~80% of a step and they cannot show. Bytes per token come from the checkpoint's headers
(``inspection.bytes_per_token``, the same classes ``inspect`` shows) plus the context reads (KV
cache of full-attention layers, recurrent state of DeltaNet layers). The four profiles differ only
in how the shared experts (BF16 or FP8 block-128) and the lm-head (BF16 or int8 per row) are
stored, as ``conversion.plan_conversion`` sizes them.

Speculative decoding: one verify step over V positions reads every dense weight once, the union
of the routed experts the V positions select (expected count under uniform top-k routing), the
context once, plus the drafter's own weights and the target lm-head it shares; it yields
``accept`` tokens. Dense savings are paid once per step, so they shrink as acceptance grows.

Concurrent streams (``streams``): one verify step serves every stream. Dense weights and the
drafter's weights are read once per step; the routed experts are the union over every stream's
positions (``batch_experts``: independent uniform routing, or streams that emit the same tokens
for a share of their steps, as one prompt sent to every stream does); each stream's KV cache,
DeltaNet state and drafter KV are read per stream. ``published_concurrency`` sets the model against
the seed's GB10 concurrency table.

Everything here is a pure function of numbers already read; docs/plan.md states the assumptions.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the formats import torch: `plan --help` reads the presets here without it
    from hybrid_build.core.checkpoint import Checkpoint
    from hybrid_build.recipes.conversion import ConversionPlan

PROFILES = ("base", "fp8", "int8_head", "dense")
PROFILE_LABELS = {
    "base": "INT4 source",
    "fp8": "+ FP8 shared experts",
    "int8_head": "+ int8 lm-head",
    "dense": "+ both (dense levers)",
}
CONTEXT_PARTS = ("kv_cache", "linear_state")
# parts read once per step whatever the number of positions verified
_PER_TOKEN_PARTS = ("routed_expert", "embedding")

DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2,
               "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}


# ----------------------------------------------------------------------------- hardware


@dataclass(frozen=True)
class StepFloor:
    """Time per decode step that does not scale with the bytes read: a fixed part, plus a part per
    decoder layer of each kind (``linear_attention``, ``full_attention``). ``source`` says where the
    numbers come from; ``measured`` is False where they are carried over from other hardware."""

    fixed_ms: float = 0.0
    per_layer_ms: tuple[tuple[str, float], ...] = ()
    source: str = "none: decode is taken as bound by bytes alone"
    measured: bool = True

    def ms(self, layer_types: list[str]) -> float:
        per = dict(self.per_layer_ms)
        return self.fixed_ms + sum(per.get(t, 0.0) for t in layer_types)


NO_FLOOR = StepFloor()


@dataclass(frozen=True)
class Hardware:
    """A memory system: peak read bandwidth, the fraction single-stream decode achieves, and the
    per-step time that is not bytes."""

    name: str
    label: str
    bandwidth_gbps: float
    efficiency: float
    calibration: str
    calibrated: bool
    floor: StepFloor = NO_FLOOR
    gpu_name: str = ""  # what `nvidia-smi --query-gpu=name` prints of it (serve tells the GPU by it)


# Efficiency on GB10, calibrated on ONE published number: Intel's INT4 Qwen3.5-122B-A10B decodes
# at 28.2 tok/s single-stream (vLLM, no speculation). With the 122B's headers and the default
# context below (4096 tokens, BF16 KV, FP32 DeltaNet state), base reads 6.968 GB per token:
# 28.2 x 6.968e9 / 273e9 = 0.7198.
# tests/pipeline/test_plan.py recomputes this from the synthetic 122B headers.
GB10_BASE_TOK_S = 28.2
GB10_EFFICIENCY = 0.7198
DEFAULT_CONTEXT = 4096
# GB10 has no floor: the published base -> dense gain (+27.7%) is larger than the byte ratio
# (6.968 / 5.76 GB = +21%), so the published figures leave no room for time that is not bytes.
GB10_FLOOR = StepFloor(source="none: the published GB10 lever gains exceed the byte ratio, which leaves no "
                              "room for a floor")

# H200, measured here (lab/gpu_runs.md, runs 4-5): read ceiling 4,426 GB/s of 4,800 from a 4 GiB fp32
# sum (efficiency 0.922). vLLM 0.25.1 at the real 122B widths, dummy weights, full CUDA graphs,
# single stream, five layer compositions (48 layers 36+12, 24 layers, other linear:full mixes):
# step_ms = 0.250 + 0.1437 x n_linear + 0.1790 x n_full + bytes / 4426 GB/s, RMS residual 0.027 ms.
# At 48 layers base decodes at 109.43 tok/s (3 engines: 109.42-109.77), dense at 110.56 (1.010x).
H200_EFFICIENCY = 4426 / 4800
H200_BASE_TOK_S = 109.43
H200_FLOOR = StepFloor(
    fixed_ms=0.250, per_layer_ms=(("linear_attention", 0.1437), ("full_attention", 0.1790)),
    source="H200 measured (run 5): least-squares fit over 5 layer compositions at the real widths, "
           "vLLM 0.25.1, CUDA graphs, dummy weights (RMS residual 0.027 ms)")
_FLOOR_CARRIED = "not measured on this GPU: the H200's floor, carried over"
_NOT_CALIBRATED = "not calibrated: GB10's factor (no published single-stream number for this model)"

HARDWARE: dict[str, Hardware] = {
    "gb10": Hardware("gb10", "NVIDIA DGX Spark (GB10, LPDDR5X)", 273.0, GB10_EFFICIENCY,
                     "calibrated: Qwen3.5-122B-A10B INT4 base decode 28.2 tok/s (vLLM, c=1)", True, GB10_FLOOR,
                     gpu_name="GB10"),
    "h200": Hardware("h200", "NVIDIA H200 (HBM3e)", 4800.0, H200_EFFICIENCY,
                     "measured: read ceiling 4,426 GB/s (4 GiB fp32 sum on the H200)", True, H200_FLOOR,
                     gpu_name="H200"),
    "h100": Hardware("h100", "NVIDIA H100 SXM (HBM3)", 3350.0, H200_EFFICIENCY, _NOT_CALIBRATED.replace(
        "GB10's factor", "the H200's read efficiency"), False, StepFloor(
        H200_FLOOR.fixed_ms, H200_FLOOR.per_layer_ms, _FLOOR_CARRIED + " (same Hopper architecture)", False),
        gpu_name="H100"),
    "rtx-pro-6000": Hardware("rtx-pro-6000", "NVIDIA RTX PRO 6000 Blackwell (GDDR7)", 1792.0, GB10_EFFICIENCY,
                             _NOT_CALIBRATED, False, StepFloor(
        H200_FLOOR.fixed_ms, H200_FLOOR.per_layer_ms, _FLOOR_CARRIED + " (another architecture: a guess)", False),
        gpu_name="RTX PRO 6000"),
}

# Published GB10 figures (single stream, vLLM, temperature 0) that docs/plan.md compares with.
# accept 1.0 means no speculation. DFlash rows use n=12 drafted tokens.
PUBLISHED_GB10: tuple[dict, ...] = (
    {"profile": "base", "accept": None, "tok_s": 28.2, "note": "INT4 baseline, no speculation (calibration row)"},
    {"profile": "fp8", "accept": None, "tok_s": 30.4, "note": "+ FP8 shared experts"},
    {"profile": "int8_head", "accept": None, "tok_s": 32.7, "note": "+ int8 lm-head"},
    {"profile": "dense", "accept": None, "tok_s": 36.0, "note": "+ both"},
    {"profile": "base", "accept": 6.5, "tok_s": 53.7, "note": "DFlash, end-to-end harness incl. prefill"},
    {"profile": "fp8", "accept": 6.4, "tok_s": 57.0, "note": "DFlash + FP8 shared experts, same harness"},
    {"profile": "dense", "accept": 6.4, "tok_s": 59.0, "note": "DFlash + both levers, same harness"},
    {"profile": "base", "accept": 8.3, "tok_s": 81.0, "note": "DFlash, real agent turns (73% tool calls)"},
)


def calibrate_efficiency(tok_s: float, bytes_per_token: float, bandwidth_gbps: float, floor_ms: float = 0.0) -> float:
    """The efficiency that makes ``bytes_per_token`` decode at ``tok_s`` on ``bandwidth_gbps``,
    the per-step ``floor_ms`` taken out of the step first."""
    byte_s = 1.0 / tok_s - floor_ms / 1e3
    if byte_s <= 0:
        raise ValueError(f"{tok_s:g} tok/s is faster than the floor of {floor_ms:g} ms per step allows")
    return bytes_per_token / (bandwidth_gbps * 1e9 * byte_s)


def step_seconds(bytes_per_step: float, bandwidth_gbps: float, efficiency: float, floor_ms: float = 0.0) -> float:
    return bytes_per_step / (bandwidth_gbps * 1e9 * efficiency) + floor_ms / 1e3


def decode_tok_s(bytes_per_token: float, bandwidth_gbps: float, efficiency: float, floor_ms: float = 0.0) -> float:
    return 1.0 / step_seconds(bytes_per_token, bandwidth_gbps, efficiency, floor_ms)


def layer_types(tc: dict) -> list[str]:
    """The kind of every decoder layer, from ``layer_types`` or ``full_attention_interval``."""
    return _layer_types(tc)


# ----------------------------------------------------------------------------- context reads


def _layer_types(tc: dict) -> list[str]:
    n = tc.get("num_hidden_layers", 0)
    types = tc.get("layer_types")
    if types:
        return list(types)
    interval = tc.get("full_attention_interval")
    if interval:
        return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    return ["full_attention"] * n


def state_dtype_bytes(tc: dict) -> int:
    """vLLM keeps the DeltaNet state in ``mamba_ssm_dtype`` when the config names one, else in the
    model dtype (its ``auto``)."""
    return DTYPE_BYTES.get(str(tc.get("mamba_ssm_dtype", "bfloat16")).lower(), 2)


def context_reads(tc: dict, context: int, kv_bytes: int = 2, state_bytes: int | None = None) -> dict[str, int]:
    """Context traffic per decode step: every full-attention layer reads K and V for ``context``
    positions; every DeltaNet layer reads and writes back its recurrent state [Hv, dk, dv] and
    its conv state [conv_dim, kernel-1] (BF16)."""
    types = _layer_types(tc)
    full = sum(1 for t in types if t == "full_attention")
    linear = sum(1 for t in types if t == "linear_attention")
    heads = tc.get("num_attention_heads", 1)
    kv_heads = tc.get("num_key_value_heads", heads)
    head_dim = tc.get("head_dim") or tc.get("hidden_size", 0) // max(heads, 1)
    kv = full * 2 * kv_heads * head_dim * kv_bytes * context
    state = 0
    if linear:
        sb = state_bytes if state_bytes is not None else state_dtype_bytes(tc)
        nk, nv = tc["linear_num_key_heads"], tc["linear_num_value_heads"]
        dk, dv = tc["linear_key_head_dim"], tc["linear_value_head_dim"]
        conv_dim = 2 * nk * dk + nv * dv
        per_layer = nv * dk * dv * sb + conv_dim * (tc.get("linear_conv_kernel_dim", 4) - 1) * 2
        state = linear * 2 * per_layer  # read, then write back
    return {"kv_cache": kv, "linear_state": state}


def context_layout(tc: dict, kv_bytes: int = 2, state_bytes: int | None = None) -> dict:
    """What ``context_reads`` rests on, from the config: the layers with a KV cache that grows with
    the context, and the DeltaNet layers whose state per stream does not."""
    types = _layer_types(tc)
    heads = tc.get("num_attention_heads", 1)
    kv_heads = tc.get("num_key_value_heads", heads)
    head_dim = tc.get("head_dim") or tc.get("hidden_size", 0) // max(heads, 1)
    full = sum(1 for t in types if t == "full_attention")
    one = context_reads(tc, 1, kv_bytes, state_bytes)
    return {"full_attention_layers": full, "kv_heads": kv_heads, "head_dim": head_dim, "kv_dtype_bytes": kv_bytes,
            "kv_bytes_per_token": one["kv_cache"],
            "linear_attention_layers": sum(1 for t in types if t == "linear_attention"),
            "state_size_per_stream": one["linear_state"] // 2}  # context_reads counts it read and written


# ----------------------------------------------------------------------------- profiles


@dataclass
class ProfileReads:
    """Bytes per decoded token, by part, for each profile; and how they were derived."""

    parts: dict[str, dict[str, int]]  # profile -> part -> bytes per token (no speculation)
    input_state: str  # "source" (an INT4 checkpoint) or "hybrid" (an artifact: the dense state)
    experts: int
    top_k: int
    notes: list[str] = field(default_factory=list)

    def total(self, profile: str) -> int:
        return sum(self.parts[profile].values())


def _module_bytes(ckpt: Checkpoint, module: str) -> int:
    return sum(t.nbytes for t in ckpt.modules.get(module, {}).values())


def _linear_shape(parts: dict) -> tuple[int, int] | None:
    """[N, K] of a stored linear from its weight (BF16/FP8/int8) or its GPTQ qweight [K/pack, N]."""
    w = parts.get("weight")
    if w is not None and len(w.shape) == 2:
        return w.shape
    qw = parts.get("qweight")
    if qw is not None and len(qw.shape) == 2:
        pack = 4 if qw.storage == "int8" else 8
        return qw.shape[1], qw.shape[0] * pack
    return None


def _savings_from_source(plan: ConversionPlan) -> tuple[int, int]:
    """Bytes per token the recipe saves on shared experts and on the lm-head at serve time.
    A head kept BF16 on disk (``quantize-at-load``) is served as GPTQ int8 all the same."""
    fp8 = sum(c.in_bytes - c.out_bytes for c in plan.of_kind("fp8"))
    head = 0
    for c in plan.of_kind("int8"):
        served = c.out_bytes
        if not plan.recipe.output.fmt.stores_head(plan.recipe.lm_head.storage):
            served = _served_at_load(*c.shape)
        head += c.in_bytes - served
    return fp8, head


def _served_at_load(n: int, k: int) -> int:
    """Bytes a BF16 head is served in: the serve plugin quantizes it at load to inc-hybrid's GPTQ int8."""
    from hybrid_build.core.formats import inc_hybrid

    return inc_hybrid.FORMAT.head_bytes(n, k)


def _savings_from_hybrid(ckpt: Checkpoint) -> tuple[int, int, int]:
    """For a hybrid artifact: what its FP8 shared experts and int8 head save against BF16, and the
    correction to its stored head bytes when the head is quantized at load."""
    fp8 = head = stored_head_fix = 0
    for module, parts in ckpt.modules.items():
        first = next(iter(parts.values()))
        shape = _linear_shape(parts)
        if shape is None:
            continue
        n, k = shape
        if first.klass == "shared_expert" and first.storage == "fp8":
            fp8 += 2 * n * k - _module_bytes(ckpt, module)
        elif first.klass == "lm_head" and first.storage == "int8":
            head += 2 * n * k - _module_bytes(ckpt, module)
        elif first.klass == "lm_head" and first.storage == "bf16" and \
                _head_quantized_at_load((ckpt.hybrid_info or {}).get("lm_head")):
            served = _served_at_load(n, k)
            head += 2 * n * k - served
            stored_head_fix += _module_bytes(ckpt, module) - served
    return fp8, head, stored_head_fix


def profile_reads(ckpt: Checkpoint, per_token: dict[str, int], plan: ConversionPlan | None,
                  context: int = DEFAULT_CONTEXT, kv_bytes: int = 2, state_bytes: int | None = None) -> ProfileReads:
    """The four profiles' bytes per token. ``per_token`` is ``inspection.bytes_per_token(ckpt)``;
    ``plan`` the recipe's conversion of a source (None for a hybrid artifact, which is taken as
    the ``dense`` state and converted back to BF16 for the others)."""
    tc = ckpt.text_config
    notes: list[str] = []
    stored = {k: v for k, v in per_token.items() if v}
    hybrid = plan is None
    if hybrid:
        fp8, head, head_fix = _savings_from_hybrid(ckpt)
        dense = dict(stored)
        if head_fix:
            dense["lm_head"] -= head_fix
            notes.append("the lm-head is stored BF16 and quantized to int8 at load: counted as int8")
        base = dict(dense)
        base["shared_expert"] = base.get("shared_expert", 0) + fp8
        base["lm_head"] = base.get("lm_head", 0) + head
        notes.append("input is a hybrid artifact: it is the 'dense' profile; the others restore BF16")
    else:
        fp8, head = _savings_from_source(plan)
        base = dict(stored)
        notes.append(f"conversion by recipe {plan.recipe.name}")
    if not fp8:
        notes.append("no shared-expert tensor is converted: 'fp8' equals 'base'")
    if not head:
        notes.append("no lm-head is converted: 'int8_head' equals 'base'")
    parts = {
        "base": base,
        "fp8": dict(base, shared_expert=base.get("shared_expert", 0) - fp8),
        "int8_head": dict(base, lm_head=base.get("lm_head", 0) - head),
        "dense": dict(base, shared_expert=base.get("shared_expert", 0) - fp8, lm_head=base.get("lm_head", 0) - head),
    }
    ctx = context_reads(tc, context, kv_bytes, state_bytes)
    for p in parts.values():
        p.update(ctx)
    return ProfileReads(parts, "hybrid" if hybrid else "source",
                        int(tc.get("num_experts") or 1), int(tc.get("num_experts_per_tok") or 1), notes)


# ----------------------------------------------------------------------------- speculation


@dataclass(frozen=True)
class Drafter:
    """A draft model run once per step: its weights, its KV cache, and whether it computes its
    logits with the target's lm-head (DFlash has no head of its own)."""

    name: str
    weight_bytes: int
    kv_bytes_per_position: int  # summed over its layers, at BF16
    full_layers: int = 0
    sliding_layers: int = 0
    window: int = 0
    shares_lm_head: bool = True
    block: int = 0  # tokens a step can emit at most: drafted + the bonus (DFlash's block_size); 0: not known

    def context_bytes(self, context: int, kv_bytes: int = 2) -> int:
        """Its KV cache read per step for one stream at ``context`` tokens, stored in ``kv_bytes``
        per element: vLLM builds the drafter's attention layers with the engine's cache config
        (``qwen3_dflash.py`` passes ``cache_config``), so ``--kv-cache-dtype`` applies to it too."""
        per_layer = self.kv_bytes_per_position // max(self.full_layers + self.sliding_layers, 1) * kv_bytes // 2
        return per_layer * (self.full_layers * context + self.sliding_layers * min(context, self.window))


# z-lab/Qwen3.5-122B-A10B-DFlash: ~0.8B params BF16; 6 layers (5 sliding-4096 + 1 full),
# 8 KV heads of 128: 2 x 8 x 128 x 2 bytes = 4 KiB per position per layer.
# dflash_config.block_size 16: 15 drafted tokens and the bonus at most
DFLASH_122B = Drafter("dflash", 1_600_000_000, 6 * 2 * 8 * 128 * 2, full_layers=1, sliding_layers=5, window=4096,
                      block=16)
NO_DRAFTER = Drafter("none", 0, 0, shares_lm_head=False)


def expected_experts(experts: int, top_k: int, positions: float) -> float:
    """Expected number of distinct experts per layer selected by ``positions`` tokens, each
    choosing ``top_k`` of ``experts`` uniformly: an expert is missed by one token with
    probability 1 - k/E, by all of them with (1 - k/E)^V."""
    if experts <= 0 or top_k >= experts:
        return float(experts)
    return experts * (1.0 - (1.0 - top_k / experts) ** positions)


def batch_experts(experts: int, top_k: int, positions: float, streams: int = 1, overlap: float = 0.0) -> float:
    """Expected distinct experts per layer in one verify step of ``streams`` streams of ``positions``
    tokens each. Independent streams (``overlap`` 0) pick as independent uniform tokens do: the
    union over ``streams x positions``. ``overlap`` is the share of steps in which the streams emit
    the same tokens, and so pick the same experts as one stream does (a benchmark that sends one
    prompt to every stream at temperature 0, until their numerics part): the step's bytes, linear in
    the experts, average the two cases."""
    one = expected_experts(experts, top_k, positions)
    if streams <= 1:
        return one
    return one + (1.0 - overlap) * (expected_experts(experts, top_k, positions * streams) - one)


def step_reads(parts: dict[str, int], experts: int, top_k: int, positions: float,
               drafter: Drafter = NO_DRAFTER, context: int = DEFAULT_CONTEXT, streams: int = 1,
               overlap: float = 0.0, kv_bytes: int = 2) -> dict[str, float]:
    """Bytes read by one verify step over ``positions`` tokens per stream for ``streams`` streams
    (and one draft), by part. ``parts`` holds one stream's context reads (``kv_cache``,
    ``linear_state``); ``kv_bytes`` is the KV dtype's size, for the drafter's cache."""
    out: dict[str, float] = {}
    for name, b in parts.items():
        if name == "routed_expert":
            out[name] = b * batch_experts(experts, top_k, positions, streams, overlap) / top_k
        elif name in _PER_TOKEN_PARTS:
            out[name] = b * positions * streams
        elif name in CONTEXT_PARTS:
            out[name] = float(b * streams)  # every stream has its own KV cache and DeltaNet state
        else:
            out[name] = float(b)  # dense weights: read once by the batched kernels
    if drafter.weight_bytes or drafter.kv_bytes_per_position:
        out["drafter"] = float(drafter.weight_bytes + streams * drafter.context_bytes(context, kv_bytes))
        if drafter.shares_lm_head:
            out["drafter_lm_head"] = float(parts.get("lm_head", 0))
    return out


def speculative_tok_s(parts: dict[str, int], experts: int, top_k: int, accept: float, bandwidth_gbps: float,
                      efficiency: float, drafter: Drafter = DFLASH_122B, context: int = DEFAULT_CONTEXT,
                      verify_positions: float | None = None, floor_ms: float = 0.0, streams: int = 1,
                      overlap: float = 0.0, kv_bytes: int = 2) -> tuple[float, float]:
    """(tok/s per stream, bytes per step) for ``accept`` tokens emitted per step by each of
    ``streams`` streams. The verify step's experts are the union over ``verify_positions`` tokens
    per stream (default: the ``accept`` accepted ones). ``floor_ms`` is the step's time that is not
    bytes (target and drafter: ``spec_floor_ms``); it is paid once per step, whatever the streams."""
    positions = accept if verify_positions is None else verify_positions
    step = sum(step_reads(parts, experts, top_k, positions, drafter, context, streams, overlap, kv_bytes).values())
    return accept / step_seconds(step, bandwidth_gbps, efficiency, floor_ms), step


def implied_experts(parts: dict[str, int], experts: int, top_k: int, accept: float, tok_s: float,
                    bandwidth_gbps: float, efficiency: float, drafter: Drafter = DFLASH_122B,
                    context: int = DEFAULT_CONTEXT, floor_ms: float = 0.0, streams: int = 1,
                    kv_bytes: int = 2) -> float:
    """Distinct routed experts per layer per step that a measured per-stream ``tok_s`` implies, every
    other read as modelled: (the step's time less the floor) x the effective bandwidth, less the
    other reads, over one expert's bytes per layer."""
    reads = step_reads(parts, experts, top_k, accept, drafter, context, streams, 0.0, kv_bytes)
    other = sum(b for name, b in reads.items() if name != "routed_expert")
    step_bytes = (accept / tok_s - floor_ms / 1e3) * bandwidth_gbps * 1e9 * efficiency
    return (step_bytes - other) / (parts["routed_expert"] / top_k)


def spec_floor_ms(floor: StepFloor, target_layers: list[str], drafter: Drafter) -> float:
    """The floor of one speculative step: the target's verify pass (its kernels do not multiply
    with the positions verified) plus one draft pass, each drafter layer counted as a target
    full-attention layer (an assumption: the drafter's kernels are not measured on their own)."""
    draft_layers = drafter.full_layers + drafter.sliding_layers
    draft = floor.ms(["full_attention"] * draft_layers) if draft_layers else 0.0  # its own fixed part too
    return floor.ms(target_layers) + draft


def published_comparison(reads: ProfileReads, hardware: Hardware, drafter: Drafter = DFLASH_122B,
                         context: int = DEFAULT_CONTEXT, floor_ms: float = 0.0,
                         spec_floor: float = 0.0) -> list[dict]:
    """Predicted against the published GB10 figures (meaningful for the 122B on GB10 only);
    ``floor_ms`` / ``spec_floor`` are the hardware's floors of a plain and a speculative step."""
    rows = []
    for pub in PUBLISHED_GB10:
        parts = reads.parts[pub["profile"]]
        if pub["accept"] is None:
            pred = decode_tok_s(sum(parts.values()), hardware.bandwidth_gbps, hardware.efficiency, floor_ms)
        else:
            pred = speculative_tok_s(parts, reads.experts, reads.top_k, pub["accept"], hardware.bandwidth_gbps,
                                     hardware.efficiency, drafter, context, floor_ms=spec_floor)[0]
        rows.append(dict(pub, predicted=pred, gap=pred / pub["tok_s"] - 1.0))
    return rows


# ----------------------------------------------------------------------------- concurrent streams

# The seed's concurrency table: GB10, the dense profile, DFlash n=12, vLLM, temperature 0, decode-only
# tok/s per stream (the mean over K streams). Its script (scripts/conc_workloads.py) sends ONE prompt
# to all K streams (a one-line request, max_tokens 200). Acceptance as the seed's per-workload table
# gives it: prose ~2.3, code ~5.4. Its third row (agentic, 6k-token context) states no acceptance and is left out.
PUBLISHED_GB10_CONCURRENCY: tuple[dict, ...] = tuple(
    {"workload": w, "profile": "dense", "accept": a, "concurrency": k, "tok_s": t, "calibrates": (w, k) == ("code", 2)}
    for w, a, speeds in (("prose", 2.3, (48.8, 38.4, 30.8)), ("code", 5.4, (66.9, 55.3, 43.0)))
    for k, t in zip((1, 2, 3), speeds))
# a one-line prompt (~40 tokens with the chat template) plus at most 200 generated: under 256 tokens
SEED_CONTEXT = 256
# The streams of that benchmark emit the same tokens until their numerics part, so they share most
# expert reads. The share of steps they are in step (``batch_experts``' overlap), calibrated on ONE
# figure: code at 2 streams (55.3 tok/s), the workload whose single-stream figure the model meets
# (66.9 published, 67.9 predicted), so the overlap does not absorb a single-stream error. It also
# absorbs any per-stream cost the model lacks (compute, sampling). tests/serve/speed/test_speed_plan.py
# recomputes it from the synthetic 122B headers.
SEED_STREAM_OVERLAP = 0.596


def published_concurrency(reads: ProfileReads, hardware: Hardware, drafter: Drafter = DFLASH_122B,
                          context: int = SEED_CONTEXT, spec_floor: float = 0.0,
                          overlap: float = SEED_STREAM_OVERLAP) -> list[dict]:
    """Predicted per-stream tok/s against the seed's concurrency table: with the streams sharing
    ``overlap`` of their steps (as that benchmark's one-prompt streams do) and independent (different
    conversations, ``overlap`` 0); and the experts per layer each figure implies."""
    rows = []
    for pub in PUBLISHED_GB10_CONCURRENCY:
        parts, a, k = reads.parts[pub["profile"]], pub["accept"], pub["concurrency"]
        args = (reads.experts, reads.top_k, a, hardware.bandwidth_gbps, hardware.efficiency, drafter, context)
        shared = speculative_tok_s(parts, *args, floor_ms=spec_floor, streams=k, overlap=overlap)[0]
        independent = speculative_tok_s(parts, *args, floor_ms=spec_floor, streams=k)[0]
        implied = implied_experts(parts, reads.experts, reads.top_k, a, pub["tok_s"], hardware.bandwidth_gbps,
                                  hardware.efficiency, drafter, context, spec_floor, k)
        rows.append(dict(pub, predicted=shared, gap=shared / pub["tok_s"] - 1.0, predicted_independent=independent,
                         gap_independent=independent / pub["tok_s"] - 1.0,
                         experts_per_layer=batch_experts(reads.experts, reads.top_k, a, k, overlap),
                         experts_independent=batch_experts(reads.experts, reads.top_k, a, k),
                         experts_implied=implied))
    return rows


# ----------------------------------------------------------------------------- context limits

# Qwen3.5's native context (the seed serves --max-model-len 262144), for a config that names none
NATIVE_MAX_CONTEXT = 262_144


def max_context(tc: dict) -> tuple[int, str]:
    """The longest context the model takes, and where that number comes from."""
    n = tc.get("max_position_embeddings")
    if isinstance(n, int) and n > 0:
        return n, "the model's max_position_embeddings"
    return NATIVE_MAX_CONTEXT, "Qwen3.5's native context (the config names no max_position_embeddings)"


def _head_quantized_at_load(label) -> bool:
    from hybrid_build.core import formats  # torch: only when a plan is computed

    return formats.head_quantized_at_load(label)
