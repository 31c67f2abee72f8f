# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # `make bench`: how fast is our Transformer, and how close to the hardware?
#
# Absolute speeds depend on the machine, its load and the library versions,
# so this benchmark judges our code by **ratios measured side by side in one
# process**: the same batches, the same sizes, the same optimiser, timed in
# interleaved rounds. It measures
#
# 1. **one training step** (forward, backward, Adam step) in target tokens
#    per second, and the peak memory of the step, for four implementations:
#    our model with fused attention on the SDPA path
#    (`annotated.transformer.FAST_PATH = True`), the same with the explicit
#    softmax (`FAST_PATH = False`), our per-head attention, and a
#    **reference built from `torch.nn.Transformer`** that does the same work;
# 2. **decoding** in sentences per second: greedy with the key/value cache,
#    greedy recomputing the whole prefix at every step (the original
#    Annotated Transformer's way), and beam search with 4 beams;
# 3. on CUDA: the same in bf16 autocast, eagerly and under `torch.compile`,
#    and the **model FLOPs utilisation** (MFU) against the GPU's peak;
# 4. on the CPU: training's `--precision` and `--threads` side by side, the
#    fused SDPA step in fp32 and bf16 autocast on one thread and on every
#    core, each against fp32 on every core (`bench_cpu_arithmetic`).
#
# Sizes: the `cpu` and `gpu` presets of `annotated/training/config.py` and the paper's
# base model. The results go to a table on stdout and to
# `benchmarks/results/<device>-<date>.json`, with the project's performance
# targets beside the numbers (section 8).
#
# `python benchmarks/bench.py --help` lists the options; `make bench ARGS=...`
# passes them on.

