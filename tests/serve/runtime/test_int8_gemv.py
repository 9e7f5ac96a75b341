"""The int8 lm-head GEMV kernel (serve/runtime/int8_gemv.py) under Triton's CPU interpreter.

Every check runs for bf16 and fp16 activations and compares against float64 arithmetic with a
bound derived from how the kernel rounds: products x_k * q_k are exact in fp32 (bf16 8 / fp16 11
significant bits times 8), the K-term fp32 sum and the scale multiply add at most
E = gamma(K + 2) * S with S = s_n * sum_k |x_k q_k| (gamma(n) = n u / (1 - n u), u = 2^-24;
doubled for hardware MMAs that truncate), and the final store in x's dtype adds
u_out * (|v| + E) + a_out:
- bf16: u_out = 2^-7, one bf16 ulp, because the interpreter (triton 3.9) converts fp32 to bf16
  by truncation where the GPU rounds to nearest (2^-8); a_out = 2^-133 (bf16 subnormals);
- fp16 (10-bit mantissa): u_out = 2^-11, round to nearest in the interpreter (numpy) and on the
  GPU (cvt.rn); a_out = 2^-25, half the spacing of fp16's subnormals (|v| < 2^-14). The tests
  keep |v| far below fp16's 65504, past which the kernel, like any fp16 matmul, gives inf.

The int8 tensor-core form (act="i16") holds row b of x as integers q on the grid t_b = max|x_b| /
32639: with t_b, 1 / t_b and x_k / t_b each rounded once in fp32, |x_k - q_k t_b| <= t_b (1/2 + 3 *
32639 * 2^-24) <= 0.506 t_b, so it adds 0.506 t_b s_n sum_k |q_nk| to E (its integer dot is exact).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
# The interpreter paths pass with triton 3.7.1 (what torch 2.13.0's CUDA wheel pins) and 3.9.0; 3.6's
# interpreter cannot iterate over a runtime loop bound, so interpreter runs need 3.7 (the test extra's floor).
INTERPRETER_OK = tuple(int(p) for p in triton.__version__.split(".")[:2]) >= (3, 7)

from hybrid_build.serve.runtime import int8_gemv as g  # noqa: E402

U32 = 2.0**-24
# (relative, absolute) error of the final store, per output dtype (module docstring)
OUT_ROUNDING = {torch.bfloat16: (2.0**-7, 2.0**-133), torch.float16: (2.0**-11, 2.0**-25)}
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
ROOT = Path(__file__).resolve().parents[3]


def _can_compile() -> bool:
    """False when triton was first imported with TRITON_INTERPRET=1 (tests/conftest.py sets it
    for the session): its library functions are then interpreter-only and compiling fails."""
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    return isinstance(tl.standard.cdiv, JITFunction)


# With a GPU (and a compile-capable triton) the same checks run compiled on it; otherwise on
# the CPU under the interpreter. Run `TRITON_INTERPRET=0 pytest -m gpu ...` on a GPU machine.
ON_GPU = torch.cuda.is_available() and _can_compile()
DEV = torch.device("cuda" if ON_GPU else "cpu")


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    # int8_gemv picks interpreted or compiled per call, so setting this late is enough (and
    # clearing it on a GPU machine undoes a session-wide TRITON_INTERPRET=1).
    if ON_GPU:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        if not INTERPRETER_OK:
            pytest.skip(f"interpreter runs need triton >= 3.7, found {triton.__version__}")
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def i16_term(x, w, s):
    """float64 bound on what act="i16" adds: x's rounding to its row's 16-bit grid (docstring)."""
    t = x.double().abs().amax(dim=1, keepdim=True) / 32639
    return 0.506 * t * (w.double().abs().sum(dim=1) * s.double().reshape(-1).abs())[None, :]


def exact_and_bound(x, w, s, act="native"):
    """float64 value of s_n * sum_k x_k q_k, and the per-element bound on the kernel's error
    when the result is stored in x's dtype (act: the form that ran)."""
    x64, w64, s64 = x.double(), w.double(), s.double().reshape(-1)
    exact = (x64 @ w64.T) * s64
    mag = (x64.abs() @ w64.abs().T) * s64.abs()
    k = x.shape[-1]
    gamma = 2 * (k + 2) * U32 / (1 - 2 * (k + 2) * U32)
    fp32_err = gamma * mag
    if act == "i16":
        fp32_err = fp32_err + i16_term(x, w, s)
    u_out, a_out = OUT_ROUNDING[x.dtype]
    assert (exact.abs() + fp32_err).max() < 6e4 or x.dtype != torch.float16  # fp16's range
    return exact, u_out * (exact.abs() + fp32_err) + a_out + fp32_err


