"""Freed memory kept in the process, within a bound, and handed back between phases.

By default glibc's `malloc` serves every block above a threshold (128 KiB at first) with a fresh `mmap`, returns
it with `munmap` when it is freed, and trims the top of its heap whenever more than 128 KiB there is free. A CPU
training step, or a beam step of the translator, allocates and frees tensors of many sizes, step after step, so
the kernel maps, zeroes and unmaps fresh pages for the same tensors at every step (what that costs:
benchmarks/README.md#levers-shared-memory-freed-memory-windows).

`keep_freed_memory()` asks malloc (`mallopt`, through `ctypes`) to serve blocks below `KEPT_BYTES` from its heap
and to keep up to `KEPT_BYTES` free at the top of each heap (at most `ARENAS` heaps) instead of trimming it, so a
step reuses the memory the previous one freed; training and the translator call it on the CPU. Inside a heap,
tensors of changing shapes leave holes that no trim threshold reaches: `release_freed_memory()` (`malloc_trim(0)`)
hands every free page back to the kernel, and training calls it where a phase ends, so what one phase left free
never stays resident through the next (`benchmarks/README.md`, "Where the memory goes in a CPU run").

A bf16 run on the CPU holds one more kind of memory, oneDNN's and ideep's caches of compiled kernels, one per
shape of each bf16 product, which batches of new lengths fill for hours; `bound_kernel_caches()` caps them
(benchmarks/README.md, "bf16 autocast on the CPU").
`resident_bytes()`, `peak_resident_bytes()` and `heap_bytes()` read what the process holds, for the training
log. Elsewhere than glibc they do nothing and say so (`False`, or None).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import resource
import sys

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -2, -3, -8  # glibc's <malloc.h>
KEPT_BYTES = 256 << 20  # the most free memory kept at the top of one heap, and the largest block it serves
ARENAS = 4  # heaps: the main one, and at most three more for the threads that allocate
SETTINGS = (
    (M_MMAP_THRESHOLD, KEPT_BYTES),
    (M_TRIM_THRESHOLD, KEPT_BYTES),
    (M_TOP_PAD, 16 << 20),  # the heap grows 16 MiB at a time
    (M_ARENA_MAX, ARENAS),
)

KERNEL_CACHES = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "1"}  # 0 for ideep crashes torch


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """glibc, or None where this is no glibc (musl has no mallopt; macOS's libc neither)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt.argtypes, libc.mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = (ctypes.c_size_t,), ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


@functools.cache
def keep_freed_memory() -> bool:
    """Tell glibc's malloc to keep freed memory for reuse, within `KEPT_BYTES` (above); True where every
    setting was taken."""
    libc = _libc()
    return libc is not None and all(libc.mallopt(param, value) == 1 for param, value in SETTINGS)


def bound_kernel_caches() -> None:
    """Cap oneDNN's and ideep's caches of compiled kernels (`KERNEL_CACHES`) where the environment does not set
    them already; read once, at the first oneDNN product of the process, so call it before that."""
    for name, value in KERNEL_CACHES.items():
        os.environ.setdefault(name, value)


def release_freed_memory() -> bool:
    """Hand every free page of every heap back to the kernel (`malloc_trim(0)`); True where glibc did."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
        + ("keepcost",)
    ]


def heap_bytes() -> tuple[int, int] | None:
    """(bytes malloc hands out now, bytes it holds free), over every heap and mapped block (`mallinfo2`,
    glibc 2.33 and later); None elsewhere. Free bytes may be resident or already handed back."""
    libc = _libc()
    info = getattr(libc, "mallinfo2", None)
    if info is None:
        return None
    info.restype = _Mallinfo2
    m = info()
    return m.uordblks + m.hblkhd, m.fordblks


def resident_bytes() -> int:
    """The process's resident memory now (`/proc/self/statm`; the peak so far where there is no /proc)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_resident_bytes()


def peak_resident_bytes() -> int:
    """The most resident memory the process has held (`getrusage`: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
