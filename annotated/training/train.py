# %% [markdown]
# # Training a translator
#
# This chapter turns the model of `annotated/transformer.py` into a German ->
# English translator trained on Multi30k (the text of WMT16's multimodal
# task 1). `train_wmt.py` is only a command line over `train()` below.
#
# The recipe is the paper's (section 5), scaled down to a 29,000-sentence
# corpus: token-count batches, Adam with beta = (0.9, 0.98) and eps = 1e-9,
# the warm-up/inverse-square-root learning rate, dropout, and label
# smoothing. Evaluation is sacreBLEU on detokenised text, so the numbers are
# comparable with other work.

# %%
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import torch
from torch import Tensor

from annotated.checkpoint import CheckpointError, read_checkpoint, save_checkpoint  # noqa: F401 train.CheckpointError for the callers
from annotated.decoding import casing
from annotated.plumbing.allocator import bound_kernel_caches, keep_freed_memory
from annotated.plumbing.devices import autocast, default_device, resolve_precision
from annotated.plumbing.files import atomic_write
from annotated.plumbing.interrupts import StopFlag
from annotated.plumbing.provenance import environment
from annotated.run_folder import BEST, CONFIG, LAST, epoch_file
from annotated.tokens import PAD, Tokenizer
from annotated.training import data, distributed
from annotated.training.config import PRESETS, TrainConfig, config_dict  # noqa: F401 train.PRESETS for the callers
from annotated.training.evaluate import evaluate_bleu
from annotated.training.loss import label_smoothed_loss
from annotated.training.memory import MemoryLog
from annotated.training.results import Arithmetic, score_test_set
from annotated.training.runs import (
    RunState,
    TrainingError,
    check_run_dir,
    log_line,
    point_latest,
    resume_state,
    rng_state,
    set_rng_state,
    truncate_log,
)
from annotated.transformer import EncoderDecoder, cooled_rate, make_model, padding_mask, rate, target_mask

# %% [markdown]
# ## Settings
#
# Every setting of a run is one `TrainConfig` (`annotated/training/config.py`,
# with the presets); its `model` is the first chapter's `TransformerConfig`.
# Its `precision` chooses fp32 or bf16 autocast (`annotated/plumbing/devices.py`);
# on the CPU a bf16 step's loss lies within 2^-9 of the fp32 step's
# (`test_a_bf16_step_on_the_cpu_gives_the_fp32_loss_to_bf16_rounding`).

# %% [markdown]
# ## One optimisation step
#
# Teacher forcing feeds `tgt[:, :-1]` and predicts `tgt[:, 1:]`. The loss,
# the paper's label-smoothed cross-entropy (`annotated/training/loss.py`), is
# summed over predicted tokens and divided by their number, so long and short
# batches weigh each token equally; only those tokens' positions are projected
# onto the vocabulary (`Batch.real`), not the padding. The learning rate
# follows `rate()` from the first chapter; a run may end with a cooldown, a
# straight line towards zero over its last steps, so that its last
# checkpoints are taken at small steps, not at the rate that makes the
# validation score jump by two points between epochs.


# %%
def batch_loss(
    model: torch.nn.Module, src: Tensor, tgt: Tensor, eps: float, real: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """(summed loss, number of predicted tokens), both 0-d tensors on the batch's device (nothing is read).
    With `real` (`Batch.real`: the flat indices of tgt[:, 1:]'s non-pad entries) the model projects only
    those positions onto the vocabulary; the loss is the same."""
    tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]  # (B, T-1), (B, T-1)
    masks = padding_mask(src, PAD), target_mask(tgt_in, PAD)
    if real is None:
        logits = model(src, tgt_in, *masks)  # (B, T-1, V)
        return label_smoothed_loss(logits, tgt_out, eps), (tgt_out != PAD).sum()
    logits = model(src, tgt_in, *masks, positions=real)  # (n, V)
    return label_smoothed_loss(logits, tgt_out.flatten().index_select(0, real), eps), (tgt_out != PAD).sum()