# %%
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import itertools
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python benchmarks/bench.py` runs from the repository without installing
    sys.path.insert(0, str(ROOT))

if __name__ == "__main__":  # as a command: a Ctrl-C while torch loads is one line, exit 130
    from annotated.plumbing.interrupts import quiet_ctrl_c_while_starting
    quiet_ctrl_c_while_starting("benchmarks/bench.py")

import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from annotated import transformer  # noqa: E402
from annotated.decoding import search as decoding  # noqa: E402
from annotated.plumbing.devices import all_cores, autocast, cpu_has_bf16, default_device  # noqa: E402
from annotated.tokens import BOS, EOS, PAD  # noqa: E402
from annotated.training.config import PRESETS, TrainConfig, config_dict, config_from_dict, joint_model  # noqa: E402
from annotated.training.train import batch_loss, label_smoothed_loss, make_optimizer  # noqa: E402
from annotated.transformer import TransformerConfig, convert_model, make_model, padding_mask  # noqa: E402

# %% [markdown]
# ## 1. Sizes and batches
#
# A size is a `TrainConfig` (model sizes, vocabulary, label smoothing and
# optimiser settings, exactly as training uses them) plus the number of
# sentences per batch on each kind of device. `cpu` and `gpu` are the training
# presets; `base` is the paper's base model (N=6, d_model=512, d_ff=2048,
# h=8, dropout 0.1) with its shared 37000-token vocabulary. Batches on the
# GPU, and for the cpu preset also on the CPU, hold about the preset's
# `max_tokens` tokens (the gpu preset's for base); on this project's 2-core
# CPU the larger models get small batches, so that the whole `make bench`
# stays within about ten minutes (the ratios are per step, and the batch is
# the same for every implementation in a row).
# Decoding batches hold 64 sentences, as `decoding.translate_ids` uses, except
# for the larger models on the CPU (32).
#
# **Sentences like Multi30k's.** test_2016_flickr, cut into subwords by a
# joint 8000-piece sentencepiece model trained on Multi30k's training text,
# has sentences of 15.0 (de) and 14.6 (en) subwords on average, standard
# deviation 5.7 and 5.0, from 5 to 43. We draw source lengths from a normal
# distribution with mean 15 and standard deviation 5.5, clipped to [5, 43],
# and target lengths as the source length plus a normal error of standard
# deviation 2, with random token ids (speed does not depend on which ids).
# Training batches are built as the length-bucketed batcher builds them:
# sort a large sample by length and take consecutive sentences, here the
# buckets around the median, so a batch has little padding. All batches of a
# size are padded to one common shape, so `torch.compile` compiles once.

# %%
@dataclass(frozen=True)
class Size:
    name: str
    train: TrainConfig
    train_sentences: dict  # device type ("cpu", "cuda") -> sentences per training batch
    decode_sentences: dict  # device type -> sentences per decoding batch

    def model_config(self) -> TransformerConfig:
        return self.train.model

    def to_json(self) -> dict:
        return {"name": self.name, "train": config_dict(self.train),
                "train_sentences": self.train_sentences, "decode_sentences": self.decode_sentences}

    @staticmethod
    def from_json(d: dict) -> Size:
        return Size(d["name"], config_from_dict(d["train"]), d["train_sentences"], d["decode_sentences"])


BASE = TrainConfig(model=joint_model(37000, N=6, d_model=512, d_ff=2048, h=8, dropout=0.1, max_len=256), warmup=4000,
                   max_tokens=PRESETS["gpu"].max_tokens)


def _sentences_for(cfg: TrainConfig) -> int:
    """Sentences holding about `max_tokens` padded tokens; a median bucket pads targets to about 20."""
    return max(1, cfg.max_tokens // 20)


SIZES = {
    "cpu": Size("cpu", PRESETS["cpu"], {"cpu": _sentences_for(PRESETS["cpu"]), "cuda": _sentences_for(PRESETS["cpu"])},
                {"cpu": 64, "cuda": 64}),
    "gpu": Size("gpu", PRESETS["gpu"], {"cpu": 24, "cuda": _sentences_for(PRESETS["gpu"])}, {"cpu": 32, "cuda": 64}),
    "base": Size("base", BASE, {"cpu": 16, "cuda": _sentences_for(BASE)}, {"cpu": 32, "cuda": 64}),
}


def sample_lengths(n: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """Source and target lengths (n,) like Multi30k's in subwords (see above)."""
    src = (15.0 + 5.5 * torch.randn(n, generator=gen)).round().clamp(5, 43).long()  # (n,)
    tgt = (src + 2.0 * torch.randn(n, generator=gen)).round().clamp(5, 43).long()  # (n,)
    return src, tgt


def make_batches(n_batches: int, sentences: int, vocab: int, seed: int) -> list[tuple[Tensor, Tensor]]:
    """`n_batches` (src (B, S), tgt (B, T)) pairs from the median length buckets, one common shape.

    tgt is `bos y_1 ... y_n eos pad...`, as training feeds it.
    """
    if n_batches < 1 or sentences < 1 or vocab < 5:
        raise ValueError(f"need n_batches >= 1, sentences >= 1 and vocab >= 5, got {n_batches}, {sentences}, {vocab}")
    gen = torch.Generator().manual_seed(seed)
    pool = 20 * n_batches * sentences
    src_len, tgt_len = sample_lengths(pool, gen)  # (pool,)
    order = torch.argsort(src_len * 100 + tgt_len, stable=True)  # by length, as the batcher sorts
    start = (pool - n_batches * sentences) // 2  # the buckets around the median
    chosen = order[start:start + n_batches * sentences].view(n_batches, sentences)  # (n_batches, B)
    S, T = int(src_len[chosen].max()), int(tgt_len[chosen].max()) + 2  # + bos, eos
    batches = []
    for rows in chosen:
        s_len, t_len = src_len[rows], tgt_len[rows]  # (B,)
        src = torch.randint(4, vocab, (sentences, S), generator=gen)  # (B, S) ids above pad/bos/eos/unk
        src = src.masked_fill(torch.arange(S) >= s_len[:, None], PAD)  # (B, S)
        body = torch.randint(4, vocab, (sentences, T - 1), generator=gen)  # (B, T-1)
        pos = torch.arange(T - 1)  # (T-1,)
        body = body.masked_fill(pos == t_len[:, None], EOS).masked_fill(pos > t_len[:, None], PAD)  # (B, T-1)
        tgt = torch.cat([torch.full((sentences, 1), BOS), body], dim=1)  # (B, T)
        batches.append((src, tgt))
    return batches


# %% [markdown]
# ## 2. The reference: `torch.nn.Transformer` doing the same work
#
# `torch.nn.Transformer` is only the two stacks. Around it we put what our
# `EncoderDecoder` has, in plain PyTorch: one `nn.Embedding` table shared by
# source and target and scaled by `sqrt(d_model)`, the same sinusoidal
# positions and dropout, and an `nn.Linear` generator whose weight *is* the
# embedding table (our presets tie all three). Then the work is the same:
#
# - `batch_first=True`, the same `d_model`, `h` (nhead), `N` layers in each
#   stack, `d_ff`, dropout (in the same four places: positions, attention
#   weights, sublayer outputs, the feed-forward hidden layer) and ReLU;
# - **post-norm** (`norm_first=False`), as our default. `nn.Transformer`
#   always adds a final LayerNorm after each stack, which a post-norm model
#   does not have (ours adds one only for pre-norm), so we remove those two;
# - the masks express the same rules in torch's convention (`True` = *blocked*):
#   source padding for the encoder and for cross-attention, and the causal
#   mask plus target padding for the decoder's self-attention.
#
# The loss is the same label-smoothed loss as training's `batch_loss`.

# %%
class TorchTransformerReference(nn.Module):
    """torch.nn.Transformer inside embeddings, positional encoding and a generator like ours."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        if not cfg.bias or cfg.d_k not in (None, cfg.d_model // cfg.h) or cfg.d_v not in (None, cfg.d_model // cfg.h):
            raise ValueError(f"torch.nn.Transformer needs attention biases and d_k = d_v = d_model / h; got {cfg}")
        self.config, d = cfg, cfg.d_model
        self.src_embed = nn.Embedding(cfg.src_vocab, d)
        self.tgt_embed = self.src_embed if cfg.share_embeddings else nn.Embedding(cfg.tgt_vocab, d)
        self.register_buffer("pe", transformer.sinusoidal_encoding(cfg.max_len, d), persistent=False)
        self.dropout = nn.Dropout(cfg.dropout)
        with warnings.catch_warnings():  # a note about nested tensors, which only inference uses
            warnings.simplefilter("ignore")
            self.transformer = nn.Transformer(d, cfg.h, cfg.N, cfg.N, cfg.d_ff, cfg.dropout, batch_first=True,
                                              norm_first=cfg.norm == "pre")
        if cfg.norm == "post":  # no final LayerNorm after a post-norm stack
            self.transformer.encoder.norm = None
            self.transformer.decoder.norm = None
        self.generator = nn.Linear(d, cfg.tgt_vocab)
        if cfg.tie_generator:
            self.generator.weight = self.tgt_embed.weight  # (V, d_model), the same Parameter

    def _embed(self, table: nn.Embedding, tokens: Tensor) -> Tensor:
        x = table(tokens) * math.sqrt(self.config.d_model)  # (B, T, d_model)
        return self.dropout(x + self.pe[:tokens.size(1)])  # (B, T, d_model)

    def forward(self, src: Tensor, tgt: Tensor) -> Tensor:
        """src (B, S), tgt (B, T) ids -> logits (B, T, V)."""
        src_pad, tgt_pad = src == PAD, tgt == PAD  # (B, S), (B, T) True = ignore this key
        T = tgt.size(1)
        causal = torch.ones(T, T, dtype=torch.bool, device=tgt.device).triu(1)  # (T, T) True = future, blocked
        y = self.transformer(self._embed(self.src_embed, src), self._embed(self.tgt_embed, tgt), tgt_mask=causal,
                             src_key_padding_mask=src_pad, tgt_key_padding_mask=tgt_pad,
                             memory_key_padding_mask=src_pad, tgt_is_causal=True)  # (B, T, d_model)
        return self.generator(y)  # (B, T, V)


def reference_batch_loss(model: TorchTransformerReference, src: Tensor, tgt: Tensor, eps: float) -> tuple[Tensor, int]:
    """The reference's version of `train.batch_loss`: (summed loss, predicted tokens)."""
    tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]  # (B, T-1), (B, T-1)
    return label_smoothed_loss(model(src, tgt_in), tgt_out, eps), int((tgt_out != PAD).sum())


# %% [markdown]
# ## 3. The implementations compared
#
# Four rows per size. The two fused rows share one model and one optimiser
# (they differ only in the module flag `FAST_PATH`, switched around their
# steps); per-head attention is that model converted with `convert_model`.
# Each model is built from the same seed.

# %%
VARIANTS = {  # key -> label
    "fused_sdpa": "ours, fused, SDPA",
    "fused_explicit": "ours, fused, explicit softmax",
    "per_head": "ours, per-head",
    "reference": "torch.nn.Transformer",
}


@dataclass
class Trainee:
    """One row: a model, its loss function, its optimiser, and the FAST_PATH setting it runs with."""
    key: str
    model: nn.Module
    loss_fn: Callable
    opt: torch.optim.Optimizer
    sched: object
    fast: bool = True


def build_trainees(size: Size, device: torch.device, seed: int, keys=tuple(VARIANTS)) -> list[Trainee]:
    cfg = size.model_config()
    out, fused = [], None

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
    batch_iter = itertools.cycle(batches)

    def step():
        src, tgt = next(batch_iter)
        t.opt.zero_grad(set_to_none=True)
        with amp(), transformer.fast_path(t.fast):
            loss, n_tokens = t.loss_fn(model, src, tgt, eps)
        (loss / n_tokens).backward()
        t.opt.step()
        t.sched.step()
    return step


# %% [markdown]
# ## 4. Timing: warmed up, interleaved, median
#
# Every function first runs once untimed (first calls allocate memory, pick
# kernels, compile) and once timed, which fixes how many calls a timing
# window holds (about `window` seconds). Then `reps` rounds time each function
# for one window, in an order that rotates from round to round, so a slow
# spell of the machine (other processes, thermal throttling) hits every
# implementation alike. We keep the median per call over the rounds. A
# function that raises (out of memory, a compiler error) is dropped and its
# error recorded instead of stopping the benchmark.

# %%
def interleaved_times(fns: dict, reps: int, window: float, sync: Callable[[], None],
                      progress: Callable[[str], None] | None = None,
                      clock: Callable[[], float] = time.perf_counter) -> tuple[dict, dict, dict]:
    """-> (seconds per call: name -> list over rounds, calls per window, errors: name -> message)."""
    fns, iters, errors = dict(fns), {}, {}

    def run(name, n):
        try:
            sync()
            t0 = clock()
            for _ in range(n):
                fns[name]()
            sync()
            return (clock() - t0) / n
        except Exception as e:  # noqa: BLE001 - recorded in the results, the other rows go on
            errors[name] = f"{type(e).__name__}: {e}"[:500]
            del fns[name]
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            return None

    for name in list(fns):
        if progress:
            progress(f"warm-up {name}")
        if run(name, 1) is not None:  # untimed: first-call costs
            dt = run(name, 1)
            if dt is not None:
                iters[name] = max(1, min(100, round(window / max(dt, 1e-9))))
    times = {name: [] for name in fns}
    names = list(fns)
    for r in range(reps):
        if progress:
            progress(f"round {r + 1}/{reps}")
        k = r % max(len(names), 1)
        for name in names[k:] + names[:k]:
            if name in fns:
                dt = run(name, iters[name])
                if dt is not None:
                    times[name].append(dt)
    return {n: t for n, t in times.items() if n in fns}, iters, errors


# %% [markdown]
# ## 5. Memory of a training step
#
# We report two numbers per row. **Resident**: the bytes of the parameters
# and of Adam's two moment estimates, counted exactly from the tensors.
# **Step peak**: the most memory the step needs *on top of* that: activations
# kept for the backward pass, gradients, and temporaries.
#
# - On CUDA the caching allocator counts exactly: reset its peak before a
#   step, subtract the bytes allocated before it.
# - On the CPU PyTorch keeps no such count, and Python's `tracemalloc` does
#   not see PyTorch's allocations. We measure the process's resident memory
#   instead, in a fresh subprocess per size: Linux's peak resident size
#   (`VmHWM`) is reset by writing `5` to `/proc/self/clear_refs` just before
#   the step, and the step peak is `VmHWM` after the step minus `VmRSS` before
#   it. This counts pages, not tensors, so glibc must give freed memory back
#   to the system: the subprocess runs with `MALLOC_MMAP_THRESHOLD_=65536`,
#   which puts every block of 64 KiB or more in its own mapping, returned on
#   `free`. Without that, memory freed by one step would be reused by the
#   next one unseen. Small blocks (under 64 KiB) can still be reused, so the
#   CPU number is accurate to a few MB and can only err low.

# %%
def resident_bytes(t: Trainee) -> int:
    """Parameters plus optimiser state, in bytes (a tied table counted once)."""
    params = {id(p): p.numel() * p.element_size() for p in t.model.parameters()}
    state = sum(v.numel() * v.element_size() for s in t.opt.state.values() for v in s.values()
                if isinstance(v, Tensor) and v.dim() > 0)
    return sum(params.values()) + state


def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} field")


def cpu_step_peak(step: Callable[[], None], t: Trainee) -> int:
    """Peak resident bytes of one step above the resident bytes before it (see above)."""
    t.opt.zero_grad(set_to_none=True)
    gc.collect()
    before = _proc_status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident size
    step()
    return max(0, _proc_status_kib("VmHWM") - before) * 1024


def cuda_step_peak(step: Callable[[], None], t: Trainee, device: torch.device) -> int:
    t.opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def memory_probe(spec: dict) -> dict:
    """Runs in the CPU memory subprocess: key -> {resident_bytes, step_peak_bytes}."""
    size = Size.from_json(spec["size"])
    torch.set_num_threads(spec["threads"])
    batches = make_batches(spec["n_batches"], spec["sentences"], size.train.vocab_size, spec["seed"])
    out = {}
    for t in build_trainees(size, torch.device("cpu"), spec["seed"], keys=tuple(spec["keys"])):
        step = make_step(t, t.model, batches, size.train.label_smoothing, contextlib.nullcontext)
        step()  # allocates Adam's state and warms up
        peak = cpu_step_peak(step, t)
        out[t.key] = {"resident_bytes": resident_bytes(t), "step_peak_bytes": peak}
    return out


def run_memory_probe(size: Size, n_batches: int, sentences: int, seed: int, keys) -> dict:
    """Start the probe in a fresh interpreter (see above) and return its result."""
    if not os.path.exists("/proc/self/clear_refs"):
        raise RuntimeError("the CPU memory probe needs Linux's /proc/self/clear_refs")
    spec = {"size": size.to_json(), "n_batches": n_batches, "sentences": sentences, "seed": seed,
            "keys": list(keys), "threads": torch.get_num_threads()}
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--memory-probe", json.dumps(spec)],
                          capture_output=True, text=True, env=env, cwd=str(ROOT))
    if proc.returncode != 0:
        raise RuntimeError(f"memory probe failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# %% [markdown]
# ## 6. FLOPs and MFU
#
# Model FLOPs utilisation compares the arithmetic the model *needs* with what
# the chip could do: `MFU = (model FLOPs per step / seconds per step) / peak
# FLOP/s`. We count the matrix products analytically, 2 FLOPs per
# multiply-add, and the backward pass as twice the forward (the gradients
# with respect to the inputs and to the weights), so a weight matrix with
# `P` entries costs `6 P` FLOPs per token it is applied to. With
# `H_k = h d_k`, `H_v = h d_v`, `S_i` and `T_i` the real (unpadded) lengths of
# sentence `i`'s source and decoder input:
#
# - weights applied to every **source** token: per encoder layer the four
#   attention projections (`2 d_model H_k + 2 d_model H_v` entries) and the
#   feed-forward (`2 d_model d_ff`); per decoder layer the cross-attention
#   `W_K, W_V` (`d_model H_k + d_model H_v`), which read the memory;
# - weights applied to every **target** token: per decoder layer self-attention
#   (`2 d_model H_k + 2 d_model H_v`), cross-attention `W_Q, W_O`
#   (`d_model H_k + H_v d_model`) and the feed-forward; and the generator
#   (`d_model V`: tied to the embedding table, but a real product, unlike the
#   embedding lookup, which costs no FLOPs);
# - attention itself, per layer: `Q K^T` and `weights V` cost
#   `2 T_q T_k (H_k + H_v)` forward, `6 T_q T_k (H_k + H_v)` with the
#   backward, for `T_q T_k` = `S_i^2` (encoder), `T_i^2` (decoder
#   self-attention, counted in full: we do not discount the causal mask,
#   as PaLM's MFU does not) and `T_i S_i` (cross-attention).
#
# $$F = 6\Big(\sum_i S_i \cdot P_{src} + \sum_i T_i \cdot P_{tgt}\Big)
#   + 6 N (H_k + H_v) \sum_i \big(S_i^2 + T_i^2 + T_i S_i\big)$$
#
# Padding positions are computed but not counted, so MFU charges padding as
# waste. Layer norms, softmax, biases and the loss are left out (elementwise
# work, well under 1% of the FLOPs at these sizes). `test_flop_formula_matches_flop_counter` checks
# `F` against PyTorch's `FlopCounterMode` on a batch without padding.
#
# Peaks are the dense (no 2:4 sparsity) bf16 tensor-core figures of NVIDIA's
# data sheets, matched by the name CUDA reports; `--peak-tflops` overrides.

