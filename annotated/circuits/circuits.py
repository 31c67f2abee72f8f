# %% [markdown]
# # What a head's own matrices compute: the QK and OV circuits
#
# The chapter gave queries, keys and values as shapes; this part reads them
# as what they compute. Head `i` uses its four matrices in two products only
# (Elhage et al. 2021, "A Mathematical Framework for Transformer Circuits"):
#
# $$W_{QK}^{(i)} = W_Q^{(i)}\, {W_K^{(i)}}^{\top} \in \mathbb{R}^{d_{model} \times d_{model}},
# \qquad W_{OV}^{(i)} = W_V^{(i)}\, W_O^{(i)} \in \mathbb{R}^{d_{model} \times d_{model}}$$
#
# the **QK circuit** decides *where* the head looks (the score of query `a`
# for key `b` is `x_a W_QK x_b^T / sqrt(d_k)`, and `W_Q[i]`, `W_K[i]` alone
# are not even determined: `W_Q M`, `W_K M^{-T}` give the same head), the
# **OV circuit** *what* it moves (a key attended with probability `p` adds
# `p x_b W_OV`). Both are of rank at most `d_k` (or `d_v`), so we never build
# them: a `Factored` matrix keeps the two factors, as TransformerLens's
# `FactoredMatrix` does.

# %%
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from annotated.sites import Site, attention_at, sites
from annotated.transformer import (
    BLOCKS,
    EncoderDecoder,
    FusedAttention,
    PerHeadAttention,
    head_blocks,
    padding_mask,
    target_mask,
)

# %% [markdown]
# ## 1. A low-rank matrix kept as its factors
#
# `Factored(left, right)` stands for `left @ right`, `(m x r) @ (r x n)`.
# With reduced QR decompositions `left = Q_L R_L` and `right^T = Q_R R_R`,
# `left @ right = Q_L (R_L R_R^T) Q_R^T`, and the orthonormal factors keep
# the singular values: they are those of the small `r x r` core
# (`test_a_circuit_has_rank_at_most_d_k`,
# `test_factored_singular_values_are_the_products`). In the shipped models
# every head uses all of its `d_k = 32` directions, but not evenly.
#
# <!-- figure: circuit_spectra -->


# %%
@dataclass(frozen=True)
class Factored:
    """The matrix left @ right, (m, r) @ (r, n), kept as its factors."""

    left: Tensor  # (m, r)
    right: Tensor  # (r, n)

    @property
    def inner(self) -> int:
        """r: the rank can be at most this."""
        return self.left.size(1)

    def singular_values(self) -> Tensor:
        """The r largest singular values of left @ right (the rest are 0), largest first."""
        _, R_L = torch.linalg.qr(self.left)  # (r, r)
        _, R_R = torch.linalg.qr(self.right.T)  # (r, r)
        return torch.linalg.svdvals(R_L @ R_R.T)  # (r,)

    def rank(self, rtol: float = 1e-6) -> int:
        """The number of singular values above rtol times the largest."""
        s = self.singular_values()
        return int((s > rtol * s[0]).sum()) if s.numel() and s[0] > 0 else 0

    def bilinear(self, x_a: Tensor, x_b: Tensor) -> Tensor:
        """x_a (.., T_a, m) (left @ right) x_b^T, x_b (.., T_b, n): (.., T_a, T_b), through the r inner columns."""
        return (x_a @ self.left) @ (x_b @ self.right.T).transpose(-1, -2)  # (.., T_a, T_b)

    def apply(self, x: Tensor) -> Tensor:
        """x (.., m) @ left @ right: (.., n)."""
        return (x @ self.left) @ self.right  # (.., n)


# %% [markdown]
# ## 2. Head `i`'s matrices, from either form
#
# `head_matrices` takes head `i`'s block of each matrix from the chapter's own
# `head_blocks`, so the per-head and the fused form give the same circuits
# (`test_circuits_of_the_per_head_and_fused_forms_are_equal`).


