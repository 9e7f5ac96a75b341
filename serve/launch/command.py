"""``hybrid-build serve``: start vLLM (local or the DGX Spark docker image) for one profile."""
from __future__ import annotations

import argparse
import re
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path

from hybrid_build.core.cli_support import (
    COUNT,
    NON_NEGATIVE,
    PORT,
    POSITIVE_INT,
    SECONDS,
    ExampleFormatter,
    add_json_flag,
    emit_json,
    progress,
)
from hybrid_build.core.errors import UserError
from hybrid_build.core.stop_signals import interrupt_exit_code, stop_signals_held
from hybrid_build.core.user_paths import check_output_path
from hybrid_build.recipes.serve_names import DOCKER_IMAGE, shipped_profile_names
from hybrid_build.serve.runtime.fixes import ENV_DISABLE, FIX_IDS
from hybrid_build.serve.speed.bandwidth import HARDWARE

from . import ray_auth, served_key
from .watch import MEMORY_RESERVE_GB, POLL_S, STALL_TIMEOUT_S, STOP_GRACE_S


def register(sub, common) -> None:
    p = sub.add_parser(
        "serve", parents=[common], formatter_class=ExampleFormatter,
        help="serve an artifact with vLLM (dense, dflash, base or mtp profile)",
        description="Start vLLM for an artifact with one of its recipe's serve profiles, wait until it is "
                    "ready, check it against the artifact's reference (`hybrid-build verify`), smoke-test it and "
                    "print the OpenAI base URL. dense = hybrid checkpoint + int8 "
                    "lm-head + DFlash; dflash = DFlash only; base = no speculation; mtp = the model's MTP head.",
        epilog="examples:\n"
               "  hybrid-build serve out/ --profile dense --dry-run\n"
               "  hybrid-build serve out/ --profile base --port 8001\n"
               "  hybrid-build serve out/ --profile dense --disable-fix marlin_moe_scale --dry-run   # a fix off\n"
               "  hybrid-build serve out/ --engine docker --profile dense   # DGX Spark image, patched vLLM 0.23\n"
               "  hybrid-build serve out/ --profile dense --host 0.0.0.0 --dry-run   # beyond loopback: an API key\n"
               "  hybrid-build serve out/ --profile dense --nodes 192.168.100.11,192.168.100.12 --ifname enp1s0f1np1 "
               "--dry-run\n"
               "  hybrid-build serve out/ --profile dense --nodes 192.168.100.11,192.168.100.12 --ifname enp1s0f1np1 "
               "--ray-token-file ray-token --dry-run   # your Ray token (a 0600 file)")
    p.add_argument("artifact", help="artifact folder (or a Hub id, with --recipe)")
    p.add_argument("--profile", metavar="NAME",
                   help="one of the recipe's serve profiles (shipped recipes: "
                        f"{', '.join(shipped_profile_names())}; default: the recipe's default)")
    p.add_argument("--engine", choices=("local", "docker"), default="local",
                   help="local: pip-installed vLLM with the hybrid-build plugin; docker: the sm121 image")
    p.add_argument("--port", type=PORT, default=8000, help="port of the OpenAI-compatible server (default 8000)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1); any but a loopback address needs an API key, "
                        "generated when none is given (docs/serve.md, Security)")
    p.add_argument("--api-key", metavar="KEY",
                   help="the key clients must send (Bearer); vLLM gets it as VLLM_API_KEY in its environment. "
                        "Default: --api-key-file, else $VLLM_API_KEY, else beyond loopback one generated into "
                        f"$XDG_STATE_HOME/{served_key.STATE_FOLDER}/{served_key.KEY_FILE} (default ~/.local/state/...; "
                        "0600; the path is printed, never the key). A flag shows in `ps`: prefer the file or the "
                        "variable")
    p.add_argument("--api-key-file", type=Path, metavar="FILE",
                   help="read the API key from FILE (one line; a file of yours, mode 0600)")
    p.add_argument("--recipe", help="recipe name or YAML (default: the artifact's own)")
    p.add_argument("--drafter", help="DFlash drafter Hub id or folder (overrides the profile's)")
    p.add_argument("--drafter-revision", metavar="REV",
                   help="the Hub drafter's revision (commit, tag or branch) in place of the one the profile pins; "
                        "serve names the revision it serves at start")
    p.add_argument("--source", help="source checkpoint (default: the one the artifact records): the dflash/base/mtp "
                                    "profiles serve it, and a recipe's `{source}-dflash` drafter is the folder "
                                    "beside it")
    p.add_argument("--image", default=DOCKER_IMAGE, help="docker image (docker engine)")
    p.add_argument("--hardware", choices=sorted(HARDWARE),
                   help="the GPU, as a `plan` preset (default: what nvidia-smi names): its memory sizes the KV pool "
                        "serve prints before it starts, and it says when this profile's levers are predicted to "
                        "gain little there")
    p.add_argument("--ready-timeout", type=SECONDS, default=1800, help="seconds to wait for READY (default 1800)")
    p.add_argument("--log", type=Path, help="server log file (default: logs/serve-PROFILE-PORT.log in the user's state "
                                            "folder, $XDG_STATE_HOME/hybrid-build, default ~/.local/state/...; "
                                            "$HYBRID_BUILD_STATE_DIR names another; the path is printed at start)")
    p.add_argument("--no-smoke", action="store_true", help="skip the smoke test")
    p.add_argument("--no-verify", action="store_true",
                   help="do not check the server against the artifact's reference before calling it ready "
                        "(`hybrid-build verify`; a failed check stops the server)")
    p.add_argument("--dry-run", action="store_true", help="print the exact command and environment, start nothing")
    p.add_argument("--disable-fix", action="append", default=[], metavar="ID",
                   help="leave this runtime fix or patch out (repeatable; `all` for every one), to see whether "
                        f"your vLLM still needs it: sets {ENV_DISABLE} (ids: {', '.join(FIX_IDS)}; docs/serve.md)")
    g = p.add_argument_group(
        "several nodes (vLLM on a Ray cluster; docs/multinode.md)",
        "Ray runs with token authentication: a token generated per run (or --ray-token-file,\n"
        "$RAY_AUTH_TOKEN, $RAY_AUTH_TOKEN_PATH), handed to each node in a 0600 file under\n"
        f"~/{ray_auth.TOKEN_DIR}, never on a command line, and removed when the cluster stops. The Ray\n"
        "dashboard stays on the head's loopback. vLLM on the head gets the API key (--api-key...) as\n"
        "for one node, in its environment; one is needed where it listens beyond loopback, as on a\n"
        "head that is another machine.")
    g.add_argument("--nodes", metavar="HOST1,HOST2", help="serve across these machines: [user@]host, each by its "
                   "address on the link; the first is the Ray head and runs vLLM. One of them may be this machine; "
                   "the others are reached over ssh")
    g.add_argument("--nodes-file", type=Path, metavar="FILE", help="the hosts, one a line (# comments)")
    g.add_argument("--ifname", metavar="IFACE", help="the link's network interface on every node (NCCL, Gloo and "
                   "vLLM use it), e.g. the ConnectX-7 port ibdev2netdev names")
    g.add_argument("--ib-hca", metavar="DEV[,DEV]", help="RDMA devices for NCCL (NCCL_IB_HCA), e.g. both RoCE "
                   "devices of a Spark's 200G port")
    g.add_argument("--parallel", choices=("tp", "pp"), default="tp",
                   help="tp: tensor parallel over all GPUs (default); pp: one pipeline stage per node")
    g.add_argument("--gpus-per-node", type=POSITIVE_INT, default=1, help="GPUs on each node (default 1: a DGX Spark)")
    g.add_argument("--ray-port", type=PORT, default=6379, help="the Ray head's port (default 6379)")
    g.add_argument("--ray-token-file", type=Path, metavar="FILE",
                   help="the Ray cluster's token (a file of yours, mode 0600); default: $RAY_AUTH_TOKEN, "
                        "$RAY_AUTH_TOKEN_PATH, else one generated per run")
    g.add_argument("--ray-temp-dir", metavar="DIR", help="Ray's temp folders, DIR/nodeN on each node "
                   "(default: Ray's own)")
    g.add_argument("--remote-venv", metavar="DIR", help="the environment hybrid-build, Ray and vLLM are installed "
                   "in on the other nodes (default: their login PATH)")
    g.add_argument("--node-env", action="append", default=[], metavar="[N:]KEY=VALUE",
                   help="environment for node N (1 = the head), or for every node without N; repeatable "
                        "(e.g. 1:CUDA_VISIBLE_DEVICES=0 2:CUDA_VISIBLE_DEVICES=1 for two nodes on one machine)")
    g.add_argument("--join-timeout", type=SECONDS, default=600,
                   help="seconds to wait for the head and for every node to join (default 600)")
    g.add_argument("--trust-key", action="append", metavar="PUB.pem", default=None,
                   help="a public key, or a CA certificate, whose signatures (model.sig, OpenSSF Model Signing) you "
                        "trust; repeatable (default: $HYBRID_BUILD_TRUSTED_KEYS). An artifact not built on this "
                        "machine is served only when signed by one, after a passing `hybrid-build validate` here "
                        "(without --trust-key), or with --force")
    g.add_argument("--force", action="store_true",
                   help="serve anyway an artifact whose files differ from its provenance or whose validation is "
                        "missing, failed or stale (refused otherwise, --dry-run included; verify still runs), and "
                        "across nodes whose addresses are not private or link-local (refused otherwise: NCCL and "
                        "Gloo traffic is not authenticated; docs/multinode.md, Security)")
    w = p.add_argument_group(
        "after READY (docs/serve.md, Keeping it up)",
        "serve watches the engine and exits 1 on any of: the engine's process ends (whatever its status:\n"
        "vLLM exits 0 after EngineDeadError), no token while requests run (a hang /health does not see),\n"
        "MemAvailable below the reserve (unified memory freezes the host rather than failing). Each event\n"
        "is one line with its time, in the serve log too.")
    w.add_argument("--stall-timeout", type=SECONDS, default=STALL_TIMEOUT_S, metavar="S",
                   help=f"seconds without a token while requests run before the engine is stopped (default "
                        f"{STALL_TIMEOUT_S:g}: the longest prefill the profiles admit, 262,144 tokens, at a "
                        "pessimistic 500 tokens/s moves no counter for ~9 min)")
    w.add_argument("--memory-reserve", type=NON_NEGATIVE, default=MEMORY_RESERVE_GB, metavar="GB",
                   help=f"host memory (MemAvailable, GB) kept free: below it the engine is stopped, and a start "
                        f"that would not leave it is refused (default {MEMORY_RESERVE_GB:g}: what the public DGX "
                        "Spark recipe keeps for the OS)")
    w.add_argument("--restart", type=COUNT, default=0, metavar="N",
                   help="restart the engine after a fault, up to N times (default 0: exit 1, for a supervisor to "
                        "restart): backoff, wait for memory, verify again, READY again")
    w.add_argument("--restart-backoff", type=NON_NEGATIVE, default=10.0, metavar="S",
                   help="seconds before the first restart, doubled for each next one (at most 300; default 10)")
    w.add_argument("--memory-wait", type=NON_NEGATIVE, default=300.0, metavar="S",
                   help="seconds a restart waits for MemAvailable to come back above the start budget (default "
                        "300; a GB10 gives memory back over ~60 s after a kill)")
    w.add_argument("--stop-grace", type=SECONDS, default=STOP_GRACE_S, metavar="S",
                   help=f"seconds between SIGTERM and SIGKILL when serve stops the engine (default {STOP_GRACE_S:g})")
    w.add_argument("--watch-interval", type=SECONDS, default=POLL_S, metavar="S",
                   help=f"seconds between two looks at the engine, /metrics and MemAvailable (default {POLL_S:g})")
    w.add_argument("--print-unit", action="store_true",
                   help="print a systemd unit that runs this command line (without --print-unit) and start nothing")
    add_json_flag(p)
    p.set_defaults(handler=run)


