"""Serve one artifact across several machines: vLLM's tensor or pipeline parallelism over a Ray
cluster, the way two DGX Sparks linked by ConnectX-7 serve a model one of them cannot hold.

``plan_multinode`` turns a single-node ``LaunchPlan`` (``engine.plan_launch``) and a list of hosts
into a ``MultiNodePlan``: for every node the check it runs, the ``ray start --block`` it runs
(head on the first host, workers on the others, with the link's NCCL/GLOO interface and address
settings), the Ray API query that says who has joined, and on the head ``vllm serve`` with
``--tensor-parallel-size``/``--pipeline-parallel-size`` and ``--distributed-executor-backend
ray``. The docker engine does the same inside the image on every host (host networking, the
runtime patches applied in each container before Ray starts). A host whose address is one of
this machine's runs its commands here; any other is reached with ``ssh -o BatchMode=yes`` (``-tt``
for the long-running ones, so that closing the connection ends them). Nothing runs in
``plan_multinode``: ``--dry-run`` prints the plan, ``bring_up`` performs it.

Only members get in: every Ray process runs with token authentication (``ray_auth``: one token
per run, handed to each node in a file of its own that only its owner can read, never on a command
line), the Ray dashboard stays on the head's loopback, and a node address that is not private
(``check_private_link``) is refused without ``force``: NCCL's and Gloo's traffic between the nodes
is not authenticated. The served API's key (``served_key``, on ``serve.api_key``) reaches the head's
vLLM in its environment only: from this process for a head on this machine, else from a file of
its own on the head, written and removed like the token's, that the head's shell reads into
``$VLLM_API_KEY``; serve's readiness probe, check and smoke test send it.

``bring_up`` checks every node first (same artifact by content, same vLLM, same Ray, same
hybrid-build runtime patches), then writes each node's token file (and the key's, on a head
elsewhere), starts the head, waits until it answers, starts the workers, waits until every node has
joined with its GPUs, starts vLLM, waits for READY and runs the smoke test. Anything that fails, and
Ctrl-C (or SIGTERM, SIGHUP), stops what was started, last started first: vLLM, the workers, the head
(``Cluster.stop``; a ``ray start --block`` that ends takes the Ray processes of its node with it),
then removes those files.

Run as ``python -m hybrid_build.serve.launch.multinode probe JSON`` on a node, it prints that node's
check as JSON (what ``bring_up`` compares).
"""
from __future__ import annotations

import hashlib
import ipaddress
import json
import logging
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from hybrid_build.core.bounded_read import InputRefused, parse_json, read_text
from hybrid_build.core.errors import ArtifactError, CannotRun, ExternalToolError, UserError
from hybrid_build.core.stop_signals import stop_signals_held

from . import ray_auth
from .engine import LaunchPlan, apply_patches_command, docker_mounts, runtime_dir
from .served_key import SERVER_ENV, is_loopback

log = logging.getLogger(__name__)

RAY_PORT = 6379
CONTAINER_PREFIX = "hybrid-build-ray"
SSH = ["ssh", "-o", "BatchMode=yes"]
PARALLEL = ("tp", "pp")
DASHBOARD_HOST = "127.0.0.1"  # Ray's dashboard (and its job API) on the head's loopback only
# the hybrid-build code that changes vLLM at run time (the runtime package, all of it): every node
# must run the same
RUNTIME_FILES = ("**/*.py",)
# asked on the head: the nodes Ray knows, by address (the Ray API, as a driver that leaves at once)
NODES_SCRIPT = ('import json,sys,ray;ray.init(address=sys.argv[1],logging_level="ERROR",log_to_driver=False);'
                'print(json.dumps([{"ip":n["NodeManagerAddress"],"alive":n["Alive"],'
                '"gpus":n["Resources"].get("GPU",0)} for n in ray.nodes()]))')


# ----------------------------------------------------------------------------- nodes


@dataclass(frozen=True)
class Node:
    """One machine: ``spec`` as given (``[user@]host``; what ssh is told), its address on the link,
    and whether that address is this machine's."""

    spec: str
    ip: str
    local: bool
    index: int
    resolved: bool = True  # False: a dry run's name that does not resolve here; ``ip`` holds the name

    @property
    def role(self) -> str:
        return "head" if self.index == 0 else "worker"

    def describe(self) -> str:
        where = "this machine" if self.local else f"ssh {self.spec}"
        return f"node {self.index + 1} ({self.role}, {self.ip}, {where})"


def parse_nodes(nodes: str | None, nodes_file: Path | None) -> list[str]:
    """Host specs from ``--nodes A,B`` or a file (one a line, ``#`` comments); the first is the head."""
    if nodes and nodes_file:
        raise UserError("give --nodes or --nodes-file, not both")
    if nodes_file is not None:
        text = read_text(nodes_file, f"--nodes-file {nodes_file}", error=UserError)  # a FIFO: refused, not waited on
        specs = [line.split("#", 1)[0].strip() for line in text.splitlines()]
    else:
        specs = [s.strip() for s in (nodes or "").split(",")]
    specs = [s for s in specs if s]
    if len(specs) < 2:
        raise UserError(f"several nodes need two hosts or more, got {len(specs)}: {', '.join(specs) or 'none'}")
    seen = {}
    for s in specs:
        if any(c.isspace() for c in s) or s.startswith("-"):
            raise UserError(f"{s!r}: not a host (write [user@]host, one per entry)")
        if s in seen:
            raise UserError(f"{s!r} is named twice")
        seen[s] = True
    return specs