def problem(b, n, k, seed, scale_dtype=torch.float32, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(b, k, generator=gen) * 2).to(dtype)
    w = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    s = ((torch.rand(n, generator=gen) + 0.1) * 0.02).to(scale_dtype)
    return x, w, s


def run(x, w, s, cfg=None):
    """Kernel output on DEV (poisoned with NaN first), back on the CPU."""
    out = torch.full((x.shape[0], s.numel()), float("nan"), dtype=x.dtype, device=DEV)
    res = g.int8_linear(x.to(DEV), w.to(DEV), s.to(DEV), out=out, config=cfg)
    assert res.data_ptr() == out.data_ptr()
    return out.cpu()


CASES = [
    # (B, N, K, config): tails in N and K, every batch class, split dots, chunking past 64
    (1, 40, 48, g.GemvConfig(32, 32, 4, 2, "bits")),
    (3, 130, 272, g.GemvConfig(64, 64, 4, 2, "bits")),
    (13, 96, 128, g.GemvConfig(64, 128, 4, 3, "bits", block_m=16)),
    (16, 70, 256, g.GemvConfig(32, 64, 4, 2, "bits")),
    (17, 64, 160, g.GemvConfig(64, 64, 4, 2, "bits", block_m=32)),
    (33, 50, 96, g.GemvConfig(32, 32, 4, 2, "bits", block_m=64)),
    (64, 100, 64, g.GemvConfig(64, 32, 4, 2, "bits", block_m=32, dots=2)),
    (50, 40, 96, g.GemvConfig(32, 64, 4, 2, "bits", block_m=16, dots=4)),
    # the weight as the dot's left operand (swap): every batch class, tails in N and K
    (5, 70, 96, g.GemvConfig(64, 32, 4, 2, "bits", block_m=16, swap=True)),
    (29, 130, 160, g.GemvConfig(64, 32, 4, 2, "bits", block_m=32, swap=True)),
    (64, 100, 64, g.GemvConfig(32, 64, 8, 3, "bits", block_m=64, swap=True)),
    (100, 33, 32, None),
]


@DTYPES
@pytest.mark.parametrize("tiled", [False, True], ids=["rows", "tiled"])
@pytest.mark.parametrize("b,n,k,cfg", CASES, ids=[f"B{c[0]}-N{c[1]}-K{c[2]}" for c in CASES])
def test_matches_float64_within_bound(b, n, k, cfg, dtype, tiled):
    """Row-major and tiled weights (tile_weight with the config's tile, or TILE for the table's
    configs): the same bound over N and K tails, every batch class, split dots and chunking."""
    x, w, s = problem(b, n, k, seed=b * 1000 + n, dtype=dtype)
    wk = g.tile_weight(w, g.TILE if cfg is None else (cfg.block_n, cfg.block_k)) if tiled else w
    out = run(x, wk, s, cfg)
    assert out.dtype == dtype
    used = cfg or g.config_for(min(b, 64), DEV, dtype, tile=g.TILE if tiled else None)
    exact, bound = exact_and_bound(x, w, s, used.act)
    assert torch.isfinite(out).all(), "some outputs were never written"
    err = (out.double() - exact).abs()
    assert (err <= bound).all(), f"max err/bound {(err / bound).max():.3f}"
    # The bound is not vacuous: it sits far below the values themselves.
    assert bound.max() < 0.02 * exact.abs().max()


def test_fp16_keeps_its_extra_mantissa_bits():
    """The same problem in fp16 lands within fp16's own rounding of the exact value (2^-11 plus the
    fp32 sum), i.e. 16x tighter than bf16 allows: fp16 is not computed through bf16."""
    x, w, s = problem(13, 300, 512, seed=21, dtype=torch.float16)
    out = run(x, w, s)
    exact, bound = exact_and_bound(x, w, s)
    err = (out.double() - exact).abs()
    assert (err <= bound).all()
    assert ((out.double() - exact).norm() / exact.norm()).item() < 2.0**-10
    # through bf16 the relative error would be near 2^-9 on average; here most values are exact
    # roundings of the float64 result
    assert (out == exact.to(torch.float16)).float().mean() > 0.9


@DTYPES
def test_reference_within_same_bound(dtype):
    x, w, s = problem(5, 80, 272, seed=7, dtype=dtype)
    exact, bound = exact_and_bound(x, w, s)
    ref = g.int8_linear_reference(x, w, s)
    assert ref.dtype == dtype
    assert ((ref.double() - exact).abs() <= bound).all()