def _api_key(args: argparse.Namespace, host: str):
    """The served API's key (``served_key.resolve``). A ``--dry-run`` generates it too (in the user's
    state folder, where serving would, kept and reused): the ``export VLLM_API_KEY="$(cat FILE)"`` line
    it prints then works as printed, where a file to come would give vLLM an empty key."""
    from hybrid_build.core.redaction import remember, remember_file

    from .served_key import resolve

    key = resolve(host, args.api_key, args.api_key_file, create=True)
    if key is not None:  # never in what this process prints, whatever raised it (``core.redaction``)
        remember(key.value)
        remember_file(key.path)
    return key


def run(args: argparse.Namespace) -> int:
    from .engine import plan_launch
    from .launcher import check_prerequisites, warn_if_untested

    if args.print_unit:
        return _print_unit(args)
    bound = _check_artifact(args)  # before anything is planned or started, --dry-run included
    several = bool(args.nodes or args.nodes_file)  # the docker engine's image is set by the multi-node plan
    version = None if several else _vllm_version(args)
    plan = plan_launch(args.artifact, args.profile, engine="local" if several else args.engine, port=args.port,
                       host=args.host,
                       hardware=args.hardware, disable_fixes=args.disable_fix,
                       recipe=args.recipe, drafter=args.drafter, source=args.source, image=args.image,
                       drafter_rev=args.drafter_revision,
                       api_key=None if several else _api_key(args, args.host),  # several: for the head's address
                       vllm_version=version, bound=bound)
    if several:
        return _run_nodes(args, plan)
    if args.dry_run:
        memory = _memory(args, plan, version)
        if args.json:
            emit_json(dict(plan.to_json(), memory=memory.to_json()))
        else:
            for k, v in sorted(plan.env.items()):
                print(f"export {k}={v}")
            if plan.api_key is not None:
                print(plan.api_key.shell_line())
            print(shlex.join(plan.argv))
            for n in plan.notes:
                print(f"# {n}")
            for line in memory.lines():
                print(f"# {line}")
            if plan.api_key is not None:
                print(f"# {plan.api_key.announce()}")
        return 0
    check_prerequisites(plan)
    _check_port_free(plan)  # another server on the port: one line naming it (exit 3), nothing started
    log_path = _log_path(args, plan.profile, plan.port)
    check_output_path(log_path, "--log", folder=False)
    version = _check_engine(args, plan, version)  # a drafter this vLLM cannot run: one line, nothing started
    warn_if_untested(plan, version)  # an untested vLLM still runs: verify checks what it serves
    memory = _memory(args, plan, version)
    if not args.quiet:
        for line in memory.lines():  # stdout stays JSON with --json
            print(line, file=sys.stderr if args.json else sys.stdout, flush=True)
    need = _check_memory(args, plan, version)  # an engine that does not fit: one line (exit 3), nothing started
    if plan.api_key is not None and not (args.quiet or args.json):
        print(plan.api_key.announce(), flush=True)
    if not args.quiet:
        print(f"log: {log_path}", file=sys.stderr if args.json else sys.stdout, flush=True)
    return _serve_watched(args, plan, log_path, need, memory)


