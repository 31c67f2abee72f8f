# %% [markdown]
# # How much each head matters
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
# model you trained, on a CPU; `make heads` runs them
# (docs/heads.md). Tests: `tests/attention/test_heads.py`.

# %%
from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import numpy as np
import torch
from torch import Tensor

from annotated.plumbing.progress import tracked
from annotated.sites import KINDS, attention_at, remove_heads, sites
from annotated.tokens import PAD
from annotated.transformer import EncoderDecoder, convert_model, padding_mask, target_mask

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
def teacher_forced_logits(model: EncoderDecoder, src: Tensor, tgt: Tensor) -> tuple[Tensor, Tensor]:
    """(logits (B, T-1, V) in at least float32, the tokens they predict (B, T-1)) of one batch."""
    tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]  # (B, T-1), (B, T-1)
    logits = model(src, tgt_in, padding_mask(src, PAD), target_mask(tgt_in, PAD))  # (B, T-1, V)
    return logits.to(torch.promote_types(logits.dtype, torch.float32)), tgt_out


def mean_token_loss(model: EncoderDecoder, src: Tensor, tgt: Tensor) -> Tensor:
    """Mean cross-entropy per predicted target token of one batch (teacher forcing)."""
    logits, tgt_out = teacher_forced_logits(model, src, tgt)  # (B, T-1, V), (B, T-1)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tgt_out.flatten(), ignore_index=PAD)


def head_importance(model: EncoderDecoder, batches: Iterable, progress: bool = False) -> dict[str, list[list[float]]]:
    """Michel et al.'s I_i for every head, x being one sentence: {kind: [[I of each head] per layer]}.

    `batches` yields objects with `.src` (B, S) and `.tgt` (B, T) (bos ... eos, padded), e.g.
    `annotated.training.data.make_batches`; every row counts as one sentence.
    """
    per_head = convert_model(model, "per_head").eval()  # a copy; the same numbers, in W_O[i] matrices
    device = next(per_head.parameters()).device
    W_O = [(site, list(attention_at(per_head, *site).W_O)) for site in sites(per_head)]
    flat = [W for _, Ws in W_O for W in Ws]
    total, batches = torch.zeros(len(flat), dtype=torch.float64), list(batches)
    n = sum(b.src.size(0) for b in batches)  # sentences
    rows = ((b.src[r : r + 1], b.tgt[r : r + 1]) for b in batches for r in range(b.src.size(0)))
    for src, tgt in tracked(rows, n, "importance", "sentence", progress):
        src, tgt = src[:, : int((src != PAD).sum())], tgt[:, : int((tgt != PAD).sum())]  # (1, S), (1, T) no pad
        loss = mean_token_loss(per_head, src.to(device), tgt.to(device))
        grads = torch.autograd.grad(loss, flat)
        # dL/dxi_i = <dL/dW_O[i], W_O[i]>, then |.|, summed over sentences
        total += torch.stack([(g * W).sum() for g, W in zip(grads, flat)]).abs().double().cpu()
    scores: dict[str, list[list[float]]] = {kind: [] for kind in KINDS}
    for ((kind, _), _), layer in zip(W_O, (total / n).split([len(Ws) for _, Ws in W_O])):
        scores[kind].append(layer.tolist())  # each site's heads, in the order of `sites`
    return scores


def normalise_per_attention(scores: dict[str, list[list[float]]]) -> dict[str, list[list[float]]]:
    """Each attention's scores divided by their L2 norm, as Michel et al. do before ranking across layers
    (`annotated/attention/prune.py` says why we rank by the scores themselves).

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
# head, `ablate` builds the model without it (`annotated/sites.py`) and hands
# it to `evaluate`: `3Nh` evaluations, `24` for the `cpu` preset (`N = 2`,
# `h = 4`). The command keeps the translations and each sentence's summed loss
# and token count (`sentence_losses`), so that `annotated/attention/bootstrap.py`
# can resample sentences for the intervals of the changes.


# %%
def ablate(
    model: EncoderDecoder, evaluate: Callable[[EncoderDecoder], dict], progress: bool = False
) -> dict[str, list[list[dict]]]:
    """{kind: [[evaluate(model without head i of that layer) for each head i] per layer]}."""
    jobs = [(site, i) for site in sites(model) for i in range(attention_at(model, *site).h)]
    out: dict[str, list[list[dict]]] = {kind: [[] for _ in range(model.config.N)] for kind in KINDS}
    for (kind, layer), i in tracked(jobs, len(jobs), "ablation", "head", progress):
        out[kind][layer].append(evaluate(remove_heads(model, {(kind, layer): [i]}).eval()))
    return out


@torch.no_grad()
def sentence_losses(model: EncoderDecoder, batches: Iterable) -> tuple[np.ndarray, np.ndarray]:
    """(summed cross-entropy (n,), target tokens (n,)) of every sentence of `batches`, in batch order.

    >>> from annotated.transformer import make_model
    >>> from types import SimpleNamespace
    >>> _ = torch.manual_seed(0)
    >>> m = make_model(src_vocab=9, tgt_vocab=9, N=1, d_model=8, d_ff=16, h=2).eval()
    >>> b = SimpleNamespace(src=torch.tensor([[4, 5], [6, 0]]), tgt=torch.tensor([[1, 7, 2], [1, 2, 0]]))
    >>> loss, tokens = sentence_losses(m, [b])
    >>> tokens.tolist(), bool(abs(loss.sum() / tokens.sum() - mean_token_loss(m, b.src, b.tgt).item()) < 1e-6)
    ([2.0, 1.0], True)
    """
    model = model.eval()
    device = next(model.parameters()).device
    losses, tokens = [], []
    for b in batches:
        logits, tgt_out = teacher_forced_logits(model, b.src.to(device), b.tgt.to(device))  # (B, T-1, V), (B, T-1)
        ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), tgt_out, ignore_index=PAD, reduction="none")
        losses.append(ce.sum(-1).double().cpu())
        tokens.append((tgt_out != PAD).sum(-1).double().cpu())
    return torch.cat(losses).numpy(), torch.cat(tokens).numpy()
