"""A stand-in Hub on loopback, spoken to over real HTTP by the real huggingface_hub client (point
``HF_ENDPOINT``, or ``huggingface_hub.constants.ENDPOINT`` in process, at ``HubServer.url``).

It serves folders of this machine as model repositories, one commit each, through the routes the
client uses to read and download a repository:

- ``GET /api/models/ORG/NAME[/revision/REV]`` (``repo_info``/``model_info``: the commit, every
  file with its size; with ``blobs`` its blob id and LFS sha256),
- ``GET /api/models/ORG/NAME/tree/REV`` (``list_repo_tree``, as ``snapshot_download`` lists),
- ``HEAD`` and ``GET /ORG/NAME/resolve/REV/PATH`` (``hf_hub_download``, and the ranged GETs of
  ``parse_safetensors_file_metadata``): ``X-Repo-Commit``, ``ETag``, ``Content-Length``, and
  ``Range: bytes=A-B`` answered with 206 and ``Content-Range``.

Errors carry the Hub's ``X-Error-Code`` (RepoNotFound, RevisionNotFound, EntryNotFound), so the
client raises what it raises against the Hub. Every answer is recorded (``served``: method, path,
range, status, body bytes), so a test counts what a command transferred. A file's body is read
from disk as it is sent, so a sparse file of many GB costs nothing until someone reads it; with
``budget`` set, an answer whose body would take the bytes sent past it is refused (403) instead of
sent: a command that starts downloading weights fails at once rather than fetching them.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin")
LFS_MIN_BYTES = 10 * 1024 * 1024
HASH_MAX_BYTES = 64 * 1024 * 1024  # larger files get a stable id instead of their sha256 (reading GBs for a name)
CHUNK = 1 << 20


@dataclass(frozen=True)
class Served:
    method: str
    path: str
    range: str | None
    status: int
    body_bytes: int


@dataclass
class Repo:
    folder: Path
    commit: str
    files: dict[str, Path]  # path in the repo -> file here
    _etags: dict[str, str] = field(default_factory=dict)

    def etag(self, rel: str) -> str:
        if rel not in self._etags:
            self._etags[rel] = self._etag(rel)
        return self._etags[rel]

    def _etag(self, rel: str) -> str:
        """The sha256 for an LFS file (a stable stand-in id past ``HASH_MAX_BYTES``), the git blob sha1 otherwise."""
        path = self.files[rel]
        size = path.stat().st_size
        if not _is_lfs(rel, size):
            return hashlib.sha1(f"blob {size}\0".encode() + path.read_bytes()).hexdigest()
        if size > HASH_MAX_BYTES:
            return hashlib.sha256(f"{rel}\0{size}\0{path.stat().st_mtime_ns}".encode()).hexdigest()
        h = hashlib.sha256()
        with path.open("rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
        return h.hexdigest()

    def entry(self, rel: str, blobs: bool) -> dict:
        size = self.files[rel].stat().st_size
        out: dict = {"size": size}
        if blobs:
            etag = self.etag(rel)
            out["blobId"] = hashlib.sha1(etag.encode()).hexdigest() if _is_lfs(rel, size) else etag
            if _is_lfs(rel, size):
                out["lfs"] = {"sha256": etag, "size": size, "pointerSize": 134}
        return out


def _is_lfs(rel: str, size: int) -> bool:
    return rel.endswith(LFS_SUFFIXES) or size >= LFS_MIN_BYTES


class HubServer:
    def __init__(self, budget: int | None = None):
        self.repos: dict[str, Repo] = {}
        self.served: list[Served] = []
        self.budget = budget
        self._lock = threading.Lock()
        self._sent = 0
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="hub-standin", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> HubServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()

    def add_repo(self, repo_id: str, folder: str | os.PathLike) -> str:
        """Serve every regular file under ``folder`` as ``repo_id``'s one commit; returns the commit."""
        folder = Path(folder)
        files = {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*"))
                 if p.is_file() and not p.is_symlink() and not any(part.startswith(".") for part in
                                                                    p.relative_to(folder).parts)}
        listing = json.dumps({rel: [p.stat().st_size, p.stat().st_mtime_ns] for rel, p in files.items()})
        commit = hashlib.sha1(f"{repo_id}\0{listing}".encode()).hexdigest()
        self.repos[repo_id] = Repo(folder, commit, files)
        return commit

    @property
    def bytes_sent(self) -> int:
        with self._lock:
            return self._sent

    def reset(self) -> None:
        with self._lock:
            self.served.clear()
            self._sent = 0

    def _record(self, served: Served) -> None:
        with self._lock:
            self.served.append(served)

    def _take(self, n: int) -> bool:
        """Reserve ``n`` body bytes against the budget; False: over it, refuse."""
        with self._lock:
            if self.budget is not None and self._sent + n > self.budget:
                return False
            self._sent += n
            return True


