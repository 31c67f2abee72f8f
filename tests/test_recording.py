"""The claims of annotated/recording.py.

Tolerance: in float64 the recorder and the written-out reference below compute the same softmax in a
different order (one product over h*d_k columns or h products; torch's softmax or exp / sum); probabilities
lie in [0, 1] and the scores of these small models in a few units, so the two differ by a few ulps
(~1e-16 relative, ~1e-15 absolute after exp). 1e-12 leaves three orders of magnitude of room, while a
wrong mask, scale, head or input is off by more than 1e-3.
"""

import math

import pytest
import torch

from annotated.recording import attend_with_probabilities, record_attention
from annotated.sites import attention_at, remove_heads, sites
from annotated.tokens import PAD
from annotated.transformer import (
    FusedAttention,
    PerHeadAttention,
    make_model,
    padding_mask,
    split,
    subsequent_mask,
    target_mask,
)

TOL = 1e-12
PRUNE = {("enc_self", 0): [1], ("dec_self", 1): [0, 2], ("cross", 0): [3]}


def model(form="fused", norm="post", pruned=False, dropout=0.0, dtype=torch.float64):
    torch.manual_seed(0)
    m = make_model(
        src_vocab=17,
        tgt_vocab=19,
        N=2,
        d_model=16,
        d_ff=32,
        h=4,
        dropout=dropout,
        max_len=20,
        attention=form,
        norm=norm,
    )
    with torch.no_grad():
        for name, p in m.named_parameters():
            if ".b_" in name:
                p.normal_()  # fresh biases are zero; make them count
    m = remove_heads(m, PRUNE) if pruned else m
    return m.to(dtype).eval()


def inputs():
    gen = torch.Generator().manual_seed(1)
    src, tgt = torch.randint(3, 17, (3, 7), generator=gen), torch.randint(3, 19, (3, 6), generator=gen)
    src[0, -2:] = PAD
    src[2] = PAD  # a sentence of padding only: its queries see no key, in the encoder and across
    tgt[1, -1] = PAD
    return src, tgt, padding_mask(src, PAD), target_mask(tgt, PAD)


def reference(att, x_q, x_kv, mask):
    """softmax((x_q W_Q[i] + b_Q[i]) (x_kv W_K[i] + b_K[i])^T / sqrt(d_k)) per head, blocked keys 0, written out."""
    att = att if isinstance(att, PerHeadAttention) else split(att)
    B, T_q, T_k = x_q.size(0), x_q.size(1), x_kv.size(1)
    allowed = torch.ones(B, T_q, T_k, dtype=torch.bool) if mask is None else mask.expand(B, T_q, T_k)
    heads = []
    for i in range(att.h):
        q, k = x_q @ att.W_Q[i] + att.b_Q[i], x_kv @ att.W_K[i] + att.b_K[i]
        s = q @ k.transpose(-1, -2) / math.sqrt(att.d_k)
        top = s.masked_fill(~allowed, -math.inf).amax(-1, keepdim=True)
        e = torch.exp(s - torch.where(torch.isfinite(top), top, 0.0)) * allowed
        total = e.sum(-1, keepdim=True)
        heads.append(torch.where(total > 0, e / total, 0.0))
    return torch.stack(heads, dim=1)  # (B, h, T_q, T_k)


@torch.no_grad()
def reference_model(m, src, tgt, src_mask, tgt_mask):
    """Every attention's probabilities, from the sublayer inputs traced by hand through the layers."""
    into = lambda res, x: res.ln(x) if res.pre else x  # what the sublayer sees
    want, x = {}, m.pos(m.src_embed(src))
    for l, layer in enumerate(m.encoder.layers):
        z = into(layer.res_attn, x)
        want["enc_self", l] = reference(layer.self_attn, z, z, src_mask)
        x = layer(x, src_mask)
    memory, y = m.encoder.final_ln(x), m.pos(m.tgt_embed(tgt))
    for l, layer in enumerate(m.decoder.layers):
        z = into(layer.res_self, y)
        want["dec_self", l] = reference(layer.self_attn, z, z, tgt_mask)
        after_self = layer.res_self(y, lambda z: layer.self_attn(z, z, tgt_mask))
        want["cross", l] = reference(layer.cross_attn, into(layer.res_cross, after_self), memory, src_mask)
        y = layer(y, memory, src_mask, tgt_mask)
    return want


@pytest.mark.parametrize("pruned", [False, True])
@pytest.mark.parametrize("norm", ["post", "pre"])
@pytest.mark.parametrize("form", ["fused", "per_head"])
def test_recorded_probabilities_equal_a_written_out_softmax(form, norm, pruned):
    m = model(form, norm, pruned)
    src, tgt, src_mask, tgt_mask = inputs()
    with torch.no_grad(), record_attention(m) as probs:
        m.decode(m.encode(src, src_mask), src_mask, tgt, tgt_mask)
    want = reference_model(m, src, tgt, src_mask, tgt_mask)
    assert set(probs) == set(sites(m)) and all(len(calls) == 1 for calls in probs.values())
    for site, (p,) in probs.items():
        assert p.shape == want[site].shape and p.size(1) == attention_at(m, *site).h, site
        assert (p - want[site]).abs().max() <= TOL, site
    if pruned:
        assert [probs[s][0].size(1) for s in PRUNE] == [3, 2, 3]


