"""Secrets out of what a command prints: ``redact(text)`` replaces every secret this process may
hold with ``***``, whatever exception or library put it in the text.

The secrets: the values of the variables that hold one (the Hub token, a client's and a server's API
key, the Ray token), the files that hold one (the Hub's token file, ``$HF_TOKEN_PATH``,
``$RAY_AUTH_TOKEN_PATH``, and any a command names: ``--api-key-file``, ``--ray-token-file``),
those a command was given or generated (``remember``), and what is a secret by its shape: a
``Bearer`` credential, a Hub token (``hf_...``), the password in a URL (``https://user:PASS@host``).
The CLI passes every error line, the ``--json`` failure object and every log line through it.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from .bounded_read import SECRET_CAP, InputRefused, read_bytes

SECRET_ENV = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "OPENAI_API_KEY", "VLLM_API_KEY", "RAY_AUTH_TOKEN")
SECRET_FILE_ENV = ("HF_TOKEN_PATH", "RAY_AUTH_TOKEN_PATH")
MASK = "***"
MIN_LENGTH = 6  # shorter values ("1", "abc") would mask ordinary text, and are no secret worth the name
PATTERNS = (
    (re.compile(r"(?i)\b(bearer\s+)[^\s'\"]+"), r"\1" + MASK),
    (re.compile(r"\bhf_[A-Za-z0-9]{20,}"), MASK),
    (re.compile(r"([a-z][a-z0-9+.-]*://[^/\s:@]+:)[^/\s@]+@"), r"\1" + MASK + "@"),
)

_secrets: set[str] = set()
_files: set[Path] = set()


def remember(*values: str | None) -> None:
    """Secrets this process was given or made (a flag's value, a generated key)."""
    _secrets.update(v.strip() for v in values if v and len(v.strip()) >= MIN_LENGTH)


def remember_file(*paths: str | os.PathLike | None) -> None:
    """Files that hold a secret: read only when a text is redacted."""
    _files.update(Path(p).expanduser() for p in paths if p)


def _hub_token_file() -> Path:
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "token"


def _read_secret_file(path: Path) -> str | None:
    """A small regular file's text; None for anything else (a FIFO is never opened: it would block)."""
    try:
        return read_bytes(path, path.name, SECRET_CAP).decode("utf-8", "replace").strip()
    except (OSError, InputRefused):
        return None


def known_secrets() -> list[str]:
    """Every secret value known now, longest first (a secret that contains another is masked whole)."""
    found = set(_secrets)
    found.update(os.environ.get(name, "").strip() for name in SECRET_ENV)
    files = set(_files) | {Path(os.environ[n]).expanduser() for n in SECRET_FILE_ENV if os.environ.get(n)}
    files.add(_hub_token_file())
    for path in files:
        text = _read_secret_file(path)
        if text:
            found.update(line.strip() for line in text.splitlines())
    return sorted((s for s in found if len(s) >= MIN_LENGTH), key=len, reverse=True)


def redact(text: str) -> str:
    """``text`` with every known secret, and every secret by its shape, replaced by ``***``."""
    for secret in known_secrets():
        text = text.replace(secret, MASK)
    for pattern, mask in PATTERNS:
        text = pattern.sub(mask, text)
    return text
