"""The defaults of ``verify``'s runtime paths (``verify_paths``), apart so that building the
command's parser imports nothing heavy."""

PATHS = ("cache", "concurrency", "decode")
LOGPROB_TOL = 0.25
CACHE_TOKENS = 4096  # a few KV blocks even where a hybrid model's attention block is ~1k tokens
CACHE_GEN = 16
CONCURRENCY = 4  # streams at once by default: the serve profiles' max_num_seqs
