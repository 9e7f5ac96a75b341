"""Starting vLLM from the host that runs ``hybrid-build serve``: the launch plan (``engine``: one
exact command, local ``vllm serve`` or ``docker run``), starting and watching it (``launcher``),
the drafter-vs-engine check, the served API's key, and several nodes over a Ray cluster
(``multinode``, ``ray_auth``). ``command`` is the ``serve`` command.
"""
