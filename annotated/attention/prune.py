# %% [markdown]
# # Pruning heads: a smaller, faster model
#
# `annotated/sites.py` showed that removing head `i` is deleting its blocks:
# column block `i` of `W_Q, W_K, W_V` (and of their biases) and row block `i`
# of `W_O`. Removing a set of heads for real therefore gives an ordinary
# fused model whose attentions have `h' < h` heads, fewer parameters, and
# narrower matrix products. This chapter chooses the set, saves the result as
# a checkpoint, and loads it back.
#
# Tests: `tests/attention/test_prune.py`.

# %%
from __future__ import annotations

import copy
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from annotated.checkpoint import save_checkpoint
from annotated.decoding.search import translate_ids
from annotated.plumbing.progress import progress as progress_bar
from annotated.plumbing.progress import tracked
from annotated.sites import attention_at, head_counts, remove_heads, sites
from annotated.training.config import TrainConfig
from annotated.training.train import train_step
from annotated.transformer import EncoderDecoder, convert_model

# %% [markdown]
# ## 1. Greedy pruning: rank on some sentences, decide on others
#
# Michel et al. prune iteratively: score the heads, remove the least
# important, score again on the smaller model, and so on. They divide each
# layer's scores by their L2 norm first; we rank by the scores themselves,
# since with only `h = 4` heads per attention the normalisation gives every
# attention scores of about `0.5` whether its heads matter or not
# (`heads.json` has both).
#
# A search that ranks heads and decides when to stop on the same sentences
# fits those sentences, so `split_sentences` ranks on one half of the
# validation sentences and judges each removal by the loss of the other,
# held-out half. The stop rule, and the path past it (`beyond_stop`) that
# `on_step` follows for the curve, are in docs/heads.md#pruning-and-its-stop-rule
# (`test_going_beyond_the_stop_keeps_the_same_model_and_follows_the_same_path`).

# %%
MAX_LOSS_INCREASE = 0.02  # nats per token: a 2% rise in perplexity, exp(0.02) = 1.020


def split_sentences(n: int) -> tuple[list[int], list[int]]:
    """(ranking, held-out) indices of `n` sentences: even positions rank, odd positions decide.

    >>> split_sentences(5)
    ([0, 2, 4], [1, 3])
    """
    return list(range(0, n, 2)), list(range(1, n, 2))


@dataclass
class Removal:
    kind: str
    layer: int
    head: int  # the head's index in the unpruned model
    score: float  # its importance (on the ranking sentences) when it was tried
    held_out_loss: float  # held-out loss of the model without it (and all earlier removals)
    kept: bool = True  # False: the removal that broke the stop rule (undone; the search ended)


@dataclass
class PruneResult:
    model: EncoderDecoder
    baseline_loss: float  # held-out loss of the unpruned model
    max_increase: float
    steps: list[Removal] = field(default_factory=list)
    beyond: list[Removal] = field(default_factory=list)  # the path after the stop (beyond_stop=True), not kept

    @property
    def removed(self) -> list[Removal]:
        return [s for s in self.steps if s.kept]


def greedy_prune(
    model: EncoderDecoder,
    held_out_loss: Callable[[EncoderDecoder], float],
    importance: Callable[[EncoderDecoder], dict],
    max_increase: float = MAX_LOSS_INCREASE,
    progress: bool = False,
    beyond_stop: bool = False,
    on_step: Callable[[Removal, EncoderDecoder], None] | None = None,
) -> PruneResult:
    """Remove heads, least important first, until the held-out loss would rise more than `max_increase`;
    with `beyond_stop`, go on down the same path to one head per attention (recorded in `result.beyond`).
    `on_step(removal, model without it)` is called at every step of the path."""
    if not max_increase >= 0:
        raise ValueError(f"max_increase must be >= 0 (nats per token), got {max_increase}")
    original = {site: list(range(attention_at(model, *site).h)) for site in sites(model)}
    result, current, stopped = PruneResult(model, held_out_loss(model), max_increase), model, False
    bar = progress_bar(sum(len(v) - 1 for v in original.values()), "pruning", "head") if progress else None
    while True:
        scores = importance(current)
        candidates = [
            (scores[k][l][i], (k, l), i)
            for k, l in sites(current)
            for i in range(attention_at(current, k, l).h)
            if attention_at(current, k, l).h > 1
        ]
        if not candidates:
            break
        score, site, i = min(candidates)
        trial = remove_heads(current, {site: [i]})
        loss = held_out_loss(trial)
        # every removal is judged against the unpruned model's loss, never the previous step's
        kept = not stopped and loss - result.baseline_loss <= max_increase
        step = Removal(*site, original[site][i], score, loss, kept)
        (result.beyond if stopped else result.steps).append(step)
        if on_step is not None:
            on_step(step, trial)
        if bar is not None:
            bar.set_postfix_str(f"held-out loss {loss:.3f}")
            bar.update(1)
        if not step.kept:
            stopped = True
            if not beyond_stop:
                break
        else:
            result.model = trial
        original[site].pop(i)
        current = trial
    if bar is not None:
        bar.close()
    return result


