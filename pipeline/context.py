"""``BuildContext``: everything a stage may read about the build it is part of.

The source checkpoint (headers only), the resolved recipe, the conversion plan, the output folder
and its work folder, a progress factory, and the source's identity by content. Stages take it
and never change it; the runner (``pipeline.runner``) owns what changes while a build runs.
"""
from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hybrid_build.core import __version__
from hybrid_build.core.artifact import RUN_RECIPE, WORK_DIR
from hybrid_build.core.checkpoint import Checkpoint
from hybrid_build.core.manifest import sha256_json
from hybrid_build.core.progress import ProgressFactory, null_progress
from hybrid_build.core.safetensors_io import write_text_atomic
from hybrid_build.core.source_identity import DIGEST_CACHE, LOCATION_FILE, SourceDigests, SourceRecord, record_for
from hybrid_build.recipes.conversion import ConversionPlan
from hybrid_build.recipes.schema import Recipe

_RECORD_LOCK = threading.Lock()  # a background stage may save its manifest while the main thread does


@dataclass
class BuildContext:
    source: Checkpoint
    recipe: Recipe
    recipe_note: str  # how the recipe was chosen, for the user
    out: Path
    plan: ConversionPlan
    progress: ProgressFactory = null_progress
    in_artifact: str | None = None  # the demo source: its place inside the output folder
    announce: Callable[[str], None] | None = None  # a line the user should see before a long step
    _digests: SourceDigests | None = field(default=None, repr=False)

    @property
    def work(self) -> Path:
        return self.out / WORK_DIR

    def stage_dir(self, stage: str) -> Path:
        d = self.work / stage
        d.mkdir(parents=True, exist_ok=True)
        return d

    @property
    def digests(self) -> SourceDigests:
        """sha256 of every source file, from the work folder's cache or computed (``source_identity``)."""
        if self._digests is None:
            self._digests = SourceDigests(self.source.root, self.work / DIGEST_CACHE)
        return self._digests

    def fingerprint(self) -> str:
        """The source's identity by content: every stage key and the provenance use it. Waits for
        the digests if they are still being computed."""
        return self.digests.fingerprint(self.progress)

    def source_record(self) -> SourceRecord:
        return record_for(self.source.root, self.source.source_id, self.source.revision,
                          self.digests.result(self.progress), self.in_artifact)

    def record_recipe(self) -> None:
        """The recipe of this run, in the work folder beside the stage manifests, and (``record_location``)
        where the source is: ``hybrid-build status`` re-keys the stages from the output folder alone."""
        self._record(self.out / RUN_RECIPE, self.recipe.to_yaml())

    def record_location(self) -> None:
        """Where the source is (it needs the source's digests: called once they are known)."""
        self._record(self.work / LOCATION_FILE, json.dumps(self.source_record().to_location(), indent=2) + "\n")

    @staticmethod
    def _record(path: Path, text: str) -> None:
        with _RECORD_LOCK:
            if not path.is_file() or path.read_text() != text:
                write_text_atomic(path, text)

    def assemble_marker(self) -> str:
        """Identifies an assemble in progress, so a resumed one keeps only its own complete shards.
        It uses the source files' size, mtime and inode rather than their digests, which a fresh
        build is still computing when assemble starts; the digest cache trusts the same fields."""
        stats = {f: self.digests.stat(f) for f in self.digests.files}
        return sha256_json({"tool": __version__, "source": stats,
                            "recipe": self.recipe.model_dump(mode="json", by_alias=True)})


def output_bytes(ctx: BuildContext) -> int:
    """Tensor bytes of the output checkpoint: the source's, with the planned conversions applied."""
    return sum(t.nbytes for t in ctx.source.tensors.values()) - ctx.plan.bytes_before + ctx.plan.bytes_after
