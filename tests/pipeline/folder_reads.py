"""Counts how a command reads an artifact folder: every open of a file in it and every listing of a
folder in it (Python's audit events ``open``, ``os.listdir``, ``os.scandir``), each attributed to the
hybrid_build function that issued it (the innermost hybrid_build frame), and whether it happened inside
``core.bound`` (``open_artifact``, the one pass that opens and checks the artifact, or a question asked
of the ``BoundArtifact`` it returns: ``core.bound`` on the stack) or outside it (a command reading the
folder itself). The hashing threads of ``core.integrity.check_artifact`` are attributed to whoever
called it. Reads of the work folder (``.hybrid-build/``: stage manifests, hash caches) are counted apart.

    python tests/pipeline/folder_reads.py ARTIFACT publish|serve|status|inspect [--json]

Run as its own process (an audit hook cannot be removed), by ``test_one_reader.py`` on this tree, or
with PYTHONPATH pointing at another checkout to count that one on an artifact it built.
"""
from __future__ import annotations

import collections
import contextlib
import io
import json
import os
import sys
import threading
from pathlib import Path

COMMANDS = {
    "publish": ["publish", "{a}", "--repo-id", "me/demo", "--dry-run"],
    "serve": ["serve", "{a}", "--profile", "base", "--dry-run"],
    "status": ["status", "{a}"],
    "inspect": ["inspect", "{a}"],  # the control: it reads the folder as a source checkpoint, not through core.bound
}
WORK = ".hybrid-build"


def _frames(frame) -> tuple[str | None, bool]:
    """The innermost hybrid_build function on the stack, and whether core.bound is on it."""
    site, inside = None, False
    while frame is not None:
        mod = frame.f_globals.get("__name__", "")
        if mod.startswith("hybrid_build.") and site is None:
            site = f"{mod.removeprefix('hybrid_build.')}.{frame.f_code.co_name}"
        if mod == "hybrid_build.core.bound":
            inside = True
        frame = frame.f_back
    return site, inside


def measure(artifact: Path, argv: list[str]) -> tuple[int, list[dict]]:
    root = str(artifact.resolve()) + os.sep
    events: list[dict] = []
    active = [False]
    owner = {"inside": False}  # who called check_artifact, for its hashing threads

    from hybrid_build.core import bound, integrity

    real = integrity.check_artifact

    def check_artifact(*a, **kw):
        before = owner["inside"]
        owner["inside"] = _frames(sys._getframe(1))[1]
        try:
            return real(*a, **kw)
        finally:
            owner["inside"] = before

    integrity.check_artifact = bound.check_artifact = check_artifact

    def hook(event, args):
        if not active[0] or event not in ("open", "os.listdir", "os.scandir"):
            return
        path = args[0] if args else None
        if isinstance(path, int) or path is None:
            return
        try:
            full = os.path.abspath(os.fsdecode(path))
        except TypeError:
            return
        if not (full + os.sep).startswith(root) or (event == "open" and os.path.isdir(full)):
            return
        site, inside = _frames(sys._getframe(1))
        if threading.current_thread().name.startswith("hash-artifact"):
            inside = owner["inside"]
        if site is not None:
            rel = os.path.relpath(full, artifact.resolve())
            events.append({"site": site, "file": rel, "inside": inside, "work": rel.split(os.sep)[0] == WORK,
                           "event": event})

    sys.addaudithook(hook)
    from hybrid_build.pipeline.cli import main

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        main([a.format(a=artifact) for a in argv])  # once, uncounted: the hash caches warm, as a user's next run
        active[0] = True
        rc = main([a.format(a=artifact) for a in argv])
    active[0] = False
    return rc, events


def summary(events: list[dict]) -> dict:
    art = [e for e in events if not e["work"]]
    out = [e for e in art if not e["inside"]]

    def modules(es):
        return sorted({e["site"].rsplit(".", 1)[0] for e in es})

    return {"reads": len(art), "sites": sorted({e["site"] for e in art}), "modules": modules(art),
            "outside": len(out), "outside_sites": sorted({e["site"] for e in out}), "outside_modules": modules(out),
            "work_reads": len(events) - len(art)}


def main() -> None:
    artifact, which = Path(sys.argv[1]), sys.argv[2]
    rc, events = measure(artifact, COMMANDS[which])
    s = summary(events)
    if "--json" in sys.argv:
        print(json.dumps({"exit": rc, **s, "events": events}))
        return
    print(f"{which}: exit {rc}; the artifact's files and folders: {s['reads']} reads from {len(s['sites'])} functions "
          f"in {len(s['modules'])} modules; outside core.bound: {s['outside']} reads from {len(s['outside_sites'])} "
          f"functions in {len(s['outside_modules'])} modules; the work folder: {s['work_reads']} reads")
    counts = collections.Counter((e["site"], e["inside"]) for e in events if not e["work"])
    for (site, inside), n in sorted(counts.items()):
        files = sorted({e["file"] for e in events if e["site"] == site and not e["work"]})
        print(f"   {n:3d}  {'inside ' if inside else 'outside'}  {site}  ({', '.join(files[:4])}"
              f"{' ...' if len(files) > 4 else ''})")


if __name__ == "__main__":
    main()