def learning_rate(step: int, cfg: TrainConfig) -> float:
    """The learning rate of optimizer step `step` (counted from 1): the paper's `rate()`, except over the
    budget's last `cfg.cooldown_steps`, where it falls on a straight line from the rate it had reached
    towards zero (`test_the_cooldown_falls_linearly_to_the_last_step`).

    >>> cfg = dataclasses.replace(PRESETS["smoke"], cooldown=0.1)  # 28 steps, the last round(2.8) = 3 cool down
    >>> [round(learning_rate(n, cfg) / rate(25, cfg.d_model, cfg.warmup), 2) for n in (25, 26, 27, 28)]
    [1.0, 0.75, 0.5, 0.25]
    """
    if not cfg.cooldown or cfg.max_steps is None:  # (a cooldown needs max_steps: TrainConfig checks)
        return rate(step, cfg.d_model, cfg.warmup, cfg.lr_factor)
    return cooled_rate(step, cfg.max_steps, cfg.cooldown_steps, cfg.d_model, cfg.warmup, cfg.lr_factor)


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig):
    """Adam as in the paper, fused (one kernel for all parameters; it can skip a step on the device, below).
    The scheduler's counter s counts the steps taken, so step s + 1 (counted from 1) runs at
    learning_rate(s + 1) (`test_the_optimizer_uses_rate_n_at_step_n`)."""
    opt = torch.optim.Adam(model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: learning_rate(s + 1, cfg))
    return opt, sched


# %% [markdown]
# ## A step that never waits for the host
#
# The host queues a GPU's kernels and runs ahead, unless it needs a value
# back: each `loss.item()` or `float(grad_norm)` waits until the queue is
# empty. A model of this size is small enough that such waits, several a
# step, cost more than the arithmetic. So a step reads nothing:
#
# * the loss and the token count of each step are added to running sums **on
#   the device** (`Meter`), read once every `log_every` steps, at each epoch's
#   end and where the run stops: a row of `train_loss.tsv` and of tensorboard
#   per read, the mean loss per token since the previous one;
# * the non-finite check is done on the device too, as `torch.amp.GradScaler`
#   does it: `found_inf = 1` when the gradient norm is NaN or infinite (a NaN
#   or infinite loss makes it so), and the fused Adam kernel, given
#   `found_inf`, leaves parameters and moments untouched. The next read sees
#   the count of skipped steps and stops the run with an error, before any
#   checkpoint is written, so the last good one is kept;
# * on a GPU the epoch's batches are copied once into page-locked ("pinned")
#   host memory, so that each batch's copy to the GPU is queued like a kernel,
#   not waited for;
# * token-id checks live where ids are made (data, translator input), not in
#   the model.
#
# `tests/training/test_train_syncs.py` counts the synchronising operators a run of
# steps dispatches (`benchmarks/syncs.py`): none between two reads.


