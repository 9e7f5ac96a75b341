"""``hybrid-build verify URL --artifact OUT``: check a running server against the artifact's reference."""
from __future__ import annotations

import argparse
from pathlib import Path

# three outcomes, three exit codes (as `validate`): could not run is neither a pass nor a failure
OUTCOME_EXIT = {"passed": 0, "failed": 1, "could not run": 3}


def register(sub, common) -> None:
    from hybrid_build.core.artifact import REPORTS
    from hybrid_build.core.cli_support import ExampleFormatter, add_json_flag

    from .verify_options import CACHE_TOKENS, CONCURRENCY, LOGPROB_TOL, PATHS

    p = sub.add_parser(
        "verify", parents=[common], formatter_class=ExampleFormatter,
        help="check a running OpenAI-compatible server (vLLM) against the artifact's reference",
        description="Ask a running server for the prompt log-probabilities of the reference texts (/v1/completions "
                    "with prompt_logprobs, else echo + logprobs) and compare them, position by position, with "
                    f"the artifact's reference ({', '.join('ARTIFACT/' + f for f in REPORTS['reference'].files)}, "
                    "written by `hybrid-build validate`): KL(reference || server), same top-1, the actual token's "
                    "log-probability. The KL is estimated on the reference's top-k tokens with the rest of the "
                    "vocabulary lumped into one bucket: a lower bound of the full-vocabulary KL. Thresholds come "
                    "from the recipe's `verify` section. Works against any server: one `hybrid-build serve` "
                    "started, the DGX Spark docker image, a server on another machine. Speculative decoding does "
                    "not change the figures (prompt log-probabilities do not go through the drafter; the decode "
                    "path does). Exit 0 when "
                    "the server passes, 1 when it fails, 3 when the check could not run (nothing answers, the "
                    "model asked for is not served, no prompt log-probabilities, no reference in the artifact, a "
                    "request past --timeout, a path that could not run), 2 on a usage error (a server that refuses "
                    "the API key, or wants one and got none, is one). Every answer is checked for shape before "
                    "any figure: finite log-probabilities <= 0, every position answered, the top-k asked for, "
                    "token ids inside the artifact's vocabulary, the model the artifact's recipe names; one "
                    "violation fails, named by text and position. Then, by default, the paths where runtimes "
                    "break, each compared on generated tokens' log-probabilities: cache (the same prompt cold and "
                    "with its prefix cached, the hit read from /metrics), concurrency (N requests at once), decode "
                    "(a greedy continuation against a prefill of it); --skip leaves one out. The report says which "
                    "ran and the time each took.",
        epilog="examples:\n"
               "  hybrid-build verify http://127.0.0.1:8000/v1 --artifact out/\n"
               "  hybrid-build verify http://127.0.0.1:8000/v1 --artifact out/ --json\n"
               "  hybrid-build verify http://127.0.0.1:8000/v1 --artifact out/ --profile base   # caching as profiled\n"
               "  hybrid-build verify http://127.0.0.1:8000/v1 --artifact out/ --skip cache --skip decode\n"
               "  hybrid-build verify http://127.0.0.1:8000/v1 --artifact out/ --against source"
               "   # serving the source\n"
               "  hybrid-build verify http://spark:8000/v1 --artifact out/ --model qwen   # key: $OPENAI_API_KEY")
    p.add_argument("url", help="the server's OpenAI base URL (http://HOST:PORT/v1, or without /v1)")
    p.add_argument("--artifact", type=Path, required=True,
                   help="the artifact folder whose reference the server is checked against (a URL does not say "
                        "which artifact it serves)")
    p.add_argument("--against", choices=("hybrid", "source"), default="hybrid",
                   help="which of the reference's sides the server should match: hybrid (the artifact, default) "
                        "or source (a server of the source checkpoint: the dflash, base and mtp profiles)")
    p.add_argument("--model", help="the served model name (default: the name the artifact's recipe serves it under)")
    p.add_argument("--api-key", metavar="KEY", help="sent as a Bearer token (default: $OPENAI_API_KEY, which keeps "
                                                   "the key off the command line; `serve` says where its key is)")
    p.add_argument("--timeout", default="120", metavar="S",
                   help="seconds each request may take, start to last byte (a deadline, not a per-read wait; "
                        "default 120)")
    p.add_argument("--skip", action="append", default=[], choices=PATHS, metavar="PATH",
                   help="leave out one of the paths checked after the prompt log-probabilities (repeatable): "
                        "cache (a prefix-cache hit, warm against cold), concurrency (N requests at once against "
                        "each alone), decode (a greedy continuation, through the drafter where one is served, "
                        "against a prefill of the same tokens)")
    p.add_argument("--concurrency", default=str(CONCURRENCY), metavar="N",
                   help=f"requests at once in the concurrency path (default {CONCURRENCY})")
    p.add_argument("--profile", help="the serve profile the server runs (its prefix-caching setting is what the "
                                     "cache path holds it to; default: the one setting every profile serving "
                                     "--against agrees on, else none)")
    p.add_argument("--prefix-caching", choices=("on", "off"),
                   help="whether the server should cache prefixes (overrides --profile): with on, caching off "
                        "or a warm prompt with zero cache hits fails the cache path")
    p.add_argument("--cache-tokens", default=str(CACHE_TOKENS), metavar="N",
                   help=f"the cache path's prompt length in tokens (default {CACHE_TOKENS}, cut to the served "
                        "max_model_len): longer than a few of the server's KV blocks, or no block can hit")
    p.add_argument("--logprob-tol", default=str(LOGPROB_TOL), metavar="NATS",
                   help=f"the paths' near-tie and log-probability tolerance (default {LOGPROB_TOL}: two bf16 steps "
                        "of a logit in [16, 32); docs/serve.md)")
    add_json_flag(p)
    p.set_defaults(handler=_handle)