# %%
def training_flops(cfg: TransformerConfig, src_lengths: list[int], tgt_lengths: list[int]) -> int:
    """Model FLOPs of one training step (forward + backward) on sentences of these lengths."""
    d, N, V = cfg.d_model, cfg.N, cfg.tgt_vocab
    d_k, d_v = transformer._head_sizes(d, cfg.h, cfg.d_k, cfg.d_v)
    H_k, H_v = cfg.h * d_k, cfg.h * d_v
    attn_proj = 2 * d * H_k + 2 * d * H_v  # W_Q, W_K (d x H_k), W_V (d x H_v), W_O (H_v x d)
    ffn = 2 * d * cfg.d_ff  # W_1, W_2
    P_src = N * (attn_proj + ffn) + N * (d * H_k + d * H_v)  # encoder layers + decoder cross W_K, W_V
    P_tgt = N * (attn_proj + (d * H_k + H_v * d) + ffn) + d * V  # self-attn, cross W_Q, W_O, FFN; generator
    pairs = sum(s * s + t * t + t * s for s, t in zip(src_lengths, tgt_lengths))
    return 6 * (sum(src_lengths) * P_src + sum(tgt_lengths) * P_tgt) + 6 * N * (H_k + H_v) * pairs


PEAK_BF16_TFLOPS = [  # (regular expression for torch.cuda.get_device_name(), dense bf16 TFLOP/s); first match wins
    (r"H100 NVL", 835.0),        # data sheet: 1,671 with sparsity
    (r"H100 PCIe", 756.0),       # 1,513 with sparsity
    (r"H100|H800", 989.0),       # SXM5, e.g. "NVIDIA H100 80GB HBM3": 1,979 with sparsity (989.4 dense)
    (r"H200 NVL", 835.0),        # 1,671 with sparsity
    (r"H200", 989.0),            # H200 SXM and GH200: 1,979 with sparsity
    (r"A100|A800", 312.0),       # SXM and PCIe: 624 with sparsity
    (r"L40S", 362.0),            # 733 with sparsity
    (r"\bL4\b", 121.0),          # 242 with sparsity
    (r"\bA10\b", 125.0),         # A10 (not A10G, not A100): 250 with sparsity
]


