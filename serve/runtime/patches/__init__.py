"""Runtime patches for the DGX Spark docker image's vLLM 0.23.0, applied before ``vllm serve``.

Each patch is a list of anchor edits (``anchors.Edit``) on one vLLM source file, written against
vLLM 0.23.0's real source. ``apply.py`` runs them inside the container; it is also runnable as a
plain script (the container does not have hybrid-build installed).
"""
