"""Compile the int8 lm-head kernel's shipped configs for a GPU that is not here, and report what
each needs: shared memory per block and which tensor-core instructions it uses.

Triton compiles for any NVIDIA target without a GPU (its bundled ptxas); the pipeliner only
makes asynchronous, multi-stage copies when it knows the pointers and strides are 16-byte
aligned, which a real launch tells it, so the compile here passes the same divisibility hints.
GB10 (sm_121) has 99 KiB of shared memory per block; the H200 (sm_90) 227 KiB.

    python benchmarks/compile_lmhead_gemv.py --cc 90 121 [--json]

Exit status 1 when a config needs more shared memory than its target has.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from pathlib import Path

# Shared memory per block, KiB (CUDA programming guide, compute capabilities table).
SMEM_LIMIT_KIB = {80: 163, 86: 99, 89: 99, 90: 227, 100: 227, 120: 99, 121: 99}


def _load_gemv():
    """serve/runtime/int8_gemv.py as the benchmark loads it, with Triton imported compile-capable."""
    os.environ.pop("TRITON_INTERPRET", None)  # must be off before Triton is first imported
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_lmhead_gemv import g

    return g


def compile_config(g, cfg, batch: int, cc: int, x_dtype: str):
    """Triton's compiled kernel for ``cfg`` at ``batch`` rows of ``x_dtype`` ("bf16"/"fp16") on
    compute capability ``cc``, tiled weight, K a multiple of the tile (what the head serves)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    m, dots = cfg.rows(batch)
    if cfg.act == "i16":
        return _compile_i16(g, cfg, m, cc)
    sig = {"x_ptr": "*" + x_dtype, "w_ptr": "*i8", "s_ptr": "*fp32", "o_ptr": "*" + x_dtype, "B": "i32",
           "N": "i32", "K": "i32", "stride_xb": "i32", "stride_ob": "i32"}
    const = dict(BLOCK_H=m, N_DOTS=dots, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                 DEQUANT=g._DEQUANT_CODE[cfg.dequant], EVEN_K=True, STAGE=0, DOT_F32=False,
                 X_F16=(x_dtype == "fp16"), W_EVICT=cfg.w_evict, W_TILED=True, O_EVICT=cfg.o_evict, SWAP=cfg.swap)
    sig.update({name: "constexpr" for name in const})
    # pointers, K and the two strides 16-byte divisible, as a launch on the head's tensors specializes
    aligned = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 6, 7, 8)}
    src = ASTSource(g._kernel(False), sig, constexprs=const, attrs=aligned)
    return triton.compile(src, target=GPUTarget("cuda", cc, 32),
                          options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))


def _compile_i16(g, cfg, block_p: int, cc: int):
    """The int8 dot kernel of an act="i16" config (x's quantizer is a one-row loop that needs no
    shared memory to speak of), tiled 128 x 128 weight."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    q_t, w_t = "*i8", "*i8"
    if cfg.tma:  # tensor descriptors: x's rows per load, one weight tile per load
        q_t = f"tensordesc<i8[{block_p if cfg.split_acc else 2 * block_p},{cfg.block_k}]>"
        w_t = f"tensordesc<i8[{g.TILE[0]},{cfg.block_k}]>"
    sig = {"q_ptr": q_t, "t_ptr": "*fp32", "w_ptr": w_t, "s_ptr": "*fp32", "o_ptr": "*bf16", "B": "i32",
           "N": "i32", "K": "i32", "stride_ob": "i32"}
    const = dict(BLOCK_P=block_p, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, TILE_N=g.TILE[0], EVEN_K=True,
                 W_TILED=True, SWAP=cfg.swap, W_EVICT=cfg.w_evict, O_EVICT=cfg.o_evict, TMA=cfg.tma,
                 SPLIT=cfg.split_acc)
    sig.update({name: "constexpr" for name in const})
    aligned = {(i,): [["tt.divisibility", 16]] for i in (1, 3, 4, 7, 8) + (() if cfg.tma else (0, 2))}
    src = ASTSource(g._kernel(False, "i16"), sig, constexprs=const, attrs=aligned)
    target = GPUTarget("cuda", cc, 32)
    # x's quantizer (one row per program, the head's K in one load): compiled too, never timed here
    qsig = {"x_ptr": "*bf16", "q_ptr": "*i8", "t_ptr": "*fp32", "K": "i32", "stride_xb": "i32"}
    qconst = dict(BLOCK_P=block_p, BLOCK_K=4096, ONE_PASS=True, I16=g.I16_MAX)
    qsig.update({name: "constexpr" for name in qconst})
    triton.compile(ASTSource(g._kernel(False, "quant_i16"), qsig, constexprs=qconst), target=target,
                   options=dict(num_warps=4))
    return triton.compile(src, target=target, options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))


def mma_kind(kernel) -> str:
    """"wgmma" or "mma.sync" (or "none"), read from the PTX."""
    ptx = kernel.asm["ptx"]
    if re.search(r"\bwgmma\.mma_async", ptx):
        return "wgmma"
    return "mma.sync" if re.search(r"\bmma\.sync", ptx) else "none"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cc", type=int, nargs="+", default=[90, 121], help="compute capabilities (90 = H200, 121 = GB10)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    g = _load_gemv()
    import triton

    rows, over = [], 0
    for cc in args.cc:
        limit = SMEM_LIMIT_KIB.get(cc)
        for cls in sorted(g._H200_TABLE):
            for x_dtype in ("bf16", "fp16"):
                cfg = g._H200_TABLE[cls]
                if x_dtype == "bf16" and cc < 90:  # config_for's choice: no sub.bf16x2 before sm_90
                    cfg = dataclasses.replace(cfg, dequant="cvt")
                k = compile_config(g, cfg, cls, cc, x_dtype)
                kib = k.metadata.shared / 1024
                ok = limit is None or kib <= limit
                over += not ok
                rows.append({"cc": cc, "class": cls, "dtype": x_dtype, "config": cfg.as_dict(), "shared_KiB": kib,
                             "limit_KiB": limit, "fits": ok, "mma": mma_kind(k)})
    doc = {"triton": triton.__version__, "rows": rows}
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        print(f"triton {triton.__version__}")
        for r in rows:
            print(f"sm_{r['cc']} B<={r['class']:<3d} {r['dtype']}  {r['shared_KiB']:6.1f} KiB of {r['limit_KiB']} "
                  f"({'fits' if r['fits'] else 'OVER'})  {r['mma']}")
    return 1 if over else 0


if __name__ == "__main__":
    raise SystemExit(main())
