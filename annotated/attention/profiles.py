# %% [markdown]
# # Inspecting a head: two matrices and where it looks
#
# What a head does is written in its four matrices. Leaving biases aside,
# the score between a query at position `a` and a key at position `b` is
#
# $$s_{ab} = \frac{(x_a W_Q^{(i)})(x_b W_K^{(i)})^\top}{\sqrt{d_k}} = \frac{x_a\, \big(W_Q^{(i)} W_K^{(i)\top}\big)\, x_b^\top}{\sqrt{d_k}}$$
#
# a bilinear form with the `d_model x d_model` matrix `W_Q[i] W_K[i]^T`.
# It factors through `d_k` dimensions, so its rank is at most `d_k`: a head
# can compare positions along at most `d_k` directions. Its **singular
# values** say how many it really uses: one dominant value means the head
# looks for one feature (a position, a kind of word).
#
# Once head `i` has chosen where to look, what it adds to the output of the
# attention for a chosen position `b` is `x_b W_V[i] W_O[i]` (plus biases):
# the **value-output map** `W_V[i] W_O[i]`, also `d_model x d_model`, of rank
# at most `d_v`. Its singular values say how much, and along how many
# directions, the head writes.
#
# Matrices do not say where a head looks in real sentences. Measures of its
# attention on validation sentences do (section 2), and a label is given
# only when a measure clears a stated threshold (section 3).

# %%
from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import torch
from matplotlib.figure import Figure
from torch import Tensor

from annotated.attention.dump import teacher_forced_attention
from annotated.attention.pictures import figure
from annotated.plumbing.progress import tracked
from annotated.sites import KINDS, attention_at, sites
from annotated.tokens import PAD
from annotated.transformer import EncoderDecoder, head_blocks, target_mask

# %% [markdown]
# ## 1. Singular values of the bilinear form and of the value-output map
#
# We compute them in float64 from the per-head blocks (`head_blocks`, either
# form). Values beyond `d_k` (or `d_v`) are zero up to rounding, which is the
# rank bound; we keep the first `d_k` (`d_v`):
#
# >>> from annotated.transformer import FusedAttention
# >>> att = FusedAttention(d_model=16, h=4).double()
# >>> s = torch.linalg.svdvals(head_blocks(att, "W_Q")[0] @ head_blocks(att, "W_K")[0].T)  # all 16 singular values
# >>> bool(s[att.d_k:].abs().max() < 1e-12 * s[0]), tuple(bilinear_spectra(att)["qk"].shape)
# (True, (4, 4))


# %%
@torch.no_grad()
def bilinear_spectra(att) -> dict[str, Tensor]:
    """{"qk": (h, d_k) singular values of W_Q[i] W_K[i]^T, "vo": (h, d_v) of W_V[i] W_O[i]}."""
    W_Q, W_K, W_V, W_O = (head_blocks(att, name) for name in ("W_Q", "W_K", "W_V", "W_O"))  # head i's block at [i]
    assert W_Q is not None and W_K is not None and W_V is not None and W_O is not None  # weights are never None
    qk = torch.linalg.svdvals(W_Q.double() @ W_K.double().transpose(1, 2))[:, : att.d_k]  # (h, d_k)
    vo = torch.linalg.svdvals(W_V.double() @ W_O.double())[:, : att.d_v]  # (h, d_v)
    return {"qk": qk.cpu(), "vo": vo.cpu()}


# %% [markdown]
# ## 2. Measures of where a head looks
#
# One teacher-forced pass per batch gives every head's attention
# probabilities `p` of shape `(B, h, T_q, T_k)`. Only real (non-pad) query
# positions count, and every measure is compared with what **uniform
# attention** (every visible key weighted `1/n`, `n` the number of keys the
# query may see) would give on the same sentences:
#
# * **entropy**: `H(p_q) / log n` per query, averaged over queries with
#   `n > 1`: 1 for uniform attention, 0 for attention on one key;
# * **weight by key offset** `k - q` (`-1`: the previous token, `0`: the same
#   position, `+1`: the next) for offsets `-window ... +window`, and uniform's
#   weight at each offset (`1/n` where that key exists, else 0);
# * **weight on the last source token** (encoder self-attention and
#   cross-attention; the project's sources carry no end-of-sentence token, so
#   the last source token, usually the final full stop, is what `</s>` is in
#   other models) and **on the first key** (`<s>` in decoder
#   self-attention), each with uniform's `1/n`;
# * **diagonal share** (cross-attention): the share of target positions `q`
#   whose most attended source position lies within `DIAGONAL_BAND` of the
#   diagonal `q (S - 1) / (T - 1)` (`T` target, `S` source positions).
#
# For cross-attention the offset compares a target position with a source
# position, which is meaningful only as far as the two sentences run in
# parallel; the diagonal share scales one length to the other.

# %%
DIAGONAL_BAND = 0.1  # a target position is "on the diagonal" within max(1, 0.1 S) source positions


