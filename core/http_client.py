"""The one HTTP client of hybrid-build: every request to a server (``verify``, ``bench``, ``serve``'s
probes) goes through here, on httpx, and every answer that is not what the protocol says ends as one
typed error (``core/errors.py``), never a traceback.

API::

    with HttpClient(api_key=None, timeout=120.0, max_bytes=MAX_BYTES, connections=64) as c:
        c.get(url) -> Answer                  # status < 300; Answer(url, status, headers, body)
        c.post(url, payload) -> Answer        # payload: a JSON-able dict, sent as JSON
        c.get_json(url) / c.post_json(url, payload) -> the parsed JSON (``parse_json``)
        c.stream_events(url, payload) -> Iterator[dict]   # SSE: each ``data:`` event's JSON, to [DONE]
        c.metrics(url) -> Metrics | None      # Prometheus text (``parse_metrics``); None on 404
    async with AsyncHttpClient(...) as c:    # the same methods, awaited; ``stream_events`` is an
        ...                                   # async iterator: many conversations on one event loop

    shared_client(api_key, timeout) -> HttpClient   # one pooled client per key for the process
    parse_json(url, body) / parse_metrics(url, text) / metrics_url(base) / check_url(url) / one_line(x)
    Metrics.counter(name) -> float | None     # a counter summed over its label sets
    Metrics.samples(name) -> [(labels, value)]

**Per request**: ``timeout`` is a deadline for the whole request (connecting, sending, the status
line, every header byte and every body byte, an SSE stream to its end), not per read: httpx's
timeouts bound each socket operation, so a server that trickles a byte at a time would hold a
client as long as it likes. The deadline rides in the timeout value httpx hands to each socket
operation (``_Deadline``, a float that knows when the request ends); the transport's network
streams wait at most the time left. No watchdog thread. The body is read at most ``max_bytes``
(decoded) bytes: a larger answer ends the read there, so memory stays bounded whatever the
server sends. Connections are pooled per client (``connections`` at once, kept alive). A
redirect is never followed: the API key goes to the URL given and nowhere else. Proxies from the
environment are not used: the servers are addressed directly.

**Errors** (exit codes: ``core/errors.py``):

- ``ServerUnreachable`` (exit 3): nothing answers, the connection broke, the deadline passed;
- ``ProtocolViolation`` (exit 3): an answer the protocol does not allow: an HTML page, not JSON, JSON
  nested too deep, a body that is not UTF-8, cut off or over ``max_bytes``; a ``/metrics`` that is
  not Prometheus text;
- ``RedirectRefused`` (exit 2): a redirect (3xx), not followed;
- ``KeyRefused`` (exit 2): 401/403, the API key;
- ``ErrorStatus`` (exit 1): any other status >= 400 (``.status``, ``.detail``: the body's first line,
  ``.message``: the server's own words from a JSON error body, ``error_message``);
- ``UserError`` (exit 2): a URL that is not http(s) with a host and a port.

``ServerUnreachable`` and ``ProtocolViolation`` are both ``CannotRun`` and ``CannotVerify``, so
``verify`` (a path that could not run) and ``bench`` catch them as they catch their own.

``TRANSPORT``: None sends over the network; a test sets an ``httpx.MockTransport`` to run a server in
process (a fake clock), and every client made after uses it.
"""
from __future__ import annotations

import codecs
import json
import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import AsyncIterator, Callable, Iterator
from urllib.parse import urlsplit, urlunsplit

import httpcore
import httpx

from .api_key import HINT, REFUSED, bearer, refused
from .bounded_read import depth_over
from .errors import ErrorStatus, ProtocolViolation, RedirectRefused, ServerUnreachable, UserError

MAX_BYTES = 64 << 20  # an answer of verify's longest prompt log-probabilities is a few MB
CONNECTIONS = 64
DETAIL_BYTES = 4096  # of an error status's body, for its one line
TRANSPORT: httpx.BaseTransport | httpx.AsyncBaseTransport | None = None


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


def server_of(url: str) -> str:
    """The server a request URL belongs to, as users give it: up to ``/v1`` where the path has it."""
    parts = urlsplit(url)
    path = parts.path[:parts.path.index("/v1") + 3] if "/v1" in parts.path else ""
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def metrics_url(base_url: str) -> str:
    """vLLM serves ``/metrics`` at the server root, beside ``/v1``."""
    parts = urlsplit(base_url.rstrip("/"))
    path = parts.path[:-3] if parts.path.endswith("/v1") else parts.path
    return urlunsplit((parts.scheme, parts.netloc, path.rstrip("/") + "/metrics", "", ""))


