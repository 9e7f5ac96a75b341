"""Prefix caching with a drafter on a hybrid model: the GDN state is cached every
``mamba_block_size`` tokens, and the attention block size (shared with the drafter) must divide
it or cached prefixes never line up. The edit rounds ``mamba_block_size`` up to a multiple of the
attention block size when prefix caching is on, before 0.23 validates the block size."""
from .anchors import Edit, Patch

S = "# hybrid-build patch: prefix-block-align"
PATCH = Patch(
    name="prefix-caching-align",
    path="vllm/config/vllm.py",
    why="prefix caching with DFlash on Qwen3.5",
    edits=(Edit(
        name="prefix-block-align",
        anchor=("    def validate_block_size(self) -> None:\n"
                "        \"\"\"Validate block_size against DCP and mamba constraints.\n"),
        new=("    def validate_block_size(self) -> None:\n"
             "        \"\"\"Validate block_size against DCP and mamba constraints.\n"
             "        \"\"\"\n"
             f"        {S}\n"
             "        _bs, _mbs = self.cache_config.block_size, self.cache_config.mamba_block_size\n"
             "        if self.cache_config.enable_prefix_caching and _bs and _mbs and _mbs % _bs:\n"
             "            self.cache_config.mamba_block_size = -(-_mbs // _bs) * _bs\n"
             "        return self._validate_block_size_unpatched()\n"
             "\n"
             "    def _validate_block_size_unpatched(self) -> None:\n"
             "        \"\"\"Validate block_size against DCP and mamba constraints.\n"),
    ),),
)
