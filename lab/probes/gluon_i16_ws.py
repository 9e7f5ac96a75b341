"""A warp-specialized candidate for the head kernel's act="i16" form at B = 33-64,
written in Gluon (Triton's explicit-layout dialect, triton 3.6's API). Measured, NOT shipped:
its best variant (two tiles per unit, 4 stages, persistent) ran at 82-85 % of the H200's read
ceiling, 2-4 % faster than the shipped Triton form and short of 88 % (lab/kernel_history.md "A
warp-specialized kernel in Gluon"). `bench_gluon.py` checks every variant against
the reference with the i16 bound and times it; `probe_gluon_mma.py` drops its dots to see where
the time goes. It compiles on the CPU here:

    python lab/probes/gluon_i16_ws.py --compile [--stages 4] [--halves 2]   # triton 3.6 or 3.9, sm_90

The idea: in Triton's software pipeline the next TMA loads are issued only as the previous wgmma
group retires; here one loader warp owns the loads and runs ahead on a ring of STAGES
shared-memory slots, each guarded by two mbarriers ("ready": the slot's bytes landed; "empty":
every consumer has finished reading it), while the consumer warp groups only wait, issue wgmma
and retire it one step behind.

Per tile: 128 weight rows ([N / 128, K / 128, 128, 128], tile_weight's layout, read through a
descriptor over its [-1, 128] view) against x's high and low halves (P = 64 rows each, the
quantizer of serve/runtime/int8_gemv.py), two accumulators, the epilogue (256 hi + lo) t_b s_n as in
the Triton form, run by its consumer while the loader already fills the ring for the next tile.
"""
from __future__ import annotations

import argparse
import sys

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

TILE_N, BLOCK_K = 128, 128
# The second consumer warp group's registers (HALVES = 2): two [64, 128] int32 accumulators are
# 128 per thread; the rest is the epilogue's.
CONSUMER_REGS = gl.constexpr(232)
# The TMA load's name: triton 3.6 `async_copy_global_to_shared`, 3.9 `async_load` (the old name raises).
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@gluon.jit
def _tile_range(N, TILE_N: gl.constexpr):
    """This program's weight tiles: a contiguous run [lo, hi), the runs of all programs as even as
    whole tiles allow (so a unit of two tiles never leaves a whole wave of SMs idle at the end)."""
    tiles = gl.cdiv(N, TILE_N)
    pid = gl.program_id(0)
    grid = gl.num_programs(0)
    return pid * tiles // grid, (pid + 1) * tiles // grid


@gluon.jit
def _loader(x_desc, w_desc, xh_bufs, xl_bufs, w_bufs, ready, empty, N, K,
            BLOCK_P: gl.constexpr, BLOCK_K: gl.constexpr, TILE_N: gl.constexpr, STAGES: gl.constexpr,
            HALVES: gl.constexpr):
    x_bytes: gl.constexpr = 2 * BLOCK_P * BLOCK_K
    w_bytes: gl.constexpr = TILE_N * BLOCK_K
    kt = gl.cdiv(K, BLOCK_K)
    lo, hi = _tile_range(N, TILE_N)
    c = 0  # steps issued by this program, over all its units: slot c % STAGES, lap c // STAGES
    for first in range(lo, hi, HALVES):
        n_w = gl.minimum(hi - first, HALVES)  # the last unit of an odd run has one tile
        for i in range(kt):
            s = c % STAGES
            # a fresh "empty" barrier counts as released for the first lap (parity 1)
            mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)
            for h in gl.static_range(1, HALVES + 1):  # the byte count is a constant: one expect per case
                mbarrier.expect(ready.index(s), x_bytes + h * w_bytes, pred=n_w == h)
            _tma_load(x_desc, [0, i * BLOCK_K], ready.index(s), xh_bufs.index(s))
            _tma_load(x_desc, [BLOCK_P, i * BLOCK_K], ready.index(s), xl_bufs.index(s))
            for h in gl.static_range(HALVES):
                _tma_load(w_desc, [((first + h) * kt + i) * TILE_N, 0], ready.index(s),
                          w_bufs.index(s * HALVES + h), pred=h < n_w)
            c += 1


