"""The start budget's arithmetic: weights + drafter + activations + KV pool + reserve against
MemAvailable on unified memory, against the GPU's free memory (and the reserve against MemAvailable)
on a discrete GPU; the utilization that fits is what is left above the reserve over the total,
rounded down to two decimals."""
from __future__ import annotations

from hybrid_build.serve.launch.memory_budget import HostMemory, PlannedBytes, budget

GB = 10**9


def test_unified_memory_counts_the_reserve_against_memavailable():
    planned = PlannedBytes(weights=66 * GB, drafter=2 * GB, kv_pool=30 * GB, reserve=14 * GB, activations=7 * GB)
    host = HostMemory(True, total=128 * GB, available=119 * GB, host_available=119 * GB)
    assert budget(planned, host, 0.82).fits  # 105 + 14 = 119 <= 119
    tight = budget(planned, HostMemory(True, 128 * GB, 110 * GB, 110 * GB), 0.82)
    assert not tight.fits
    assert tight.fitting_utilization == 0.75  # (110 - 14) / 128 = 0.75
    assert "does not fit; gpu_memory_utilization 0.75 fits (the profile's is 0.82)" in tight.line()


def test_the_fitting_utilization_rounds_down():
    planned = PlannedBytes(weights=1 * GB, drafter=0, kv_pool=100 * GB, reserve=14 * GB)
    found = budget(planned, HostMemory(True, 128 * GB, 100 * GB, 100 * GB), 0.82)
    assert found.fitting_utilization == 0.67  # 86 / 128 = 0.6718...: 0.68 would eat into the reserve


def test_a_discrete_gpu_counts_its_free_memory_and_the_host_keeps_the_reserve():
    planned = PlannedBytes(weights=66 * GB, drafter=2 * GB, kv_pool=40 * GB, reserve=14 * GB)
    gpu = dict(unified=False, total=141 * GB)
    assert budget(planned, HostMemory(available=120 * GB, host_available=200 * GB, **gpu), 0.82).fits
    short_gpu = budget(planned, HostMemory(available=100 * GB, host_available=200 * GB, **gpu), 0.82)
    assert not short_gpu.fits and short_gpu.fitting_utilization == 0.70  # 100 / 141 = 0.709
    short_host = budget(planned, HostMemory(available=120 * GB, host_available=10 * GB, **gpu), 0.82)
    assert not short_host.fits  # the GPU has room; the host would keep 10 GB < 14 GB


def test_a_planner_names_the_context_that_fits():
    planned = PlannedBytes(weights=66 * GB, drafter=0, kv_pool=30 * GB, reserve=14 * GB)
    seen = []

    def context_at(u: float) -> int:
        seen.append(u)
        return 131072

    found = budget(planned, HostMemory(True, 128 * GB, 100 * GB, 100 * GB), 0.82, context_at)
    assert seen == [0.67] and "there one stream holds 131,072 tokens (max_model_len)" in found.line()
