"""The circuits of annotated/circuits/circuits.py: the identity with the model's own scores and writes, ranks."""

import pytest
import torch
from tiny import padded_batch, random_biases, tiny_model

from annotated.circuits.circuits import Factored, attention_inputs, circuit, circuits
from annotated.recording import attend_with_probabilities
from annotated.sites import attention_at, sites
from annotated.tokens import BOS, EOS, PAD
from annotated.transformer import (
    PerHeadAttention,
    attention_explicit,
    convert_model,
    head_mask,
    padding_mask,
    target_mask,
)

# float64 throughout: the circuit and the model add the same products in another order, so they differ by
# rounding only, about 1e-16 relative; 1e-12 on scores of size ~10 leaves a factor 100 of room and catches
# any wrong term (a dropped bias term moves a score by ~1e-2 or more).
TOL = 1e-12


def _random_model(form: str, seed: int = 0):
    """Two layers of d_model 24, h 3, d_k 5 != d_v 7, vocabularies 23 and 19; every bias random (they start at
    zero), so every bias term is exercised."""
    model = tiny_model(23, 19, seed=seed, N=2, d_model=24, h=3, d_k=5, d_v=7, attention=form)
    return random_biases(model).double()


def _shippedpadded_batch():
    from annotated.shipped import load_shipped

    model, tok, _ = load_shipped("de-en")
    src_text = ["Ein Hund rennt über die Wiese.", "Zwei Männer spielen Fußball im Park."]
    tgt_text = ["A dog runs across the meadow.", "Two men play soccer in the park."]
    enc = lambda texts: torch.nn.utils.rnn.pad_sequence(
        [torch.tensor(t) for t in texts], batch_first=True, padding_value=PAD
    )
    src = enc([tok.encode(s) + [EOS] for s in src_text])
    tgt = enc([[BOS] + tok.encode(t) for t in tgt_text])
    return model.double().eval(), src, tgt


def _models_and_batches():
    yield "random per_head", _random_model("per_head"), *padded_batch()
    yield "random fused", _random_model("fused"), *padded_batch()
    model, src, tgt = _shippedpadded_batch()
    yield "shipped fused", model, src, tgt
    yield "shipped per_head", convert_model(model, "per_head"), src, tgt


def _masks(kind: str, src, tgt):
    return {"enc_self": padding_mask(src, PAD), "dec_self": target_mask(tgt, PAD), "cross": padding_mask(src, PAD)}[
        kind
    ]


def test_circuit_scores_are_the_models_scores():
    """For every head of every attention: scores from W_QK and the bias terms = the model's q k^T / sqrt(d_k)."""
    checked = 0
    for label, model, src, tgt in _models_and_batches():
        inputs = attention_inputs(model, src, tgt, PAD)
        assert set(inputs) == set(sites(model)), label
        for site, heads in circuits(model).items():
            att = attention_at(model, *site)
            x_q, x_kv = inputs[site]
            q, (k, _) = att.queries(x_q), att.keys_values(x_kv)  # (B, h, T_q, d_k), (B, h, T_k, d_k)
            model_scores = q @ k.transpose(-1, -2) / att.d_k**0.5  # (B, h, T_q, T_k)
            for c in heads:
                gap = (c.scores(x_q, x_kv) - model_scores[:, c.head]).abs().max().item()
                assert gap < TOL, f"{label} {site} head {c.head}: {gap}"
                checked += 1
    assert checked == 2 * 18 + 2 * 24  # every head of the two random models (3 x 2 x 3) and the shipped (3 x 2 x 4)


def test_only_the_bilinear_term_and_the_key_bias_reach_the_softmax():
    """softmax(matching) = softmax(scores): the query-only terms and the constant cancel, the key bias does not."""
    model = _random_model("per_head")
    src, tgt = padded_batch()
    inputs = attention_inputs(model, src, tgt, PAD)
    c = circuits(model)[("cross", 1)][2]
    x_q, x_kv = inputs[("cross", 1)]
    full, seen = c.scores(x_q, x_kv).softmax(-1), c.matching(x_q, x_kv).softmax(-1)
    assert (full - seen).abs().max() < TOL
    without_key_bias = (c.QK.bilinear(x_q, x_kv) * c.scale).softmax(-1)
    assert (full - without_key_bias).abs().max() > 1e-3  # the key bias is a real part of the QK circuit


