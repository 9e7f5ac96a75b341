"""Pure tensor transforms: FP8 block quantization (and its observers), int8 per-row quantization,
GPTQ packing, error metrics.

No file I/O here; the pipeline feeds tensors in and writes what comes out.
"""
