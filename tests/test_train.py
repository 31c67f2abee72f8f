"""annotated/train.py: the loss, the schedule, and a whole (smoke) run."""
import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from annotated import train as T
from annotated.transformer import PAD, rate


def test_label_smoothing_matches_formula():
    gen = torch.Generator().manual_seed(0)
    B, L, V, eps = 3, 5, 11, 0.1
    logits = torch.randn(B, L, V, generator=gen, dtype=torch.float64)
    target = torch.randint(1, V, (B, L), generator=gen)
    target[0, -2:] = PAD
    ours = T.label_smoothed_loss(logits, target, eps)
    # the prose's formula, term by term: -sum_k q(k) log p(k) over non-pad positions
    q = T.smoothed_targets(target, V, eps).double()  # (B*L, V)
    assert torch.allclose(q.sum(-1), torch.ones(B * L, dtype=torch.float64))
    per_pos = -(q * logits.reshape(-1, V).float().log_softmax(-1).double()).sum(-1)  # (B*L,)
    want = per_pos[target.reshape(-1) != PAD].sum()
    assert abs(ours.item() - want.item()) <= 1e-5 * abs(want.item())  # ours computes log_softmax in float32
    torch_ls = F.cross_entropy(logits.reshape(-1, V).float(), target.reshape(-1), ignore_index=PAD,
                               label_smoothing=eps, reduction="sum")
    assert abs(ours.item() - torch_ls.item()) <= 1e-5 * abs(want.item())


def test_no_smoothing_is_cross_entropy():
    logits = torch.randn(2, 4, 7)
    target = torch.tensor([[3, 4, PAD, PAD], [1, 2, 3, 4]])
    ce = F.cross_entropy(logits.reshape(-1, 7), target.reshape(-1), ignore_index=PAD, reduction="sum")
    assert torch.allclose(T.label_smoothed_loss(logits, target, 0.0), ce)


def test_schedule_warms_up_then_decays():
    lrs = [rate(s, 256, 1000) for s in range(1, 5001)]
    peak = max(range(len(lrs)), key=lrs.__getitem__) + 1
    assert peak == 1000
    assert math.isclose(lrs[999], 256 ** -0.5 * 1000 ** -0.5)
    assert math.isclose(lrs[3999] / lrs[999], 0.5)  # step 4000 vs 1000: 1/sqrt(4)


def test_presets_are_valid_and_bad_settings_are_named():
    for name, cfg in T.PRESETS.items():
        T.make_optimizer(torch.nn.Linear(2, 2), cfg)
        assert cfg.model_config(100)["share_embeddings"]
    with pytest.raises(ValueError, match="two different languages"):
        T.TrainConfig(src_lang="de", tgt_lang="de")
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        T.TrainConfig(label_smoothing=1.5)
