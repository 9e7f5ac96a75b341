"""Serving the artifact with vLLM: the ``serve`` and ``bench`` commands and everything they run.

Owns the launch plan and its engines (local vLLM or docker, one node or a Ray cluster), the code
that runs inside vLLM's own process (the plugin, the runtime fixes and patches, the int8 head
kernel; they import nothing else of hybrid_build), the bench client, and ``plan``'s speed model
(bytes per token, the measured floor, multi-node). Reads artifacts through ``core`` and recipes
through ``recipes``; checks a started server with ``validate``'s reference.
"""
