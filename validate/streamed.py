"""A teacher-forced forward of a Qwen3.5-MoE text model that holds one decoder layer at a time.

A whole-model transformers forward of the 122B needs ~96 GB of RAM; this one reads each decoder
layer's tensors from the safetensors files when it reaches that layer, dequantizes them to
float32 with the project's own code (``calibration.gptq``, ``fp8_block``, ``int8_rows``), runs
it over every text, and drops it before the next. Routed experts are dequantized one at a time
and only for the tokens routed to them; the lm-head is read in vocabulary chunks whose logits are
folded into the statistics at once, so memory is bounded by one layer (or one head chunk), not by
the model, and no ``[positions, vocab]`` logits are kept. Vision tower and MTP are never read.

The math is transformers' ``qwen3_5_moe`` in float32 (5.17 was read): RMSNorm ``x * (1 + w)``,
gated full attention with q/k norms and partial rotary (text positions make M-RoPE's three
sections equal, so it is plain RoPE), Gated DeltaNet with its causal conv1d, l2-normed q/k and
the chunked delta rule of its torch fallback, a softmax top-k router and a sigmoid-gated shared
expert. Several checkpoints (a source and its hybrid) run in lockstep, layer by layer: a module
stored with the same codes in both (INT4 experts and attention: auto-round or repacked
pack-quantized) is dequantized once and applied to each model's own hidden states, which differ.

Entry points: ``streamed_hidden_states`` (final-norm hidden states), ``streamed_logits`` (full
logits, small vocabularies only) and ``compare_streamed`` (source vs artifact statistics from
``divergence``). On CUDA when torch sees one, else on the CPU.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from hybrid_build.calibration.fp8_block import BLOCK as FP8_BLOCK
from hybrid_build.core.checkpoint import Checkpoint
from hybrid_build.core.errors import ArtifactError, UserError
from hybrid_build.core.weights import RangeReader, read_stored

from .divergence import BOOTSTRAP_RESAMPLES, DivergenceAccumulator, PositionStats, divergence_report
from .reference import ReferenceRecorder

log = logging.getLogger(__name__)

# (steps done, steps in all, what was just done): one call per decoder layer, then per head step
Progress = Callable[[int, int, str], None]
TokenIds = Mapping[str, Sequence[int] | torch.Tensor]

# positions scored together: the lm-head is read once per block; their float64 statistics
# temporaries are [block, VOCAB_CHUNK] (1024 x 8192 x 8 B = 67 MB each)
POSITION_BLOCK = 1024
VOCAB_CHUNK = 8192  # lm-head rows dequantized at a time: 8192 x 3072 x 4 B = 101 MB (a multiple of 128)
DELTA_CHUNK = 64  # the delta rule's chunk length, as transformers' torch fallback

def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@contextlib.contextmanager
def _float32_math():
    """Inference mode, and no TF32 on a GPU (cuDNN allows it for convolutions by default; a 1e-4
    agreement with a float32 reference does not survive it). The caller's settings come back."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        with torch.inference_mode():
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


# ----------------------------------------------------------------------------------- reading