def attention_sums(p: Tensor, kind: str, src_len: Tensor, tgt_len: Tensor, window: int) -> dict[str, Tensor]:
    """Sums over the real queries of one batch of one attention's probabilities `p` (B, h, T_q, T_k).

    `src_len`, `tgt_len` (B,): real source and target-input positions. `summarise` turns sums into means.
    """
    p = p.double()
    B, h, T_q, T_k = p.shape
    q_pos = torch.arange(T_q, device=p.device)  # (T_q,)
    k_pos = torch.arange(T_k, device=p.device)  # (T_k,)
    real = q_pos[None, :] < (src_len if kind == "enc_self" else tgt_len)[:, None]  # (B, T_q)
    if kind == "dec_self":
        visible = (k_pos[None, None, :] <= q_pos[None, :, None]).expand(B, T_q, T_k)  # (B, T_q, T_k) causal
    else:
        visible = (k_pos[None, :] < src_len[:, None])[:, None, :].expand(B, T_q, T_k)  # (B, T_q, T_k)
    n = visible.sum(-1).double()  # (B, T_q) keys each query may see
    w = real.double()  # (B, T_q) 1 for a query that counts
    uniform = visible.double() / n.clamp(min=1)[..., None]  # (B, T_q, T_k)

    off = k_pos[None, :] - q_pos[:, None]  # (T_q, T_k)
    onehot = (off[..., None] == torch.arange(-window, window + 1, device=p.device)).double()  # (T_q, T_k, 2W+1)
    offsets = torch.einsum("bhqk,qkd,bq->hd", p, onehot, w)  # (h, 2W+1)
    uniform_offsets = torch.einsum("bqk,qkd,bq->d", uniform, onehot, w)  # (2W+1,)

    plogp = torch.where(p > 0, p * p.clamp(min=1e-300).log(), torch.zeros_like(p))  # (B, h, T_q, T_k)
    several = w * (n > 1)  # (B, T_q) queries with a choice
    entropy = torch.einsum("bhq,bq->h", -plogp.sum(-1) / n.clamp(min=2).log()[:, None, :], several)  # (h,)

    first = torch.einsum("bhq,bq->h", p[..., 0], w)  # (h,)
    ones = torch.einsum("bq,bq->", 1 / n.clamp(min=1), w)  # (): uniform's weight on any one visible key

    sums = {
        "queries": w.sum(),
        "offsets": offsets,
        "uniform_offsets": uniform_offsets,
        "entropy": entropy,
        "entropy_queries": several.sum(),
        "first": first,
        "uniform_first": ones,
    }
    if kind != "dec_self":
        last_idx = (src_len - 1).clamp(min=0).view(B, 1, 1, 1).expand(B, h, T_q, 1)  # (B, h, T_q, 1)
        last = torch.einsum("bhq,bq->h", p.gather(-1, last_idx).squeeze(-1), w)  # (h,)
        sums.update(last=last, uniform_last=ones)
    if kind == "cross":
        diag = q_pos[None, :] * (src_len[:, None] - 1) / (tgt_len[:, None] - 1).clamp(min=1)  # (B, T_q)
        band = (DIAGONAL_BAND * src_len.double()).clamp(min=1.0)[:, None]  # (B, 1)
        hit = ((p.argmax(-1) - diag[:, None, :]).abs() <= band[:, None, :]).double()  # (B, h, T_q)
        sums["diagonal"] = torch.einsum("bhq,bq->h", hit, w)  # (h,)
    return sums


def summarise(sums: dict[str, Tensor]) -> dict[str, np.ndarray]:
    """Means per real query (entropy: per query with more than one key) of `attention_sums`' sums."""
    means = [k for k in sums if k not in ("queries", "entropy_queries")]  # those two are the denominators
    count = {k: float(sums["entropy_queries" if k == "entropy" else "queries"]) for k in means}
    return {k: (sums[k] / max(count[k], 1.0)).cpu().numpy() for k in means}


@torch.no_grad()
def position_profiles(
    model: EncoderDecoder, batches: Iterable, window: int = 4, progress: bool = False
) -> dict[str, list[dict[str, np.ndarray]]]:
    """{kind: [summarise(...) per layer]}: the measures above over all `batches` (objects with .src, .tgt)."""
    model = model.eval()
    device = next(model.parameters()).device
    batches = list(batches)
    sums: dict = {}
    for b in tracked(batches, len(batches), "attention measures", "batch", progress):
        src, tgt_in = b.src.to(device), b.tgt[:, :-1].to(device)  # (B, S), (B, T)
        src_len, tgt_len = (src != PAD).sum(-1), (tgt_in != PAD).sum(-1)  # (B,), (B,)
        for (kind, layer), p in teacher_forced_attention(model, src, tgt_in, target_mask(tgt_in, PAD)).items():
            batch_sums = attention_sums(p, kind, src_len, tgt_len, window)
            old = sums.get((kind, layer))
            sums[(kind, layer)] = batch_sums if old is None else {k: old[k] + v for k, v in batch_sums.items()}
    return {kind: [summarise(sums[(kind, l)]) for l in range(model.config.N)] for kind in KINDS}


