# %% [markdown]
# # What a head's own matrices compute: the QK and OV circuits
#
# The chapter asked what queries, keys and values *are*, and answered with
# shapes: `W_Q[i]`, `W_K[i]` are `d_model x d_k`, `W_V[i]` is `d_model x d_v`,
# `W_O[i]` is `d_v x d_model`. This part reads them as what they compute.
# Head `i` uses its four matrices in two products only (Elhage et al. 2021, "A
# Mathematical Framework for Transformer Circuits"):
#
# $$W_{QK}^{(i)} = W_Q^{(i)}\, {W_K^{(i)}}^{\top} \in \mathbb{R}^{d_{model} \times d_{model}},
# \qquad W_{OV}^{(i)} = W_V^{(i)}\, W_O^{(i)} \in \mathbb{R}^{d_{model} \times d_{model}}$$
#
# * the **QK circuit** decides *where* the head looks: the score of query
#   position `a` for key position `b` is the bilinear form
#   `x_a W_QK x_b^T / sqrt(d_k)`, so `W_QK` is the head's whole notion of
#   "which inputs match"; `W_Q[i]` and `W_K[i]` separately are not even
#   determined (any invertible `d_k x d_k` matrix `M` gives the same head with
#   `W_Q M`, `W_K M^{-T}` and the biases `b_Q M`, `b_K M^{-T}`);
# * the **OV circuit** decides *what* it moves: a key position `b` that the
#   head attends to with probability `p` adds `p x_b W_OV` to the query
#   position's output, so `W_OV` maps "what was read" to "what is written".
#
# Both are `d_model x d_model` but of rank at most `d_k` (or `d_v`): a product
# through `d_k` columns. So we never build them: a `Factored` matrix keeps the
# two factors and computes what we need from them (products with vectors, the
# singular values from two QR decompositions and a `d_k x d_k` SVD), as
# TransformerLens's `FactoredMatrix` does. Tests: `tests/circuits/test_circuits.py`.

# %%
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from annotated.sites import Site, attention_at, sites
from annotated.transformer import BLOCKS, EncoderDecoder, FusedAttention, PerHeadAttention, head_blocks

# %% [markdown]
# ## 1. A low-rank matrix kept as its factors
#
# `Factored(left, right)` stands for `left @ right`, `(m x r) @ (r x n)`. Its
# singular values are those of the small `r x r` core: with `left = Q_L R_L`
# and `right^T = Q_R R_R` (reduced QR decompositions, `Q_L` and `Q_R` with
# orthonormal columns), `left @ right = Q_L (R_L R_R^T) Q_R^T`, and
# multiplying by matrices with orthonormal columns on both sides keeps the
# singular values. So the rank is at most `r`, whatever `m` and `n` are
# (`test_a_circuit_has_rank_at_most_d_k`, and the singular values equal
# those of the materialised product: `test_factored_singular_values_are_the_products`).
#
# <!-- figure: circuit_spectra -->
#
# In the shipped models every head uses all of its `d_k = 32` directions
# (no singular value is negligible), but not evenly: a few carry most of the
# first layer's QK circuits, while the cross-attention heads spread theirs.
#
# <!-- figure: circuit_spectra -->


# %%
@dataclass(frozen=True)
class Factored:
    """The matrix left @ right, (m, r) @ (r, n), kept as its factors."""

    left: Tensor  # (m, r)
    right: Tensor  # (r, n)

    @property
    def shape(self) -> tuple[int, int]:
        return self.left.size(0), self.right.size(1)

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

    def materialise(self) -> Tensor:
        """The m x n matrix itself: for tests and small sizes only."""
        return self.left @ self.right  # (m, n)

    def bilinear(self, x_a: Tensor, x_b: Tensor) -> Tensor:
        """x_a (.., T_a, m) (left @ right) x_b^T, x_b (.., T_b, n): (.., T_a, T_b), through the r inner columns."""
        return (x_a @ self.left) @ (x_b @ self.right.T).transpose(-1, -2)  # (.., T_a, T_b)

    def apply(self, x: Tensor) -> Tensor:
        """x (.., m) @ left @ right: (.., n)."""
        return (x @ self.left) @ self.right  # (.., n)


