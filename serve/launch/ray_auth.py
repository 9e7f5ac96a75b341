"""The secrets ``serve --nodes`` hands its nodes: the token its Ray cluster admits members with
(where it comes from), and the files the nodes read secrets from, how they are written there and
removed again.

Ray (2.60) started with ``RAY_AUTH_MODE=token`` refuses every gRPC call without the cluster's token:
a node that would join, a driver that would connect (``ray.init``), a job submission. Each Ray
process reads the token from ``$RAY_AUTH_TOKEN``, else from the file ``$RAY_AUTH_TOKEN_PATH``, else
from ``~/.ray/auth_token``. A command line is visible to every user of a machine (``ps``), so the
nodes are given only the path of a file that holds the token: one per node, written by this run
before that node's Ray starts, readable by its owner only (``core.private_file``: created 0600
under a temporary name, then linked to its name, so it is never readable by others nor
half-written), and removed when the cluster is taken down. On another machine the file is written
by ``python3 -m hybrid_build.serve.launch.ray_auth write FILE``, which reads the secret from its stdin
(ssh carries it; no command line holds it). A head on another machine gets the served API's key
(``served_key``) the same way, in a file its vLLM's shell reads into ``$VLLM_API_KEY``.

The token is generated per run (``secrets``, 256 bits), unless one is given: ``--ray-token-file``,
``$RAY_AUTH_TOKEN`` (Ray's own variable), or a file named by ``$RAY_AUTH_TOKEN_PATH`` (Ray's own
variable); a file must be its owner's alone (mode 0600).
"""
from __future__ import annotations

import os
import secrets
import sys
from dataclasses import dataclass, field
from pathlib import Path

from hybrid_build.core.errors import UserError
from hybrid_build.core.private_file import is_one_word, read_private, write_private
from hybrid_build.core.redaction import remember

MODE_ENV = "RAY_AUTH_MODE"
TOKEN_ENV = "RAY_AUTH_TOKEN"
PATH_ENV = "RAY_AUTH_TOKEN_PATH"
# on every node, under its user's home: the one folder the same on each without asking the node
TOKEN_DIR = ".cache/hybrid-build"
TOKEN_FILE = "ray-token"
KEY_FILE = "api-key"  # the served API's key, on a head that is another machine
CONTAINER_TOKEN = "/run/hybrid-build/ray-token"  # where a docker node's file is mounted, read-only
MIN_LENGTH = 16


def node_file(kind: str, port: int, node_index: int, local: bool) -> str:
    """Where node ``node_index`` (0-based) of the cluster on Ray ``port`` keeps the secret ``kind``
    (``TOKEN_FILE``, ``KEY_FILE``): on this machine an absolute path; on another ``~/...``, under
    its user's home, which the node's shell expands (``"$HOME"``, see ``multinode.Command``)."""
    name = f"{kind}-{port}-node{node_index + 1}"
    return str(Path.home() / TOKEN_DIR / name) if local else f"~/{TOKEN_DIR}/{name}"


def auth_env(token_path: str) -> dict[str, str]:
    """What a Ray process (node, driver, vLLM) needs to take part: token mode and the file."""
    return {MODE_ENV: "token", PATH_ENV: token_path}


def check_token(token: str, what: str) -> str:
    """``token`` if Ray takes it: one word of printable ASCII (a gRPC metadata value), long enough."""
    if not (is_one_word(token) and token.isascii() and token.isprintable()):
        raise UserError(f"{what}: the Ray token must be one word of printable ASCII (no spaces)")
    if len(token) < MIN_LENGTH:
        raise UserError(f"{what}: the Ray token has {len(token)} characters; use {MIN_LENGTH} or more "
                        "(e.g. python3 -c 'import secrets; print(secrets.token_urlsafe(32))')")
    return token


def read_token_file(path: Path, what: str) -> str:
    """The token in ``path``, a file its owner alone can read; else one line saying what to do."""
    return check_token(read_private(path, what), f"{what} {path}")


@dataclass(frozen=True)
class RayToken:
    """Where the cluster's token comes from, never the token itself (``repr`` leaves it out):
    ``generated`` (when the cluster starts), ``$RAY_AUTH_TOKEN`` or a file (``path``)."""

    origin: str
    path: Path | None = None
    given: str | None = field(default=None, repr=False)

    def value(self) -> str:
        """The token: the given one, the file's (read again, checked again), or a new one."""
        if self.given is not None:
            return self.given
        if self.path is not None:
            return read_token_file(self.path, self.origin)
        token = secrets.token_urlsafe(32)
        remember(token)  # never in what this process prints (``core.redaction``)
        return token

    def describe(self) -> str:
        if self.path is not None:
            return f"the token in {self.path} ({self.origin})"
        if self.origin == "generated":
            return "a token generated for this run"
        return f"the token given by {self.origin}"

    def to_json(self) -> dict:
        return {"mode": "token", "origin": self.origin, "file": str(self.path) if self.path else None}


def resolve_token(token_file: Path | None = None, environ: dict | None = None) -> RayToken:
    """The cluster's token: ``token_file`` (an option), else ``$RAY_AUTH_TOKEN``, else the file
    ``$RAY_AUTH_TOKEN_PATH``, else one generated when the cluster starts. A given one is checked now
    (a ``--dry-run`` refuses what the run would refuse)."""
    env = os.environ if environ is None else environ
    if token_file is not None:
        path = Path(token_file).expanduser().resolve()
        read_token_file(path, "--ray-token-file")
        return RayToken("--ray-token-file", path)
    if env.get(TOKEN_ENV):
        return RayToken("$" + TOKEN_ENV, given=check_token(env[TOKEN_ENV].strip(), "$" + TOKEN_ENV))
    if env.get(PATH_ENV):
        path = Path(env[PATH_ENV]).expanduser().resolve()
        read_token_file(path, "$" + PATH_ENV)
        return RayToken("$" + PATH_ENV, path)
    return RayToken("generated")


def write_node_file(path: Path, secret: str) -> None:
    """Write ``secret`` (a token or a key: one word) to ``path``, readable by its owner only
    (``write_private``). A ``path`` that exists already is left alone: ``UserError`` (another
    cluster on the same Ray port may use it)."""
    if not is_one_word(secret):
        raise UserError(f"{path}: a token or key is one word, without spaces")
    if not write_private(path, secret + "\n"):
        raise _exists(path)


def _exists(path: Path) -> UserError:
    return UserError(f"{path} exists: a `serve --nodes` on the same Ray port runs (or was killed); remove the file "
                     "once no Ray of that run is left")


if __name__ == "__main__":  # on a node: `python3 -m hybrid_build.serve.launch.ray_auth write FILE`, the secret on stdin
    if len(sys.argv) != 3 or sys.argv[1] != "write":
        sys.exit("usage: python3 -m hybrid_build.serve.launch.ray_auth write FILE (the token or key on stdin)")
    try:
        write_node_file(Path(sys.argv[2]).expanduser(), sys.stdin.readline().strip())
    except (UserError, OSError) as e:
        sys.exit(f"error: {e}")
