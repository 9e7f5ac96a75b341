"""The ``record`` stage: the resolved recipe copy and ``provenance.json``, after ``assemble``.

It is a stage of its own so that each stage's key covers only what that stage reads: ``assemble``
keys on the recipe sections that decide the checkpoint's bytes, this stage on the whole recipe.
A recipe edit that changes only validate thresholds or serve settings re-runs
this stage (milliseconds: two small files) and ``validate``, and rewrites no shard. The hashes of
the checkpoint's files come from ``assemble``'s result, computed while it wrote them, so nothing
large is read again here. ``assemble`` removes the provenance of an earlier build before it
writes a shard, so a provenance in the folder always describes the checkpoint beside it. That this
machine built it is recorded in the user's state folder (``core.local_trust``), never in the folder.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

from hybrid_build.core import __version__, local_trust
from hybrid_build.core.artifact import META_DIR, PROVENANCE, RECIPE, build_outputs
from hybrid_build.core.manifest import build_digest, sha256_file
from hybrid_build.core.provenance import SCHEMA_VERSION, TOOL_NAME, Provenance, Tool, build_time
from hybrid_build.core.safetensors_io import write_text_atomic

from ..context import BuildContext
from .base import Stage, StageIO


def inputs(ctx: BuildContext) -> dict:
    return {"recipe": ctx.recipe.model_dump(mode="json", by_alias=True)}


def _text_file(out: Path, rel: str, text: str) -> dict:
    write_text_atomic(out / rel, text)
    data = text.encode()
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def run(ctx: BuildContext, io: StageIO) -> tuple[list[Path], dict]:
    out, built = ctx.out, io.up["assemble"]
    (out / META_DIR).mkdir(exist_ok=True)
    recipe = _text_file(out, RECIPE, ctx.recipe.to_yaml())
    known = built.details["files"]  # hashed by assemble while it wrote them
    # every build output in the folder: a stage that writes into the artifact before this one (and
    # is named in ``reads``) is recorded without a change here; reports never are (core.artifact)
    files = {rel: known.get(rel) or {"bytes": (out / rel).stat().st_size, "sha256": sha256_file(out / rel)}
             for rel in build_outputs(out)}
    files[RECIPE] = recipe
    prov = Provenance(
        schema_version=SCHEMA_VERSION, tool=Tool(name=TOOL_NAME, version=__version__),
        format=ctx.recipe.output.format, source=ctx.source_record().to_provenance(),
        recipe=ctx.recipe.model_dump(mode="json", by_alias=True), files=dict(sorted(files.items())),
        tensors=built.details["tensors"], converted=built.details["converted"], created=build_time())
    text = prov.to_text()
    write_text_atomic(out / PROVENANCE, text)
    # this machine built these bytes: said in the user's state folder, where a download cannot say it
    local_trust.remember(build_digest(text.encode()), local_trust.BUILT, out)
    return [out / RECIPE, out / PROVENANCE], {}


# the provenance (a few hundred bytes per file, tensor class and converted module), the recipe copy
# and the model card `run` writes after the build: measured ~27 kB together on the demo; bounds
RECORD_FIXED_BYTES, RECORD_BYTES_PER_MODULE = 256_000, 2_000


def writes(ctx: BuildContext) -> int:
    return RECORD_FIXED_BYTES + RECORD_BYTES_PER_MODULE * (len(ctx.plan.conversions) + len(ctx.source.files))


STAGE = Stage("record", run, inputs=inputs, reads=("assemble",), writes=writes)
