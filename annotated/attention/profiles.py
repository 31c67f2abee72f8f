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
# # Inspecting a head: two matrices and a habit
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
# Matrices do not say where a head looks in real sentences. The **average
# attention by relative position** does: for every query position `q` of
# every validation sentence, the weight the head gives to the key at offset
# `k - q` (`-1`: the previous token, `0`: the same position, `+1`: the next),
# averaged over all query positions; for encoder self-attention and
# cross-attention also the weight on the *last* source token, the end of the
# sentence. Voita et al. (ACL 2019) call heads with a sharp peak at `-1` or
# `+1` *positional heads*. For cross-attention the offset compares a target
# position with a source position, which is meaningful only as far as the
# two sentences run in parallel.

# %%
from __future__ import annotations

import math
from typing import Iterable

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from torch import Tensor

from annotated.sites import KINDS, attention_at, sites
from annotated.tokens import PAD
from annotated.transformer import EncoderDecoder, FusedAttention, padding_mask, split, target_mask

# %% [markdown]
# ## 1. Singular values of the bilinear form and of the value-output map
#
# We compute them in float64 from the per-head blocks (a fused attention is
# split first, which copies numbers only). Values beyond `d_k` (or `d_v`)
# are zero up to rounding, which is the rank bound; we keep the first `d_k`
# (`d_v`):
#
# >>> att = split(FusedAttention(d_model=16, h=4)).double()
# >>> s = torch.linalg.svdvals(att.W_Q[0] @ att.W_K[0].T)  # all 16 singular values
# >>> bool(s[att.d_k:].abs().max() < 1e-12 * s[0]), tuple(bilinear_spectra(att)["qk"].shape)
# (True, (4, 4))

# %%
@torch.no_grad()
def bilinear_spectra(att) -> dict[str, Tensor]:
    """{"qk": (h, d_k) singular values of W_Q[i] W_K[i]^T, "vo": (h, d_v) of W_V[i] W_O[i]}."""
    per_head = split(att) if isinstance(att, FusedAttention) else att
    qk = [torch.linalg.svdvals(W_Q.double() @ W_K.double().T)[:att.d_k]  # (d_k,)
          for W_Q, W_K in zip(per_head.W_Q, per_head.W_K)]
    vo = [torch.linalg.svdvals(W_V.double() @ W_O.double())[:att.d_v]  # (d_v,)
          for W_V, W_O in zip(per_head.W_V, per_head.W_O)]
    return {"qk": torch.stack(qk).cpu(), "vo": torch.stack(vo).cpu()}  # (h, d_k), (h, d_v)


# %% [markdown]
# ## 2. Average attention by relative position
#
# One teacher-forced pass per batch returns every head's attention
# probabilities `p` of shape `(B, h, T_q, T_k)`. For an offset `d`, the
# weight at that offset is the sum of `p[..., q, k]` over the keys with
# `k - q = d` (zero or one key); offsets from `-window` to `+window` are
# kept, and the rest of the weight is simply not shown. Only real (non-pad)
# query positions count. The result per attention is an `(h, 2 window + 2)`
# array: the offsets, then the weight on the last source token (`nan` for
# decoder self-attention, whose last visible key is the query itself).

# %%
def _offset_mass(p: Tensor, window: int) -> Tensor:
    """(B, h, T_q, T_k) -> (B, h, T_q, 2 window + 1): weight at key offsets -window ... +window."""
    T_q, T_k = p.shape[-2:]
    off = torch.arange(T_k, device=p.device)[None, :] - torch.arange(T_q, device=p.device)[:, None]  # (T_q, T_k)
    onehot = (off[..., None] == torch.arange(-window, window + 1, device=p.device)).to(p.dtype)  # (T_q, T_k, 2W+1)
    return torch.einsum("bhqk,qkd->bhqd", p, onehot)  # (B, h, T_q, 2W+1)


def _last_mass(p: Tensor, src_len: Tensor) -> Tensor:
    """(B, h, T_q, S) -> (B, h, T_q): weight on each sentence's last source token."""
    idx = (src_len - 1).view(-1, 1, 1, 1).expand(*p.shape[:-1], 1)  # (B, h, T_q, 1)
    return p.gather(-1, idx).squeeze(-1)  # (B, h, T_q)


