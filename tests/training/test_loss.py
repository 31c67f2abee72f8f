"""annotated/training/loss.py: the label-smoothed loss and its formula."""

import torch
import torch.nn.functional as F

from annotated.tokens import PAD
from annotated.training import loss


def test_label_smoothing_matches_formula():
    gen = torch.Generator().manual_seed(0)
    B, L, V, eps = 3, 5, 11, 0.1
    logits = torch.randn(B, L, V, generator=gen, dtype=torch.float64)
    target = torch.randint(1, V, (B, L), generator=gen)
    target[0, -2:] = PAD
    ours = loss.label_smoothed_loss(logits, target, eps)
    # the prose's formula, term by term: -sum_k q(k) log p(k) over non-pad positions
    q = loss.smoothed_targets(target, V, eps).double()  # (B*L, V)
    assert torch.allclose(q.sum(-1), torch.ones(B * L, dtype=torch.float64))
    per_pos = -(q * logits.reshape(-1, V).float().log_softmax(-1).double()).sum(-1)  # (B*L,)
    want = per_pos[target.reshape(-1) != PAD].sum()
    assert abs(ours.item() - want.item()) <= 1e-5 * abs(want.item())  # ours computes log_softmax in float32
    torch_ls = F.cross_entropy(
        logits.reshape(-1, V).float(), target.reshape(-1), ignore_index=PAD, label_smoothing=eps, reduction="sum"
    )
    assert abs(ours.item() - torch_ls.item()) <= 1e-5 * abs(want.item())


def test_no_smoothing_is_cross_entropy():
    logits = torch.randn(2, 4, 7)
    target = torch.tensor([[3, 4, PAD, PAD], [1, 2, 3, 4]])
    ce = F.cross_entropy(logits.reshape(-1, 7), target.reshape(-1), ignore_index=PAD, reduction="sum")
    assert torch.allclose(loss.label_smoothed_loss(logits, target, 0.0), ce)
