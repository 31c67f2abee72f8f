"""The masks of annotated/transformer.py keep their promises, for every query.

`target_mask` promises "no padding keys and no future keys": checked entry by
entry, pad queries included (a mask that only blocks the future passes any
test that looks at real queries alone). `attention()` promises zeros for a
query that may attend to no key, on the fast path too, whatever the fused
kernel returns there: checked with a kernel that writes NaN into such rows.
"""

import pytest
import torch

from annotated import transformer
from annotated.transformer import attention, attention_explicit, target_mask

PAD = 0


@pytest.mark.parametrize("seed", range(5))
def test_target_mask_blocks_padding_keys_and_future_keys_for_every_query(seed):
    gen = torch.Generator().manual_seed(seed)
    B, L = 4, 7
    tgt = torch.randint(1, 9, (B, L), generator=gen)
    lengths = torch.randint(1, L + 1, (B,), generator=gen)
    for b in range(B):
        tgt[b, lengths[b] :] = PAD  # trailing padding, as batches have it
    tgt[0, 2] = PAD  # and a pad in the middle: the rule is about the token, not its place
    mask = target_mask(tgt, PAD)  # (B, L, L)
    assert mask.dtype == torch.bool and mask.shape == (B, L, L)
    for b in range(B):
        for q in range(L):  # every query, pad queries included
            for k in range(L):
                allowed = bool(tgt[b, k] != PAD) and k <= q
                assert bool(mask[b, q, k]) == allowed, (b, q, k)


def output(result):
    """The attention output, whether the function returns it alone or with the probabilities."""
    return result[0] if isinstance(result, tuple) else result


def nan_in_blocked_rows(real):
    """scaled_dot_product_attention that writes NaN where a query may attend to no key."""

    def kernel(q, k, v, attn_mask=None, **kw):
        out = real(q, k, v, attn_mask=attn_mask, **kw)  # (..., T_q, d_v)
        if attn_mask is None:
            return out
        blocked = ~attn_mask.any(dim=-1, keepdim=True)  # (..., T_q, 1)
        return out.masked_fill(blocked, float("nan"))

    return kernel


def test_fast_path_gives_zeros_for_fully_blocked_queries_whatever_the_kernel(monkeypatch, fast_path):
    fast_path(True)
    monkeypatch.setattr(
        transformer.F, "scaled_dot_product_attention", nan_in_blocked_rows(transformer.F.scaled_dot_product_attention)
    )
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 4, 5, generator=gen) for _ in range(3))  # (B, h, T, d)
    mask = torch.ones(2, 1, 4, 4, dtype=torch.bool)
    mask[0, :, 1] = False  # sentence 0, query 1: no key at all
    mask[1, :, 3, :2] = False  # sentence 1, query 3: two keys left
    kernel_out = transformer.F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert kernel_out[0, :, 1].isnan().all()  # the stand-in kernel does what it should
    out = output(attention(q, k, v, mask))  # (B, h, T_q, d)
    assert torch.equal(out[0, :, 1], torch.zeros(3, 5))
    want = output(attention_explicit(q, k, v, mask))
    assert torch.allclose(out, want, atol=1e-6)  # float32 rounding of two summation orders
