"""Freed memory stays in the process: glibc's malloc told not to hand large blocks back to the kernel.

By default glibc's `malloc` serves every block above a threshold (128 KiB, rising to at most 32 MiB as large
blocks are freed) with a fresh `mmap` and returns it with `munmap` when it is freed, and it trims the top of
its heap whenever more than 128 KiB there is free. A CPU training step allocates and frees tensors of many
sizes (activations, gradients, the logits over the vocabulary), batch after batch of a new shape, so the
kernel maps, zeroes and unmaps fresh pages for the same tensors at every step (`docs/training.md`, "The step
on real batches", measures what that costs).

`keep_freed_memory()` asks malloc (`mallopt`, through `ctypes`) to serve blocks below 1 GiB from its heap, to
keep up to 1 GiB of free heap instead of trimming it, and to grow the heap 256 MiB at a time, so a step reuses
the memory the previous one freed. The process keeps its peak size until it exits, as PyTorch's CUDA caching
allocator does on a GPU. Training calls it when it runs on the CPU, and so do the benchmarks of the training
step (every implementation they compare runs in the same process, under the same allocator). The translator
calls it too on the CPU: a beam step of 256 rows allocates logits and log-probabilities of 5 MB each, which
malloc, with its thresholds at their starting 128 KiB, hands back to the kernel and page-faults in again at
the next step (`annotated/decoding/search.py`, section 7; the faults and the time they cost:
benchmarks/README.md#levers-shared-memory-freed-memory-windows).
Elsewhere than glibc it does nothing and says so (`False`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc's <malloc.h>
SETTINGS = ((M_MMAP_THRESHOLD, 1 << 30), (M_TRIM_THRESHOLD, 1 << 30), (M_TOP_PAD, 256 << 20))


@functools.cache
def keep_freed_memory() -> bool:
    """Tell glibc's malloc to keep freed memory for reuse (above); True where every setting was taken."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt; macOS's libc neither)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in SETTINGS)