@torch.no_grad()
def position_profiles(model: EncoderDecoder, batches: Iterable, window: int = 4,
                      progress: bool = False) -> dict[str, list[np.ndarray]]:
    """{kind: [(h, 2 window + 2) array per layer]}: mean weight per offset, then on the last source token."""
    model = model.eval()
    device = next(model.parameters()).device
    sums = {site: 0.0 for site in sites(model)}
    counts = {"enc_self": 0, "dec_self": 0, "cross": 0}
    if progress:
        from tqdm.auto import tqdm
        batches = tqdm(batches, desc="attention by position", leave=False)
    for b in batches:
        src, tgt_in = b.src.to(device), b.tgt[:, :-1].to(device)  # (B, S), (B, T)
        src_mask = padding_mask(src, PAD)  # (B, 1, S)
        memory, enc = model.encode_with_attention(src, src_mask)
        _, dec_self, cross = model.decode_with_attention(memory, src_mask, tgt_in, target_mask(tgt_in, PAD))
        src_real, tgt_real = (src != PAD), (tgt_in != PAD)  # (B, S), (B, T)
        src_len = src_real.sum(-1)  # (B,)
        for kind, ps, real in (("enc_self", enc, src_real), ("dec_self", dec_self, tgt_real), ("cross", cross, tgt_real)):
            counts[kind] += int(real.sum())
            for layer, p in enumerate(ps):
                p = p.double()  # (B, h, T_q, T_k)
                mass = _offset_mass(p, window)  # (B, h, T_q, 2W+1)
                last = _last_mass(p, src_len) if kind != "dec_self" else torch.full_like(mass[..., 0], math.nan)
                both = torch.cat([mass, last[..., None]], dim=-1) * real[:, None, :, None]  # (B, h, T_q, 2W+2)
                sums[(kind, layer)] = sums[(kind, layer)] + both.sum(dim=(0, 2)).cpu()  # (h, 2W+2)
    if not all(counts.values()):
        raise ValueError("position_profiles needs at least one batch with a non-pad token")
    return {kind: [(sums[(kind, l)] / counts[kind]).numpy() for l in range(model.config.N)] for kind in KINDS}


def habit(profile: np.ndarray, window: int) -> str:
    """A few words for one head's (2 window + 2,) profile: its strongest offset (or the last token) and weight.

    >>> habit(np.array([0.0, 0.7, 0.2, 0.1, 0.0, 0.05]), window=2)  # offsets -2 ... +2, then the last token
    'previous token 0.70'
    """
    names = {-1: "previous token", 0: "same position", 1: "next token"}
    values = np.nan_to_num(profile, nan=-1.0)
    best = int(values.argmax())
    if best == 2 * window + 1:
        return f"last source token {profile[best]:.2f}"
    offset = best - window
    return f"{names.get(offset, f'offset {offset:+d}')} {profile[best]:.2f}"


# %% [markdown]
# ## 3. One page
#
# One row per attention (`enc_self`, `dec_self`, `cross`, layer by layer),
# three panels per row: the singular values of `W_Q[i] W_K[i]^T`, those of
# `W_V[i] W_O[i]` (one line per head, largest first, log scale), and the
# average attention by relative position (one line per head; the point at
# the right edge is the last source token).

# %%
def inspect_figure(model: EncoderDecoder, profiles: dict[str, list[np.ndarray]], window: int,
                   title: str = "") -> Figure:
    rows = sites(model)
    fig = Figure(figsize=(13, 2.3 * len(rows) + 0.6))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(rows), 3, squeeze=False)
    offsets = list(range(-window, window + 1)) + [window + 1.5]
    for r, (kind, layer) in enumerate(rows):
        att = attention_at(model, kind, layer)
        spectra = bilinear_spectra(att)
        for c, (key, label) in enumerate((("qk", "W_Q[i] W_K[i]^T"), ("vo", "W_V[i] W_O[i]"))):
            ax = axes[r, c]
            for i, s in enumerate(spectra[key]):
                ax.semilogy(range(1, len(s) + 1), s.numpy(), marker=".", label=f"head {i}")
            ax.set_title(f"{kind} layer {layer}: singular values of {label}", fontsize=9)
        ax = axes[r, 2]
        for i, prof in enumerate(profiles[kind][layer]):
            ax.plot(offsets, prof, marker="o", label=f"head {i}")
        ax.set_xticks(offsets, [str(o) for o in range(-window, window + 1)] + ["last"], fontsize=8)
        ax.set_ylim(0, 1)
        ax.set_title(f"{kind} layer {layer}: mean attention by key offset k - q", fontsize=9)
        axes[r, 0].legend(fontsize=7, ncol=2)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def save_figure(fig: Figure, path) -> None:
    from annotated.plumbing.files import atomic_write

    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=90))