# %%
def train_step(
    model: torch.nn.Module,
    opt,
    sched,
    batches,
    n_tokens: int,
    cfg: TrainConfig,
    dev: torch.device,
    world: int = 1,
    ddp=None,
    precision: str = "fp32",
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One optimizer step over `batches` (up to `accum` of them, `n_tokens` predicted tokens over all ranks),
    forward and backward under `precision` ("fp32" or "bf16" autocast).
    Returns (summed loss, tokens, gradient norm, found_inf), device tensors that nobody reads here."""
    loss_sum, tokens = torch.zeros((), device=dev), torch.zeros((), dtype=torch.long, device=dev)
    for j, b in enumerate(batches):
        # DDP averages the gradients in the backward pass of the step's last batch only
        sync = ddp is None or j == len(batches) - 1
        with contextlib.nullcontext() if sync else ddp.no_sync(), autocast(dev, precision):
            loss, n = batch_loss(
                model,
                b.src.to(dev, non_blocking=True),
                b.tgt.to(dev, non_blocking=True),
                cfg.label_smoothing,
                b.real.to(dev, non_blocking=True),
            )
        # (W / N) sum_b L_b on this rank; DDP's mean over the W ranks makes it sum_b L_b / N ("Several processes")
        (loss * (world / max(n_tokens, 1))).backward()
        loss_sum, tokens = loss_sum + loss.detach().float(), tokens + n
    params = [p for group in opt.param_groups for p in group["params"]]
    gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.clip_norm or float("inf"))  # () on the device
    found_inf = (~torch.isfinite(gnorm)).float()  # (): 1.0 makes fused Adam skip this update
    opt.found_inf = found_inf
    opt.step()
    del opt.found_inf
    opt.zero_grad(set_to_none=True)
    sched.step()
    return loss_sum, tokens, gnorm, found_inf


class Meter:
    """Running sums on the device between two reads: loss, tokens, gradient norms, steps, skipped steps, and the
    step number, loss and gradient norm of the first skipped one."""

    SUMMED = ("loss", "tokens", "grad_norm", "steps", "skipped")
    FIRST_SKIPPED = ("first_skipped_step", "first_skipped_loss", "first_skipped_grad_norm")
    FIELDS = SUMMED + FIRST_SKIPPED
    # gradient-derived: every rank holds the same value, so the sum over ranks is divided by their number
    SAME_ON_EVERY_RANK = ("grad_norm", "steps", "skipped", "first_skipped_step", "first_skipped_grad_norm")

    def __init__(self, dev: torch.device):
        self.sums = torch.zeros(len(self.FIELDS), dtype=torch.float64, device=dev)  # (8,)

    def _at(self, name: str) -> Tensor:
        return self.sums[self.FIELDS.index(name)]  # () a view

    def add(self, loss: Tensor, tokens: Tensor, gnorm: Tensor, found_inf: Tensor) -> None:
        first = (found_inf > 0) & (self._at("skipped") == 0)  # (): the first skipped step since the last read
        summed = torch.stack(
            [loss.double(), tokens.double(), gnorm.double(), torch.ones_like(self.sums[0]), found_inf.double()]
        )  # (5,) in SUMMED's order
        first_skipped = torch.stack([self._at("steps") + 1, loss.double(), gnorm.double()])  # (3,)
        n = len(self.SUMMED)
        self.sums[:n] += summed
        self.sums[n:] = torch.where(first, first_skipped, self.sums[n:])

    def read(self, world: int, stopping: bool, out_of_time: bool) -> SimpleNamespace:
        """The sums since the last read over all ranks (the first skipped step's number counted from the previous
        read, 1 = its first step), and how many ranks are stopping or out of time; then zero. The one sync."""
        flags = torch.tensor([float(stopping), float(out_of_time)], dtype=torch.float64)  # (2,)
        values = distributed.sum_over_ranks(torch.cat([self.sums, flags.to(self.sums.device)]), world)
        out = dict(zip(self.FIELDS + ("ranks_stopping", "ranks_out_of_time"), values.cpu().tolist()))
        self.sums.zero_()
        for name in self.SAME_ON_EVERY_RANK:
            out[name] /= world
        return SimpleNamespace(**out)


# %% [markdown]
# ## Validation loss


# %%
@torch.no_grad()
def evaluate_loss(model: EncoderDecoder, batches, eps: float, device: torch.device, precision: str = "fp32") -> float:
    """Label-smoothed loss per predicted token over all batches."""
    model.eval()
    total, tokens = torch.zeros((), dtype=torch.float64, device=device), 0
    for b in batches:
        with autocast(device, precision):
            loss, _ = batch_loss(model, b.src.to(device), b.tgt.to(device), eps, b.real.to(device))
        total, tokens = total + loss.double(), tokens + b.ntokens  # (ntokens: counted on the host)
    return total.item() / max(tokens, 1)


# %% [markdown]
# ## The training loop
#
# `train()` sets a run up and then reads like any training loop: epochs of
# token-count batches (a new shuffle each epoch, seeded, so a resumed run sees
# the same batches), `train_step` for every `accum` batches, a read of the
# running sums at each log point, and at each epoch's end validation loss and
# BLEU, one plain log line, and checkpoints:
#
# * `last.pt`: everything needed to resume;
# * `best.pt`: the model with the best validation BLEU so far;
# * `epoch{n}.pt`: kept only when `average_last` asks for checkpoint averaging,
#   for exactly the last `average_last` epochs, which `averaged.pt` averages
#   (`test_a_run_keeps_and_averages_exactly_its_last_average_last_epochs`).
#
# Ctrl-C finishes the current step, writes `last.pt` and stops (a second
# Ctrl-C stops at once). The run folder, its logs and resuming are
# `annotated/training/runs.py`'s; scoring, `annotated/training/evaluate.py`'s;
# the end, `annotated/training/results.py`'s. With several processes
# (`torchrun`), each rank trains on its own share of every epoch's batches
# and only rank 0 evaluates, logs and writes (`annotated/training/distributed.py`).

# %%
AlignmentImage = Callable[..., object]  # (writer, model, tokenizer, sentence, step): logs a picture


@dataclass(frozen=True)
class DataSource:
    """Where the sentence pairs come from: Multi30k (`data_url`, `cache_dir`), or the user's three pairs of files
    (`empty_lines`: read_parallel's rule for a pair with an empty side: error, skip or keep)."""

    data_url: str | None = None
    cache_dir: Path | None = None
    train_files: tuple[str, str] | None = None
    val_files: tuple[str, str] | None = None
    test_files: tuple[str, str] | None = None
    empty_lines: str = "error"


@dataclass(frozen=True)
class Placement:
    """This process among the run's processes, and its device."""

    rank: int
    world: int
    dev: torch.device


@dataclass
class Learner:
    """The model and what updates it."""

    model: EncoderDecoder  # the plain model (checkpoints, evaluation)
    model_for_step: torch.nn.Module  # what the step calls: the model, or DDP / torch.compile around it
    opt: torch.optim.Optimizer
    sched: Any  # a LambdaLR
    ddp: Any = None


@dataclass
class RunData:
    tokenizer: Tokenizer
    train_enc: list  # the training pairs as subword ids (over-long pairs left out)
    val_batches: list
    val_pairs: list
    test_pairs: list
    case_table: dict  # the sources' words in their most frequent casing (decoding/casing.py)


@dataclass
class EpochTally:
    """The current epoch's summed loss and tokens as read at its log points, and when the sums were last read
    (tokens per second between two reads)."""

    loss: float = 0.0
    tokens: float = 0.0
    t_read: float = field(default_factory=time.perf_counter)


@dataclass
class Run:
    """What every part of the loop needs: the settings, where this process runs, the learner, the data, and
    where to write."""

    cfg: TrainConfig
    run_dir: Path
    place: Placement
    arithmetic: Arithmetic
    learner: Learner
    data: RunData
    meta: dict
    say: Callable[[str], None]
    writer: Any = None  # a tensorboard SummaryWriter on rank 0
    bar: Any = None  # a tqdm bar
    alignment_image: AlignmentImage | None = None
    t_start: float = field(default_factory=time.perf_counter)
    tally: EpochTally = field(default_factory=EpochTally)
    memory: MemoryLog = field(default_factory=MemoryLog)  # what the process holds where each phase ends

    @property
    def main(self) -> bool:
        return self.place.rank == 0

    def out_of_time(self) -> bool:
        return self.cfg.max_minutes is not None and time.perf_counter() - self.t_start > 60 * self.cfg.max_minutes


def train(
    cfg: TrainConfig,
    run_dir: Path,
    *,
    source: DataSource = DataSource(),
    device: str | None = None,
    resume: bool = False,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
    alignment_image: AlignmentImage | None = None,
) -> dict:
    """Train (or resume) a run in `run_dir` on the pairs of `source`; returns the final results (also in
    results.json). `alignment_image`: a picture of the attention on the first validation sentence at each
    epoch's end (train_wmt.py hands in annotated/attention/dump.py's `log_alignment_image`)."""
    precision, reason = resolve_precision(cfg.precision, default_device(device))  # before any work
    rank, world, dev, owns_group = distributed.join(default_device(device))
    if dev.type == "cpu":  # a CPU step's large tensors reuse freed memory instead of faulting pages in
        keep_freed_memory()
        if precision == "bf16":  # oneDNN compiles a kernel per batch shape: keep few (allocator.py)
            bound_kernel_caches()
    arithmetic = Arithmetic(precision, reason, torch.get_num_threads())
    started_in = environment()  # the commit and packages that train, whatever the checkout is when it ends
    run_dir, run = Path(run_dir), None
    try:
        try:
            distributed.from_rank0(lambda: check_run_dir(run_dir, resume), rank, world)  # before any work
            run, state = setup(
                cfg,
                run_dir,
                place=Placement(rank, world, dev),
                arithmetic=arithmetic,
                resume=resume,
                source=source,
                say=log or (lambda s: log_line(run_dir, s)),
            )
            run.alignment_image = alignment_image
            stopped = loop(run, state, progress)
        finally:
            if owns_group:  # all ranks leave the loop at the same agreed point; rank 0 goes on alone
                distributed.leave()
        if stopped:
            return {"interrupted": True, "run_dir": str(run_dir)}
        if not run.main:
            return {}
        return score_test_set(
            cfg,
            run_dir,
            run.data.tokenizer,
            run.data.test_pairs,
            dev,
            run.say,
            arithmetic,
            progress=progress,
            test_files=source.test_files,
            writer=run.writer,
            val_pairs=run.data.val_pairs,
            started_in=started_in,
            memory=run.memory,
        )
    finally:
        if run is not None and run.writer is not None:
            run.writer.close()


def loop(run: Run, state: RunState, progress: bool) -> bool:
    """Epochs until the budget is spent; True when a Ctrl-C stopped the run."""
    cfg, dev = run.cfg, run.place.dev
    if progress and run.main:  # one bar over the run's steps, with an ETA; log lines are written above it
        from tqdm.auto import tqdm

        run.bar = tqdm(total=cfg.max_steps, initial=state.step, unit="step", dynamic_ncols=True)
    with StopFlag() as stop, run.bar or contextlib.nullcontext():
        while cfg.epochs is None or state.epoch < cfg.epochs:
            t_epoch, why = time.perf_counter(), run_epoch(run, state, stop)
            if dev.type == "cuda":  # the queued kernels belong to this epoch's training time
                torch.cuda.synchronize(dev)
            train_s = time.perf_counter() - t_epoch
            state.train_s += train_s
            end_of_epoch(run, state, train_s)
            # the other ranks wait here while rank 0 evaluates; a Ctrl-C meanwhile stops all of them
            flags = torch.tensor([float(why == "stop" or stop.requested)], dtype=torch.float64, device=dev)
            if distributed.sum_over_ranks(flags, run.place.world).item() > 0:
                if run.main:
                    run.say(
                        f"interrupted: saved {run.run_dir / LAST} at epoch {state.epoch}, batch "
                        f"{state.batch_in_epoch}; continue with --resume --run-dir {run.run_dir}"
                    )
                return True
            if why is not None:  # out of steps or of time
                break
    return False


def columns_multiple(dev: torch.device) -> int:
    """`make_batches`' `pad_to` on this device: 8 on a GPU (tensor cores; few shapes for CUDA graphs), 1 on
    the CPU, where every padded column is work for nothing (`docs/training.md`, "The step on real batches")."""
    return 8 if dev.type == "cuda" else 1


def run_epoch(run: Run, state: RunState, stop: StopFlag) -> str | None:
    """Train the rest of the current epoch. None when it is done, else why it stopped: "stop" (Ctrl-C),
    "steps" (max_steps reached) or "time" (max_minutes)."""
    cfg, place, learner = run.cfg, run.place, run.learner
    batches = data.make_batches(
        run.data.train_enc,
        cfg.max_tokens,
        shuffle=True,
        seed=cfg.seed + state.epoch,
        rank=place.rank,
        world_size=place.world,
        pad_to=columns_multiple(place.dev),
        max_len=cfg.max_len,
    )
    if place.dev.type == "cuda":  # page-locked, so each batch's copy to the GPU is queued, not waited for
        batches = [b.pin_memory() for b in batches]
    tokens = step_tokens(batches, cfg.accum, place.world, place.dev)  # N of each step: its batches on all ranks
    meter, run.tally = Meter(place.dev), EpochTally()
    learner.model_for_step.train()
    why = None
    while state.batch_in_epoch < len(batches):
        i = state.batch_in_epoch
        step_batches = batches[i : (i // cfg.accum + 1) * cfg.accum]
        meter.add(
            *train_step(
                learner.model_for_step,
                learner.opt,
                learner.sched,
                step_batches,
                tokens[i // cfg.accum],
                cfg,
                place.dev,
                place.world,
                learner.ddp,
                precision=run.arithmetic.precision,
            )
        )
        state.batch_in_epoch, state.step = i + len(step_batches), state.step + 1
        if run.bar is not None:
            run.bar.update(1)
        steps_done = cfg.max_steps is not None and state.step >= cfg.max_steps
        ask = place.world == 1 and (stop.requested or run.out_of_time())  # one process decides alone, at once
        if state.step % cfg.log_every == 0 or state.batch_in_epoch == len(batches) or steps_done or ask:
            why = log_point(run, state, meter, stop.requested, run.out_of_time()) or ("steps" if steps_done else None)
            if why:
                break
    if state.batch_in_epoch == len(batches):
        state.epoch, state.batch_in_epoch = state.epoch + 1, 0
    return why


TRAIN_TAGS = {
    "loss": "train/loss_per_token",
    "lr": "train/learning_rate",
    "grad_norm": "train/gradient_norm",
    "tokens_per_s": "train/tokens_per_second",
}  # tensorboard's name of each logged quantity


def log_point(run: Run, state: RunState, meter: Meter, asked: bool, late: bool) -> str | None:
    """Read the running sums (all ranks agree here), stop on a skipped step, log a row. "stop", "time" or None."""
    r = meter.read(run.place.world, asked, late)
    if r.skipped:
        what = (
            f"the loss became {r.first_skipped_loss}"
            if not math.isfinite(r.first_skipped_loss)
            else f"the gradient norm became {r.first_skipped_grad_norm}"
        )
        raise TrainingError(
            f"{what} at step {state.step - int(r.steps) + int(r.first_skipped_step)} (epoch "
            f"{state.epoch + 1}); {int(r.skipped)} step(s) with a non-finite loss or gradient were "
            f"skipped; stopped at step {state.step}, the last good checkpoint "
            f"{run.run_dir / LAST} is kept"
        )
    tally = run.tally
    tally.loss, tally.tokens = tally.loss + r.loss, tally.tokens + r.tokens
    seconds, tally.t_read = time.perf_counter() - tally.t_read, time.perf_counter()
    if run.main:
        mean, lr, tok_s = r.loss / max(r.tokens, 1), run.learner.sched.get_last_lr()[0], r.tokens / max(seconds, 1e-9)
        with open(run.run_dir / "train_loss.tsv", "a") as f:  # one row per read, for plots and tests
            f.write(f"{state.step}\t{mean:.8f}\n")
        values = {"loss": mean, "lr": lr, "grad_norm": r.grad_norm / max(r.steps, 1), "tokens_per_s": tok_s}
        for key, value in values.items():
            run.writer.add_scalar(TRAIN_TAGS[key], value, state.step)
        if run.bar is not None:
            run.bar.set_postfix(loss=f"{mean:.3f}", tok_s=f"{tok_s:,.0f}", lr=f"{lr:.2e}")
    return "stop" if r.ranks_stopping else "time" if r.ranks_out_of_time else None


def step_tokens(batches, accum: int, world: int = 1, device: torch.device = torch.device("cpu")) -> list[int]:
    """N of each optimizer step of an epoch: the target tokens of its `accum` batches, summed over all ranks.

    >>> from annotated.training.data import collate
    >>> batches = [collate([([5], [6] * n)], [0]) for n in (3, 1, 4)]  # n target ids + eos each
    >>> step_tokens(batches, accum=2)
    [6, 5]
    """
    local = [sum(b.ntokens for b in batches[i : i + accum]) for i in range(0, len(batches), accum)]
    if world == 1 or not local:
        return local
    total = distributed.sum_over_ranks(torch.tensor(local, dtype=torch.float64, device=device), world)
    return [int(n) for n in total.cpu().tolist()]


# %% [markdown]
# ## Setting a run up


# %%
def prepare_data(cfg: TrainConfig, source: DataSource):
    """Load the three splits (Multi30k or the user's files) and the tokenizer trained on train only."""

    def load(split, files):
        if files:
            return data.read_parallel(*files, empty=source.empty_lines)
        return data.load_multi30k(
            split, cfg.src_lang, cfg.tgt_lang, cache_dir=source.cache_dir, base_url=source.data_url
        )

    train_pairs = load("train", source.train_files)
    if cfg.train_limit:
        train_pairs = train_pairs[: cfg.train_limit]
    train_pairs = data.case_augmented(train_pairs, cfg.case_augment, cfg.seed)
    val_pairs, test_pairs = load("val", source.val_files), load("test_2016_flickr", source.test_files)
    if cfg.test_sentences:
        test_pairs = test_pairs[: cfg.test_sentences]
    texts = [s for s, _ in train_pairs] + [t for _, t in train_pairs]
    tokenizer = data.train_tokenizer(texts, cfg.vocab_size, cache_dir=source.cache_dir)
    return tokenizer, train_pairs, val_pairs, test_pairs


def load_run_data(cfg: TrainConfig, source: DataSource, place: Placement, say: Callable[[str], None]) -> RunData:
    """The splits, encoded; the training pairs longer than max_len left out (and counted in the log)."""
    tokenizer, train_pairs, val_pairs, test_pairs = distributed.from_rank0(  # the same data on every rank
        lambda: prepare_data(cfg, source), place.rank, place.world
    )
    train_enc = data.encode_pairs(train_pairs, tokenizer)
    kept, too_long = data.split_long(train_enc, cfg.max_len)
    if too_long and place.rank == 0:
        say(
            f"note: {len(too_long)} of {len(train_enc)} training pairs are longer than max_len={cfg.max_len} "
            f"subwords and are left out of training (rule: long pairs are skipped, never truncated)"
        )
    val_enc = data.encode_pairs(val_pairs, tokenizer)
    val_batches = data.make_batches(
        [val_enc[i] for i in data.split_long(val_enc, cfg.max_len)[0]],
        cfg.max_tokens,
        pad_to=columns_multiple(place.dev),
        max_len=cfg.max_len,
    )
    return RunData(
        tokenizer,
        [train_enc[i] for i in kept],
        val_batches,
        val_pairs,
        test_pairs,
        casing.case_table(s for s, _ in train_pairs),
    )


def setup(
    cfg: TrainConfig,
    run_dir: Path,
    *,
    place: Placement,
    arithmetic: Arithmetic,
    resume: bool,
    source: DataSource,
    say: Callable[[str], None],
) -> tuple[Run, RunState]:
    """Data, model, optimizer and state (resumed or new) of a run."""
    main, dev = place.rank == 0, place.dev
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if main:  # the other ranks never touch the run directory
        run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    run_data = load_run_data(cfg, source, place, say)
    tokenizer = run_data.tokenizer
    model = make_model(cfg.model_for(tokenizer.vocab_size)).to(dev)
    opt, sched = make_optimizer(model, cfg)
    state = RunState()
    if resume:  # rank 0 reads last.pt and sends it to the others
        state = resume_state(
            run_dir / LAST,
            cfg,
            model,
            opt,
            sched,
            tokenizer,
            read=lambda path: distributed.from_rank0(lambda: read_checkpoint(path), place.rank, place.world),
        )
        if state.world_size != place.world:  # keep the number of batches done over all ranks (distributed.py)
            if main:
                say(f"note: last.pt was written by {state.world_size} process(es), this run has {place.world}")
            state.batch_in_epoch = state.batch_in_epoch * state.world_size // place.world
        if main:
            truncate_log(run_dir / "train_loss.tsv", state.step)
            say(f"resumed {run_dir / LAST} at epoch {state.epoch}, batch {state.batch_in_epoch}, step {state.step}")
    state.world_size = place.world
    ddp = distributed.wrap(model, dev) if place.world > 1 else None
    model_for_step = ddp or model
    if cfg.compile:  # CUDA graphs on a GPU (batches come in few shapes); inductor's default on the CPU
        model_for_step = cast(
            torch.nn.Module,
            torch.compile(model_for_step, dynamic=True, mode="reduce-overhead" if dev.type == "cuda" else None),
        )
    meta = {"src_lang": cfg.src_lang, "tgt_lang": cfg.tgt_lang, "train_config": config_dict(cfg)}
    run = Run(cfg, run_dir, place, arithmetic, Learner(model, model_for_step, opt, sched, ddp), run_data, meta, say)
    if main:
        from torch.utils.tensorboard import SummaryWriter

        run.writer = SummaryWriter(log_dir=str(run_dir / "tb"))
        atomic_write(run_dir / CONFIG, json.dumps(config_dict(cfg), indent=2))
        say(
            f"run {run_dir}: {len(run_data.train_enc)} training pairs, vocab {tokenizer.vocab_size}, "
            f"{sum(p.numel() for p in model.parameters()):,} parameters, device {dev}, world size {place.world}, "
            f"precision {arithmetic.precision} ({arithmetic.reason}), "
            f"{arithmetic.threads} CPU thread{'' if arithmetic.threads == 1 else 's'}"
        )
    run.memory.phase_end("data", state.step, run.writer)  # the splits, the tokenizer and the model loaded
    return run, state


# %% [markdown]
# ## Checkpoints, epoch ends and resuming


# %%
def save_resumable(run: Run, state: RunState) -> None:
    """last.pt: everything needed to resume; then runs/latest points here (runs.point_latest)."""
    learner = run.learner
    save_checkpoint(
        run.run_dir / LAST,
        learner.model,
        run.data.tokenizer,
        run.meta,
        casing=run.data.case_table,
        optimizer=learner.opt.state_dict(),
        scheduler=learner.sched.state_dict(),
        rng=rng_state(),
        run_state=dataclasses.asdict(state),
    )
    point_latest(run.run_dir)  # the run has a checkpoint now


VALIDATION_TAGS = {
    "val_loss": "validation/loss_per_token",
    "val_bleu": "validation/bleu_greedy",
    "val_chrf": "validation/chrf_greedy",
    "train_s": "time/epoch_training_seconds",
    "eval_s": "time/epoch_validation_seconds",
}


def end_of_epoch(run: Run, state: RunState, train_s: float) -> None:
    """Rank 0: validate, checkpoint and log a finished epoch; a run stopped mid-epoch only saves last.pt."""
    cfg, model, dev, tokenizer = run.cfg, run.learner.model, run.place.dev, run.data.tokenizer
    trained = run.memory.phase_end("training", state.step, run.writer)  # the epoch's steps (memory.py)
    if not run.main:
        return
    if state.batch_in_epoch:  # interrupted or out of budget mid-epoch: just make it resumable
        save_resumable(run, state)
        return
    t_eval = time.perf_counter()
    rng = rng_state()  # evaluation must not change the training's random stream
    val_loss = evaluate_loss(model, run.data.val_batches, cfg.label_smoothing, dev, run.arithmetic.precision)
    subset = run.data.val_pairs[: cfg.val_bleu_sentences] if cfg.val_bleu_sentences else run.data.val_pairs
    val, _ = evaluate_bleu(model, tokenizer, subset, beam_size=1, length_penalty=0.0, device=dev)
    if run.alignment_image is not None:  # the first val sentence's alignment, in tensorboard
        with contextlib.suppress(ValueError):  # (an empty or over-long first sentence: no picture)
            run.alignment_image(run.writer, model, tokenizer, run.data.val_pairs[0][0], state.step)
    set_rng_state(rng)
    model.train()
    validated = run.memory.phase_end("validation", state.step, run.writer)
    train_loss = run.tally.loss / max(run.tally.tokens, 1)
    record = {
        "epoch": state.epoch,
        "step": state.step,
        "train_loss": round(train_loss, 4),
        "val_loss": round(val_loss, 4),
        "val_bleu": val["bleu"],
        "val_chrf": val["chrf"],
        "lr": run.learner.sched.get_last_lr()[0],
        "train_s": round(train_s, 2),
        "tokens_per_s": round(run.tally.tokens / max(train_s, 1e-9)),
        "eval_s": round(time.perf_counter() - t_eval, 2),
    }  # validation loss, BLEU and the picture
    state.history.append(record)
    for key, tag in VALIDATION_TAGS.items():
        run.writer.add_scalar(tag, record[key], state.step)
    run.writer.flush()
    improved = val["bleu"] > state.best_bleu
    state.best_bleu = max(state.best_bleu, val["bleu"])
    for name in ([BEST] if improved else []) + ([epoch_file(state.epoch)] if cfg.average_last else []):
        save_checkpoint(run.run_dir / name, model, tokenizer, dict(run.meta, **record), casing=run.data.case_table)
    if cfg.average_last:
        with contextlib.suppress(FileNotFoundError):
            (run.run_dir / epoch_file(state.epoch - cfg.average_last)).unlink()
    save_resumable(run, state)
    run.say(
        f"epoch {state.epoch:3d} step {state.step:6d}  train loss {train_loss:.3f}  val loss {val_loss:.3f}  "
        f"val BLEU {val['bleu']:5.2f} (greedy, {val['sentences']} sentences)  chrF {val['chrf']:5.2f}"
        f"{'  *best*' if improved else ''}  [train {record['train_s']:.1f} s, {record['tokens_per_s']:,} "
        f"tok/s; eval {record['eval_s']:.1f} s]  [memory {trained['resident_mb']:,} MB after the steps, "
        f"{validated['resident_mb']:,} MB after validation, peak {validated['peak_mb']:,} MB]"
    )
