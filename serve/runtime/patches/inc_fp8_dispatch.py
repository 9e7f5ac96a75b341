"""Per-layer FP8 in vLLM 0.23's INC (a single ``inc.py``): a linear whose ``extra_config`` entry
(or every fused sub-entry) says ``bits 8, data_type fp`` gets the block-FP8 linear method, which
reads ``weight`` + ``weight_scale_inv``. Same rule as ``serve/runtime/plugin.py`` for 0.25+."""
from .anchors import Edit, Patch

S = "# hybrid-build patch: inc-fp8-dispatch"
PATCH = Patch(
    name="inc-fp8-dispatch",
    path="vllm/model_executor/layers/quantization/inc.py",
    why="FP8 shared experts inside an auto-round checkpoint",
    edits=(Edit(
        name="inc-fp8-dispatch",
        anchor="    def get_quant_method(self, layer: torch.nn.Module, prefix: str):\n",
        new=("    def get_quant_method(self, layer: torch.nn.Module, prefix: str):\n"
             f"        {S}\n"
             "        _fp8 = self._hybrid_fp8_method(layer, prefix)\n"
             "        if _fp8 is not None:\n"
             "            return _fp8\n"
             "        return self._get_quant_method_unpatched(layer, prefix)\n"
             "\n"
             "    def _hybrid_fp8_method(self, layer, prefix):\n"
             "        from vllm.model_executor.layers.linear import LinearBase\n"
             "        extra = self.extra_config or {}\n"
             "        if not prefix or not isinstance(layer, LinearBase):\n"
             "            return None\n"
             "        names = [prefix]\n"
             "        for fused, subs in (getattr(self, 'packed_modules_mapping', None) or {}).items():\n"
             "            if prefix.endswith('.' + fused):\n"
             "                names = [prefix[: -len(fused)] + s for s in subs]\n"
             "                break\n"
             "        entries = [extra.get(n) or extra.get('model.' + n) or {} for n in names]\n"
             "        fp8 = [e.get('bits') == 8 and e.get('data_type') in ('fp', 'fp8') for e in entries]\n"
             "        if not any(fp8):\n"
             "            return None\n"
             "        if not all(fp8):\n"
             "            raise ValueError(f'hybrid-build: fused layer {prefix} mixes FP8 and non-FP8 parts')\n"
             "        from vllm.model_executor.layers.quantization.fp8 import Fp8Config, Fp8LinearMethod\n"
             "        block = list(entries[0].get('weight_block_size') or [128, 128])\n"
             "        return Fp8LinearMethod(Fp8Config(is_checkpoint_fp8_serialized=True,\n"
             "                                         activation_scheme='dynamic', weight_block_size=block))\n"
             "\n"
             "    def _get_quant_method_unpatched(self, layer: torch.nn.Module, prefix: str):\n"),
    ),),
)