def test_the_ov_circuit_is_what_a_head_writes():
    """P X W_OV + (P 1) b_V W_O = head_i W_O[i], and the heads' terms plus b_O are the attention's output."""
    for label, model, src, tgt in _models_and_batches():
        inputs = attention_inputs(model, src, tgt, PAD)
        for site, heads in circuits(model).items():
            att = attention_at(model, *site)
            x_q, x_kv = inputs[site]
            B, T_q, _ = x_q.shape
            mask = head_mask(_masks(site[0], src, tgt), B, T_q, x_kv.size(1))
            out, p = attend_with_probabilities(att, x_q, x_kv, _masks(site[0], src, tgt))  # p: (B, h, T_q, T_k)
            q, (k, v) = att.queries(x_q), att.keys_values(x_kv)
            heads_out, _ = attention_explicit(q, k, v, mask)  # (B, h, T_q, d_v)
            total = torch.zeros_like(out)
            for c in heads:
                if isinstance(att, PerHeadAttention):
                    W_O = att.W_O[c.head]
                else:  # fused: row block i of W_O, as the chapter's view hands it to head i
                    W_O = att.W_O.view(att.h, att.d_v, -1)[c.head]
                term = heads_out[:, c.head] @ W_O  # head_i W_O[i]  (B, T_q, d_model)
                written = c.writes(p[:, c.head], x_kv)
                assert (written - term).abs().max() < TOL, f"{label} {site} head {c.head}"
                total = total + written
            b_O = att.b_O if att.b_O is not None else 0.0
            assert (total + b_O - out).abs().max() < TOL, f"{label} {site}"


def test_a_circuit_has_rank_at_most_d_k():
    model = _random_model("fused")  # d_model 24, d_k 5, d_v 7
    for heads in circuits(model).values():
        for c in heads:
            assert (c.QK.left @ c.QK.right).shape == (c.OV.left @ c.OV.right).shape == (24, 24)
            assert torch.linalg.matrix_rank(c.QK.left @ c.QK.right) <= 5 and c.QK.rank() <= 5
            assert torch.linalg.matrix_rank(c.OV.left @ c.OV.right) <= 7 and c.OV.rank() <= 7


def test_factored_singular_values_are_the_products():
    g = torch.Generator().manual_seed(3)
    left, right = (
        torch.randn(30, 4, generator=g, dtype=torch.float64),
        torch.randn(4, 20, generator=g, dtype=torch.float64),
    )
    f = Factored(left, right)
    full = torch.linalg.svdvals(left @ right)
    assert torch.allclose(f.singular_values(), full[:4], atol=1e-10)
    assert full[4:].abs().max() < 1e-10 and f.rank() == 4
    assert Factored(left[:, :2] @ torch.ones(2, 4, dtype=torch.float64), right).rank() == 1  # rank 1 however wide


def test_circuits_of_the_per_head_and_fused_forms_are_equal():
    fused = _random_model("fused")
    per_head = convert_model(fused, "per_head")
    for (site, a), (_, b) in zip(circuits(fused).items(), circuits(per_head).items()):
        for ca, cb in zip(a, b):
            for part in ("QK", "OV"):
                # the factors are the weights themselves (a block of the fused matrix, head i's own matrix),
                # copied by convert_model and computed by nothing: bit for bit on any CPU
                fa, fb = getattr(ca, part), getattr(cb, part)
                assert torch.equal(fa.left, fb.left) and torch.equal(fa.right, fb.right), (site, ca.head, part)
            for term in ("key_bias", "query_bias", "constant", "ov_bias"):
                # products (W_K b_Q, ...) of the same numbers read through different strides (a column block
                # of the fused matrix, a contiguous per-head one): the BLAS may pick another kernel for each
                # and sum in another order (2.8e-17 apart on an AMD Zen 4), so within TOL; a term of the
                # wrong head or block is O(1) off
                gap = (getattr(ca, term) - getattr(cb, term)).abs().max().item()
                assert gap < TOL, (site, ca.head, term, gap)


def test_a_head_that_does_not_exist_is_refused_by_number():
    att = attention_at(_random_model("fused"), "cross", 0)
    with pytest.raises(IndexError, match=r"head 3 does not exist: this attention has heads 0\.\.2"):
        circuit(att, 3)


def test_a_query_whose_keys_are_all_masked_writes_nothing():
    """A sentence whose source is padding only: every cross-attention query of it has all its keys masked, its
    row of P is zeros, and each head writes nothing there (not b_V W_O, its constant write whatever it reads),
    so the attention's output at those rows is b_O alone, as the chapter says a fully masked row gives."""
    model = _random_model("per_head")
    src, tgt = padded_batch()
    src[2] = PAD  # sentence 2: a source of padding only
    inputs = attention_inputs(model, src, tgt, PAD)
    for site in (("cross", 0), ("cross", 1)):
        att = attention_at(model, *site)
        x_q, x_kv = inputs[site]
        out, p = attend_with_probabilities(att, x_q, x_kv, padding_mask(src, PAD))  # p: (B, h, T_q, T_k)
        assert p[2].abs().max() == 0 and p[:2].sum(-1).sub(1).abs().max() < TOL
        for c in circuits(model)[site]:
            assert c.ov_bias is not None and c.ov_bias.abs().max() > 0.1  # a constant write there is to be had
            written = c.writes(p[:, c.head], x_kv)  # (B, T_q, d_model)
            assert written[2].abs().max() == 0, (site, c.head)  # zero rows of P times anything: exactly zero
        assert (out[2] - att.b_O).abs().max() < TOL, site