@DTYPES
def test_argmax_of_planted_winners(dtype):
    """Each batch row has one weight row aligned with it; the kernel must pick it."""
    b, n, k = 13, 257, 192
    x, w, s = problem(b, n, k, seed=3, dtype=dtype)
    targets = torch.randperm(n, generator=torch.Generator().manual_seed(4))[:b]
    for row, t in enumerate(targets):
        w[t] = torch.where(x[row] >= 0, 127, -127).to(torch.int8)
        s[t] = s.max()
    out = run(x, w, s)
    assert torch.equal(out.float().argmax(dim=1), targets)
    assert torch.equal(g.int8_linear_reference(x, w, s).float().argmax(dim=1), targets)


@DTYPES
def test_every_int8_code_dequantizes_exactly(dtype):
    """x = identity picks single weights: out[b, n] = q[n, b] * s[n] with s = 1 is exact."""
    k = 16
    w = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8).reshape(16, 16).repeat(2, 1)
    w[16:] = w[16:].T.contiguous()
    x = torch.eye(k, dtype=dtype)
    out = run(x, w, torch.ones(w.shape[0]))
    assert torch.equal(out.float(), w.T.float())


@DTYPES
def test_leading_dims_and_scale_layouts(dtype):
    x, w, s = problem(6, 48, 64, seed=11, scale_dtype=torch.float16, dtype=dtype)
    x3 = x.reshape(2, 3, 64)
    exact, bound = exact_and_bound(x, w, s)
    for scale in (s, s.reshape(-1, 1), s.reshape(1, -1)):
        out = g.int8_linear(x3, w, scale)
        assert out.shape == (2, 3, 48) and out.dtype == dtype
        assert ((out.reshape(6, 48).double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("bad,match", [
    (lambda x, w, s: (x, w[:, :40], s), "K="),
    (lambda x, w, s: (x[:, :40], w[:, :40].contiguous(), s), "multiple of 16"),
    (lambda x, w, s: (x.float(), w, s), "bfloat16 or float16, got torch.float32"),
    (lambda x, w, s: (x, w.to(torch.int16), s), "int8"),
    (lambda x, w, s: (x, w, s[:-1]), "one per output row"),
])
def test_rejects_bad_inputs(bad, match):
    x, w, s = problem(2, 24, 48, seed=1)
    with pytest.raises(ValueError, match=match):
        g.int8_linear(*bad(x, w, s))


def test_rejects_out_of_another_dtype_and_unknown_hints():
    x, w, s = problem(2, 24, 48, seed=1, dtype=torch.float16)
    with pytest.raises(ValueError, match="out must be a contiguous torch.float16"):
        g.int8_linear(x, w, s, out=torch.empty(2, 24, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="eviction priority"):
        g.int8_linear(x, w, s, config=g.GemvConfig(32, 32, 4, 2, "bits", o_evict="evict_sometimes"))


def test_tile_weight_layout():
    """tile_weight puts tile (i, j) at [i, j], zero-pads past N and K, and untile_weight undoes it."""
    w = torch.randint(-128, 128, (300, 272), dtype=torch.int8, generator=torch.Generator().manual_seed(9))
    t = g.tile_weight(w, (128, 64))
    assert t.shape == g.tiled_shape(300, 272, (128, 64)) == (3, 5, 128, 64) and t.is_contiguous()
    assert torch.equal(t[1, 2], w[128:256, 128:192])
    assert torch.equal(t[2, 4, :44, :16], w[256:, 256:]) and not t[2, 4, 44:].any() and not t[2, 4, :, 16:].any()
    assert torch.equal(g.untile_weight(t, 300, 272), w)
    assert g.tile_weight(w).shape == (3, 3, 128, 128)  # TILE by default
    with pytest.raises(ValueError, match="2-D int8"):
        g.tile_weight(w.float())


def test_tiled_weight_must_match_n_k_and_config():
    x, w, s = problem(4, 200, 96, seed=6)
    t = g.tile_weight(w, (64, 32))
    with pytest.raises(ValueError, match="does not hold"):
        g.int8_linear(x, t, s[:-70])  # N = 130 needs 3 row tiles, not 4
    with pytest.raises(ValueError, match="does not hold"):
        g.int8_linear(x[:, :64], t, s)  # K = 64 needs 2 column tiles, not 3
    with pytest.raises(ValueError, match="does not match the config"):
        g.int8_linear(x, t, s, config=g.GemvConfig(32, 32, 4, 2, "bits"))
    # a tile other than TILE runs with the table's config in that block shape
    assert g.config_for(4, torch.device("cpu"), tile=(64, 32)).block_n == 64


def test_no_store_diagnostic_writes_nothing():
    """The benchmark's "no_store" stage (the cost of the output write, by difference) computes and
    stores nothing: a NaN-poisoned output stays NaN; the full stage overwrites all of it."""
    x, w, s = problem(5, 130, 64, seed=8)
    cfg = g.config_for(5, DEV, tile=(64, 32))
    t = g.tile_weight(w, (64, 32)).to(DEV)
    out = torch.full((5, 130), float("nan"), dtype=x.dtype, device=DEV)
    g._launch(x.to(DEV), t, s.to(DEV), out, cfg, stage="no_store")
    assert out.isnan().all()
    g._launch(x.to(DEV), t, s.to(DEV), out, cfg)
    assert torch.isfinite(out).all()


def test_config_must_cover_the_batch():
    x, w, s = problem(20, 24, 48, seed=2)
    with pytest.raises(ValueError, match="covers 16 batch rows"):
        g.int8_linear(x, w, s, config=g.GemvConfig(32, 32, 4, 2, "bits", block_m=16))


def test_config_table_covers_every_batch_class():
    for dtype in (torch.bfloat16, torch.float16):
        for b in range(1, 65):
            for tile in (None, g.TILE):
                cfg = g.config_for(b, torch.device("cpu"), dtype, tile=tile)
                m, dots = cfg.rows(b)
                assert m * dots >= b
                assert cfg.dequant == "bits"  # neither PTX nor the interpreter's broken cast on CPU
                if tile:  # every tiled config reads the layout tile_weight writes
                    assert (cfg.block_n, cfg.block_k) == g.TILE
    assert [g.table_class(b) for b in (1, 8, 9, 16, 17, 32, 33, 64, 100)] == [8, 8, 16, 16, 32, 32, 64, 64, 64]
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        g.config_for(4, torch.device("cpu"), torch.float32)


def test_b9_to_16_class_is_the_b8_tiling():
    """The H200 A/B and probes (lab/kernel_history.md, "B = 9-16", "Tiles and the output") found no
    config faster than the <= 8 one at B = 9-16, for either layout: each table hands out that
    config; changing it needs a new measurement."""
    assert g._H200_TABLE[16] == g._H200_TABLE[8]
    assert g._H200_ROWS_TABLE[16] == g._H200_ROWS_TABLE[8]


@DTYPES
@pytest.mark.parametrize("b", [9, 12, 16])
def test_b9_to_16_config_within_bound(b, dtype):
    """The table's 9-16 config for the tiled weight as config_for hands it out ("bits" dequant
    here), with every eviction priority on the weight loads and the output stores, over N and K
    tails; and the row-major table's config on the untiled weight."""
    x, w, s = problem(b, 300, 784, seed=b, dtype=dtype)  # N: 2 tiles + tail; K: 6 tiles + tail
    exact, bound = exact_and_bound(x, w, s)
    t = g.tile_weight(w)
    cfg = g.config_for(b, DEV, dtype, tile=g.TILE)
    assert g.table_class(b) == 16 and (cfg.block_n, cfg.block_k) == g.TILE and cfg.o_evict == "evict_last"
    for we in g.EVICT_MODES:
        for oe in g.EVICT_MODES:
            out = run(x, t, s, g.dataclasses.replace(cfg, w_evict=we, o_evict=oe))
            assert ((out.double() - exact).abs() <= bound).all(), (we, oe)
    assert torch.equal(g.int8_linear(x.to(DEV), t.to(DEV), s.to(DEV)).cpu(), out)  # the default path
    rows_cfg = g.config_for(b, DEV, dtype)
    assert (rows_cfg.block_n, rows_cfg.block_k) == (128, 256)
    out = run(x, w, s, rows_cfg)
    assert ((out.double() - exact).abs() <= bound).all()


def _emulate_ptx(asm: str, word: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's dequant PTX on int64 32-bit words (one per element of ``word`` as $2); returns
    ($0, $1). Implements the PTX ISA semantics of the instructions it uses: xor/and/mov.b32,
    prmt.b32 (default mode: byte i of d is byte c[4i+2:4i] of {b, a}, a in bytes 0-3; c's bit
    4i+3 replicates that byte's sign) and sub.{bf16x2,f16x2} (two halves, round to nearest)."""
    regs = {"$2": word & 0xFFFFFFFF}

    def val(tok):
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        return torch.full_like(word, int(tok, 0))

    for line in asm.strip().strip("{}").splitlines():
        line = line.strip().rstrip(";")
        if not line or line.startswith((".reg", "{", "}")):
            continue
        op, args = line.split(None, 1)
        d, *src = [a.strip() for a in args.split(",")]
        a = [val(t) for t in src]
        if op == "xor.b32":
            r = a[0] ^ a[1]
        elif op == "and.b32":
            r = a[0] & a[1]
        elif op == "mov.b32":
            r = a[0]
        elif op == "prmt.b32":
            both = a[0] | (a[1] << 32)
            r = torch.zeros_like(word)
            for i in range(4):
                sel = (a[2] >> (4 * i)) & 0xF
                byte = (both >> (8 * (sel & 7))) & 0xFF
                byte = torch.where((sel & 8) != 0, torch.where(byte >= 0x80, 0xFF, 0), byte)
                r |= byte << (8 * i)
        elif op in ("sub.bf16x2", "sub.f16x2"):
            fdt = torch.bfloat16 if op == "sub.bf16x2" else torch.float16
            halves = []
            for sh in (0, 16):
                p, m = [((v >> sh) & 0xFFFF).to(torch.int32).to(torch.int16).view(fdt).double() for v in a]
                res = (p - m).to(fdt).view(torch.int16).to(torch.int64) & 0xFFFF
                halves.append(res << sh)
            r = halves[0] | halves[1]
        else:
            raise AssertionError(f"emulator does not know {op}")
        regs[d] = r & 0xFFFFFFFF
    return regs["$0"], regs["$1"]


@pytest.mark.parametrize("fdt", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_inline_ptx_dequant_decodes_every_code(fdt):
    """The "asm" dequant blocks, as written in the kernel source, emulated instruction by
    instruction: every int8 code in every byte of a register comes out exactly, in order
    (element 0 = low byte = low half of $0). The GPU runs the same text (gpu-marked tests);
    ptxas turns the fp16 block into LOP3 + 2 PRMT + 2 HADD2 per register (sm_90, triton 3.9)."""
    import inspect
    import re

    src = inspect.getsource(g._int8_gemv_kernel)
    blocks = {m.group(2): m.group(1) for m in re.finditer(r'asm="""(.*?)""".*?dtype=tl\.(\w+)', src, re.S)}
    assert sorted(blocks) == ["bfloat16", "float16"]
    asm = blocks[str(fdt).replace("torch.", "")]
    codes = torch.arange(256, dtype=torch.int64)
    bytes4 = torch.stack([(codes + 64 * i) % 256 for i in range(4)], dim=1)  # every code in every byte
    word = bytes4[:, 0] | (bytes4[:, 1] << 8) | (bytes4[:, 2] << 16) | (bytes4[:, 3] << 24)
    r0, r1 = _emulate_ptx(asm, word)
    got = torch.stack([(r >> sh) & 0xFFFF for r in (r0, r1) for sh in (0, 16)], dim=1)
    got = got.to(torch.int32).to(torch.int16).view(fdt).double()
    want = bytes4.to(torch.uint8).view(torch.int8).double()
    assert torch.equal(got, want)


def test_cpu_without_interpreter_uses_reference(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, w, s = problem(4, 24, 48, seed=5)
    assert not g.kernel_available(torch.device("cpu"))
    assert torch.equal(g.int8_linear(x, w, s), g.int8_linear_reference(x, w, s))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", g.DEQUANT_MODES)
def test_gpu_modes(monkeypatch, mode):
    if not ON_GPU:
        pytest.skip("needs a CUDA GPU and triton imported without TRITON_INTERPRET=1")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for dtype in (torch.bfloat16, torch.float16):
        if mode == "asm" and dtype == torch.bfloat16 and torch.cuda.get_device_capability() < (9, 0):
            continue  # sub.bf16x2 needs sm_90; sub.f16x2 runs everywhere
        for b in (1, 8, 13, 16, 32, 64):
            x, w, s = problem(b, 1000, 272, seed=b, dtype=dtype)
            exact, bound = exact_and_bound(x, w, s)
            for tile in (None, g.TILE):
                cfg = g.dataclasses.replace(g.config_for(b, torch.device("cuda"), dtype, tile=tile), dequant=mode)
                wd = (w if tile is None else g.tile_weight(w, tile)).cuda()
                out = run(x.cuda(), wd, s.cuda(), cfg).cpu()
                assert ((out.double() - exact).abs() <= bound).all(), (mode, dtype, b, tile)


def test_benchmark_script_smoke(tmp_path, monkeypatch):
    """The H200 benchmark runs end to end on the CPU interpreter (numbers meaningless)."""
    if not INTERPRETER_OK:
        pytest.skip(f"interpreter runs need triton >= 3.7, found {triton.__version__}")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    path = ROOT / "benchmarks" / "bench_lmhead_gemv.py"
    spec = importlib.util.spec_from_file_location("bench_lmhead_gemv", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_lmhead_gemv"] = bench
    spec.loader.exec_module(bench)
    out = tmp_path / "r.json"
    assert bench.main(["--cpu-smoke", "--n", "96", "--k", "64", "--batches", "1,13,40", "--sweep", "--ab",
                       "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [(r["dtype"], r["B"]) for r in res["table"]] == [(d, b) for d in ("bfloat16", "float16")
                                                            for b in (1, 13, 40)]
    assert all(r["check"]["within_bound"] and r["check"]["argmax_equal"] for r in res["table"])
    assert {o["dtype"] for o in res["odd_shapes"]} == {"bfloat16", "float16"}
    assert all(o["within_bound"] for o in res["odd_shapes"])
    # every sweep candidate (the B 9-16 ones included) ran and met the bound
    assert all("error" not in r and r["check"]["within_bound"] for r in res["sweep"])
    assert {r["B"] for r in res["sweep"]} == set(bench.SWEEP)
    assert [(r["dtype"], r["B"]) for r in res["ab_b16"]] == [(d, b) for d in ("bfloat16", "float16") for b in (1, 13)]
    assert all(r["control"]["ratio_to_control"] == 1.0 for r in res["ab_b16"])
    assert all(c["within_bound"] for r in res["ab_b16"] for c in r["checks_B16"].values())
    # the Gaussian head (the tool's own quantizer on Gaussian rows): every row reaches +-127, as
    # the absmax quantizer makes it, and the kernel meets the bound on it too
    w, s, _ = bench.make_problem(96, 64, torch.device("cpu"), "gaussian")
    assert torch.equal(w.abs().amax(dim=1), torch.full((96,), 127, dtype=torch.int8)) and w.float().std() < 64
    assert bench.main(["--cpu-smoke", "--n", "96", "--k", "64", "--batches", "40", "--dtypes", "bf16",
                       "--head", "gaussian", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["head"] == "gaussian" and [r["B"] for r in res["table"]] == [40]
    assert all(r["check"]["within_bound"] and r["check"]["argmax_equal"] for r in res["table"])


def test_swapped_config_runs_one_dot():
    with pytest.raises(ValueError, match="one dot"):
        g.GemvConfig(128, 128, 4, 3, block_m=16, dots=2, swap=True).rows(32)


def test_every_batch_class_compiles_for_gb10_within_its_shared_memory():
    """Every shipped config compiles for sm_121 (GB10: 99 KiB of shared memory per block)
    and for the H200's sm_90, with Triton's own compiler and the divisibility a real launch has;
    on sm_90 the B <= 64 class runs on wgmma. In a child: Triton imported in interpreter mode
    (this session) cannot compile."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compile_lmhead_gemv.py"), "--cc", "90", "121",
                           "--json"], capture_output=True, text=True, timeout=600,
                          env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert proc.returncode == 0, proc.stderr[-2000:] + proc.stdout[-2000:]
    rows = json.loads(proc.stdout)["rows"]
    assert {(r["cc"], r["class"], r["dtype"]) for r in rows} == {
        (cc, c, d) for cc in (90, 121) for c in g._H200_TABLE for d in ("bf16", "fp16")}
    for r in rows:
        assert 0 < r["shared_KiB"] <= r["limit_KiB"], r
        assert r["mma"] == ("mma.sync" if r["cc"] == 121 else r["mma"]), r  # no wgmma on sm_121
    assert {r["mma"] for r in rows if r["cc"] == 90 and r["class"] == 64} == {"wgmma"}


# act="i16": x on a per-row 16-bit grid, int8 dots (module docstring). (B, N, K, config, tiled):
# one and two weight tiles per program, x's rows on either side of the dot, one accumulator or
# split halves, per-thread copies or TMA descriptors (one tile), N and K tails, the row-major weight.
I16 = dict(act="i16", o_evict="evict_last")
I16_CASES = [
    (20, 300, 272, g.GemvConfig(128, 128, 4, 3, block_m=32, **I16), True),
    (33, 517, 256, g.GemvConfig(256, 128, 8, 3, block_m=64, swap=True, **I16), True),
    (5, 130, 208, g.GemvConfig(128, 128, 4, 3, block_m=16, split_acc=True, **I16), True),
    (64, 300, 384, g.GemvConfig(128, 128, 4, 3, block_m=64, tma=True, **I16), True),
    (31, 390, 272, g.GemvConfig(256, 128, 8, 3, block_m=32, split_acc=True, **I16), True),
    (40, 129, 128, g.GemvConfig(128, 128, 4, 3, block_m=64, tma=True, split_acc=True, swap=True, **I16), True),
    (18, 77, 48, g.GemvConfig(32, 32, 4, 2, block_m=32, **I16), False),
    (50, 45, 96, g.GemvConfig(64, 32, 4, 2, block_m=64, split_acc=True, **I16), False),
]


@DTYPES
@pytest.mark.parametrize("b,n,k,cfg,tiled", I16_CASES, ids=[f"B{c[0]}-N{c[1]}-K{c[2]}" for c in I16_CASES])
def test_i16_matches_float64_within_its_bound(b, n, k, cfg, tiled, dtype):
    x, w, s = problem(b, n, k, seed=7 * b + n, dtype=dtype)
    out = run(x, g.tile_weight(w) if tiled else w, s, cfg)
    exact, bound = exact_and_bound(x, w, s, "i16")
    err = (out.double() - exact).abs()
    assert torch.isfinite(out).all(), "some outputs were never written"
    assert (err <= bound).all(), f"max err/bound {(err / bound).max():.3f}"
    assert bound.max() < 0.02 * exact.abs().max()


@DTYPES
def test_i16_grid_error_shows_and_stays_within_its_term(dtype):
    """A row whose largest |x| is 4096 times its other entries puts those on a coarse grid: the
    kernel then differs from the exact value by more than the dequantizing form's whole bound,
    and stays within the i16 term (so the term is needed, and it holds). The fp32 and output
    rounding terms are kept small by a tiny weight scale on an exact x."""
    gen = torch.Generator().manual_seed(5)
    k, n = 256, 96
    x = (torch.randint(-255, 256, (3, k), generator=gen).double() / 256 + 1 / 512).to(dtype)
    x[:, 7] = 4096.0
    w = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    w[:, 7] = 0  # the outlier column alone would swamp the output's rounding
    s = torch.full((n,), 1e-3)
    cfg = g.GemvConfig(128, 128, 4, 3, block_m=32, **I16)
    out = run(x, g.tile_weight(w), s, cfg)
    exact, native_bound = exact_and_bound(x, w, s)
    _, bound = exact_and_bound(x, w, s, "i16")
    err = (out.double() - exact).abs()
    assert (err <= bound).all(), f"max err/bound {(err / bound).max():.3f}"
    assert (err > native_bound).any(), "the 16-bit grid left no trace: the test lost its edge"


def test_i16_error_bound_helper_is_the_derived_term():
    x, w, s = problem(9, 40, 96, seed=3)
    got = g.i16_error_bound(x, g.tile_weight(w), s).double()
    assert torch.allclose(got, i16_term(x, w, s), rtol=1e-5, atol=0)


@pytest.mark.parametrize("k", [96, 8208])
def test_i16_quantizer_halves_rebuild_the_rounded_grid(k):
    """The quantizer's bytes: q = 256 hi + lo with |hi| <= 127 and lo in [-128, 127], q within
    half a step (plus fp32 rounding) of x / t, t = max|x| / 32639 per row; rows past B untouched
    by the dot. K = 8208 runs the two-pass path (past one 8192-wide load)."""
    gen = torch.Generator().manual_seed(k)
    b, p = 5, 16
    x = (torch.randn(b, k, generator=gen) * 3).to(torch.bfloat16)
    x[2] = 0.0  # an all-zero row: t = 0, every q = 0
    xq = torch.empty((2 * p, k), dtype=torch.int8)
    t = torch.empty((p,), dtype=torch.float32)
    blk = min(8192, g._pow2_at_least(k))
    g._kernel(True, "quant_i16")[(b,)](x, xq, t, k, x.stride(0), BLOCK_P=p, BLOCK_K=blk, ONE_PASS=(k <= blk),
                                       I16=g.I16_MAX)
    hi, lo = xq[:b].int(), xq[p:p + b].int()
    q = 256 * hi + lo
    assert hi.abs().max() <= 127 and q.abs().max() <= g.I16_MAX
    amax = x.float().abs().amax(dim=1)
    assert torch.equal(t[:b], amax / g.I16_MAX)
    ok = amax > 0
    assert ((x.double()[ok] - q[ok].double() * t[:b][ok, None].double()).abs()
            <= 0.506 * t[:b][ok, None].double()).all()
    assert (q[~ok] == 0).all() and (q[ok].abs().amax(dim=1) == g.I16_MAX).all()


def test_i16_non_finite_row_gives_non_finite_logits_in_that_row_only():
    x, w, s = problem(20, 70, 128, seed=11)
    x[3, 5] = float("nan")
    x[7, 9] = float("inf")
    out = run(x, g.tile_weight(w), s, g.GemvConfig(128, 128, 4, 3, block_m=32, **I16))
    assert not torch.isfinite(out[3]).any() and not torch.isfinite(out[7]).any()
    rest = [i for i in range(20) if i not in (3, 7)]
    assert torch.isfinite(out[rest]).all()


def test_i16_config_rules():
    with pytest.raises(ValueError, match="need act='i16'"):
        g.GemvConfig(128, 128, 4, 3, tma=True).rows(8)
    with pytest.raises(ValueError, match="one dot"):
        g.GemvConfig(128, 128, 4, 3, block_m=32, dots=2, act="i16").rows(40)
    with pytest.raises(ValueError, match="unknown act"):
        g.GemvConfig(128, 128, 4, 3, act="i8").rows(8)
    with pytest.raises(ValueError, match="multiple of 32"):
        g.GemvConfig(64, 16, 4, 3, act="i16").rows(8)
    x, w, s = problem(20, 300, 256, seed=1)
    with pytest.raises(ValueError, match="does not match"):  # TMA: one whole tile per program
        g.int8_linear(x, g.tile_weight(w), s, config=g.GemvConfig(256, 128, 4, 3, block_m=32, act="i16", tma=True))
    with pytest.raises(ValueError, match="tiled weight"):
        g.int8_linear(x, w, s, config=g.GemvConfig(128, 128, 4, 3, block_m=32, act="i16", tma=True))
    with pytest.raises(ValueError, match="act='i16' runs stage"):
        g._launch(x, w, s, torch.empty(20, 300, dtype=x.dtype), g.GemvConfig(128, 128, 4, 3, block_m=32, act="i16"),
                  stage="no_dot")


def test_table_runs_the_int8_form_for_wide_batches_only():
    """The H200 table (docs/kernel.md "Results on the H200"): B <= 16 dequantizes, B = 17-64 runs act="i16"
    with TMA (dropped where the GPU has none: config_for)."""
    for b in range(1, 65):
        cfg = g._H200_TABLE[g.table_class(b)]
        assert (cfg.act == "i16") == (b > 16) and cfg.tma == (b > 16)
        assert cfg.rows(b)[0] >= b


def test_tma_only_where_the_gpu_and_triton_have_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 9))
    assert not g._tma_available(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    assert g._tma_available(torch.device("cuda"))
    monkeypatch.setattr(g.importlib.util, "find_spec", lambda name: None)
    assert not g._tma_available(torch.device("cuda"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_runtime_quantizer_is_the_build_quantizer_bit_for_bit(dtype):
    """The quantize-at-load head inside vLLM (``quantize_rows``, a copy: this module may import
    nothing else of hybrid_build) gives the codes and scales of the build's quantizer
    (``calibration.int8_rows.quantize_int8_rows``) bit for bit: Gaussian rows from 1e-6 to 1e3 in
    scale, heavy-tailed rows, an all-zero row, a row of fp32 subnormals (the scale's clamp), and
    ties at half a code (round half to even)."""
    from hybrid_build.calibration.int8_rows import quantize_int8_rows

    gen = torch.Generator().manual_seed(11)
    k = 96
    w = torch.randn(64, k, generator=gen) * torch.logspace(-6, 3, 64)[:, None]
    heavy = torch.randn(8, k, generator=gen) ** 3
    zero = torch.zeros(1, k)
    tiny = torch.full((1, k), 1e-40) * torch.randn(1, k, generator=gen).sign()
    ties = torch.tensor([127.0, -126.5, 2.5, -3.5, 0.5, -0.5, 1.5, 64.5] * (k // 8)).reshape(1, k)
    rows = torch.cat([w, heavy, zero, tiny if dtype == torch.float32 else zero, ties]).to(dtype)
    q_rt, s_rt = g.quantize_rows(rows)
    q_build, s_build = quantize_int8_rows(rows)
    assert q_rt.dtype == q_build.dtype == torch.int8 and s_rt.dtype == s_build.dtype == torch.float32
    assert torch.equal(q_rt, q_build) and torch.equal(s_rt.view(torch.int32), s_build.view(torch.int32))
    # the ties row: scale exactly 1, so the codes show the rounding rule
    assert q_rt[-1, :8].tolist() == [127, -126, 2, -4, 0, 0, 2, 64]