# ------------------------------------------------------------------------------------ the deadline

class _Deadline(float):
    """A timeout (its value, seconds) that knows when its request ends: httpx passes it unchanged to
    every socket operation of the request, and the streams below wait at most the time left."""

    at: float

    def __new__(cls, seconds: float) -> "_Deadline":
        self = super().__new__(cls, seconds)
        self.at = time.monotonic() + seconds
        return self

    def left(self) -> float:
        return self.at - time.monotonic()


def _left(timeout, late: type[Exception]):
    if not isinstance(timeout, _Deadline):
        return timeout
    left = timeout.left()
    if left <= 0:
        raise late("the request's deadline passed")
    return left


class _Stream(httpcore.NetworkStream):
    def __init__(self, stream: httpcore.NetworkStream):
        self._s = stream

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._s.read(max_bytes, _left(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._s.write(buffer, _left(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._s.close()

    def start_tls(self, ssl_context, server_hostname=None, timeout=None):
        return _Stream(self._s.start_tls(ssl_context, server_hostname, _left(timeout, httpcore.ConnectTimeout)))

    def get_extra_info(self, info):
        return self._s.get_extra_info(info)


class _Backend(httpcore.NetworkBackend):
    def __init__(self, connected: Callable[[], None] | None = None):
        self._b, self._connected = httpcore.SyncBackend(), connected

    def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        stream = _Stream(self._b.connect_tcp(host, port, _left(timeout, httpcore.ConnectTimeout), local_address,
                                             socket_options))
        if self._connected is not None:
            self._connected()
        return stream

    def connect_unix_socket(self, path, timeout=None, socket_options=None):
        return _Stream(self._b.connect_unix_socket(path, _left(timeout, httpcore.ConnectTimeout), socket_options))

    def sleep(self, seconds: float) -> None:
        self._b.sleep(seconds)


class _AsyncStream(httpcore.AsyncNetworkStream):
    def __init__(self, stream: httpcore.AsyncNetworkStream):
        self._s = stream

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return await self._s.read(max_bytes, _left(timeout, httpcore.ReadTimeout))

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        await self._s.write(buffer, _left(timeout, httpcore.WriteTimeout))

    async def aclose(self) -> None:
        await self._s.aclose()

    async def start_tls(self, ssl_context, server_hostname=None, timeout=None):
        return _AsyncStream(await self._s.start_tls(ssl_context, server_hostname,
                                                    _left(timeout, httpcore.ConnectTimeout)))

    def get_extra_info(self, info):
        return self._s.get_extra_info(info)


class _AsyncBackend(httpcore.AsyncNetworkBackend):
    def __init__(self):
        self._b = httpcore.AnyIOBackend()

    async def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        return _AsyncStream(await self._b.connect_tcp(host, port, _left(timeout, httpcore.ConnectTimeout),
                                                      local_address, socket_options))

    async def connect_unix_socket(self, path, timeout=None, socket_options=None):
        return _AsyncStream(await self._b.connect_unix_socket(path, _left(timeout, httpcore.ConnectTimeout),
                                                              socket_options))

    async def sleep(self, seconds: float) -> None:
        await self._b.sleep(seconds)


def _pool_args(connections: int) -> dict:
    return {"ssl_context": httpx.create_ssl_context(), "max_connections": connections,
            "max_keepalive_connections": connections, "keepalive_expiry": 5.0}


class _Transport(httpx.HTTPTransport):
    """httpx's transport over the deadline-keeping streams (its pool, ``_pool``, built with them)."""

    def __init__(self, connections: int, connected: Callable[[], None] | None = None):
        super().__init__(trust_env=False)
        self._pool = httpcore.ConnectionPool(**_pool_args(connections), network_backend=_Backend(connected))


class _AsyncTransport(httpx.AsyncHTTPTransport):
    def __init__(self, connections: int):
        super().__init__(trust_env=False)
        self._pool = httpcore.AsyncConnectionPool(**_pool_args(connections), network_backend=_AsyncBackend())


# ------------------------------------------------------------------------------------ answers

@dataclass(frozen=True)
class Answer:
    """A whole answer (status < 300): its body, at most the client's ``max_bytes``."""
    url: str
    status: int
    headers: httpx.Headers = field(repr=False)
    body: bytes = field(repr=False)

    def text(self) -> str:
        return decode_utf8(self.url, self.body)

    def json(self):
        return parse_json(self.url, self.body, self.headers.get("content-type", ""))


def decode_utf8(url: str, body: bytes) -> str:
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ProtocolViolation(f"{url} answered bytes that are not UTF-8 (at byte {e.start})") from None


def _looks_html(body: bytes, content_type: str = "") -> bool:
    head = body[:256].lstrip().lower()
    return "html" in content_type.lower() or head.startswith((b"<!doctype", b"<html", b"<head", b"<body"))


def parse_json(url: str, body: bytes, content_type: str = ""):
    """The JSON of an answer; one ``ProtocolViolation`` line for an HTML page, bytes that are not UTF-8,
    a body cut off or not JSON, or JSON nested deeper than the parser goes."""
    if _looks_html(body, content_type):
        raise ProtocolViolation(f"{url} answered an HTML page, not JSON (not an OpenAI-compatible server: "
                                "a proxy's or a login page?)")
    text = decode_utf8(url, body)
    try:
        if depth_over(text):  # core/bounded_read's limit, measured before the parser recurses
            raise RecursionError
        return json.loads(text)
    except RecursionError:
        raise ProtocolViolation(f"{url} answered JSON nested too deep to read ({len(body)} bytes)") from None
    except ValueError as e:
        where = getattr(e, "pos", None)
        cut = isinstance(where, int) and where >= len(text.rstrip()) and text.strip()
        what = "JSON cut off" if cut else "no JSON" if not text.strip() else f"not JSON ({one_line(e, 80)})"
        raise ProtocolViolation(f"{url} answered {what} (not an OpenAI-compatible server?)") from None


def error_message(body: bytes) -> str | None:
    """The server's own words in an error body: OpenAI's and vLLM's ``{"error": {"message": ...}}``,
    vLLM's older ``{"message": ...}``, FastAPI's ``{"detail": ...}`` or ``{"error": "..."}``; None for
    anything else (a body cut at ``DETAIL_BYTES``, HTML, text). Unbounded and raw: a caller bounds it."""
    try:
        text = body.decode("utf-8")
        data = None if depth_over(text) else json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    err = data.get("error")
    for found in ((err or {}).get("message") if isinstance(err, dict) else err, data.get("message"),
                  data.get("detail")):
        if isinstance(found, str) and found.strip():
            return found
    return None


@dataclass(frozen=True)
class Metrics:
    """A Prometheus text exposition, parsed by ``prometheus_client``: its samples by name."""
    url: str
    by_name: dict = field(repr=False)

    def samples(self, name: str) -> list[tuple[dict, float]]:
        """A counter's samples: ``<name>_total`` in the exposition (the bare name accepted too)."""
        return self.by_name.get(name + "_total", self.by_name.get(name, []))

    def counter(self, name: str) -> float | None:
        """The sum over label sets of counter ``name``; None when the text has no sample of it."""
        found = self.samples(name)
        return sum(v for _, v in found) if found else None


def parse_metrics(url: str, body: bytes, content_type: str = "") -> Metrics:
    """``/metrics`` through ``prometheus_client``'s parser; anything else (JSON, HTML, garbage) is one
    ``ProtocolViolation`` line saying it is not Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    stripped = body.lstrip()[:1]
    if _looks_html(body, content_type) or stripped in (b"{", b"["):
        kind = "an HTML page" if _looks_html(body, content_type) else "JSON"
        raise ProtocolViolation(f"{url} answered {kind}, not Prometheus text (not vLLM's /metrics)")
    text = decode_utf8(url, body)
    out: dict[str, list[tuple[dict, float]]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    except (ValueError, TypeError, IndexError, KeyError) as e:
        raise ProtocolViolation(f"{url} answered text that is not Prometheus text ({one_line(e, 80)})") from None
    return Metrics(url, out)


# ------------------------------------------------------------------------------------ SSE

class _Events:
    """Server-sent events from byte chunks: lines end in CR, LF or CRLF, ``:`` starts a comment, and
    each ``data:`` line is one event's payload, as OpenAI-compatible servers (vLLM, SGLang, OpenAI)
    send them (one JSON object a line; some omit the blank line between the last two). The
    caller's byte cap bounds the buffer."""

    def __init__(self, url: str):
        self.url, self.buf = url, ""
        self.utf8 = codecs.getincrementaldecoder("utf-8")("strict")

    def feed(self, chunk: bytes, final: bool = False) -> list[str]:
        try:
            self.buf += self.utf8.decode(chunk, final)
        except UnicodeDecodeError:
            raise ProtocolViolation(f"{self.url} streamed bytes that are not UTF-8") from None
        lines = self.buf.replace("\r\n", "\n").replace("\r", "\n").split("\n")
        self.buf = "" if final else lines.pop()
        out = []
        for line in lines:
            name, _, value = line.partition(":")
            if name == "data":
                out.append(value[1:] if value.startswith(" ") else value)
        return out


class _CappedBody:
    """A whole answer read under the byte cap and the deadline, for the sync and async clients alike."""

    def __init__(self, client: "_Base", url: str, t: httpx.Timeout):
        self.client, self.url, self.t, self.chunks, self.n = client, url, t, [], 0

    def feed(self, chunk: bytes) -> None:
        self.n += len(chunk)
        if self.n > self.client.max_bytes:
            raise self.client._too_big(self.url)
        if self.t.read.left() <= 0:
            raise self.client._late(self.url, self.t)
        self.chunks.append(chunk)

    def bytes(self) -> bytes:
        return b"".join(self.chunks)


class _EventStream:
    """One streamed answer read as events: the byte cap, the end at ``[DONE]`` (what follows is read
    and dropped, so the connection goes back to the pool) and the deadline, for the sync and async
    clients alike (they differ only in how they iterate the body)."""

    def __init__(self, client: "_Base", url: str, t: httpx.Timeout):
        self.client, self.url, self.t = client, url, t
        self.events, self.n, self.done = _Events(url), 0, False

    def feed(self, chunk: bytes, final: bool = False) -> list[dict]:
        self.n += len(chunk)
        if self.n > self.client.max_bytes:
            raise self.client._too_big(self.url)
        out = []
        for data in [] if self.done else self.events.feed(chunk, final):
            self.done = self.done or data.strip() == "[DONE]"
            if not self.done:
                out.append(_event_json(self.url, data))
        if not final and self.t.read.left() <= 0:
            raise self.client._late(self.url, self.t)
        return out


def _event_json(url: str, data: str):
    try:
        if depth_over(data):
            raise RecursionError
        event = json.loads(data)
    except RecursionError:
        raise ProtocolViolation(f"{url} streamed an event nested too deep to read") from None
    except ValueError:
        raise ProtocolViolation(f"{url} streamed an event that is not JSON ({len(data)} characters)") from None
    if not isinstance(event, dict):
        raise ProtocolViolation(f"{url} streamed an event that is not a JSON object")
    return event


# ------------------------------------------------------------------------------------ the clients

class _Base:
    def __init__(self, api_key: str | None = None, timeout: float = 120.0, max_bytes: int = MAX_BYTES,
                 connections: int = CONNECTIONS, refused_hint: str = HINT):
        self.api_key, self.timeout, self.max_bytes, self.hint = api_key, timeout, max_bytes, refused_hint
        self.connections = connections
        self.headers = {"Accept-Encoding": "identity", **bearer(api_key)}

    def _timeout(self, timeout: float | None) -> httpx.Timeout:
        return httpx.Timeout(_Deadline(self.timeout if timeout is None else timeout))

    def _late(self, url: str, t: httpx.Timeout) -> ServerUnreachable:
        return ServerUnreachable(f"{url} did not answer within {float(t.read):g} s (the timeout is a deadline for "
                                 f"the whole request)")

    def _failed(self, url: str, e: Exception, t: httpx.Timeout) -> Exception:
        """The typed error for an httpx exception."""
        if isinstance(e, httpx.TimeoutException) and not isinstance(e, httpx.ConnectTimeout):
            return self._late(url, t)
        if isinstance(e, httpx.ConnectTimeout) and t.read.left() <= 0:
            return self._late(url, t)
        if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)):
            return ServerUnreachable(f"no server answers at {url} ({one_line(e) or type(e).__name__})")
        if isinstance(e, httpx.RemoteProtocolError):
            if "without sending" in str(e) and "complete" not in str(e):
                return ServerUnreachable(f"{url} closed the connection without answering")
            return ProtocolViolation(f"{url} broke the HTTP protocol: the answer was cut off or malformed "
                                     f"({one_line(e, 120)})")
        if isinstance(e, httpx.DecodingError):
            return ProtocolViolation(f"{url} answered a body that does not decode ({one_line(e, 120)})")
        if isinstance(e, (httpx.InvalidURL, httpx.UnsupportedProtocol)):
            return UserError(f"{url}: not a valid http(s) URL ({one_line(e, 120)})")
        return ServerUnreachable(f"{url}: the connection broke ({one_line(e) or type(e).__name__})")

    def _status(self, url: str, r: httpx.Response, detail: bytes) -> Exception | None:
        """The error for a status that is not a success; None for 2xx."""
        if r.status_code < 300:
            return None
        if r.status_code < 400:
            where = r.headers.get("location", "")
            to = f" to {one_line(where, 120)}" if where else ""
            return RedirectRefused(f"{url} answered HTTP {r.status_code}, a redirect{to}: not followed (the request "
                                   "and its API key go only to the URL given); give the server's own URL")
        if r.status_code in REFUSED:
            return refused(server_of(url), r.status_code, bool(self.api_key), self.hint)
        text = detail.decode("utf-8", "replace")
        if _looks_html(detail, r.headers.get("content-type", "")):
            text = "an HTML page"
        return ErrorStatus(url, r.status_code, one_line(text, 300), error_message(detail))

    def _request(self, method: str, url: str, payload) -> httpx.Request:
        body = None if payload is None else json.dumps(payload).encode()
        headers = self.headers if body is None else {**self.headers, "Content-Type": "application/json"}
        return self._client.build_request(method, url, content=body, headers=headers)

    def _too_big(self, url: str) -> ProtocolViolation:
        return ProtocolViolation(f"{url} answered more than {self.max_bytes / 2**20:g} MiB: not read further "
                                 "(the client's body-size cap)")

    def _declared(self, url: str, r: httpx.Response) -> None:
        n = r.headers.get("content-length", "")
        if n.isdigit() and int(n) > self.max_bytes:
            raise self._too_big(url)


class HttpClient(_Base):
    """A pooled, synchronous client (module docstring): one per server and command; thread-safe, so
    streams at once may share it (``connections`` of them). ``connected``, where given, is called on
    the thread of each new connection once it is open and before a byte is sent: requests meant to
    arrive together wait there (a barrier) until every one is connected."""

    def __init__(self, *args, connected: Callable[[], None] | None = None, **kw):
        super().__init__(*args, **kw)
        self._client = httpx.Client(transport=TRANSPORT or _Transport(self.connections, connected),
                                    follow_redirects=False, trust_env=False)

    def __enter__(self) -> "HttpClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._client.close()

    def _send(self, method: str, url: str, payload, timeout: float | None):
        """(response, deadline) for a request whose status is a success; the caller reads the body."""
        t = self._timeout(timeout)
        req = self._request(method, url, payload)
        req.extensions["timeout"] = t.as_dict()
        try:
            r = self._client.send(req, stream=True)
        except httpx.HTTPError as e:
            raise self._failed(url, e, t) from None
        try:
            if r.status_code >= 300:
                detail = b"" if r.status_code < 400 else self._head(url, r, t)
                raise self._status(url, r, detail)
            self._declared(url, r)
        except BaseException:
            r.close()
            raise
        return r, t

    def _head(self, url: str, r: httpx.Response, t) -> bytes:
        out = b""
        try:
            for chunk in r.iter_bytes():
                out += chunk
                if len(out) >= DETAIL_BYTES:
                    break
        except httpx.HTTPError:
            pass
        return out[:DETAIL_BYTES]

    def _body(self, url: str, r: httpx.Response, t) -> bytes:
        body = _CappedBody(self, url, t)
        try:
            for chunk in r.iter_bytes():
                body.feed(chunk)
        except httpx.HTTPError as e:
            raise self._failed(url, e, t) from None
        finally:
            r.close()
        return body.bytes()

    def request(self, method: str, url: str, payload=None, timeout: float | None = None) -> Answer:
        r, t = self._send(method, url, payload, timeout)
        body = self._body(url, r, t)
        return Answer(url, r.status_code, r.headers, body)

    def get(self, url: str, timeout: float | None = None) -> Answer:
        return self.request("GET", url, None, timeout)

    def post(self, url: str, payload, timeout: float | None = None) -> Answer:
        return self.request("POST", url, payload, timeout)

    def get_json(self, url: str, timeout: float | None = None):
        return self.get(url, timeout).json()

    def post_json(self, url: str, payload, timeout: float | None = None):
        return self.post(url, payload, timeout).json()

    def metrics(self, url: str, timeout: float | None = None) -> Metrics | None:
        """The Prometheus text at ``url`` parsed; None when the server has none there (404)."""
        try:
            a = self.get(url, timeout)
        except ErrorStatus as e:
            if e.status == 404:
                return None
            raise
        return parse_metrics(url, a.body, a.headers.get("content-type", ""))

    def stream_events(self, url: str, payload, timeout: float | None = None) -> Iterator[dict]:
        """A streamed POST's server-sent events, each ``data:`` parsed as a JSON object, until
        ``[DONE]`` or the end; the whole stream under one deadline and the byte cap. The body is read
        to its end after ``[DONE]``, so that the connection goes back to the pool (a response closed
        before its end closes its connection: the next request would connect again)."""
        r, t = self._send("POST", url, payload, timeout)
        stream = _EventStream(self, url, t)
        try:
            for chunk in r.iter_bytes():
                yield from stream.feed(chunk)
            yield from stream.feed(b"", final=True)
        except httpx.HTTPError as e:
            raise self._failed(url, e, t) from None
        finally:
            r.close()


@lru_cache(maxsize=16)
def _shared(api_key: str | None, timeout: float, connections: int, transport) -> HttpClient:
    return HttpClient(api_key=api_key, timeout=timeout, connections=connections)


def shared_client(api_key: str | None = None, timeout: float = 120.0, connections: int = CONNECTIONS) -> HttpClient:
    """One pooled client per key, deadline and pool size for the whole process (a command's
    requests reuse its connections), made again when a test sets another ``TRANSPORT``."""
    return _shared(api_key, timeout, connections, TRANSPORT)


class AsyncHttpClient(_Base):
    """The same client on asyncio: many conversations at once on one event loop, one pool."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._client = httpx.AsyncClient(transport=TRANSPORT or _AsyncTransport(self.connections),
                                         follow_redirects=False, trust_env=False)

    async def __aenter__(self) -> "AsyncHttpClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _send(self, method: str, url: str, payload, timeout: float | None):
        t = self._timeout(timeout)
        req = self._request(method, url, payload)
        req.extensions["timeout"] = t.as_dict()
        try:
            r = await self._client.send(req, stream=True)
        except httpx.HTTPError as e:
            raise self._failed(url, e, t) from None
        try:
            if r.status_code >= 300:
                detail = b""
                if r.status_code >= 400:
                    try:
                        async for chunk in r.aiter_bytes():
                            detail += chunk
                            if len(detail) >= DETAIL_BYTES:
                                break
                    except httpx.HTTPError:
                        pass
                raise self._status(url, r, detail[:DETAIL_BYTES])
            self._declared(url, r)
        except BaseException:
            await r.aclose()
            raise
        return r, t

    async def request(self, method: str, url: str, payload=None, timeout: float | None = None) -> Answer:
        r, t = await self._send(method, url, payload, timeout)
        body = _CappedBody(self, url, t)
        try:
            async for chunk in r.aiter_bytes():
                body.feed(chunk)
        except httpx.HTTPError as e:
            raise self._failed(url, e, t) from None
        finally:
            await r.aclose()
        return Answer(url, r.status_code, r.headers, body.bytes())

    async def get(self, url: str, timeout: float | None = None) -> Answer:
        return await self.request("GET", url, None, timeout)

    async def post(self, url: str, payload, timeout: float | None = None) -> Answer:
        return await self.request("POST", url, payload, timeout)

    async def get_json(self, url: str, timeout: float | None = None):
        return (await self.get(url, timeout)).json()

    async def post_json(self, url: str, payload, timeout: float | None = None):
        return (await self.post(url, payload, timeout)).json()

    async def metrics(self, url: str, timeout: float | None = None) -> Metrics | None:
        try:
            a = await self.get(url, timeout)
        except ErrorStatus as e:
            if e.status == 404:
                return None
            raise
        return parse_metrics(url, a.body, a.headers.get("content-type", ""))

    async def stream_events(self, url: str, payload, timeout: float | None = None) -> AsyncIterator[dict]:
        r, t = await self._send("POST", url, payload, timeout)
        stream = _EventStream(self, url, t)
        try:
            async for chunk in r.aiter_bytes():
                for event in stream.feed(chunk):
                    yield event
            for event in stream.feed(b"", final=True):
                yield event
        except httpx.HTTPError as e:
            raise self._failed(url, e, t) from None
        finally:
            await r.aclose()
