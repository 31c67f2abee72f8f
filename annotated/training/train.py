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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import Tensor

from annotated.training import data
from annotated.training import distributed
from annotated.plumbing.checkpoint import CheckpointError, read_checkpoint, save_checkpoint  # noqa: F401 (T.CheckpointError)
from annotated.plumbing.interrupts import StopFlag
from annotated.training.evaluate import evaluate_bleu, finish, score  # noqa: F401 (score: scoring lives in evaluate.py)
from annotated.plumbing.files import atomic_write
from annotated.training.runs import (RunState, TrainingError, check_run_dir, log_line, point_latest, resume_state,
                            rng_state, set_rng_state, truncate_log)
from annotated.tokens import PAD
from annotated.transformer import EncoderDecoder, make_model, padding_mask, rate, target_mask

# %% [markdown]
# ## Presets
#
# One dataclass holds every setting. A preset is defined by its number of
# optimizer steps, `max_steps`, never by wall time: the same command gives the
# same model on an idle and on a busy machine, on a CPU or a GPU.
# `max_minutes` stays available as an optional cap.
#
# * `cpu`: 2 + 2 layers, `d_model` 128, a joint vocabulary of 5,000 subwords,
#   batches of 2500 tokens, 2,200 steps (about 10.5 epochs of Multi30k) with 800
#   warm-up steps to a peak learning rate twice the paper's formula. Small
#   enough to train on two CPU cores.
# * `gpu`: the same model and schedule with batches of 8192 tokens (3.3 times
#   the data per step), 4,200 steps (about 65 epochs), beam 5, and the
#   average of the last 5 epoch checkpoints. A model this small is bound by
#   kernel launches more than by arithmetic on a GPU, so a bigger batch costs
#   little per step; the step never waits for the host (below), and batches of
#   few shapes (`data.make_batches`) let `--compile` replay CUDA graphs.
# * `smoke`: a few seconds, a few hundred sentences; for the tests.
#
# Embeddings are tied by default: one joint sentencepiece vocabulary, one
# table shared by the encoder, the decoder and the generator (section 3.4).

