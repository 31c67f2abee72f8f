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
import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import Tensor

from annotated.checkpoint import (CheckpointError, atomic_torch_save, model_from_state, read_checkpoint,
                                  save_checkpoint)
from annotated import decoding
from annotated.transformer import PAD, EncoderDecoder, make_model, padding_mask, rate, target_mask

# %% [markdown]
# ## Presets
#
# One dataclass holds every setting. Three presets cover the usual cases:
#
# * `gpu`: one GPU, about 10 minutes; aims at >= 40 BLEU on test_2016_flickr.
#   It is the `cpu` recipe below (measured: 36.6 lowercased BLEU after 2,169
#   steps on two CPU cores) with batches of 8192 tokens instead of 2500, up to
#   9 minutes of training instead of 13, beam 5 and the average of the last 5
#   epochs. On a GPU a model this small should be bound by kernel launches
#   more than by arithmetic, so that a step of 8192 tokens costs little more
#   than one of 2500 and buys 3.3 times the data (expected, not measured). On
#   two CPU cores it learned faster per step than the `cpu` preset: greedy
#   validation BLEU 25.2 at step 390, against 19.2 at step 418 and 24.0 at
#   step 836. Not yet run on a GPU. The recipe it replaced, the published
#   "Transformer-tiny" baseline of multimodal MT (Wu et al., ACL 2021: 4 + 4
#   layers, `d_model` 128, dropout 0.3, warm-up 2000 steps to a peak learning
#   rate of 0.005, 8000 steps), ran on one H100 for 7 minutes: 2,940 steps,
#   18.7 lowercased BLEU de -> en; at step 840 its validation BLEU was 10.0,
#   where the `cpu` recipe's is 24.0 at step 836.
# * `cpu`: a smaller model that finishes in about 15 minutes on 2 cores and
#   still translates sensibly.
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
    max_tokens: int = 4096           # tokens per batch (padded, source or target, whichever is larger)
    accum: int = 1                   # batches per optimizer step
    epochs: int = 20
    max_minutes: Optional[float] = None  # stop training after this wall time (checked between steps)
    max_steps: Optional[int] = None      # stop training after this many optimizer steps (in total)
    warmup: int = 2000
    lr_factor: float = 1.0
    label_smoothing: float = 0.1
    clip_norm: Optional[float] = 1.0
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
        if self.max_tokens < 1 or self.accum < 1 or self.epochs < 1 or self.vocab_size < 8:
            raise ValueError(f"max_tokens, accum, epochs must be >= 1 and vocab_size >= 8: {self}")
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


