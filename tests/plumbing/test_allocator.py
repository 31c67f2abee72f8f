"""annotated/plumbing/allocator.py: after keep_freed_memory(), a large tensor allocated and freed again and again
reuses the same memory instead of faulting fresh pages in each time. Each case runs in its own process (the
setting is for the whole process)."""

import subprocess
import sys

import pytest
import torch

from annotated.plumbing.allocator import keep_freed_memory, release_freed_memory

CHURN = """
import resource, sys, torch
from annotated.plumbing.allocator import keep_freed_memory, release_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None

def churn(rounds):
    for _ in range(rounds):
        x = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, written, then freed
        del x

churn(10)  # the heap settles (its first blocks land at new addresses while it grows)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
churn(20)
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(mode: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", CHURN, mode], capture_output=True, text=True, check=True).stdout
    kept, n = out.split()
    return kept, int(n)


def test_freed_memory_is_reused_not_faulted_in_again():
    """A 64 MiB block is above the largest size glibc ever serves from its heap by default (32 MiB), so with
    the defaults each of 20 rounds maps it anew and faults in all of its 16,384 4-KiB pages (at least 15
    rounds' worth, allowing for huge pages); kept, the rounds reuse one block: under one round's worth."""
    if not keep_freed_memory():
        pytest.skip("not glibc's malloc: keep_freed_memory() does nothing here")
    _, default = faults("default")
    kept, with_setting = faults("keep")
    pages = (64 << 20) // 4096
    assert kept == "True" and default >= 15 * pages and with_setting < pages, (default, with_setting)


HOLES = """
import sys, torch
from annotated.plumbing.allocator import keep_freed_memory, release_freed_memory, resident_bytes
assert keep_freed_memory()
blocks = [torch.ones(8 << 20, dtype=torch.uint8) for _ in range(32)]  # 256 MiB in 8 MiB blocks, written
del blocks[::2]  # 128 MiB freed as holes between live blocks: no trim of the heap's top can reach them
held = resident_bytes()
release_freed_memory()
print(held - resident_bytes())
"""


def test_released_memory_leaves_the_process_even_from_holes_in_the_heap():
    """`release_freed_memory()` hands back free pages from the middle of the heap, where `KEPT_BYTES`' trim
    threshold never reaches: of 128 MiB freed in 8 MiB holes between live blocks, at least 100 MiB leave the
    resident set (the margin: a hole's first and last pages hold malloc's own bookkeeping and stay)."""
    if not keep_freed_memory():
        pytest.skip("not glibc's malloc: keep_freed_memory() does nothing here")
    out = subprocess.run([sys.executable, "-c", HOLES], capture_output=True, text=True, check=True).stdout
    assert int(out) >= 100 << 20, int(out) >> 20


def test_blocks_above_the_bound_are_handed_back_when_freed():
    """A block above `KEPT_BYTES` is mapped on its own and unmapped when freed: what the heap keeps is bounded."""
    if not keep_freed_memory():
        pytest.skip("not glibc's malloc: keep_freed_memory() does nothing here")
    from annotated.plumbing.allocator import KEPT_BYTES, resident_bytes

    before = resident_bytes()
    x = torch.ones(KEPT_BYTES + (64 << 20), dtype=torch.uint8)
    assert resident_bytes() - before >= KEPT_BYTES  # written: resident
    del x
    assert resident_bytes() - before < 32 << 20  # gone again (the margin: other threads' small allocations)


SHAPES = """
import sys, torch
from annotated.plumbing.allocator import bound_kernel_caches, release_freed_memory, resident_bytes
if sys.argv[1] == "bound":
    bound_kernel_caches()
torch.set_num_threads(1)
linear = torch.nn.Linear(128, 512)
held = []
for rows in range(100, 400):  # a bf16 product, forward and backward, at 300 row counts, each new
    x = torch.randn(rows, 128, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        linear(x).float().sum().backward()
    if rows in (199, 399):
        release_freed_memory()
        held.append(resident_bytes())
print(held[1] - held[0])
"""


def test_bf16_products_of_new_shapes_do_not_pile_up_compiled_kernels():
    """After `bound_kernel_caches()`, bf16 products at 200 new row counts leave the process holding what it
    held before them, within 4 MiB (malloc's and the kernels' own bookkeeping). Without the call, on this
    Xeon (oneDNN emulating bf16 with AVX-512), the same 200 shapes added about 30 MiB."""
    if not release_freed_memory():
        pytest.skip("not glibc's malloc: the resident figures would keep freed memory")
    out = subprocess.run([sys.executable, "-c", SHAPES, "bound"], capture_output=True, text=True, check=True).stdout
    assert int(out) < 4 << 20, int(out) >> 20