# %%
@dataclass(frozen=True)
class TrainConfig:
    # data
    src_lang: str = "de"
    tgt_lang: str = "en"
    vocab_size: int = 8000          # joint sentencepiece vocabulary
    train_limit: Optional[int] = None  # use only the first n training pairs (smoke tests)
    # model (see TransformerConfig)
    N: int = 3
    d_model: int = 256
    d_ff: int = 1024
    h: int = 8
    dropout: float = 0.1
    attention: str = "fused"
    norm: str = "post"
    tie_embeddings: bool = True
    max_len: int = 256               # longest subword sequence the model accepts
    # optimisation
    max_tokens: int = 4096           # tokens per batch (source or target, whichever is larger, before padding)
    accum: int = 1                   # batches per optimizer step
    max_steps: Optional[int] = None  # optimizer steps of the run (in total); the budget that defines a preset
    epochs: Optional[int] = 20       # an upper bound on epochs (None: max_steps alone decides)
    max_minutes: Optional[float] = None  # an optional cap on training wall time (checked between steps)
    warmup: int = 2000
    lr_factor: float = 1.0
    label_smoothing: float = 0.1
    clip_norm: Optional[float] = 1.0
    log_every: int = 50              # steps between two reads of the running loss (the only host syncs)
    # evaluation
    beam_size: int = 4
    length_penalty: float = 0.6
    val_bleu_sentences: Optional[int] = None  # translate only the first n val sentences each epoch
    test_sentences: Optional[int] = None      # score only the first n test sentences (smoke runs)
    average_last: int = 0            # average the last n epoch checkpoints at the end
    # hardware / reproducibility
    compile: bool = False
    seed: int = 0

    def __post_init__(self):
        langs = ("en", "de", "fr", "cs")
        if self.src_lang not in langs or self.tgt_lang not in langs or self.src_lang == self.tgt_lang:
            raise ValueError(f"src_lang and tgt_lang must be two different languages of {langs}, "
                             f"got {self.src_lang!r} -> {self.tgt_lang!r}")
        if not 0 <= self.label_smoothing < 1:
            raise ValueError(f"label_smoothing must be in [0, 1), got {self.label_smoothing}")
        if min(self.max_tokens, self.accum, self.log_every, self.beam_size) < 1 or self.vocab_size < 8:
            raise ValueError(f"max_tokens, accum, log_every, beam_size must be >= 1 and vocab_size >= 8: {self}")
        for name in ("max_steps", "epochs", "val_bleu_sentences", "test_sentences"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (or None), got {getattr(self, name)}")
        if self.max_steps is None and self.epochs is None:
            raise ValueError("a run needs a budget: max_steps (or epochs)")
        if self.max_minutes is not None and not (math.isfinite(self.max_minutes) and self.max_minutes > 0):
            raise ValueError(f"max_minutes must be a positive number (or None), got {self.max_minutes}")
        if min(self.N, self.d_model, self.d_ff, self.h, self.warmup) < 1 or self.d_model % self.h:
            raise ValueError(f"N, d_model, d_ff, h and warmup must be >= 1 and d_model divisible by h "
                             f"(d_k = d_model / h), got N={self.N}, d_model={self.d_model}, d_ff={self.d_ff}, "
                             f"h={self.h}, warmup={self.warmup}")
        if not 0 <= self.dropout < 1 or not self.lr_factor > 0:
            raise ValueError(f"dropout must be in [0, 1) and lr_factor > 0, got dropout={self.dropout}, "
                             f"lr_factor={self.lr_factor}")

    def model_config(self, vocab: int) -> dict:
        return dict(src_vocab=vocab, tgt_vocab=vocab, N=self.N, d_model=self.d_model, d_ff=self.d_ff, h=self.h,
                    dropout=self.dropout, max_len=self.max_len, norm=self.norm, attention=self.attention,
                    share_embeddings=self.tie_embeddings, tie_generator=self.tie_embeddings)


_CPU = TrainConfig(N=2, d_model=128, d_ff=512, h=4, dropout=0.1, vocab_size=5000, max_tokens=2500, epochs=None,
                   max_steps=2200, warmup=800, lr_factor=2.0, beam_size=4, val_bleu_sentences=300)
PRESETS = {
    "gpu": dataclasses.replace(_CPU, max_tokens=8192, max_steps=4200, beam_size=5, average_last=5,
                               val_bleu_sentences=None),
    "cpu": _CPU,
    "smoke": TrainConfig(N=1, d_model=32, d_ff=64, h=2, dropout=0.0, vocab_size=500, max_tokens=800,
                         epochs=None, max_steps=28, warmup=20, train_limit=300, beam_size=2,
                         val_bleu_sentences=20, test_sentences=20, max_len=64),  # 28 steps: 2 epochs of 14
}

# %% [markdown]
# ## Label smoothing
#
# Instead of the one-hot target, the model is trained towards a slightly
# flattened distribution: with smoothing `eps` and a vocabulary of `V` tokens,
#
# $$q(k) = (1 - \epsilon)\,[k = y] + \frac{\epsilon}{V}$$
#
# so the loss for one position is the cross-entropy
# $-\sum_k q(k) \log p(k) = -(1-\epsilon) \log p(y) - \frac{\epsilon}{V} \sum_k \log p(k)$.
# It hurts perplexity (the model learns to be unsure) but improves BLEU
# (section 5.4). Padding positions contribute nothing. This is the same
# definition as `F.cross_entropy(..., label_smoothing=eps)`
# (`test_label_smoothing_matches_formula`).

# %%
def smoothed_targets(target: Tensor, vocab: int, eps: float) -> Tensor:
    """The distribution q above, one row per target id: (n,) -> (n, V)."""
    q = torch.full((target.numel(), vocab), eps / vocab)  # (n, V)
    q[torch.arange(target.numel()), target.reshape(-1)] += 1 - eps
    return q


def label_smoothed_loss(logits: Tensor, target: Tensor, eps: float, pad: int = PAD) -> Tensor:
    """Sum over non-pad positions of -sum_k q(k) log p(k). logits (B, T, V), target (B, T)."""
    logp = logits.float().log_softmax(dim=-1)  # (B, T, V)
    # -(1 - eps) log p(y) - eps/V sum_k log p(k)
    nll = -logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)  # (B, T)
    smooth = -logp.mean(dim=-1)  # (B, T)
    loss = (1 - eps) * nll + eps * smooth  # (B, T)
    return loss.masked_fill(target == pad, 0.0).sum()


