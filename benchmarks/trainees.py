# %% [markdown]
# # The implementations compared (`make bench`)
#
# Four rows per size (`benchmarks.rows.VARIANTS`). The two fused rows share
# one model and one optimiser (they differ only in the module flag
# `FAST_PATH`, switched around their steps); per-head attention is that model
# converted with `convert_model`; the reference is `torch.nn.Transformer`
# (`benchmarks/reference.py`). Each model is built from the same seed. A step
# is training's: forward, the label-smoothed loss over the real target
# positions only (`Batch.real`, made with the batch, outside the timed step),
# backward, and the Adam step with its schedule
# (`annotated.training.train.make_optimizer`).

# %%
from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from annotated.training.data import real_positions
from annotated.training.train import batch_loss, make_optimizer
from annotated.transformer import convert_model, fast_path, make_model
from benchmarks.reference import TorchTransformerReference, reference_batch_loss
from benchmarks.rows import VARIANTS
from benchmarks.sizes import Size


@dataclass
class Trainee:
    """One row: a model, its loss function, its optimiser, and the FAST_PATH setting it runs with."""

    key: str
    model: nn.Module
    loss_fn: Callable
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    fast: bool = True


def build_trainees(size: Size, device: torch.device, seed: int, keys=tuple(VARIANTS)) -> list[Trainee]:
    cfg = size.model_config()
    out: list[Trainee] = []

    def optimiser(model):
        return make_optimizer(model, size.train)

    if {"fused_sdpa", "fused_explicit", "per_head"} & set(keys):
        torch.manual_seed(seed)
        fused = make_model(cfg).to(device).train()
        opt, sched = optimiser(fused)
        for key, fast in (("fused_sdpa", True), ("fused_explicit", False)):
            if key in keys:
                out.append(Trainee(key, fused, batch_loss, opt, sched, fast))
        if "per_head" in keys:
            per_head = convert_model(fused, "per_head").train()
            out.append(Trainee("per_head", per_head, batch_loss, *optimiser(per_head)))
    if "reference" in keys:
        torch.manual_seed(seed)
        ref = TorchTransformerReference(cfg).to(device).train()
        out.append(Trainee("reference", ref, reference_batch_loss, *optimiser(ref)))
    return out


def make_step(t: Trainee, model: nn.Module, batches, eps: float, amp) -> Callable[[], None]:
    """One training step per call, cycling through `batches`; `model` may be a compiled `t.model`."""
    batch_iter = itertools.cycle([(src, tgt, real_positions(tgt)) for src, tgt in batches])  # as a Batch has them

    def step():
        src, tgt, real = next(batch_iter)
        t.opt.zero_grad(set_to_none=True)
        with amp(), fast_path(t.fast):
            loss, n_tokens = t.loss_fn(model, src, tgt, eps, real)
        (loss / n_tokens).backward()
        t.opt.step()
        t.sched.step()

    return step
