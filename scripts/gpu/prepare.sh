#!/usr/bin/env bash
# Run HERE, in the repository root (needs the venv and network access to PyPI):
#   bash scripts/gpu/prepare.sh                       # vLLM 0.25.1
#   VLLM_VERSION=0.26.0 bash scripts/gpu/prepare.sh   # vLLM 0.26.0 instead (also pins torch 2.11)
# 1. vLLM (built for torch 2.11 + CUDA 13, what the H200 image has) and the wheels it needs
#    (requirements-gpu.txt; for 0.26.0 with apache-tvm-ffi 0.1.10 and pydantic-extra-types, which
#    mistral_common imports there), packed into .gpu1/ .gpu2/ ... of at most 60 MB each (a device
#    call carries 64 MiB);
# 2. .gpuev/: lm-eval and the wheels it needs (requirements-eval.txt), for the eval step;
# 3. .gpuhb/: the tiny inc-hybrid and compressed-tensors artifacts, the CPU reference logprobs,
#    a random tiny DFlash drafter and the hybrid-build wheel; .gpusrc/: the tiny source checkpoint.
# All these folders are git-ignored (/.gpu*/). docs/gpu.md says which calls carry which folder.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
vllm_version=${VLLM_VERSION:-0.25.1}
case "$vllm_version" in 0.25.1|0.26.0) ;; *) echo "VLLM_VERSION: 0.25.1 or 0.26.0 (the two that pin torch 2.11)" >&2; exit 2;; esac
cache=${HYBRID_BUILD_GPU_CACHE:-${TMPDIR:-/tmp}/hybrid-build-gpu}/vllm-$vllm_version; mkdir -p "$cache"
rm -rf "$cache/whl"; mkdir -p "$cache/whl"  # only this version's wheels go into the parts
plat="--only-binary=:all: --python-version 3.12 --implementation cp"
for n in 17 24 26 27 28 31; do plat="$plat --platform manylinux_2_${n}_x86_64"; done
plat="$plat --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
ls "$cache"/vllm-$vllm_version-*.whl >/dev/null 2>&1 || python3 -m pip download -q --no-deps $plat -d "$cache" vllm==$vllm_version
reqs="$here/requirements-gpu.txt"
if [ "$vllm_version" = 0.26.0 ]; then
  reqs="$cache/requirements-gpu.txt"
  sed 's/^apache-tvm-ffi==0.1.9$/apache-tvm-ffi==0.1.10/' "$here/requirements-gpu.txt" > "$reqs"
  echo "pydantic-extra-types==2.11.1" >> "$reqs"
fi
python3 -m pip download -q --no-deps $plat -d "$cache/whl" -r "$reqs"
if [ ! -f "$cache/vllm.tar.xz" ]; then
  rm -rf "$cache/site"; mkdir "$cache/site"; (cd "$cache/site" && unzip -q "$cache"/vllm-$vllm_version-*.whl)
  # Hopper runs FA3; the FA2 library and DeepGEMM builds for other Pythons only cost carry space
  # (and the optional Rust frontend binary, which vllm.LLM never starts)
  rm -f "$cache"/site/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so "$cache"/site/vllm/third_party/deep_gemm/_C.cpython-3{10,11,13,14}-*.so \
    "$cache"/site/vllm/vllm-rs
  tar -C "$cache/site" -cf - vllm vllm-$vllm_version.dist-info | xz -T0 -7 > "$cache/vllm.tar.xz"
fi
rm -f "$cache"/vllm.tar.xz.part*; (cd "$cache" && split -b 41000000 vllm.tar.xz vllm.tar.xz.part)
rm -rf .gpu[0-9]*
python3 - "$cache" "$here" <<'PY'
import os, shutil, sys
cache, here = sys.argv[1:3]
files = [os.path.join(cache, f) for f in os.listdir(cache) if f.startswith("vllm.tar.xz.part")]
files += [os.path.join(cache, "whl", f) for f in os.listdir(os.path.join(cache, "whl"))]
files.sort(key=os.path.getsize, reverse=True)
bins = []  # first fit, largest first
for f in files:
    size = os.path.getsize(f)
    for b in bins:
        if b[0] + size <= 60e6:
            b[0] += size; b[1].append(f); break
    else:
        bins.append([size, [f]])
for i, (_, fs) in enumerate(bins, 1):
    d = f".gpu{i}"; os.makedirs(d)
    for f in fs:
        shutil.copy(f, d)
    shutil.copy(os.path.join(here, "assemble.sh"), d)
    with open(os.path.join(d, "MANIFEST"), "w") as m:
        m.write("\n".join(os.path.basename(f) for f in files) + "\n")
print("vLLM parts:", " ".join(f".gpu{i}" for i in range(1, len(bins) + 1)))
with open(".gpu1/VLLM_VERSION", "w") as v:  # which vLLM these parts carry (assemble.sh copies it along)
    v.write(os.environ.get("VLLM_VERSION", "0.25.1") + "\n")
PY
# lm-eval for the eval step (requirements-eval.txt; the three sdists built into wheels here)
rm -rf .gpuev; mkdir .gpuev
grep -v '^#' "$here/requirements-eval.txt" | sed -n '/^lm-eval/,/^typepy/p' > "$cache/ev-wheels.txt"
python3 -m pip download -q --no-deps $plat -d .gpuev -r "$cache/ev-wheels.txt"
python3 -m pip wheel -q --no-deps -w .gpuev $(sed -n '/^# sdists/,$p' "$here/requirements-eval.txt" | grep -v '^#')
# the tiny artifacts, their CPU reference, a drafter and our wheel
rm -rf .gpuhb .gpusrc; mkdir -p .gpuhb .gpusrc
hybrid-build run -o .gpuhb/inc -q
hybrid-build run -o .gpuhb/ct --format compressed-tensors -q
mv .gpuhb/inc/.hybrid-build/demo-source .gpusrc/src
rm -rf .gpuhb/inc/.hybrid-build .gpuhb/ct/.hybrid-build
python3 "$here/reference.py" .gpusrc/src .gpuhb/inc .gpuhb/ct .gpuhb/ref.pt
python3 "$here/tiny_drafter.py" .gpuhb/inc .gpuhb/drafter-dflash
python3 -m pip wheel -q --no-deps -w .gpuhb .
# Ray for the multi-node steps: the wheel unpacked, less what vLLM never imports (its Java
# jars, the dashboard's web client, rllib / tune / train / serve / data / llm), 28 MB as tar.xz
rm -rf .gpuray "$cache/ray"; mkdir -p .gpuray "$cache/ray"
ls "$cache"/ray-2.60.0-*.whl >/dev/null 2>&1 || python3 -m pip download -q --no-deps $plat -d "$cache" ray==2.60.0
(cd "$cache/ray" && unzip -q "$cache"/ray-2.60.0-*.whl && rm -rf ray/jars ray/rllib ray/tune ray/train ray/serve \
  ray/data ray/llm ray/dashboard/client && tar -cf - . | xz -T0 -6 > "$OLDPWD/.gpuray/ray-site.tar.xz")
du -sh .gpu*
