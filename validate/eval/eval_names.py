"""The plain names and defaults of ``eval`` (how it reaches a model, which tasks it runs unless told):
what `eval --help` shows, readable without ``task_eval`` and its runner."""
from __future__ import annotations

# lm-eval's Hugging Face backend on the source and the hybrid, or OpenAI-compatible servers (completions:
# log-likelihoods and generation; chat: generation only)
BACKENDS = ("hf", "completions", "chat")
DEFAULT_TASKS = ("hybrid_build",)  # the bundled offline multiple-choice group (eval_taskset.GROUPS)
