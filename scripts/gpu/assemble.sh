#!/usr/bin/env bash
# Run THERE, once per carried part folder, back to back: bash .gpuN/assemble.sh .gpuN
# Keeps each part in $HOME/vl (files last while the machine stays warm, ~30 s after a call); when
# every file named in MANIFEST is there, unpacks vLLM and installs its wheels into $HOME/site.
set -e
mkdir -p "$HOME/vl"; cp -n "$1"/* "$HOME/vl/" 2>/dev/null || true
if [ -d "$HOME/site/vllm" ]; then echo "vLLM ready: PYTHONPATH=$HOME/site"; exit 0; fi
missing=0
while read -r f; do [ -z "$f" ] || [ -f "$HOME/vl/$f" ] || missing=$((missing + 1)); done < "$HOME/vl/MANIFEST"
if [ "$missing" != 0 ]; then echo "stashed; $missing files still to come"; exit 0; fi
mkdir -p "$HOME/site"; cat "$HOME"/vl/vllm.tar.xz.part* | tar -C "$HOME/site" -xJf -
python3 -m pip install -q --no-index --no-deps --no-compile --target "$HOME/site" "$HOME"/vl/*.whl
echo "vLLM ready: PYTHONPATH=$HOME/site"