class _Weights:
    """The same module from each checkpoint, as float32 on the device: dequantized once when the
    stored codes agree (every INT4 module of a hybrid), once per checkpoint when they differ."""

    def __init__(self, readers: list[RangeReader], device: torch.device) -> None:
        self.readers, self.device = readers, device
        self.shared = self.dequantized = 0

    def get(self, module: str, rows: tuple[int, int] | None = None) -> list[torch.Tensor]:
        stored = [read_stored(r, module, rows) for r in self.readers]
        out: list[torch.Tensor] = []
        for i, st in enumerate(stored):
            j = next((j for j in range(i) if stored[j].same_as(st)), None)
            if j is None:
                out.append(st.dequantize(self.device))
                self.dequantized += 1
            else:
                out.append(out[j])
                self.shared += 1
        return out

    def vector(self, name: str) -> list[torch.Tensor]:
        """Small float tensors (norm weights, A_log, conv1d) as stored, in float32."""
        return [r.read(name).to(self.device, torch.float32) for r in self.readers]

    def linear(self, module: str, xs: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """``x @ W.T`` for each model's input (None: that model has no tokens for it)."""
        if all(x is None for x in xs):
            return list(xs)
        ws = self.get(module)
        return [None if x is None else F.linear(x, w) for x, w in zip(xs, ws)]


# ------------------------------------------------------------------------------------ config


@dataclass(frozen=True)
class _TextConfig:
    hidden: int
    vocab: int
    layer_types: tuple[str, ...]
    eps: float
    heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    lin_k_heads: int
    lin_v_heads: int
    lin_k_dim: int
    lin_v_dim: int
    experts: int
    top_k: int
    norm_topk_prob: bool
    tie_embeddings: bool
    prefix: str

    @classmethod
    def of(cls, ckpt: Checkpoint) -> _TextConfig:
        tc = ckpt.text_config
        try:
            n = tc["num_hidden_layers"]
            types = tc.get("layer_types") or [
                "full_attention" if (i + 1) % (tc.get("full_attention_interval") or 4) == 0 else "linear_attention"
                for i in range(n)]
            rope = tc.get("rope_parameters") or tc.get("rope_scaling") or {}
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            if rope_type not in ("default", "mrope"):
                raise ArtifactError(f"{ckpt.root.name}: rope_type {rope_type!r} is not supported by the "
                                    "streamed forward")
            head_dim = tc.get("head_dim") or tc["hidden_size"] // tc["num_attention_heads"]
            factor = rope.get("partial_rotary_factor", tc.get("partial_rotary_factor", 1.0))
            unknown = sorted(set(types) - {"linear_attention", "full_attention"})
            if unknown:
                raise ArtifactError(f"{ckpt.root.name}: layer type {unknown[0]!r} is not supported by the "
                                    "streamed forward")
            return cls(
                hidden=tc["hidden_size"], vocab=tc["vocab_size"], layer_types=tuple(types[:n]),
                eps=tc.get("rms_norm_eps", 1e-6), heads=tc["num_attention_heads"], kv_heads=tc["num_key_value_heads"],
                head_dim=head_dim, rotary_dim=int(head_dim * factor),
                rope_theta=float(rope.get("rope_theta", tc.get("rope_theta", 10000.0))),
                lin_k_heads=tc["linear_num_key_heads"], lin_v_heads=tc["linear_num_value_heads"],
                lin_k_dim=tc["linear_key_head_dim"], lin_v_dim=tc["linear_value_head_dim"],
                experts=tc["num_experts"], top_k=tc["num_experts_per_tok"],
                norm_topk_prob=tc.get("norm_topk_prob", True),
                tie_embeddings=bool(ckpt.config.get("tie_word_embeddings", tc.get("tie_word_embeddings", False))),
                prefix=ckpt.lm_prefix)
        except KeyError as e:
            raise ArtifactError(f"{ckpt.root.name}: config.json lacks {e.args[0]}, needed by the streamed forward")

    @property
    def head_module(self) -> str:
        return self.prefix + "embed_tokens" if self.tie_embeddings else "lm_head"


# -------------------------------------------------------------------------------------- math


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's RMSNorm: the weight is stored as an offset from 1."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      chunk: int = DELTA_CHUNK) -> torch.Tensor:
    """The gated delta rule over one sequence, chunked as transformers' torch fallback computes it.

    q, k [T, H, Dk] (already l2-normed), v [T, H, Dv], log-decay g and beta [T, H] -> [T, H, Dv]."""
    t_len = q.shape[0]
    q, k, v = (x.transpose(0, 1) for x in (q, k, v))  # [H, T, D]
    g, beta = g.t(), beta.t()
    q = q * q.shape[-1] ** -0.5
    pad = -t_len % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    h, n = q.shape[0], q.shape[1] // chunk
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(h, n, chunk, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    g = g.reshape(h, n, chunk).cumsum(-1)  # log of the decay from the chunk's start
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay  # unit lower-triangular after the solve ignores its diagonal
    intra = (q @ k.transpose(-1, -2)) * decay
    new_v = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(system, k_beta * g.exp()[..., None], upper=False, unitriangular=True)
    q = q * g.exp()[..., None]
    k = k * (g[..., -1:] - g).exp()[..., None]
    chunk_decay = g[..., -1].exp()
    state = q.new_zeros(h, q.shape[-1], v.shape[-1])
    out = torch.empty_like(new_v)
    for i in range(n):
        v_i = new_v[:, i] - k_cumdecay[:, i] @ state
        out[:, i] = q[:, i] @ state + intra[:, i] @ v_i
        state = state * chunk_decay[:, i, None, None] + k[:, i].transpose(-1, -2) @ v_i
    return out.reshape(h, n * chunk, -1)[:, :t_len].transpose(0, 1)


def _gated_deltanet(w: _Weights, p: str, xs: list[torch.Tensor], segments: list[tuple[int, int]],
                    cfg: _TextConfig) -> list[torch.Tensor]:
    nk, nv, dk, dv = cfg.lin_k_heads, cfg.lin_v_heads, cfg.lin_k_dim, cfg.lin_v_dim
    qkv = w.linear(p + "in_proj_qkv", xs)
    z = w.linear(p + "in_proj_z", xs)
    b = w.linear(p + "in_proj_b", xs)
    a = w.linear(p + "in_proj_a", xs)
    conv_w, a_log, dt_bias, norm_w = (w.vector(p + n) for n in ("conv1d.weight", "A_log", "dt_bias", "norm.weight"))
    core_all = []
    for m in range(len(xs)):
        beta = b[m].sigmoid()
        g = -a_log[m].exp() * F.softplus(a[m] + dt_bias[m])  # log-decay per token and value head
        kernel = conv_w[m].shape[-1]
        core = torch.empty(xs[m].shape[0], nv, dv, device=xs[m].device)
        for s0, s1 in segments:
            mixed = F.conv1d(qkv[m][s0:s1].t()[None], conv_w[m], padding=kernel - 1,
                             groups=conv_w[m].shape[0])[0, :, : s1 - s0]
            mixed = F.silu(mixed).t()
            q, k, v = torch.split(mixed, [nk * dk, nk * dk, nv * dv], dim=-1)
            q, k = (_l2norm(x.reshape(-1, nk, dk)).repeat_interleave(nv // nk, dim=1) for x in (q, k))
            core[s0:s1] = _gated_delta_rule(q, k, v.reshape(-1, nv, dv), g[s0:s1], beta[s0:s1])
        # gated RMSNorm per value head: a plain weight (not 1 + w), then silu(z)
        core = core * torch.rsqrt(core.pow(2).mean(-1, keepdim=True) + cfg.eps) * norm_w[m]
        core_all.append((core * F.silu(z[m].view_as(core))).reshape(xs[m].shape[0], nv * dv))
    del qkv, z, a, b
    return w.linear(p + "out_proj", core_all)


def _rope(positions: torch.Tensor, cfg: _TextConfig) -> tuple[torch.Tensor, torch.Tensor]:
    rot = cfg.rotary_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, rot, 2, dtype=torch.float32, device=positions.device) / rot))
    freqs = positions.float()[:, None] * inv_freq[None]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]: rotate the first ``rot`` dims (rotate-half form), keep the rest."""
    rot = cos.shape[-1]
    xr, xp = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    return torch.cat([xr * cos[:, None] + rotated * sin[:, None], xp], dim=-1)


def _attention(w: _Weights, p: str, xs: list[torch.Tensor], segments: list[tuple[int, int]],
               cfg: _TextConfig) -> list[torch.Tensor]:
    nh, nkv, hd = cfg.heads, cfg.kv_heads, cfg.head_dim
    qg = w.linear(p + "q_proj", xs)
    kk = w.linear(p + "k_proj", xs)
    vv = w.linear(p + "v_proj", xs)
    q_norm, k_norm = w.vector(p + "q_norm.weight"), w.vector(p + "k_norm.weight")
    outs = []
    for m in range(len(xs)):
        n_tok = xs[m].shape[0]
        gated = qg[m].shape[-1] == 2 * nh * hd  # q_proj carries an output gate per head
        if gated:
            q, gate = qg[m].view(n_tok, nh, 2 * hd).split(hd, dim=-1)
            gate = gate.reshape(n_tok, nh * hd)
        else:
            q, gate = qg[m].view(n_tok, nh, hd), None
        q = _rms_norm(q, q_norm[m], cfg.eps)
        k = _rms_norm(kk[m].view(n_tok, nkv, hd), k_norm[m], cfg.eps)
        v = vv[m].view(n_tok, nkv, hd)
        out = torch.empty(n_tok, nh, hd, device=xs[m].device)
        for s0, s1 in segments:
            cos, sin = _rope(torch.arange(s1 - s0, device=q.device), cfg)
            qs, ks = _apply_rope(q[s0:s1], cos, sin), _apply_rope(k[s0:s1], cos, sin)
            ks, vs = (x.repeat_interleave(nh // nkv, dim=1) for x in (ks, v[s0:s1]))  # GQA
            o = F.scaled_dot_product_attention(qs.transpose(0, 1)[None], ks.transpose(0, 1)[None],
                                               vs.transpose(0, 1)[None], is_causal=True, scale=hd ** -0.5)
            out[s0:s1] = o[0].transpose(0, 1)
        out = out.reshape(n_tok, nh * hd)
        outs.append(out * torch.sigmoid(gate) if gated else out)
    del qg, kk, vv
    return w.linear(p + "o_proj", outs)


def _moe(w: _Weights, p: str, xs: list[torch.Tensor], cfg: _TextConfig) -> tuple[list[torch.Tensor], int]:
    """The sparse MoE block of each model, and how many distinct experts ran (any model)."""
    router = w.linear(p + "gate", xs)
    routes = []
    for logits in router:
        probs = torch.softmax(logits.float(), dim=-1)
        top_v, top_i = torch.topk(probs, cfg.top_k, dim=-1)
        if cfg.norm_topk_prob:
            top_v = top_v / top_v.sum(-1, keepdim=True)
        routes.append((top_v, top_i))
    outs = [torch.zeros_like(x) for x in xs]
    hit = torch.unique(torch.cat([i.flatten() for _, i in routes])).tolist()
    for j in hit:  # one expert at a time, each model's tokens routed to it only
        picks = [(top_i == j).nonzero(as_tuple=True) for _, top_i in routes]
        sel = [x[tok] if tok.numel() else None for x, (tok, _) in zip(xs, picks)]
        e = f"{p}experts.{j}."
        gate, up = w.linear(e + "gate_proj", sel), w.linear(e + "up_proj", sel)
        act = [None if g_ is None else F.silu(g_) * u for g_, u in zip(gate, up)]
        down = w.linear(e + "down_proj", act)
        for m, (tok, slot) in enumerate(picks):
            if down[m] is not None:
                outs[m].index_add_(0, tok, down[m] * routes[m][0][tok, slot, None])
    s = p + "shared_expert."
    act = [F.silu(g_) * u for g_, u in zip(w.linear(s + "gate_proj", xs), w.linear(s + "up_proj", xs))]
    shared = w.linear(s + "down_proj", act)
    shared_gate = w.linear(p + "shared_expert_gate", xs)
    return [o + torch.sigmoid(sg) * sh for o, sg, sh in zip(outs, shared_gate, shared)], len(hit)


# ----------------------------------------------------------------------------------- passes


@dataclass
class StreamedForward:
    """Final-norm hidden states of each checkpoint's text model, per text ([T, hidden] float32,
    on the CPU), and how long each decoder layer took (all checkpoints together)."""

    hidden: list[dict[str, torch.Tensor]]
    layer_seconds: list[float]
    layer_experts: list[int]  # distinct routed experts run per layer (most of the time goes there)
    embed_seconds: float
    device: str
    modules_shared: int = 0  # module reads that reused another checkpoint's dequantized weight
    modules_dequantized: int = 0


def _open(c: Checkpoint | str | os.PathLike) -> Checkpoint:
    return c if isinstance(c, Checkpoint) else Checkpoint.read_folder(Path(c))


def _token_tensors(token_ids: TokenIds, vocab: int, min_tokens: int) -> dict[str, torch.Tensor]:
    if not token_ids:
        raise UserError("no texts to run: give at least one text")
    out = {}
    for name, ids in token_ids.items():
        t = torch.as_tensor(ids, dtype=torch.long).flatten()
        if t.numel() < min_tokens:
            raise UserError(f"text {name!r} has {t.numel()} token(s): the forward needs at least {min_tokens} per text")
        if int(t.min()) < 0 or int(t.max()) >= vocab:
            raise UserError(f"text {name!r} has token ids outside the model's vocabulary of {vocab}")
        out[name] = t
    return out


def _check_compatible(cfgs: list[_TextConfig], ckpts: list[Checkpoint]) -> None:
    ref = cfgs[0]
    for c, ck in zip(cfgs[1:], ckpts[1:]):
        for f in ("hidden", "vocab", "layer_types", "heads", "kv_heads", "head_dim", "lin_v_heads", "experts", "top_k"):
            if getattr(c, f) != getattr(ref, f):
                raise ArtifactError(f"{ck.root.name}: {f} differs from {ckpts[0].root.name}'s "
                                    f"({getattr(c, f)} vs {getattr(ref, f)}); they are not the same model")


def _run_layers(readers: list[RangeReader], cfg: _TextConfig, ids: dict[str, torch.Tensor], device: torch.device,
                progress: Progress | None, total_steps: int) -> StreamedForward:
    weights = _Weights(readers, device)
    names = list(ids)
    flat = torch.cat([ids[n] for n in names])
    segments, pos = [], 0
    for n in names:
        segments.append((pos, pos + ids[n].numel()))
        pos += ids[n].numel()
    t0 = time.perf_counter()
    embed = cfg.prefix + "embed_tokens.weight"
    hs = [r.gather_rows(embed, flat).to(device, torch.float32) for r in readers]
    embed_s = time.perf_counter() - t0
    layer_s, layer_experts = [], []
    for i, kind in enumerate(cfg.layer_types):
        t0 = time.perf_counter()
        p = f"{cfg.prefix}layers.{i}."
        xs = [_rms_norm(h, wn, cfg.eps) for h, wn in zip(hs, weights.vector(p + "input_layernorm.weight"))]
        if kind == "linear_attention":
            mixed = _gated_deltanet(weights, p + "linear_attn.", xs, segments, cfg)
        else:
            mixed = _attention(weights, p + "self_attn.", xs, segments, cfg)
        hs = [h + o for h, o in zip(hs, mixed)]
        xs = [_rms_norm(h, wn, cfg.eps) for h, wn in zip(hs, weights.vector(p + "post_attention_layernorm.weight"))]
        moe, hit = _moe(weights, p + "mlp.", xs, cfg)
        hs = [h + o for h, o in zip(hs, moe)]
        layer_experts.append(hit)
        del xs, mixed, moe
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        layer_s.append(time.perf_counter() - t0)
        log.info("layer %d/%d (%s): %.2f s, %d experts", i + 1, len(cfg.layer_types), kind, layer_s[-1], hit)
        if progress:
            progress(i + 1, total_steps, f"layer {i} ({kind})")
    final = [_rms_norm(h, wn, cfg.eps) for h, wn in zip(hs, weights.vector(cfg.prefix + "norm.weight"))]
    hidden = [{n: f[s0:s1].cpu() for n, (s0, s1) in zip(names, segments)} for f in final]
    return StreamedForward(hidden, layer_s, layer_experts, embed_s, str(device), weights.shared, weights.dequantized)


def streamed_hidden_states(checkpoints: Sequence[Checkpoint | str | os.PathLike], token_ids: TokenIds, *,
                           device: str | torch.device | None = None,
                           progress: Progress | None = None) -> StreamedForward:
    """Run every checkpoint's text model over the texts, in lockstep one decoder layer at a time,
    and return the final-norm hidden states. Checkpoints must be the same model (a source and its
    artifacts); a text needs at least one token."""
    ckpts = [_open(c) for c in checkpoints]
    cfgs = [_TextConfig.of(c) for c in ckpts]
    _check_compatible(cfgs, ckpts)
    ids = _token_tensors(token_ids, cfgs[0].vocab, 1)
    dev = torch.device(device) if device is not None else default_device()
    readers = [RangeReader(c) for c in ckpts]
    try:
        with _float32_math():
            return _run_layers(readers, cfgs[0], ids, dev, progress, len(cfgs[0].layer_types))
    finally:
        for r in readers:
            r.close()


def _head_logits(weights: _Weights, head: str, vocab: int, xs: list[torch.Tensor],
                 vocab_chunk: int) -> list[torch.Tensor]:
    """Logits [P, vocab] of each model's hidden states ``xs`` [P, H], the head read in row chunks."""
    if vocab_chunk % FP8_BLOCK:
        raise ValueError(f"vocab_chunk must be a multiple of {FP8_BLOCK}")
    outs = [torch.empty(x.shape[0], vocab, device=x.device) for x in xs]
    for v0 in range(0, vocab, vocab_chunk):
        v1 = min(vocab, v0 + vocab_chunk)
        for out, x, wt in zip(outs, xs, weights.get(head, rows=(v0, v1))):
            out[:, v0:v1] = F.linear(x, wt)
    return outs


