# %% [markdown]
# # How much of a head do its weights explain? Faithfulness, measured
#
# For each head we compare the direct path's predicted scores with the
# model's real scores (recorded with `attention_inputs`; the softmax keeps
# their order, and far-off keys' probabilities underflow to tied zeros in
# float32) on validation sentences, query by query, over the keys the query
# may see (`allowed_keys`;
# `test_argmax_agreement_never_counts_a_key_the_query_may_not_see`,
# `test_a_sentences_faithfulness_does_not_depend_on_how_its_batch_is_padded`):
# **rank correlation** (Spearman's rho: does the reading order the keys as
# the head does?) and **argmax agreement** (is its first key the head's?),
# for both readings (`READINGS`). The gap between the two is what the
# weights-only shortcuts through the LayerNorms cost; what the exact reading
# misses is what the sublayers wrote
# (`test_the_exact_norms_reading_is_the_heads_input_when_the_sublayers_write_nothing`).
# Each is averaged over a sentence's queries, then over sentences, with a
# 95% bootstrap interval (`mean_interval`).

# %%
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from annotated.attention.bootstrap import RESAMPLES, SEED, Change, mean_interval
from annotated.circuits.circuits import allowed_keys, attention_inputs, circuits
from annotated.circuits.direct import SIDES, exact_sentence_vectors, norm_divisors, sentence_vectors
from annotated.circuits.fold import fold_layer_norms
from annotated.sites import Site
from annotated.transformer import EncoderDecoder

# %% [markdown]
# ## 1. Rank correlation over the keys a query may see
#
# Ranks are counted among the allowed keys only (`allowed`, `(B, T_q, T_k)`):
# a key's rank is its place among the allowed keys in increasing order. rho is then the
# correlation of the two rank vectors, for each query row with at least two
# allowed keys (`test_masked_spearman_is_scipys_on_each_row`).


# %%
def _ranks(x: Tensor, allowed: Tensor) -> Tensor:
    """Rank of each allowed entry among the allowed entries of its row (0 = lowest); (B, T_q, T_k).

    The entries a row may not see are set below every other and sorted first, then taken off the rank.
    """
    lowest = torch.finfo(x.dtype).min
    order = x.masked_fill(~allowed, lowest).argsort(dim=-1, stable=True).argsort(dim=-1)  # (B, T_q, T_k)
    return (order - (~allowed).sum(-1, keepdim=True)).to(torch.float64)


def masked_spearman(a: Tensor, b: Tensor, allowed: Tensor) -> tuple[Tensor, Tensor]:
    """Per row: Spearman's rho of a and b over the allowed keys, and which rows have >= 2 of them; (B, T_q) each."""
    n = allowed.sum(-1)  # (B, T_q)
    rows = n >= 2
    ra, rb = _ranks(a, allowed), _ranks(b, allowed)  # (B, T_q, T_k)
    mean = lambda r: (r * allowed).sum(-1, keepdim=True) / n.clamp(min=1).unsqueeze(-1)
    da, db = (ra - mean(ra)) * allowed, (rb - mean(rb)) * allowed
    rho = (da * db).sum(-1) / ((da * da).sum(-1) * (db * db).sum(-1)).sqrt().clamp(min=1e-300)
    return rho, rows


def argmax_agreement(a: Tensor, b: Tensor, allowed: Tensor) -> Tensor:
    """Per row: 1.0 where a and b have their largest allowed entry at the same key; (B, T_q)."""
    never = torch.finfo(a.dtype).min
    pick = lambda x: x.masked_fill(~allowed, never).argmax(-1)
    return (pick(a) == pick(b)).to(torch.float64)


# %% [markdown]
# ## 2. The two readings of one batch
#
# `predicted_scores` gives, for each reading, each head's predicted
# matching scores (the bilinear term and the key bias, what the softmax
# sees) on one batch; the folded model is built once by the caller.


# %%
READINGS = ("weights_only", "exact_norms")
Scores = dict[tuple[Site, int], Tensor]  # (site, head) -> (B, T_q, T_k)


@torch.no_grad()
def predicted_scores(
    model: EncoderDecoder, folded: EncoderDecoder, src: Tensor, tgt: Tensor, pad: int
) -> dict[str, Scores]:
    """{reading: {(site, head): predicted scores (B, T_q, T_k)}} for src (B, S) and the decoder's input tgt (B, T)."""
    divisors = norm_divisors(model, src, tgt, pad)  # the real pass's
    ids = {"src": src, "tgt": tgt}
    out: dict[str, Scores] = {r: {} for r in READINGS}
    heads = {"weights_only": circuits(model), "exact_norms": circuits(folded)}
    for site in heads["weights_only"]:
        q_side, kv_side = SIDES[site[0]]
        inputs = {
            "weights_only": (
                sentence_vectors(model, site, "q", ids[q_side]),
                sentence_vectors(model, site, "kv", ids[kv_side]),
            ),
            "exact_norms": (
                exact_sentence_vectors(folded, site, "q", ids[q_side], divisors),
                exact_sentence_vectors(folded, site, "kv", ids[kv_side], divisors),
            ),
        }
        for reading in READINGS:
            for c in heads[reading][site]:
                out[reading][(site, c.head)] = c.matching(*inputs[reading])  # (B, T_q, T_k)
    return out


# %% [markdown]
# ## 3. Every head, over sentences


# %%
@dataclass(frozen=True)
class Faithfulness:
    """One head: the mean per-sentence rank correlation and argmax agreement, with intervals."""

    rho: Change
    argmax: Change


@torch.no_grad()
def faithfulness(
    model: EncoderDecoder,
    batches: Iterable[tuple[Tensor, Tensor]],
    pad: int,
    resamples: int = RESAMPLES,
    seed: int = SEED,
) -> dict[tuple[Site, int], dict[str, Faithfulness]]:
    """For each (site, head) and each of `READINGS`: how well that reading of the direct path predicts the
    attention on (src (B, S), tgt (B, T)) batches.

    `tgt` is the decoder's input (BOS first). Each sentence counts once, whatever its length.
    """
    model = model.eval()
    folded = fold_layer_norms(model)
    heads = circuits(model)
    per_sentence: dict[tuple[str, Site, int], tuple[list[float], list[float]]] = {}
    for src, tgt in batches:
        inputs = attention_inputs(model, src, tgt, pad)
        predicted = predicted_scores(model, folded, src, tgt, pad)
        for site, cs in heads.items():
            allowed = allowed_keys(site[0], src, tgt, pad)
            for c in cs:
                real = c.matching(*inputs[site])  # (B, T_q, T_k) what the head's softmax sees
                for reading in READINGS:
                    guess = predicted[reading][(site, c.head)]  # (B, T_q, T_k) from the embeddings
                    rho, rows = masked_spearman(guess, real, allowed)
                    agree = argmax_agreement(guess, real, allowed)
                    lists = per_sentence.setdefault((reading, site, c.head), ([], []))
                    for b in range(src.size(0)):
                        if rows[b].any():
                            lists[0].append(float(rho[b][rows[b]].mean()))
                            lists[1].append(float(agree[b][rows[b]].mean()))
    out: dict[tuple[Site, int], dict[str, Faithfulness]] = {}
    for (reading, site, head), (r, a) in per_sentence.items():
        out.setdefault((site, head), {})[reading] = Faithfulness(
            mean_interval(np.array(r), resamples, seed), mean_interval(np.array(a), resamples, seed)
        )
    return out
