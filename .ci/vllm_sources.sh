#!/usr/bin/env bash
# Download (cached) and unpack the vLLM wheels the `vllm`-marked serve tests read.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python tests/serve/vllm_sources.py "$@"
