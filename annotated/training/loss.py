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
# whatever the logits' precision (bf16 under autocast).
#
# <!-- figure: label_smoothing -->

# %%
from __future__ import annotations

import torch
from torch import Tensor

from annotated import transformer
from annotated.tokens import PAD


def smoothed_targets(target: Tensor, vocab: int, eps: float) -> Tensor:
    """The distribution q above, one row per target id: (n,) -> (n, V)."""
    q = torch.full((target.numel(), vocab), eps / vocab)  # (n, V)
    q[torch.arange(target.numel()), target.reshape(-1)] += 1 - eps
    return q


def label_smoothed_loss_explicit(logits: Tensor, target: Tensor, eps: float, pad: int = PAD) -> Tensor:
    """Sum over non-pad positions of -sum_k q(k) log p(k). logits (..., V), target (...)."""
    logp = logits.float().log_softmax(dim=-1)  # (..., V)
    # -(1 - eps) log p(y) - eps/V sum_k log p(k)
    nll = -logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)  # (...)
    smooth = -logp.mean(dim=-1)  # (...)
    loss = (1 - eps) * nll + eps * smooth  # (...)
    return loss.masked_fill(target == pad, 0.0).sum()


# %% [markdown]
# ## The gradient, written out
#
# Autograd differentiates the function above one operation at a time: the
# mean's and the gather's backward each fill a tensor the size of the logits,
# they are added, then the log-softmax's backward and the cast back to the
# logits' precision each make another. On the `cpu` preset that is a few
# passes over 2,500 x 5,000 numbers per step. With $p = \mathrm{softmax}(z)$,
# $\partial \log p(k) / \partial z_i = [k = i] - p(i)$, and since
# $\sum_k q(k) = 1$ the whole gradient of one position's loss is
#
# $$\frac{\partial}{\partial z_i}\Big(-\sum_k q(k) \log p(k)\Big) = p(i) - q(i)$$
#
# `LabelSmoothedLoss` computes the same loss in its forward and returns
# `p - q` from its backward in one pass over the saved log-probabilities
# (zero on padding positions, times the incoming gradient). It is the fast
# path, chosen where attention's is (`transformer.FAST_PATH`); both give the
# same loss and the same gradient to fp32 rounding
# (`test_the_written_gradient_is_autograds`, in fp32 and bf16, with padding).

# %%
class LabelSmoothedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, eps: float, pad: int) -> Tensor:
        logp = torch.log_softmax(logits.reshape(-1, logits.size(-1)), dim=-1, dtype=torch.float32)  # (n, V)
        target = target.reshape(-1)  # (n,)
        keep = target != pad  # (n,)
        nll = logp.gather(1, target.unsqueeze(1)).squeeze(1)  # (n,) log p(y)
        per_position = (1 - eps) * nll + (eps / logp.size(1)) * logp.sum(dim=1)  # (n,) sum_k q(k) log p(k)
        ctx.save_for_backward(logp, target, keep)
        ctx.eps, ctx.shape, ctx.dtype = eps, logits.shape, logits.dtype
        return -per_position.masked_fill(~keep, 0.0).sum()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: Tensor):
        logp, target, keep = ctx.saved_tensors
        n, V = logp.shape
        grad = logp.exp().sub_(ctx.eps / V)  # (n, V) p - eps/V
        grad.scatter_add_(1, target.unsqueeze(1), logp.new_full((n, 1), -(1 - ctx.eps)))  # (n, V) p - q
        grad.mul_(torch.where(keep, grad_loss, 0.0).unsqueeze(1))  # (n, V) zero on padding
        return grad.to(ctx.dtype).reshape(ctx.shape), None, None, None


def label_smoothed_loss(logits: Tensor, target: Tensor, eps: float, pad: int = PAD) -> Tensor:
    """Sum over non-pad positions of -sum_k q(k) log p(k); logits (..., V), target (...). The written gradient
    on the fast path, autograd's through the formula off it."""
    if not transformer.FAST_PATH:
        return label_smoothed_loss_explicit(logits, target, eps, pad)
    return LabelSmoothedLoss.apply(logits, target, eps, pad)