def streamed_logits(checkpoint: Checkpoint | str | os.PathLike, token_ids: TokenIds, *,
                    device: str | torch.device | None = None, progress: Progress | None = None,
                    vocab_chunk: int = VOCAB_CHUNK) -> dict[str, torch.Tensor]:
    """Full logits [T, vocab] (float32, CPU) per text. It holds every text's logits at once:
    for small models and tests; ``compare_streamed`` is the bounded-memory path."""
    ckpt = _open(checkpoint)
    cfg = _TextConfig.of(ckpt)
    fwd = streamed_hidden_states([ckpt], token_ids, device=device, progress=progress)
    dev = torch.device(fwd.device)
    reader = RangeReader(ckpt)
    try:
        with _float32_math():
            weights = _Weights([reader], dev)
            return {n: _head_logits(weights, cfg.head_module, cfg.vocab, [h.to(dev)], vocab_chunk)[0].cpu()
                    for n, h in fwd.hidden[0].items()}
    finally:
        reader.close()


@dataclass
class StreamedComparison:
    """Source vs artifact, teacher-forced: ``report`` is ``divergence.divergence_report`` (reference
    = source), the hidden states are the final-norm ones per text (kept for the lm-head check)."""

    report: dict
    hidden_source: dict[str, torch.Tensor]
    hidden_artifact: dict[str, torch.Tensor]
    layer_seconds: list[float]
    layer_experts: list[int]
    embed_seconds: float
    head_seconds: float
    device: str
    stats: dict[str, PositionStats] = field(repr=False, default_factory=dict)

    def to_json(self) -> dict:
        return {**self.report, "device": self.device, "embed_seconds": round(self.embed_seconds, 3),
                "layer_seconds": [round(s, 3) for s in self.layer_seconds], "layer_experts": self.layer_experts,
                "head_seconds": round(self.head_seconds, 3)}


