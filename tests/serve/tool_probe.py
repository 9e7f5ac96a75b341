"""Run vLLM's own tool-call parser on what Qwen3.5 emits for a tool call (a subprocess with a vLLM
version's sources on PYTHONPATH).

Usage: ``python tool_probe.py TOKENIZER_FOLDER PARSER OUT.json``. The request is the one the GPU
harness sends (``scripts/gpu/agent_steps.py``, ``TOOL_REQUEST``), parsed by vLLM's own
``ChatCompletionRequest``; the parser is the class vLLM registers under PARSER, built as the server
builds it, and given the text the request's regex forces.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "gpu"))
from agent_steps import TOOL_REQUEST, TOOL_TEXT  # noqa: E402


def main() -> int:
    folder, name, out = sys.argv[1:4]
    from transformers import AutoTokenizer
    from vllm.tool_parsers import ToolParserManager

    try:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    except ImportError:  # 0.23.0
        from vllm.entrypoints.openai.protocol import ChatCompletionRequest
    tok = AutoTokenizer.from_pretrained(folder)
    req = ChatCompletionRequest(model="qwen", **TOOL_REQUEST)
    cls = ToolParserManager.get_tool_parser(name)
    res: dict = {"class": cls.__name__}
    try:
        try:
            parser = cls(tok, req.tools)
        except TypeError:  # parsers that take the tokenizer alone
            parser = cls(tok)
        got = parser.extract_tool_calls(TOOL_TEXT, req)
        res.update(tools_called=got.tools_called, content=got.content,
                   calls=[{"name": c.function.name, "arguments": json.loads(c.function.arguments)}
                          for c in got.tool_calls])
    except Exception as e:  # what the server would answer with
        res["error"] = f"{type(e).__name__}: {e}"
    Path(out).write_text(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