def peak_tflops(device_name: str) -> float | None:
    """Dense bf16 peak TFLOP/s for a CUDA device name, or None if the table does not know it.

    >>> [peak_tflops(n) for n in ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA A10G", "AMD EPYC")]
    [989.0, 756.0, None, None]
    """
    for pattern, value in PEAK_BF16_TFLOPS:
        if re.search(pattern, device_name):
            return value
    return None


def real_lengths(batches) -> tuple[list[int], list[int], int]:
    """(source lengths, decoder-input lengths, predicted tokens) over all batches, padding excluded."""
    src_l, tgt_l = [], []
    for src, tgt in batches:
        src_l += (src != PAD).sum(dim=1).tolist()
        tgt_l += (tgt[:, 1:] != PAD).sum(dim=1).tolist()  # decoder input bos y_1..y_n = predictions y_1..eos
    return src_l, tgt_l, sum(tgt_l)


# %% [markdown]
# ## 7. Decoding throughput at a fixed length
#
# A randomly initialised model produces `eos` whenever it likes, and the
# cached and recomputing decoders would then stop at different moments only
# by chance. For a fair comparison every decoder must run the same number of
# steps: we set the generator's bias for `eos` to `-inf`, so `eos` has
# probability exactly zero, no sentence ever finishes, and every decoder runs
# exactly `steps` steps (the benchmark checks the output length). `steps` is
# the longest target in the batch plus its `eos`, the length a real batch
# decodes to. Beam search uses width 4 and the paper's length penalty 0.6.

# %%
DECODERS = {  # key -> label
    "greedy_cached": "greedy, key/value cache",
    "greedy_recompute": "greedy, recompute prefix",
    "beam4_cached": "beam search (4), cache",
}


@torch.no_grad()
def suppress_eos(model: nn.Module) -> nn.Module:
    """Make eos unreachable: its generator bias becomes -inf, so its probability is exactly 0."""
    model.generator.bias[EOS] = float("-inf")
    return model


def decode_fns(model, batches, steps: int, amp) -> dict:
    """key -> function decoding every batch for exactly `steps` steps."""
    def run(decode):
        def go():
            for src, _ in batches:
                with amp():
                    out = decode(src, padding_mask(src, PAD))
                if out.size(1) != steps:
                    raise RuntimeError(f"decoder stopped after {out.size(1)} of {steps} steps; eos must be unreachable")
        return go
    return {
        "greedy_cached": run(lambda s, m: decoding.greedy(model, s, m, steps, use_cache=True)),
        "greedy_recompute": run(lambda s, m: decoding.greedy(model, s, m, steps, use_cache=False)),
        "beam4_cached": run(lambda s, m: decoding.beam_search(model, s, m, steps, beam_size=4, length_penalty=0.6)),
    }


# %% [markdown]
# ## 8. The targets
#
# The project's targets, each reported beside the number it is about, as
# `met`, `not met`, or `not measured` (with the command that measures it):
#
# - our fused training step at least 1.0x the `torch.nn.Transformer`
#   reference, on the CPU and on the GPU (every size);
# - cached greedy decoding at least 3x the recomputing one, on the CPU;
# - per-head attention within 2x of fused (per-head step time / fused step
#   time <= 2) at the gpu preset on the GPU (bf16, eager);
# - MFU at least 30% for the base model in bf16 on one H100 (the better of
#   eager and compiled).

# %%
GPU_COMMAND = "make bench PYTHON=python3"  # on a machine with one CUDA GPU (an H100 for the MFU target)
CPU_COMMAND = "make bench ARGS='--device cpu'"


def _target(target: str, size: str, where: str, value: float | None, ok: Callable[[float], bool],
            unit: str, command: str) -> dict:
    t = {"target": target, "size": size, "device": where, "measured": value, "unit": unit,
         "status": "not measured" if value is None else ("met" if ok(value) else "not met")}
    if value is None:
        t["command"] = command
    return t


