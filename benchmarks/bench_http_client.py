"""The HTTP client's overhead: requests/s and time to the first streamed event through
``core/http_client`` against a bare ``httpx`` loop, measured in the same run against one local
stand-in server that answers at once (a child process: asyncio, HTTP/1.1 keep-alive).

Per concurrency (1, 16, 64 requests in flight on one event loop): ``--requests`` JSON GETs of
``/v1/models`` (requests/s) and streamed chat completions (4 SSE events each: the time from sending
to the first parsed event), through ``AsyncHttpClient`` (one pooled client: deadline, size cap, the
guarded JSON and SSE parsing) and through a bare ``httpx.AsyncClient`` (``response.json()``,
``aiter_lines`` + ``json.loads``), interleaved in ``--rounds`` rounds; medians over the rounds.
The ratio client / bare is the figure (goal: requests/s >= 0.9, TTFT <= 1.1). Where the stand-in
is the bottleneck (one Python process) both sides wait on it alike: the ratio then bounds the
client's cost from above only where it shows.

``python benchmarks/bench_http_client.py [--requests 1000] [--rounds 3] [--json OUT]``
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time

import httpx

MODELS = json.dumps({"object": "list", "data": [{"id": "qwen", "object": "model"}]}).encode()
EVENTS = b"".join(b"data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": f"t{i} "}}]}).encode()
                  + b"\n\n" for i in range(4)) + b"data: [DONE]\n\n"


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            if length:
                await reader.readexactly(length)
            if head.startswith(b"POST"):
                body, ctype = EVENTS, b"text/event-stream"
            else:
                body, ctype = MODELS, b"application/json"
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: " + ctype + b"\r\nContent-Length: "
                         + str(len(body)).encode() + b"\r\n\r\n" + body)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()


async def _serve() -> None:
    server = await asyncio.start_server(_handle, "127.0.0.1", 0, backlog=1024)
    print(f"READY {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


# ---- the two sides -------------------------------------------------------------------------------

async def bare_get(c: httpx.AsyncClient, url: str):
    r = await c.get(url)
    r.raise_for_status()
    return r.json()


async def bare_ttft(c: httpx.AsyncClient, url: str, body: dict) -> float:
    t0 = time.perf_counter()
    first = None
    async with c.stream("POST", url, json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                json.loads(line[5:])
                first = first if first is not None else time.perf_counter() - t0
    return first


async def client_ttft(c, url: str, body: dict) -> float:
    t0 = time.perf_counter()
    first = None
    async for _ in c.stream_events(url, body):
        first = first if first is not None else time.perf_counter() - t0
    return first


async def run_side(side: str, base: str, concurrency: int, n: int) -> tuple[float, float]:
    """(requests/s of the GETs, mean TTFT of the streams) for one side at one concurrency."""
    from hybrid_build.core.http_client import AsyncHttpClient

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    if side == "bare":
        c = httpx.AsyncClient(limits=limits, timeout=60.0)
        get, ttft, close = (lambda: bare_get(c, base + "/v1/models")), \
            (lambda: bare_ttft(c, base + "/v1/chat/completions", {"stream": True})), c.aclose
    else:
        c = AsyncHttpClient(timeout=60.0, connections=concurrency)
        get, ttft, close = (lambda: c.get_json(base + "/v1/models")), \
            (lambda: client_ttft(c, base + "/v1/chat/completions", {"stream": True})), c.aclose
    sem = asyncio.Semaphore(concurrency)

    async def bounded(fn):
        async with sem:
            return await fn()

    try:
        await asyncio.gather(*(bounded(get) for _ in range(concurrency)))  # warm the pool
        t0 = time.perf_counter()
        await asyncio.gather(*(bounded(get) for _ in range(n)))
        rps = n / (time.perf_counter() - t0)
        firsts = await asyncio.gather(*(bounded(ttft) for _ in range(max(n // 4, concurrency))))
    finally:
        await close()
    return rps, statistics.fmean(firsts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write the figures here as JSON")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        asyncio.run(_serve())
        return
    server = subprocess.Popen([sys.executable, __file__, "--serve"], stdout=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()
        base = f"http://127.0.0.1:{int(line.split()[1])}"
        rows = []
        for conc in (1, 16, 64):
            got: dict[str, list] = {"bare": [], "client": []}
            for _ in range(a.rounds):
                for side in ("bare", "client"):  # interleaved: drift hits both
                    got[side].append(asyncio.run(run_side(side, base, conc, a.requests)))
            med = {s: (statistics.median(r for r, _ in v), statistics.median(t for _, t in v)) for s, v in got.items()}
            rows.append({"concurrency": conc, "requests": a.requests, "rounds": a.rounds,
                         "bare_rps": med["bare"][0], "client_rps": med["client"][0],
                         "rps_ratio": med["client"][0] / med["bare"][0],
                         "bare_ttft_ms": med["bare"][1] * 1e3, "client_ttft_ms": med["client"][1] * 1e3,
                         "ttft_ratio": med["client"][1] / med["bare"][1]})
    finally:
        server.kill()
        server.wait()
    print(f"httpx {httpx.__version__}; stand-in: one asyncio process on 127.0.0.1; medians of {a.rounds} "
          f"interleaved rounds of {a.requests} GETs and {a.requests // 4} streams")
    print(f"{'conc':>4} {'bare req/s':>11} {'client req/s':>13} {'ratio':>6} {'bare TTFT ms':>13} "
          f"{'client TTFT ms':>15} {'ratio':>6}")
    for r in rows:
        print(f"{r['concurrency']:>4} {r['bare_rps']:>11.0f} {r['client_rps']:>13.0f} {r['rps_ratio']:>6.3f} "
              f"{r['bare_ttft_ms']:>13.3f} {r['client_ttft_ms']:>15.3f} {r['ttft_ratio']:>6.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"kind": "http client overhead", "httpx": httpx.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
