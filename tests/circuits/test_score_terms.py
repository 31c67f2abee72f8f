"""Where each score comes from (annotated/circuits/score_terms.py): the stream's parts and the six terms add up to
the model's own inputs and scores; shares and roles by hand."""

import numpy as np
import pytest
import torch
from tiny import padded_batch, random_biases, tiny_model

from annotated.attention.bootstrap import mean_interval
from annotated.circuits.circuits import allowed_keys, attention_inputs, circuits, head_matrices
from annotated.circuits.score_terms import (
    PARTS,
    TERMS,
    aligned_share,
    aligned_shares,
    argmax_roles,
    read_scores,
    reading_records,
    score_terms,
    stream_parts,
    variance_shares,
)
from annotated.sites import attention_at
from annotated.tokens import BOS, EOS, PAD
from annotated.transformer import convert_model

# float64 throughout: the parts and terms add the model's own products in another order, so they differ from the
# model's inputs and scores by rounding only (about 1e-16 relative, scores of size ~10); 1e-12 leaves a factor 100
# and catches any lost part (a LayerNorm's bias or a sublayer's output moves a score by 1e-2 or more)
TOL = 1e-12


def _random_model(form: str, norm: str, seed: int = 0):
    """test_circuits.py's random model; its LayerNorms' gains and shifts random too, so every part is exercised."""
    model = tiny_model(23, 19, seed=seed, N=2, d_model=24, h=3, d_k=5, d_v=7, attention=form, norm=norm)
    return random_biases(model, norms=True).double()


def _models_and_batches():
    for norm in ("post", "pre"):
        for form in ("fused", "per_head"):
            yield f"random {norm} {form}", _random_model(form, norm), *padded_batch()
    from annotated.shipped import load_shipped

    model, tok, _ = load_shipped("de-en")
    pad = lambda seqs: torch.nn.utils.rnn.pad_sequence([torch.tensor(s) for s in seqs], batch_first=True)
    src = pad([tok.encode(s) for s in ["Ein Hund rennt über die Wiese.", "Zwei Männer spielen Fußball im Park."]])
    tgt = pad([[BOS, *tok.encode(t)] for t in ["A dog runs across the meadow.", "Two men play soccer in the park."]])
    yield "shipped fused", model.double().eval(), src, tgt
    yield "shipped per_head", convert_model(model.double().eval(), "per_head"), src, tgt


def test_score_terms_sum_to_the_real_scores():
    """The stream's four parts sum to what each attention reads, and the six terms to the model's own scores."""
    checked = 0
    for label, model, src, tgt in _models_and_batches():
        parts = stream_parts(model, src, tgt, PAD)
        inputs = attention_inputs(model, src, tgt, PAD)
        for site, heads in circuits(model).items():
            (q_parts, k_parts), (x_q, x_kv) = parts[site], inputs[site]
            assert set(q_parts) == set(PARTS)
            assert (sum(q_parts.values()) - x_q).abs().max() < TOL, (label, site)
            assert (sum(k_parts.values()) - x_kv).abs().max() < TOL, (label, site)
            att = attention_at(model, *site)
            q, (k, _) = att.queries(x_q), att.keys_values(x_kv)
            model_scores = q @ k.transpose(-1, -2) / att.d_k**0.5  # (B, h, T_q, T_k) as the model computes them
            for c in heads:
                terms = score_terms(c, head_matrices(att, c.head), q_parts, k_parts)
                assert list(terms) == list(TERMS)
                gap = (sum(terms.values()) - model_scores[:, c.head]).abs().max().item()
                assert gap < TOL, f"{label} {site} head {c.head}: {gap}"
                if site[1] == 0 and site[0] != "cross" and model.config.norm == "post":
                    assert terms["written"].abs().max() == 0.0  # nothing is written before the first layer
                checked += 1
    assert checked == 4 * 18 + 2 * 24


def test_shares_of_the_score_sum_to_one_and_ignore_what_is_constant_per_query():
    g = torch.Generator().manual_seed(0)
    src, tgt = padded_batch()
    allowed = allowed_keys("dec_self", src, tgt, PAD)
    a, b = (
        torch.randn(3, 5, 5, generator=g, dtype=torch.float64),
        torch.randn(3, 5, 5, generator=g, dtype=torch.float64),
    )
    constant = torch.randn(3, 5, 1, generator=g, dtype=torch.float64).expand(3, 5, 5)  # the same for every key
    shares = variance_shares({"a": a, "b": b, "constant": constant}, allowed)
    assert torch.allclose(sum(shares.values()), torch.ones(3, dtype=torch.float64))
    assert shares["constant"].abs().max() < 1e-15
    alone = variance_shares({"a": a, "none": torch.zeros_like(a)}, allowed)
    assert torch.allclose(alone["a"], torch.ones(3, dtype=torch.float64)) and alone["none"].abs().max() == 0


