# %% [markdown]
# # Where each attention sits, and removing heads
#
# A trained model has `3N` attentions: one encoder self-attention, one decoder
# self-attention and one cross-attention per layer. This module names them
# (*sites*), counts their heads, and removes heads for real. Checkpoint
# loading (`annotated/checkpoint.py`, for pruned models), the head
# analysis and pruning (`annotated/attention/`) and the attention dump all
# address attentions through it. Tests: `tests/test_sites.py`.

# %%
from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import Tensor

from annotated.transformer import BLOCKS, EncoderDecoder, FusedAttention, PerHeadAttention, empty_like

# %% [markdown]
# ## 1. Removing head `i` is dropping one term of a sum
#
# Multi-head attention is a sum over heads (main chapter, section 3):
#
# $$\mathrm{MultiHead}(Q, K, V) = \sum_{i=1}^{h} \mathrm{head}_i\, W_O^{(i)} + b_O,
# \qquad \mathrm{head}_i = \mathrm{Attention}(Q W_Q^{(i)}, K W_K^{(i)}, V W_V^{(i)})$$
#
# Head `i` enters the output through term `i` and nowhere else. So "the model
# without head `i`" has one unambiguous meaning: **leave out term `i`**. In
# the per-head form that is literal: build the same attention from the other
# heads' matrices only, and its loop over heads never computes `head_i`. The
# output bias `b_O` belongs to no head and stays; `d_k`, `d_v` and `d_model`
# do not change.
#
# Michel et al. describe the same operation with a gate `xi_i` on each head,
# `sum_i xi_i head_i W_O[i]`, and remove a head by setting `xi_i = 0`; the sum
# with term `i` left out is exactly that.


# %%
def _check_keep(att, keep: Sequence[int]) -> list[int]:
    keep = sorted({int(i) for i in keep})
    if not keep:
        raise ValueError(f"an attention needs at least one head; asked to keep none of its {att.h}")
    if keep[0] < 0 or keep[-1] >= att.h:
        raise ValueError(f"head indices must lie in [0, {att.h}), got {keep}")
    return keep


@torch.no_grad()
def keep_heads_per_head(att: PerHeadAttention, keep: Sequence[int]) -> PerHeadAttention:
    """A PerHeadAttention holding only the heads in `keep`: sum_{i in keep} head_i W_O[i] + b_O."""
    keep = _check_keep(att, keep)
    new = empty_like(att, type(att), h=len(keep))
    for name in BLOCKS:  # every per-head parameter: W_Q, W_K, W_V, W_O and the head biases
        if getattr(att, name) is not None:
            for j, i in enumerate(keep):
                getattr(new, name)[j].copy_(getattr(att, name)[i])  # head i becomes head j
    if att.b_O is not None and new.b_O is not None:  # both or neither: the same `bias`
        new.b_O.copy_(att.b_O)  # (d_model,) belongs to no head
    return new


# %% [markdown]
# ## 2. In the fused form: delete one column block and one row block
#
# The fused form stores the same numbers side by side (main chapter,
# section 4): column block `i` of `W_Q`, `W_K`, `W_V` (and of each bias) is
# head `i`'s, and row block `i` of `W_O` reads head `i`, since
# `Concat(head_0, ..., head_{h-1}) W_O = sum_i head_i W_O^(i)`. Leaving out
# term `i` is deleting block `i` of the concatenation *and* row block `i` of
# `W_O`; nothing else reads the columns `head_i` was computed from, so they
# go too. What is left is an ordinary fused attention with `h - 1` heads of
# the same `d_k` and `d_v`: the model gets smaller, by
#
# $$2\, d_{model} d_k + 2\, d_{model} d_v + 2 d_k + d_v \text{ parameters per head}$$
#
# (`W_Q`, `W_K`, `W_V`, `W_O` blocks and the three bias blocks;
# `test_removing_a_head_deletes_the_parameters_the_formula_counts`), and
# faster, because every product in the attention is narrower. Removing head
# `i` in the per-head form gives the same function as the fused model built
# without block `i` (`test_removing_a_head_per_head_equals_fused_without_its_blocks`).


# %%
def _block_index(keep: list[int], d: int, device) -> Tensor:
    """Columns (or rows) of the blocks in `keep`, each block `d` wide.

    >>> _block_index([0, 2], 2, "cpu").tolist()  # blocks 0 and 2 of width 2: columns 0, 1, 4, 5
    [0, 1, 4, 5]
    """
    return torch.cat([torch.arange(i * d, (i + 1) * d, device=device) for i in keep])


