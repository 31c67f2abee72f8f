# %% [markdown]
# # The loss: label smoothing
#
# Instead of the one-hot target, the model is trained towards a slightly
# flattened distribution: with smoothing `eps` and a vocabulary of `V` tokens,
#
# $$q(k) = (1 - \epsilon)\,[k = y] + \frac{\epsilon}{V}$$
#
# so the loss for one position is the cross-entropy
# $-\sum_k q(k) \log p(k) = -(1-\epsilon) \log p(y) - \frac{\epsilon}{V} \sum_k \log p(k)$.
# It hurts perplexity (the model learns to be unsure) but improves BLEU
# (section 5.4). Padding positions contribute nothing. This is the same
# definition as `F.cross_entropy(..., label_smoothing=eps)`
# (`test_label_smoothing_matches_formula`). The log-softmax is taken in fp32
# whatever the logits' precision (bf16 under autocast). Autograd takes the
# gradient, `p - q` per position.
#
# <!-- figure: label_smoothing -->

# %%
from __future__ import annotations

import torch
from torch import Tensor

from annotated.tokens import PAD


def smoothed_targets(target: Tensor, vocab: int, eps: float) -> Tensor:
    """The distribution q above, one row per target id: (n,) -> (n, V)."""
    q = torch.full((target.numel(), vocab), eps / vocab)  # (n, V)
    q[torch.arange(target.numel()), target.reshape(-1)] += 1 - eps
    return q


def label_smoothed_loss(logits: Tensor, target: Tensor, eps: float, pad: int = PAD) -> Tensor:
    """Sum over non-pad positions of -sum_k q(k) log p(k). logits (..., V), target (...)."""
    logp = logits.float().log_softmax(dim=-1)  # (..., V)
    # -(1 - eps) log p(y) - eps/V sum_k log p(k)
    nll = -logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)  # (...)
    smooth = -logp.mean(dim=-1)  # (...)
    loss = (1 - eps) * nll + eps * smooth  # (...)
    return loss.masked_fill(target == pad, 0.0).sum()
