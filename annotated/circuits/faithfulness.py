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
# # How much of a head do its weights explain? Faithfulness, measured
#
# The direct path of `annotated/circuits/direct.py` predicts, from the
# weights and the embeddings alone, a score for every query and key of a
# sentence. The model's real attention is computed from the whole residual
# stream. For each head we compare the two on validation sentences, query by
# query, over the keys the query may see:
#
# * **rank correlation** (Spearman's rho): does the weights-only reading
#   order the keys as the head's attention does? 1 is the same order;
# * **argmax agreement**: is the key the reading ranks first the one the
#   head attends to most?
#
# The head's attention is the softmax of its scores, which keeps their
# order, so both are measured against the model's real scores (recorded with
# `attention_inputs`, equal to the model's by
# `test_circuit_scores_are_the_models_scores`) rather than its probabilities:
# in float32 the weights of far-off keys underflow to exact zeros, and ties
# among them would count as disagreement.
#
# Each is averaged over a sentence's queries, then over sentences, with a
# 95% bootstrap interval over sentences (`mean_interval` of
# `annotated/attention/bootstrap.py`). Where the direct path is exact (the
# first layer's self-attentions of a post-norm model), both are 1 up to
# rounding (`test_faithfulness_is_one_where_the_direct_path_is_exact`); a
# head that scores low there needs its context: what earlier layers wrote is
# what it reads.

# %%
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from annotated.attention.bootstrap import RESAMPLES, SEED, Change, mean_interval
from annotated.circuits.circuits import attention_inputs, circuits
from annotated.circuits.direct import SIDES, sentence_vectors
from annotated.sites import Site
from annotated.transformer import EncoderDecoder, padding_mask, target_mask

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
# ## 2. Every head, over sentences


# %%
@dataclass(frozen=True)
class Faithfulness:
    """One head: the mean per-sentence rank correlation and argmax agreement, with intervals."""

    rho: Change
    argmax: Change


def _allowed(kind: str, src: Tensor, tgt: Tensor, pad: int) -> Tensor:
    mask = {"enc_self": padding_mask(src, pad), "cross": padding_mask(src, pad), "dec_self": target_mask(tgt, pad)}
    q = src if kind == "enc_self" else tgt
    T_k = src.size(1) if kind != "dec_self" else tgt.size(1)
    return mask[kind].expand(q.size(0), q.size(1), T_k) & (q != pad).unsqueeze(-1)  # (B, T_q, T_k)


@torch.no_grad()
def faithfulness(
    model: EncoderDecoder,
    batches: Iterable[tuple[Tensor, Tensor]],
    pad: int,
    resamples: int = RESAMPLES,
    seed: int = SEED,
) -> dict[tuple[Site, int], Faithfulness]:
    """For each (site, head): how well the direct path predicts the attention on (src (B, S), tgt (B, T)) batches.

    `tgt` is the decoder's input (BOS first). Each sentence counts once, whatever its length.
    """
    model = model.eval()
    heads = circuits(model)
    per_sentence: dict[tuple[Site, int], tuple[list[float], list[float]]] = {}
    for src, tgt in batches:
        inputs = attention_inputs(model, src, tgt, pad)
        for site, cs in heads.items():
            ids = {"src": src, "tgt": tgt}
            q_side, kv_side = SIDES[site[0]]
            x_q = sentence_vectors(model, site, "q", ids[q_side])  # (B, T_q, d_model)
            x_kv = sentence_vectors(model, site, "kv", ids[kv_side])  # (B, T_k, d_model)
            allowed = _allowed(site[0], src, tgt, pad)
            for c in cs:
                predicted = c.matching(x_q, x_kv)  # (B, T_q, T_k) from the weights and the embeddings
                real = c.matching(*inputs[site])  # (B, T_q, T_k) what the head's softmax sees
                rho, rows = masked_spearman(predicted, real, allowed)
                agree = argmax_agreement(predicted, real, allowed)
                lists = per_sentence.setdefault((site, c.head), ([], []))
                for b in range(src.size(0)):
                    if rows[b].any():
                        lists[0].append(float(rho[b][rows[b]].mean()))
                        lists[1].append(float(agree[b][rows[b]].mean()))
    return {
        key: Faithfulness(mean_interval(np.array(r), resamples, seed), mean_interval(np.array(a), resamples, seed))
        for key, (r, a) in per_sentence.items()
    }
