"""The bounds of the numbers a user gives, by what they mean: the command line's types
(``core/cli_support``) and the library's own checks read them from here, so that a bound is stated once.
"""
# streams at once: the most sequences vLLM batches by default (max_num_seqs 1024 on GPUs with 70 GiB
# or more, 256 below: vllm/engine/arg_utils.py, 0.23.0 to 0.34.0); more would queue, not run at once
MAX_STREAMS = 1024
# speculative tokens per step (a serve profile's num_speculative_tokens, recipes/profiles.py); an
# acceptance length counts the bonus token: at most one more
MAX_SPECULATIVE_TOKENS = 64
MAX_ACCEPT = MAX_SPECULATIVE_TOKENS + 1
# a length in tokens (a context, a prompt, a completion): 16 Mi, above any served max_model_len
MAX_TOKENS = 1 << 24
MAX_SECONDS = 30 * 86400  # a deadline, a wait or a soak: 30 days
MAX_COUNT = 1_000_000  # runs, restarts, examples: counts a person asks for
MAX_SEED = 2**32 - 1  # what every seed consumer takes (numpy's is 32-bit; vLLM's request seed is 64-bit)
# conversations a trace replay holds (the whole trace, or a sample): memory holds these, never the file
MAX_CONVERSATIONS = 10_000
MAX_GB = 100_000.0  # memory or bytes in GB, bandwidth in GB/s (an H200 reads 4,800 GB/s)
