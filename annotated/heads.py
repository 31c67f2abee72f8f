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
# # What each head does, and do we need it?
#
# The main chapter (`annotated/transformer.py`) keeps every head's matrices
# `W_Q[i], W_K[i], W_V[i], W_O[i]` as parameters of their own. This chapter
# uses them to answer two questions about a trained translator: **what does
# head `i` of layer `l` contribute**, and **can the model do without it**?
#
# Michel, Levy and Neubig (NeurIPS 2019, "Are Sixteen Heads Really Better than
# One?") removed heads from a trained WMT Transformer at test time and found
# that many can go with little loss of BLEU; they ranked heads by a
# gradient-based importance score. Voita et al. (ACL 2019) found a few
# specialised heads doing most of the work. Here both experiments run on the
# model you trained, on a CPU:
#
# * **ablation**: validation BLEU and loss with one head removed (this file);
# * **importance**: Michel et al.'s score, from one backward pass per
#   sentence (this file);
# * **pruning**: remove heads for real, so the model gets smaller and faster
#   (`annotated/prune.py`);
# * **inspection**: what each head's matrices and attention look like
#   (`annotated/head_inspect.py`).
#
# `python -m annotated.heads --checkpoint PATH` (or `make heads`) runs them all
# (`annotated/heads_cli.py`). Tests: `tests/test_heads.py`.

# %%
from __future__ import annotations

if __name__ == "__main__":  # as a command: a Ctrl-C while torch loads is one line, exit 130
    from annotated.cli import quiet_ctrl_c_while_starting
    quiet_ctrl_c_while_starting("python -m annotated.heads")

import copy
import math
from typing import Callable, Iterable, Mapping, Sequence

import torch
from torch import Tensor

from annotated.transformer import (PAD, EncoderDecoder, FusedAttention, PerHeadAttention, convert_model,
                                   padding_mask, target_mask)

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
    keep = sorted(set(int(i) for i in keep))
    if not keep:
        raise ValueError(f"an attention needs at least one head; asked to keep none of its {att.h}")
    if keep[0] < 0 or keep[-1] >= att.h:
        raise ValueError(f"head indices must lie in [0, {att.h}), got {keep}")
    return keep


def _empty_like(att, h: int):
    """A module of the same class and sizes as `att`, with `h` heads (parameters overwritten by the caller)."""
    new = type(att)(att.d_model, h, att.d_k, att.d_v, att.bias, att.dropout)
    p = next(att.parameters())
    return new.to(device=p.device, dtype=p.dtype).train(att.training)


@torch.no_grad()
def keep_heads_per_head(att: PerHeadAttention, keep: Sequence[int]) -> PerHeadAttention:
    """A PerHeadAttention holding only the heads in `keep`: sum_{i in keep} head_i W_O[i] + b_O."""
    keep = _check_keep(att, keep)
    new = _empty_like(att, len(keep))
    names = ("W_Q", "W_K", "W_V", "W_O") + (("b_Q", "b_K", "b_V") if att.bias else ())
    for name in names:
        for j, i in enumerate(keep):
            getattr(new, name)[j].copy_(getattr(att, name)[i])  # head i becomes head j
    if att.bias:
        new.b_O.copy_(att.b_O)  # (d_model,) belongs to no head
    return new


# %% [markdown]
# ## 2. In the fused form: delete one column block and one row block
#
# The fused form stores the same numbers side by side (main chapter,
# section 4): `W_Q = [W_Q[1] | ... | W_Q[h]]` has `h` column blocks of width
# `d_k` (likewise `W_K`, and `W_V` with width `d_v`), and `W_O` stacks its
# row blocks `W_O[1], ..., W_O[h]` of height `d_v`. Write the output as a
# block product:
#
# $$\mathrm{Concat}(\mathrm{head}_1, \dots, \mathrm{head}_h)\, W_O
# = [\,\mathrm{head}_1 \mid \dots \mid \mathrm{head}_h\,]
# \begin{bmatrix} W_O^{(1)} \\ \vdots \\ W_O^{(h)} \end{bmatrix} = \sum_i \mathrm{head}_i\, W_O^{(i)}$$
#
# Leaving out term `i` is deleting block `i` of the row vector *and* row
# block `i` of `W_O`: the product of what remains is the sum of the other
# terms. And `head_i` is computed from column block `i` of `W_Q`, `W_K`, `W_V`
# (and block `i` of each bias) alone; once its term is gone nothing reads
# those columns, so they go too. What is left is an ordinary fused attention
# with `h - 1` heads of the same `d_k` and `d_v`: the model gets smaller, by
#
# $$2\, d_{model} d_k + 2\, d_{model} d_v + 2 d_k + d_v \text{ parameters per head}$$
#
# (`W_Q`, `W_K`, `W_V`, `W_O` blocks and the three bias blocks), and faster,
# because every product in the attention is narrower. Removing head `i` in
# the per-head form gives the same function as the fused model built without
# block `i` (`test_removing_a_head_per_head_equals_fused_without_its_blocks`).