# %% [markdown]
# ## 2. A pruned checkpoint
#
# The model configuration has one `h` for every attention; a pruned model's
# checkpoint keeps the unpruned configuration and adds the head counts,
# `"heads": {kind: [h of layer 0, layer 1, ...]}`, which the project's one
# loader, `checkpoint.load_checkpoint`, checks and applies before it loads the
# parameters strictly (docs/heads.md#pruned-checkpoints). The attention modules
# never needed a global `h`: `fuse`, `split`, decoding and the key/value cache
# all read each module's own `h`.


# %%
def count_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (a tied embedding table counts once)."""
    return sum(p.numel() for p in model.parameters())


def save_pruned(
    path: os.PathLike | str, model: EncoderDecoder, tokenizer, meta: dict | None = None, case_table: dict | None = None
) -> None:
    """Save `model` as a fused checkpoint; non-uniform head counts go to the checkpoint's "heads" entry; the
    unpruned checkpoint's case table (decoding/casing.py) goes along."""
    fused = convert_model(model, "fused")
    counts = head_counts(fused)
    uniform = all(h == fused.config.h for hs in counts.values() for h in hs)
    extra = ({} if uniform else {"heads": counts}) | ({} if case_table is None else {"casing": case_table})
    save_checkpoint(path, fused, tokenizer, meta, **extra)


# %% [markdown]
# ## 3. Fine-tuning the pruned model
#
# The heads that remain were trained to work beside the removed ones. A few
# steps of training let them take over (Michel et al. do not fine-tune;
# Voita et al. prune while training). `finetune` runs training's own step,
# `train_step` of `annotated/training/train.py`, at a constant learning rate
# `FINETUNE_LR` (a run's warm-up would start near zero). Given the held-out
# loss, it keeps the model of lowest held-out loss, like the stop never looking
# at test (docs/heads.md#pruning-and-its-stop-rule). Dropout draws from a seed,
# so the same call gives the same model
# (`test_finetune_with_dropout_repeats_by_its_seed_and_leaves_the_callers_random_state`).

# %%
FINETUNE_LR = 1e-4
FINETUNE_CHECK_EVERY = 100  # steps between two held-out losses
FINETUNE_PATIENCE = 3  # checks in a row without a new lowest held-out loss end fine-tuning


@dataclass
class Finetuned:
    model: EncoderDecoder  # the model kept (with `held_out_loss`, the lowest's; step 0: the input itself)
    steps: int  # its training steps
    checks: list[tuple[int, float]]  # (steps, held-out loss) at every check, step 0 first