@torch.no_grad()
def keep_heads_fused(att: FusedAttention, keep: Sequence[int]) -> FusedAttention:
    """A FusedAttention without the blocks of the heads not in `keep`.

    `BLOCKS` (main chapter, section 5) says along which axis each parameter's
    head blocks lie and how wide they are: W_Q, W_K, W_V keep column blocks,
    W_O keeps row blocks, each head bias keeps its stretch; b_O stays whole.
    """
    keep = _check_keep(att, keep)
    new = empty_like(att, type(att), h=len(keep))
    for name, (dim, width) in BLOCKS.items():
        if getattr(att, name) is not None:
            index = _block_index(keep, getattr(att, width), att.W_Q.device)  # (h' d,)
            getattr(new, name).copy_(getattr(att, name).index_select(dim, index))  # blocks in `keep` only
    if att.b_O is not None and new.b_O is not None:  # both or neither: the same `bias`
        new.b_O.copy_(att.b_O)  # (d_model,)
    return new


def keep_heads(att, keep: Sequence[int]):
    """`att` (either form) with only the heads in `keep`, in the same form."""
    if isinstance(att, PerHeadAttention):
        return keep_heads_per_head(att, keep)
    if isinstance(att, FusedAttention):
        return keep_heads_fused(att, keep)
    raise TypeError(f"expected a PerHeadAttention or FusedAttention, got {type(att).__name__}")


# %% [markdown]
# ## 3. Every attention of a model
#
# A model has three kinds of attention, one of each kind per layer: encoder
# self-attention (`enc_self`), decoder self-attention (`dec_self`) and the
# decoder's cross-attention over the source (`cross`). A *site* `(kind, l)`
# names one of them. `remove_heads` returns a new model (the old one is left
# as it was) with the given heads removed from the given sites; head indices
# are those of the model passed in.
#
# After removals the attentions of one model can hold different numbers of
# heads. `head_counts` lists them, and `set_head_counts` gives a freshly built
# model those counts, so that the parameters of a pruned checkpoint fit it
# (`annotated/attention/prune.py`).

# %%
KINDS = ("enc_self", "dec_self", "cross")
Site = tuple[str, int]


def attention_at(model: EncoderDecoder, kind: str, layer: int):
    if kind not in KINDS:
        raise ValueError(f"attention kind must be one of {KINDS}, got {kind!r}")
    if kind == "enc_self":
        return model.encoder.layers[layer].self_attn
    return model.decoder.layers[layer].self_attn if kind == "dec_self" else model.decoder.layers[layer].cross_attn


def _replace_attention(model: EncoderDecoder, kind: str, layer: int, att) -> None:
    stack = model.encoder if kind == "enc_self" else model.decoder
    setattr(stack.layers[layer], "cross_attn" if kind == "cross" else "self_attn", att)


def sites(model: EncoderDecoder) -> list[Site]:
    """Every (kind, layer) of the model, encoder first."""
    return [(kind, l) for kind in KINDS for l in range(model.config.N)]


def remove_heads(model: EncoderDecoder, drop: Mapping[Site, Iterable[int]]) -> EncoderDecoder:
    """A copy of `model` without the heads `drop[(kind, layer)]` of each listed site."""
    new = copy.deepcopy(model)
    for (kind, layer), heads in drop.items():
        att = attention_at(new, kind, layer)
        gone = set(heads)
        _replace_attention(new, kind, layer, keep_heads(att, [i for i in range(att.h) if i not in gone]))
    return new


def head_counts(model: EncoderDecoder) -> dict[str, list[int]]:
    """{kind: [heads of layer 0, layer 1, ...]}."""
    return {kind: [attention_at(model, kind, l).h for l in range(model.config.N)] for kind in KINDS}


def set_head_counts(model: EncoderDecoder, counts: Mapping[str, Sequence[int]]) -> EncoderDecoder:
    """Give each attention of `model` (in place) the number of heads in `counts`; its weights are then
    placeholders, to be overwritten by `load_state_dict`. Raises ValueError on counts that do not fit."""
    N = model.config.N
    if not isinstance(counts, Mapping) or set(counts) != set(KINDS):
        raise ValueError(f"head counts must map each of {KINDS} to a list of {N} numbers, got {counts!r}")
    for kind in KINDS:
        hs = list(counts[kind])
        if len(hs) != N or not all(isinstance(h, int) and h >= 1 for h in hs):
            raise ValueError(f"head counts of {kind} must be {N} integers >= 1 (one per layer), got {hs!r}")
        for layer, h in enumerate(hs):
            att = attention_at(model, kind, layer)
            if h != att.h:
                _replace_attention(model, kind, layer, empty_like(att, type(att), h=h))
    return model
