"""Which attention sits where, head counts, and removing heads (annotated/sites.py).

`tiny_model`, `batch` and `logits` are shared with the tests of annotated/attention/."""

from types import SimpleNamespace

import pytest
import tiny
import torch

from annotated.sites import (
    KINDS,
    attention_at,
    head_counts,
    keep_heads,
    keep_heads_fused,
    keep_heads_per_head,
    remove_heads,
    set_head_counts,
    sites,
)
from annotated.tokens import BOS, EOS, PAD
from annotated.transformer import FusedAttention, attention_explicit, convert_model, padding_mask, target_mask


def tiny_model(attention="per_head", dtype=torch.float64, seed=0, N=2, h=3, d_model=12, vocab=17):
    """A small model with every parameter random (biases too, so no block of zeros hides a mistake)."""
    shape = dict(N=N, d_model=d_model, d_ff=16, h=h, max_len=20, attention=attention)
    m = tiny.tiny_model(vocab, seed=seed, tied=False, **shape).to(dtype)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return m.eval()


def batch(seed=1, B=3, S=7, T=6, vocab=17):
    """Token ids with padding: src (B, S), tgt (B, T) = bos ... eos pad."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, vocab, (B, S), generator=g)
    tgt = torch.randint(4, vocab, (B, T), generator=g)
    tgt[:, 0] = BOS
    for b in range(B):
        s_len, t_len = S - b, T - b
        src[b, s_len:] = PAD
        tgt[b, t_len - 1] = EOS
        tgt[b, t_len:] = PAD
    return SimpleNamespace(src=src, tgt=tgt)


def logits(model, b):
    tgt_in = b.tgt[:, :-1]
    return model(b.src, tgt_in, padding_mask(b.src, PAD), target_mask(tgt_in, PAD))


@pytest.mark.parametrize("form", ["per_head", "fused"])
def test_removing_no_heads_changes_nothing(form):
    model, b = tiny_model(form), batch()
    same = remove_heads(model, {site: [] for site in sites(model)})
    assert torch.equal(logits(same, b), logits(model, b))  # exactly: the same numbers, the same operations
    for site in sites(model):
        att = attention_at(model, *site)
        kept = keep_heads(att, range(att.h))
        assert all(torch.equal(p, q) for p, q in zip(att.parameters(), kept.parameters()))


def test_per_head_removal_leaves_out_exactly_term_i():
    """keep_heads_per_head computes sum over the other heads of head_j W_O[j] + b_O, written out here."""
    att = attention_at(tiny_model(), "enc_self", 0)
    x = torch.randn(2, 5, att.d_model, dtype=torch.float64)
    mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])[:, None, :]  # (B, 1, T) padding mask
    for i in range(att.h):
        want = att.b_O.clone()
        for j in range(att.h):
            if j != i:
                head_j, _ = attention_explicit(
                    x @ att.W_Q[j] + att.b_Q[j], x @ att.W_K[j] + att.b_K[j], x @ att.W_V[j] + att.b_V[j], mask
                )
                want = want + head_j @ att.W_O[j]
        got = keep_heads_per_head(att, [j for j in range(att.h) if j != i])(x, x, mask)
        # float64, sums of a dozen products of O(1) numbers: rounding is ~1e-15; a wrong head is O(1) off
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_removing_a_head_per_head_equals_fused_without_its_blocks():
    per_head, b = tiny_model("per_head"), batch()
    fused = convert_model(per_head, "fused")
    for kind, layer in sites(per_head):
        for i in range(per_head.config.h):
            keep = [j for j in range(per_head.config.h) if j != i]
            a = remove_heads(per_head, {(kind, layer): [i]})  # term i left out of the per-head loop
            f = convert_model(fused, "fused")  # the fused model built without block i
            attn = attention_at(fused, kind, layer)
            stack = f.encoder if kind == "enc_self" else f.decoder
            setattr(stack.layers[layer], "cross_attn" if kind == "cross" else "self_attn", keep_heads_fused(attn, keep))
            # float64: the two forms add the same products in a different order, so they differ by rounding
            # (~1e-15 relative on logits of size ~10); removing the wrong head changes logits by O(1)
            torch.testing.assert_close(logits(a, b), logits(f, b), rtol=0, atol=1e-10)
            # and the blocks are the same numbers: fusing the pruned per-head attention gives f's, bit for bit
            fused_a = convert_model(a, "fused")
            assert all(
                torch.equal(p, q)
                for p, q in zip(
                    attention_at(fused_a, kind, layer).parameters(), attention_at(f, kind, layer).parameters()
                )
            )
            assert not torch.allclose(logits(a, b), logits(per_head, b), atol=1e-3)  # the head did matter


@pytest.mark.parametrize("bias", [True, False])
def test_removing_a_head_deletes_the_parameters_the_formula_counts(bias):
    """The prose of annotated/sites.py, section 2: 2 d_model d_k + 2 d_model d_v + 2 d_k + d_v per head."""
    d_model, d_k, d_v = 12, 5, 3
    att = FusedAttention(d_model, 4, d_k=d_k, d_v=d_v, bias=bias)
    formula = 2 * d_model * d_k + 2 * d_model * d_v + (2 * d_k + d_v if bias else 0)
    count = lambda a: sum(p.numel() for p in a.parameters())
    assert count(att) - count(keep_heads(att, [0, 1, 2])) == formula
    assert count(keep_heads(att, [0, 2])) - count(keep_heads(att, [1])) == formula


def test_remove_heads_leaves_the_model_alone_and_counts_heads():
    model = tiny_model("fused")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pruned = remove_heads(model, {("enc_self", 1): [0, 2], ("cross", 0): [1]})
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert head_counts(pruned) == {"enc_self": [3, 1], "dec_self": [3, 3], "cross": [2, 3]}
    assert head_counts(model) == {kind: [3, 3] for kind in KINDS}


def test_keep_heads_rejects_bad_indices():
    att = attention_at(tiny_model(), "cross", 0)
    with pytest.raises(ValueError, match="at least one head"):
        keep_heads(att, [])
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        keep_heads(att, [0, 3])
    with pytest.raises(ValueError, match="2 integers >= 1"):
        set_head_counts(tiny_model(), {"enc_self": [3], "dec_self": [3, 3], "cross": [3, 3]})
