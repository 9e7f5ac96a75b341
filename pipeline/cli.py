"""The ``hybrid-build`` command line: one parser, subcommands registered from their packages.

Each subcommand is a module (``pipeline/commands/``, or ``command.py`` beside the package it
drives) that only parses arguments, calls library code and prints; it exposes
``register(subparsers, common)``,
where ``common`` is the parent parser holding ``-v/--quiet``. The handler it sets returns an exit
code. Every error funnels through ``main``: a ``UserError`` prints one line and exits 2, any
other ``HybridBuildError`` one line and exits 1; tracebacks appear only with ``-vv``.
"""
from __future__ import annotations

import argparse
import errno
import importlib
import logging
import sys

from hybrid_build.core.cli_support import (
    ExampleFormatter,
    describe_os_error,
    emit_failure_json,
    json_written,
)
from hybrid_build.core.errors import HybridBuildError
from hybrid_build.core.redaction import redact, remember, remember_file
from hybrid_build.core.stop_signals import interrupt_exit_code, stop_on_signals
from hybrid_build.core.terminal_text import PrintableStream, printable

# what the filesystem refuses that another folder, freed space or the right permissions fix: bad input
# (exit 2), as the space check before a build says it; any other OSError (an I/O error) exits 1
USER_FIXES = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM, errno.ELOOP,
              errno.ENOTDIR, errno.EISDIR, errno.ENAMETOOLONG}

# name -> module with register(); order is the order of `hybrid-build --help`
COMMANDS: dict[str, str] = {
    "inspect": "hybrid_build.pipeline.commands.inspect",
    "demo-checkpoint": "hybrid_build.pipeline.commands.demo",
    "run": "hybrid_build.pipeline.commands.run",
    "status": "hybrid_build.pipeline.commands.status",
    "validate": "hybrid_build.validate.command",
    "verify": "hybrid_build.validate.verify.verify_command",
    "verify-artifact": "hybrid_build.pipeline.commands.verify_artifact",
    "eval": "hybrid_build.validate.eval.eval_command",
    "plan": "hybrid_build.pipeline.commands.plan",
    "publish": "hybrid_build.pipeline.commands.publish",
    "serve": "hybrid_build.serve.launch.command",
    "bench": "hybrid_build.serve.bench.bench_command",
}


class UsageError(SystemExit):
    """A mistake argparse found: exit 2, the line already on stderr; ``message`` for ``--json``."""

    def __init__(self, message: str) -> None:
        super().__init__(2)
        self.message = message


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage mistake in one line and exits 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        line = printable(f"{message} (see `{self.prog} --help`)", one_line=True)
        sys.stderr.write(f"error: {line}\n")
        raise UsageError(line)


