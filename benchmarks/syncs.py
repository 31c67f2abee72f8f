# %% [markdown]
# # Counting host <-> device synchronisations
#
# A GPU runs the kernels that the host queues; the host only waits when it
# needs a value back: `loss.item()`, `float(norm)`, `int(mask.sum())`, an
# `if` on a tensor, boolean indexing (whose output size depends on the
# data). Each such read drains the queue, and for a small model the GPU then
# idles while Python prepares the next kernels. The training step is built
# to read nothing (`annotated/training/train.py`, "A step that never waits").
#
# `SyncCounter` proves it on any machine, the CPU included: it sees every
# operator PyTorch dispatches and counts those that must hand a value, or a
# data-dependent shape, to the host. On the CPU nothing actually waits, but
# the same code on a GPU would dispatch the same operators.

# %%
from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# operators whose result the host must see: a scalar, or an output whose size depends on the values
SYNC_OPS = {
    "_local_scalar_dense",
    "item",
    "nonzero",
    "masked_select",
    "equal",
    "is_nonzero",
    "unique_dim",
    "_unique",
    "_unique2",
    "unique_consecutive",
    "bincount",
    "histc",
    "repeat_interleave",
}


class SyncCounter(TorchDispatchMode):
    """Counts the synchronising operators dispatched inside the block (`counts`, `total`).

    >>> x = torch.ones(3)
    >>> with SyncCounter() as c:
    ...     y = (x * 2).sum()      # queued: no sync
    ...     v = y.item()           # read: one sync
    ...     z = x[x > 0]           # boolean index: its size depends on the data
    >>> c.total, sorted(c.counts)
    (2, ['_local_scalar_dense', 'index'])
    """

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        if name in SYNC_OPS or (name == "index" and _has_bool_index(args)) or _copies_to_host(name, args, kwargs):
            self.counts[name] += 1
        return func(*args, **kwargs)


def _has_bool_index(args) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ()))


def _copies_to_host(name: str, args, kwargs) -> bool:
    """A copy from an accelerator into host memory (on the CPU there is none to count)."""
    if name not in ("_to_copy", "copy_") or not args or not isinstance(args[0], torch.Tensor):
        return False
    src, dst = (args[1], args[0]) if name == "copy_" else (args[0], kwargs.get("device"))
    dst_type = dst.device.type if isinstance(dst, torch.Tensor) else getattr(dst, "type", None)
    return isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst_type == "cpu"
