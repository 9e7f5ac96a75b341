"""Whether a profile's engine fits this host before it starts: weights + drafter + the profile's
KV pool + the reserve, against ``MemAvailable`` on unified memory (a GB10: the GPU draws from the
host's memory, and ``gpu_memory_utilization`` is no hard cap there, vLLM 46307) and against the
GPU's free memory on a discrete GPU (the reserve then against the host's ``MemAvailable``).

``budget`` is the arithmetic, on planned bytes given to it; ``host_memory`` reads this machine
(``nvidia-smi``, ``/proc/meminfo`` or ``HYBRID_BUILD_MEMINFO``); ``planned_bytes`` sums the files
of what the plan serves. ``serve`` refuses (exit 3) a budget that does not fit, naming the
``gpu_memory_utilization`` (and, with a KV size per token, the ``max_model_len``) that fits;
``plan`` prints the same lines.
"""
from __future__ import annotations

import math
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from hybrid_build.core.byte_units import human_bytes

from .watch import read_meminfo

MIB = 1 << 20


@dataclass(frozen=True)
class PlannedBytes:
    weights: int  # the served checkpoint's safetensors
    drafter: int  # the speculative drafter's (0: none, or not known here)
    kv_pool: int  # the profile's KV pool
    reserve: int  # what the host keeps for itself (--memory-reserve)
    activations: int = 0  # vLLM's budget besides weights and KV: activation peak, CUDA graphs (the planner's)
    basis: str = "the KV pool as vLLM sizes it: gpu_memory_utilization x total less the weights"

    @property
    def engine(self) -> int:
        return self.weights + self.drafter + self.activations + self.kv_pool


@dataclass(frozen=True)
class HostMemory:
    unified: bool
    total: int  # what vLLM's gpu_memory_utilization is a fraction of (MemTotal on unified memory)
    available: int  # what the engine can take: MemAvailable (unified) or the GPU's free memory
    host_available: int  # MemAvailable
    gpu: str = ""  # the GPU's name


@dataclass(frozen=True)
class Budget:
    planned: PlannedBytes
    host: HostMemory
    utilization: float  # the profile's gpu_memory_utilization
    fits: bool
    fitting_utilization: float  # the largest (two decimals) that leaves the reserve free
    fitting_max_model_len: int | None

    def line(self) -> str:
        p, h = self.planned, self.host
        against = (f"MemAvailable {human_bytes(h.available)} (unified memory)" if h.unified
                   else f"free GPU memory {human_bytes(h.available)}, MemAvailable {human_bytes(h.host_available)}")
        acts = f" + activations {human_bytes(p.activations)}" if p.activations else ""
        words = (f"memory budget: weights {human_bytes(p.weights)} + drafter {human_bytes(p.drafter)}{acts} + KV pool "
                 f"{human_bytes(p.kv_pool)} + reserve {human_bytes(p.reserve)} = "
                 f"{human_bytes(p.engine + p.reserve)} against {against}: ")
        if self.fits:
            return words + "fits"
        fix = f"gpu_memory_utilization {self.fitting_utilization:.2f} fits (the profile's is {self.utilization:.2f})"
        if self.fitting_max_model_len:
            fix += f"; there one stream holds {self.fitting_max_model_len:,} tokens (max_model_len)"
        return words + f"does not fit; {fix}"

    def to_json(self) -> dict:
        return {"planned": asdict(self.planned), "host": asdict(self.host), "utilization": self.utilization,
                "fits": self.fits, "fitting_utilization": self.fitting_utilization,
                "fitting_max_model_len": self.fitting_max_model_len}


def budget(planned: PlannedBytes, host: HostMemory, utilization: float,
           context_at: Callable[[float], int | None] | None = None) -> Budget:
    """The arithmetic. Unified memory: engine + reserve <= MemAvailable, and the utilization that
    fits is what is left above the reserve, over the total. Discrete: engine <= the GPU's free
    memory and reserve <= MemAvailable; the utilization that fits is the free share (vLLM refuses
    to start with less free than it asks for)."""
    if host.unified:
        room = host.available - planned.reserve
        fits = planned.engine <= room
    else:
        room = host.available
        fits = planned.engine <= room and planned.reserve <= host.host_available
    fitting = max(0.0, math.floor(room / host.total * 100) / 100) if host.total else 0.0
    fitting_len = context_at(fitting) if context_at is not None and not fits else None
    return Budget(planned, host, utilization, fits, fitting, fitting_len)


def host_memory(meminfo: Path | None = None) -> HostMemory | None:
    """This machine's memory as ``budget`` reads it; None when no GPU can be read (``nvidia-smi``
    missing or saying nothing)."""
    try:
        mem = read_meminfo(meminfo)
    except OSError:
        return None
    if "MemAvailable" not in mem or not shutil.which("nvidia-smi"):
        return None
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,memory.free", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    first = r.stdout.strip().splitlines()[:1]
    if r.returncode != 0 or not first:
        return None
    fields = [f.strip() for f in first[0].split(",")]
    if len(fields) != 3:
        return None
    name, total, free = fields
    if "GB10" in name or not total.isdigit():  # unified memory: nvidia-smi has no figures of its own ([N/A])
        return HostMemory(True, mem.get("MemTotal", 0), mem["MemAvailable"], mem["MemAvailable"], name)
    if not free.isdigit():
        return None
    return HostMemory(False, int(total) * MIB, int(free) * MIB, mem["MemAvailable"], name)


def folder_bytes(folder: str | None) -> int:
    """The safetensors bytes of a local folder (0 for a Hub id or none)."""
    if not folder or not Path(folder).expanduser().is_dir():
        return 0
    return sum(f.stat().st_size for f in Path(folder).expanduser().glob("*.safetensors"))


def planned_bytes(model: str, drafter: str | None, profile, total: int, reserve: int, engine: str | None = None,
                  text_config: dict | None = None) -> tuple[PlannedBytes, Callable[[float], int | None] | None]:
    """What the plan serves, in bytes, and how long a context one stream holds at another
    utilization. With the model's config and a vLLM version the KV planner knows
    (``serve/speed/memory_plan``), the KV pool and the activation reserve are the planner's;
    otherwise the pool is what vLLM gives it: its share of the total less weights and drafter."""
    from hybrid_build.serve.speed import memory_plan as mem

    weights, draft = folder_bytes(model), folder_bytes(drafter)
    util = profile.gpu_memory_utilization
    if text_config is not None and engine in mem.ENGINE_VERSIONS:
        acts, basis = mem.reserve_for("gb10")
        try:
            inputs = mem.profile_inputs(text_config, profile, engine, mem.DFLASH_DRAFTER, total_bytes=total,
                                        weights_bytes=weights, drafter_bytes=draft, reserve_bytes=acts,
                                        reserve_basis=basis)
            mp = mem.plan_memory(inputs)
        except (mem.MemoryPlanError, KeyError, TypeError, ValueError):
            pass
        else:
            def context_at(u: float) -> int | None:
                return mem.with_changes(inputs, gpu_memory_utilization=u).max_context_tokens or None

            return PlannedBytes(weights, draft, mp.kv_pool_bytes, reserve, acts,
                                f"the KV planner's pool for vLLM {engine}; activations {basis}"), context_at
    kv = max(0, int(util * total) - weights - draft)
    return PlannedBytes(weights, draft, kv, reserve), None