# %% [markdown]
# ## One optimisation step
#
# A batch holds `src` (B, S) and `tgt` (B, T) = `bos y_1 ... y_n eos pad...`.
# Teacher forcing feeds `tgt[:, :-1]` and predicts `tgt[:, 1:]`. The loss is
# summed over predicted tokens and divided by their number, so long and short
# batches weigh each token equally. The learning rate follows `rate()` from
# the first chapter.

# %%
def batch_loss(model: EncoderDecoder, src: Tensor, tgt: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(summed loss, number of predicted tokens), both 0-d tensors on the batch's device (nothing is read)."""
    tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]  # (B, T-1), (B, T-1)
    logits = model(src, tgt_in, padding_mask(src, PAD), target_mask(tgt_in, PAD))  # (B, T-1, V)
    return label_smoothed_loss(logits, tgt_out, eps), (tgt_out != PAD).sum()


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig):
    """Adam as in the paper, fused (one kernel for all parameters; it can skip a step on the device, below)."""
    opt = torch.optim.Adam(model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: rate(s + 1, cfg.d_model, cfg.warmup, cfg.lr_factor))
    return opt, sched


def autocast_for(device: torch.device):
    """bf16 autocast on CUDA; nothing on the CPU (fp32 is exact and fast enough there)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def pick_device(name: Optional[str] = None) -> torch.device:
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


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
#   host memory, so that each batch's copy to the GPU (`non_blocking=True`)
#   is queued like a kernel; from ordinary memory CUDA first waits for the
#   GPU's queue to drain;
# * token-id checks live where ids are made (data, translator input), not in
#   the model.
#
# `tests/training/test_train_syncs.py` counts the synchronising operators a run of
# steps dispatches (`annotated/training/syncs.py`): none between two reads.

# %%
def train_step(model: torch.nn.Module, opt, sched, batches, n_tokens: int, cfg: TrainConfig,
               dev: torch.device, world: int = 1, ddp=None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One optimizer step over `batches` (up to `accum` of them, `n_tokens` predicted tokens over all ranks).
    Returns (summed loss, tokens, gradient norm, found_inf), device tensors that nobody reads here."""
    loss_sum, tokens = torch.zeros((), device=dev), torch.zeros((), dtype=torch.long, device=dev)
    for j, b in enumerate(batches):
        # DDP averages the gradients in the backward pass of the step's last batch only
        sync = ddp is None or j == len(batches) - 1
        with (contextlib.nullcontext() if sync else ddp.no_sync()), autocast_for(dev):
            loss, n = batch_loss(model, b.src.to(dev, non_blocking=True), b.tgt.to(dev, non_blocking=True),
                                 cfg.label_smoothing)
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

    def __init__(self, dev: torch.device):
        self.sums = torch.zeros(8, dtype=torch.float64, device=dev)  # (8,)

    def add(self, loss: Tensor, tokens: Tensor, gnorm: Tensor, found_inf: Tensor) -> None:
        s = self.sums
        first = (found_inf > 0) & (s[4] == 0)  # (): the first skipped step since the last read
        row = torch.stack([loss.double(), tokens.double(), gnorm.double(), torch.ones_like(s[0]),
                           found_inf.double(), s[3] + 1, loss.double(), gnorm.double()])  # (8,)
        s[:5] += row[:5]
        s[5:] = torch.where(first, row[5:], s[5:])

    def read(self, world: int, *flags: bool) -> list[float]:
        """The sums (over all ranks) and the sum of each flag over the ranks; then zero. The one sync."""
        extra = torch.tensor([float(f) for f in flags], dtype=torch.float64)  # (F,)
        values = distributed.sum_over_ranks(torch.cat([self.sums, extra.to(self.sums.device)]), world)
        out = values.cpu().tolist()
        self.sums.zero_()
        for k in (2, 3, 4, 5, 7):  # the same on every rank (from the all-reduced gradient): not a sum
            out[k] /= world
        return out


# %% [markdown]
# ## Validation loss

