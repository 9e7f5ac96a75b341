"""The int8 lm-head in vLLM 0.23's logits processor (``_get_logits``). With
``HYBRID_BUILD_LM_HEAD=quantize-at-load`` a BF16 head is quantized per row on its first call
(the GEMV module's ``quantize_rows``: symmetric, [-127, 127]; stored tiled where the Triton
kernel runs) and every later call runs the int8 GEMV that ``apply.py`` copies next to this module
(``vllm/hybrid_build_int8_gemv.py``); a stored GPTQ int8 head keeps its quant method."""
from .anchors import Edit, Patch

S = "# hybrid-build patch: int8-lm-head"
PATCH = Patch(
    name="int8-lm-head",
    path="vllm/model_executor/layers/logits_processor.py",
    why="halve the lm-head bytes per decoded token",
    copies=(("int8_gemv.py", "vllm/hybrid_build_int8_gemv.py"),),
    edits=(Edit(
        name="int8-lm-head",
        anchor=("        # Get the logits for the next tokens.\n"
                "        logits = lm_head.quant_method.apply(lm_head, hidden_states, bias=embedding_bias)\n"),
        new=("        # Get the logits for the next tokens.\n"
             f"        {S}\n"
             "        import os as _os\n"
             "        if _os.environ.get('HYBRID_BUILD_LM_HEAD') == 'quantize-at-load' "
             "and hasattr(lm_head, 'weight') \\\n"
             "                and lm_head.weight.dtype in (torch.bfloat16, torch.float16):\n"
             "            from vllm.hybrid_build_int8_gemv import int8_linear as _int8_linear, "
             "prepare_weight as _prep, \\\n"
             "                quantize_rows as _quant\n"
             "            if getattr(lm_head, '_hb_int8', None) is None:\n"
             "                _q, _s = _quant(lm_head.weight.data)\n"
             "                lm_head._hb_int8 = (_prep(_q), _s)\n"
             "            logits = _int8_linear(hidden_states, *lm_head._hb_int8)\n"
             "            if embedding_bias is not None:\n"
             "                logits = logits + embedding_bias\n"
             "        else:\n"
             "            logits = lm_head.quant_method.apply(lm_head, hidden_states, bias=embedding_bias)\n"),
    ),),
)
