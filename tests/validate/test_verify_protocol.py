"""The requests `verify` sends are vLLM's: every field exists in the ``CompletionRequest`` of each
checked version (read from the unpacked sources), echo maps to prompt log-probabilities there, the
response choice carries the id-keyed ``prompt_logprobs``; and 0.25.1's and 0.33.0's own pydantic
model parses both bodies (0.23.0's protocol module imports gguf, which the CPU deps leave out)."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid_build.validate.verify import PROTOCOLS, request_body

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serve"))
import vllm_sources  # noqa: E402  (tests/serve: where the unpacked vLLM wheels are found)

PROTOCOL_FILE = "vllm/entrypoints/openai/completion/protocol.py"


def _source(version: str) -> Path:
    root = vllm_sources.unpacked(version)
    if root is None:
        pytest.skip(f"vLLM {version} sources not prepared (run .ci/vllm_sources.sh)")
    return root


def _fields(tree: ast.Module, cls: str) -> set[str]:
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return {s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}


@pytest.mark.vllm
@pytest.mark.parametrize("version", vllm_sources.VERSIONS)
def test_verify_request_fields_exist_in_vllms_completion_request(version):
    text = (_source(version) / PROTOCOL_FILE).read_text()
    tree = ast.parse(text)
    fields = _fields(tree, "CompletionRequest")
    for protocol in PROTOCOLS:
        sent = set(request_body(protocol, "qwen", [1, 2, 3], 20))
        assert sent <= fields, (protocol, sent - fields)
    # echo + logprobs asks for prompt log-probabilities too, and the choice returns them by id
    assert "prompt_logprobs = self.logprobs" in text and "if prompt_logprobs is None and self.echo:" in text
    assert "prompt_logprobs" in _fields(tree, "CompletionResponseChoice")


PARSE_PROBE = r'''
import json, sys
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
out = []
for body in json.loads(sys.argv[1]):
    r = CompletionRequest.model_validate(body)
    out.append({"prompt": r.prompt, "prompt_logprobs": r.prompt_logprobs, "echo": r.echo, "logprobs": r.logprobs,
                "max_tokens": r.max_tokens, "temperature": r.temperature})
print(json.dumps(out))
'''


@pytest.mark.vllm
@pytest.mark.parametrize("version", ["0.25.1", "0.33.0"])
def test_vllm_parses_verifys_requests(version):
    _source(version)
    path = vllm_sources.cpu_pythonpath(version)
    if path is None:
        pytest.skip("vLLM's CPU import dependencies not prepared (run .ci/vllm_sources.sh)")
    bodies = [request_body(p, "qwen", [5, 6, 7], 20) for p in PROTOCOLS]
    env = dict(os.environ, PYTHONPATH=path)
    r = subprocess.run([sys.executable, "-c", PARSE_PROBE, json.dumps(bodies)], capture_output=True, text=True,
                       timeout=180, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    direct, echo = json.loads(r.stdout.strip().splitlines()[-1])
    assert direct == {"prompt": [5, 6, 7], "prompt_logprobs": 20, "echo": False, "logprobs": None, "max_tokens": 1,
                      "temperature": 0}
    assert echo == {"prompt": [5, 6, 7], "prompt_logprobs": None, "echo": True, "logprobs": 20, "max_tokens": 1,
                    "temperature": 0}
