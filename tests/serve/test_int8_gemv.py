"""The int8 lm-head GEMV kernel (serve/int8_gemv.py) under Triton's CPU interpreter.

Every check compares against float64 arithmetic with a bound derived from how the kernel
rounds: products x_k * q_k are exact in fp32 (8 + 8 significant bits), the K-term fp32 sum
and the scale multiply add at most gamma(K + 2) * S with S = s_n * sum_k |x_k q_k|
(gamma(n) = n u / (1 - n u), u = 2^-24; doubled for hardware MMAs that truncate), and the
final bf16 rounding adds less than 2^-7 of the value: one bf16 ulp, because the interpreter
(triton 3.9) converts fp32 to bf16 by truncation where the GPU rounds to nearest (2^-8).
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
# The interpreter paths are verified with triton 3.9; 3.6's interpreter cannot iterate over a
# runtime loop bound (seen on the GPU machine), so interpreter runs need a newer one.
INTERPRETER_OK = tuple(int(p) for p in triton.__version__.split(".")[:2]) >= (3, 9)

from hybrid_build.serve import int8_gemv as g  # noqa: E402

U32 = 2.0**-24
U_BF16 = 2.0**-7
ROOT = Path(__file__).resolve().parents[2]


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
            pytest.skip(f"interpreter runs need triton >= 3.9, found {triton.__version__}")
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def exact_and_bound(x, w, s):
    """float64 value of s_n * sum_k x_k q_k, and the per-element bound on the kernel's error."""
    x64, w64, s64 = x.double(), w.double(), s.double().reshape(-1)
    exact = (x64 @ w64.T) * s64
    mag = (x64.abs() @ w64.abs().T) * s64.abs()
    k = x.shape[-1]
    gamma = 2 * (k + 2) * U32 / (1 - 2 * (k + 2) * U32)
    fp32_err = gamma * mag
    return exact, U_BF16 * (exact.abs() + fp32_err) + fp32_err


def problem(b, n, k, seed, scale_dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(b, k, generator=gen) * 2).to(torch.bfloat16)
    w = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    s = ((torch.rand(n, generator=gen) + 0.1) * 0.02).to(scale_dtype)
    return x, w, s


def run(x, w, s, cfg=None):
    """Kernel output on DEV (poisoned with NaN first), back on the CPU."""
    out = torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=torch.bfloat16, device=DEV)
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
    (100, 33, 32, None),
]


@pytest.mark.parametrize("b,n,k,cfg", CASES, ids=[f"B{c[0]}-N{c[1]}-K{c[2]}" for c in CASES])
def test_matches_float64_within_bound(b, n, k, cfg):
    x, w, s = problem(b, n, k, seed=b * 1000 + n)
    out = run(x, w, s, cfg)
    exact, bound = exact_and_bound(x, w, s)
    assert torch.isfinite(out).all(), "some outputs were never written"
    err = (out.double() - exact).abs()
    assert (err <= bound).all(), f"max err/bound {(err / bound).max():.3f}"
    # The bound is not vacuous: it sits far below the values themselves.
    assert bound.max() < 0.02 * exact.abs().max()


def test_reference_within_same_bound():
    x, w, s = problem(5, 80, 272, seed=7)
    exact, bound = exact_and_bound(x, w, s)
    ref = g.int8_linear_reference(x, w, s)
    assert ref.dtype == torch.bfloat16
    assert ((ref.double() - exact).abs() <= bound).all()


def test_argmax_of_planted_winners():
    """Each batch row has one weight row aligned with it; the kernel must pick it."""
    b, n, k = 13, 257, 192
    x, w, s = problem(b, n, k, seed=3)
    targets = torch.randperm(n, generator=torch.Generator().manual_seed(4))[:b]
    for row, t in enumerate(targets):
        w[t] = torch.where(x[row] >= 0, 127, -127).to(torch.int8)
        s[t] = s.max()
    out = run(x, w, s)
    assert torch.equal(out.float().argmax(dim=1), targets)
    assert torch.equal(g.int8_linear_reference(x, w, s).float().argmax(dim=1), targets)


def test_every_int8_code_dequantizes_exactly():
    """x = identity picks single weights: out[b, n] = q[n, b] * s[n] with s = 1 is exact."""
    k = 16
    w = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8).reshape(16, 16).repeat(2, 1)
    w[16:] = w[16:].T.contiguous()
    x = torch.eye(k, dtype=torch.bfloat16)
    out = run(x, w, torch.ones(w.shape[0]))
    assert torch.equal(out.float(), w.T.float())


def test_leading_dims_and_scale_layouts():
    x, w, s = problem(6, 48, 64, seed=11, scale_dtype=torch.float16)
    x3 = x.reshape(2, 3, 64)
    exact, bound = exact_and_bound(x, w, s)
    for scale in (s, s.reshape(-1, 1), s.reshape(1, -1)):
        out = g.int8_linear(x3, w, scale)
        assert out.shape == (2, 3, 48)
        assert ((out.reshape(6, 48).double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("bad,match", [
    (lambda x, w, s: (x, w[:, :40], s), "K="),
    (lambda x, w, s: (x[:, :40], w[:, :40].contiguous(), s), "multiple of 16"),
    (lambda x, w, s: (x.float(), w, s), "bfloat16"),
    (lambda x, w, s: (x, w.to(torch.int16), s), "int8"),
    (lambda x, w, s: (x, w, s[:-1]), "one per output row"),
])
def test_rejects_bad_inputs(bad, match):
    x, w, s = problem(2, 24, 48, seed=1)
    with pytest.raises(ValueError, match=match):
        g.int8_linear(*bad(x, w, s))


def test_config_must_cover_the_batch():
    x, w, s = problem(20, 24, 48, seed=2)
    with pytest.raises(ValueError, match="covers 16 batch rows"):
        g.int8_linear(x, w, s, config=g.GemvConfig(32, 32, 4, 2, "bits", block_m=16))


def test_config_table_covers_every_batch_class():
    for b in range(1, 65):
        cfg = g.config_for(b, torch.device("cpu"))
        m, dots = cfg.rows(b)
        assert m * dots >= b
        assert cfg.dequant == "bits"  # neither PTX nor the interpreter's broken cast on CPU


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
    if mode == "asm" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("inline PTX dequant needs sm_90")
    for b in (1, 13, 32, 64):
        x, w, s = problem(b, 1000, 272, seed=b)
        cfg = g.dataclasses.replace(g.config_for(b, torch.device("cuda")), dequant=mode)
        out = run(x.cuda(), w.cuda(), s.cuda(), cfg).cpu()
        exact, bound = exact_and_bound(x, w, s)
        assert ((out.double() - exact).abs() <= bound).all()


def test_benchmark_script_smoke(tmp_path, monkeypatch):
    """The H200 benchmark runs end to end on the CPU interpreter (numbers meaningless)."""
    if not INTERPRETER_OK:
        pytest.skip(f"interpreter runs need triton >= 3.9, found {triton.__version__}")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    path = ROOT / "benchmarks" / "bench_lmhead_gemv.py"
    spec = importlib.util.spec_from_file_location("bench_lmhead_gemv", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_lmhead_gemv"] = bench
    spec.loader.exec_module(bench)
    out = tmp_path / "r.json"
    assert bench.main(["--cpu-smoke", "--n", "96", "--k", "64", "--batches", "1,13,40", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [r["B"] for r in res["table"]] == [1, 13, 40]
    assert all(r["check"]["within_bound"] and r["check"]["argmax_equal"] for r in res["table"])
    assert all(o["within_bound"] for o in res["odd_shapes"])