# %%
def head_matrices(att: PerHeadAttention | FusedAttention, i: int) -> dict[str, Tensor | None]:
    """W_Q, W_K, W_V, W_O and b_Q, b_K, b_V of head i (b_* None without biases)."""
    if not 0 <= i < att.h:
        raise IndexError(f"head {i} does not exist: this attention has heads 0..{att.h - 1}")
    blocks = {name: head_blocks(att, name) for name in BLOCKS}  # (h, ...) each, or None
    return {name: None if b is None else b[i].detach() for name, b in blocks.items()}


# %% [markdown]
# ## 3. The circuits, biases included, term by term
#
# With biases, `q_a = x_a W_Q + b_Q` and `k_b = x_b W_K + b_K`, and
#
# $$q_a k_b^{\top} = x_a W_{QK} x_b^{\top} + x_b\, (W_K b_Q^{\top}) + x_a\, (W_Q b_K^{\top}) + b_Q b_K^{\top}$$
#
# The softmax runs over the keys `b` of one query, so the last two terms
# **cancel in it**: the attention depends on the bilinear term and the **key
# bias** `x_b u`, `u = W_K b_Q^T`, a preference for some keys whatever the
# query (`matching`); the other two only reproduce the raw scores (`scores`).
# A head writes `P X W_OV` plus `ov_bias = b_V W_O` (each row of `P` sums to
# 1, or to 0 when every key is masked, and then it writes nothing:
# `test_a_query_whose_keys_are_all_masked_writes_nothing`); `b_O` belongs to
# no head. On the model's own inputs `scores` is its pre-softmax scores within
# 1e-12 in float64, both forms (`test_circuit_scores_are_the_models_scores`),
# and `writes` head `i`'s term of the output
# (`test_the_ov_circuit_is_what_a_head_writes`).


# %%
@dataclass(frozen=True)
class HeadCircuit:
    """Head `head` of the attention at `site`: its QK and OV circuits with the bias terms."""

    site: Site
    head: int
    QK: Factored  # W_Q W_K^T: (d_model, d_k) @ (d_k, d_model)
    OV: Factored  # W_V W_O: (d_model, d_v) @ (d_v, d_model)
    key_bias: Tensor | None  # u = W_K b_Q^T (d_model,): survives the softmax
    query_bias: Tensor | None  # W_Q b_K^T (d_model,): constant along the keys, cancels
    constant: Tensor | None  # b_Q b_K^T, a number: cancels
    ov_bias: Tensor | None  # b_V W_O (d_model,): written whatever the head reads
    scale: float  # 1 / sqrt(d_k)

    def scores(self, x_q: Tensor, x_kv: Tensor) -> Tensor:
        """The head's raw scores q_a k_b^T / sqrt(d_k) for x_q (B, T_q, d_model), x_kv (B, T_k, d_model)."""
        s = self.QK.bilinear(x_q, x_kv)  # (B, T_q, T_k)
        if self.key_bias is not None:
            s = s + (x_kv @ self.key_bias).unsqueeze(-2)  # x_b u, the same for every query
        if self.query_bias is not None and self.constant is not None:
            s = s + (x_q @ self.query_bias).unsqueeze(-1) + self.constant  # constant along the keys
        return s * self.scale  # (B, T_q, T_k)

    def matching(self, x_q: Tensor, x_kv: Tensor) -> Tensor:
        """The part of the scores the softmax sees: the bilinear term and the key bias, scaled."""
        s = self.QK.bilinear(x_q, x_kv)  # (B, T_q, T_k)
        if self.key_bias is not None:
            s = s + (x_kv @ self.key_bias).unsqueeze(-2)
        return s * self.scale  # (B, T_q, T_k)

    def writes(self, p: Tensor, x_kv: Tensor) -> Tensor:
        """What the head adds to the output for probabilities p (B, T_q, T_k) over x_kv (B, T_k, d_model)."""
        out = p @ self.OV.apply(x_kv)  # (B, T_q, d_model)
        if self.ov_bias is not None:
            out = out + p.sum(-1, keepdim=True) * self.ov_bias  # (P 1) b_V W_O
        return out  # (B, T_q, d_model)


