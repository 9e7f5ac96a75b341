"""What a stage is, as the runner sees it, and what it receives from the stages it reads.

A stage module declares one ``Stage``: its name, the stages whose results it reads, whether it
may run in the background alongside its reader, the recipe slice its result depends on
(``inputs``), a ``check`` run before anything of the build is written, and ``run``. The runner
(``pipeline.runner``) keys, skips, orders and overlaps stages through these fields alone.

A reader gets each upstream result as a ``StageOutput``: the files of a finished stage, or a
stage still running in the background whose file layout is already known (``Pending``); either
way ``entries()`` maps tensor names to their header and a source of their bytes.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from hybrid_build.core.errors import ArtifactError
from hybrid_build.core.safetensors_io import ByteRange, ShardPlan, TensorHeader, read_header

if TYPE_CHECKING:
    import torch

    from ..context import BuildContext

StageRun = Callable[["BuildContext", "StageIO"], "tuple[list[Path], dict]"]


@dataclass(frozen=True)
class Stage:
    """One step of the build. ``layout``, for a background stage, plans the file it will write
    before a byte of it is computed, so that a reader can plan its own output meanwhile.
    ``writes`` sizes what it writes (the runner checks free space against the sum); ``describe``
    adds to ``--dry-run`` what only it can plan (the output shards) from its upstream results."""

    name: str
    run: StageRun
    inputs: Callable[[BuildContext], dict] = lambda ctx: {}
    reads: tuple[str, ...] = ()
    background: bool = False
    check: Callable[[BuildContext], None] | None = None
    layout: Callable[[BuildContext], ShardPlan | None] | None = None
    writes: Callable[[BuildContext], int] | None = None  # bytes it will write, planned from headers
    describe: Callable[[BuildContext, dict], dict] | None = None  # for --dry-run, once its reads are current
    # why a finished result no longer holds although its key and outputs do (None: it holds): for a
    # stage whose result is a report judged by its own state (validate), not by its bytes; given the
    # output folder, and the bound artifact (core.bound) where the caller opened one
    current: Callable[..., str | None] | None = None

@dataclass
class StageIO:
    """What the runner hands a stage: its upstream results, and for a stage running in the
    background for a reader in this process, the ``Handover`` that passes tensors to it."""

    up: dict[str, StageOutput] = field(default_factory=dict)
    handover: Handover | None = None


class Handover:
    """Tensors passed from a background stage to a reader in this process, each taken once."""

    def __init__(self) -> None:
        self._tensors: dict[str, torch.Tensor] = {}
        self._closed = False
        self._cond = threading.Condition()

    def put(self, tensors: dict[str, torch.Tensor]) -> None:
        with self._cond:
            self._tensors.update(tensors)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def take(self, name: str) -> torch.Tensor | None:
        """The tensor handed over under ``name``, once computed; None if the stage ended without it."""
        with self._cond:
            self._cond.wait_for(lambda: name in self._tensors or self._closed)
            return self._tensors.pop(name, None)


class StageOutput:
    """A stage's result as a reader sees it."""

    details: dict

    def entries(self) -> dict[str, tuple[TensorHeader, ByteRange | Callable]]:
        raise NotImplementedError

    def wait(self) -> None:
        """Block until the stage has finished (its details are final)."""


class Finished(StageOutput):
    """A finished stage: the safetensors files it wrote (recorded in its manifest)."""

    def __init__(self, files: list[Path], details: dict) -> None:
        self.files, self.details = files, details

    def entries(self) -> dict[str, tuple[TensorHeader, ByteRange]]:
        out = {}
        for path in self.files:
            if path.name.endswith(".safetensors") and path.exists():
                for name, t in read_header(path).tensors.items():
                    out[name] = (t, ByteRange(path, t.start, t.nbytes))
        return out


class Pending(StageOutput):
    """A stage running in the background. Its file's layout is ``plan``; each tensor's bytes
    come from the ``Handover`` as soon as computed, or from the file once it is complete."""

    def __init__(self, path: Path, plan: ShardPlan, handover: Handover, wait: Callable[[], dict]) -> None:
        self.path, self.plan, self.handover, self._wait = path, plan, handover, wait
        self.details: dict = {}

    def wait(self) -> None:
        self.details = self._wait()

    def entries(self) -> dict[str, tuple[TensorHeader, Callable]]:
        out, offset = {}, len(self.plan.header_bytes())
        for t in self.plan.tensors:
            rng = ByteRange(self.path, offset, t.nbytes, ready=self.wait)
            out[t.name] = (TensorHeader(t.name, t.dtype, t.shape, offset, t.nbytes), self._producer(t.name, rng))
            offset += t.nbytes
        return out

    def _producer(self, name: str, rng: ByteRange):
        def produce():
            t = self.handover.take(name)
            if t is not None:
                yield memoryview(t.contiguous().numpy()).cast("B")
                return
            rng.ready()
            with open(rng.path, "rb") as f:
                f.seek(rng.start)
                left = rng.nbytes
                while left:
                    chunk = f.read(min(left, 1 << 26))
                    if not chunk:
                        raise ArtifactError(f"{rng.path.name}: ended early while copying bytes {rng.start}..")
                    left -= len(chunk)
                    yield chunk
        return produce
