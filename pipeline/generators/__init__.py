"""Checkpoints the tool makes itself: the tiny demo model (``demo``, real transformers weights
exported by auto-round) and real-width synthetic checkpoints (``synthetic``, for ``plan`` and the
benchmarks), reached through one source resolver (``sources.open_source``)."""
