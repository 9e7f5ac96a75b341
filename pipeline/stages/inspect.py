"""The ``inspect`` stage: the source has been read and planned; record the conversion plan.

The checks themselves (missing shards, truncated headers, packing rules) ran when the source was
opened (``Checkpoint.require_clean`` in ``build.prepare``); this stage keeps what was decided.
"""
from __future__ import annotations

from .base import Stage


def run(ctx, io):
    return [], {"conversion": ctx.plan.to_json()}


STAGE = Stage("inspect", run)
