"""The stages of a build, in order, each in a module of its own that declares one ``Stage``.

Kept free of torch: the CLI lists the stage names without importing any stage. To add a stage,
write ``stages/<name>.py`` with ``STAGE = Stage(...)`` (see ``base.py``) and name it here, in
the place of the order where it runs; the runner needs no change.
"""
from __future__ import annotations

import importlib

# name -> module; the order is the order of a build
STAGE_MODULES: dict[str, str] = {
    "inspect": "hybrid_build.pipeline.stages.inspect",
    "calibrate": "hybrid_build.pipeline.stages.calibrate",
    "quantize-head": "hybrid_build.pipeline.stages.quantize_head",
    "assemble": "hybrid_build.pipeline.stages.assemble",
    "record": "hybrid_build.pipeline.stages.record",
    "validate": "hybrid_build.pipeline.stages.validate",
}
STAGES = tuple(STAGE_MODULES)


def load_stage(name: str):
    """The ``Stage`` declared by the module of ``name``."""
    return importlib.import_module(STAGE_MODULES[name]).STAGE
