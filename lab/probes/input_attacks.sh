#!/bin/bash
# The input attacks of the trust-boundary pass, re-run: each command, its stderr (control
# characters shown by `cat -v`) and its exit code. Usage: bash lab/probes/input_attacks.sh ARTIFACT
# (a built artifact, e.g. the demo's `hybrid-build run -o demo-out`; it is copied, not touched).
set -u
ARTIFACT=$(realpath "$1")
W=$(mktemp -d) && trap 'rm -rf "$W"' EXIT && cd "$W"
cp -a "$ARTIFACT" ./art
mkfifo trace.fifo
python3 -c "print('{\"id\": \"a\", \"messages\": ' + '['*100000 + ']'*100000 + '}')" > deep.jsonl
python3 - <<'PY'
import json
msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}, {"role": "user", "content": 7}]
open("evil.jsonl", "w").write(json.dumps({"id": "conv\x1b[2J\x1b]0;owned\x07\r-1", "messages": msgs}) + "\n")
PY
run() { echo "\$ $*"; timeout 120 "$@" >/dev/null 2>err.txt; rc=$?; cat -v err.txt; echo "exit $rc"; echo; }
run hybrid-build bench http://127.0.0.1:9/v1 --trace /dev/zero
run hybrid-build bench http://127.0.0.1:9/v1 --trace trace.fifo
run hybrid-build bench http://127.0.0.1:9/v1 --trace deep.jsonl
run hybrid-build bench http://127.0.0.1:9/v1 --trace evil.jsonl
python3 -c "print('['*100000 + ']'*100000)" > art/model.sig
run hybrid-build verify-artifact art
run hybrid-build serve art --dry-run
rm art/model.sig && mkfifo art/model.sig
run hybrid-build verify-artifact art
rm art/model.sig
run hybrid-build plan synthetic:qwen3.5-122b-a10b --accept 1e308
run hybrid-build plan synthetic:qwen3.5-122b-a10b --concurrency 1000000000
run hybrid-build bench http://127.0.0.1:9/v1 --concurrency 1000000000
run hybrid-build plan synthetic:qwen3.5-122b-a10b --accept 17
