"""The plain names and defaults of serving (profile names, the docker image, the smoke test, the
drafter's source placeholder): what `serve --help` shows, readable without pydantic.
``profiles`` holds the models that validate a recipe's profiles and re-exports these."""

PROFILE_NAMES = ("dense", "dflash", "base", "mtp")
DOCKER_IMAGE = "ghcr.io/aeon-7/aeon-vllm-ultimate:2026-06-18-v0.23.0-dflashfix"
# `serve`'s smoke test: this question, and what a trained model's answer contains (a recipe's
# serve.smoke_expect overrides it; null for random weights)
SMOKE_PROMPT = "What is the capital of France? Answer in one word."
SMOKE_EXPECT = "Paris"
# in a drafter's ``model``: the source checkpoint's folder (the demo's drafter is ``{source}-dflash``)
SOURCE_PLACEHOLDER = "{source}"
