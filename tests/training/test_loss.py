"""annotated/training/loss.py: the label-smoothed loss, its formula, and its gradient written out."""
import pytest
import torch
import torch.nn.functional as F

from annotated.tokens import PAD
from annotated.training import loss
from annotated.transformer import fast_path


@pytest.mark.parametrize("fast", [True, False])
def test_label_smoothing_matches_formula(fast):
    gen = torch.Generator().manual_seed(0)
    B, L, V, eps = 3, 5, 11, 0.1
    logits = torch.randn(B, L, V, generator=gen, dtype=torch.float64)
    target = torch.randint(1, V, (B, L), generator=gen)
    target[0, -2:] = PAD
    with fast_path(fast):
        ours = loss.label_smoothed_loss(logits, target, eps)
    # the prose's formula, term by term: -sum_k q(k) log p(k) over non-pad positions
    q = loss.smoothed_targets(target, V, eps).double()  # (B*L, V)
    assert torch.allclose(q.sum(-1), torch.ones(B * L, dtype=torch.float64))
    per_pos = -(q * logits.reshape(-1, V).float().log_softmax(-1).double()).sum(-1)  # (B*L,)
    want = per_pos[target.reshape(-1) != PAD].sum()
    assert abs(ours.item() - want.item()) <= 1e-5 * abs(want.item())  # ours computes log_softmax in float32
    torch_ls = F.cross_entropy(logits.reshape(-1, V).float(), target.reshape(-1), ignore_index=PAD,
                               label_smoothing=eps, reduction="sum")
    assert abs(ours.item() - torch_ls.item()) <= 1e-5 * abs(want.item())


@pytest.mark.parametrize("fast", [True, False])
def test_no_smoothing_is_cross_entropy(fast):
    logits = torch.randn(2, 4, 7)
    target = torch.tensor([[3, 4, PAD, PAD], [1, 2, 3, 4]])
    ce = F.cross_entropy(logits.reshape(-1, 7), target.reshape(-1), ignore_index=PAD, reduction="sum")
    with fast_path(fast):
        assert torch.allclose(loss.label_smoothed_loss(logits, target, 0.0), ce)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_written_gradient_is_autograds(dtype):
    """The fast path's backward (p - q, zero on padding, times the incoming gradient) against autograd through
    the formula, on logits shaped as training's ((B, T, V) and the real positions' (n, V)), with padding."""
    gen = torch.Generator().manual_seed(1)
    for shape in ((3, 6, 50), (17, 50)):
        logits = (3 * torch.randn(shape, generator=gen)).to(dtype)
        target = torch.randint(1, shape[-1], shape[:-1], generator=gen)
        target.view(-1)[::5] = PAD
        grads, losses = [], []
        for fast in (True, False):
            z = logits.clone().requires_grad_()
            with fast_path(fast):
                value = loss.label_smoothed_loss(z, target, 0.1)
            (2.5 * value).backward()  # an incoming gradient other than 1
            grads.append(z.grad)
            losses.append(value.detach())
        assert grads[0].dtype == grads[1].dtype == dtype and grads[0].shape == logits.shape
        assert torch.allclose(losses[0], losses[1], rtol=1e-6, atol=0)  # both sum the same fp32 log-probabilities
        # the gradients are 2.5 (p - q) in [-2.5, 2.5]: fp32 differs by rounding (~1e-7 relative), bf16 by at
        # most one rounding of each (2^-8 relative, 2.5 * 2^-8 ~ 0.01 absolute)
        assert torch.allclose(grads[0].float(), grads[1].float(), rtol=0,
                              atol=1e-6 if dtype == torch.float32 else 2.5 * 2 ** -8)
        assert (grads[0].reshape(-1, shape[-1])[target.reshape(-1) == PAD] == 0).all()


def test_the_written_gradient_trains_under_autocast():
    """Under bf16 autocast (training's CPU path) the loss of bf16 logits is fp32 and the gradient reaches a
    linear layer's fp32 weight as autograd's does."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 30)
    x, target = torch.randn(12, 8), torch.randint(1, 30, (12,))
    grads = []
    for fast in (True, False):
        layer.zero_grad()
        with fast_path(fast), torch.autocast("cpu", dtype=torch.bfloat16):
            value = loss.label_smoothed_loss(layer(x), target, 0.1)
        assert value.dtype == torch.float32
        value.backward()
        grads.append(layer.weight.grad.clone())
    assert torch.allclose(grads[0], grads[1], rtol=0, atol=1e-2)  # bf16 products on both sides: 2^-8 relative