class _Version(argparse.Action):
    """``--version``, reading the installed version only when asked (``hybrid_build.core``)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        from hybrid_build.core import __version__

        print(f"hybrid-build {__version__}")
        parser.exit()


def _common_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    g = common.add_argument_group("output")
    g.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv: debug and tracebacks)")
    g.add_argument("-q", "--quiet", action="store_true", help="only errors; no progress bars")
    return common


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="hybrid-build",
        description="Turn an INT4 AutoRound MoE checkpoint into an INT4 + FP8 + int8-head hybrid; "
                    "validate, publish and serve it.",
        formatter_class=ExampleFormatter,
        epilog="examples:\n"
               "  hybrid-build run -o out/                 # the whole pipeline on the tiny demo model\n"
               "  hybrid-build inspect Intel/Qwen3.5-122B-A10B-int4-AutoRound\n"
               "  hybrid-build serve out/ --profile dense --dry-run",
    )
    parser.add_argument("--version", action=_Version, nargs=0, help="show the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    common = _common_parser()
    for name, module in COMMANDS.items():
        try:
            mod = importlib.import_module(module)
        except ImportError as e:  # a broken install or a bug, never "not landed yet": say which
            sys.stderr.write(f"error: the `{name}` command's module {module} does not import: {e}\n")
            raise SystemExit(1) from e
        mod.register(sub, common)
    return parser


class _RedactingFormatter(logging.Formatter):
    """A log line without a secret and without what a terminal would obey (``core/terminal_text``)."""

    def format(self, record: logging.LogRecord) -> str:
        return printable(redact(super().format(record)))


def setup_logging(verbose: int, quiet: bool) -> None:
    """WARNING by default, INFO with -v; -vv adds DEBUG for hybrid-build's own loggers only (all
    under ``hybrid_build``), so that the debug chatter of the libraries it imports (matplotlib's font
    manager, PIL, filelock, urllib3, asyncio, torch...) does not bury them. ``main`` prints
    tracebacks with -vv."""
    level = logging.ERROR if quiet else logging.INFO if verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr, force=True)
    for handler in logging.getLogger().handlers:  # a log line or a -vv traceback holds no secret either
        handler.setFormatter(_RedactingFormatter(handler.formatter._fmt if handler.formatter else None))
    logging.getLogger("hybrid_build").setLevel(logging.DEBUG if verbose >= 2 and not quiet else logging.NOTSET)
    for noisy in ("autoround", "transformers", "httpx", "urllib3", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(max(level, logging.WARNING))


def _fail(args: argparse.Namespace, code: int, message: str, prefix: str = "error") -> int:
    """One line on stderr, without a secret (``core/redaction.py``: whatever raised it) or a terminal
    control character (``core/terminal_text.py``: a file name, an id or a server's words in it); with
    ``--json``, also the failure's object on stdout unless the command printed its own. Returns ``code``."""
    message = printable(redact(message), one_line=True)
    sys.stderr.write(f"{prefix}: {message}\n")
    if getattr(args, "json", False) and not json_written():
        emit_failure_json(code, message)
    return code


def main(argv: list[str] | None = None) -> int:
    """Exit codes, one per outcome for every command: 0 passed, 1 a check failed, 2 bad input,
    3 could not run here (``core/errors.py``); 128 + N for stop signal N."""
    json_written(reset=True)
    if (sys.argv[1:] if argv is None else argv)[:1] == ["--version"]:  # the parser would import every command
        from hybrid_build.core import __version__

        print(f"hybrid-build {__version__}")
        return 0
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as e:
        if "--json" in (sys.argv[1:] if argv is None else argv):
            emit_failure_json(2, e.message)
        raise
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    args.argv = list(sys.argv[1:] if argv is None else argv)  # serve --print-unit writes it back
    remember(getattr(args, "api_key", None))  # the secrets this command was given, for ``redact``
    remember_file(getattr(args, "api_key_file", None), getattr(args, "ray_token_file", None))
    setup_logging(args.verbose, args.quiet)
    restore_signals = stop_on_signals()
    stdout, sys.stdout = sys.stdout, PrintableStream(sys.stdout)  # what a command prints came from outside too
    try:
        return int(args.handler(args) or 0)
    except HybridBuildError as e:
        if args.verbose >= 2:
            logging.exception("failed")
        return _fail(args, e.exit_code, str(e))
    except BrokenPipeError:  # an OSError too: the reader went away, nothing to report
        return 0
    except OSError as e:  # the filesystem refused (full, read-only, unreadable): the path and the cause
        if args.verbose >= 2:
            logging.exception("failed")
        return _fail(args, 2 if e.errno in USER_FIXES else 1, describe_os_error(e))
    except KeyboardInterrupt as e:  # only a command that keeps its finished work says it resumes
        then = ("run the same command again to resume" if getattr(args, "resumes", False)
                else "nothing of this run is kept: the same command starts over")
        return _fail(args, interrupt_exit_code(e), then, prefix="interrupted")
    finally:
        sys.stdout = stdout
        restore_signals()


if __name__ == "__main__":
    sys.exit(main())
