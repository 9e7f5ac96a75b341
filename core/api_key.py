"""The API key a client of an OpenAI-compatible server sends (``verify``, ``eval``, ``serve``'s own
readiness probe, check and smoke test): where it comes from, the header it goes in, and the one
line when a server refuses it.

vLLM's OpenAI server, started with a key, answers every request under ``/v1`` that lacks
``Authorization: Bearer KEY`` with 401 ``{"error": "Unauthorized"}`` (``/metrics`` and ``/health``
stay open). A client gets the key from ``--api-key`` or ``$OPENAI_API_KEY``, the variable the
OpenAI clients and lm-eval's API models read.
"""
from __future__ import annotations

import os

from .errors import KeyRefused

CLIENT_ENV = "OPENAI_API_KEY"
HINT = f"give --api-key or {CLIENT_ENV}"
REFUSED = (401, 403)  # vLLM answers 401; a proxy in front of it may answer 403


def client_key(given: str | None) -> str | None:
    """``--api-key`` if given, else ``$OPENAI_API_KEY``; None when neither is set (or both are empty)."""
    return given or os.environ.get(CLIENT_ENV) or None


def bearer(key: str | None) -> dict[str, str]:
    """The Authorization header for ``key`` (none without a key)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def refused(url: str, code: int, sent: bool, hint: str = HINT) -> KeyRefused:
    """The one line for a 401/403: whether a key was sent, never the key."""
    what = "refused the API key" if sent else "wants an API key and none was sent"
    return KeyRefused(f"the server at {url} {what} (HTTP {code}): {hint}")
