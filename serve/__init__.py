"""Serving the artifact with vLLM: the ``serve`` and ``bench`` commands and everything they run,
in one sub-package per process it runs in.

- ``runtime``: inside vLLM's own process (the plugin, the runtime fixes and patches, the int8 head
  kernel); imports nothing else of hybrid_build, so the docker engine mounts that folder alone.
- ``launch``: on the host that runs ``hybrid-build serve``: the launch plan, local vLLM or docker,
  one node or a Ray cluster, the served API's key.
- ``bench``: the ``bench`` command's HTTP client against a running server.
- ``speed``: ``plan``'s speed model (bytes per token, the measured floor, several nodes).
"""