def is_local_address(ip: str) -> bool:
    """True if ``ip`` is an address of this machine: only those can be bound."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.bind((ip, 0))
        return True
    except OSError:
        return False


def resolve_nodes(specs: list[str], dry_run: bool = False) -> list[Node]:
    """Each node's address on the link. ``dry_run``: a name that does not resolve on this machine (the
    nodes' names in the README's example, a name only the nodes' own hosts files know) stays a name in
    the plan, said in its notes; serving resolves it and refuses it when it does not resolve."""
    nodes = []
    for i, spec in enumerate(specs):
        host = spec.rsplit("@", 1)[-1].strip("[]")
        try:
            ip = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)[0][4][0]
        except socket.gaierror as e:
            if dry_run:
                nodes.append(Node(spec, host, False, i, resolved=False))
                continue
            raise UserError(f"{spec}: cannot resolve {host!r} ({e.strerror}); give the node's address on the link")
        nodes.append(Node(spec, ip, is_local_address(ip), i))
    ips = [n.ip for n in nodes]
    dup = next((ip for ip in ips if ips.count(ip) > 1), None)
    if dup:
        raise UserError(f"two nodes resolve to {dup}: each node needs its own address on the link")
    return nodes


def check_private_link(nodes: list[Node], force: bool = False) -> str | None:
    """Refuse (one line, exit 2) a node whose address is neither private, link-local nor loopback:
    Ray checks its token, but NCCL's and Gloo's traffic between the nodes (tensors, and the
    rendezvous that sets it up) is neither authenticated nor encrypted, and Ray's token itself
    crosses the link in clear. ``force``: go on, and return the warning to show."""
    public = []
    for node in (n for n in nodes if n.resolved):  # a dry run's unresolved name is checked when serving
        ip = ipaddress.ip_address(node.ip.split("%", 1)[0])  # an IPv6 scope (fe80::1%eth0) is not part of it
        if not (ip.is_private or ip.is_link_local or ip.is_loopback):
            spec = f" ({node.spec})" if node.spec.rsplit("@", 1)[-1].strip("[]") != node.ip else ""
            public.append(f"node {node.index + 1}{spec} is at {node.ip}")
    if not public:
        return None
    kind = "a private or link-local address" if len(public) == 1 else "private or link-local addresses"
    why = (f"{' and '.join(public)}, not {kind}: NCCL and Gloo traffic between the nodes is not authenticated, so "
           "the link must be one only the nodes reach")
    if not force:
        raise UserError(f"{why}; give the nodes' addresses on the private link, or --force")
    return f"{why} (--force: going on)"


# ----------------------------------------------------------------------------- plan


@dataclass
class Command:
    """One command on one node: ``argv`` as that node runs it, ``env`` on top of its environment."""

    node: Node
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    what: str = ""
    tty: bool = False  # long-running: over ssh it gets a terminal, so closing the connection ends it
    # another machine's: variables its shell reads from a file there (a secret: on no command line)
    env_files: dict[str, str] = field(default_factory=dict)

    def local_argv(self, remote_venv: str | None = None) -> list[str]:
        """What this machine executes: the command itself, or ssh with it."""
        inner = (["env"] + [f"{k}={v}" for k, v in sorted(self.env.items())] if self.env else []) + self.argv
        if self.node.local:
            return inner
        line = "exec " + " ".join(_remote_word(w) for w in inner)
        if remote_venv:
            line = f"PATH={shlex.quote(remote_venv.rstrip('/') + '/bin')}:\"$PATH\" {line}"
        for k, path in sorted(self.env_files.items()):  # `&&`: a file that cannot be read starts nothing
            line = f'{k}="$(cat {_remote_word(path)})" && export {k} && {line}'
        return SSH + (["-tt"] if self.tty else []) + [self.node.spec, line]


def _remote_word(word: str) -> str:
    """``shlex.quote`` for the node's shell, except that a leading ``~/`` (alone, after ``KEY=`` or
    as a ``-v`` mount's source) stays the node user's home: ``"$HOME"/...``."""
    m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*=)?~/(.+)", word, re.S)
    if m is None:
        return shlex.quote(word)
    return (m[1] or "") + '"$HOME"/' + shlex.quote(m[2])


@dataclass(frozen=True)
class NodeFile:
    """A secret this run hands one node in a file of its own (0600, ``ray_auth.write_node_file``)
    and removes at teardown: the Ray token on every node, the served API's key on a head elsewhere."""

    node: Node
    path: str  # on that node ("~/": its home)
    kind: str  # ray_auth.TOKEN_FILE or ray_auth.KEY_FILE

    @property
    def holds(self) -> str:
        return "the Ray token" if self.kind == ray_auth.TOKEN_FILE else "the served API's key"