def evaluate_targets(result: dict) -> list[dict]:
    """One entry per target and size (and per dtype/compile setting where several were run)."""
    dev, name = result["meta"]["device_type"], result["meta"]["device_name"]
    train, dec = result["train"], result["decode"]
    out = []
    for size in dict.fromkeys(list(SIZES) + result["meta"]["sizes"]):  # the standard sizes, then any others
        # fused >= 1.0x the reference, on the CPU and on the GPU
        for where in ("cpu", "cuda"):
            rows = [r for r in train if r["size"] == size and r["key"] == "fused_sdpa" and dev == where]
            for r in rows:
                setting = f"{where} {r['dtype']}" + (" compiled" if r["compiled"] else "")
                out.append(_target("fused >= 1.0x torch.nn.Transformer", size, setting, r["ratio_vs_reference"],
                                   lambda v: v >= 1.0, "x", GPU_COMMAND if where == "cuda" else CPU_COMMAND))
            if not rows:
                out.append(_target("fused >= 1.0x torch.nn.Transformer", size, where, None, lambda v: v >= 1.0,
                                   "x", GPU_COMMAND if where == "cuda" else CPU_COMMAND))
        # cached greedy >= 3x recomputing greedy, on the CPU
        cached = [r for r in dec if r["size"] == size and r["key"] == "greedy_cached" and dev == "cpu"]
        out.append(_target("cached greedy >= 3x recompute", size, "cpu",
                           cached[0]["ratio_vs_recompute"] if cached else None, lambda v: v >= 3.0, "x", CPU_COMMAND))
    # per-head within 2x of fused at the gpu preset on the GPU (bf16, eager)
    def step_s(key):
        rows = [r for r in train if r["size"] == "gpu" and r["key"] == key and not r["compiled"] and dev == "cuda"]
        return rows[0]["step_s"] if rows else None
    fused, per_head = step_s("fused_sdpa"), step_s("per_head")
    out.append(_target("per-head step time <= 2x fused", "gpu", "cuda, eager",
                       per_head / fused if fused and per_head else None, lambda v: v <= 2.0, "x", GPU_COMMAND))
    # MFU >= 30%, base model, bf16, one H100: the better of eager and compiled
    mfus = [r["mfu"] for r in train if r["size"] == "base" and r["key"] == "fused_sdpa" and r["mfu"] is not None
            and dev == "cuda" and r["dtype"] == "bf16" and "H100" in name]
    out.append(_target("MFU >= 30% (fused)", "base", "one H100, bf16", max(mfus) if mfus else None,
                       lambda v: v >= 0.30, "fraction", GPU_COMMAND))
    return out


# %% [markdown]
# ## 9. Running it all
#
# `Settings` gathers how to measure. The clock is the wall clock by default.
# On a shared CPU machine other processes steal time at random; `clock="cpu"`
# then measures this process's CPU time instead (`time.process_time`), which
# with one thread (`--threads 1`) is the time the benchmark actually ran, and
# equals the wall time on an idle machine. CUDA work is always timed by the
# wall clock, after a synchronisation.

# %%
@dataclass(frozen=True)
class Settings:
    device: torch.device = torch.device("cpu")
    dtype: str = "fp32"              # "fp32", or "bf16" autocast
    compile_modes: tuple = (False,)  # False: eager; True: torch.compile
    reps: int = 5                    # timing rounds
    window: float = 1.0              # seconds per timing window
    train_batches: int = 2           # batches cycled through by the training steps
    decode_batches: int = 1          # batches each decoding call translates
    memory: bool = True
    decode: bool = True
    arithmetic: bool = True          # on the CPU: fp32 vs bf16, one thread vs all (bench_cpu_arithmetic)
    seed: int = 0
    peak_tflops: float | None = None  # for MFU; default from PEAK_BF16_TFLOPS on CUDA with bf16
    clock: str = "wall"              # "wall" or "cpu" (process CPU time, CPU device only)
    compile_keys: tuple | None = None  # the rows that get a compiled twin (None: all)
    sync_steps: int = 8              # training steps under the host-sync counter (0: skip)

    def __post_init__(self):
        if self.dtype not in ("fp32", "bf16"):
            raise ValueError(f"dtype must be 'fp32' or 'bf16', got {self.dtype!r}")
        if self.clock not in ("wall", "cpu") or (self.clock == "cpu" and self.device.type != "cpu"):
            raise ValueError(f"clock must be 'wall', or 'cpu' on the CPU device; got {self.clock!r} on {self.device}")
        if self.reps < 1 or self.window <= 0 or self.train_batches < 1 or self.decode_batches < 1:
            raise ValueError(f"need reps >= 1, window > 0, train_batches >= 1, decode_batches >= 1; got "
                             f"{self.reps}, {self.window}, {self.train_batches}, {self.decode_batches}")

    def amp(self):
        """A factory of autocast contexts: bf16 autocast (as training's --precision bf16), or none."""
        return lambda: autocast(self.device, self.dtype)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def timer(self) -> Callable[[], float]:
        return time.process_time if self.clock == "cpu" else time.perf_counter


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:500]


def bench_training(size: Size, st: Settings, log: Callable[[str], None]) -> list[dict]:
    device = st.device
    sentences = size.train_sentences[device.type]
    batches = [(s.to(device), t.to(device))
               for s, t in make_batches(st.train_batches, sentences, size.train.vocab_size, st.seed)]
    src_l, tgt_l, tokens = real_lengths(batches)
    tokens_per_step = tokens / len(batches)
    flops_per_step = training_flops(size.model_config(), src_l, tgt_l) / len(batches)
    peak = st.peak_tflops
    trainees = build_trainees(size, device, st.seed)
    fns = {}
    for compiled in st.compile_modes:
        compiled_models = {}
        for t in trainees:
            model = t.model
            if compiled and st.compile_keys is not None and t.key not in st.compile_keys:
                continue
            if compiled:  # one compiled wrapper per module (the two fused rows share theirs)
                if id(t.model) not in compiled_models:
                    compiled_models[id(t.model)] = torch.compile(t.model)  # lazy: compiles at the first call
                model = compiled_models[id(t.model)]
            fns[(t.key, compiled)] = make_step(t, model, batches, size.train.label_smoothing, st.amp())
    log(f"[{size.name}] training: {len(fns)} rows, {sentences} sentences/batch, shape src {tuple(batches[0][0].shape)} "
        f"tgt {tuple(batches[0][1].shape)}")
    times, iters, errors = interleaved_times(fns, st.reps, st.window, st.sync,
                                             lambda s: log(f"[{size.name}] training {s}"), st.timer())
    mem = {}
    if st.memory and device.type == "cpu":
        log(f"[{size.name}] memory probe (subprocess)")
        try:
            mem = run_memory_probe(size, st.train_batches, sentences, st.seed, [t.key for t in trainees])
        except Exception as e:  # noqa: BLE001 - reported in the rows
            mem = {t.key: {"error": _error(e)} for t in trainees}
    rows = []
    for compiled in st.compile_modes:
        ref_time = _median(times.get(("reference", compiled), []))
        for t in trainees:
            name = (t.key, compiled)
            if name not in fns:
                continue
            step_s = _median(times.get(name, []))
            r = {"size": size.name, "key": t.key, "label": VARIANTS[t.key], "device": device.type,
                 "dtype": st.dtype, "compiled": compiled, "sentences": sentences, "batches": len(batches),
                 "src_shape": list(batches[0][0].shape), "tgt_shape": list(batches[0][1].shape),
                 "target_tokens_per_step": tokens_per_step, "step_s": step_s,
                 "step_s_rounds": times.get(name, []), "calls_per_round": iters.get(name),
                 "tokens_per_s": tokens_per_step / step_s if step_s else None,
                 "ratio_vs_reference": ref_time / step_s if step_s and ref_time else None,
                 "flops_per_step": flops_per_step,
                 "achieved_tflops": flops_per_step / step_s / 1e12 if step_s else None,
                 "mfu": flops_per_step / step_s / (peak * 1e12) if step_s and peak else None}
            if name in errors:
                r["error"] = errors[name]
            if device.type == "cuda" and st.memory and name not in errors:
                try:
                    r["resident_bytes"] = resident_bytes(t)
                    r["step_peak_bytes"] = cuda_step_peak(fns[name], t, device)
                except Exception as e:  # noqa: BLE001
                    r["memory_error"] = _error(e)
            elif t.key in mem:
                if "error" in mem[t.key]:
                    r["memory_error"] = mem[t.key]["error"]
                else:
                    r.update(mem[t.key])
            rows.append(r)
    return rows


