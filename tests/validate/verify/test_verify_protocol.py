"""The requests `verify` sends are vLLM's: every field exists in the ``CompletionRequest`` of each
checked version (read from the unpacked sources), echo maps to prompt log-probabilities there, the
response choice carries the id-keyed ``prompt_logprobs``; and 0.25.1's and 0.33.0's own pydantic
model parses the bodies (0.23.0's protocol module imports gguf, which the CPU deps leave out). The
paths' premises hold in each version's source: prompt log-probabilities skip the prefix cache, the
salt keys the first block, the prefix-cache counters have the names verify reads, generated tokens
come back as ``token_id:N``."""
from __future__ import annotations

import ast
import json
import os
import re
import sys
from pathlib import Path

import pytest

from hybrid_build.validate.verify.verify import PROTOCOLS, Served, request_body
from hybrid_build.validate.verify.verify_paths import PREFIX_HITS, PREFIX_QUERIES, SPEC_DRAFTS, generation_body

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "serve"))
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
    sent = set(generation_body(SERVED, [1, 2, 3], 8, "salt"))
    assert sent <= fields, ("generation", sent - fields)
    # echo + logprobs asks for prompt log-probabilities too, and the choice returns them by id
    assert "prompt_logprobs = self.logprobs" in text and "if prompt_logprobs is None and self.echo:" in text
    assert "prompt_logprobs" in _fields(tree, "CompletionResponseChoice")


SERVED = Served("http://127.0.0.1:8000/v1", "qwen", None, 10.0, 20, 1024)


@pytest.mark.vllm
@pytest.mark.parametrize("version", vllm_sources.VERSIONS)
def test_the_paths_premises_hold_in_vllms_source(version):
    vllm = _source(version) / "vllm"
    # a request asking for prompt log-probabilities never reads the prefix cache: the paths use generated tokens
    params = " ".join((vllm / "sampling_params.py").read_text().split())
    assert re.search(r"self\.skip_reading_prefix_cache = \(? ?self\.prompt_logprobs is not None", params)
    manager = (vllm / "v1/core/kv_cache_manager.py").read_text()
    assert "prefix_cache_stats.record(" in manager
    if "request.skip_reading_prefix_cache" not in manager:  # 0.34.0: the skip is a hit limit of 0 tokens
        assert "request.prefix_cache_hit_limit != 0" in manager
        request = " ".join((vllm / "v1/request.py").read_text().split())
        assert "if params is not None and params.skip_reading_prefix_cache: return 0" in request
    # the salt keys the first block only, so every later block's hash (chained) differs too
    utils = (vllm / "v1/core/kv_cache_utils.py").read_text()
    assert "if (start_token_idx == 0 and request.cache_salt)" in " ".join(utils.split())
    # the counters verify reads from /metrics
    loggers = (vllm / "v1/metrics/loggers.py").read_text()
    for name in (PREFIX_QUERIES, PREFIX_HITS):
        assert f'name="{name}"' in loggers
    assert f'"{SPEC_DRAFTS}"' in (vllm / "v1/spec_decode/metrics.py").read_text()
    # generated tokens named by id with return_tokens_as_token_ids
    served = "\n".join(p.read_text() for p in (vllm / "entrypoints").rglob("serving.py"))
    assert 'f"token_id:{token_id}"' in served


PARSE_PROBE = r'''
import json, sys
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
out = []
for body in json.loads(sys.argv[1]):
    r = CompletionRequest.model_validate(body)
    out.append({"prompt": r.prompt, "prompt_logprobs": r.prompt_logprobs, "echo": r.echo, "logprobs": r.logprobs,
                "max_tokens": r.max_tokens, "temperature": r.temperature, "ignore_eos": r.ignore_eos,
                "return_tokens_as_token_ids": r.return_tokens_as_token_ids, "cache_salt": r.cache_salt})
print(json.dumps(out))
'''


@pytest.mark.vllm
@pytest.mark.parametrize("version", ["0.25.1", "0.33.0", "0.34.0"])
def test_vllm_parses_verifys_requests(version):
    _source(version)
    path = vllm_sources.cpu_pythonpath(version)
    if path is None:
        pytest.skip("vLLM's CPU import dependencies not prepared (run .ci/vllm_sources.sh)")
    bodies = [request_body(p, "qwen", [5, 6, 7], 20) for p in PROTOCOLS]
    bodies.append(generation_body(SERVED, [5, 6, 7], 8, "hybrid-build-verify-x"))
    env = dict(os.environ, **vllm_sources.cache_env(version), PYTHONPATH=path, VLLM_LOGGING_LEVEL="ERROR")
    r = vllm_sources.run_python(version, ["-c", PARSE_PROBE, json.dumps(bodies)], env, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    direct, echo, generation = json.loads(r.stdout.strip().splitlines()[-1])
    plain = {"ignore_eos": False, "return_tokens_as_token_ids": None, "cache_salt": None}
    assert direct == {"prompt": [5, 6, 7], "prompt_logprobs": 20, "echo": False, "logprobs": None, "max_tokens": 1,
                      "temperature": 0, **plain}
    assert echo == {"prompt": [5, 6, 7], "prompt_logprobs": None, "echo": True, "logprobs": 20, "max_tokens": 1,
                    "temperature": 0, **plain}
    assert generation == {"prompt": [5, 6, 7], "prompt_logprobs": None, "echo": False, "logprobs": 20,
                          "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_tokens_as_token_ids": True,
                          "cache_salt": "hybrid-build-verify-x"}