PRESETS = {
    "gpu": TrainConfig(N=2, d_model=128, d_ff=512, h=4, dropout=0.1, vocab_size=5000, max_tokens=8192,
                       epochs=100, max_minutes=9.0, warmup=800, lr_factor=2.0, beam_size=5, average_last=5),
    "cpu": TrainConfig(N=2, d_model=128, d_ff=512, h=4, dropout=0.1, vocab_size=5000, max_tokens=2500,
                       epochs=30, max_minutes=13.0, warmup=800, lr_factor=2.0, beam_size=4,
                       val_bleu_sentences=300),
    "smoke": TrainConfig(N=1, d_model=32, d_ff=64, h=2, dropout=0.0, vocab_size=500, max_tokens=800,
                         epochs=2, warmup=20, train_limit=300, beam_size=2, val_bleu_sentences=20,
                         test_sentences=20, max_len=64),
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
def batch_loss(model: EncoderDecoder, src: Tensor, tgt: Tensor, eps: float) -> tuple[Tensor, int]:
    """(summed loss, number of predicted tokens) for one batch."""
    tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]  # (B, T-1), (B, T-1)
    logits = model(src, tgt_in, padding_mask(src, PAD), target_mask(tgt_in, PAD))  # (B, T-1, V)
    return label_smoothed_loss(logits, tgt_out, eps), int((tgt_out != PAD).sum())


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig):
    opt = torch.optim.Adam(model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
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
# ## Translating and scoring
#
# Sentences are translated in batches of similar length (fewer pad
# positions), then put back in their original order and detokenised by
# sentencepiece before scoring. BLEU and chrF come from sacreBLEU with its
# defaults (cased, `13a` tokenisation); we also report lowercased BLEU, the
# number most Multi30k papers quote. A source longer than the model's
# `max_len` is truncated to `max_len` subwords (the rule, stated once, and
# counted in the results).

# %%
def score(hypotheses: list[str], references: list[str]) -> dict:
    """sacreBLEU cased and lowercased BLEU, and chrF, with their signatures."""
    import sacrebleu

    bleu = sacrebleu.metrics.BLEU()
    bleu_lc = sacrebleu.metrics.BLEU(lowercase=True)
    chrf = sacrebleu.metrics.CHRF()
    b, bl, c = (m.corpus_score(hypotheses, [references]) for m in (bleu, bleu_lc, chrf))
    return {"bleu": round(b.score, 2), "bleu_lowercase": round(bl.score, 2), "chrf": round(c.score, 2),
            "signature": {"bleu": str(bleu.get_signature()), "bleu_lowercase": str(bleu_lc.get_signature()),
                          "chrf": str(chrf.get_signature())}}


def evaluate_bleu(model, tokenizer, pairs: list[tuple[str, str]], beam_size: int, length_penalty: float,
                  device=None, progress: bool = False) -> tuple[dict, list[str]]:
    sources = [tokenizer.encode(s) for s, _ in pairs]
    truncated = sum(len(s) > model.config.max_len for s in sources)
    hyp_ids = decoding.translate_ids(model, sources, beam_size, length_penalty, device=device, progress=progress)
    hyps = [tokenizer.decode(h) for h in hyp_ids]
    result = score(hyps, [t for _, t in pairs])
    result.update(sentences=len(pairs), truncated_sources=truncated, beam_size=beam_size)
    return result, hyps


@torch.no_grad()
def evaluate_loss(model: EncoderDecoder, batches, eps: float, device: torch.device) -> float:
    """Label-smoothed loss per predicted token over all batches."""
    model.eval()
    total, tokens = 0.0, 0
    for b in batches:
        with autocast_for(device):
            loss, n = batch_loss(model, b.src.to(device), b.tgt.to(device), eps)
        total, tokens = total + loss.item(), tokens + n
    return total / max(tokens, 1)


# %% [markdown]
# ## The training loop
#
# `train()` runs epochs of token-count batches (a new shuffle each epoch,
# seeded, so a resumed run sees the same batches), steps the optimizer every
# `accum` batches, and at each epoch end measures validation loss and BLEU,
# logs them (tqdm bar, tensorboard, one plain line), and writes checkpoints:
#
# * `last.pt`: everything needed to resume (model, optimizer, scheduler,
#   random-number states, position in the epoch);
# * `best.pt`: the model with the best validation BLEU so far;
# * `epoch{n}.pt`: kept only when `average_last` asks for checkpoint averaging.
#
# All of them are written atomically (see `annotated/checkpoint.py`). Ctrl-C
# finishes the current step, writes `last.pt` and stops; `--resume` continues
# from there. A loss that becomes NaN or infinite stops the run at the end of
# that step, before the update and without overwriting the last good
# checkpoint; with several processes every rank learns of it in the step's
# all-reduce and all of them stop there together.
#
# With several processes (`torchrun`), each rank trains on its own share of
# every epoch's batches and DistributedDataParallel averages the gradients;
# only rank 0 evaluates, logs and writes files (next section).

# %%
class TrainingError(RuntimeError):
    """A run that cannot go on (non-finite loss, incompatible resume)."""


@dataclass
class RunState:
    epoch: int = 0                # epochs completed
    batch_in_epoch: int = 0       # batches of the current epoch already trained
    step: int = 0                 # optimizer steps taken
    best_bleu: float = -1.0
    history: list = field(default_factory=list)
    world_size: int = 1           # processes of the run (batch_in_epoch counts the batches of each one)


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class _StopFlag:
    """Turns the first Ctrl-C (SIGINT) or SIGTERM into a request to stop after the current step."""

    def __init__(self):
        self.requested = False
        self._old = {}

    def __enter__(self):
        def handler(signum, frame):
            if self.requested:  # a second Ctrl-C: stop now
                raise KeyboardInterrupt
            self.requested = True
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, handler)
            except ValueError:  # not the main thread
                pass
        return self

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def average_checkpoints(paths: list[Path]) -> dict:
    """Element-wise mean of the model parameters of several checkpoints (same config)."""
    states = [read_checkpoint(p) for p in paths]
    base = dict(states[-1])
    base["model"] = {k: sum(s["model"][k].double() for s in states).div(len(states)).to(v.dtype)
                     for k, v in states[-1]["model"].items()}
    base["meta"] = dict(base.get("meta", {}), averaged=[str(p) for p in paths])
    for key in ("optimizer", "scheduler", "rng", "run_state"):
        base.pop(key, None)
    return base