def bench_decoding(size: Size, st: Settings, log: Callable[[str], None]) -> list[dict]:
    device = st.device
    sentences = size.decode_sentences[device.type]
    batches = [(s.to(device), t.to(device))
               for s, t in make_batches(st.decode_batches, sentences, size.train.vocab_size, st.seed + 1)]
    steps = batches[0][1].size(1) - 1  # the longest target plus eos
    torch.manual_seed(st.seed)
    model = suppress_eos(make_model(size.model_config()).to(device).eval())
    fns = decode_fns(model, batches, steps, st.amp())
    log(f"[{size.name}] decoding: {len(batches)} x {sentences} sentences, {steps} steps each")
    times, iters, errors = interleaved_times(fns, st.reps, st.window, st.sync,
                                             lambda s: log(f"[{size.name}] decoding {s}"), st.timer())
    n_sent = len(batches) * sentences
    base = _median(times.get("greedy_recompute", []))
    rows = []
    for key, label in DECODERS.items():
        s = _median(times.get(key, []))
        r = {"size": size.name, "key": key, "label": label, "device": device.type, "dtype": st.dtype,
             "sentences": n_sent, "steps": steps, "src_shape": list(batches[0][0].shape),
             "seconds": s, "seconds_rounds": times.get(key, []), "calls_per_round": iters.get(key),
             "sentences_per_s": n_sent / s if s else None,
             "ratio_vs_recompute": base / s if s and base else None}
        if key in errors:
            r["error"] = errors[key]
        rows.append(r)
    return rows


# The CPU's arithmetic: training's `--precision` and `--threads` side by side.
# The fused SDPA training step of the first size, timed in interleaved rounds
# like every row above, in fp32 and in bf16 autocast, on one thread and on
# every core this process may use; each row's speed-up is the fp32 row on
# every core's median step time over its own (> 1: faster than that
# baseline). bf16 rows only where the CPU has bf16 instructions
# (`annotated.plumbing.devices.cpu_has_bf16`).
ARITHMETIC = (("fp32", "all"), ("fp32", 1), ("bf16", "all"), ("bf16", 1))  # the baseline first


def with_threads(step: Callable[[], None], threads: int) -> Callable[[], None]:
    def run():
        torch.set_num_threads(threads)
        step()
    return run


def bench_cpu_arithmetic(size: Size, st: Settings, log: Callable[[str], None]) -> list[dict]:
    """Rows of (precision, threads) for the fused SDPA training step on the CPU, against fp32 on every core."""
    cpu, cores, threads_before = torch.device("cpu"), all_cores(), torch.get_num_threads()
    sentences = size.train_sentences["cpu"]
    batches = make_batches(st.train_batches, sentences, size.train.vocab_size, st.seed)
    tokens_per_step = real_lengths(batches)[2] / len(batches)
    [t] = build_trainees(size, cpu, st.seed, keys=("fused_sdpa",))
    wanted = {(p, cores if n == "all" else n) for p, n in ARITHMETIC}  # (with one core, 1 and "all" are one row)
    runnable = {k for k in wanted if k[0] == "fp32" or cpu_has_bf16()}
    fns = {k: with_threads(make_step(t, t.model, batches, size.train.label_smoothing,
                                     lambda precision=k[0]: autocast(cpu, precision)), k[1])
           for k in sorted(runnable, key=lambda k: (k[0], -k[1]))}
    log(f"[{size.name}] CPU arithmetic: {len(fns)} rows, {cores} cores")
    try:
        times, _, errors = interleaved_times(fns, st.reps, st.window, st.sync,
                                             lambda s: log(f"[{size.name}] CPU arithmetic {s}"), st.timer())
    finally:
        torch.set_num_threads(threads_before)
    base = _median(times.get(("fp32", cores), []))
    rows = []
    for precision, threads in sorted(wanted, key=lambda k: (k[0], -k[1])):
        step_s = _median(times.get((precision, threads), []))
        r = {"size": size.name, "key": "fused_sdpa", "precision": precision, "threads": threads, "step_s": step_s,
             "step_s_rounds": times.get((precision, threads), []),
             "tokens_per_s": tokens_per_step / step_s if step_s else None,
             "speedup_vs_fp32_all_threads": base / step_s if step_s and base else None}
        if (precision, threads) not in runnable:
            r["note"] = "not measured: this CPU has no bf16 instructions (avx512_bf16 or amx_bf16)"
        elif (precision, threads) in errors:
            r["error"] = errors[(precision, threads)]
        rows.append(r)
    return rows


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    return f"{name}, {os.cpu_count()} cores, {torch.get_num_threads()} threads"