# %%
@torch.no_grad()
def evaluate_loss(model: EncoderDecoder, batches, eps: float, device: torch.device) -> float:
    """Label-smoothed loss per predicted token over all batches."""
    model.eval()
    total, tokens = torch.zeros((), dtype=torch.float64, device=device), 0
    for b in batches:
        with autocast_for(device):
            loss, _ = batch_loss(model, b.src.to(device), b.tgt.to(device), eps)
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
# * `last.pt`: everything needed to resume (model, optimizer, scheduler,
#   random-number states, position in the epoch);
# * `best.pt`: the model with the best validation BLEU so far;
# * `epoch{n}.pt`: kept only when `average_last` asks for checkpoint averaging.
#
# All of them are written atomically (`annotated/plumbing/files.py`). Ctrl-C finishes
# the current step, writes `last.pt` and stops (a second Ctrl-C stops at
# once); `--resume` continues from there, first cutting `train_loss.tsv`
# back to the checkpoint's step. A non-finite step stops the run at the next
# read, without writing a checkpoint.
#
# The run folder, its logs and the checkpoints' bookkeeping are the next
# chapter's (`annotated/training/runs.py`); translating and scoring, `annotated/training/evaluate.py`.
#
# With several processes (`torchrun`), each rank trains on its own share of
# every epoch's batches and DistributedDataParallel averages the gradients;
# only rank 0 evaluates, logs and writes files (`annotated/training/distributed.py`).

# %%
@dataclass
class Run:
    """What every part of the loop needs: the settings, the model and its optimizer, data, and where to write."""
    cfg: TrainConfig
    run_dir: Path
    model: EncoderDecoder             # the plain model (checkpoints, evaluation)
    model_for_step: torch.nn.Module   # what the step calls: the model, or DDP / torch.compile around it
    opt: torch.optim.Optimizer
    sched: object
    dev: torch.device
    tokenizer: object
    train_enc: list
    val_batches: list
    val_pairs: list
    meta: dict
    say: Callable[[str], None]
    rank: int = 0
    world: int = 1
    ddp: object = None
    writer: object = None
    bar: object = None
    t_start: float = field(default_factory=time.perf_counter)
    epoch_loss: float = 0.0           # this epoch's summed loss and tokens, as read at its log points
    epoch_tokens: float = 0.0
    t_read: float = 0.0               # when the running sums were last read (tokens/s between reads)

    @property
    def main(self) -> bool:
        return self.rank == 0

    def out_of_time(self) -> bool:
        return self.cfg.max_minutes is not None and time.perf_counter() - self.t_start > 60 * self.cfg.max_minutes


def train(cfg: TrainConfig, run_dir: Path, *, data_url: Optional[str] = None, cache_dir: Optional[Path] = None,
          device: Optional[str] = None, resume: bool = False, progress: bool = True,
          train_files=None, val_files=None, test_files=None, empty_lines: str = "error",
          log: Callable[[str], None] | None = None) -> dict:
    """Train (or resume) a run in `run_dir`; returns the final results (also in results.json)."""
    rank, world, dev, owns_group = distributed.join(pick_device(device))
    run_dir, run = Path(run_dir), None
    try:
        distributed.from_rank0(lambda: check_run_dir(run_dir, resume), rank, world)  # before any work
        run, state, test_pairs = setup(cfg, run_dir, rank, world, dev, resume, data_url, cache_dir, log,
                                       (train_files, val_files, test_files), empty_lines)
        stopped = loop(run, state, progress)
    finally:
        if run is not None and run.writer is not None:
            run.writer.close()
        if owns_group:  # all ranks leave the loop at the same agreed point; rank 0 goes on alone
            distributed.leave()
    if stopped:
        return {"interrupted": True, "run_dir": str(run_dir)}
    if not run.main:
        return {}
    return finish(cfg, run_dir, run.tokenizer, test_pairs, dev, run.say, progress, test_files)


def loop(run: Run, state: RunState, progress: bool) -> bool:
    """Epochs until the budget is spent; True when a Ctrl-C stopped the run."""
    cfg = run.cfg
    if progress and run.main:  # one bar over the run's steps, with an ETA
        from tqdm.auto import tqdm
        run.bar = tqdm(total=cfg.max_steps, initial=state.step, unit="step", dynamic_ncols=True)
    with StopFlag() as stop, (run.bar or contextlib.nullcontext()):
        while cfg.epochs is None or state.epoch < cfg.epochs:
            t_epoch, why = time.perf_counter(), run_epoch(run, state, stop)
            if run.dev.type == "cuda":  # the queued kernels belong to this epoch's training time
                torch.cuda.synchronize(run.dev)
            train_s = time.perf_counter() - t_epoch
            state.train_s += train_s
            end_of_epoch(run, state, train_s)
            # the other ranks wait here while rank 0 evaluates; a Ctrl-C meanwhile stops all of them
            flags = torch.tensor([float(why == "stop" or stop.requested)], dtype=torch.float64, device=run.dev)
            if distributed.sum_over_ranks(flags, run.world).item() > 0:
                if run.main:
                    run.say(f"interrupted: saved {run.run_dir / 'last.pt'} at epoch {state.epoch}, batch "
                            f"{state.batch_in_epoch}; continue with --resume --run-dir {run.run_dir}")
                return True
            if why is not None:  # out of steps or of time
                break
    return False


