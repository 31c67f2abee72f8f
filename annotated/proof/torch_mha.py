# %% [markdown]
# # Our attentions and `torch.nn.MultiheadAttention`: conversions both ways
#
# `to_torch_mha(att)` gives an `nn.MultiheadAttention` that computes the same
# function as one of our attentions; `from_torch_mha(mha)` gives a
# `FusedAttention` computing the same function as PyTorch's module, and
# `split` of it the per-head form, so PyTorch weights can be read head by
# head:
#
# >>> mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
# >>> per_head = split(from_torch_mha(mha))
# >>> tuple(per_head.W_Q[1].shape)  # head 1's query projection, d_model x d_k
# (8, 4)
# >>> torch.equal(per_head.W_Q[1], mha.in_proj_weight[4:8].T)  # rows 4..7 of its query block, transposed
# True
#
# Both copy numbers and never compute them, so a round trip is bit-identical
# (`tests/proof/test_torch_mha.py`).

# %% [markdown]
# ## How PyTorch stores the same parameters
#
# PyTorch's module stores the fused parameters in its own orientation. It
# computes `x @ in_proj_weight.T`, so its weights are our fused matrices
# transposed and stacked:
#
# $$\texttt{in\_proj\_weight} = \begin{bmatrix} W_Q^\top \\ W_K^\top \\ W_V^\top \end{bmatrix}
#   \in \mathbb{R}^{3 d_{model} \times d_{model}},\qquad
#   \texttt{out\_proj.weight} = W_O^\top$$
#
# so rows `i*d_k ... (i+1)*d_k - 1` of its query block are `W_Q^(i)` transposed:
# head `i`'s projection. `in_proj_bias = [b_Q | b_K | b_V]`, `out_proj.bias = b_O`.
#
# **Shapes it can hold.** Its heads are always `d_model / h` wide:
# `d_k = d_v = d_model / h`. Its `kdim`/`vdim` arguments are something else,
# the widths of the key and value *inputs*; with them it keeps three separate
# input projections, which our forms (one input width `d_model`) do not have.
# Converting anything else raises a `ValueError` naming the shapes. Its
# `add_bias_kv` and `add_zero_attn` options add keys our forms do not have
# and are refused too, by `check_torch_mha` in `annotated/checks.py`,
# the door `from_torch_mha` goes through first.
#
# **Masks.** Its boolean masks mean the opposite of ours, `True` = *blocked*;
# `torch_mha_masks` maps ours onto its `key_padding_mask` or `attn_mask`.
# Where a query may attend to *no* key, `nn.MultiheadAttention` returns NaN
# and ours returns zeros, so the comparisons keep a key visible for every query.

# %%
from __future__ import annotations

from typing import TypeVar

import torch
from torch import Tensor, nn

from annotated.checks import check_torch_mha
from annotated.transformer import BLOCKS, FusedAttention, PerHeadAttention, split, subsequent_mask  # noqa: F401 the doctests use them

AttentionLike = PerHeadAttention | FusedAttention | nn.MultiheadAttention
Dst = TypeVar("Dst", PerHeadAttention, FusedAttention, nn.MultiheadAttention)


def _shape_str(shape: dict) -> str:
    return "{" + ", ".join(f"{k}={v}" for k, v in shape.items()) + "}"


def attention_shape(att: AttentionLike) -> dict:
    """d_model, h, d_k, d_v, bias of any of the three kinds of attention (as `att.shape()`); ValueError for an
    nn.MultiheadAttention our forms cannot hold."""
    if isinstance(att, (PerHeadAttention, FusedAttention)):
        return att.shape()
    if isinstance(att, nn.MultiheadAttention):
        check_torch_mha(att)
        d = att.embed_dim // att.num_heads
        return dict(d_model=att.embed_dim, h=att.num_heads, d_k=d, d_v=d, bias=att.in_proj_bias is not None)
    raise TypeError(f"expected PerHeadAttention, FusedAttention or nn.MultiheadAttention, got {type(att).__name__}")