# %% [markdown]
# ## Several processes: DistributedDataParallel
#
# `torchrun --nproc_per_node=W train_wmt.py ...` starts `W` copies of this
# program (one per GPU, or `W` CPU processes) and gives each its `RANK`,
# `LOCAL_RANK` and `WORLD_SIZE`. They join one process group (NCCL between
# GPUs, gloo between CPU processes; a process uses the GPU numbered by its
# `LOCAL_RANK` on its machine) and train one model together:
#
# * **Same data.** Rank 0 reads the data and trains the tokenizer; the others
#   receive both from it, so every rank batches the same examples with the
#   same vocabulary (and no other machine needs the data). Every rank builds
#   the epoch's batches from the same seed and keeps every `W`-th one
#   (`data.make_batches`), which also gives every rank the same number of
#   batches.
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
#   each step's `N`; rank `r` backpropagates `(W / N) sum_b L_b`, and DDP's
#   mean over the `W` ranks gives exactly `g`. So `W` processes take the step
#   one process takes on the union of their batches, and one process with
#   `accum = W` on the same batches computes the same gradient
#   (`test_each_step_applies_the_gradient_of_the_union_of_the_two_shards`,
#   `test_ddp_run_equals_single_process_with_accumulation`). Averaging the
#   batches' own means instead would weigh a token of a short batch more than
#   one of a long batch.
# * **Effective batch and learning rate.** A step consumes
#   `W * accum` batches of at most `max_tokens` tokens each, and the
#   learning-rate schedule counts steps. Keep `W * accum` fixed and the recipe
#   is unchanged: 4 GPUs with `accum = 1` train like 1 GPU with `accum = 4`,
#   only faster. With `W` times larger steps and nothing else changed, an
#   epoch has `W` times fewer steps, so the warm-up lasts `W` times more
#   examples; nothing is rescaled automatically.
# * **Rank 0 alone** logs, writes tensorboard, evaluates BLEU and writes the
#   checkpoints, from the unwrapped model (no DDP `module.` prefix), so a
#   checkpoint of a `W`-process run is an ordinary one: it loads, translates
#   and resumes in a single process, and the other way round.
# * **Agreement.** A collective operation waits until every rank has entered
#   it, so a rank that leaves the loop alone leaves the others waiting
#   forever. After each step one all-reduce sums the step's loss (for the
#   log) and each rank's stop requests (Ctrl-C or SIGTERM, which torchrun
#   forwards to all workers; the time limit), and all ranks stop at that step
#   if any asks (`test_ctrl_c_on_one_rank_stops_all_ranks_at_one_step_and_saves`).
#   At an epoch end the others wait in the same kind of all-reduce while
#   rank 0 evaluates (the process group's timeout, 30 minutes, bounds that
#   wait). After the last step all ranks leave the process group together,
#   and rank 0 scores the test set alone. A rank that fails (an error on
#   rank 0 is sent to the others, `test_failure_on_rank_0_stops_every_rank`)
#   exits, and torchrun then ends the other workers.
# * **Resume.** `last.pt` stores `batch_in_epoch` per rank and the world size.
#   Resumed with another number of processes, the run keeps the number of
#   batches done over all ranks, `batch_in_epoch * W_old // W_new`. When no
#   batch had to be split for either world size (the epoch's length buckets
#   are a multiple of both), the epoch's batch list is the same and this is
#   exact; otherwise the other split and shuffle may repeat or skip a few
#   examples of that one epoch. Rank 0's random state is restored on
#   every rank (`test_distributed_checkpoint_resumes_in_one_process`,
#   `test_single_process_checkpoint_resumes_under_torchrun_with_accumulation`).