@dataclass
class MultiNodePlan:
    nodes: list[Node]
    engine: str
    tp: int
    pp: int
    gpus_per_node: int
    ray_address: str
    probes: list[Command]  # one per node; local ones run in this process
    ray: list[Command]  # head first
    nodes_query: Command  # on the head: who has joined
    vllm: Command  # on the head
    stops: list[Command]  # docker: `docker stop` per node, head first
    serve: LaunchPlan  # the single-node plan the vLLM command is built from (model name, base URL)
    remote_venv: str | None = None
    ray_temp_dir: str | None = None
    notes: list[str] = field(default_factory=list)
    probe_args: dict = field(default_factory=dict)
    token: ray_auth.RayToken = field(default_factory=lambda: ray_auth.RayToken("generated"))
    token_files: list[str] = field(default_factory=list)  # one per node, on that node ("~/": its home)
    key_file: str | None = None  # the served API's key, on a head that is another machine

    def node_files(self) -> list[NodeFile]:
        """The secrets' files this run writes, in order."""
        files = [NodeFile(n, self.token_files[n.index], ray_auth.TOKEN_FILE) for n in self.nodes]
        if self.key_file:
            files.append(NodeFile(self.nodes[0], self.key_file, ray_auth.KEY_FILE))
        return files

    def file_write(self, f: NodeFile) -> Command:
        """Writes the secret, read from stdin, into ``f`` (another machine's; this machine's are
        written in this process)."""
        return Command(f.node, [sys_python(), "-m", "hybrid_build.serve.launch.ray_auth", "write", f.path],
                       what=f"hand {f.node.describe()} {f.holds}: into {f.path} (0600)"
                            + (", in this process" if f.node.local else ", read from stdin over ssh"))

    def file_remove(self, f: NodeFile) -> Command:
        return Command(f.node, ["rm", "-f", f.path], what=f"remove {f.path} ({f.holds}) of {f.node.describe()}")

    @property
    def vllm_env(self) -> dict[str, str]:
        """What the head's vLLM gets in its environment from this process, never shown: the served
        API's key, when the head is this machine (one elsewhere reads ``key_file``)."""
        return self.serve.secret_env if self.nodes[0].local else {}

    @property
    def base_url(self) -> str:
        return self.serve.base_url

    def steps(self) -> list[tuple[str, list[str] | None]]:
        """(what, the exact command this machine runs) in order; None: done in this process."""
        out: list[tuple[str, list[str] | None]] = []
        for p in self.probes:
            out.append((p.what, None if p.node.local else p.local_argv(self.remote_venv)))
        for f in self.node_files():
            w = self.file_write(f)
            out.append((w.what, None if f.node.local else w.local_argv(self.remote_venv)))
        out.append((self.ray[0].what, self.ray[0].local_argv(self.remote_venv)))
        out.append(("wait until the head answers: " + self.nodes_query.what,
                    self.nodes_query.local_argv(self.remote_venv)))
        for c in self.ray[1:]:
            out.append((c.what, c.local_argv(self.remote_venv)))
        out.append((f"wait until all {len(self.nodes)} nodes have joined with {self.gpus_per_node} GPU(s) each "
                    "(the same query, repeated)", None))
        out.append((self.vllm.what, self.vllm.local_argv(self.remote_venv)))
        out.append((f"wait for GET {self.base_url}/models, then the smoke test", None))
        return out

    def teardown(self) -> list[tuple[str, list[str] | None]]:
        if self.stops:  # the head's container holds vLLM too: it goes last
            out = [("stop the `docker exec` of vLLM (vLLM itself ends with the head's container)", None)] + \
                  [(s.what, s.local_argv(self.remote_venv)) for s in reversed(self.stops)]
        else:
            out = [("stop vLLM (SIGTERM; over ssh, closing its connection)", None)] + \
                  [(f"stop {c.what.split(':')[0]} (SIGTERM to its `ray start --block`, which stops that node's Ray)",
                    None) for c in reversed(self.ray)]
        for f in self.node_files():  # once no Ray process is left to read them
            r = self.file_remove(f)
            out.append((r.what, None if f.node.local else r.local_argv(self.remote_venv)))
        return out

    def key_lines(self) -> list[str]:
        """Where the served API's key is and how vLLM gets it, in words (never the key)."""
        key = self.serve.api_key
        if key is None:
            return [f"no API key: vLLM listens on loopback ({self.serve.host})"]
        how = f"from {self.key_file} on the head" if self.key_file else "from this process"
        return [f"{key.describe()}; vLLM on the head gets it as {SERVER_ENV} in its environment ({how}), never on a "
                "command line", key.client_hint()]

    def to_json(self) -> dict:
        return {"nodes": [{"spec": n.spec, "ip": n.ip, "local": n.local, "role": n.role} for n in self.nodes],
                "engine": self.engine, "tensor_parallel_size": self.tp, "pipeline_parallel_size": self.pp,
                "gpus_per_node": self.gpus_per_node, "ray_address": self.ray_address,
                "ray_auth": dict(self.token.to_json(), node_files=self.token_files, dashboard_host=DASHBOARD_HOST),
                "api_key": dict(self.serve.api_key.to_json(), head_file=self.key_file) if self.serve.api_key else None,
                "model_name": self.serve.model_name, "base_url": self.base_url, "model": self.serve.model,
                "profile": self.serve.profile,
                "steps": [{"what": w, "argv": a} for w, a in self.steps()],
                "teardown": [{"what": w, "argv": a} for w, a in self.teardown()],
                "notes": self.notes}

    def render(self) -> str:
        lines = [f"# {len(self.nodes)} nodes, {self.engine} engine: vLLM with TP={self.tp} x PP={self.pp} over Ray "
                 f"at {self.ray_address}",
                 f"# Ray token authentication: {self.token.describe()}, in a file per node that only its owner can "
                 f"read (the token itself is never shown); the dashboard on {DASHBOARD_HOST}"]
        lines += [f"# {line}" for line in self.key_lines()]
        for what, argv in self.steps():
            lines.append(f"# {what}")
            if argv is not None:
                lines.append(shlex.join(argv))
        lines.append("# on failure or Ctrl-C, in this order:")
        for what, argv in self.teardown():
            lines.append(f"# {what}")
            if argv is not None:
                lines.append(shlex.join(argv))
        lines += [f"# {n}" for n in self.notes]
        return "\n".join(lines)


def link_env(node: Node, ifname: str, ib_hca: str | None) -> dict[str, str]:
    """What NCCL, Gloo, torch and vLLM need to use the link (not the management network) and to
    advertise this node's address on it."""
    env = {"NCCL_SOCKET_IFNAME": ifname, "GLOO_SOCKET_IFNAME": ifname, "TP_SOCKET_IFNAME": ifname,
           "UCX_NET_DEVICES": ifname, "VLLM_HOST_IP": node.ip}
    if ib_hca:
        env["NCCL_IB_HCA"] = ib_hca  # a Spark's 200G port is two RoCE devices: name both for full speed
    return env