def fused_parameters(att: AttentionLike, *, grads: bool = False) -> dict[str, Tensor]:
    """The parameters of any attention (or their .grad) in our fused layout: W_Q (d_model, h*d_k), ...

    >>> ph = PerHeadAttention(6, 2, d_k=1, d_v=4)
    >>> {n: tuple(t.shape) for n, t in fused_parameters(ph).items()}
    {'W_Q': (6, 2), 'W_K': (6, 2), 'W_V': (6, 8), 'W_O': (8, 6), 'b_Q': (2,), 'b_K': (2,), 'b_V': (8,), 'b_O': (6,)}
    """
    shape = attention_shape(att)
    get = lambda p: p if not grads else p.grad if p.grad is not None else torch.zeros_like(p)
    if isinstance(att, FusedAttention):
        return {n: get(p) for n, p in att.named_parameters()}
    if isinstance(att, PerHeadAttention):
        # the chapter's BLOCKS table: W_Q, W_K, W_V side by side (dim 1), W_O stacked (dim 0), biases end to end
        out = {
            n: torch.cat([get(p) for p in getattr(att, n)], dim=dim)
            for n, (dim, _) in BLOCKS.items()
            if getattr(att, n) is not None
        }  # (d_model, h*d), (h*d_v, d_model)...
        if att.b_O is not None:
            out["b_O"] = get(att.b_O)
        return out
    E = shape["d_model"]
    W_in = get(att.in_proj_weight)  # (3 d_model, d_model) = [W_Q^T; W_K^T; W_V^T]
    out = {"W_Q": W_in[:E].T, "W_K": W_in[E : 2 * E].T, "W_V": W_in[2 * E :].T, "W_O": get(att.out_proj.weight).T}
    if shape["bias"]:
        b_in = get(att.in_proj_bias)  # (3 d_model,) = [b_Q | b_K | b_V]
        out.update(b_Q=b_in[:E], b_K=b_in[E : 2 * E], b_V=b_in[2 * E :], b_O=get(att.out_proj.bias))
    return out


@torch.no_grad()
def _load_fused_parameters(dst: AttentionLike, params: dict[str, Tensor]) -> None:
    """Write fused-layout parameters into `dst` (any kind); shapes were checked by the caller."""
    s = attention_shape(dst)
    if isinstance(dst, FusedAttention):
        for n, p in dst.named_parameters():
            p.copy_(params[n])
    elif isinstance(dst, PerHeadAttention):
        for n, (dim, width) in BLOCKS.items():  # head i's block of each parameter, as the chapter's split cuts it
            if getattr(dst, n) is not None:
                for p_i, block in zip(getattr(dst, n), params[n].split(s[width], dim)):
                    p_i.copy_(block)  # (d_model, d), (d_v, d_model) or (d,)
        if dst.b_O is not None:  # the `bias` of both
            dst.b_O.copy_(params["b_O"])
    else:
        dst.in_proj_weight.copy_(torch.cat([params["W_Q"].T, params["W_K"].T, params["W_V"].T], dim=0))
        dst.out_proj.weight.copy_(params["W_O"].T)  # (d_model, h*d_v)
        if s["bias"]:
            dst.in_proj_bias.copy_(torch.cat([params["b_Q"], params["b_K"], params["b_V"]]))
            dst.out_proj.bias.copy_(params["b_O"])


def copy_attention(src: AttentionLike, dst: Dst) -> Dst:
    """Copy the parameters of `src` into the existing `dst` (any of the three kinds); returns `dst`.

    Both must have the same `attention_shape`; otherwise a ValueError names both shapes.
    Numbers are copied, never recomputed, so a round trip is bit-identical.
    """
    s, d = attention_shape(src), attention_shape(dst)
    if s != d:
        differ = ", ".join(k for k in s if s[k] != d[k])
        raise ValueError(
            f"cannot copy attention parameters: source {type(src).__name__} has shape {_shape_str(s)}, "
            f"destination {type(dst).__name__} has shape {_shape_str(d)} (they differ in {differ})"
        )
    _load_fused_parameters(dst, fused_parameters(src))
    return dst


