#!/usr/bin/env bash
# Run THERE (the H200 machine), from the repository root, once every .gpuN folder has been
# assembled (see docs/gpu.md): installs the hybrid-build wheel beside vLLM, puts `vllm` and
# `hybrid-build` on PATH and runs scripts/gpu/driver.py, which writes results.json and logs to $OUT.
#   bash scripts/gpu/run.sh --deadline UNIX_TIME [--steps build,correct,profiles,graphs,eager] [--layers N]
#   bash scripts/gpu/run.sh --deadline UNIX_TIME --floor $HOME/floor --steps warm,vcompare,floor,mix,eagerprof
#   bash scripts/gpu/run.sh --deadline UNIX_TIME --steps ab_start,ab_bench   (then ab_eval,ab_stop: the servers stay up)
#   bash scripts/gpu/run.sh --deadline UNIX_TIME --floor $HOME/floor --steps starts,ttft,tools --agent-cases dense:mixed:on
#     (the 122B at full depth with the real drafter's shape: agent_steps.py, docs/gpu.md)
#   bash scripts/gpu/run.sh --deadline UNIX_TIME --floor $HOME/floor --steps up,warm_ttft,accept --graphs --agent-cases dflash:mixed:on
#     (one server kept up across calls: lease_steps.py)
# VLLM_TRITON_FORCE_FIRST_CONFIG=1 skips Triton autotuning (the linear-attention prefill kernels
# otherwise compile every candidate config on a cold cache: minutes per engine); set it to 0 to tune.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)  # the driver beside this script (a carried copy runs its own)
# the compile caches of an earlier machine (caches.sh save), carried in .gpucache
if ls .gpucache/compile-cache.tar.xz.part* >/dev/null 2>&1; then
  bash "$here/caches.sh" restore .gpucache || echo "run.sh: the carried compile caches could not be restored; going on cold" >&2
fi
# the tiny artifacts travel in .gpuhb (and the tiny source in .gpusrc, possibly with an earlier
# call); stash them in $HOME, which lasts as long as the machine stays warm
if [ -d .gpuhb ]; then rm -rf "$HOME/hb"; cp -r .gpuhb "$HOME/hb"; fi
if [ -d .gpusrc/src ]; then rm -rf "$HOME/hbsrc"; cp -r .gpusrc/src "$HOME/hbsrc"; fi
# the config-only checkpoints and token ids of the floor / vcompare steps (floor_configs.py): --floor $HOME/floor
if [ -d .gpufloor ]; then rm -rf "$HOME/floor"; cp -r .gpufloor "$HOME/floor"; fi
# lm-eval and the wheels it needs beyond the image (.gpuev, prepare.sh), for the ab_eval step
if [ -d .gpuev ] && [ ! -d "$HOME/evsite/lm_eval" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$HOME/evsite" .gpuev/*.whl
fi
# Ray (the multi-node steps) travels as the unpacked ray wheel less its Java, dashboard client and libraries
# vLLM does not import (.gpuray/ray-site.tar.xz, made by prepare.sh), possibly with an earlier call
if [ -f .gpuray/ray-site.tar.xz ] && [ ! -d "$HOME/raysite/ray" ]; then
  mkdir -p "$HOME/raysite"; tar -C "$HOME/raysite" -xJf .gpuray/ray-site.tar.xz
fi
ray=; [ -d "$HOME/raysite/ray" ] && ray=:$HOME/raysite
hb=$HOME/hbsite
if [ ! -d "$hb/hybrid_build" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$hb" "$HOME"/hb/hybrid_build-*.whl
fi
mkdir -p "$HOME/bin"
printf '#!/bin/sh\nexec python3 -m vllm.entrypoints.cli.main "$@"\n' > "$HOME/bin/vllm"; chmod +x "$HOME/bin/vllm"
printf '#!/bin/sh\nexec python3 -c "import sys; from ray.scripts.scripts import main; sys.exit(main())" "$@"\n' \
  > "$HOME/bin/ray"; chmod +x "$HOME/bin/ray"
ev=; [ -d "$HOME/evsite/lm_eval" ] && ev=:$HOME/evsite
export PYTHONPATH=$hb:$HOME/site$ev$ray PATH=$hb/bin:$HOME/bin:$PATH VLLM_USE_FLASHINFER_SAMPLER=0 \
  VLLM_TRITON_FORCE_FIRST_CONFIG=${VLLM_TRITON_FORCE_FIRST_CONFIG:-1} \
  PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
out=${OUT:-$PWD/gpu-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/gpu.txt" 2>&1 || true
exec python3 "$here/driver.py" --hb "$HOME/hb" --src "$HOME/hbsrc" --work "$HOME/work" --out "$out" "$@"