# %%
def _block_index(keep: list[int], d: int, device) -> Tensor:
    """Columns (or rows) of the blocks in `keep`, each block `d` wide.

    >>> _block_index([0, 2], 2, "cpu").tolist()  # blocks 0 and 2 of width 2: columns 0, 1, 4, 5
    [0, 1, 4, 5]
    """
    return torch.cat([torch.arange(i * d, (i + 1) * d, device=device) for i in keep])


@torch.no_grad()
def keep_heads_fused(att: FusedAttention, keep: Sequence[int]) -> FusedAttention:
    """A FusedAttention without the blocks of the heads not in `keep`."""
    keep = _check_keep(att, keep)
    new = _empty_like(att, len(keep))
    dev = att.W_Q.device
    cols_k, cols_v = _block_index(keep, att.d_k, dev), _block_index(keep, att.d_v, dev)
    new.W_Q.copy_(att.W_Q[:, cols_k])  # (d_model, h' d_k) column blocks kept
    new.W_K.copy_(att.W_K[:, cols_k])  # (d_model, h' d_k)
    new.W_V.copy_(att.W_V[:, cols_v])  # (d_model, h' d_v)
    new.W_O.copy_(att.W_O[cols_v, :])  # (h' d_v, d_model) row blocks kept
    if att.bias:
        new.b_Q.copy_(att.b_Q[cols_k])  # (h' d_k,)
        new.b_K.copy_(att.b_K[cols_k])
        new.b_V.copy_(att.b_V[cols_v])  # (h' d_v,)
        new.b_O.copy_(att.b_O)  # (d_model,)
    return new


def keep_heads(att, keep: Sequence[int]):
    """`att` (either form) with only the heads in `keep`, in the same form."""
    if isinstance(att, PerHeadAttention):
        return keep_heads_per_head(att, keep)
    if isinstance(att, FusedAttention):
        return keep_heads_fused(att, keep)
    raise TypeError(f"expected a PerHeadAttention or FusedAttention, got {type(att).__name__}")


def parameters_per_head(att) -> int:
    """Parameters that removing one head of `att` deletes (the formula above).

    >>> att = FusedAttention(d_model=128, h=4)
    >>> parameters_per_head(att), sum(p.numel() for p in att.parameters()) - sum(
    ...     p.numel() for p in keep_heads(att, [0, 1, 2]).parameters())
    (16480, 16480)
    """
    d_model, d_k, d_v = att.d_model, att.d_k, att.d_v
    return 2 * d_model * d_k + 2 * d_model * d_v + ((2 * d_k + d_v) if att.bias else 0)


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
# (`annotated/prune.py`).

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
                _replace_attention(model, kind, layer, _empty_like(att, h))
    return model


# %% [markdown]
# ## 4. Importance: how much the loss cares about each gate
#
# Michel et al. score head `i` by the gate's gradient: with gates
# `xi_i = 1` on every head, the importance is the expected size of the
# loss's derivative with respect to the gate,
#
# $$I_i = \mathbb{E}_x \left| \frac{\partial L(x)}{\partial \xi_i} \right|_{\xi = 1}$$
#
# A first-order estimate of how much the loss would move if the head went
# away (`xi_i: 1 -> 0`). Taking the absolute value before the average keeps
# a head whose effect helps on some batches and hurts on others from scoring
# zero. Here `x` is one validation sentence and `L` its mean per-token
# cross-entropy. Taking `|.|` per sentence, not per batch, matters for the
# same reason: in a batch the derivatives of different sentences cancel
# (`|mean| <= mean |.|`), and a trained model's gradient averaged over many
# sentences is small in every direction.
#
# **The gate is already in the model.** Since `xi_i` multiplies a row vector
# that is then multiplied by `W_O[i]`, `(xi_i head_i) W_O[i] = head_i (xi_i
# W_O[i])`: gating head `i` is scaling its own output matrix. The chain rule
# then gives the gate's derivative from the gradient of `W_O[i]`:
#
# $$\frac{\partial L}{\partial \xi_i}\Big|_{\xi=1} = \sum_{a,b} \frac{\partial L}{\partial W_O^{(i)}[a,b]}\, W_O^{(i)}[a,b] = \langle \nabla_{W_O^{(i)}} L,\ W_O^{(i)} \rangle$$
#
# so one ordinary backward pass per batch scores every head of every layer,
# with no gate added to the model. This needs `W_O[i]` as a matrix of its
# own: we use the per-head form (converting a fused model first, which
# changes no number). `test_importance_matches_finite_differences` checks the
# result against `(L(1 + e) - L(1 - e)) / 2e` with an explicit gate.