# %% [markdown]
# ## 2. Head `i`'s matrices, from either form
#
# The per-head form stores `W_Q[i]` as it is; the fused form stores it as
# column block `i` of `W_Q` (rows block `i` for `W_O`), exactly the block the
# `view` in the chapter's section 4 hands to head `i`. `head_matrices` takes
# head `i`'s block of each from the chapter's own `head_blocks`, so the two
# forms give the same circuits (`test_circuits_of_the_per_head_and_fused_forms_are_equal`).


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
# With biases, head `i`'s query and key at positions `a` and `b` are
# `q_a = x_a W_Q + b_Q` and `k_b = x_b W_K + b_K`, and the score expands into
# four terms:
#
# $$q_a k_b^{\top} = x_a W_{QK} x_b^{\top} + x_b\, (W_K b_Q^{\top}) + x_a\, (W_Q b_K^{\top}) + b_Q b_K^{\top}$$
#
# The softmax runs over the keys `b` for one query `a`, and adding the same
# number to every key's score changes nothing. The last two terms do not
# depend on `b`: **they cancel in the softmax**. What the head's attention
# depends on is the bilinear term and the **key bias** `x_b u`, with
# `u = W_K b_Q^T` (a `d_model` vector): a preference for some keys whatever
# the query. So `key_bias` is part of the QK circuit and `query_bias`,
# `constant` are kept only to reproduce the raw scores exactly.
#
# On the OV side, `head_i W_O = P (X W_V + 1 b_V) W_O = P X W_OV + (P 1) b_V W_O`,
# and each row of `P` sums to 1 (a row with every key masked is all zeros,
# and writes nothing, not even `b_V W_O`:
# `test_a_query_whose_keys_are_all_masked_writes_nothing`): the head writes `P X W_OV` plus a constant
# `ov_bias = b_V W_O` whatever it reads. `b_O` belongs to no head.
#
# `scores` puts the terms back together; on real inputs from the model's own
# residual stream it equals the model's pre-softmax scores within 1e-12 in
# float64, for every head, both forms (`test_circuit_scores_are_the_models_scores`),
# and `writes` equals head `i`'s term of `sum_i head_i W_O[i]`
# (`test_the_ov_circuit_is_what_a_head_writes`). The fast beam search uses
# the same two identities forwards: it keeps a layer's inputs instead of keys
# and values, and attends through `q W_K[i]^T` and `(P X) W_V[i]`
# (`annotated/decoding/search.py`, section 7).


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


def circuits(model: EncoderDecoder) -> dict[Site, list[HeadCircuit]]:
    """Every head's circuits, by site, in the order of `sites` (a pruned attention has only its kept heads)."""
    return {
        site: [circuit(attention_at(model, *site), i, site) for i in range(attention_at(model, *site).h)]
        for site in sites(model)
    }


# %% [markdown]
# ## 4. The inputs each attention reads
#
# To check the circuits against the model, and to read them in context, we
# need what each attention receives: the residual stream `x_q` at the
# queries and `x_kv` at the keys (for cross-attention, the encoder's output).
# `attention_inputs` records them with forward hooks during one teacher-forced
# pass, the way `annotated/recording.py` records probabilities: the chapter
# knows nothing of it.


# %%
def attention_inputs(model: EncoderDecoder, src: Tensor, tgt: Tensor, pad: int) -> dict[Site, tuple[Tensor, Tensor]]:
    """(x_q (B, T_q, d_model), x_kv (B, T_k, d_model)) of every attention in one pass over src (B, S), tgt (B, T)."""
    from annotated.transformer import padding_mask, target_mask

    seen: dict[Site, tuple[Tensor, Tensor]] = {}

    def recorder(site: Site):
        def hook(att, args, kwargs) -> None:
            x_q = kwargs.get("x_q", args[0] if args else None)
            x_kv = kwargs.get("x_kv", args[1] if len(args) > 1 else None)
            seen[site] = (x_q.detach(), x_kv.detach())

        return hook

    handles = [attention_at(model, *s).register_forward_pre_hook(recorder(s), with_kwargs=True) for s in sites(model)]
    try:
        with torch.no_grad():  # encoder and decoder only: the generator reads no attention
            src_mask = padding_mask(src, pad)
            model.decode(model.encode(src, src_mask), src_mask, tgt, target_mask(tgt, pad))
    finally:
        for handle in handles:
            handle.remove()
    return seen
