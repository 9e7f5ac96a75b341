"""Counts how `publish --dry-run`, `serve --dry-run` and `status` read the artifact folder: every open
of a file in it and every listing of a folder in it (Python's audit events ``open``, ``os.listdir``,
``os.scandir``), each attributed to the hybrid_build function that issued it (the innermost
hybrid_build frame), and whether it ran inside ``core.bound`` (``open_artifact``, the one pass that opens
and checks the artifact, or a question asked of the ``BoundArtifact`` it returns) or outside it (a
command reading the folder itself); "<- X" names the first function outside ``core`` on the way. Reads of the work
folder (``.hybrid-build/``: stage manifests, hash caches, the demo source) are counted apart.

    python lab/probes/folder_reads.py ARTIFACT [publish|serve|status ...]

Run it with PYTHONPATH pointing at the tree to measure (a checkout of main, or this branch) and an
artifact that tree built. A probe: it prints what it counted.
"""
from __future__ import annotations

import collections
import contextlib
import io
import os
import sys
from pathlib import Path

COMMANDS = {
    "publish": ["publish", "{a}", "--repo-id", "me/demo", "--dry-run"],
    "serve": ["serve", "{a}", "--dry-run"],
    "status": ["status", "{a}"],
}


def measure(artifact: Path, argv: list[str]) -> tuple[int, list[tuple[str, str, bool]]]:
    root = str(artifact.resolve()) + os.sep
    events: list[tuple[str, str, bool]] = []
    active = [True]

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
        if not (full + os.sep).startswith(root):
            return
        if event == "open" and os.path.isdir(full):
            return
        frame, site, caller, inside = sys._getframe(1), None, None, False
        while frame is not None:
            mod = frame.f_globals.get("__name__", "")
            if mod.startswith("hybrid_build.") and site is None:
                site = f"{mod.removeprefix('hybrid_build.')}.{frame.f_code.co_name}"
            if mod.startswith("hybrid_build.") and not mod.startswith("hybrid_build.core.") and caller is None:
                caller = f"{mod.removeprefix('hybrid_build.')}.{frame.f_code.co_name}"
            if mod == "hybrid_build.core.bound":  # open_artifact, or a question asked of the BoundArtifact
                inside = True
            frame = frame.f_back
        if site is not None and caller is not None and not site.startswith(caller.rsplit(".", 1)[0]):
            site = f"{site} <- {caller}"
        if site is not None:
            events.append((site, os.path.relpath(full, artifact.resolve()), inside))

    sys.addaudithook(hook)
    from hybrid_build.pipeline.cli import main

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        rc = main([a.format(a=artifact) for a in argv])
    active[0] = False
    return rc, events


def main() -> None:
    artifact = Path(sys.argv[1])
    which = sys.argv[2]
    rc, events = measure(artifact, COMMANDS[which])
    work = [e for e in events if e[1].split(os.sep)[0] == ".hybrid-build"]
    events = [e for e in events if e not in work]  # the work folder (stage manifests, hash caches): counted apart
    sites = collections.Counter(s for s, _, _ in events)
    modules = {s.split(" <- ")[0].rsplit(".", 1)[0] for s in sites}
    outside = [e for e in events if not e[2]]
    out_sites = collections.Counter(s for s, _, _ in outside)
    out_modules = {s.split(" <- ")[0].rsplit(".", 1)[0] for s in out_sites}
    print(f"{which}: exit {rc}; the artifact's files and folders: {len(events)} reads from {len(sites)} functions in "
          f"{len(modules)} modules; outside core.bound: {len(outside)} reads from {len(out_sites)} functions in "
          f"{len(out_modules)} modules; the work folder: {len(work)} reads")
    for s, n in sorted(sites.items()):
        files = sorted({f for x, f, _ in events if x == s})
        where = "outside" if s in out_sites else "inside "
        print(f"   {n:3d}  {where}  {s}  ({', '.join(files[:4])}{' ...' if len(files) > 4 else ''})")

if __name__ == "__main__":
    main()
