"""``hybrid-build bench``: speed and speculative acceptance of one server (one stream, or N at
once), the A/B of two (interleaved), or the A/B of two saved results."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hybrid_build.core.api_key import client_key
from hybrid_build.core.cli_support import (
    SECONDS,
    SEED,
    STREAMS,
    TOKENS,
    ExampleFormatter,
    add_json_flag,
    describe_os_error,
    emit_json,
    int_range,
    progress,
)
from hybrid_build.core.errors import UserError
from hybrid_build.core.limits import MAX_CONVERSATIONS
from hybrid_build.core.terminal_text import printable
from hybrid_build.core.user_paths import check_output_path

from .workloads import LOW_ACCEPTANCE_FRACTION, LOW_ACCEPTANCE_MIN_GAP, MAX_CONCURRENCY, MIN_RUNS_FOR_VERDICT, WORKLOADS


def register(sub, common) -> None:
    p = sub.add_parser(
        "bench", parents=[common], formatter_class=ExampleFormatter,
        help="measure decode and end-to-end tok/s and speculative acceptance; A/B two servers",
        description="One stream (or --concurrency N at once), temperature 0, a bank of workloads:\n"
                    + "".join(f"  {w.name:<9} {w.about}\n" for w in WORKLOADS.values())
                    + "Per workload, RUNS measured runs after one discarded warm-up give decode tok/s (excludes the\n"
                      "time to first token), end-to-end tok/s (completion tokens / wall time) and TTFT, as median\n"
                      "and range; on a speculating vLLM, the mean acceptance length and draft acceptance rate, from\n"
                      "the deltas of its /metrics counters around each run.\n\n"
                      "--concurrency N: rounds of N streams at once (threads released together), each with its own\n"
                      "request from the bank (cycling; repeats get 'Request k.' first). Per stream the same figures "
                      "and\n"
                      "its overlap (share of its decode window while all N were decoding); per round total tok/s and\n"
                      "the mean and min per-stream decode tok/s. Per-stream acceptance is decode tokens per streamed\n"
                      "chunk (one chunk per engine step), checked against the server-wide counters.\n\n"
                      "A/B: two URLs are measured interleaved (A, B, A, B...); --compare reads two saved results.\n"
                      "Per workload it says 'B faster by x%' only where the two ranges of runs do not overlap (at\n"
                      f"least {MIN_RUNS_FOR_VERDICT} runs each), else 'within noise'. It flags a side whose accepted "
                      f"tokens per draft\nfall below {LOW_ACCEPTANCE_FRACTION:.0%} of the other's (and at least "
                      f"{LOW_ACCEPTANCE_MIN_GAP} lower), the mark of a build that dropped its\nMTP or drafter weights, "
                      "and then exits 1.",
        epilog="examples:\n"
               "  hybrid-build bench http://127.0.0.1:8000/v1\n"
               "  hybrid-build bench http://127.0.0.1:8000/v1 --runs 3 --max-tokens 128 --json\n"
               "  hybrid-build bench http://127.0.0.1:8000/v1 --workloads counting,agent --runs 3\n"
               "  hybrid-build bench http://127.0.0.1:8000/v1 --concurrency 4 --runs 3   # 4 streams at once\n"
               "  OPENAI_API_KEY=\"$(cat key)\" hybrid-build bench https://gpu.example/v1   # a served API key\n"
               "  hybrid-build bench http://127.0.0.1:8000/v1 http://127.0.0.1:8000/v1 --runs 3"
               "   # A/A: the size of the noise\n"
               "  hybrid-build bench http://127.0.0.1:8000/v1 --out source.json     # serving the source\n"
               "  hybrid-build bench http://127.0.0.1:8000/v1 --out hybrid.json     # later, serving the hybrid\n"
               "  hybrid-build bench --compare source.json hybrid.json\n"
               "  hybrid-build bench http://127.0.0.1:8000/v1 --agent --contexts 512,1536 --runs 3   # agents' TTFT\n"
               "  hybrid-build bench http://127.0.0.1:8000/v1 --agent --contexts 1k --concurrency 4   # per stream\n"
               "  hybrid-build bench http://127.0.0.1:8000/v1 --trace chats.jsonl --concurrency 4   # yours\n"
               "  hybrid-build bench http://127.0.0.1:8000/v1 --trace ~/.hermes/state.db --conversations 10\n"
               "  hybrid-build bench http://127.0.0.1:8000/v1 --trace agent-synthetic --max-turns 8 "
               "--slo ttft=2,tpot=50ms\n"
               "  hybrid-build bench http://127.0.0.1:8000/v1 --trace agent-synthetic --duration 600 --out soak.json")
    p.add_argument("urls", nargs="*", metavar="URL",
                   help="OpenAI base URL (ending in /v1); two URLs: A and B, measured interleaved")
    p.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), type=Path,
                   help="compare two results saved by --out or --json (no URL then)")
    p.add_argument("--model", help="model name (default: the first of each server's /v1/models)")
    p.add_argument("--runs", type=int_range(1, 1000), default=5,
                   help="measured runs per workload and server (default 5)")
    p.add_argument("--max-tokens", type=TOKENS, default=256, help="completion tokens per request (default 256)")
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help=f"comma list from {', '.join(WORKLOADS)} (default: all)")
    p.add_argument("--thinking", action="store_true",
                   help="leave the chat template's thinking on (default: off, so that each workload answers with "
                        "its own kind of text)")
    p.add_argument("--concurrency", type=STREAMS, default=1, metavar="N",
                   help=f"streams at once, each its own request (default 1; at most {MAX_CONCURRENCY}: vLLM batches "
                        f"at most {MAX_CONCURRENCY} sequences by default (256 on smaller GPUs), more would queue, not "
                        "run at once)")
    p.add_argument("--api-key", help="sent as a Bearer token on every request (default: $OPENAI_API_KEY, "
                                     "which keeps it out of `ps`); never printed")
    p.add_argument("--agent", action="store_true",
                   help="measure time to first token for agents instead of the bank: per context length a long "
                        "prefix (a session's history) plus a short new turn, cold (first time sent) and warm (the "
                        "next turn: the prefix cached where the server caches), with the prefix-cache hit rate "
                        "from /metrics; with --concurrency N, N sessions at once, TTFT per stream")
    p.add_argument("--contexts", default="8k,32k,64k", metavar="LIST",
                   help="--agent's context lengths in tokens (k = 1024; default 8k,32k,64k; at most the served "
                        "max_model_len)")
    t = p.add_argument_group("trace replay (--trace)")
    t.add_argument("--trace", metavar="FILE|agent-synthetic[:k=v,...]",
                   help="replay multi-turn conversations, regenerating each assistant turn: OpenAI chat JSONL (one "
                        "conversation a line), vLLM's multi-turn benchmark JSON, or a Hermes agent state.db (read "
                        "only); or the shipped synthetic coding-agent trace (parameters: conversations, turns, "
                        "tool_share, start, end, call_tokens, answer_tokens)")
    t.add_argument("--feed-back", choices=("recorded", "generated"), default="recorded",
                   help="the history sent before each turn: the recorded one (default: every run and server gets "
                        "the same prompts) or the server's own earlier replies")
    t.add_argument("--conversations", type=int_range(1, MAX_CONVERSATIONS), metavar="K",
                   help=f"replay K conversations of the trace (a seeded sample, taken while the file is read; "
                        f"default all, up to {MAX_CONVERSATIONS:,})")
    t.add_argument("--max-turns", type=int_range(1, 100_000), metavar="N",
                   help="regenerate at most N assistant turns of each")
    t.add_argument("--seed", type=SEED, default=0, help="the sample of conversations, the synthetic trace and the "
                                                        "request seed (default 0)")
    t.add_argument("--skip-too-long", action="store_true",
                   help="leave out the turns whose prompt + --max-tokens the server would refuse (longer than its "
                        "max_model_len, counted by its /tokenize before the replay; without the flag they are "
                        "counted, said, and fail with the server's reason)")
    t.add_argument("--no-tools", action="store_true",
                   help="send no tool definitions (a server without a tool-call parser refuses requests with tools; "
                        "tool-call validity then measures nothing)")
    t.add_argument("--slo", metavar="ttft=S,tpot=S", help="goodput: the share of turns within these (s, or ms)")
    t.add_argument("--duration", type=SECONDS, metavar="S",
                   help="soak: loop the trace for S seconds and report per window; exit 1 on any failed request")
    t.add_argument("--window", type=SECONDS, default=60.0, metavar="S",
                   help=f"the soak's window (default 60 s; at most {MAX_WINDOWS:,} of them in duration + timeout)")
    t.add_argument("--timeout", type=SECONDS, default=600.0, metavar="S",
                   help="one request's deadline, the whole stream included (default 600 s)")
    p.add_argument("--out", type=Path, help="also write the JSON result to this file (input of --compare); a soak "
                                            "draws its windows beside it as PNG where matplotlib is installed")
    add_json_flag(p)
    p.set_defaults(handler=run)


MAX_WINDOWS = 10_000  # a soak's windows (each closes with a /metrics read): bounds --window from below


def _url(u: str) -> str:
    url = u.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise UserError(f"{u}: not an http(s) URL")
    return url


def _write(args: argparse.Namespace, result: dict) -> None:
    from hybrid_build.core.artifact import seal_report_at

    if args.out:
        try:
            args.out.write_text(json.dumps(result, indent=2) + "\n")
            seal_report_at(args.out)  # ARTIFACT/hybrid_build/bench.json: recorded in its provenance
        except OSError as e:
            raise UserError(describe_os_error(e))


def _read(path: Path) -> dict:
    from .bench import load_report

    report = load_report(path)
    report["file"] = path.name
    return report


def _agent(args: argparse.Namespace) -> dict:
    from .bench_agent import bench_agent, parse_contexts

    if args.compare or len(args.urls) != 1:
        raise UserError("--agent measures one server: give one URL (and no --compare)")
    contexts = parse_contexts(args.contexts)
    if args.runs < 1:
        raise UserError("--runs must be at least 1")
    if not 1 <= args.concurrency <= MAX_CONCURRENCY:
        raise UserError(f"--concurrency must be between 1 and {MAX_CONCURRENCY}")
    url = _url(args.urls[0])
    with progress(args.quiet, total=len(contexts) * args.runs, unit="run", desc="bench --agent", leave=False) as bar:
        return bench_agent(url, args.model, contexts, args.runs, args.concurrency, client_key(args.api_key),
                           on_run=lambda *_: bar.update(1))


def _trace(args: argparse.Namespace) -> int:
    from .bench_trace import ReplayOptions, pair_table, replay, replay_pair
    from .soak import GRACE_S, draw, soak, soak_table
    from .trace_formats import read_trace
    from .trace_report import parse_slo, table
    from .trace_synthetic import NAME, generate, parse_spec, stated

    if args.compare or args.agent:
        raise UserError("--trace replays conversations against URLs: no --compare or --agent with it")
    if not 1 <= len(args.urls) <= 2:
        raise UserError("--trace: give one URL to measure, or two (A B) to compare")
    if args.duration and len(args.urls) != 1:
        raise UserError("--duration soaks one server: give one URL")
    windows = (args.duration + args.timeout + GRACE_S) / args.window if args.duration else 0
    if windows > MAX_WINDOWS:
        raise UserError(f"--window {args.window:g}: the soak could close {windows:,.0f} windows in --duration + "
                        f"--timeout + {GRACE_S:g} s; at most {MAX_WINDOWS:,}: give a longer window")
    urls = [_url(u) for u in args.urls]
    synthetic = None
    if args.trace.split(":")[0] == NAME:
        params = parse_spec(args.trace, args.seed)
        trace = generate(params)
        synthetic = stated(trace, params)
    else:
        trace = read_trace(Path(args.trace).expanduser(), args.conversations, args.seed)
    opts = ReplayOptions(concurrency=args.concurrency, conversations=args.conversations, max_turns=args.max_turns,
                         max_tokens=args.max_tokens, feed_back=args.feed_back, seed=args.seed,
                         thinking=args.thinking, timeout=args.timeout, duration=args.duration, window=args.window,
                         slo=parse_slo(args.slo) if args.slo else None, tools=not args.no_tools,
                         skip_too_long=args.skip_too_long)
    api_key = client_key(args.api_key)

    def on_note(line: str) -> None:  # said before the replay starts: a trace that does not fit the server
        if not args.quiet:
            print(f"bench: {printable(line, one_line=True)}", file=sys.stderr, flush=True)

    with progress(args.quiet, unit="turn", desc="bench --trace", leave=False) as bar:
        on_turn = lambda *_: bar.update(1)  # noqa: E731
        if args.duration:
            result = soak(urls[0], trace, opts, args.model, api_key, synthetic, on_turn=on_turn, on_note=on_note)
        elif len(urls) == 2:
            result = replay_pair(urls[0], urls[1], trace, opts, args.runs, args.model, api_key, synthetic,
                                 on_turn=on_turn, on_note=on_note)
        else:
            result = replay(urls[0], trace, opts, args.model, api_key, synthetic, on_turn=on_turn, on_note=on_note)
    _write(args, result)
    png = draw(result, args.out.with_suffix(".png")) if args.duration and args.out else None
    if args.json:
        emit_json(result)
    else:
        text = soak_table(result) if args.duration else pair_table(result) if len(urls) == 2 else table(result)
        print(text)
        if png:
            print(f"windows drawn: {png}")
    failed = result.get("failed_requests", sum(1 for t in result.get("turns", []) if t["error"]))
    if len(urls) == 2:
        failed = sum(1 for r in result["reports"].values() for t in r["turns"] if t["error"])
    if failed:
        print(f"bench: {failed} request(s) failed (their reasons: the 'failed:' lines; --json: error_reasons)",
              file=sys.stderr)
        return 1
    return 0


def run(args: argparse.Namespace) -> int:
    from .bench import bench, bench_pair, compare, compare_table, table  # the client (httpx): when the command runs

    if args.out:  # refused before a request is sent, not after the measuring
        check_output_path(args.out, "--out", folder=False)
    if args.trace:
        return _trace(args)
    if args.duration or args.slo or args.conversations or args.max_turns or args.skip_too_long:
        raise UserError("--duration, --slo, --conversations, --max-turns and --skip-too-long go with --trace")
    if args.agent:
        from .bench_agent import agent_table

        result = _agent(args)
        _write(args, result)
        if args.json:
            emit_json(result)
        else:
            print(agent_table(result))
        return 0
    if args.compare:
        if args.urls:
            raise UserError("give either URLs to measure or --compare A.json B.json, not both")
        if args.concurrency != 1:
            raise UserError("--concurrency is for measuring; --compare reads it from the two results")
        result = compare(_read(args.compare[0]), _read(args.compare[1]))
    else:
        if not 1 <= len(args.urls) <= 2:
            raise UserError("give one URL to measure, two to compare (A B), or --compare A.json B.json")
        workloads = [s.strip() for s in args.workloads.split(",") if s.strip()]
        unknown = [s for s in workloads if s not in WORKLOADS]
        if unknown or not workloads:
            raise UserError(f"unknown workload {unknown[0] if unknown else ''!r} (choose from: {', '.join(WORKLOADS)})")
        urls = [_url(u) for u in args.urls]
        api_key = client_key(args.api_key)
        per_run = len(workloads) if args.concurrency == 1 else args.concurrency
        with progress(args.quiet, total=per_run * (args.runs + 1) * len(urls), unit="request",
                      desc="bench", leave=False) as bar:
            on_run = lambda *_: bar.update(1)  # noqa: E731
            if len(urls) == 1:
                result = bench(urls[0], args.model, args.runs, args.max_tokens, workloads, args.thinking, on_run,
                               args.concurrency, api_key)
            else:
                result = bench_pair(urls[0], urls[1], args.model, args.runs, args.max_tokens, workloads,
                                    args.thinking, on_run, args.concurrency, api_key)
    _write(args, result)
    comparison = "flags" in result
    if args.json:
        emit_json(result)
    else:
        print(compare_table(result) if comparison else table(result))
    if comparison and result["flags"]:
        unit = "workload(s)" if result.get("concurrency", 1) == 1 else "stream(s)"
        print(f"bench: low speculative acceptance in {len(result['flags'])} {unit} "
              f"({'; '.join(f.split(': ')[0] for f in result['flags'])}): see the FLAG lines", file=sys.stderr)
        return 1
    return 0