@pytest.mark.parametrize("form", ["fused", "per_head"])
def test_recording_changes_no_output(form, fast_path):
    fast_path(True)
    m = model(form, dtype=torch.float32)
    src, tgt, src_mask, tgt_mask = inputs()
    with torch.no_grad():
        plain = m(src, tgt, src_mask, tgt_mask)
        with record_attention(m) as probs:
            recorded = m(src, tgt, src_mask, tgt_mask)
    assert torch.equal(plain, recorded) and all(len(calls) == 1 for calls in probs.values())


@pytest.mark.parametrize("form", ["fused", "per_head"])
def test_in_training_mode_the_recorder_gives_probabilities_before_dropout(form):
    """Dropout 0.5 in training: the model's outputs do not change (the recorder draws no random numbers)
    and each recorded row sums to 1 (thinned rows would not: dropout zeroes weights and doubles the rest)."""
    m = model(form, dropout=0.5).train()
    src, tgt, src_mask, tgt_mask = inputs()
    torch.manual_seed(5)
    plain = m(src, tgt, src_mask, tgt_mask)
    torch.manual_seed(5)
    with record_attention(m) as probs:
        recorded = m(src, tgt, src_mask, tgt_mask)
    assert torch.equal(plain, recorded)
    torch.manual_seed(6)
    assert not torch.equal(plain, m(src, tgt, src_mask, tgt_mask))  # dropout is on
    for kind, l in sites(m):
        p = probs[kind, l][0]
        rows = p.sum(-1)  # (B, h, T_q)
        sees = rows > 0  # fully masked rows are zero (the padding-only sentence)
        assert not p.requires_grad and (rows[sees] - 1).abs().max() <= TOL and sees[:2].all()


def test_rows_sum_to_one_and_fully_masked_rows_are_zero():
    m = model("per_head")
    src, tgt, src_mask, tgt_mask = inputs()
    with torch.no_grad(), record_attention(m) as probs:
        m.decode(m.encode(src, src_mask), src_mask, tgt, tgt_mask)
    S, T_len = src.size(1), tgt.size(1)
    masks = {"enc_self": src_mask.expand(3, S, S), "dec_self": tgt_mask, "cross": src_mask.expand(3, T_len, S)}
    for kind, l in sites(m):
        p, allowed = probs[kind, l][0], masks[kind].unsqueeze(1).expand_as(probs[kind, l][0])
        assert torch.all(p[~allowed] == 0)  # blocked keys: exactly 0
        sees = allowed.any(-1)  # (B, h, T_q)
        assert (p.sum(-1)[sees] - 1).abs().max() <= TOL
        assert torch.all(p[~sees] == 0)
        assert sees.all() if kind == "dec_self" else (not sees[2].any() and sees[:2].all())


def _hooks(m):
    return [len(attention_at(m, *s)._forward_hooks) for s in sites(m)]


def test_hooks_are_removed_after_the_block_and_after_an_error():
    m = model()
    src, _, src_mask, _ = inputs()
    before = _hooks(m)
    with record_attention(m) as probs:
        assert _hooks(m) == [n + 1 for n in before]
    with pytest.raises(RuntimeError, match="inside the block"), record_attention(m):
        raise RuntimeError("inside the block")
    assert _hooks(m) == before == [0] * len(before)
    with torch.no_grad():
        m.encode(src, src_mask)
    assert all(calls == [] for calls in probs.values())  # nothing recorded outside the block


@pytest.mark.parametrize("form", ["fused", "per_head"])
def test_cached_decoding_records_the_rows_of_full_recomputation(form):
    m = model(form)
    src, tgt, src_mask, _ = inputs()
    T_len = tgt.size(1)
    with torch.no_grad():
        memory = m.encode(src, src_mask)
        with record_attention(m) as full:
            m.decode(memory, src_mask, tgt, subsequent_mask(T_len))
        cache = m.new_cache()
        with record_attention(m) as steps:
            for t in range(T_len):
                m.decode(memory, src_mask, tgt[:, t : t + 1], None, cache=cache, start=t)
    for kind, l in sites(m):
        if kind == "enc_self":
            continue
        assert len(steps[kind, l]) == T_len
        for t, p in enumerate(steps[kind, l]):  # step t: one query, keys 0..t (self) or the source (cross)
            want = full[kind, l][0][:, :, t : t + 1, : t + 1 if kind == "dec_self" else None]
            assert p.shape == want.shape and (p - want).abs().max() <= TOL, (kind, l, t)


@pytest.mark.parametrize("cls", [PerHeadAttention, FusedAttention])
def test_attend_with_probabilities_gives_the_module_output(cls):
    torch.manual_seed(0)
    att = cls(12, 3, d_k=5, d_v=2).double().eval()
    gen = torch.Generator().manual_seed(2)
    x, x_kv = (
        torch.randn(2, 4, 12, generator=gen, dtype=torch.float64),
        torch.randn(2, 6, 12, generator=gen, dtype=torch.float64),
    )
    mask = torch.rand(2, 1, 6, generator=gen) > 0.4
    out, p = attend_with_probabilities(att, x, x_kv, mask)
    assert torch.equal(out, att(x, x_kv, mask)) and (p - reference(att, x, x_kv, mask)).abs().max() <= TOL
    out_kv, p_kv = attend_with_probabilities(att, x, mask=mask, kv=att.keys_values(x_kv))
    assert torch.equal(out_kv, out) and torch.equal(p_kv, p)
    with pytest.raises(ValueError, match="exactly one of x_kv and precomputed kv"):
        attend_with_probabilities(att, x, x_kv, kv=att.keys_values(x_kv))
    with pytest.raises(TypeError, match="record_attention expects an EncoderDecoder"), record_attention(att):
        pass