def to_torch_mha(att: PerHeadAttention | FusedAttention, batch_first: bool = True) -> nn.MultiheadAttention:
    """An nn.MultiheadAttention computing the same function as `att` (same dtype, device, mode, dropout), laid out
    as above; call it as `mha(x_q, x_kv, x_kv, ...)` with the masks of `torch_mha_masks`.

    >>> att = FusedAttention(8, 2)
    >>> mha = to_torch_mha(att)
    >>> x = torch.randn(1, 3, 8)
    >>> bool((mha(x, x, x, need_weights=False)[0] - att(x, x)).abs().max() < 1e-5)
    True
    """
    s = attention_shape(att)
    if not (s["d_k"] == s["d_v"] and s["h"] * s["d_k"] == s["d_model"]):
        raise ValueError(
            f"nn.MultiheadAttention needs d_k = d_v = d_model / h, got {type(att).__name__} with shape "
            f"{_shape_str(s)} (its kdim/vdim are the widths of the key/value inputs, not head sizes)"
        )
    p = next(att.parameters())
    mha = nn.MultiheadAttention(
        s["d_model"],
        s["h"],
        dropout=att.dropout,
        bias=s["bias"],
        batch_first=batch_first,
        device=p.device,
        dtype=p.dtype,
    )
    return copy_attention(att, mha).train(att.training)


def from_torch_mha(mha: nn.MultiheadAttention) -> FusedAttention:
    """A FusedAttention computing the same function as `mha` (same dtype, device, mode, dropout); a module our
    attentions cannot hold is refused by its door, `check_torch_mha`, before anything is built."""
    check_torch_mha(mha)
    s = attention_shape(mha)
    p = mha.in_proj_weight
    att = FusedAttention(s["d_model"], s["h"], s["d_k"], s["d_v"], bias=s["bias"], dropout=mha.dropout)
    return copy_attention(mha, att.to(device=p.device, dtype=p.dtype)).train(mha.training)


def torch_mha_masks(mask: Tensor | None, batch: int, h: int) -> tuple[Tensor | None, Tensor | None]:
    """Our mask (True = may attend) -> nn.MultiheadAttention's (attn_mask, key_padding_mask), True = blocked.

    >>> pad = torch.tensor([[[True, True, False]]])           # (B=1, 1, T_k=3): the last key is padding
    >>> torch_mha_masks(pad, batch=1, h=2)
    (None, tensor([[False, False,  True]]))
    >>> attn, kpm = torch_mha_masks(subsequent_mask(2), batch=4, h=2)   # (1, T, T): shared by the batch
    >>> attn, kpm
    (tensor([[False,  True],
            [False, False]]), None)
    """
    if mask is None:
        return None, None
    if mask.dtype != torch.bool or mask.dim() not in (2, 3):
        raise ValueError(
            f"expected a bool mask of shape (T_q, T_k) or (B or 1, T_q or 1, T_k), "
            f"got dtype {mask.dtype}, shape {tuple(mask.shape)}"
        )
    mask = mask if mask.dim() == 3 else mask.unsqueeze(0)  # (B or 1, T_q or 1, T_k)
    if mask.size(0) not in (1, batch):
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not match batch size {batch}")
    if mask.size(1) == 1:
        return None, ~mask[:, 0, :].expand(batch, -1)  # key_padding_mask (B, T_k)
    if mask.size(0) == 1:
        return ~mask[0], None  # attn_mask (T_q, T_k)
    return (~mask).repeat_interleave(h, dim=0), None  # attn_mask (B*h, T_q, T_k), row b*h + i