def compare_streamed(source: Checkpoint | str | os.PathLike, artifact: Checkpoint | str | os.PathLike,
                     token_ids: TokenIds, *, device: str | torch.device | None = None,
                     progress: Progress | None = None, position_block: int = POSITION_BLOCK,
                     vocab_chunk: int = VOCAB_CHUNK, resamples: int = BOOTSTRAP_RESAMPLES,
                     seed: int = 0, recorder: ReferenceRecorder | None = None) -> StreamedComparison:
    """Teacher-forced source vs artifact on the texts (token ids per text name, at least 2 tokens
    each). Both run layer by layer in lockstep; then each lm-head is read once per block of
    ``position_block`` positions, ``vocab_chunk`` rows at a time, and each chunk's logits of both
    models are folded into per-position statistics at once (``DivergenceAccumulator``): no
    ``[positions, vocab]`` logits exist. Position t is scored on predicting token t + 1.
    ``recorder`` (``reference.ReferenceRecorder``) is fed the same chunks and keeps each
    position's top-k of both models."""
    ckpts = [_open(source), _open(artifact)]
    cfgs = [_TextConfig.of(c) for c in ckpts]
    _check_compatible(cfgs, ckpts)
    cfg = cfgs[0]
    if vocab_chunk % FP8_BLOCK:
        raise ValueError(f"vocab_chunk must be a multiple of {FP8_BLOCK}")
    ids = _token_tensors(token_ids, cfg.vocab, 2)
    if recorder is not None:
        recorder.start(ids)
    dev = torch.device(device) if device is not None else default_device()
    n_pos = sum(t.numel() - 1 for t in ids.values())
    blocks = [(lo, min(n_pos, lo + position_block)) for lo in range(0, n_pos, position_block)]
    chunks = [(v0, min(cfg.vocab, v0 + vocab_chunk)) for v0 in range(0, cfg.vocab, vocab_chunk)]
    total = len(cfg.layer_types) + len(blocks) * len(chunks)
    readers = [RangeReader(c) for c in ckpts]
    try:
        with _float32_math():
            fwd = _run_layers(readers, cfg, ids, dev, progress, total)
            t0 = time.perf_counter()
            # every position but each text's last (it has no next token), texts concatenated
            hs = [torch.cat([h[n][:-1] for n in ids]) for h in fwd.hidden]
            targets = torch.cat([ids[n][1:] for n in ids])
            weights = _Weights(readers, dev)
            parts, step = [], len(cfg.layer_types)
            for lo, hi in blocks:
                acc = DivergenceAccumulator(targets[lo:hi].to(dev))
                if recorder is not None:
                    recorder.begin(lo, hi)
                xs = [h[lo:hi].to(dev) for h in hs]
                for v0, v1 in chunks:
                    w_src, w_art = weights.get(cfg.head_module, rows=(v0, v1))
                    z_src, z_art = F.linear(xs[0], w_src), F.linear(xs[1], w_art)
                    acc.update(v0, z_src, z_art)
                    if recorder is not None:
                        recorder.update(v0, z_src, z_art)
                    del z_src, z_art
                    del w_src, w_art
                    step += 1
                    if progress:
                        progress(step, total, f"lm-head rows {v0}-{v1} (positions {lo}-{hi})")
                parts.append(acc.result())
                if recorder is not None:
                    recorder.end()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            head_s = time.perf_counter() - t0
    finally:
        for r in readers:
            r.close()
    allstats = PositionStats.cat(parts)
    per_text, pos = {}, 0
    for n, t in ids.items():
        per_text[n] = allstats.slice(pos, pos + t.numel() - 1)
        pos += t.numel() - 1
    report = divergence_report(per_text, resamples, seed)
    log.info("streamed comparison: mean KL %.3g, same top-1 %.4f over %d positions", report["overall"]["mean_kl"],
             report["overall"]["same_top1"], n_pos)
    return StreamedComparison(report, fwd.hidden[0], fwd.hidden[1], fwd.layer_seconds, fwd.layer_experts,
                              fwd.embed_seconds, head_s, fwd.device, per_text)
