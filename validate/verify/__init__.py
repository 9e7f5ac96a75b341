"""``verify``: a running OpenAI-compatible server checked against the artifact's reference, and the
paths where serving runtimes break (``verify_paths``)."""