# %%
def _distributed(dev: torch.device) -> tuple[int, int, torch.device, bool]:
    """(rank, world size, this rank's device, whether we joined the group here) from torchrun's environment."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():  # a caller set it up (and will tear it down)
        owned = False
    elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
        owned = True
    else:
        return 0, 1, dev, False
    if dev.type == "cuda":  # one GPU per process: the LOCAL_RANK-th of this machine
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if local >= torch.cuda.device_count():
            raise ValueError(f"process LOCAL_RANK={local} needs GPU {local}, but this machine has "
                             f"{torch.cuda.device_count()}: start at most that many processes per machine "
                             f"(--nproc_per_node), or train on CPUs with --device cpu")
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    if owned:
        from datetime import timedelta
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", timeout=timedelta(minutes=30))
    return dist.get_rank(), dist.get_world_size(), dev, owned


def _from_rank0(fn: Callable, rank: int, world: int):
    """fn() run on rank 0 and sent to every rank; if it fails there, every rank stops with an error."""
    if world == 1:
        return fn()
    import torch.distributed as dist

    box = [None]
    if rank == 0:
        try:
            box = [(True, fn())]
        except Exception as e:
            dist.broadcast_object_list([(False, f"{type(e).__name__}: {e}")], src=0)
            raise
    dist.broadcast_object_list(box, src=0)
    ok, value = box[0]
    if not ok:
        raise TrainingError(f"rank {rank}: stopped because rank 0 failed: {value}")
    return value


def _sum_over_ranks(values: list[float], world: int, device: torch.device) -> list[float]:
    """Element-wise sum over all ranks (float64: token counts stay exact); a synchronisation point."""
    if world == 1 or not values:
        return values
    import torch.distributed as dist

    total = torch.tensor(values, dtype=torch.float64, device=device)  # (len(values),)
    dist.all_reduce(total)
    return total.tolist()


def step_tokens(batches, accum: int, world: int = 1, device: torch.device = torch.device("cpu")) -> list[int]:
    """N of each optimizer step of an epoch: the target tokens of its `accum` batches, summed over all ranks.

    >>> from annotated.data import collate
    >>> batches = [collate([([5], [6] * n)], [0]) for n in (3, 1, 4)]  # n target ids + eos each
    >>> step_tokens(batches, accum=2)
    [6, 5]
    """
    local = [sum(b.ntokens for b in batches[i:i + accum]) for i in range(0, len(batches), accum)]
    return [int(n) for n in _sum_over_ranks(local, world, device)]


def _log_line(run_dir: Path, text: str) -> None:
    print(text, flush=True)
    with open(run_dir / "train.log", "a", encoding="utf-8") as f:
        f.write(text + "\n")


def _point_latest(run_dir: Path) -> None:
    """runs/latest -> this run (an atomically replaced symlink)."""
    link = run_dir.parent / "latest"
    tmp = run_dir.parent / f".latest.{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    tmp.symlink_to(run_dir.name)
    os.replace(tmp, link)


def prepare_data(cfg: TrainConfig, cache_dir: Optional[Path], data_url: Optional[str],
                 train_files: Optional[tuple[str, str]] = None, val_files=None, test_files=None,
                 empty_lines: str = "error"):
    """Load the three splits (Multi30k or the user's files) and the tokenizer trained on train only.

    `empty_lines` is `read_parallel`'s rule for the user's pairs with an empty side: error, skip or keep.
    """
    from annotated import data

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


def train(cfg: TrainConfig, run_dir: Path, *, data_url: Optional[str] = None, cache_dir: Optional[Path] = None,
          device: Optional[str] = None, resume: bool = False, progress: bool = True,
          train_files=None, val_files=None, test_files=None, empty_lines: str = "error",
          log: Callable[[str], None] | None = None) -> dict:
    """Train (or resume) a run in `run_dir`; returns the final results (also in results.json)."""
    from annotated import data

    rank, world, dev, owns_group = _distributed(pick_device(device))
    main = rank == 0
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    run_dir = Path(run_dir)
    say = log or (lambda s: _log_line(run_dir, s))
    if main:  # the other ranks never touch the run directory
        run_dir.mkdir(parents=True, exist_ok=True)
        _point_latest(run_dir)

    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    tokenizer, train_pairs, val_pairs, test_pairs = _from_rank0(  # the same data and vocabulary on every rank
        lambda: prepare_data(cfg, cache_dir, data_url, train_files, val_files, test_files, empty_lines), rank,
        world)
    train_enc = data.encode_pairs(train_pairs, tokenizer)
    kept, too_long = data.split_long(train_enc, cfg.max_len)
    if too_long and main:
        say(f"note: {len(too_long)} of {len(train_enc)} training pairs are longer than max_len={cfg.max_len} "
            f"subwords and are left out of training (rule: long pairs are skipped, never truncated)")
    train_enc = [train_enc[i] for i in kept]
    val_enc = data.encode_pairs(val_pairs, tokenizer)
    val_kept, _ = data.split_long(val_enc, cfg.max_len)
    val_batches = data.make_batches([val_enc[i] for i in val_kept], cfg.max_tokens)

    model = make_model(**cfg.model_config(tokenizer.vocab_size)).to(dev)
    opt, sched = make_optimizer(model, cfg)
    state = RunState()
    if resume:  # rank 0 reads last.pt and sends it to the others
        state = _resume(run_dir / "last.pt", cfg, model, opt, sched, tokenizer,
                        read=lambda path: _from_rank0(lambda: read_checkpoint(path), rank, world))
        if state.world_size != world:  # keep the number of batches done over all ranks ("Several processes")
            if main:
                say(f"note: last.pt was written by {state.world_size} process(es), this run has {world}")
            state.batch_in_epoch = state.batch_in_epoch * state.world_size // world
        if main:
            say(f"resumed {run_dir / 'last.pt'} at epoch {state.epoch}, batch {state.batch_in_epoch}, "
                f"step {state.step}")
    elif _from_rank0(lambda: (run_dir / "last.pt").exists(), rank, world):
        raise TrainingError(f"{run_dir} already holds a run (last.pt); pass --resume to continue it "
                            f"or choose another --run-dir")
    state.world_size = world
    model_for_step, ddp = model, None
    if world > 1:  # copies rank 0's parameters to every rank, then averages gradients in backward
        from torch.nn.parallel import DistributedDataParallel as DDP
        import inspect  # the one buffer, the positional table, is constant: no copy before each forward
        no_buffer_sync = ("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP).parameters
                          else "broadcast_buffers")  # newer torch's name for it, and the older one
        ddp = model_for_step = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None,
                                   **{no_buffer_sync: False})
    if cfg.compile:
        model_for_step = torch.compile(model_for_step, dynamic=True)

    writer = None
    if main:
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(log_dir=str(run_dir / "tb"))
        (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
        n_params = sum(p.numel() for p in model.parameters())
        say(f"run {run_dir}: {len(train_enc)} training pairs, vocab {tokenizer.vocab_size}, "
            f"{n_params:,} parameters, device {dev}, world size {world}")

    meta = {"src_lang": cfg.src_lang, "tgt_lang": cfg.tgt_lang, "train_config": dataclasses.asdict(cfg)}
    t_start = time.perf_counter()
    out_of_time = stopping = False  # decisions agreed by all ranks (stop.requested is this rank's own)
    with _StopFlag() as stop:
        while state.epoch < cfg.epochs and not stopping and not out_of_time:
            batches = data.make_batches(train_enc, cfg.max_tokens, shuffle=True, seed=cfg.seed + state.epoch,
                                        rank=rank, world_size=world)
            tokens = step_tokens(batches, cfg.accum, world, dev)  # N of each step: its batches on all ranks
            epoch_loss, epoch_tokens, step_loss, t_epoch = 0.0, 0, 0.0, time.perf_counter()
            bad_loss = None  # (value, batch) of this rank's first non-finite loss
            bar = range(state.batch_in_epoch, len(batches))
            if progress and main:
                from tqdm.auto import tqdm
                bar = tqdm(bar, total=len(batches), initial=state.batch_in_epoch,
                           desc=f"epoch {state.epoch + 1}/{cfg.epochs}", dynamic_ncols=True)
            model_for_step.train()
            for i in bar:
                b = batches[i]
                src, tgt = b.src.to(dev, non_blocking=True), b.tgt.to(dev, non_blocking=True)
                last = (i + 1) % cfg.accum == 0 or i + 1 == len(batches)  # this batch completes a step
                # DDP averages the gradients in the backward pass of a step's last batch only
                no_sync = ddp.no_sync() if ddp is not None and not last else contextlib.nullcontext()
                with no_sync, autocast_for(dev):
                    loss, n = batch_loss(model_for_step, src, tgt, cfg.label_smoothing)
                if bad_loss is None and not math.isfinite(loss.item()):  # stop at this step's end, all ranks
                    bad_loss = (loss.item(), i)
                # (W / N) sum_b L_b on this rank; DDP's mean over the W ranks makes it sum_b L_b / N over all
                (loss / max(tokens[i // cfg.accum], 1) * world).backward()
                step_loss += loss.item()
                state.batch_in_epoch = i + 1
                if last:
                    if cfg.max_minutes is not None and time.perf_counter() - t_start > 60 * cfg.max_minutes:
                        out_of_time = True
                    if cfg.max_steps is not None and state.step + 1 >= cfg.max_steps:
                        out_of_time = True
                    # one all-reduce before the update: the step's loss over all ranks, whether any rank asks
                    # to stop or is out of time, and which ranks saw a non-finite loss (they all stop together)
                    step_loss, asked, late, *bad_on = _sum_over_ranks(
                        [step_loss, stop.requested, out_of_time, *(float(r == rank and bad_loss is not None)
                                                                     for r in range(world))], world, dev)
                    stopping, out_of_time = asked > 0, late > 0
                    if any(bad_on):
                        raise TrainingError(_non_finite_loss_message(bad_loss, bad_on, rank, state, run_dir))
                    gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_norm or float("inf"))
                    if not math.isfinite(float(gnorm)):  # a finite loss can still have an inf/NaN gradient
                        raise TrainingError(f"the gradient norm became {float(gnorm)} at step {state.step + 1} "
                                            f"(epoch {state.epoch + 1}, batch {i}); stopped before the update, "
                                            f"the last good checkpoint {run_dir / 'last.pt'} is kept")
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    sched.step()
                    state.step += 1
                    n_step = tokens[i // cfg.accum]
                    epoch_loss, epoch_tokens = epoch_loss + step_loss, epoch_tokens + n_step
                    step_mean, step_loss = step_loss / max(n_step, 1), 0.0  # loss per token of this step
                    if main:
                        lr = sched.get_last_lr()[0]
                        tok_s = epoch_tokens / max(time.perf_counter() - t_epoch, 1e-9)
                        writer.add_scalar("train/loss", step_mean, state.step)
                        writer.add_scalar("train/lr", lr, state.step)
                        writer.add_scalar("train/grad_norm", float(gnorm), state.step)
                        writer.add_scalar("train/tokens_per_s", tok_s, state.step)
                        if progress and hasattr(bar, "set_postfix"):
                            bar.set_postfix(loss=f"{step_mean:.3f}", tok_s=f"{tok_s:,.0f}",
                                            lr=f"{lr:.2e}")
                    if main:
                        with open(run_dir / "train_loss.tsv", "a") as f:  # every step's loss, for plots and tests
                            f.write(f"{state.step}\t{step_mean:.8f}\n")
                    if stopping or out_of_time:
                        break
            if hasattr(bar, "close"):
                bar.close()
            if dev.type == "cuda":  # the queued kernels belong to this epoch's training time
                torch.cuda.synchronize(dev)
            train_s = time.perf_counter() - t_epoch
            epoch_done = state.batch_in_epoch >= len(batches)
            if epoch_done:
                state.epoch += 1
                state.batch_in_epoch = 0
            if main:
                _end_of_epoch(cfg, state, model, tokenizer, val_batches, val_pairs, dev, writer, run_dir, meta,
                              opt, sched, epoch_loss / max(epoch_tokens, 1), epoch_done, say,
                              timing=(train_s, epoch_tokens))
            # the other ranks wait here while rank 0 evaluates; a Ctrl-C meanwhile stops all of them
            stopping = _sum_over_ranks([stopping or stop.requested], world, dev)[0] > 0
            if stopping:
                if main:
                    say(f"interrupted: saved {run_dir / 'last.pt'} at epoch {state.epoch}, batch "
                        f"{state.batch_in_epoch}; continue with --resume --run-dir {run_dir}")
                break
    if writer is not None:
        writer.close()
    if owns_group:  # all ranks left the loop at the same agreed point; rank 0 goes on alone
        import torch.distributed as dist
        dist.destroy_process_group()
    if stopping:
        return {"interrupted": True, "run_dir": str(run_dir)}
    if not main:
        return {}
    return finish(cfg, run_dir, tokenizer, test_pairs, dev, say, progress)


def _non_finite_loss_message(bad_loss, bad_on, rank, state, run_dir) -> str:
    """What every rank says when some rank's loss was NaN or infinite in the step just computed."""
    where = f"at step {state.step + 1} (epoch {state.epoch + 1}, batch {bad_loss[1]})" if bad_loss else \
        f"at step {state.step + 1} (epoch {state.epoch + 1})"
    ranks = [r for r, f in enumerate(bad_on) if f > 0]
    if len(bad_on) == 1:
        what = f"the loss became {bad_loss[0]} {where}"
    elif bad_loss is not None:
        what = f"the loss became {bad_loss[0]} on rank {rank} {where}"
    else:
        what = f"the loss became non-finite on rank(s) {', '.join(map(str, ranks))} {where}"
    return f"{what}; stopped, the last good checkpoint {run_dir / 'last.pt'} is kept"


def _save_last(run_dir, model, tokenizer, meta, opt, sched, state: RunState):
    save_checkpoint(run_dir / "last.pt", model, tokenizer, meta, optimizer=opt.state_dict(),
                    scheduler=sched.state_dict(), rng=_rng_state(), run_state=dataclasses.asdict(state))


def _end_of_epoch(cfg, state, model, tokenizer, val_batches, val_pairs, dev, writer, run_dir, meta, opt, sched,
                  train_loss, epoch_done, say, timing=(0.0, 0)):
    """Validate, checkpoint and log one finished epoch. `timing`: (seconds of training, target tokens) of
    the epoch, so that the log shows where the time goes (training vs evaluation)."""
    if not epoch_done:  # interrupted or out of time mid-epoch: just make it resumable
        _save_last(run_dir, model, tokenizer, meta, opt, sched, state)
        return
    t_eval = time.perf_counter()
    rng = _rng_state()  # evaluation must not change the training's random stream
    val_loss = evaluate_loss(model, val_batches, cfg.label_smoothing, dev)
    subset = val_pairs[:cfg.val_bleu_sentences] if cfg.val_bleu_sentences else val_pairs
    val, _ = evaluate_bleu(model, tokenizer, subset, beam_size=1, length_penalty=0.0, device=dev)
    from annotated.attention import log_alignment_image  # the first val sentence's alignment, in tensorboard
    with contextlib.suppress(ValueError):  # (an empty or over-long first sentence: no picture)
        log_alignment_image(writer, model, tokenizer, val_pairs[0][0], state.step)
    _set_rng_state(rng)
    model.train()
    eval_s = time.perf_counter() - t_eval  # validation loss, BLEU and the picture (not the saves below)
    record = {"epoch": state.epoch, "step": state.step, "train_loss": round(train_loss, 4),
              "val_loss": round(val_loss, 4), "val_bleu": val["bleu"], "val_chrf": val["chrf"],
              "lr": sched.get_last_lr()[0], "train_s": round(timing[0], 2),
              "tokens_per_s": round(timing[1] / max(timing[0], 1e-9)), "eval_s": round(eval_s, 2)}
    state.history.append(record)
    for key in ("val_loss", "val_bleu", "val_chrf"):
        writer.add_scalar(key.replace("_", "/", 1), record[key], state.step)
    writer.add_scalar("train/epoch_loss", train_loss, state.step)
    writer.add_scalar("time/train_s", record["train_s"], state.step)
    writer.add_scalar("time/eval_s", record["eval_s"], state.step)
    writer.flush()
    improved = val["bleu"] > state.best_bleu
    if improved:
        state.best_bleu = val["bleu"]
        save_checkpoint(run_dir / "best.pt", model, tokenizer, dict(meta, **record))
    if cfg.average_last:
        save_checkpoint(run_dir / f"epoch{state.epoch}.pt", model, tokenizer, dict(meta, **record))
        old = run_dir / f"epoch{state.epoch - cfg.average_last}.pt"
        with contextlib.suppress(FileNotFoundError):
            old.unlink()
    _save_last(run_dir, model, tokenizer, meta, opt, sched, state)
    say(f"epoch {state.epoch:3d} step {state.step:6d}  train loss {train_loss:.3f}  val loss {val_loss:.3f}  "
        f"val BLEU {val['bleu']:5.2f} (greedy, {val['sentences']} sentences)  chrF {val['chrf']:5.2f}"
        f"{'  *best*' if improved else ''}  [train {record['train_s']:.1f} s, {record['tokens_per_s']:,} "
        f"tok/s; eval {record['eval_s']:.1f} s]")


def _resume(path: Path, cfg: TrainConfig, model, opt, sched, tokenizer=None,
            read=read_checkpoint) -> RunState:
    state = read(path)
    if "run_state" not in state:
        raise CheckpointError(f"checkpoint {path} has no training state; it cannot be resumed")
    saved = state.get("meta", {}).get("train_config", {})
    model_keys = ("src_lang", "tgt_lang", "vocab_size", "N", "d_model", "d_ff", "h", "attention", "norm",
                  "tie_embeddings", "max_len", "train_limit")
    diff = {k: (saved.get(k), getattr(cfg, k)) for k in model_keys if saved.get(k) != getattr(cfg, k)}
    if diff:
        raise CheckpointError(f"checkpoint {path} was trained with different settings; cannot resume: " +
                              ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in diff.items()))
    if tokenizer is not None and state.get("tokenizer") not in (None, tokenizer.to_bytes()):
        raise CheckpointError(f"checkpoint {path} was trained with another tokenizer than the one built from "
                              f"the training data now (the data or the sentencepiece version changed); "
                              f"cannot resume")
    loaded = model_from_state(state, path)
    model.load_state_dict(loaded.state_dict())
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    _set_rng_state(state["rng"])
    return RunState(**state["run_state"])


