"""HTTP for ``verify``: one request under one deadline, and vLLM's Prometheus counters.

``--timeout`` bounds a whole request: connecting, sending, the status line, the headers and every
byte of the body. urllib's timeout bounds each socket operation only, so a server that sends a
byte every few seconds holds a client for as long as it likes. Here each request has a deadline:
every read of the body waits at most the time left (the socket's timeout is set again before each
read, and each read returns after one receive), and a watchdog shuts the socket down at the
deadline, which ends a read blocked anywhere inside ``http.client`` (the status line, a header
trickled byte by byte). Whatever the server does, the request ends by its deadline.

An HTTP error status is raised as ``urllib.error.HTTPError`` (with the body), as urllib does, so
that callers word it (``raise_if_refused`` for 401/403); nothing answering, a connection that
breaks and a passed deadline are ``CannotVerify`` (exit 3).
"""
from __future__ import annotations

import http.client
import io
import json
import socket
import threading
import time
import urllib.error
from urllib.parse import urlsplit, urlunsplit

from hybrid_build.core.api_key import bearer
from hybrid_build.core.errors import CannotVerify, UserError

READ_BYTES = 1 << 16


def one_line(text, limit: int = 200) -> str:
    return " ".join(str(text).split())[:limit]


def check_url(url: str) -> str:
    """``url`` if it is an http(s) URL with a host and a valid port; else a ``UserError`` (exit 2)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a port that is not a number or out of range
    except ValueError as e:
        raise UserError(f"{url}: not a valid URL ({e})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UserError(f"{url}: not an http(s) URL")
    return url


class Exchange:
    """One request under one deadline. ``connect()`` may come first (a batch of requests sent at
    once connects every one before any is sent); ``result()`` sends, reads and returns (status, body)."""

    def __init__(self, url: str, payload: dict | None = None, api_key: str | None = None, timeout: float = 120.0,
                 method: str | None = None):
        self.url, self.timeout = url, timeout
        self.deadline = time.monotonic() + timeout
        self.body = None if payload is None else json.dumps(payload).encode()
        self.method = method or ("GET" if payload is None else "POST")
        self.headers = {"Content-Type": "application/json", **bearer(api_key)}
        self.conn: http.client.HTTPConnection | None = None
        self.sock: socket.socket | None = None
        self.expired = False
        self.watchdog: threading.Timer | None = None

    def left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0 or self.expired:
            raise self._late()
        return left

    def _late(self) -> CannotVerify:
        return CannotVerify(f"could not verify: {self.url} did not answer within {self.timeout:g} s (--timeout is "
                            "a deadline for the whole request)")

    def _expire(self) -> None:
        self.expired = True
        if self.sock is not None:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)  # wakes a read blocked on it, wherever it is
            except OSError:
                pass

    def connect(self) -> "Exchange":
        parts = urlsplit(self.url)
        kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        self.conn = kind(parts.hostname, parts.port, timeout=self.left())
        self.watchdog = threading.Timer(self.left(), self._expire)
        self.watchdog.daemon = True
        self.watchdog.start()
        try:
            self.conn.connect()
        except OSError as e:
            self.close()
            if self.expired or time.monotonic() >= self.deadline:
                raise self._late() from None
            raise CannotVerify(f"could not verify: no server answers at {self.url} ({one_line(e)})") from None
        self.sock = self.conn.sock
        if self.expired:  # the watchdog fired before the socket was known
            self._expire()
        return self

    def result(self) -> tuple[int, bytes]:
        if self.conn is None:
            self.connect()
        parts = urlsplit(self.url)
        path = urlunsplit(("", "", parts.path or "/", parts.query, ""))
        try:
            self.sock.settimeout(self.left())
            self.conn.request(self.method, path, body=self.body, headers=self.headers)
            self.sock.settimeout(self.left())
            resp = self.conn.getresponse()
            chunks = []
            while True:
                self.sock.settimeout(self.left())
                chunk = resp.read1(READ_BYTES)
                if not chunk:
                    break
                chunks.append(chunk)
            self.left()
        except (http.client.HTTPException, OSError) as e:
            if self.expired or time.monotonic() >= self.deadline:
                raise self._late() from None
            raise CannotVerify(f"could not verify: {self.url}: the connection broke ({one_line(e) or type(e).__name__})"
                               ) from None
        finally:
            self.close()
        body = b"".join(chunks)
        if resp.status >= 400:
            raise urllib.error.HTTPError(self.url, resp.status, resp.reason, resp.headers, io.BytesIO(body))
        return resp.status, body

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.cancel()
        if self.conn is not None:
            self.conn.close()
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass


def fetch(url: str, payload: dict | None = None, api_key: str | None = None, timeout: float = 120.0) -> bytes:
    """The body of one request that must end within ``timeout`` seconds (module docstring)."""
    return Exchange(url, payload, api_key, timeout).result()[1]


def fetch_json(url: str, payload: dict | None = None, api_key: str | None = None, timeout: float = 120.0):
    body = fetch(url, payload, api_key, timeout)
    return parse_json(url, body)


def parse_json(url: str, body: bytes):
    try:
        return json.loads(body.decode("utf-8", "replace"))
    except ValueError:
        raise CannotVerify(f"could not verify: {url} did not answer JSON (not an OpenAI-compatible server?)") from None


def http_detail(e: urllib.error.HTTPError) -> str:
    try:
        body = e.read().decode("utf-8", "replace")
    except (OSError, ValueError):
        body = ""
    return f"HTTP {e.code}" + (f": {one_line(body)}" if body.strip() else "")


# ------------------------------------------------------------------------------------ /metrics

# vLLM's prefix-cache counters (v1/metrics/loggers.py, PrometheusStatLogger, in 0.23.0, 0.25.1, 0.26.0
# and 0.33.0): tokens looked up in the cache and tokens found there, summed over engines. The
# scheduler counts them in KVCacheManager.get_computed_blocks, which returns before counting for a
# request that skips reading the cache (one asking for prompt log-probabilities) or when caching is
# off: no queries means no lookup happened.
PREFIX_QUERIES = "vllm:prefix_cache_queries"
PREFIX_HITS = "vllm:prefix_cache_hits"


def metrics_url(base_url: str) -> str:
    """vLLM serves ``/metrics`` at the server root, beside ``/v1``."""
    parts = urlsplit(base_url.rstrip("/"))
    path = parts.path[:-3] if parts.path.endswith("/v1") else parts.path
    return urlunsplit((parts.scheme, parts.netloc, path.rstrip("/") + "/metrics", "", ""))


def counter_sum(text: str, name: str) -> float | None:
    """The sum over label sets of counter ``name`` (``<name>_total`` in the exposition, the bare
    name accepted too) in a Prometheus text; None when the text has no sample of it."""
    found, total = False, 0.0
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        metric = line.split("{", 1)[0].split(None, 1)[0]
        if metric not in (name + "_total", name):
            continue
        try:
            total += float(line.rsplit("}", 1)[-1].split()[0])
            found = True
        except (IndexError, ValueError):
            continue
    return total if found else None


def prefix_cache_counts(base_url: str, api_key: str | None, timeout: float) -> tuple[float, float] | None:
    """(queries, hits) of the server's prefix cache now, in tokens; None when it serves no
    ``/metrics`` or no such counters (not vLLM, or stats off)."""
    try:
        text = fetch(metrics_url(base_url), None, api_key, timeout).decode("utf-8", "replace")
    except urllib.error.HTTPError:
        return None
    queries, hits = counter_sum(text, PREFIX_QUERIES), counter_sum(text, PREFIX_HITS)
    return None if queries is None or hits is None else (queries, hits)