def _ray_argv(node: Node, head: Node, port: int, gpus: int, temp_dir: str | None) -> list[str]:
    argv = ["ray", "start", "--block"]
    argv += (["--head", "--port", str(port), "--dashboard-host", DASHBOARD_HOST] if node is head
             else ["--address", f"{head.ip}:{port}"])
    argv += ["--node-ip-address", node.ip, "--num-gpus", str(gpus), "--disable-usage-stats"]
    if temp_dir:
        argv += ["--temp-dir", f"{temp_dir.rstrip('/')}/node{node.index + 1}"]
    return argv


def _parallel_args(tp: int, pp: int) -> list[str]:
    return ["--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp),
            "--distributed-executor-backend", "ray"]


def served_host(host: str, head: Node) -> str:
    """Where the head's vLLM listens: ``host`` (``--host``), except that loopback on a head that is
    another machine becomes the head's address on the link, where the smoke test reaches it from
    here. A key is needed where this is not loopback (``served_key.resolve``)."""
    return head.ip if not head.local and is_loopback(host) else host


def plan_multinode(serve: LaunchPlan, specs: list[str], artifact: str, ifname: str | None, *,
                   parallel: str = "tp", gpus_per_node: int = 1, ray_port: int = RAY_PORT,
                   ib_hca: str | None = None, remote_venv: str | None = None, ray_temp_dir: str | None = None,
                   image: str | None = None, nodes: list[Node] | None = None,
                   node_env: dict[int | None, dict[str, str]] | None = None, force: bool = False,
                   ray_token_file: Path | None = None) -> MultiNodePlan:
    """The multi-node bring-up of ``serve`` (the single-node plan of the same profile, built for the
    local engine: its argv is ``vllm serve ...``); ``image`` selects the docker engine. ``node_env``
    adds environment to every node (key None) or to node N (1-based): e.g. one GPU each with
    ``CUDA_VISIBLE_DEVICES`` when two nodes share a machine. A node address that is not private is
    refused unless ``force``; the Ray token comes from ``ray_token_file``, ``$RAY_AUTH_TOKEN``,
    ``$RAY_AUTH_TOKEN_PATH`` or is generated when the cluster starts (``ray_auth.resolve_token``).
    ``serve.api_key`` (``served_key.resolve`` for ``served_host``) goes to the head's vLLM: through
    this process's environment, or a file on a head elsewhere (``key_file``)."""
    if not ifname:
        raise UserError("several nodes need --ifname: the network interface of the link (e.g. the ConnectX-7 port "
                        "`ibdev2netdev` shows); without it NCCL may pick the management network")
    if parallel not in PARALLEL:
        raise UserError(f"--parallel must be one of {', '.join(PARALLEL)}")
    if gpus_per_node < 1:
        raise UserError(f"--gpus-per-node must be >= 1, got {gpus_per_node}")
    nodes = nodes or resolve_nodes(specs)
    public = check_private_link(nodes, force)
    head = nodes[0]
    n = len(nodes)
    node_env = node_env or {}
    bad = [k for k in node_env if k is not None and not 1 <= k <= n]
    if bad:
        raise UserError(f"--node-env names node {bad[0]}, but there are {n} nodes (1..{n})")
    owned = [k for part in node_env.values() for k in part if k.startswith("RAY_AUTH_")]
    if owned:
        raise UserError(f"--node-env {owned[0]}: serve sets Ray's authentication itself (docs/multinode.md, Security)")
    token = ray_auth.resolve_token(ray_token_file)
    token_files = [ray_auth.node_file(ray_auth.TOKEN_FILE, ray_port, node.index, node.local) for node in nodes]
    key_file = (ray_auth.node_file(ray_auth.KEY_FILE, ray_port, head.index, False)
                if serve.api_key is not None and not head.local else None)
    key_env = {SERVER_ENV: key_file} if key_file else {}  # read by the head's shell into vLLM's environment

    def extra(node: Node) -> dict[str, str]:
        return dict(node_env.get(None, {}), **node_env.get(node.index + 1, {}))
    tp, pp = (n * gpus_per_node, 1) if parallel == "tp" else (gpus_per_node, n)
    address = f"{head.ip}:{ray_port}"
    notes = list(serve.notes)
    unresolved = [n.spec for n in nodes if not n.resolved]
    if unresolved:
        notes.append(f"{', '.join(unresolved)}: not resolved on this machine; the plan shows the name where serving "
                     "puts the address (serving resolves it and refuses an address that is not private)")
    if public:
        log.warning("%s", public)
        notes.append(public)
    host = served_host(serve.host, head)
    if host != serve.host:
        notes.append(f"the head is another machine: vLLM listens on its link address {head.ip}")
    url_plan = replace(serve, host=host, notes=notes)  # keeps the key: serve's requests send it
    flags: list[str] = []
    sharing = sum(node.local for node in nodes)
    if parallel == "tp" and sharing > 1 and "--disable-custom-all-reduce" not in serve.vllm.argv():
        # vLLM finds the ranks of nodes on one machine "in the same node" (shared memory works) and
        # sets up its custom all-reduce as over one node's GPUs: rank 1 then asks for a second GPU
        # that its node does not have (IndexError, vLLM 0.25.1 on 2 H200s, docs/multinode.md)
        flags.append("--disable-custom-all-reduce")
        notes.append(f"{sharing} nodes share this machine: vLLM's custom all-reduce is off (it would take their "
                     "ranks for GPUs of one node); the all-reduce goes through NCCL")
    # the head's vLLM request: where it listens, and its parallel flags after the profile's arguments
    head_vllm = replace(serve.vllm, host=host, extra=tuple(flags + _parallel_args(tp, pp)))
    model_local = Path(serve.model).expanduser()
    probe_args = {"artifact": str(Path(artifact).expanduser().resolve()) if Path(artifact).expanduser().exists()
                  else artifact, "model": serve.model if model_local.is_dir() else None,
                  "engine": serve.engine if image is None else "docker", "image": image}

    probes = [Command(node, [sys_python(), "-m", "hybrid_build.serve.launch.multinode", "probe",
                             json.dumps(probe_args, separators=(",", ":"))],
                      what=f"check {node.describe()}: artifact content, vLLM, Ray and runtime patches"
                           + (" (in this process)" if node.local else ""))
              for node in nodes]
    serve_env = {k: v for k, v in serve.env.items() if not (image and k == "VLLM_PLUGINS")}
    ray_cmds: list[Command] = []
    stops: list[Command] = []
    if image is None:
        for node in nodes:
            # Ray's workers inherit it: the link settings and the token's file
            env = dict(serve_env, **link_env(node, ifname, ib_hca), **extra(node),
                       **ray_auth.auth_env(token_files[node.index]))
            ray_cmds.append(Command(node, _ray_argv(node, head, ray_port, gpus_per_node, ray_temp_dir), env,
                                    f"Ray {node.role} on {node.describe()}", tty=True))
        head_auth = ray_auth.auth_env(token_files[0])
        query = Command(head, ["python3", "-c", NODES_SCRIPT, address], head_auth,
                        what="the nodes Ray lists (Ray API, on the head)")
        vllm = Command(head, ["vllm"] + head_vllm.argv(),
                       dict(serve_env, **link_env(head, ifname, ib_hca), **extra(head), **head_auth,
                            RAY_ADDRESS=address),
                       f"vLLM on the head: TP={tp} x PP={pp} over Ray", tty=True, env_files=key_env)
    else:
        mounts = docker_mounts(head_vllm)  # the same folders in every node's container
        rdma = ["--device", "/dev/infiniband", "--ulimit", "memlock=-1"] if ib_hca else []
        for node in nodes:
            name = f"{CONTAINER_PREFIX}-{node.index + 1}"
            # the token's file mounted read-only; `docker exec` (vLLM, the query) inherits the environment
            env = dict(serve_env, **link_env(node, ifname, ib_hca), **extra(node),
                       **ray_auth.auth_env(ray_auth.CONTAINER_TOKEN))
            flags = [f for k, v in sorted(env.items()) for f in ("-e", f"{k}={v}")]
            token_mount = ["-v", f"{token_files[node.index]}:{ray_auth.CONTAINER_TOKEN}:ro"]
            ray_argv = _ray_argv(node, head, ray_port, gpus_per_node, None)
            script = f"{apply_patches_command()} && exec {shlex.join(ray_argv)}"
            argv = (["docker", "run", "--rm", "--name", name, "--network", "host", "--ipc", "host", "--gpus", "all"]
                    + rdma + mounts.flags + token_mount + flags + [image, "bash", "-c", script])
            ray_cmds.append(Command(node, argv, what=f"Ray {node.role} on {node.describe()}, in the image with "
                                                     "the runtime patches applied", tty=True))
            stops.append(Command(node, ["docker", "stop", name], what=f"stop the container of {node.describe()}"))
        head_name = f"{CONTAINER_PREFIX}-1"
        query = Command(head, ["docker", "exec", head_name, "python3", "-c", NODES_SCRIPT, address],
                        what="the nodes Ray lists (Ray API, in the head's container)")
        # the key's name alone, as for one node (engine.plan_launch): docker exec copies its value
        key_flag = ["-e", SERVER_ENV] if serve.api_key is not None else []
        vllm = Command(head, ["docker", "exec", "-e", f"RAY_ADDRESS={address}", *key_flag, head_name, "vllm"]
                       + mounts.vllm.argv(), what=f"vLLM in the head's container: TP={tp} x PP={pp} over Ray",
                       tty=True, env_files=key_env)
    return MultiNodePlan(nodes, "docker" if image else "local", tp, pp, gpus_per_node, address, probes, ray_cmds,
                         query, vllm, stops, url_plan, remote_venv, ray_temp_dir, notes, probe_args, token, token_files,
                         key_file)


