"""The profiles' default tool-call and reasoning parsers against vLLM's parser sources.

Qwen3.5 emits a tool call as ``<tool_call><function=NAME><parameter=K>V</parameter></function>
</tool_call>`` (FACTS.md; the GPU harness forces exactly that text, ``agent_steps.TOOL_TEXT``). For each
checked version: the default names are registered, their parser reads that format (its markers in
the source), and, where vLLM's parser modules import on CPU, vLLM's own parser turns the text into
the ``tool_calls`` entry, with the harness's request parsed by vLLM's own ``ChatCompletionRequest``.
"""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from hybrid_build.recipes.profiles import ServeProfile

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent.parent / "scripts" / "gpu"))
import vllm_sources  # noqa: E402
from agent_steps import TOOL_REQUEST, TOOL_TEXT  # noqa: E402

TOOL, REASONING = ServeProfile().tool_call_parser, ServeProfile().reasoning_parser
MARKERS = ("<tool_call>", "<function=", "<parameter=", "</parameter>", "</function>", "</tool_call>")  # nesting order


def _registered(root: Path, package: str, name: str) -> str:
    """The module vLLM registers ``name`` under in ``vllm/<package>/__init__.py``."""
    text = (root / "vllm" / package / "__init__.py").read_text()
    m = re.search(rf'"{re.escape(name)}":\s*\(\s*"([a-z0-9_]+)",\s*"([A-Za-z0-9_]+)"', text)
    assert m, f"{name!r} is not registered in vllm/{package}"
    return m.group(1)


def _parser_source(root: Path, module: str) -> str:
    text = (root / "vllm" / "tool_parsers" / f"{module}.py").read_text()
    if "Qwen3ParserToolAdapter" in text:  # 0.25+: an adapter of the unified Qwen3 parser
        text += (root / "vllm" / "parser" / "qwen3.py").read_text()
    return text


def test_the_harness_forces_the_format_qwen35_emits():
    at = [TOOL_TEXT.index(m) for m in MARKERS]
    assert at == sorted(at) and TOOL_TEXT.startswith(MARKERS[0]) and TOOL_TEXT.endswith(MARKERS[-1])
    assert re.fullmatch(TOOL_REQUEST["structured_outputs"]["regex"], TOOL_TEXT)


@pytest.mark.vllm
@pytest.mark.parametrize("version", vllm_sources.VERSIONS)
def test_default_parsers_exist_and_read_the_format(version):
    root = vllm_sources.unpacked(version)
    if root is None:
        pytest.skip(f"vLLM {version} sources not prepared (run .ci/vllm_sources.sh)")
    source = _parser_source(root, _registered(root, "tool_parsers", TOOL))
    assert all(m in source for m in MARKERS), version
    reasoning = (root / "vllm" / "reasoning" / f"{_registered(root, 'reasoning', REASONING)}.py").read_text()
    if "Qwen3ParserReasoningAdapter" in reasoning or "qwen3_engine" in reasoning:
        reasoning += (root / "vllm" / "parser" / "qwen3.py").read_text()
    assert "<think>" in reasoning and "</think>" in reasoning
    # qwen3_coder is the same parser as qwen3_xml from 0.25 on: the choice matters on 0.23.0 only
    same = _registered(root, "tool_parsers", "qwen3_coder") == _registered(root, "tool_parsers", "qwen3_xml")
    assert same is (version != "0.23.0")


def _probe(version: str, parser: str, tokenizer: Path, tmp_path: Path) -> dict:
    pp = vllm_sources.cpu_pythonpath(version)
    if pp is None:
        pytest.skip(f"vLLM {version} sources not prepared (run .ci/vllm_sources.sh)")
    out = tmp_path / f"{version}-{parser}.json"
    r = vllm_sources.run_python(version, [str(HERE / "tool_probe.py"), str(tokenizer), parser, str(out)],
                                dict(os.environ, **vllm_sources.cache_env(version), PYTHONPATH=pp,
                                     VLLM_LOGGING_LEVEL="ERROR"), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.vllm
@pytest.mark.parametrize("version", ["0.23.0", "0.25.1", "0.26.0"])
def test_vllms_own_parser_returns_the_call(version, tiny_checkpoint, tmp_path):
    res = _probe(version, TOOL, tiny_checkpoint, tmp_path)
    assert res.get("error") is None, res
    assert res["tools_called"] and res["calls"] == [{"name": "get_weather", "arguments": {"city": "Paris"}}]


@pytest.mark.vllm
def test_0230_qwen3_coder_needs_the_tags_as_tokens(tiny_checkpoint, tmp_path):
    """Why the default is qwen3_xml: on 0.23.0 the other parser refuses a tokenizer without the tags
    as tokens (the tiny one; Qwen3.5's own has them)."""
    res = _probe("0.23.0", "qwen3_coder", tiny_checkpoint, tmp_path)
    assert res["class"] == "Qwen3CoderToolParser" and "could not locate tool call start/end tokens" in res["error"]
