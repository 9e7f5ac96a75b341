"""Who listens on a TCP port of this machine, read from the kernel (Linux ``/proc``): so that
``serve`` refuses a port another process holds before its engine starts, and calls READY, verifies,
smoke-tests and restarts only against the engine it started.

The kernel lists every listening socket in ``/proc/net/tcp`` and ``/proc/net/tcp6`` (address, port,
inode); a process holds a socket when one of ``/proc/PID/fd`` links to ``socket:[INODE]``. A socket
counts as the engine's when a process of the engine's tree holds it: its session (the engine starts
in a session of its own, whose id is its pid) or a descendant of it. Holding the listening socket is
what binds: a connection to the port reaches the process that holds it, whatever the server says
about itself, so a server that merely answers (another user's, one left over from an earlier
engine) is told apart from ours. Processes of other users are not shown to this one (their ``fd``
folder is closed): a socket that none of the processes this user can see holds is "a process this
user cannot see". Where ``/proc/net/tcp`` cannot be read (not Linux), nothing can be told
(``None``)."""
from __future__ import annotations

import errno
import ipaddress
import os
import socket
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's "st" column


@dataclass(frozen=True)
class Listener:
    address: str  # the local address it is bound to, as ipaddress writes it
    port: int
    inode: int


def listeners(port: int, proc: Path = PROC) -> list[Listener] | None:
    """The listening TCP sockets on ``port`` (IPv4 and IPv6); None where the kernel's tables cannot be read."""
    found, read_any = [], False
    for name, width in (("tcp", 4), ("tcp6", 16)):
        try:
            lines = (proc / "net" / name).read_text().splitlines()[1:]
        except OSError:
            continue
        read_any = True
        for line in lines:
            parts = line.split()
            if len(parts) < 10 or parts[3] != LISTEN:
                continue
            addr_hex, _, port_hex = parts[1].partition(":")
            if int(port_hex, 16) != port:
                continue
            found.append(Listener(_address(addr_hex, width), port, int(parts[9])))
    return found if read_any else None


def _address(hex_addr: str, width: int) -> str:
    """/proc/net/tcp's address: 32-bit words in host order (little-endian here), as text."""
    raw = bytes.fromhex(hex_addr)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words[:width]))


def _stat(pid: int, proc: Path = PROC) -> tuple[int, int, int] | None:
    """(parent pid, session id, start time in clock ticks) of a process; None once it is gone."""
    try:
        text = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # the command name may hold spaces and parentheses
    return int(fields[1]), int(fields[3]), int(fields[19])


def start_ticks(pid: int, proc: Path = PROC) -> int | None:
    """When a process started (clock ticks after boot): with its pid, what names one process for good."""
    got = _stat(pid, proc)
    return got[2] if got else None


def _pids(proc: Path = PROC) -> list[int]:
    try:
        return [int(d.name) for d in proc.iterdir() if d.name.isdigit()]
    except OSError:
        return []


def tree(root: int, proc: Path = PROC) -> set[int]:
    """The processes of ``root``'s tree: ``root``, those of its session (the engine leads one) and
    every descendant, wherever it moved its session."""
    stats = {pid: s for pid in _pids(proc) if (s := _stat(pid, proc)) is not None}
    ours = {pid for pid, (_, sid, _) in stats.items() if sid == root} | ({root} if root in stats else set())
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    todo = list(ours)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in ours:
                ours.add(child)
                todo.append(child)
    return ours


def _sockets(pid: int, proc: Path = PROC) -> set[int] | None:
    """The socket inodes a process holds; None when its fds cannot be read (another user's)."""
    try:
        names = os.listdir(proc / str(pid) / "fd")
    except OSError:
        return None
    out = set()
    for name in names:
        try:
            link = os.readlink(proc / str(pid) / "fd" / name)
        except OSError:
            continue
        if link.startswith("socket:["):
            out.add(int(link[8:-1]))
    return out


def command_line(pid: int, proc: Path = PROC, limit: int = 120) -> str:
    """A process's command line, shortened, printable (control characters as ``?``)."""
    try:
        raw = (proc / str(pid) / "cmdline").read_bytes()
    except OSError:
        return "?"
    text = raw.replace(b"\0", b" ").decode(errors="replace").strip() or f"[{_comm(pid, proc)}]"
    text = "".join(c if c.isprintable() else "?" for c in text)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _comm(pid: int, proc: Path) -> str:
    try:
        return (proc / str(pid) / "comm").read_text().strip()
    except OSError:
        return "?"


