"""Read-only checks of a built artifact, and of a server running it: the ``validate``, ``eval``
and ``verify`` commands.

Owns the structural and numeric checks (``checks``), the three end-to-end engines (``streamed``,
``transformers_forward``, ``vllm_compare``) and their divergence statistics, the report it writes
into the artifact, the reference log-probabilities a server is verified against, and lm-eval
accuracy. Nothing here changes the checkpoint.
"""
