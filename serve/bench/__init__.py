"""The ``bench`` command's client, run against a running OpenAI-compatible server: the workload
bank, single-stream and concurrent timing and A/B comparisons (``bench``), the agents' time to first
token over a long resent prefix (``bench_agent``), and the command itself (``bench_command``).
"""