# %%
def mean_token_loss(model: EncoderDecoder, src: Tensor, tgt: Tensor) -> Tensor:
    """Mean cross-entropy per predicted target token of one batch (teacher forcing)."""
    tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]  # (B, T-1), (B, T-1)
    logits = model(src, tgt_in, padding_mask(src, PAD), target_mask(tgt_in, PAD))  # (B, T-1, V)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # (B, T-1, V) at least float32
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tgt_out.flatten(), ignore_index=PAD)


def head_importance(model: EncoderDecoder, batches: Iterable, progress: bool = False) -> dict[str, list[list[float]]]:
    """Michel et al.'s I_i for every head, x being one sentence: {kind: [[I of each head] per layer]}.

    `batches` yields objects with `.src` (B, S) and `.tgt` (B, T) (bos ... eos, padded), e.g.
    `annotated.data.make_batches`; every row counts as one sentence.
    """
    per_head = convert_model(model, "per_head").eval()  # a copy; the same numbers, in W_O[i] matrices
    device = next(per_head.parameters()).device
    W_O = [(site, list(attention_at(per_head, *site).W_O)) for site in sites(per_head)]
    flat = [W for _, Ws in W_O for W in Ws]
    total, n = torch.zeros(len(flat), dtype=torch.float64), 0
    rows = ((b.src[r:r + 1], b.tgt[r:r + 1]) for b in batches for r in range(b.src.size(0)))
    if progress:
        from tqdm.auto import tqdm
        rows = tqdm(rows, desc="importance", unit="sentence", leave=False)
    for src, tgt in rows:
        src, tgt = src[:, :int((src != PAD).sum())], tgt[:, :int((tgt != PAD).sum())]  # (1, S), (1, T) no pad
        loss = mean_token_loss(per_head, src.to(device), tgt.to(device))
        grads = torch.autograd.grad(loss, flat)
        # dL/dxi_i = <dL/dW_O[i], W_O[i]>, then |.|, summed over sentences
        total += torch.stack([(g * W).sum() for g, W in zip(grads, flat)]).abs().double().cpu()
        n += 1
    if n == 0:
        raise ValueError("head_importance needs at least one sentence")
    scores, k = {kind: [] for kind in KINDS}, 0
    for (kind, _), Ws in W_O:
        scores[kind].append((total[k:k + len(Ws)] / n).tolist())
        k += len(Ws)
    return scores


def normalise_per_attention(scores: dict[str, list[list[float]]]) -> dict[str, list[list[float]]]:
    """Each attention's scores divided by their L2 norm, as Michel et al. do before ranking across layers
    (`annotated/prune.py` says why we rank by the scores themselves).

    >>> normalise_per_attention({"cross": [[3.0, 4.0]]})
    {'cross': [[0.6, 0.8]]}
    """
    out = {}
    for kind, layers in scores.items():
        out[kind] = [[s / (math.sqrt(sum(x * x for x in row)) or 1.0) for s in row] for row in layers]
    return out


# %% [markdown]
# ## 5. Ablation: the model without one head at a time
#
# The score above is a first-order estimate; ablation measures. For every
# site and head, `ablate` builds the model without that head (section 3) and
# hands it to `evaluate`, which returns the numbers to keep (validation BLEU
# and loss, in the command). With `h` heads in each of the `3N` attentions
# that is `3Nh` evaluations, `24` for the `cpu` preset (`N = 2`, `h = 4`).

# %%
def ablate(model: EncoderDecoder, evaluate: Callable[[EncoderDecoder], dict],
           progress: bool = False) -> dict[str, list[list[dict]]]:
    """{kind: [[evaluate(model without head i of that layer) for each head i] per layer]}."""
    jobs = [(site, i) for site in sites(model) for i in range(attention_at(model, *site).h)]
    if progress:
        from tqdm.auto import tqdm
        jobs = tqdm(jobs, desc="ablation", leave=False)
    out = {kind: [[] for _ in range(model.config.N)] for kind in KINDS}
    for (kind, layer), i in jobs:
        out[kind][layer].append(evaluate(remove_heads(model, {(kind, layer): [i]}).eval()))
    return out


if __name__ == "__main__":
    from annotated.cli import run_command
    from annotated.heads_cli import main

    run_command(main, "python -m annotated.heads")  # Ctrl-C: one line and exit code 130, not a traceback