def bench_translator_cli(st: Settings, log: Callable[[str], None], sentences: int = 48, beam: int = 2) -> dict:
    """The translator reading `sentences` lines from stdin (annotated/decoding/translate.py's main, in process:
    checkpoint loading, reading, input rules, output) against one `translate_ids` call on the same sentences'
    ids with the same beam, on the CPU, a tiny random model. ratio = CLI seconds / translate_ids seconds."""
    import io
    import random

    from annotated.decoding import translate as cli
    from annotated.plumbing.checkpoint import save_checkpoint
    from annotated.training.data import train_tokenizer

    words = ["ein", "hund", "eine", "frau", "zwei", "männer", "rennt", "liest", "spielt", "über", "die", "wiese", "im", "park", "buch", "ball"]
    pick = random.Random(st.seed)
    texts = [" ".join(pick.choice(words) for _ in range(pick.randint(3, 10))) + "." for _ in range(sentences)]
    with tempfile.TemporaryDirectory() as folder:
        tok = train_tokenizer(texts, 320, cache_dir=folder)
        torch.manual_seed(st.seed)
        model = transformer.make_model(src_vocab=tok.vocab_size, tgt_vocab=tok.vocab_size, N=2, d_model=32, d_ff=64, h=4,
                              dropout=0.0, max_len=64).eval()
        save_checkpoint(Path(folder) / "tiny.pt", model, tok)
        lines, ids = "".join(t + "\n" for t in texts).encode(), [tok.encode(t) for t in texts]
        argv = ["--checkpoint", str(Path(folder) / "tiny.pt"), "--beam", str(beam), "--device", "cpu"]
        fns = {"cli": lambda: cli.main(argv, stdin=io.BytesIO(lines), stdout=io.BytesIO(), stderr=io.StringIO()),
               "translate_ids": lambda: decoding.translate_ids(model, ids, beam)}
        times, _, errors = interleaved_times(fns, st.reps, st.window, lambda: None, lambda s: log(f"translator {s}"),
                                             st.timer())
    cli_s, batched_s = _median(times.get("cli", [])), _median(times.get("translate_ids", []))
    return {"sentences": sentences, "beam": beam, "cli_s": cli_s, "translate_ids_s": batched_s,
            "ratio": cli_s / batched_s if cli_s and batched_s else None, **({"error": errors} if errors else {})}


def run_benchmarks(sizes: list[Size], settings: Settings = Settings(), log: Callable[[str], None] = print) -> dict:
    """Run everything for these sizes; returns the result dict (also what the JSON file holds)."""
    st = settings
    if st.peak_tflops is None and st.device.type == "cuda" and st.dtype == "bf16":
        st = dataclasses.replace(st, peak_tflops=peak_tflops(device_name(st.device)))
    meta = {"device_type": st.device.type, "device_name": device_name(st.device), "torch": torch.__version__,
            "python": platform.python_version(),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "threads": torch.get_num_threads(), "clock": st.clock, "dtype": st.dtype,
            "compiled": list(st.compile_modes), "sizes": [s.name for s in sizes], "reps": st.reps,
            "window_s": st.window, "seed": st.seed, "peak_tflops": st.peak_tflops,
            "size_details": {s.name: dict(dataclasses.asdict(s.model_config()),
                                          train_sentences=s.train_sentences[st.device.type],
                                          decode_sentences=s.decode_sentences[st.device.type]) for s in sizes},
            "load_average_start": list(os.getloadavg())}
    t0 = time.perf_counter()
    train_rows, decode_rows = [], []
    for size in sizes:
        train_rows += bench_training(size, st, log)
        gc.collect()
        if st.decode:
            decode_rows += bench_decoding(size, st, log)
            gc.collect()
    meta.update(load_average_end=list(os.getloadavg()), wall_s=round(time.perf_counter() - t0, 1))
    result = {"meta": meta, "train": train_rows, "decode": decode_rows,
              "compile_speedup": compile_speedups(train_rows)}
    if st.arithmetic and st.device.type == "cpu":
        result["cpu_arithmetic"] = bench_cpu_arithmetic(sizes[0], st, log)
    if st.sync_steps:
        result["host_syncs"] = host_syncs_per_step(sizes[0], st)
    if st.decode:
        result["translator_cli"] = bench_translator_cli(st, log)
    result["targets"] = evaluate_targets(result)
    return result


def compile_speedups(rows: list[dict]) -> list[dict]:
    """Eager step time / compiled step time of each row measured both ways in this run.

    >>> compile_speedups([{"size": "cpu", "key": "fused_sdpa", "compiled": c, "step_s": t}
    ...                   for c, t in ((False, 0.3), (True, 0.2))])
    [{'size': 'cpu', 'key': 'fused_sdpa', 'speedup': 1.5}]
    """
    eager = {(r["size"], r["key"]): r["step_s"] for r in rows if not r["compiled"] and r.get("step_s")}
    return [{"size": r["size"], "key": r["key"], "speedup": round(eager[(r["size"], r["key"])] / r["step_s"], 3)}
            for r in rows if r["compiled"] and r.get("step_s") and (r["size"], r["key"]) in eager]


def host_syncs_per_step(size: Size, st: Settings) -> dict:
    """Synchronising operators per step of the real training step (`train.train_step`), counted over
    `st.sync_steps` steps with `annotated.training.syncs.SyncCounter` (after one uncounted step)."""
    from annotated.training.data import Batch
    from annotated.training.syncs import SyncCounter
    from annotated.training.train import Meter, train_step

    torch.manual_seed(st.seed)
    model = make_model(size.model_config()).to(st.device).train()
    opt, sched = make_optimizer(model, size.train)
    batches = [Batch(s, t, torch.arange(s.size(0)))
               for s, t in make_batches(2, size.train_sentences[st.device.type], size.train.vocab_size, st.seed)]
    n = [int((b.tgt[:, 1:] != 0).sum()) for b in batches]
    meter = Meter(st.device)
    meter.add(*train_step(model, opt, sched, [batches[0]], n[0], size.train, st.device))
    with SyncCounter() as counter:
        for i in range(st.sync_steps):
            meter.add(*train_step(model, opt, sched, [batches[i % 2]], n[i % 2], size.train, st.device))
    return {"size": size.name, "steps": st.sync_steps, "per_step": counter.total / st.sync_steps,
            "ops": dict(counter.counts)}


# %% [markdown]
# ## 10. The table and the file