def holders(inodes: set[int], among: set[int] | None = None, proc: Path = PROC) -> dict[int, set[int]]:
    """For each process (of ``among``, else every one this user can read) the ``inodes`` it holds."""
    out = {}
    for pid in sorted(among if among is not None else _pids(proc)):
        held = _sockets(pid, proc)
        if held and held & inodes:
            out[pid] = held & inodes
    return out


def describe(inodes: set[int], proc: Path = PROC) -> str:
    """Who holds these sockets, in words: ``pid N (COMMAND)``, or a process this user cannot see."""
    found = holders(inodes, proc=proc)
    if not found:
        return "a process this user cannot see (another user's: `ss -ltnp` as root names it)"
    return ", ".join(f"pid {pid} ({command_line(pid, proc)})" for pid in sorted(found))


def _reaches(listener: Listener, targets: set[str]) -> bool:
    """Whether a connection to one of ``targets`` (addresses) would reach this listening socket."""
    addr = ipaddress.ip_address(listener.address)
    if addr.is_unspecified:  # 0.0.0.0 takes IPv4; :: takes IPv6 and, dual-stack, IPv4 too
        return any(ipaddress.ip_address(t).version == addr.version or addr.version == 6 for t in targets)
    mapped = getattr(addr, "ipv4_mapped", None)
    return str(addr) in targets or (mapped is not None and str(mapped) in targets)


def addresses(host: str) -> set[str]:
    """The addresses a client of ``host`` connects to (``0.0.0.0`` / ``::``: loopback, as serve's URL)."""
    if host in ("", "0.0.0.0"):
        return {"127.0.0.1"}
    if host == "::":
        return {"::1"}
    try:
        return {info[4][0] for info in socket.getaddrinfo(host.strip("[]"), None, proto=socket.IPPROTO_TCP)}
    except OSError:
        return {host.strip("[]")}


@dataclass(frozen=True)
class Owner:
    """Who answers on the port: ``ours`` True (the engine's tree holds every listening socket a client
    reaches), False (``holder`` names who else does), or None (nothing can be told here: ``why``)."""

    ours: bool | None
    holder: str = ""
    why: str = ""


def owner(port: int, host: str, root: int, proc: Path = PROC) -> Owner:
    """Whether the sockets a client of ``host:port`` reaches are held by ``root``'s tree alone."""
    found = listeners(port, proc)
    if found is None:
        return Owner(None, why="the kernel's socket tables (/proc/net/tcp) cannot be read here")
    targets = addresses(host)
    reached = {x.inode for x in found if _reaches(x, targets)}
    if not reached:
        return Owner(None, why=f"no listening socket on port {port} is seen here (a container's published port?)")
    ours = set().union(*holders(reached, tree(root, proc), proc).values() or [set()])
    foreign = reached - ours
    if not foreign:
        return Owner(True)
    return Owner(False, holder=describe(foreign, proc))


def engine_owner(port: int, host: str, root: int, docker: bool) -> Owner:
    """``owner`` for an engine serve started; for the docker engine, docker's proxy holding the published
    port (or a holder this user cannot see) is "cannot be told", not another holder."""
    got = owner(port, host, root)
    if got.ours is False and docker and ("docker-proxy" in got.holder or "cannot see" in got.holder):
        return Owner(None, why=f"docker publishes the port ({got.holder})")
    return got


def taken_by(host: str, port: int, proc: Path = PROC) -> str | None:
    """Who holds ``host:port`` against a new listener (None: it is free): tried as vLLM's server
    binds (``SO_REUSEADDR``, so a closed connection's TIME_WAIT does not count), then named from
    the kernel's tables."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    bind_host = host.strip("[]") or "0.0.0.0"
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((bind_host, port))
            return None
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                return None  # not ours to judge (a name that does not resolve, a privileged port): vLLM says
    found = listeners(port, proc) or []
    return describe({x.inode for x in found}, proc) if found else "a socket this machine does not list"