@gluon.jit
def _mma_epilogue(xh_bufs, xl_bufs, w_bufs, ready, empty, t_ptr, s_ptr, o_ptr, B, N, K, stride_ob,
                  BLOCK_P: gl.constexpr, BLOCK_K: gl.constexpr, TILE_N: gl.constexpr, STAGES: gl.constexpr,
                  ACC_LAYOUT: gl.constexpr, OUT_LAYOUT: gl.constexpr, HALF: gl.constexpr, HALVES: gl.constexpr,
                  MMA: gl.constexpr):
    kt = gl.cdiv(K, BLOCK_K)
    offs_b = gl.arange(0, BLOCK_P, layout=gl.SliceLayout(1, OUT_LAYOUT))
    b_ok = offs_b < B
    t = gl.load(t_ptr + offs_b, mask=b_ok, other=0.0)
    lo, hi = _tile_range(N, TILE_N)
    c = 0
    for tile in range(lo + HALF, hi, HALVES):
        acc_hi = gl.zeros([BLOCK_P, TILE_N], gl.int32, layout=ACC_LAYOUT)
        acc_lo = gl.zeros([BLOCK_P, TILE_N], gl.int32, layout=ACC_LAYOUT)
        for i in range(kt):
            s = c % STAGES
            mbarrier.wait(ready.index(s), (c // STAGES) & 1)
            w_t = w_bufs.index(s * HALVES + HALF).permute((1, 0))
            if MMA == 2:
                acc_hi = warpgroup_mma(xh_bufs.index(s), w_t, acc_hi, is_async=True)
                acc_lo = warpgroup_mma(xl_bufs.index(s), w_t, acc_lo, is_async=True)
                # keep this step's pair in flight; the previous step's pair is done: free its slot
                acc_hi, acc_lo = warpgroup_mma_wait(num_outstanding=2, deps=[acc_hi, acc_lo])
            elif MMA == 1:  # probe only (wrong numbers): half the tensor-core work
                acc_hi = warpgroup_mma(xh_bufs.index(s), w_t, acc_hi, is_async=True)
                acc_hi = warpgroup_mma_wait(num_outstanding=1, deps=[acc_hi])
            mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES), pred=c > 0)
            c += 1
        if MMA == 2:
            acc_hi, acc_lo = warpgroup_mma_wait(num_outstanding=0, deps=[acc_hi, acc_lo])
        elif MMA == 1:
            acc_hi = warpgroup_mma_wait(num_outstanding=0, deps=[acc_hi])
        # the epilogue of this tile runs while the loader fills the ring for the next one
        hi_f = gl.convert_layout(acc_hi, OUT_LAYOUT).to(gl.float32)
        lo_f = gl.convert_layout(acc_lo, OUT_LAYOUT).to(gl.float32)
        offs_n = tile * TILE_N + gl.arange(0, TILE_N, layout=gl.SliceLayout(0, OUT_LAYOUT))
        n_ok = offs_n < N
        s_n = gl.load(s_ptr + offs_n, mask=n_ok, other=0.0).to(gl.float32)
        val = (hi_f * 256.0 + lo_f) * t[:, None] * s_n[None, :]
        o_ptrs = o_ptr + offs_b[:, None] * stride_ob + offs_n[None, :]
        gl.store(o_ptrs, val.to(o_ptr.dtype.element_ty), mask=b_ok[:, None] & n_ok[None, :])
    # An odd run's last unit has no tile for the second consumer: it still frees each slot the
    # loader fills for that unit (after the slot is filled, so the arrival counts for its lap).
    n_units = gl.cdiv(hi - lo, HALVES)
    for _ in range((hi - lo - HALF + HALVES - 1) // HALVES, n_units):
        for i in range(kt):
            s = c % STAGES
            mbarrier.wait(ready.index(s), (c // STAGES) & 1)
            mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES), pred=c > 0)
            c += 1


@gluon.jit
def gluon_i16_ws_kernel(x_desc, t_ptr, w_desc, s_ptr, o_ptr, B, N, K, stride_ob,
                        BLOCK_P: gl.constexpr, BLOCK_K: gl.constexpr, TILE_N: gl.constexpr,
                        STAGES: gl.constexpr, HALVES: gl.constexpr, num_warps: gl.constexpr, MMA: gl.constexpr = 2):
    """Each program takes a contiguous run of the weight's 128-row tiles (`_tile_range`), in units
    of HALVES tiles: one unit each with a grid of ceil(tiles / HALVES), several (persistent) with
    a smaller grid. With
    HALVES = 2 a second consumer warp group takes the unit's second tile, so each x slot loaded
    from L2 serves 256 weight rows (half of x's L2 reads per weight byte)."""
    xh_bufs = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_P, BLOCK_K], x_desc.layout)
    xl_bufs = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_P, BLOCK_K], x_desc.layout)
    w_bufs = gl.allocate_shared_memory(gl.int8, [STAGES * HALVES, TILE_N, BLOCK_K], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=HALVES)  # each consumer frees the slot
    fence_async_shared()

    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, TILE_N, 32])
    out_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    if HALVES == 1:
        gl.warp_specialize([
            (_mma_epilogue, (xh_bufs, xl_bufs, w_bufs, ready, empty, t_ptr, s_ptr, o_ptr, B, N, K, stride_ob,
                             BLOCK_P, BLOCK_K, TILE_N, STAGES, acc_layout, out_layout, 0, 1, MMA)),
            (_loader, (x_desc, w_desc, xh_bufs, xl_bufs, w_bufs, ready, empty, N, K, BLOCK_P, BLOCK_K, TILE_N,
                       STAGES, 1)),
        ], [1], [24])
    else:
        gl.warp_specialize([
            (_mma_epilogue, (xh_bufs, xl_bufs, w_bufs, ready, empty, t_ptr, s_ptr, o_ptr, B, N, K, stride_ob,
                             BLOCK_P, BLOCK_K, TILE_N, STAGES, acc_layout, out_layout, 0, 2, MMA)),
            (_mma_epilogue, (xh_bufs, xl_bufs, w_bufs, ready, empty, t_ptr, s_ptr, o_ptr, B, N, K, stride_ob,
                             BLOCK_P, BLOCK_K, TILE_N, STAGES, acc_layout, out_layout, 1, 2, MMA)),
            (_loader, (x_desc, w_desc, xh_bufs, xl_bufs, w_bufs, ready, empty, N, K, BLOCK_P, BLOCK_K, TILE_N,
                       STAGES, 2)),
        ], [num_warps, 1], [CONSUMER_REGS, 24])