def check_tools(plan: MultiNodePlan) -> None:
    """One line when a tool this machine runs is missing (ssh; ray/vllm or docker for local nodes)."""
    env = child_env()
    need = set()
    if any(not n.local for n in plan.nodes):
        need.add("ssh")
    if any(n.local for n in plan.nodes):
        need |= {"docker"} if plan.engine == "docker" else {"ray", "vllm"}
    for tool in sorted(need):
        if shutil.which(tool, path=env["PATH"]) is None:
            raise CannotRun(f"{tool!r} was not found on PATH" + (
                ": pip install hybrid-build brings Ray" if tool == "ray" else ""))


def sys_python() -> str:
    """How a node's commands name Python: ``python3`` of the node's PATH (here: hybrid-build's own
    first, see ``child_env``; elsewhere: ``--remote-venv``)."""
    return "python3"


# ----------------------------------------------------------------------------- checks


def runtime_fingerprint() -> str:
    """sha256 over the hybrid-build files that change vLLM at run time (patches, plugin, fixes, kernel)."""
    root = runtime_dir()
    h = hashlib.sha256()
    for pattern in RUNTIME_FILES:
        for p in sorted(root.glob(pattern)):
            h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def node_identity(artifact: Path) -> dict:
    """The model folder's identity on this node and whether this node's files have its bytes: for an
    artifact, ``core.artifact.build_fingerprint`` of its provenance (the same on every node that
    holds the same bytes), each file checked against it (sha256 cached in the work folder); for a
    source folder served directly, its content fingerprint."""
    from hybrid_build.core.artifact import CONFIG, WORK_DIR, build_fingerprint, read_provenance
    from hybrid_build.core.integrity import check_artifact
    from hybrid_build.core.source_identity import DIGEST_CACHE, SourceDigests

    prov = read_provenance(artifact, missing_ok=True)
    if prov is None:  # a source folder served directly: its content is its identity
        if not (artifact / CONFIG).is_file():
            return {"fingerprint": None, "problem": f"{artifact} is not here"}
        return {"fingerprint": SourceDigests(artifact, artifact / WORK_DIR / DIGEST_CACHE).fingerprint(),
                "problem": None}
    found = check_artifact(artifact, prov)  # every file by size and sha256, cached by stat (core.integrity)
    return {"fingerprint": build_fingerprint(prov), "problem": found.problem}


