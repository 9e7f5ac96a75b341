"""The GDN group honours the EAGLE trailing-block drop in vLLM 0.23.0 (the docker image): the
coordinator looks one block past the candidate hit in every group that drops its last matching
block, and ``MambaManager.find_longest_cache_hit`` takes the flag and never reads it, so the GDN hit
runs one block past the attention groups' (upstream PR 48375). The edit searches one block less
when the flag is set, as the plugin's ``align_mode_fixes`` does on 0.25.1."""
from .anchors import Edit, Patch

S = "# hybrid-build patch: mamba-eagle-drop"
PATCH = Patch(
    name="mamba-eagle-drop",
    path="vllm/v1/core/single_type_kv_cache_manager.py",
    why="a resumed GDN state at the same block as the attention hit under speculative decoding",
    edits=(Edit(
        name="mamba-eagle-drop",
        anchor=('        assert pcp_world_size == 1, "PCP not support mamba now."\n'
                "        computed_blocks: tuple[list[KVCacheBlock], ...] = tuple(\n"
                "            [] for _ in range(len(kv_cache_group_ids))\n"
                "        )\n"
                "\n"
                "        block_size = kv_cache_spec.block_size\n"
                "        max_num_blocks = max_length // block_size\n"),
        new=('        assert pcp_world_size == 1, "PCP not support mamba now."\n'
             "        computed_blocks: tuple[list[KVCacheBlock], ...] = tuple(\n"
             "            [] for _ in range(len(kv_cache_group_ids))\n"
             "        )\n"
             "\n"
             "        block_size = kv_cache_spec.block_size\n"
             f"        {S}\n"
             "        if drop_eagle_block:\n"
             "            max_length = max(max_length - block_size, 0)\n"
             "        max_num_blocks = max_length // block_size\n"),
    ),),
)