def finish(cfg: TrainConfig, run_dir: Path, tokenizer, test_pairs, dev, say, progress=True) -> dict:
    """Test BLEU of the best (and averaged) checkpoint, greedy and beam; writes results.json."""
    from annotated.checkpoint import load_checkpoint

    # a run stopped before its first epoch ended has no best.pt yet: use last.pt
    candidates = {"best": run_dir / "best.pt" if (run_dir / "best.pt").exists() else run_dir / "last.pt"}
    epochs = sorted(run_dir.glob("epoch*.pt"), key=lambda p: int(p.stem[5:]))
    if cfg.average_last >= 2 and len(epochs) >= 2:
        atomic_torch_save(average_checkpoints(epochs[-cfg.average_last:]), run_dir / "averaged.pt")
        candidates["averaged"] = run_dir / "averaged.pt"
    results = {"run_dir": str(run_dir), "device": str(dev), "torch": torch.__version__,
               "train_config": dataclasses.asdict(cfg), "test_set": "test_2016_flickr", "test": {}}
    last = read_checkpoint(run_dir / "last.pt")
    results["history"] = last["run_state"]["history"]
    samples = []
    for name, path in candidates.items():
        model, _, meta = load_checkpoint(path)
        model.to(dev)
        greedy, hyps = evaluate_bleu(model, tokenizer, test_pairs, 1, 0.0, dev, progress)
        beam, beam_hyps = evaluate_bleu(model, tokenizer, test_pairs, cfg.beam_size, cfg.length_penalty, dev,
                                        progress)
        results["test"][name] = {"checkpoint": str(path), "epoch": meta.get("epoch"), "greedy": greedy,
                                 "beam": dict(beam, length_penalty=cfg.length_penalty)}
        say(f"test_2016_flickr {cfg.src_lang}->{cfg.tgt_lang} [{name}]: greedy BLEU {greedy['bleu']:.2f} "
            f"(lowercased {greedy['bleu_lowercase']:.2f}), beam {cfg.beam_size} BLEU {beam['bleu']:.2f} "
            f"(lowercased {beam['bleu_lowercase']:.2f}), chrF {beam['chrf']:.2f}")
        if not samples:
            samples = [{"source": s, "reference": r, "greedy": g, "beam": b}
                       for (s, r), g, b in list(zip(test_pairs, hyps, beam_hyps))[:5]]
    results["samples"] = samples
    tmp = run_dir / ".results.json.tmp"
    tmp.write_text(json.dumps(results, indent=2, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, run_dir / "results.json")
    for s in samples[:3]:
        say(f"  src : {s['source']}\n  ref : {s['reference']}\n  beam: {s['beam']}")
    say(f"results: {run_dir / 'results.json'}; checkpoints: {run_dir}; tensorboard --logdir {run_dir / 'tb'}")
    return results
