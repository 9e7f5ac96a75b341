"""Drafter KV page unification for vLLM 0.23.0: the DFlash drafter's attention pages (8 KV heads x
128) and the hybrid target's pages (attention 2 x 256, GDN state padded to the attention page) need
not match. 0.23.0 grows a smaller page by an integer ratio of block sizes, which cannot grow a GDN
state page (its size does not depend on the block size: ``assert new_spec.page_size_bytes ==
max_page_size`` fails, the 122B with its real drafter), and raises NotImplementedError for a page
that does not divide. The edit pads such pages up to the largest one instead
(``page_size_padded``, which 0.23's AttentionSpec/MambaSpec honour), as vLLM 0.26.0 does for GDN
pages and the plugin's ``kv_cache_fixes`` does on 0.25.1."""
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
             "            if hasattr(layer_spec, \"page_size_padded\") and (\n"
             "                    max_page_size % layer_page_size != 0 or isinstance(layer_spec, MambaSpec)):\n"
             "                new_kv_cache_spec[layer_name] = replace(layer_spec, page_size_padded=max_page_size)\n"
             "                continue\n"
             "            if max_page_size % layer_page_size != 0:\n"
             "                raise NotImplementedError(\n"),
    ),),
)
