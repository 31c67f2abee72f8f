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

import dataclasses
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from annotated.plumbing.checkpoint import save_checkpoint
from annotated.sites import attention_at, head_counts, remove_heads, sites
from annotated.transformer import EncoderDecoder, convert_model

# %% [markdown]
# ## 1. Greedy pruning by importance
#
# Michel et al. prune iteratively: score the heads, remove the least
# important, score again on the smaller model, and so on. They divide each
# layer's scores by their L2 norm before comparing heads of different layers.
# We rank by the scores themselves: with only `h = 4` heads per attention,
# the normalisation gives every attention scores of about `0.5` whether its
# heads matter or not. On the `cpu` preset model (500 validation sentences)
# the raw scores rank the 24 heads almost exactly as the measured loss
# increase without each head does (Spearman correlation 0.97), the
# normalised ones hardly (0.33). Both are in `heads.json`.
#
# The loop below removes **one head at a time**, the least important first,
# recomputing the scores after each removal, and measures validation BLEU
# each time. It stops at the first removal that would lose more than
# `threshold` BLEU against the unpruned model, and keeps the model from just
# before it: one path, in the order the scores give, with one stopping point
# chosen by BLEU. (Trying every head in turn and keeping each removal that
# passes would be a search over many subsets of heads, and the subset that
# does best on a few hundred sentences does so partly by chance.) Every
# attention keeps at least one head: an attention with none would be the
# constant `b_O`, which the attention modules cannot represent (they need
# `h >= 1`).
#
# Validation BLEU on a few hundred sentences moves by a fraction of a point
# from one small change to the next, so even the stopping point fits those
# sentences a little. The honest figure is the test BLEU of the final model,
# measured once on data the search never saw.

# %%
@dataclass
class Removal:
    kind: str
    layer: int
    head: int                    # the head's index in the unpruned model
    score: float                 # its importance when it was tried
    val_bleu: float              # validation BLEU of the model without it (and all earlier removals)
    kept: bool = True            # False: the removal that crossed the threshold (undone; the search ended)


@dataclass
class PruneResult:
    model: EncoderDecoder
    baseline_bleu: float
    steps: list[Removal] = field(default_factory=list)

    @property
    def removed(self) -> list[Removal]:
        return [s for s in self.steps if s.kept]


def greedy_prune(model: EncoderDecoder, val_bleu: Callable[[EncoderDecoder], float],
                 importance: Callable[[EncoderDecoder], dict], threshold: float = 0.5,
                 progress: bool = False, baseline: Optional[float] = None) -> PruneResult:
    """Remove heads, least important first, until validation BLEU would drop more than `threshold`."""
    if not threshold >= 0:
        raise ValueError(f"threshold must be >= 0 BLEU, got {threshold}")
    baseline = val_bleu(model) if baseline is None else baseline
    original = {site: list(range(attention_at(model, *site).h)) for site in sites(model)}
    result, current = PruneResult(model, baseline), model
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=sum(len(v) - 1 for v in original.values()), desc="pruning", leave=False)
    while True:
        scores = importance(current)
        candidates = [(scores[k][l][i], (k, l), i) for k, l in sites(current)
                      for i in range(attention_at(current, k, l).h) if attention_at(current, k, l).h > 1]
        if not candidates:
            break
        score, site, i = min(candidates)
        trial = remove_heads(current, {site: [i]})
        bleu = val_bleu(trial)
        step = Removal(site[0], site[1], original[site][i], score, bleu, kept=baseline - bleu <= threshold)
        result.steps.append(step)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(val_bleu=f"{bleu:.2f}")
        if not step.kept:
            break
        original[site].pop(i)
        current = result.model = trial
    if bar is not None:
        bar.close()
    return result


# %% [markdown]
# ## 2. A pruned checkpoint
#
# The model configuration has one `h` for every attention, and a pruned model
# breaks that rule. The smallest honest record of the difference is the list
# of head counts itself: the checkpoint keeps the unpruned configuration,
# and a top-level entry `"heads"` holds `{kind: [h of layer 0, layer 1,
# ...]}`. The project's one loader, `checkpoint.load_checkpoint`, checks the
# configuration and those counts, builds the model, gives each attention its
# number of heads (`set_head_counts`), and only then loads the parameters,
# strictly, so every block must fit. So the translator, `make attention` and
# `make equivalence` take a pruned checkpoint like any other. The attention modules
# themselves never needed a global `h`: `fuse`, `split`, decoding and the
# key/value cache all read each module's own `h`.

# %%
def count_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (a tied embedding table counts once)."""
    return sum(p.numel() for p in model.parameters())


def save_pruned(path: os.PathLike | str, model: EncoderDecoder, tokenizer, meta: Optional[dict] = None) -> None:
    """Save `model` as a fused checkpoint; non-uniform head counts go to the checkpoint's "heads" entry."""
    fused = convert_model(model, "fused")
    counts = head_counts(fused)
    uniform = all(h == fused.config.h for hs in counts.values() for h in hs)
    save_checkpoint(path, fused, tokenizer, meta, **({} if uniform else {"heads": counts}))


# %% [markdown]
# ## 3. Speed
#
# Decoding speed is measured as sentences translated per second over a whole
# test set, with the project's one decoder (`translate_ids`), timed with
# `time.perf_counter`. On a shared or busy machine such figures move from
# run to run, and other work slows a timing down but never speeds it up. The
# command therefore times the unpruned and the pruned model in the same
# process, on the same sentences, alternately for a few rounds, and keeps the
# fastest round of each.
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
def timed_translation(model: EncoderDecoder, sources: list[list[int]], beam_size: int, length_penalty: float,
                      progress: bool = False) -> tuple[list[list[int]], float]:
    """(output ids, sentences per second) of translating `sources` with `translate_ids`."""
    from annotated.decoding.search import translate_ids

    start = time.perf_counter()
    out = translate_ids(model, sources, beam_size, length_penalty, progress=progress)
    return out, len(sources) / (time.perf_counter() - start)


def removal_table(result: PruneResult) -> list[dict]:
    """The steps of a search as JSON-ready rows."""
    return [dataclasses.asdict(s) for s in result.steps]
