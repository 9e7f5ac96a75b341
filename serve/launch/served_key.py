"""The served API's key: when ``serve`` needs one, where it comes from, and the file a generated one
is kept in.

vLLM's OpenAI server (0.23.0 and 0.25.1: ``entrypoints/openai/api_server.py``; 0.33.0:
``entrypoints/serve/middleware/register.py``) takes ``--api-key``, else ``$VLLM_API_KEY``, and then
answers every request under ``/v1`` without ``Authorization: Bearer KEY`` with 401. ``serve``
passes the key in vLLM's environment only (the docker engine: ``-e VLLM_API_KEY`` names it, the
value is in docker's environment), never on a command line, which every user of the machine can
read (``ps``). With ``--nodes`` the head's vLLM gets it the same way; a head on another machine
reads it from a file of its own (0600, written from ssh's stdin, removed at teardown: ``multinode``).

A server that listens beyond loopback (``--host`` not a loopback address; the docker engine
publishes the port where vLLM listens) needs a key: ``--api-key``, ``--api-key-file`` or
``$VLLM_API_KEY``, else one is generated (``secrets``) into a file only its owner can read, under
the user's state folder (``$XDG_STATE_HOME/hybrid-build``, default ``~/.local/state/hybrid-build``),
never in the artifact that ``publish`` uploads. It is kept and reused, so clients set up once
keep working. On loopback without a key given, nothing changes: no key.
"""
from __future__ import annotations

import ipaddress
import os
import secrets
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from hybrid_build.core.api_key import CLIENT_ENV
from hybrid_build.core.errors import UserError
from hybrid_build.core.local_trust import STATE_FOLDER, state_dir  # noqa: F401 - the user's state folder
from hybrid_build.core.private_file import is_one_word, read_private, write_private

SERVER_ENV = "VLLM_API_KEY"  # what vLLM's OpenAI server reads
KEY_FILE = "serve-api-key"  # the generated key, in STATE_FOLDER


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1); False for every other
    name or address, ``0.0.0.0`` and ``::`` (every interface) included."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ApiKey:
    """A key ``serve`` gives vLLM: its value (never printed: ``repr`` leaves it out), where it came
    from (``--api-key``, ``--api-key-file``, ``$VLLM_API_KEY`` or ``generated``) and its file, if it
    has one. ``pending``: a ``--dry-run`` plan whose key would be generated when serving starts."""

    value: str = field(repr=False)
    origin: str
    path: Path | None = None
    created: bool = False
    pending: bool = False

    def env(self) -> dict[str, str]:
        """What goes into the environment of vLLM (or of ``docker run``)."""
        return {SERVER_ENV: self.value}

    def describe(self) -> str:
        """Where the key is, in words: its file, or where it was given; never the key."""
        if self.origin == "generated":
            made = ("generated when serving starts" if self.pending else "generated now" if self.created
                    else "generated earlier, reused")
            return f"API key: {self.path} ({made}; readable by its owner only)"
        if self.path is not None:
            return f"API key: {self.path} (--api-key-file)"
        return f"API key: the one given by {'$' + SERVER_ENV if self.origin == SERVER_ENV else self.origin}"

    def client_hint(self) -> str:
        """How a client sends it."""
        key = _cat(self.path) if self.path is not None else "KEY"
        return f"clients send it as a Bearer token, e.g. {CLIENT_ENV}={key} hybrid-build verify URL --artifact OUT"

    def announce(self) -> str:
        """The line serve prints before starting: where the key is and how a client sends it."""
        return f"{self.describe()}; {self.client_hint()}"

    def shell_line(self) -> str:
        """The ``--dry-run`` line that puts the key in the environment, without the key."""
        if self.path is not None:
            return f"export {SERVER_ENV}={_cat(self.path)}"
        if self.origin == SERVER_ENV:
            return f"# {SERVER_ENV}: this environment's, passed on (not shown)"
        return f"# {SERVER_ENV}: the key given by {self.origin} (not shown)"

    def to_json(self) -> dict:
        return {"env": SERVER_ENV, "origin": self.origin, "file": str(self.path) if self.path else None,
                "pending": self.pending}


def _cat(path: Path) -> str:
    """``"$(cat PATH)"``: the key file's content in a shell line, which shows the path, never the key."""
    return f'"$(cat {shlex.quote(str(path))})"'


def _read_key(path: Path, what: str) -> str:
    """The key in ``path``, a file its owner alone can read (``read_private``), alone on its line."""
    key = read_private(path, what)
    if not is_one_word(key):
        raise UserError(f"{what} {path}: it should hold the key alone, on one line")
    return key


def _write_new(path: Path) -> str | None:
    """Generate a key into ``path`` (``write_private``: 0600, never half-written), which fails rather
    than replace a key another ``serve`` wrote meanwhile (None then: read that one)."""
    key = "hbk_" + secrets.token_urlsafe(32)
    return key if write_private(path, key + "\n") else None


def _generated(path: Path, create: bool) -> ApiKey:
    """The generated key in ``path``: reused if there, else made (``create``) or pending (dry run)."""
    for _ in range(2):
        try:
            path.stat()
        except FileNotFoundError:
            if not create:
                return ApiKey("", "generated", path, pending=True)
            key = _write_new(path)
            if key is not None:
                return ApiKey(key, "generated", path, created=True)
            continue  # another serve wrote one first: use it
        return ApiKey(_read_key(path, "the generated API key file"), "generated", path)
    raise UserError(f"{path}: the API key file keeps changing while it is read")


def resolve(host: str, flag: str | None = None, file: Path | None = None, environ: dict | None = None,
            create: bool = True, folder: Path | None = None) -> ApiKey | None:
    """The key to serve with: ``--api-key``, ``--api-key-file``, ``$VLLM_API_KEY``, in that order;
    without one, a server beyond loopback gets the generated key (``folder``, default
    ``state_dir()``; ``create=False``: not written now, for ``--dry-run``) and one on loopback
    none (None)."""
    env = os.environ if environ is None else environ
    if flag is not None and file is not None:
        raise UserError("give the API key once: --api-key or --api-key-file")
    if flag is not None:
        if not is_one_word(flag):
            raise UserError("--api-key: empty, or holds a space")
        return ApiKey(flag, "--api-key")
    if file is not None:
        path = Path(file).expanduser().resolve()
        return ApiKey(_read_key(path, "--api-key-file"), "--api-key-file", path)
    if env.get(SERVER_ENV):
        return ApiKey(env[SERVER_ENV], SERVER_ENV)
    if is_loopback(host):
        return None
    return _generated((folder or state_dir()) / KEY_FILE, create)