def profile_rows(measures: dict[str, np.ndarray]) -> np.ndarray:
    """(h, 2 window + 2): each head's weight per offset, then on the last source token (nan for dec_self)."""
    h = measures["offsets"].shape[0]
    last = measures.get("last", np.full(h, math.nan))  # (h,)
    return np.concatenate([measures["offsets"], last[:, None]], axis=1)


# %% [markdown]
# ## 3. A label, only where a measure says so
#
# A flat head over a 14-token sentence puts 0.07 on the previous token, and
# on every other; so a head gets a label only when a measure clears uniform
# attention's value by a stated amount. `head_label` tries the rules in order;
# docs/heads.md#labels tabulates them with their constants. `positional
# (offset -1)` is Voita et al.'s (ACL 2019) head looking at the previous
# token (`test_labels_of_constructed_heads` builds heads of every label).

# %%
DIFFUSE_ENTROPY = 0.9
MARGIN = 0.25
MONOTONIC_SHARE = 0.6


def head_label(measures: dict[str, np.ndarray], head: int, kind: str) -> str:
    """The label of head `head` of one attention from its `summarise` measures, by the first rule that holds.

    >>> m = {"entropy": np.array([0.95]), "offsets": np.array([[0.07, 0.07, 0.07]]),
    ...      "uniform_offsets": np.array([0.07, 0.07, 0.0]), "first": np.array([0.07]), "uniform_first": 0.07}
    >>> head_label(m, 0, "enc_self")
    'diffuse'
    """
    if measures["entropy"][head] >= DIFFUSE_ENTROPY:
        return "diffuse"
    if "last" in measures and measures["last"][head] >= measures["uniform_last"] + MARGIN:
        return "aligns to the last source token"
    if measures["first"][head] >= measures["uniform_first"] + MARGIN:
        return "aligns to <s>" if kind == "dec_self" else "aligns to the first source token"
    if "diagonal" in measures and measures["diagonal"][head] >= MONOTONIC_SHARE:
        return "monotonic alignment"
    excess = measures["offsets"][head] - measures["uniform_offsets"]  # (2W+1,)
    best = int(excess.argmax())
    if excess[best] >= MARGIN:
        return f"positional (offset {best - (len(excess) - 1) // 2:+d})"
    return "mixed"


def head_labels(profiles: dict[str, list[dict[str, np.ndarray]]]) -> dict[str, list[list[str]]]:
    """{kind: [[label per head] per layer]} of `position_profiles`' result."""
    return {
        kind: [[head_label(m, i, kind) for i in range(len(m["entropy"]))] for m in layers]
        for kind, layers in profiles.items()
    }


# %% [markdown]
# ## 4. One page
#
# One row per attention, three panels: the two spectra of section 1, each
# divided by the head's largest (the panels compare how many directions a
# head uses, not its scale), and the mean attention by key offset next to
# uniform attention's (dashed).


# %%
def _spectrum_panel(ax, spectra: Tensor, what: str, kind: str, layer: int) -> None:
    for i, s in enumerate(spectra):
        s = s.numpy()
        ax.semilogy(range(1, len(s) + 1), s / s[0], marker=".", label=f"head {i} (largest {s[0]:.2g})")
    ax.set_xlabel("singular value, largest first", fontsize=8)
    ax.set_ylabel("divided by the largest", fontsize=8)
    ax.set_title(f"{kind} layer {layer}: singular values of {what}", fontsize=9)
    ax.legend(fontsize=6)


def _profile_panel(ax, measures: dict[str, np.ndarray], labels: list[str], window: int, kind: str, layer: int) -> None:
    offsets = list(range(-window, window + 1)) + [window + 1.5]
    uniform = list(measures["uniform_offsets"]) + [float(measures.get("uniform_last", math.nan))]
    ax.plot(offsets, uniform, "k--", label="uniform attention")
    for i, row in enumerate(profile_rows(measures)):
        ax.plot(offsets, row, marker="o", label=f"head {i}: {labels[i]}")
    ax.set_xticks(offsets, [str(o) for o in range(-window, window + 1)] + ["last"], fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_xlabel("key offset k - q (last: the last source token)", fontsize=8)
    ax.set_ylabel("mean attention weight", fontsize=8)
    ax.set_title(f"{kind} layer {layer}: mean attention by key offset", fontsize=9)
    ax.legend(fontsize=6)


def inspect_figure(
    model: EncoderDecoder, profiles: dict[str, list[dict[str, np.ndarray]]], window: int, title: str = ""
) -> Figure:
    rows = sites(model)
    labels = head_labels(profiles)
    fig = figure(figsize=(14, 2.6 * len(rows) + 0.6))
    axes = fig.subplots(len(rows), 3, squeeze=False)
    for r, (kind, layer) in enumerate(rows):
        spectra = bilinear_spectra(attention_at(model, kind, layer))
        _spectrum_panel(axes[r, 0], spectra["qk"], "W_Q[i] W_K[i]^T", kind, layer)
        _spectrum_panel(axes[r, 1], spectra["vo"], "W_V[i] W_O[i]", kind, layer)
        _profile_panel(axes[r, 2], profiles[kind][layer], labels[kind][layer], window, kind, layer)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig
