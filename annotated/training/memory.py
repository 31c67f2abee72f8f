# %% [markdown]
# # Memory over a run
#
# A run on the CPU goes through phases that need different amounts of
# memory (the data, each epoch's steps, its validation, and the end's
# averaging, length penalty and test decodes). Where each phase ends,
# `phase_end` writes down what the process holds
# (`annotated/plumbing/allocator.py`), then hands the freed memory back to
# the kernel, so that what one phase freed is not carried through the next.
#
# The rows go to the run log, tensorboard and `results.json` (`"memory"`;
# `benchmarks/README.md`, "Where the memory goes", reads them), never into
# the epochs' `history`, whose figures two runs of one install repeat bit for
# bit: memory does not. A short run's resident memory does not grow from its
# second epoch to its last
# (`test_resident_memory_does_not_grow_from_the_second_epoch_to_the_last`).

# %%
from __future__ import annotations

from dataclasses import dataclass, field

from annotated.plumbing.allocator import heap_bytes, peak_resident_bytes, release_freed_memory, resident_bytes

MB = 1 << 20


@dataclass
class MemoryLog:
    """The memory rows of a run: one per phase end."""

    rows: list[dict] = field(default_factory=list)

    def phase_end(self, phase: str, step: int, writer=None) -> dict:
        """Measure what the process holds where `phase` ended (MiB), then hand its freed memory back; the row
        (also kept in `rows`, and given a tensorboard writer, logged at `step`)."""
        row = {"phase": phase, "step": step, "resident_mb": round(resident_bytes() / MB)}
        heap = heap_bytes()
        if heap is not None:
            row.update(malloc_in_use_mb=round(heap[0] / MB), malloc_free_mb=round(heap[1] / MB))
        release_freed_memory()
        row.update(released_mb=round(resident_bytes() / MB), peak_mb=round(peak_resident_bytes() / MB))
        self.rows.append(row)
        if writer is not None:
            writer.add_scalar(f"memory/{phase}_resident_mb", row["resident_mb"], step)
            writer.add_scalar("memory/peak_resident_mb", row["peak_mb"], step)
        return row