def circuit(att: PerHeadAttention | FusedAttention, i: int, site: Site = ("", 0)) -> HeadCircuit:
    """The circuits of head i of `att`, in the dtype the weights have."""
    m = head_matrices(att, i)
    W_Q, W_K, W_V, W_O = m["W_Q"], m["W_K"], m["W_V"], m["W_O"]
    assert W_Q is not None and W_K is not None and W_V is not None and W_O is not None
    b_Q, b_K, b_V = m["b_Q"], m["b_K"], m["b_V"]
    terms: dict[str, Tensor | None] = dict(key_bias=None, query_bias=None, constant=None, ov_bias=None)
    if b_Q is not None and b_K is not None and b_V is not None:  # all or none: the attention's `bias`
        terms = dict(
            key_bias=W_K @ b_Q,  # (d_model,)
            query_bias=W_Q @ b_K,  # (d_model,)
            constant=b_Q @ b_K,  # ()
            ov_bias=b_V @ W_O,  # (d_model,)
        )
    return HeadCircuit(
        site=site,
        head=i,
        QK=Factored(W_Q, W_K.T),  # W_Q W_K^T
        OV=Factored(W_V, W_O),  # W_V W_O
        scale=1.0 / math.sqrt(att.d_k),
        **terms,
    )


def attentions(model: EncoderDecoder) -> dict[Site, PerHeadAttention | FusedAttention]:
    """Every attention of `model` by site, in the order of `sites`: the one place this part finds them."""
    return {site: attention_at(model, *site) for site in sites(model)}


def circuits(model: EncoderDecoder) -> dict[Site, list[HeadCircuit]]:
    """Every head's circuits, by site, in the order of `sites` (a pruned attention has only its kept heads)."""
    return {site: [circuit(att, i, site) for i in range(att.h)] for site, att in attentions(model).items()}


# %% [markdown]
# ## 4. The inputs each attention reads
#
# To check the circuits against the model, and to read them in context,
# `attention_inputs` records what each attention receives (`x_q` at the
# queries, `x_kv` at the keys) with forward hooks, the way
# `annotated/recording.py` records probabilities. Every pass of this part
# that hooks the model runs through `teacher_forced` (encoder and decoder
# only), which removes the hooks after it.


# %%
@torch.no_grad()
def teacher_forced(
    model: EncoderDecoder, src: Tensor, tgt: Tensor, pad: int, handles: Iterable = (), memory: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The encoder's output (B, S, d_model) (`memory`, when given, in its place) and the decoder's (B, T, d_model)
    for src (B, S) and the decoder's input tgt (B, T); the hooks of `handles` are removed after the pass."""
    try:
        src_mask = padding_mask(src, pad)
        memory = model.encode(src, src_mask) if memory is None else memory
        return memory, model.decode(memory, src_mask, tgt, target_mask(tgt, pad))
    finally:
        for handle in handles:
            handle.remove()


def attention_inputs(model: EncoderDecoder, src: Tensor, tgt: Tensor, pad: int) -> dict[Site, tuple[Tensor, Tensor]]:
    """(x_q (B, T_q, d_model), x_kv (B, T_k, d_model)) of every attention in one pass over src (B, S), tgt (B, T)."""
    seen: dict[Site, tuple[Tensor, Tensor]] = {}

    def recorder(site: Site):
        def hook(att, args, kwargs) -> None:
            x_q = kwargs.get("x_q", args[0] if args else None)
            x_kv = kwargs.get("x_kv", args[1] if len(args) > 1 else None)
            seen[site] = (x_q.detach(), x_kv.detach())

        return hook

    atts = attentions(model).items()
    teacher_forced(model, src, tgt, pad, [a.register_forward_pre_hook(recorder(s), with_kwargs=True) for s, a in atts])
    return seen


def allowed_keys(kind: str, src: Tensor, tgt: Tensor, pad: int) -> Tensor:
    """(B, T_q, T_k): True where a real query of attention `kind` may see a key (no padding, no decoder future)."""
    q = src if kind == "enc_self" else tgt
    mask = target_mask(tgt, pad) if kind == "dec_self" else padding_mask(src, pad)
    T_k = tgt.size(1) if kind == "dec_self" else src.size(1)
    return mask.expand(q.size(0), q.size(1), T_k) & (q != pad).unsqueeze(-1)