def finetune(
    model: EncoderDecoder,
    batches: list,
    steps: int,
    held_out_loss: Callable[[EncoderDecoder], float] | None = None,
    lr: float = FINETUNE_LR,
    check_every: int = FINETUNE_CHECK_EVERY,
    patience: int = FINETUNE_PATIENCE,
    progress: bool = False,
    seed: int = 0,
) -> Finetuned:
    """A copy of `model` after `steps` training steps on `batches` (cycled); `model` itself is not changed.
    With `held_out_loss`: the model whose held-out loss is lowest (checked every `check_every` steps and after
    the last), stopping after `patience` checks in a row without a new lowest. Dropout draws from `seed`: the
    same call gives the same model, and the caller's random state is left as it was."""
    checks = [] if held_out_loss is None else [(0, held_out_loss(model))]
    best = Finetuned(model, 0, checks)
    if steps == 0:
        return best
    tuned = copy.deepcopy(model).train()
    device = next(tuned.parameters()).device
    settings = TrainConfig()  # training's label smoothing and clipping
    opt = torch.optim.Adam(
        tuned.parameters(),
        lr=lr,
        betas=(0.9, 0.98),
        eps=1e-9,
        fused=next(tuned.parameters()).dtype in (torch.float16, torch.bfloat16, torch.float32),
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)  # constant
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        for done in tracked(range(1, steps + 1), steps, "fine-tuning", "step", progress):
            b = batches[(done - 1) % len(batches)]
            train_step(tuned, opt, sched, [b], b.ntokens, settings, device)
            if held_out_loss is None or (done % check_every and done != steps):
                continue
            checks.append((done, held_out_loss(tuned)))
            tuned.train()  # the check evaluated it
            if checks[-1][1] < min(l for _, l in checks[:-1]):
                best.model, best.steps = copy.deepcopy(tuned).eval(), done
            if done - best.steps >= patience * check_every:  # the last `patience` checks found no new lowest
                break
    return best if held_out_loss is not None else Finetuned(tuned.eval(), steps, [])


# %% [markdown]
# ## 4. Speed
#
# Decoding speed is sentences per second over the test set, with the
# project's one decoder (`translate_ids`); `alternating_speed` times the
# models in turn, round after round, so that both see the same slow spells
# (docs/heads.md#pruning-and-its-stop-rule,
# `test_alternating_speed_times_each_model_in_every_round_in_turn`).
#
# How much faster can a model with fewer heads decode? When decoding with the
# key/value cache, each generated token passes through every decoder layer's
# self-attention projections (`W_Q, W_K, W_V, W_O`), the cross-attention's
# `W_Q` and `W_O` (its keys and values are computed once per sentence), the
# feed-forward network, and the generator. Counting multiply-adds per token
# for the `cpu` preset (`N = 2`, `d_model = 128`, `d_ff = 512`, a 5,000-subword
# vocabulary), the heads own less than a fifth of them; the generator alone
# owns more than half:
#
# >>> d, d_ff, V, N = 128, 512, 5000, 2
# >>> heads = N * (4 * d * d + 2 * d * d)  # self-attention Q, K, V, O and cross-attention Q, O
# >>> ffn, generator = N * 2 * d * d_ff, d * V
# >>> heads, ffn, generator, round(heads / (heads + ffn + generator), 2)
# (196608, 262144, 640000, 0.18)
#
# (The attention scores over the `T` earlier positions add `2 T d_model` per
# layer and kind, which pruning also shrinks.) Removing a third of the heads
# therefore removes only a few per cent of the arithmetic of a decoding step
# of so small a model, and the number of PyTorch calls per step, each with a
# cost of its own, does not change at all (a fused attention with 3 heads
# makes as many calls as one with 4).


# %%
def timed_translation(
    model: EncoderDecoder, sources: list[list[int]], beam_size: int, length_penalty: float, progress: bool = False
) -> tuple[list[list[int]], float]:
    """(output ids, sentences per second) of translating `sources` with `translate_ids`."""
    start = time.perf_counter()
    out = translate_ids(model, sources, beam_size, length_penalty, progress=progress)
    return out, len(sources) / (time.perf_counter() - start)


def alternating_speed(
    models: dict[str, EncoderDecoder],
    sources: list[list[int]],
    beam_size: int,
    length_penalty: float,
    rounds: int,
    progress: bool = False,
) -> dict[str, list[float]]:
    """{name: [sentences per second in each round]}: every model translates `sources` once per round, in an
    order that is reversed every other round."""
    names = list(models)
    speeds: dict[str, list[float]] = {name: [] for name in models}
    for r in tracked(range(rounds), rounds, "timing", "round", progress):
        for name in names if r % 2 == 0 else names[::-1]:
            speeds[name].append(timed_translation(models[name], sources, beam_size, length_penalty)[1])
    return speeds


def speed_ratio(fast: list[float], base: list[float]) -> float:
    """Median over rounds of `fast[r] / base[r]` (speeds of the same round).

    >>> speed_ratio([2.0, 3.0, 1.0], [1.0, 2.0, 1.0])
    1.5
    """
    if len(fast) != len(base) or not fast:
        raise ValueError(f"need one speed per round for both models, got {len(fast)} and {len(base)}")
    return statistics.median(f / b for f, b in zip(fast, base))