def run_epoch(run: Run, state: RunState, stop: StopFlag) -> Optional[str]:
    """Train the rest of the current epoch. None when it is done, else why it stopped: "stop" (Ctrl-C),
    "steps" (max_steps reached) or "time" (max_minutes)."""
    cfg = run.cfg
    batches = data.make_batches(run.train_enc, cfg.max_tokens, shuffle=True, seed=cfg.seed + state.epoch,
                                rank=run.rank, world_size=run.world, max_len=cfg.max_len)
    if run.dev.type == "cuda":  # page-locked, so each batch's copy to the GPU is queued, not waited for
        batches = [b.pin_memory() for b in batches]
    tokens = step_tokens(batches, cfg.accum, run.world, run.dev)  # N of each step: its batches on all ranks
    meter, run.epoch_loss, run.epoch_tokens, run.t_read = Meter(run.dev), 0.0, 0.0, time.perf_counter()
    run.model_for_step.train()
    why = None
    while state.batch_in_epoch < len(batches):
        i = state.batch_in_epoch
        step_batches = batches[i:(i // cfg.accum + 1) * cfg.accum]
        meter.add(*train_step(run.model_for_step, run.opt, run.sched, step_batches, tokens[i // cfg.accum],
                              cfg, run.dev, run.world, run.ddp))
        state.batch_in_epoch, state.step = i + len(step_batches), state.step + 1
        if run.bar is not None:
            run.bar.update(1)
        steps_done = cfg.max_steps is not None and state.step >= cfg.max_steps
        ask = run.world == 1 and (stop.requested or run.out_of_time())  # one process decides alone, at once
        if state.step % cfg.log_every == 0 or state.batch_in_epoch == len(batches) or steps_done or ask:
            why = log_point(run, state, meter, stop.requested, run.out_of_time()) or ("steps" if steps_done else None)
            if why:
                break
    if state.batch_in_epoch == len(batches):
        state.epoch, state.batch_in_epoch = state.epoch + 1, 0
    return why


def log_point(run: Run, state: RunState, meter: Meter, asked: bool, late: bool) -> Optional[str]:
    """Read the running sums (all ranks agree here), stop on a skipped step, log a row. "stop", "time" or None."""
    loss, tokens, gnorm, steps, skipped, bad_step, bad_loss, bad_gnorm, asked_n, late_n = meter.read(
        run.world, asked, late)
    if skipped:
        what = (f"the loss became {bad_loss}" if not math.isfinite(bad_loss) else
                f"the gradient norm became {bad_gnorm}")
        raise TrainingError(f"{what} at step {state.step - int(steps) + int(bad_step)} (epoch {state.epoch + 1}); "
                            f"{int(skipped)} step(s) with a non-finite loss or gradient were skipped; stopped at "
                            f"step {state.step}, the last good checkpoint {run.run_dir / 'last.pt'} is kept")
    run.epoch_loss, run.epoch_tokens = run.epoch_loss + loss, run.epoch_tokens + tokens
    seconds, run.t_read = time.perf_counter() - run.t_read, time.perf_counter()
    if run.main:
        mean, lr, tok_s = loss / max(tokens, 1), run.sched.get_last_lr()[0], tokens / max(seconds, 1e-9)
        with open(run.run_dir / "train_loss.tsv", "a") as f:  # one row per read, for plots and tests
            f.write(f"{state.step}\t{mean:.8f}\n")
        for key, value in (("loss", mean), ("lr", lr), ("grad_norm", gnorm / max(steps, 1)),
                           ("tokens_per_s", tok_s)):
            run.writer.add_scalar(f"train/{key}", value, state.step)
        if run.bar is not None:
            run.bar.set_postfix(loss=f"{mean:.3f}", tok_s=f"{tok_s:,.0f}", lr=f"{lr:.2e}")
    return "stop" if asked_n else "time" if late_n else None


def step_tokens(batches, accum: int, world: int = 1, device: torch.device = torch.device("cpu")) -> list[int]:
    """N of each optimizer step of an epoch: the target tokens of its `accum` batches, summed over all ranks.

    >>> from annotated.training.data import collate
    >>> batches = [collate([([5], [6] * n)], [0]) for n in (3, 1, 4)]  # n target ids + eos each
    >>> step_tokens(batches, accum=2)
    [6, 5]
    """
    local = [sum(b.ntokens for b in batches[i:i + accum]) for i in range(0, len(batches), accum)]
    if world == 1 or not local:
        return local
    total = distributed.sum_over_ranks(torch.tensor(local, dtype=torch.float64, device=device), world)
    return [int(n) for n in total.cpu().tolist()]


# %% [markdown]
# ## Setting a run up

# %%
def prepare_data(cfg: TrainConfig, cache_dir: Optional[Path], data_url: Optional[str],
                 train_files: Optional[tuple[str, str]] = None, val_files=None, test_files=None,
                 empty_lines: str = "error"):
    """Load the three splits (Multi30k or the user's files) and the tokenizer trained on train only.

    `empty_lines` is `read_parallel`'s rule for the user's pairs with an empty side: error, skip or keep.
    """
    def load(split, files):
        if files:
            return data.read_parallel(*files, empty=empty_lines)
        return data.load_multi30k(split, cfg.src_lang, cfg.tgt_lang, cache_dir=cache_dir, base_url=data_url)

    train_pairs = load("train", train_files)
    if cfg.train_limit:
        train_pairs = train_pairs[:cfg.train_limit]
    val_pairs, test_pairs = load("val", val_files), load("test_2016_flickr", test_files)
    if cfg.test_sentences:
        test_pairs = test_pairs[:cfg.test_sentences]
    texts = [s for s, _ in train_pairs] + [t for _, t in train_pairs]
    tokenizer = data.train_tokenizer(texts, cfg.vocab_size, cache_dir=cache_dir)
    return tokenizer, train_pairs, val_pairs, test_pairs


def setup(cfg, run_dir, rank, world, dev, resume, data_url, cache_dir, log, files, empty_lines):
    """Data, model, optimizer and state (resumed or new) of a run: (Run, RunState, test pairs)."""
    main = rank == 0
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    say = log or (lambda s: log_line(run_dir, s))
    if main:  # the other ranks never touch the run directory
        run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    tokenizer, train_pairs, val_pairs, test_pairs = distributed.from_rank0(  # the same data on every rank
        lambda: prepare_data(cfg, cache_dir, data_url, *files, empty_lines), rank, world)
    train_enc = data.encode_pairs(train_pairs, tokenizer)
    kept, too_long = data.split_long(train_enc, cfg.max_len)
    if too_long and main:
        say(f"note: {len(too_long)} of {len(train_enc)} training pairs are longer than max_len={cfg.max_len} "
            f"subwords and are left out of training (rule: long pairs are skipped, never truncated)")
    val_enc = data.encode_pairs(val_pairs, tokenizer)
    val_batches = data.make_batches([val_enc[i] for i in data.split_long(val_enc, cfg.max_len)[0]],
                                    cfg.max_tokens, max_len=cfg.max_len)
    model = make_model(**cfg.model_config(tokenizer.vocab_size)).to(dev)
    opt, sched = make_optimizer(model, cfg)
    state = RunState()
    if resume:  # rank 0 reads last.pt and sends it to the others
        state = resume_state(run_dir / "last.pt", cfg, model, opt, sched, tokenizer,
                        read=lambda path: distributed.from_rank0(lambda: read_checkpoint(path), rank, world))
        if state.world_size != world:  # keep the number of batches done over all ranks (distributed.py)
            if main:
                say(f"note: last.pt was written by {state.world_size} process(es), this run has {world}")
            state.batch_in_epoch = state.batch_in_epoch * state.world_size // world
        if main:
            truncate_log(run_dir / "train_loss.tsv", state.step)
            say(f"resumed {run_dir / 'last.pt'} at epoch {state.epoch}, batch {state.batch_in_epoch}, "
                f"step {state.step}")
    state.world_size = world
    model_for_step = ddp = distributed.wrap(model, dev) if world > 1 else None
    model_for_step = model_for_step or model
    if cfg.compile:  # CUDA graphs on a GPU (batches come in few shapes); inductor's default on the CPU
        model_for_step = torch.compile(model_for_step, dynamic=True,
                                       mode="reduce-overhead" if dev.type == "cuda" else None)
    meta = {"src_lang": cfg.src_lang, "tgt_lang": cfg.tgt_lang, "train_config": dataclasses.asdict(cfg)}
    run = Run(cfg, run_dir, model, model_for_step, opt, sched, dev, tokenizer, [train_enc[i] for i in kept],
              val_batches, val_pairs, meta, say, rank, world, ddp)
    if main:
        from torch.utils.tensorboard import SummaryWriter
        run.writer = SummaryWriter(log_dir=str(run_dir / "tb"))
        atomic_write(run_dir / "config.json", json.dumps(dataclasses.asdict(cfg), indent=2))
        say(f"run {run_dir}: {len(run.train_enc)} training pairs, vocab {tokenizer.vocab_size}, "
            f"{sum(p.numel() for p in model.parameters()):,} parameters, device {dev}, world size {world}")
    return run, state, test_pairs


# %% [markdown]
# ## Checkpoints, epoch ends and resuming

# %%
def _save_last(run: Run, state: RunState) -> None:
    save_checkpoint(run.run_dir / "last.pt", run.model, run.tokenizer, run.meta, optimizer=run.opt.state_dict(),
                    scheduler=run.sched.state_dict(), rng=rng_state(), run_state=dataclasses.asdict(state))
    point_latest(run.run_dir)  # the run has a checkpoint now


def end_of_epoch(run: Run, state: RunState, train_s: float) -> None:
    """Rank 0: validate, checkpoint and log a finished epoch; a run stopped mid-epoch only saves last.pt."""
    cfg, model = run.cfg, run.model
    if not run.main:
        return
    if state.batch_in_epoch:  # interrupted or out of budget mid-epoch: just make it resumable
        _save_last(run, state)
        return
    t_eval = time.perf_counter()
    rng = rng_state()  # evaluation must not change the training's random stream
    val_loss = evaluate_loss(model, run.val_batches, cfg.label_smoothing, run.dev)
    subset = run.val_pairs[:cfg.val_bleu_sentences] if cfg.val_bleu_sentences else run.val_pairs
    val, _ = evaluate_bleu(model, run.tokenizer, subset, beam_size=1, length_penalty=0.0, device=run.dev)
    from annotated.attention.dump import log_alignment_image  # the first val sentence's alignment, in tensorboard
    with contextlib.suppress(ValueError):  # (an empty or over-long first sentence: no picture)
        log_alignment_image(run.writer, model, run.tokenizer, run.val_pairs[0][0], state.step)
    set_rng_state(rng)
    model.train()
    train_loss = run.epoch_loss / max(run.epoch_tokens, 1)
    record = {"epoch": state.epoch, "step": state.step, "train_loss": round(train_loss, 4),
              "val_loss": round(val_loss, 4), "val_bleu": val["bleu"], "val_chrf": val["chrf"],
              "lr": run.sched.get_last_lr()[0], "train_s": round(train_s, 2),
              "tokens_per_s": round(run.epoch_tokens / max(train_s, 1e-9)),
              "eval_s": round(time.perf_counter() - t_eval, 2)}  # validation loss, BLEU and the picture
    state.history.append(record)
    for key in ("val_loss", "val_bleu", "val_chrf", "train_s", "eval_s"):
        run.writer.add_scalar(key.replace("_", "/", 1), record[key], state.step)
    run.writer.flush()
    improved = val["bleu"] > state.best_bleu
    if improved:
        state.best_bleu = val["bleu"]
        save_checkpoint(run.run_dir / "best.pt", model, run.tokenizer, dict(run.meta, **record))
    if cfg.average_last:
        save_checkpoint(run.run_dir / f"epoch{state.epoch}.pt", model, run.tokenizer, dict(run.meta, **record))
        with contextlib.suppress(FileNotFoundError):
            (run.run_dir / f"epoch{state.epoch - cfg.average_last}.pt").unlink()
    _save_last(run, state)
    run.say(f"epoch {state.epoch:3d} step {state.step:6d}  train loss {train_loss:.3f}  val loss {val_loss:.3f}  "
            f"val BLEU {val['bleu']:5.2f} (greedy, {val['sentences']} sentences)  chrF {val['chrf']:5.2f}"
            f"{'  *best*' if improved else ''}  [train {record['train_s']:.1f} s, {record['tokens_per_s']:,} "
            f"tok/s; eval {record['eval_s']:.1f} s]")