def shared_layouts(block_p: int = 64):
    """The NVMMA shared layouts of x's half-tile [P, 128] and the weight tile [128, 128] (int8)."""
    return (gl.NVMMASharedLayout.get_default_for([block_p, BLOCK_K], gl.int8),
            gl.NVMMASharedLayout.get_default_for([TILE_N, BLOCK_K], gl.int8))


def make_call(g, x, w_tiled, s, out, stages: int = 3, persistent: bool = False, halves: int = 1, mma: int = 2):
    """A zero-argument call computing ``out = x @ (w * s).T`` (B <= 64): x's quantizer from
    ``g`` (serve/runtime/int8_gemv.py, the module) then this kernel, descriptors built once here; with
    ``persistent`` one program per SM walks the units; ``halves`` weight tiles per unit; ``mma``
    below 2 is a probe that drops the low half's (1) or every (0) tensor-core dot: wrong numbers."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    batch, k = x.shape
    block_p = 64
    cfg = g.GemvConfig(TILE_N, BLOCK_K, 4, 3, block_m=block_p, act="i16")
    xq, t, _ = g._i16_workspace(x.device, block_p, k, BLOCK_K, False, False)
    x_layout, w_layout = shared_layouts(block_p)
    x_desc = TensorDescriptor.from_tensor(xq, [block_p, BLOCK_K], x_layout)
    w_desc = TensorDescriptor.from_tensor(w_tiled.view(-1, w_tiled.shape[3]), [TILE_N, BLOCK_K], w_layout)
    n = s.numel()
    units = -(-n // (TILE_N * halves))
    grid = (min(units, torch.cuda.get_device_properties(x.device).multi_processor_count) if persistent else units,)

    def call():
        g._launch_i16(x, w_tiled, s, out, cfg, block_p, stage="quant_only")
        gluon_i16_ws_kernel[grid](x_desc, t, w_desc, s, out, batch, n, k, out.stride(0), BLOCK_P=block_p,
                                  BLOCK_K=BLOCK_K, TILE_N=TILE_N, STAGES=stages, HALVES=halves, num_warps=4, MMA=mma)

    return call


def compile_for(cc: int = 90, block_p: int = 64, stages: int = 3, halves: int = 1, mma: int = 2):
    """Triton's compiled kernel for compute capability ``cc`` without a GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    x_layout, w_layout = shared_layouts(block_p)
    sig = {"x_desc": f"tensordesc<i8[{block_p},{BLOCK_K}],{x_layout!r}>", "t_ptr": "*fp32",
           "w_desc": f"tensordesc<i8[{TILE_N},{BLOCK_K}],{w_layout!r}>", "s_ptr": "*fp32", "o_ptr": "*bf16",
           "B": "i32", "N": "i32", "K": "i32", "stride_ob": "i32"}
    const = dict(BLOCK_P=block_p, BLOCK_K=BLOCK_K, TILE_N=TILE_N, STAGES=stages, HALVES=halves, num_warps=4, MMA=mma)
    sig.update({name: "constexpr" for name in const})
    src = GluonASTSource(gluon_i16_ws_kernel, sig, constexprs=const,
                         attrs={(i,): [["tt.divisibility", 16]] for i in (1, 3, 4, 7, 8)})
    return triton.compile(src, target=GPUTarget("cuda", cc, 32), options=dict(num_warps=4))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compile", action="store_true", help="compile for --cc on this machine (no GPU needed)")
    ap.add_argument("--cc", type=int, default=90)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--halves", type=int, default=1, choices=(1, 2), help="weight tiles per unit (consumer warp groups)")
    args = ap.parse_args(argv)
    if not args.compile:
        ap.print_help()
        return 2
    k = compile_for(args.cc, stages=args.stages, halves=args.halves)
    ptx = k.asm["ptx"]
    print(f"sm_{args.cc}: {k.metadata.shared / 1024:.1f} KiB shared, wgmma {'wgmma.mma_async' in ptx}, "
          f"TMA {'cp.async.bulk.tensor' in ptx}, mbarrier {'mbarrier' in ptx}, spills {'.local' in ptx}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