def _log_path(args: argparse.Namespace, profile: str, port: int) -> Path:
    """``--log``, else serve-PROFILE-PORT.log in the user's state folder (never the current folder:
    a repository or a home would collect logs); one file per port, as one server holds a port."""
    from hybrid_build.core.state_dir import state_dir

    return args.log or state_dir() / "logs" / f"serve-{profile}-{port}.log"


def _serve_watched(args: argparse.Namespace, plan, log_path: Path, need: int, memory) -> int:
    """Start, prove (verify, smoke test), say READY, then watch (``watch``) until a fault; with
    ``--restart N`` stop the engine, back off, wait for memory and start again, up to N times: an
    engine that dies (or is not ready in time) before READY spends a restart too. Every event is one
    line with its time, on stdout and in the serve log, and in the artifact's serve record
    (``status``). No restart is started while the port is still held after the engine ended. A stop
    signal tears everything down, during a restart too."""
    from .launcher import EngineEnded, start
    from .serve_record import ServeRecord
    from .watch import WatchEvent, WatchLimits, exit_cause, wait_for_memory

    say = (lambda _m: None) if args.json else (lambda m: print(m, flush=True))
    limits = WatchLimits(poll_s=args.watch_interval, stall_timeout_s=args.stall_timeout,
                         memory_reserve=int(args.memory_reserve * 1e9), stop_grace_s=args.stop_grace,
                         gpu_memory_utilization=_unified_utilization(plan))
    record = ServeRecord.open(args.artifact, plan.profile, log_path, args.restart)
    server = None
    restarts = 0
    t_fault = time.monotonic()
    warned: set[str] = set()  # the warnings said once, not at every restart

    def event(kind: str, detail: str) -> None:
        e = WatchEvent(kind, time.time(), detail)
        say(e.line())
        record.add(e, log_path)

    try:
        while True:
            # a stop signal while vLLM starts waits until ``server`` names it, so ``finally`` stops it
            with stop_signals_held():
                server = start(plan, log_path, keeper_grace=limits.stop_grace_s)
            record.engine(server.process.pid)
            if restarts:
                event("restart", f"engine started again (pid {server.process.pid}), restart {restarts} of "
                                 f"{args.restart}")
            try:
                fault = _until_fault(args, plan, server, record, memory, limits, restarts, t_fault, event, warned)
            except EngineEnded as e:
                if not args.restart:
                    raise  # no restart asked for: the error line with the engine's last lines
                ended = (f"the engine {exit_cause(e.code, log_path, start=server.log_from, when=' before READY')}"
                         if e.code is not None else f"the engine was not ready after {args.ready_timeout:g} s "
                                                    "(stopped it)")
                fault = WatchEvent("exit", time.time(), ended)
            t_fault = time.monotonic()
            how = server.stop(limits.stop_grace_s)
            server = None
            done = WatchEvent(fault.kind, fault.at, fault.detail if fault.kind == "exit" else
                              f"{fault.detail}; engine {how}")
            say(done.line())
            record.add(done, log_path)
            held = _port_held_after(plan, limits.stop_grace_s)
            if held:
                event("gave-up", f"port {plan.port} is still held by {held} after the engine ended: no restart "
                                 "against it (stop that process, or choose another --port); serve exits 1")
                return 1
            if restarts >= args.restart:
                if args.restart:
                    event("gave-up", f"{restarts} restarts used (--restart {args.restart}), 0 left; serve exits 1")
                return 1
            restarts += 1
            backoff = min(args.restart_backoff * 2 ** (restarts - 1), 300.0)
            event("restart", f"restart {restarts} of {args.restart} ({args.restart - restarts} left after it) in "
                             f"{backoff:g} s; then waiting for MemAvailable >= {_gb(need)} "
                             f"(at most {args.memory_wait:g} s)")
            time.sleep(backoff)
            ok, seen = wait_for_memory(need, args.memory_wait, poll=min(args.watch_interval, 1.0))
            if not ok:
                event("gave-up", f"MemAvailable {_gb(seen)} still below {_gb(need)} after {args.memory_wait:g} s; "
                                 "serve exits 1")
                return 1
            event("restart", f"memory back: MemAvailable {_gb(seen)} >= {_gb(need)}")
    except KeyboardInterrupt as e:
        return interrupt_exit_code(e)
    finally:
        if server is not None:
            server.stop(limits.stop_grace_s)
        record.close()


