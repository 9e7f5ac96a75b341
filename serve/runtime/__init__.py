"""What runs inside vLLM's process: the plugin (``plugin.register``, the ``vllm.general_plugins``
entry point), the runtime fixes (``fixes.FIXES``, one entry each) and their code (``upstream_fixes``,
``kv_cache_fixes``, the source patches of ``patches/`` for the docker image), and the int8 head's
GEMV kernel.

Imports nothing else of hybrid_build (tests/architecture checks it): the docker engine mounts this
folder alone into an image where hybrid-build is not installed.
"""