def _version_of(argv: list[str]) -> str | None:
    env = child_env()
    if shutil.which(argv[0], path=env["PATH"]) is None:
        return None
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [line.strip() for line in r.stdout.splitlines() if line.strip()]
    return lines[-1] if r.returncode == 0 and lines else None


def probe(args: dict) -> dict:
    """This node's answer to the checks: artifact identity (and the served source's, when it is
    another folder), vLLM (version, or the image's id), Ray, hybrid-build runtime patches."""
    from importlib import metadata

    from hybrid_build.core import __version__

    out: dict = {"host": socket.gethostname(), "hybrid_build": __version__, "runtime": runtime_fingerprint()}
    try:
        out["ray"] = metadata.version("ray")
    except metadata.PackageNotFoundError:
        out["ray"] = None
    out["artifact"] = node_identity(Path(args["artifact"]))
    if args.get("model") and Path(args["model"]).resolve() != Path(args["artifact"]).resolve():
        out["model"] = node_identity(Path(args["model"]))
    if args.get("engine") == "docker":  # the image's id pins its vLLM; Ray runs inside it too
        out["vllm"] = _version_of(["docker", "image", "inspect", "--format", "{{.Id}}", args["image"]])
        out["ray"] = out["vllm"] and _version_of(["docker", "run", "--rm", "--entrypoint", "python3", args["image"],
                                                  "-c", "import ray; print(ray.__version__)"])
    else:
        out["vllm"] = _version_of(["vllm", "--version"])
    return out


def compare_probes(nodes: list[Node], answers: list[dict], engine: str) -> None:
    """Raise one line naming the first node that differs from the head, or lacks something."""
    what_vllm = "the image (docker pull it there)" if engine == "docker" else "vllm on its PATH"
    for node, a in zip(nodes, answers):
        for key in ("artifact", "model"):
            if key in a and a[key].get("problem"):
                raise ArtifactError(f"{node.describe()}: {a[key]['problem']}")
        if not a.get("vllm"):
            raise CannotRun(f"{node.describe()}: no {what_vllm}")
        if not a.get("ray"):
            raise CannotRun(f"{node.describe()}: " + ("the image has no Ray (build one FROM it with "
                                    "`pip install ray`)" if engine == "docker" else
                                    "Ray is not installed (pip install hybrid-build there)"))
    head = answers[0]
    for node, a in zip(nodes[1:], answers[1:]):
        for key, label in (("artifact", "another artifact (by content)"), ("model", "another served model"),
                           ("vllm", "another vLLM" if engine == "local" else "another image"),
                           ("ray", "another Ray"), ("runtime", "other hybrid-build runtime patches"),
                           ("hybrid_build", "another hybrid-build")):
            mine, theirs = a.get(key), head.get(key)
            if isinstance(mine, dict):
                mine, theirs = mine.get("fingerprint"), (theirs or {}).get("fingerprint")
            if mine != theirs:
                raise (ArtifactError if key in ("artifact", "model") else ExternalToolError)(
                    f"{node.describe()} has {label} than the head: {_short(mine)} vs {_short(theirs)}")


def _short(v) -> str:
    s = str(v)
    return s[:12] + "..." if len(s) > 16 and " " not in s else s