def _until_fault(args: argparse.Namespace, plan, server, record, memory, limits, restarts: int, t_fault: float,
                 event, warned: set[str]):
    """One engine from start to fault: READY (``/v1/models`` answers), bound to this engine (the
    port's listening socket is held by its tree: ``listener``), verified, smoke-tested, bound again,
    announced, then watched. Returns the fault (``WatchEvent``); raises ``launcher.EngineEnded`` for
    an engine that ended or was not ready in time before READY, and any other error for what a
    restart does not mend (another process answering on the port, numerics, a refused key)."""
    from hybrid_build.core.http_client import metrics_url

    from .launcher import plan_key, probe_generation, smoke_test, wait_ready
    from .watch import blind_warning, watch

    bar = progress(args.quiet, desc=f"starting vLLM ({plan.profile})", unit="s", bar_format="{desc}: {elapsed}")
    try:
        ready_s = wait_ready(server, args.ready_timeout, on_tick=lambda _t: bar.update(0),
                             poll=min(args.watch_interval, 1.0))
    finally:
        bar.close()
    _bind_to_engine(args, plan, server, warned)
    memory_json = _check_logged_pool(args, memory, server.log_path, server.log_from)
    if restarts:
        event("restart", f"engine up after {ready_s:.1f} s; verifying it again")
    verified = _verify(args, plan, plan.base_url)
    if restarts:
        event("restart", f"verify {verified.get('outcome', '?')}")
    answer = None if args.no_smoke else smoke_test(plan.base_url, plan.model_name, expect=plan.smoke_expect,
                                                   api_key=plan_key(plan))
    _bind_to_engine(args, plan, server, warned)  # what was verified and is announced is still the engine's
    blind = blind_warning(metrics_url(plan.base_url), limits)
    if blind and "blind" not in warned:
        warned.add("blind")
        print(blind, file=sys.stderr, flush=True)
    info = {"base_url": plan.base_url, "model": plan.model_name, "ready_s": round(ready_s, 1),
            "smoke_answer": answer, "verify": verified, "memory": memory_json, "pid": server.process.pid,
            "log": str(server.log_path), "stall_watch": "generation probe" if blind else "metrics",
            "api_key": plan.api_key.to_json() if plan.api_key else None, "restarts": restarts}
    record.ready(server.process.pid)  # before the line: whoever reads READY finds the record so
    if args.json:
        emit_json(info)
    elif restarts:
        event("ready", f"READY again after restart {restarts} of {args.restart} "
                       f"({time.monotonic() - t_fault:.1f} s after the fault)")
    else:
        print(f"READY in {ready_s:.0f} s   base URL: {plan.base_url}   model: {plan.model_name}")
        if answer:
            print(f"smoke test: {answer[:80]!r}")
        print("Ctrl-C stops the server.")
    sys.stdout.flush()
    probe = None
    if blind:
        key, stall = plan_key(plan), limits.stall_timeout_s

        def probe() -> None:
            probe_generation(plan.base_url, plan.model_name, key, timeout=stall + 5.0)
    return watch(server.process, metrics_url(plan.base_url), limits, server.log_path, log_from=server.log_from,
                 probe=probe)