# %%
def _fmt(x, spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


def _mb(r: dict, key: str) -> str:
    if "memory_error" in r:
        return "error"
    return _fmt(r.get(key) and r[key] / 2 ** 20, ".1f", "n/a")


def markdown(result: dict) -> str:
    m = result["meta"]
    lines = [f"Device: {m['device_name']}; torch {m['torch']}; {m['date']}; {m['dtype']}; {m['clock']} clock; "
             f"load average {m['load_average_start'][0]:.1f} at start, {m['load_average_end'][0]:.1f} at end.", "",
             "| size | implementation | compiled | batch (sent., src x tgt) | tokens/s | x reference | "
             "step ms | resident MiB | step peak MiB | MFU |",
             "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in result["train"]:
        lines.append(f"| {r['size']} | {r['label']} | {'yes' if r['compiled'] else 'no'} | {r['sentences']}, "
                     f"{r['src_shape'][1]} x {r['tgt_shape'][1]} | {_fmt(r['tokens_per_s'], ',.0f', 'error')} | "
                     f"{_fmt(r['ratio_vs_reference'], '.2f')} | {_fmt(r['step_s'] and r['step_s'] * 1e3, '.0f')} | "
                     f"{_mb(r, 'resident_bytes')} | {_mb(r, 'step_peak_bytes')} | {_fmt(r['mfu'], '.1%', 'n/a')} |")
    if result["decode"]:
        lines += ["", "| size | decoder | sentences x steps | sentences/s | x recompute |",
                  "| --- | --- | --- | ---: | ---: |"]
        for r in result["decode"]:
            lines.append(f"| {r['size']} | {r['label']} | {r['sentences']} x {r['steps']} | "
                         f"{_fmt(r['sentences_per_s'], ',.1f', 'error')} | {_fmt(r['ratio_vs_recompute'], '.2f')} |")
    if result.get("cpu_arithmetic"):
        lines += ["", "| size | precision | threads | step ms | tokens/s | x fp32, all threads |",
                  "| --- | --- | ---: | ---: | ---: | ---: |"]
        for r in result["cpu_arithmetic"]:
            shown = r.get("note") or r.get("error") or _fmt(r["speedup_vs_fp32_all_threads"], ".2f")
            lines.append(f"| {r['size']} | {r['precision']} | {r['threads']} | "
                         f"{_fmt(r['step_s'] and r['step_s'] * 1e3, '.0f')} | {_fmt(r['tokens_per_s'], ',.0f')} | "
                         f"{shown} |")
    lines += ["", "| target | size | device | measured | status |", "| --- | --- | --- | ---: | --- |"]
    for t in result["targets"]:
        value = t["measured"]
        shown = "-" if value is None else (f"{value:.1%}" if t["unit"] == "fraction" else f"{value:.2f}x")
        status = t["status"] + (f" (`{t['command']}`)" if t["status"] == "not measured" else "")
        lines.append(f"| {t['target']} | {t['size']} | {t['device']} | {shown} | {status} |")
    if result.get("host_syncs"):
        h = result["host_syncs"]
        lines.append(f"\nhost syncs per training step: {h['per_step']:g} (train.train_step, {h['size']} size, "
                     f"{h['steps']} steps counted on {m['device_type']})")
    if result.get("translator_cli", {}).get("ratio"):
        t = result["translator_cli"]
        lines.append(f"\ntranslator from stdin / batched translate_ids: {t['ratio']:.2f}x ({t['sentences']} sentences, "
                     f"beam {t['beam']}, CPU, tiny random model; the CLI loads the checkpoint each run)")
    for c in result.get("compile_speedup", []):
        lines.append(f"\ntorch.compile speed-up, {c['size']} {VARIANTS[c['key']]}: {c['speedup']:.2f}x "
                     f"(eager step time / compiled, this run)")
    errors = [r for r in result["train"] + result["decode"] if "error" in r]
    for r in errors:
        lines.append(f"\nerror in {r['size']} {r['label']}{' (compiled)' if r.get('compiled') else ''}: {r['error']}")
    return "\n".join(lines)


def default_out_path(result: dict) -> Path:
    dev = result["meta"]["device_type"]
    if dev == "cuda":
        dev = re.sub(r"[^a-z0-9]+", "-", result["meta"]["device_name"].lower()).strip("-")
    return ROOT / "benchmarks" / "results" / f"{dev}-{result['meta']['date'][:10]}.json"


def write_json(result: dict, path: Path) -> None:
    """Write atomically (`annotated.plumbing.files.atomic_write`: a temporary file, then a rename)."""
    from annotated.plumbing.files import atomic_write

    atomic_write(path, json.dumps(result, indent=1) + "\n")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Benchmark training steps and decoding against torch.nn.Transformer.")
    p.add_argument("--sizes", default="cpu,gpu,base", help="comma-separated subset of: " + ", ".join(SIZES))
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    p.add_argument("--quick", action="store_true", help="2 rounds, short windows: a smoke run, not a measurement")
    p.add_argument("--reps", type=int, default=None, help="timing rounds (default 5; 2 with --quick)")
    p.add_argument("--window", type=float, default=None,
                   help="seconds per timed window (default 1.0; 0.2 with --quick)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default=None, help="default: bf16 on CUDA, fp32 on the CPU")
    p.add_argument("--compile", choices=("off", "on", "both"), default=None,
                   help="torch.compile rows (default: both; on the CPU only for the fused SDPA row)")
    p.add_argument("--no-memory", action="store_true", help="skip the memory measurement")
    p.add_argument("--no-decode", action="store_true", help="skip the decoding benchmark")
    p.add_argument("--no-arithmetic", action="store_true",
                   help="skip the CPU rows of fp32 vs bf16 and one thread vs all (the first size's fused SDPA step)")
    p.add_argument("--peak-tflops", type=float, default=None, help="peak FLOP/s (in TFLOP/s) for MFU")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (default: torch's choice); 1 is steadier on a loaded machine")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall clock, or this process's CPU time (CPU only; for a shared machine, with --threads 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="JSON path (default benchmarks/results/<device>-<date>.json)")
    p.add_argument("--memory-probe", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    names = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in names if s not in SIZES]
    if unknown or not names:
        p.error(f"--sizes: unknown size(s) {unknown or args.sizes!r}; choose from {', '.join(SIZES)}")
    args.sizes = names
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.memory_probe is not None:
        print(json.dumps(memory_probe(json.loads(args.memory_probe))))
        return {}
    if args.threads:
        torch.set_num_threads(args.threads)
    device = default_device(args.device)
    if device.type not in ("cpu", "cuda"):
        raise SystemExit(f"--device must be cpu or cuda[:N], got {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    compile_arg = args.compile or "both"
    try:
        settings = Settings(device=device, dtype=args.dtype or ("bf16" if device.type == "cuda" else "fp32"),
                            compile_modes={"off": (False,), "on": (True,), "both": (False, True)}[compile_arg],
                            reps=args.reps or (2 if args.quick else 5),
                            window=args.window or (0.2 if args.quick else 1.0),
                            memory=not args.no_memory, decode=not args.no_decode,
                            arithmetic=not args.no_arithmetic, seed=args.seed,
                            peak_tflops=args.peak_tflops, clock=args.clock,
                            compile_keys=None if device.type == "cuda" else ("fused_sdpa",))
    except ValueError as e:
        raise SystemExit(f"bench.py: {e}") from None

    from tqdm.auto import tqdm
    bar = tqdm(desc="bench", unit=" phase", leave=False)

    def log(msg: str) -> None:
        bar.set_postfix_str(msg[:70])
        bar.update(1)

    result = run_benchmarks([SIZES[s] for s in args.sizes], settings, log)
    bar.close()
    result["meta"]["command"] = " ".join(["benchmarks/bench.py"] + (argv if argv is not None else sys.argv[1:]))
    result["meta"]["quick"] = args.quick
    out = args.out or default_out_path(result)
    write_json(result, out)
    print(markdown(result))
    print(f"\nwritten to {out}")
    return result


if __name__ == "__main__":
    from annotated.plumbing.interrupts import run_command
    run_command(main, "benchmarks/bench.py")  # Ctrl-C: one line and exit code 130, not a traceback