# ----------------------------------------------------------------------------- running


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of commands run here: hybrid-build's own bin folder first on PATH, so the
    ``ray``, ``vllm`` and ``python3`` beside it are the ones that run."""
    env = dict(os.environ)
    # a token in this environment would reach every child's (and override the file Ray is given):
    # the nodes get the file only; a served key only the head's vLLM, as planned (``vllm_env``)
    env.pop(ray_auth.TOKEN_ENV, None)
    env.pop(SERVER_ENV, None)
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    env.update(extra or {})
    return env


def run_once(cmd: Command, remote_venv: str | None, timeout: float, stdin_text: str | None = None) -> str:
    """Run a short command on its node (``stdin_text`` on its stdin); its stdout, or
    ExternalToolError with the last lines."""
    argv = cmd.local_argv(remote_venv)
    stdin = {"input": stdin_text} if stdin_text is not None else {"stdin": subprocess.DEVNULL}
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=child_env(), **stdin)
    except subprocess.TimeoutExpired:
        raise CannotRun(f"{cmd.node.describe()}: {cmd.argv[0]} did not answer in {timeout:.0f} s")
    except OSError as e:
        raise CannotRun(f"{cmd.node.describe()}: cannot run {argv[0]} ({e.strerror or e})")
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or r.stdout.strip().splitlines() or [f"exit code {r.returncode}"])[-1]
        raise ExternalToolError(f"{cmd.node.describe()}: {shlex.join(cmd.argv[:3])} failed: {last}")
    return r.stdout


def _last_json(text: str):
    for line in reversed(text.strip().splitlines()):
        try:  # a node's answer: nested at most MAX_DEPTH, never a RecursionError
            return parse_json(line, "a node's answer")
        except InputRefused:
            continue
    raise ValueError("no JSON line")


def check_nodes(plan: MultiNodePlan, timeout: float = 3600) -> list[dict]:
    """Every node's probe (in parallel: each may hash the artifact once), compared with the head's."""
    here: dict = {}
    here_lock = threading.Lock()

    def one(cmd: Command) -> dict:
        if cmd.node.local:  # every address of this machine gets the same answer: probe it once
            with here_lock:
                if not here:
                    here.update(probe(plan.probe_args))
                return dict(here)
        out = run_once(cmd, plan.remote_venv, timeout)
        try:
            return _last_json(out)
        except ValueError:
            raise ExternalToolError(f"{cmd.node.describe()}: the check printed no answer (is hybrid-build installed "
                                    "there? --remote-venv names its environment)")

    with ThreadPoolExecutor(max_workers=len(plan.probes)) as pool:
        answers = list(pool.map(one, plan.probes))
    compare_probes(plan.nodes, answers, plan.engine)
    return answers


@dataclass
class Started:
    """A long-running command this bring-up started, and how to stop it."""

    what: str
    process: subprocess.Popen
    log_path: Path
    stop_cmd: Command | None = None
    log_from: int = 0  # where its lines begin in the log (logs are appended to)


class Cluster:
    """What ``bring_up`` started, in order, and the secrets' files it wrote; ``stop`` ends the
    processes last-started first, then removes the files."""

    def __init__(self, plan: MultiNodePlan) -> None:
        self.plan = plan
        self.started: list[Started] = []
        self.written: list[NodeFile] = []  # the files this run (may have) written
        self._lock = threading.Lock()
        self.stopped = threading.Event()

    def write_secrets(self) -> None:
        """Give every node the cluster's token in its file, and a head elsewhere the served API's
        key. A file is listed for removal before it is written (an interrupted write leaves nothing
        behind) and taken off again when the write is refused (a file that was there already is not
        this run's)."""
        secrets = {ray_auth.TOKEN_FILE: self.plan.token.value(),  # a generated token: one per run
                   ray_auth.KEY_FILE: self.plan.serve.secret_env.get(SERVER_ENV, "")}
        for f in self.plan.node_files():
            with self._lock:
                self.written.append(f)
            try:
                if f.node.local:
                    ray_auth.write_node_file(Path(f.path), secrets[f.kind])
                else:
                    run_once(self.plan.file_write(f), self.plan.remote_venv, timeout=120,
                             stdin_text=secrets[f.kind] + "\n")
            except (UserError, ExternalToolError):
                with self._lock:
                    self.written.remove(f)
                raise

    def remove_secrets(self) -> None:
        with self._lock:
            todo, self.written = self.written, []
        for f in todo:
            try:
                if f.node.local:
                    Path(f.path).unlink(missing_ok=True)
                else:
                    run_once(self.plan.file_remove(f), self.plan.remote_venv, timeout=60)
            except (OSError, ExternalToolError) as e:
                log.warning("could not remove %s (%s) of %s: %s", f.path, f.holds, f.node.describe(), e)

    def start(self, cmd: Command, log_path: Path, stop_cmd: Command | None = None,
              secret_env: dict[str, str] | None = None) -> Started:
        """Start ``cmd`` here (or over ssh); ``secret_env`` goes into its environment, never on a
        command line."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_from = log_path.stat().st_size if log_path.exists() else 0
        with open(log_path, "ab") as out, stop_signals_held():
            # a session of its own: a Ctrl-C in the terminal reaches this process only, which stops
            # the others in order
            proc = subprocess.Popen(cmd.local_argv(self.plan.remote_venv), stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=child_env(secret_env), start_new_session=True)
            s = Started(cmd.what, proc, log_path, stop_cmd, log_from)
            with self._lock:
                self.started.append(s)
        log.info("started %s (pid %d), log %s", cmd.what, proc.pid, log_path)
        return s

    def stop(self, grace: float = 30.0) -> None:
        """Stop everything started, last first; each is waited for before the next is stopped."""
        with self._lock:
            todo, self.started = list(reversed(self.started)), []
        for s in todo:
            if s.stop_cmd is not None:
                try:
                    run_once(s.stop_cmd, self.plan.remote_venv, timeout=grace + 30)
                except ExternalToolError as e:
                    log.warning("%s", e)
            if s.process.poll() is None:
                s.process.terminate()
                try:
                    s.process.wait(grace)
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop in %.0f s: killed", s.what, grace)
                    s.process.kill()
                    s.process.wait()
        self.remove_secrets()
        self.stopped.set()

    def dead(self) -> Started | None:
        with self._lock:
            return next((s for s in self.started if s.process.poll() is not None), None)


def _exited(s: Started) -> ExternalToolError:
    from .launcher import tail

    return ExternalToolError(f"{s.what} exited with code {s.process.returncode}; last log lines:\n"
                             f"{tail(s.log_path, start=s.log_from)}")


def query_nodes(plan: MultiNodePlan) -> list[dict] | None:
    """The nodes Ray lists, or None while the head does not answer."""
    try:
        return _last_json(run_once(plan.nodes_query, plan.remote_venv, timeout=120))
    except (ExternalToolError, ValueError):
        return None


def wait_for(condition: Callable[[], object], cluster: Cluster, timeout: float, what: str, poll: float = 1.0):
    """Poll ``condition`` until it returns something truthy; a started process that exits, or the
    timeout, ends the wait with an error."""
    t0 = time.monotonic()
    while True:
        dead = cluster.dead()
        if dead is not None:
            raise _exited(dead)
        got = condition()
        if got:
            return got
        if time.monotonic() - t0 > timeout:
            raise ExternalToolError(f"{what}: not done after {timeout:.0f} s")
        if cluster.stopped.wait(poll):
            raise ExternalToolError(f"{what}: stopped")


def check_head_port(plan: MultiNodePlan) -> None:
    """Before anything starts: the port vLLM will serve on must be free where the head is this machine
    (``listener.taken_by``, the holder named); exit 3. A head elsewhere is checked by its own vLLM."""
    from .listener import taken_by

    held = taken_by(plan.serve.host, plan.serve.port) if plan.nodes[0].local else None
    if held:
        raise CannotRun(f"port {plan.serve.port} is taken by {held}: no node was started (stop that process, or "
                        "choose another --port)")


def bind_to_head(plan: MultiNodePlan, vllm: Started, warn: bool = True) -> None:
    """The server answering on the port is the vLLM this bring-up started: where the head is this machine,
    its process tree holds every listening socket a client of the port reaches (``listener.owner``);
    another holder raises (exit 3; ``bring_up`` then stops the nodes). Where that cannot be told (a head
    elsewhere; docker's proxy holding the port; no ``/proc``), a warning where ``warn``."""
    from .listener import engine_owner

    port = plan.serve.port
    if not plan.nodes[0].local:
        if warn:
            log.warning("who answers on port %d of %s cannot be told from here: it was free there when vLLM "
                        "started (its own bind would have failed otherwise)", port, plan.nodes[0].describe())
        return
    got = engine_owner(port, plan.serve.host, vllm.process.pid, plan.engine == "docker")
    if got.ours is False:
        raise CannotRun(f"port {port} answers, but {got.holder} holds it, not the vLLM this bring-up started (pid "
                        f"{vllm.process.pid}): nothing was verified or announced, the nodes are stopped (stop that "
                        "process, or choose another --port)")
    if got.ours is None and warn:
        log.warning("who answers on port %d cannot be told here (%s); it was free when vLLM started", port, got.why)


def bring_up(plan: MultiNodePlan, log_dir: Path, log_path: Path, *, join_timeout: float = 600,
             ready_timeout: float = 1800, smoke: bool = True, on_event: Callable[[str], None] = lambda _m: None,
             cluster: Cluster | None = None, verify: Callable[[], dict | None] | None = None) -> tuple[Cluster, dict]:
    """Check, start and smoke-test the cluster; on any failure stop what was started and re-raise.
    ``verify`` (serve's check against the artifact's reference, through the head) runs once vLLM
    answers, before the smoke test. Returns the running cluster and what the caller prints."""
    from .launcher import Server, plan_key, smoke_test, wait_ready

    check_head_port(plan)
    answers = check_nodes(plan)
    on_event(f"checked {len(plan.nodes)} nodes: same artifact, vLLM {answers[0]['vllm']}, Ray {answers[0]['ray']}, "
             f"runtime patches {answers[0]['runtime'][:12]}")
    if plan.engine == "local":  # an untested vLLM still runs (the docker image's is the one tested)
        from hybrid_build.serve.runtime.fixes import untested_warning, version_in

        untested = untested_warning(version_in(answers[0]["vllm"] or ""))
        if untested:
            log.warning(untested)
    cluster = cluster or Cluster(plan)
    try:
        cluster.write_secrets()
        on_event(f"Ray token authentication: {plan.token.describe()}, in a 0600 file on each node")
        head = plan.ray[0]
        cluster.start(head, log_dir / "hybrid-build-ray-node1.log", plan.stops[0] if plan.stops else None)
        wait_for(lambda: query_nodes(plan), cluster, join_timeout, "the Ray head")
        on_event(f"Ray head up at {plan.ray_address}")
        for i, cmd in enumerate(plan.ray[1:], start=1):
            cluster.start(cmd, log_dir / f"hybrid-build-ray-node{i + 1}.log", plan.stops[i] if plan.stops else None)
        want = {n.ip for n in plan.nodes}

        def joined():
            listed = query_nodes(plan) or []
            ok = {n["ip"] for n in listed if n.get("alive") and n.get("gpus", 0) >= plan.gpus_per_node}
            return want <= ok

        wait_for(joined, cluster, join_timeout, f"{len(want)} nodes joining Ray ({', '.join(sorted(want))})")
        on_event(f"{len(want)} nodes joined: {', '.join(n.ip for n in plan.nodes)}")
        vllm = cluster.start(plan.vllm, log_path, secret_env=plan.vllm_env)
        server = Server(vllm.process, plan.serve, log_path, vllm.log_from)
        ready_s = wait_ready(server, ready_timeout)  # sends the plan's key, as verify and the smoke test do
        bind_to_head(plan, vllm)
        verified = verify() if verify else None
        answer = smoke_test(plan.base_url, plan.serve.model_name, expect=plan.serve.smoke_expect,
                            api_key=plan_key(plan.serve)) if smoke else None
        bind_to_head(plan, vllm, warn=False)  # what was verified and is announced is still this vLLM's
        return cluster, {"base_url": plan.base_url, "model": plan.serve.model_name, "ready_s": round(ready_s, 1),
                         "smoke_answer": answer, "verify": verified, "nodes": [n.ip for n in plan.nodes],
                         "tensor_parallel_size": plan.tp, "pipeline_parallel_size": plan.pp, "log": str(log_path)}
    except BaseException:
        cluster.stop()
        raise


if __name__ == "__main__":  # on a node: `python -m hybrid_build.serve.launch.multinode probe JSON`
    if len(sys.argv) != 3 or sys.argv[1] != "probe":
        sys.exit("usage: python -m hybrid_build.serve.launch.multinode probe JSON")
    print(json.dumps(probe(json.loads(sys.argv[2]))))