def test_roles_are_read_from_the_real_attention():
    """Where the argmax falls, counted over queries with a choice (self-attention: from the second position)."""
    src = torch.tensor([[5, 6, 7, 8, PAD]])
    allowed = allowed_keys("enc_self", src, src, PAD)
    scores = torch.zeros(1, 5, 5)
    for a, b in ((0, 0), (1, 0), (2, 1), (3, 3), (4, 0)):  # query 4 is padding: not counted
        scores[0, a, b] = 1.0
    roles = argmax_roles(scores, allowed, "enc_self")
    # queries 1, 2, 3 are counted: 1 -> first (and previous), 2 -> previous, 3 -> self and last (key 3 is the last)
    assert {r: round(float(v[0]), 4) for r, v in roles.items() if v == v} == {
        "first": 0.3333,
        "self": 0.3333,
        "previous": 0.6667,
        "last": 0.3333,
    }
    cross = argmax_roles(scores[:, :3, :4], torch.ones(1, 3, 4, dtype=torch.bool), "cross")
    assert torch.isnan(cross["self"]).all() and torch.isnan(cross["previous"]).all() and cross["first"][0] == 2 / 3


def test_a_cross_head_that_looks_at_the_first_source_piece_is_aligned_where_the_links_say_so():
    model = tiny_model(12, 12, tied=False, d_model=8, d_ff=8, h=1).double()
    with torch.no_grad():  # no query: every score is 0 and the argmax is the first source piece
        model.decoder.layers[0].cross_attn.W_Q.zero_()
        model.decoder.layers[0].cross_attn.b_Q.zero_()
    pieces = lambda ids: ["\u2581w" + str(i) for i in ids]  # every piece a word
    src, tgt = torch.tensor([[5, 6, 7]]), torch.tensor([[BOS, 8, 9, EOS]])
    site = (("cross", 0), 0)
    # target word 0 links to source word 0 (the argmax's word), target word 1 to source word 2
    assert aligned_shares(model, pieces, [(src, tgt)], [{(0, 0), (2, 1)}], PAD)[site] == [0.5]
    assert aligned_shares(model, pieces, [(src, tgt)], [{(0, 0), (0, 1)}], PAD)[site] == [1.0]
    assert aligned_shares(model, pieces, [(src, tgt)], [{(1, 0)}], PAD)[site] == [0.0]


def test_the_aligned_word_is_read_at_the_row_that_predicts_it():
    src = ["\u2581Ein", "\u2581Hund", "\u2581bellt", "\u2581."]
    y = ["\u2581A", "\u2581d", "og", "\u2581bark", "s", "\u2581."]  # words a, dog, barks, . (never linked)
    links = {(0, 0), (1, 1), (2, 2)}
    # rows 0, 1, 3 predict the first pieces of a, dog, barks; rows 2 and 4 predict the second pieces
    assert aligned_share([0, 1, 3, 2, 3, 0], src, y, links) == 1.0
    assert aligned_share([0, 1, 2, 3, 2, 0], src, y, links) == 2 / 3  # row 3 on the full stop
    assert aligned_share([0, 1, 2, 3, 2, 0], src, y, {(3, 3)}) is None  # only the full stop linked: not a word
    assert aligned_share([1, 0, 2, 2, 2, 0], src, y, links) == 1 / 3


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_the_record_has_every_term_and_its_interval(norm):
    model = _random_model("fused", norm)
    readings = read_scores(model, [padded_batch(), padded_batch(2)], PAD)
    records = reading_records(readings, resamples=20)
    assert len(records) == 18
    values = readings[(("cross", 1), 2)].shares["written"]
    c = mean_interval(np.array(values), resamples=20)
    assert len(values) == 6 and records[(("cross", 1), 2)]["score_terms"]["written"] == [c.value, c.low, c.high]
    for (site, _), r in records.items():
        shares = r["score_terms"]
        assert list(shares) == list(TERMS)
        assert abs(sum(v[0] for v in shares.values()) - 1.0) < 1e-12  # the means of shares that sum to 1
        assert all(low <= value <= high for value, low, high in shares.values())
        expected = {"enc_self": {"first", "self", "previous", "last"}, "dec_self": {"first", "self", "previous"}}
        assert set(r["roles"]) - {"label"} == expected.get(site[0], {"first", "last"}), site


def test_reading_a_few_sentences_at_a_time_changes_nothing():
    """read_scores splits batches into chunks to keep less at once; each sentence's shares and roles are its own."""
    model = _random_model("per_head", "post")
    whole, one_by_one = read_scores(model, [padded_batch()], PAD), read_scores(model, [padded_batch()], PAD, chunk=1)
    for key, r in whole.items():
        for name in TERMS:  # another padding width adds the same products in another order: rounding only
            assert np.allclose(r.shares[name], one_by_one[key].shares[name], rtol=0, atol=1e-12), (key, name)
        assert r.roles.keys() == one_by_one[key].roles.keys()
        for name, v in r.roles.items():
            assert np.array_equal(v, one_by_one[key].roles[name], equal_nan=True), (key, name)