INFO = re.compile(r"^/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?/?$")
TREE = re.compile(r"^/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?$")
RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")
RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


def _handler(hub: HubServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the client pools connections

        def log_message(self, *args) -> None:  # the record is ``hub.served``
            pass

        def do_HEAD(self) -> None:
            self._route(head=True)

        def do_GET(self) -> None:
            self._route(head=False)

        # -- answers -----------------------------------------------------------------------------

        def _send(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False,
                  rng: str | None = None) -> None:
            if not head and body and not hub._take(len(body)):
                return self._over_budget(len(body), rng)
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)
            hub._record(Served(self.command, self.path, rng, status, 0 if head else len(body)))

        def _error(self, status: int, code: str | None, message: str, head: bool) -> None:
            headers = {"Content-Type": "application/json", "X-Error-Message": message}
            if code:
                headers["X-Error-Code"] = code
            self._send(status, json.dumps({"error": message}).encode(), headers, head)

        def _over_budget(self, n: int, rng: str | None) -> None:
            message = f"stand-in Hub: sending {n} more bytes would pass the budget of {hub.budget}"
            body = json.dumps({"error": message}).encode()
            self.send_response(403)
            self.send_header("Content-Type", "application/json")
            self.send_header("X-Error-Message", message)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            hub._record(Served(self.command, self.path, rng, 403, len(body)))

        def _json(self, data, head: bool) -> None:
            self._send(200, json.dumps(data).encode(), {"Content-Type": "application/json"}, head)

        # -- routes ------------------------------------------------------------------------------

        def _repo(self, repo_id: str, rev: str | None, head: bool) -> Repo | None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._error(404, "RepoNotFound", "Repository not found", head)
                return None
            if rev not in (None, "main", repo.commit):
                self._error(404, "RevisionNotFound", "Invalid rev id: " + rev, head)
                return None
            return repo

        def _route(self, head: bool) -> None:
            parts = urlsplit(self.path)
            path, query = unquote(parts.path), parts.query
            if m := INFO.match(path):
                repo = self._repo(m[1], m[2], head)
                if repo is not None:
                    blobs = "blobs=" in query
                    self._json({"id": m[1], "modelId": m[1], "sha": repo.commit, "private": False,
                                "siblings": [{"rfilename": rel, **repo.entry(rel, blobs)} for rel in repo.files]}, head)
            elif m := TREE.match(path):
                repo = self._repo(m[1], m[2], head)
                if repo is not None:
                    under = (m[3] or "").strip("/")
                    recursive = "recursive=true" in query.lower() or "recursive=1" in query
                    rows = []
                    for rel in repo.files:
                        inside = rel[len(under) + 1:] if under else rel
                        if under and not rel.startswith(under + "/"):
                            continue
                        if "/" in inside and not recursive:
                            continue
                        e = repo.entry(rel, blobs=True)
                        rows.append({"type": "file", "path": rel, "size": e["size"], "oid": e["blobId"],
                                     **({"lfs": {"oid": e["lfs"]["sha256"], "size": e["size"], "pointerSize": 134}}
                                        if "lfs" in e else {})})
                    self._json(rows, head)
            elif m := RESOLVE.match(path):
                repo = self._repo(m[1], m[2], head)
                if repo is not None:
                    self._file(repo, m[3], head)
            else:
                self._error(404, None, f"no route for {path}", head)

        def _file(self, repo: Repo, rel: str, head: bool) -> None:
            if rel not in repo.files:
                return self._error(404, "EntryNotFound", f"{rel} does not exist", head)
            path = repo.files[rel]
            size = path.stat().st_size
            headers = {"X-Repo-Commit": repo.commit, "ETag": f'"{repo.etag(rel)}"', "Accept-Ranges": "bytes",
                       "Content-Type": "application/octet-stream"}
            rng = self.headers.get("Range")
            lo, hi, status = 0, size - 1, 200
            if rng:
                m = RANGE.match(rng.strip())
                if m is None or int(m[1]) >= size:
                    return self._error(416, None, f"range {rng} not satisfiable for {size} bytes", head)
                lo, hi, status = int(m[1]), min(int(m[2]) if m[2] else size - 1, size - 1), 206
                headers["Content-Range"] = f"bytes {lo}-{hi}/{size}"
            n = hi - lo + 1
            if head:
                self.send_response(200)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(size))
                self.end_headers()
                hub._record(Served("HEAD", self.path, rng, 200, 0))
                return
            if not hub._take(n):
                return self._over_budget(n, rng)
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(n))
            self.end_headers()
            with path.open("rb") as f:
                f.seek(lo)
                left = n
                while left:
                    chunk = f.read(min(CHUNK, left))
                    if not chunk:
                        break
                    self.wfile.write(chunk)
                    left -= len(chunk)
            hub._record(Served("GET", self.path, rng, status, n))

    return Handler