def _check_port_free(plan) -> None:
    """Refuse, before the engine starts, a port another process listens on (``listener.taken_by``:
    named where the system shows it). Exit 3: the command line is sound, this machine's state is
    not (a service manager's later restart may find the port free)."""
    from hybrid_build.core.errors import CannotRun

    from .listener import taken_by

    held = taken_by(plan.host, plan.port)
    if held:
        raise CannotRun(f"port {plan.port} is taken by {held}: the engine was not started (stop that process, or "
                        "choose another --port)")


def _bind_to_engine(args: argparse.Namespace, plan, server, warned: set[str]) -> None:
    """The server answering on the port is the engine serve started: its tree holds every listening
    socket a client of the port reaches (``listener.owner``). Another holder stops the engine and
    raises (exit 3) before anything is verified or announced. Where the system cannot tell (no
    ``/proc``; the docker engine, whose port docker's proxy holds), one warning, once."""
    from hybrid_build.core.errors import CannotRun

    from .listener import engine_owner

    got = engine_owner(plan.port, plan.host, server.process.pid, plan.engine == "docker")
    if got.ours is False:
        server.stop(args.stop_grace)
        raise CannotRun(f"port {plan.port} answers, but {got.holder} holds it, not the engine serve started (pid "
                        f"{server.process.pid}, stopped): nothing was verified or announced (stop that process, or "
                        "choose another --port)")
    if got.ours is None and "owner" not in warned:
        warned.add("owner")
        print(f"warning: who answers on port {plan.port} cannot be told here ({got.why}); it was free when the "
              "engine started", file=sys.stderr, flush=True)


def _port_held_after(plan, wait: float, poll: float = 0.1) -> str | None:
    """Who still holds the port once the engine ended (None: free), after up to ``wait`` seconds for
    the last of its processes to close their sockets."""
    from .listener import taken_by

    deadline = time.monotonic() + wait
    while True:
        held = taken_by(plan.host, plan.port)
        if held is None or time.monotonic() >= deadline:
            return held
        time.sleep(poll)


