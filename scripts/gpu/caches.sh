#!/usr/bin/env bash
# Run THERE. The compile caches a vLLM start fills, carried from one machine to the next so that a
# later start skips the compiling (docs/gpu.md):
#   bash scripts/gpu/caches.sh save $OUT      # at the end of a call: compile-cache.tar.xz.partNN (<= 15 MB each)
#   bash scripts/gpu/caches.sh restore DIR    # run.sh, when a carried DIR holds those parts
# What vLLM 0.26.0 writes: Triton's kernels (~/.triton, TRITON_CACHE_DIR's default, for kernels compiled
# outside torch.compile: eager mode, the GDN / FLA kernels); ~/.cache/vllm (VLLM_CACHE_ROOT:
# torch_compile_cache/<hash>/ with its own inductor_cache/ and triton_cache/, which vLLM points
# TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR at once compiling starts; deep_gemm/, DeepGEMM's JIT;
# modelinfos/); and torch inductor's default /tmp/torchinductor_$USER (anything compiled before).
set -euo pipefail
what=${1:-}; dir=${2:-}
[ -n "$what" ] && [ -n "$dir" ] || { echo "usage: caches.sh save OUTDIR | restore DIR" >&2; exit 2; }
case "$what" in
  save)
    paths=()
    for p in "$HOME/.triton" "$HOME/.cache/vllm" "/tmp/torchinductor_$(id -un)"; do [ -d "$p" ] && paths+=("${p#/}"); done
    [ ${#paths[@]} -gt 0 ] || { echo "no compile caches here"; exit 0; }
    mkdir -p "$dir"; rm -f "$dir"/compile-cache.tar.xz.part*
    tar -C / -cf - "${paths[@]}" | xz -T0 -3 | split -b 15000000 -d - "$dir/compile-cache.tar.xz.part"
    du -sh "${paths[@]/#//}" 2>/dev/null || true
    ls -l "$dir"/compile-cache.tar.xz.part* ;;
  restore)
    ls "$dir"/compile-cache.tar.xz.part* >/dev/null 2>&1 || { echo "no compile-cache parts in $dir" >&2; exit 2; }
    [ -f "$HOME/.compile-cache-restored" ] && { echo "compile caches already restored"; exit 0; }
    cat "$dir"/compile-cache.tar.xz.part* | xz -dc | tar -C / -xf -
    touch "$HOME/.compile-cache-restored"; echo "compile caches restored from $dir" ;;
  *) echo "usage: caches.sh save OUTDIR | restore DIR" >&2; exit 2 ;;
esac
