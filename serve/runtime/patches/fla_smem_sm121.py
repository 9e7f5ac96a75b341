"""FLA chunk kernels on sm121 (GB10): its opt-in shared memory per block is 99 KiB (101,376 B),
just under FLA's default 100 KiB threshold, so ``check_shared_mem()`` picks the small tiles.
The edit compares against a threshold taken from ``HYBRID_BUILD_FLA_SMEM_BYTES`` (default
101,376, the ADA/GB10 figure) when the caller asks for the default arch."""
from .anchors import Edit, Patch

S = "# hybrid-build patch: fla-smem-threshold"
PATCH = Patch(
    name="fla-smem-sm121",
    path="vllm/model_executor/layers/fla/ops/utils.py",
    why="larger FLA chunk tiles on sm121",
    edits=(Edit(
        name="fla-smem-threshold",
        anchor="        return max_shared_memory >= Backend.get_shared_memory(arch)\n",
        new=(f"        {S}\n"
             "        if arch == \"none\":\n"
             "            return max_shared_memory >= "
             "int(os.environ.get(\"HYBRID_BUILD_FLA_SMEM_BYTES\", \"101376\"))\n"
             "        return max_shared_memory >= Backend.get_shared_memory(arch)\n"),
    ),),
)