def _number(flag: str, text: str, parse):
    """A flag's number through the command line's bounded type ``parse`` (``core/cli_support``), read
    here rather than by argparse so that a bad one is a one-line usage error and, with --json, a JSON
    object of verify's own."""
    from hybrid_build.core.errors import UserError

    try:
        return parse(text)
    except argparse.ArgumentTypeError as e:
        raise UserError(f"{flag} {text}: {e}") from None


def _options(args: argparse.Namespace):
    from hybrid_build.core.errors import UserError
    from hybrid_build.core.http_client import check_url

    from .verify import claimed_prefix_caching
    from .verify_paths import PathOptions, checker

    check_url(args.url)
    if not args.artifact.is_dir():
        raise UserError(f"{args.artifact}: no such artifact folder")
    from hybrid_build.core.cli_support import SECONDS, float_range, int_range
    from hybrid_build.core.limits import MAX_STREAMS, MAX_TOKENS

    args.timeout = _number("--timeout", args.timeout, SECONDS)
    concurrency = _number("--concurrency", args.concurrency, int_range(2, MAX_STREAMS))
    cache_tokens = _number("--cache-tokens", args.cache_tokens, int_range(2, MAX_TOKENS))
    # a tolerance of many nats would pass any answer: 10 is far past every kernel path's noise
    tol = _number("--logprob-tol", args.logprob_tol, float_range(0, 10, lo_open=True))
    claim = (args.prefix_caching == "on") if args.prefix_caching else claimed_prefix_caching(
        args.artifact, args.against, args.profile)
    return checker(PathOptions(frozenset(args.skip), concurrency, claim, cache_tokens, tol))


def _handle(args: argparse.Namespace) -> int:
    from hybrid_build.core.cli_support import emit_json
    from hybrid_build.core.errors import HybridBuildError

    from .verify import could_not_run_json, render, verify_server

    try:
        paths = _options(args)
        report = verify_server(args.url, args.artifact, side=args.against, model=args.model, api_key=args.api_key,
                               timeout=args.timeout, paths=paths)
    except HybridBuildError as e:  # main prints the one line and returns its code; a script gets JSON too
        if args.json:
            emit_json(could_not_run_json(str(e), e.exit_code, args.url))
        raise
    if args.json:
        emit_json(report.to_json())
    elif args.quiet:
        if report.outcome != "passed":
            print(report.verdict_line())
    else:
        print(render(report))
    return OUTCOME_EXIT[report.outcome]