def _print_unit(args: argparse.Namespace) -> int:
    """The systemd unit for this command line (``unit``); a key given on the command line would be
    written into it: refused, the file or the variable works."""
    from .unit import render_unit

    if args.api_key:
        raise UserError("--print-unit with --api-key would write the key into the unit: give --api-key-file")
    print(render_unit(args.argv, args.stop_grace, f"hybrid-build serve {args.artifact} ({args.profile or 'default'} "
                                                   "profile)"), end="")
    return 0


def _gb(n: float) -> str:
    from hybrid_build.core.byte_units import human_bytes

    return human_bytes(n)


def _unified_utilization(plan) -> float | None:
    """The profile's gpu_memory_utilization where it is a share of the host's memory (a GB10), to
    name one that fits when memory runs low; None elsewhere."""
    from .memory_budget import host_memory

    host = host_memory()
    return plan.vllm.profile.gpu_memory_utilization if host is not None and host.unified and plan.vllm else None


def _check_memory(args: argparse.Namespace, plan, version: str | None) -> int:
    """The host's memory budget for this plan (``memory_budget``): refuse one that does not fit
    (exit 3), print it otherwise. Returns the MemAvailable a restart waits for (unified memory: the
    engine and the reserve; a discrete GPU: the reserve)."""
    from hybrid_build.core.errors import CannotRun

    reserve = int(args.memory_reserve * 1e9)
    found = _budget(plan, reserve, version)
    if found is None:
        return reserve
    if not found.fits:
        raise CannotRun(found.line() + " (--memory-reserve sets the reserve)")
    if not (args.quiet or args.json):
        print(found.line(), flush=True)
    return found.planned.engine + reserve if found.host.unified else reserve


def _budget(plan, reserve: int, version: str | None = None):
    """``memory_budget.budget`` of the plan on this host; None when the host cannot be read."""
    from . import engine_check
    from .memory_budget import budget, host_memory, planned_bytes

    host = host_memory()
    if host is None or plan.vllm is None:
        return None
    profile = plan.vllm.profile
    target = engine_check.read_config(plan.model)[0] if Path(plan.model).is_dir() else None
    text_config = (target or {}).get("text_config") or target
    planned, context_at = planned_bytes(plan.model, plan.drafter, profile, host.total, reserve, version, text_config)
    return budget(planned, host, profile.gpu_memory_utilization, context_at)


def _check_artifact(args: argparse.Namespace):
    """Refuse (one line naming the file or the report) an artifact that ``core.bound.open_artifact``
    finds unsound: a build in progress or stopped (resume it with ``run``), a symbolic link, a file or
    report that differs from the provenance, a reference that is not the one the report rests on or
    holds non-finite values, an invalid signature, a validation that is missing, failed, could not run
    or is stale. An artifact this machine did not build (``core.local_trust``: a download, or a copy
    from another machine) is served only with a valid signature by a trusted key (``--trust-key``;
    once one is named nothing else will do), after a passing ``validate`` on this machine, or with
    ``--force``; the line printed says which. Trust records the folder carries are named and ignored.
    With ``--force`` each refusal is a warning and serving goes on (verify still runs). A Hub id, or a
    plain checkpoint (no provenance, no ``hybrid_build/``, no build's work folder), has nothing to
    check here (None). Returns the ``BoundArtifact``, which the launch plan asks instead of reading
    the folder again."""
    from hybrid_build.core.bound import open_artifact, trusted_keys
    from hybrid_build.core.errors import ArtifactError

    artifact = Path(args.artifact).expanduser()
    if not artifact.is_dir():
        return None
    keys = trusted_keys(getattr(args, "trust_key", None))
    bound = open_artifact(artifact, trusted=keys, missing_ok=True,
                          progress=lambda **kw: progress(args.quiet or args.json, leave=False, **kw))
    if bound is None:
        return None
    if bound.trust_line():
        print(f"{artifact}: {bound.trust_line()}", file=sys.stderr, flush=True)
    problem = None
    if not bound.intact:
        problem = f"the artifact differs from its provenance: {bound.problem}"
    elif not bound.validation.passed:
        v = bound.validation
        problem = f"validation {v.state}" + (f" ({v.report})" if v.report else "") + f": {v.reason}"
    trust = None
    if bound.signature.verified:
        trust = bound.signature.line()
    elif not bound.built_here:
        if keys and problem is None:  # a publisher is named: only its signature will do
            problem = (f"downloaded ({bound.signature.line()}): --trust-key asks for a signature by a trusted key, "
                       "and a local validate does not stand in for it")
        elif bound.validated_here:
            trust = f"downloaded, {bound.signature.line()}; served after a passing local `hybrid-build validate`"
        elif problem is None:
            problem = (f"downloaded ({bound.signature.line()}) and not validated here: run `hybrid-build validate "
                       f"{artifact}` first, or pass --trust-key with the publisher's public key")
    if problem is None:
        if trust:
            print(f"{artifact}: {trust}", file=sys.stderr, flush=True)
        return bound
    if not args.force:
        raise ArtifactError(f"{artifact}: {problem}; not served (fix it, or --force to serve it anyway: verify "
                            "still runs)")
    print(f"warning: {artifact}: {problem}; serving it anyway (--force)", file=sys.stderr, flush=True)
    return bound


