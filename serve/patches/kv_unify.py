"""Drafter KV page unification: the DFlash drafter's attention pages (8 KV heads x 128) and the
hybrid target's pages (attention 2 x 256, GDN state) need not divide each other; vLLM 0.23 then
raises NotImplementedError. The edit pads the smaller page up to the largest one instead
(``page_size_padded``, which 0.23's AttentionSpec/MambaSpec already honour), as 0.33 does."""
from .anchors import Edit, Patch

S = "# hybrid-build patch: kv-unify-pad"
PATCH = Patch(
    name="kv-unify-drafter",
    path="vllm/v1/core/kv_cache_utils.py",
    why="serve a DFlash drafter next to a GDN + attention target",
    edits=(Edit(
        name="kv-unify-pad",
        anchor=("            if max_page_size % layer_page_size != 0:\n"
                "                raise NotImplementedError(\n"),
        new=(f"            {S}\n"
             "            if max_page_size % layer_page_size != 0 and hasattr(layer_spec, \"page_size_padded\"):\n"
             "                new_kv_cache_spec[layer_name] = replace(layer_spec, page_size_padded=max_page_size)\n"
             "                continue\n"
             "            if max_page_size % layer_page_size != 0:\n"
             "                raise NotImplementedError(\n"),
    ),),
)
