"""The conversions of annotated/proof/torch_mha.py: to and from torch.nn.MultiheadAttention, and between our forms.

A round trip copies numbers, so it is compared with torch.equal; the function
computed is compared in tests/proof/test_equivalence.py (and bit for bit, where
arithmetic is exact, in its part 3).
"""

import pytest
import torch
from torch import nn

from annotated.proof.harness import random_biases
from annotated.proof.torch_mha import (
    _shape_str,
    attention_shape,
    copy_attention,
    from_torch_mha,
    fused_parameters,
    to_torch_mha,
    torch_mha_masks,
)
from annotated.recording import attend_with_probabilities
from annotated.transformer import FusedAttention, PerHeadAttention, split


def test_from_torch_mha_exposes_each_head():
    """PyTorch weights, read head by head: W_Q[i] is rows i*d_k.. of the query block of in_proj_weight, transposed."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(12, 3, batch_first=True).eval()
    with torch.no_grad():
        mha.in_proj_bias.normal_()
        mha.out_proj.bias.normal_()
    per_head = split(from_torch_mha(mha))
    for i in range(3):
        assert torch.equal(per_head.W_Q[i], mha.in_proj_weight[4 * i : 4 * (i + 1)].T)
        assert torch.equal(per_head.W_V[i], mha.in_proj_weight[24 + 4 * i : 24 + 4 * (i + 1)].T)
        assert torch.equal(per_head.b_K[i], mha.in_proj_bias[12 + 4 * i : 12 + 4 * (i + 1)])
        assert torch.equal(per_head.W_O[i], mha.out_proj.weight[:, 4 * i : 4 * (i + 1)].T)
    x = torch.randn(2, 5, 12)
    with torch.no_grad():
        want, w = mha(x, x, x, average_attn_weights=False)
        got, p = attend_with_probabilities(per_head, x, x)
    assert (got - want).abs().max() <= 1e-5 and (p - w).abs().max() <= 1e-6  # float32 rounding


def test_mask_mapping_inverts_the_convention():
    pad = torch.tensor([[[True, True, False]], [[True, False, False]]])  # (B=2, 1, T_k=3)
    attn, kpm = torch_mha_masks(pad, batch=2, h=2)
    assert attn is None and torch.equal(kpm, ~pad[:, 0])
    causal = torch.ones(1, 3, 3, dtype=torch.bool).tril()
    attn, kpm = torch_mha_masks(causal, batch=2, h=2)
    assert kpm is None and torch.equal(attn, ~causal[0])
    both = pad & causal  # (2, 3, 3): one mask per sentence -> one per (sentence, head), row b*h + i
    attn, kpm = torch_mha_masks(both, batch=2, h=3)
    assert kpm is None and attn.shape == (6, 3, 3)
    for b in range(2):
        for i in range(3):
            assert torch.equal(attn[b * 3 + i], ~both[b])
    assert torch_mha_masks(None, 2, 2) == (None, None)
    with pytest.raises(ValueError, match="does not match batch size 5"):
        torch_mha_masks(both, batch=5, h=1)
    with pytest.raises(ValueError, match="expected a bool mask"):
        torch_mha_masks(both.float(), batch=2, h=1)


@pytest.mark.parametrize("batch_first", [True, False])
def test_mha_conversions_are_exact_and_keep_settings(batch_first):
    torch.manual_seed(0)
    ph = PerHeadAttention(8, 4, dropout=0.25).double().eval()
    random_biases(ph, torch.Generator().manual_seed(0))
    mha = to_torch_mha(ph, batch_first=batch_first)
    assert mha.batch_first == batch_first and mha.dropout == 0.25 and not mha.training
    assert mha.in_proj_weight.dtype == torch.float64
    assert torch.equal(mha.in_proj_weight[2:4], ph.W_Q[1].T)  # rows of head 1's query block = W_Q[1]^T
    assert torch.equal(mha.in_proj_weight[8 + 6 : 8 + 8], ph.W_K[3].T)
    assert torch.equal(mha.out_proj.weight[:, 4:6], ph.W_O[2].T)
    back = split(from_torch_mha(mha))
    for (n1, a), (n2, b) in zip(ph.named_parameters(), back.named_parameters()):
        assert n1 == n2 and torch.equal(a, b)
    assert back.dropout == 0.25 and not back.training


def test_copy_attention_between_all_kinds():
    torch.manual_seed(1)
    src = FusedAttention(8, 2).double()
    random_biases(src, torch.Generator().manual_seed(1))
    for dst in (PerHeadAttention(8, 2), FusedAttention(8, 2), nn.MultiheadAttention(8, 2)):
        copy_attention(src, dst)
        got, want = fused_parameters(dst), fused_parameters(src)
        assert got.keys() == want.keys()
        assert all(torch.equal(got[n], want[n].float()) for n in want)


@pytest.mark.parametrize(
    "src,dst,differ",
    [
        (lambda: PerHeadAttention(8, 2), lambda: FusedAttention(8, 4), "h, d_k, d_v"),
        (lambda: FusedAttention(8, 2, 3, 4), lambda: PerHeadAttention(8, 2, 4, 4), "d_k"),
        (lambda: FusedAttention(8, 2, 4, 4), lambda: FusedAttention(6, 2, 4, 4), "d_model"),
        (lambda: PerHeadAttention(8, 2, 4, 4), lambda: PerHeadAttention(8, 2, 4, 5), "d_v"),
        (lambda: PerHeadAttention(8, 2, bias=False), lambda: nn.MultiheadAttention(8, 2), "bias"),
        (lambda: FusedAttention(8, 2), lambda: nn.MultiheadAttention(8, 4), "h, d_k, d_v"),
        (lambda: nn.MultiheadAttention(8, 2, bias=False), lambda: PerHeadAttention(8, 2), "bias"),
    ],
)
def test_incompatible_copy_names_both_shapes_and_writes_nothing(src, dst, differ):
    s, d = src(), dst()
    before = {n: p.clone() for n, p in d.named_parameters()}
    s_str, d_str = _shape_str(attention_shape(s)), _shape_str(attention_shape(d))
    with pytest.raises(ValueError) as err:
        copy_attention(s, d)
    msg = str(err.value)
    assert s_str in msg and d_str in msg and f"differ in {differ})" in msg
    assert all(torch.equal(p, before[n]) for n, p in d.named_parameters())


def test_torch_mha_shapes_it_cannot_hold():
    with pytest.raises(
        ValueError,
        match=r"needs d_k = d_v = d_model / h, got FusedAttention with shape "
        r"\{d_model=8, h=2, d_k=3, d_v=3, bias=True\}",
    ):
        to_torch_mha(FusedAttention(8, 2, 3, 3))
    with pytest.raises(ValueError, match=r"got PerHeadAttention with shape \{d_model=8, h=2, d_k=4, d_v=2"):
        to_torch_mha(PerHeadAttention(8, 2, 4, 2))  # d_k != d_v
    with pytest.raises(ValueError, match=r"kdim=4, vdim=4 != embed_dim=8"):
        from_torch_mha(nn.MultiheadAttention(8, 2, kdim=4, vdim=4))
    with pytest.raises(ValueError, match="add_bias_kv"):
        from_torch_mha(nn.MultiheadAttention(8, 2, add_bias_kv=True))
    with pytest.raises(TypeError, match="got Linear"):
        copy_attention(nn.Linear(2, 2), FusedAttention(8, 2))