def _vllm_version(args: argparse.Namespace) -> str | None:
    """The vLLM to be served, before the launch is planned: the docker image's tested version (an
    untested image is asked once planned), or the local one (``vllm --version``; a dry run reads the
    installed package's metadata and starts nothing)."""
    from hybrid_build.serve.runtime.fixes import tested_image

    from .launcher import local_vllm_version
    from .memory import installed_vllm

    if args.engine == "docker":
        known = tested_image(args.image or "")
        return known.version if known else None
    return installed_vllm() if args.dry_run else local_vllm_version()


def _memory(args: argparse.Namespace, plan, version: str | None):
    """The KV pool, largest context and streams that fit for this launch (``memory.plan_for_launch``)."""
    from hybrid_build.serve.runtime.fixes import ENV_DISABLE

    from .engine import detect_hardware, fixes_off
    from .memory import plan_for_launch

    off = fixes_off(args.disable_fix) | frozenset(filter(None, plan.env.get(ENV_DISABLE, "").split(",")))
    return plan_for_launch(plan, version, args.hardware or detect_hardware(), off)


def _check_logged_pool(args: argparse.Namespace, memory, log_path: Path, offset: int) -> dict:
    """The pool vLLM logged at this start against the plan: one line when they agree, a warning naming
    both when they differ by more than 2%. Returns what ``--json`` reports under ``memory``."""
    try:
        with open(log_path, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
    except OSError:
        text = ""
    agree, warning, logged = memory.check_log(text)
    if warning:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    elif agree and not args.quiet:
        print(agree, file=sys.stderr if args.json else sys.stdout, flush=True)
    elif memory.plan is not None and logged is None and not args.quiet:
        print("memory: vLLM's log holds no \"GPU KV cache size\" line to compare with the plan",
              file=sys.stderr if args.json else sys.stdout, flush=True)
    return dict(memory.to_json(), logged_pool_tokens=logged, warning=warning)


def _check_engine(args: argparse.Namespace, plan, version: str | None = None) -> str | None:
    """The engine's vLLM version, once the DFlash drafter's config has been checked against it
    (``engine_check``): a combination that will not start raises (exit 3: another vLLM is needed; 2:
    a switch of this command line stops it); notes (a drafter that could not be read, a warm prefix
    that will not be claimed) are printed."""
    from . import engine_check
    from .engine import fixes_off
    from .launcher import served_vllm_version

    version = version or served_vllm_version(plan)
    notes = [n for n in plan.notes  # the profile's own
             if n.startswith(("prefix caching (", "prefix cache: --block-size", f"{plan.profile!r} profile: ",
                              "drafter: "))]
    if plan.drafter is not None:
        drafter, why = engine_check.read_config(plan.drafter, plan.drafter_revision)
        target, _ = engine_check.read_config(plan.model) if Path(plan.model).is_dir() else (None, None)
        notes += [f"the DFlash drafter was not checked against the engine: {why}"] if drafter is None else \
            engine_check.check(version, plan.engine, engine_check.shapes(drafter, target),
                               fixes_off(args.disable_fix), engine_check.server_env(plan.env),
                               plan.prefix_caching, plan.prefix_match_unit).notes
    if not args.quiet:
        for note in notes:  # stdout stays JSON with --json
            print(f"note: {note}", file=sys.stderr if args.json else sys.stdout, flush=True)
    return version


def _verify(args: argparse.Namespace, plan, base_url: str) -> dict:
    """`hybrid-build verify` against the artifact being served, once vLLM answers and before it is called
    ready: prints the figures; a failed check raises (the caller's ``finally`` stops the server). An
    artifact without a current reference, or a Hub id, cannot be checked: one line says why and serving
    goes on. Returns what ``--json`` reports under ``verify``."""
    from hybrid_build.core.errors import CannotVerify, NumericsError
    from hybrid_build.core.redaction import redact
    from hybrid_build.validate.verify.verify import load_reference, render, verify_server
    from hybrid_build.validate.verify.verify_paths import PathOptions, checker

    from .launcher import plan_key

    if args.no_verify:
        return {"outcome": "skipped", "reason": "--no-verify"}
    say = (lambda _m: None) if args.json else (lambda m: print(m, flush=True))
    artifact = Path(args.artifact).expanduser()
    try:
        if not artifact.is_dir():
            raise CannotVerify(f"could not verify: {args.artifact} is a Hub id, not a local artifact holding a "
                               "reference")
        reference = load_reference(artifact)
    except CannotVerify as e:
        say(redact(f"{e}; serving without the check"))
        return {"outcome": "could not run", "reason": redact(str(e))}
    recipe, profile = plan.recipe, plan.vllm.profile  # as the plan resolved them
    side = profile.artifact  # the dense profile serves the hybrid, the others the source
    try:
        report = verify_server(base_url, artifact, side=side, model=plan.model_name, timeout=300,
                               thresholds=recipe.verify, reference=reference, api_key=plan_key(plan) or "",
                               paths=checker(PathOptions(prefix_caching=profile.enable_prefix_caching)))
    except CannotVerify as e:
        raise CannotVerify(f"{e} (stopped the server; --no-verify serves without the check)") from None
    say(render(report))
    if report.outcome == "could not run":
        raise CannotVerify(f"{report.verdict_line()} (stopped the server; --no-verify serves without the check)")
    if report.outcome == "failed":
        if args.json:
            emit_json({"verify": report.to_json()})
        raise NumericsError(f"the server does not reproduce the artifact's reference ({'; '.join(report.failures)}): "
                            "stopped it (--no-verify serves it anyway)")
    return report.to_json()


def _node_limits(args: argparse.Namespace, mplan):
    """The watch across nodes: the head's /metrics for stalls; this machine's memory where it is a
    node (the others' memory is theirs: their vLLM or Ray dying is what is seen of them)."""
    from .watch import WatchLimits

    local = any(n.local for n in mplan.nodes)
    return WatchLimits(poll_s=args.watch_interval, stall_timeout_s=args.stall_timeout,
                       memory_reserve=int(args.memory_reserve * 1e9) if local else 0, stop_grace_s=args.stop_grace)


def _node_dead(cluster, mplan):
    """What ended among the nodes' processes (Ray on each node, vLLM on the head), naming the node."""
    dead = cluster.dead()
    if dead is None:
        return None
    what = dead.what if " on node " in dead.what else f"{dead.what} ({mplan.nodes[0].describe()})"
    return what, dead.process.returncode, dead.log_path


def _node_env(items: list[str]) -> dict[int | None, dict[str, str]]:
    """``--node-env [N:]KEY=VALUE`` values by node (None: every node)."""
    out: dict[int | None, dict[str, str]] = {}
    for item in items:
        m = re.fullmatch(r"(?:(\d+):)?([A-Za-z_][A-Za-z0-9_]*)=(.*)", item, re.S)
        if not m:
            raise UserError(f"--node-env {item!r}: write [N:]KEY=VALUE")
        out.setdefault(int(m[1]) if m[1] else None, {})[m[2]] = m[3]
    return out


def _run_nodes(args: argparse.Namespace, plan) -> int:
    """Several nodes: print the bring-up (--dry-run) or perform it, then hold until Ctrl-C. The API
    key is resolved as for one node, for the address the head's vLLM listens on."""
    from hybrid_build.core.http_client import metrics_url

    from .multinode import bring_up, check_tools, parse_nodes, plan_multinode, resolve_nodes, served_host
    from .watch import watch

    specs = parse_nodes(args.nodes, args.nodes_file)
    nodes = resolve_nodes(specs, dry_run=args.dry_run)
    plan = replace(plan, api_key=_api_key(args, served_host(plan.host, nodes[0])))
    mplan = plan_multinode(plan, specs, args.artifact, args.ifname, nodes=nodes,
                           parallel=args.parallel, gpus_per_node=args.gpus_per_node, ray_port=args.ray_port,
                           ib_hca=args.ib_hca, remote_venv=args.remote_venv, ray_temp_dir=args.ray_temp_dir,
                           image=args.image if args.engine == "docker" else None,
                           node_env=_node_env(args.node_env), force=args.force, ray_token_file=args.ray_token_file)
    if args.dry_run:
        if args.json:
            emit_json(mplan.to_json())
        else:
            print(mplan.render())
        return 0
    check_tools(mplan)
    key = mplan.serve.api_key
    if key is not None and not (args.quiet or args.json):
        print(key.announce(), flush=True)
    log_path = _log_path(args, mplan.serve.profile, mplan.serve.port)
    check_output_path(log_path, "--log", folder=False)
    if not (args.quiet or args.json):
        print(f"log: {log_path}", flush=True)
    say = (lambda _m: None) if args.quiet or args.json else (lambda m: print(m, flush=True))
    try:
        cluster, info = bring_up(mplan, log_path.parent, log_path, join_timeout=args.join_timeout,
                                 ready_timeout=args.ready_timeout, smoke=not args.no_smoke, on_event=say,
                                 verify=lambda: _verify(args, mplan.serve, mplan.base_url))
    except KeyboardInterrupt as e:
        return interrupt_exit_code(e)
    try:
        if args.json:
            emit_json(dict(info, api_key=key.to_json() if key else None))
        else:
            print(f"READY in {info['ready_s']:.0f} s on {len(info['nodes'])} nodes (TP={mplan.tp} x PP={mplan.pp})   "
                  f"base URL: {info['base_url']}   model: {info['model']}")
            if info["smoke_answer"]:
                print(f"smoke test: {info['smoke_answer'][:80]!r}")
            print("Ctrl-C stops vLLM and the Ray nodes.")
        sys.stdout.flush()
        fault = watch(None, metrics_url(mplan.base_url), _node_limits(args, mplan),
                      others=lambda: _node_dead(cluster, mplan))
        print(fault.line(), flush=True)
        return 1
    except KeyboardInterrupt as e:
        return interrupt_exit_code(e)
    finally:
        cluster.stop()
