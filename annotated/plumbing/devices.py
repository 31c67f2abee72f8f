"""Which device and which arithmetic a command runs on: one rule each, for every command.

`default_device`: the device the user named, else CUDA where it is available, else the CPU. Training, the
translator and the benchmark all ask it.

`resolve_precision`: fp32 or bf16 autocast, and why: bf16 where the hardware multiplies it (CUDA from compute
capability 8.0, a CPU with AVX512-BF16 or AMX), never slowly emulated; under autocast only matrix products and
convolutions run in bf16, and the parameters, their gradients and the optimizer's moments stay fp32.

>>> resolve_precision("auto", torch.device("cpu"), flags=frozenset({"avx2"}))
('fp32', 'auto: this CPU has no bf16 instructions (avx512_bf16 or amx_bf16)')
>>> resolve_precision("fp32", torch.device("cpu"))
('fp32', 'fp32 as set (by --precision or the preset)')
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from annotated.plumbing.provenance import cpuinfo

BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def default_device(name: str | None = None) -> torch.device:
    """`name` (cpu, cuda, cuda:1) when given, else cuda when available, else cpu.

    >>> default_device("cpu"), default_device().type == ("cuda" if torch.cuda.is_available() else "cpu")
    (device(type='cpu'), True)
    """
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def all_cores() -> int:
    """The CPU cores this process may run on (its affinity mask), the default number of torch threads."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def default_threads() -> int:
    """torch's CPU threads when the command names none: $OMP_NUM_THREADS where set (torchrun sets 1 per process
    unless told otherwise), else every core this process may use, shared among the processes started on this
    machine ($LOCAL_WORLD_SIZE), at least one each."""
    if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) >= 1:
        return int(os.environ["OMP_NUM_THREADS"])
    return max(1, all_cores() // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def cpu_flags(path: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The instruction-set flags of the first CPU in /proc/cpuinfo (empty where there is no such file)."""
    return frozenset((cpuinfo("flags", path) or "").split())


def cpu_has_bf16(flags: frozenset[str] | None = None) -> bool:
    """True when the CPU multiplies bf16 in hardware: an avx512_bf16 or amx_bf16 flag, and a torch built to use
    AVX512 or AMX kernels (torch.backends.cpu.get_cpu_capability())."""
    flags = cpu_flags() if flags is None else flags
    capability = torch.backends.cpu.get_cpu_capability()
    return any(f in flags for f in BF16_CPU_FLAGS) and capability.startswith(("AVX512", "AMX"))


def resolve_precision(requested: str, device: torch.device, flags: frozenset[str] | None = None) -> tuple[str, str]:
    """("fp32" or "bf16", the reason in words) for `requested` (auto, fp32, bf16) on `device`.
    Raises ValueError for bf16 on hardware without it. `flags`: the CPU's (default: read from /proc/cpuinfo)."""
    if requested not in ("auto", "fp32", "bf16"):
        raise ValueError(f"precision must be auto, fp32 or bf16, got {requested!r}")
    if requested == "fp32":
        return "fp32", "fp32 as set (by --precision or the preset)"
    if device.type == "cuda":
        # bf16 in hardware from compute capability 8.0 (A100, H100, RTX 30xx); a T4 or V100 emulates it, and
        # `torch.cuda.is_bf16_supported()` counts emulation
        if torch.cuda.get_device_capability(device) >= (8, 0):
            return "bf16", f"{requested}: CUDA device with bf16"
        if requested == "bf16":
            raise ValueError(
                f"--precision bf16: {torch.cuda.get_device_name(device)} has no bf16 matrix products "
                f"(compute capability below 8.0), so bf16 would be emulated and slower; use fp32 or auto"
            )
        return "fp32", "auto: this CUDA device has no bf16 matrix products (compute capability below 8.0)"
    if device.type == "cpu":
        if cpu_has_bf16(flags):
            return "bf16", f"{requested}: this CPU has bf16 instructions (avx512_bf16 or amx_bf16)"
        if requested == "bf16":
            raise ValueError(
                "--precision bf16: this CPU has no bf16 instructions (avx512_bf16 or amx_bf16), "
                "so bf16 would be emulated and slower than fp32; use --precision fp32 or auto"
            )
        return "fp32", "auto: this CPU has no bf16 instructions (avx512_bf16 or amx_bf16)"
    if requested == "bf16":
        raise ValueError(f"--precision bf16: not supported on device {device}; use fp32")
    return "fp32", f"auto: fp32 on {device.type}"


def autocast(device: torch.device, precision: str):
    """bf16 autocast for precision "bf16" on `device`, else nothing (plain fp32)."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
