# %% [markdown]
# # Several processes: DistributedDataParallel
#
# `torchrun --nproc_per_node=W train_wmt.py ...` starts `W` copies of the
# training program (one per GPU, or `W` CPU processes) and gives each its
# `RANK`, `LOCAL_RANK` and `WORLD_SIZE`. They join one process group (NCCL
# between GPUs, gloo between CPU processes; a process uses the GPU numbered by
# its `LOCAL_RANK` on its machine) and train one model together:
#
# * **Same data.** Rank 0 reads the data and trains the tokenizer; the
#   others receive both from it (`from_rank0`).
# * **One step.** Each rank runs forward and backward on its own `accum`
#   batches; DistributedDataParallel (DDP) averages the gradients over the
#   ranks, and every rank applies the same Adam update to its identical copy
#   of the parameters.
# * **Normalisation.** A step's gradient is that of the summed loss of all
#   its `W * accum` batches divided by the number `N` of target tokens they
#   predict:
#
#   $$g = \frac{1}{N} \sum_{r=1}^{W} \sum_{b \in B_r} \nabla L_b, \qquad N = \sum_{r=1}^{W} \sum_{b \in B_r} n_b$$
#
#   where `B_r` are rank `r`'s batches of the step, `L_b` a batch's summed
#   loss and `n_b` its token count. One all-reduce per epoch tells every rank
#   each step's `N` (`train.step_tokens`); rank `r` backpropagates
#   `(W / N) sum_b L_b`, and DDP's mean over the `W` ranks gives exactly `g`.
#   So `W` processes take the step one process takes on the union of their
#   batches, and one process with `accum = W` on the same batches computes the
#   same gradient (`test_each_step_applies_the_gradient_of_the_union_of_the_two_shards`,
#   `test_ddp_run_equals_single_process_with_accumulation`). Averaging the
#   batches' own means instead would weigh a token of a short batch more than
#   one of a long batch.
#
# Rank 0 alone logs, evaluates BLEU and writes the checkpoints, from the
# unwrapped model, so a checkpoint of a `W`-process run is an ordinary one.
# A rank that left the loop alone would leave the others waiting in their
# next collective, so the ranks agree on stopping and on a non-finite step
# in the one all-reduce of each log point (`sum_over_ranks`). The rest:
# `docs/distributed.md`.

# %%
from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


class RankError(RuntimeError):
    """This rank stops because rank 0 failed."""


def join(dev: torch.device) -> tuple[int, int, torch.device, bool]:
    """(rank, world size, this rank's device, whether we joined the group here) from torchrun's environment."""
    if dist.is_available() and dist.is_initialized():  # a caller set it up (and will tear it down)
        owned = False
    elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
        owned = True
    else:
        return 0, 1, dev, False
    if dev.type == "cuda":  # one GPU per process: the LOCAL_RANK-th of this machine
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if local >= torch.cuda.device_count():
            raise ValueError(
                f"process LOCAL_RANK={local} needs GPU {local}, but this machine has "
                f"{torch.cuda.device_count()}: start at most that many processes per machine "
                f"(--nproc_per_node), or train on CPUs with --device cpu"
            )
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    if owned:
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", timeout=timedelta(minutes=30))
    return dist.get_rank(), dist.get_world_size(), dev, owned


def leave() -> None:
    dist.destroy_process_group()


def wrap(model: torch.nn.Module, dev: torch.device) -> torch.nn.Module:
    """DDP around `model`: copies rank 0's parameters to every rank, then averages gradients in backward."""
    # the one buffer, the positional table, is constant: no copy before each forward (newer torch's name for
    # that setting, else the older one)
    no_buffer_sync = (
        "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP).parameters else "broadcast_buffers"
    )
    settings: dict[str, Any] = {no_buffer_sync: False}
    return DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None, **settings)


def from_rank0(fn: Callable, rank: int, world: int):
    """fn() run on rank 0 and sent to every rank; if it fails there, every rank stops with an error."""
    if world == 1:
        return fn()
    box: list[Any] = [None]
    if rank == 0:
        try:
            box = [(True, fn())]
        except Exception as e:
            dist.broadcast_object_list([(False, f"{type(e).__name__}: {e}")], src=0)
            raise
    dist.broadcast_object_list(box, src=0)
    ok, value = box[0]
    if not ok:
        raise RankError(f"rank {rank}: stopped because rank 0 failed: {value}")
    return value


def sum_over_ranks(values: torch.Tensor, world: int) -> torch.Tensor:
    """Element-wise sum over all ranks of a float64 tensor (token counts stay exact); a synchronisation point."""
    if world > 1:
        dist.all_reduce(values)
    return values
