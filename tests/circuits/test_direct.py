"""The direct path (annotated/circuits/direct.py) and faithfulness (faithfulness.py): exact where the prose says
so, and a planted model whose readout finds exactly what was planted."""

import copy
import math

import numpy as np
import torch

from annotated.circuits.circuits import Factored, HeadCircuit, attention_inputs, circuits
from annotated.circuits.direct import (
    SIDES,
    best_pairs,
    copying_score,
    exact,
    layer_norms_after,
    layer_norms_before,
    norm_divisors,
    norms_before,
    ov_table,
    position_vectors,
    positional_table,
    preferred_offsets,
    sentence_vectors,
    through,
    token_vectors,
    top_table,
)
from annotated.circuits.faithfulness import argmax_agreement, faithfulness, masked_spearman, predicted_scores
from annotated.circuits.fold import fold_layer_norms
from annotated.sites import attention_at
from annotated.tokens import BOS, EOS, PAD
from annotated.transformer import FeedForward, FusedAttention, PerHeadAttention, make_model

TOL = 1e-12  # float64 sums of the same products in another order


def _shipped64():
    from annotated.shipped import load_shipped

    model, tok, _ = load_shipped("de-en")
    return model.double().eval(), tok


def _pairs(tok):
    src = ["Ein Hund rennt über die Wiese.", "Zwei Männer spielen Fußball.", "Eine Frau mit rotem Hut."]
    tgt = ["A dog runs across the meadow.", "Two men play soccer.", "A woman with a red hat."]
    pad = lambda seqs: torch.nn.utils.rnn.pad_sequence([torch.tensor(s) for s in seqs], batch_first=True)
    return pad([tok.encode(s) + [EOS] for s in src]), pad([[BOS] + tok.encode(t) for t in tgt])


def test_the_first_layer_splits_exactly_into_four_tables():
    model, tok = _shipped64()
    src, tgt = _pairs(tok)
    inputs = attention_inputs(model, src, tgt, PAD)
    for site, side_ids in ((("enc_self", 0), src), (("dec_self", 0), tgt)):
        assert exact(model, site)
        x = sentence_vectors(model, site, "q", side_ids)
        assert (x - inputs[site][0]).abs().max() < TOL  # the direct path is the whole input here
        c = circuits(model)[site][1]
        e = token_vectors(model, site, "q", side_ids[0])  # (T, d_model)
        p = position_vectors(model, site, "q", side_ids.size(1))
        cross = c.scale * (c.QK.bilinear(e, p) + c.QK.bilinear(p, e))
        four = c.matching(e, e) + c.matching(p, p) + cross  # token table + position table + the two cross terms
        assert (four - c.matching(x[0], x[0])).abs().max() < TOL
    assert not exact(model, ("enc_self", 1)) and not exact(model, ("cross", 0))


def test_the_norms_are_followed_on_the_way_in_and_out():
    model, _ = _shipped64()
    N = model.config.N
    from annotated.circuits.direct import layer_norms_before, norms_before

    assert layer_norms_before(model, ("enc_self", 0), "q") == []
    assert len(layer_norms_before(model, ("enc_self", 1), "q")) == 2  # layer 0's two sublayers
    assert len(layer_norms_before(model, ("cross", 0), "kv")) == 2 * N  # the whole encoder
    assert len(layer_norms_before(model, ("cross", 1), "q")) == 3 + 1  # decoder layer 0, then layer 1's self
    assert len(layer_norms_after(model, ("cross", N - 1))) == 2  # its own sublayer's norm and the ffn's
    pre = make_model(src_vocab=10, tgt_vocab=10, N=2, d_model=8, h=2, d_ff=8, norm="pre")
    assert norms_before(pre, ("enc_self", 1), "q") == ["encoder.layers.1.res_attn.ln"]  # pre-norm: its own only
    assert norms_before(pre, ("cross", 1), "q") == ["decoder.layers.1.res_cross.ln"]
    assert norms_before(pre, ("cross", 0), "kv") == ["encoder.final_ln"]
    assert layer_norms_after(pre, ("dec_self", 0)) == [pre.decoder.final_ln]
    assert layer_norms_after(pre, ("enc_self", 0)) == [pre.encoder.final_ln]
    v = torch.randn(5, model.config.d_model, dtype=torch.float64)
    assert through([], v) is v
    ln = model.encoder.layers[0].res_attn.ln  # trained: its gamma is not all ones
    gamma = ln.weight.detach()
    expected = (v - v.mean(-1, keepdim=True)) * gamma  # LayerNorm less its division and its beta
    assert (through([ln], v) - expected).abs().max() < TOL and (gamma - 1).abs().max() > 0.1


def _spearman_rows(a, b):
    rank = lambda x: np.argsort(np.argsort(x))
    return np.corrcoef(rank(a), rank(b))[0, 1]


def test_masked_spearman_is_scipys_on_each_row():
    g = torch.Generator().manual_seed(0)
    a, b = (
        torch.randn(2, 4, 6, generator=g, dtype=torch.float64),
        torch.randn(2, 4, 6, generator=g, dtype=torch.float64),
    )
    allowed = torch.ones(2, 4, 6, dtype=torch.bool)
    allowed[0, :, 4:] = False  # padding
    allowed[1] = torch.ones(4, 6, dtype=torch.bool).tril()  # causal: row 0 has one key
    rho, rows = masked_spearman(a, b, allowed)
    for i in range(2):
        for j in range(4):
            keys = allowed[i, j].nonzero().flatten().numpy()
            if len(keys) < 2:
                assert not rows[i, j]
                continue
            assert abs(rho[i, j].item() - _spearman_rows(a[i, j, keys].numpy(), b[i, j, keys].numpy())) < 1e-12
    agree = argmax_agreement(a, a + 1e-3 * b, allowed)
    assert agree.min() == 1.0 and argmax_agreement(a, -a, allowed)[0].max() == 0.0


def _silent(model):
    """A copy of `model` whose sublayers write nothing: every attention's W_O, b_O and every W_2, b_2 at zero.
    Each head past the first layer then reads the embeddings through the norms, and nothing else."""
    silent = copy.deepcopy(model)
    with torch.no_grad():
        for m in silent.modules():
            if isinstance(m, FeedForward):
                m.W_2.zero_(), m.b_2.zero_()
            elif isinstance(m, (PerHeadAttention, FusedAttention)):
                for p in (m.W_O, m.b_O):
                    p.zero_()
    return silent


def test_the_exact_norms_reading_is_the_heads_input_when_the_sublayers_write_nothing():
    """The exact-norms reading, from the embeddings, the folded weights and the recorded divisors only,
    gives what each head's softmax sees (its real scores up to a constant per query) when nothing else is
    written; the weights-only reading does not, past the first layer: the divisions and the betas matter."""
    model, tok = _shipped64()
    silent = _silent(model)
    src, tgt = _pairs(tok)
    real_inputs = attention_inputs(silent, src, tgt, PAD)  # the model's own pass, through hooks
    predicted = predicted_scores(silent, fold_layer_norms(silent), src, tgt, PAD)
    centred = lambda s: s - s.mean(-1, keepdim=True)  # the softmax ignores a constant per query
    missed = {}
    for site, heads in circuits(silent).items():
        for c in heads:
            real = centred(c.scores(*real_inputs[site]))  # (B, T_q, T_k) every score term, centred
            assert real.abs().max() > 1.0  # scores of real size: the tolerance means something
            gap = (centred(predicted["exact_norms"][(site, c.head)]) - real).abs().max()
            assert gap < TOL, (site, c.head, gap.item())
            missed[(site, c.head)] = (centred(predicted["weights_only"][(site, c.head)]) - real).abs().max()
    assert all(missed[(s, h)] < TOL for s, h in missed if exact(silent, s))  # both exact in the first layer
    assert min(v for (s, _), v in missed.items() if not exact(silent, s)) > 0.1  # and only there
    f = faithfulness(silent, [(src, tgt)], PAD, resamples=50)
    assert len(f) == 24
    for key, readings in f.items():
        through = readings["exact_norms"]
        assert through.rho.value > 1 - 1e-9 and through.argmax.value == 1.0, (key, through)
    assert min(r["weights_only"].rho.value for r in f.values()) < 0.95  # the weights-only reading is not exact

    torch.manual_seed(0)  # pre-norm: each head reads its own norm of the embeddings, with that norm's divisor
    pre = _silent(make_model(src_vocab=30, tgt_vocab=30, N=2, d_model=16, d_ff=8, h=2, norm="pre").double().eval())
    with torch.no_grad():
        for m in pre.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.uniform_(0.3, 2.0), m.bias.normal_()
    src, tgt = torch.randint(4, 30, (2, 6)), torch.randint(4, 30, (2, 5))
    real_inputs = attention_inputs(pre, src, tgt, PAD)
    predicted = predicted_scores(pre, fold_layer_norms(pre), src, tgt, PAD)
    for site, heads in circuits(pre).items():
        for c in heads:
            gap = centred(predicted["exact_norms"][(site, c.head)]) - centred(c.scores(*real_inputs[site]))
            assert gap.abs().max() < TOL, (site, c.head)


# ---------------------------------------------------------------- a planted model


def _planted():
    """One layer, d_model 32, 2 heads of d_k 16, d_v 32: enc head 0 matches token A with B, enc head 1 attends to
    the previous position, cross head 0 copies what it reads, cross head 1 writes the opposite."""
    torch.manual_seed(0)
    d, d_k = 32, 16
    model = (
        make_model(
            src_vocab=40,
            tgt_vocab=40,
            N=1,
            d_model=d,
            d_ff=16,
            h=2,
            d_k=d_k,
            d_v=d,
            dropout=0.0,
            attention="per_head",
            share_embeddings=True,
            tie_generator=True,
            max_len=64,
        )
        .double()
        .eval()
    )
    A, B = 7, 11
    with torch.no_grad():
        enc = attention_at(model, "enc_self", 0)
        E = model.src_embed.weight * math.sqrt(d)  # what the head reads
        for W in (enc.W_Q[0], enc.W_K[0]):
            W.zero_()
        enc.W_Q[0][:, 0] = 3 * E[A] / E[A].norm()
        enc.W_K[0][:, 0] = 3 * E[B] / E[B].norm()
        enc.W_Q[1].zero_(), enc.W_K[1].zero_()
        for j in range(d_k // 2):  # rotate each sinusoid pair back one position: p_m W_Q = p_{m-1}
            w = 10000 ** (-2 * j / d)
            enc.W_Q[1][2 * j : 2 * j + 2, 2 * j : 2 * j + 2] = 4 * torch.tensor(
                [[math.cos(w), math.sin(w)], [-math.sin(w), math.cos(w)]]
            )
            enc.W_K[1][2 * j : 2 * j + 2, 2 * j : 2 * j + 2] = 4 * torch.eye(2)
        cross = attention_at(model, "cross", 0)
        cross.W_V[0].copy_(torch.eye(d)), cross.W_O[0].copy_(torch.eye(d))
        cross.W_V[1].copy_(torch.eye(d)), cross.W_O[1].copy_(-torch.eye(d))
    return model, A, B


def test_the_readout_finds_exactly_what_was_planted():
    model, A, B = _planted()
    cs = circuits(model)
    ids = torch.arange(4, 40)  # every non-special token
    site = ("enc_self", 0)
    top = top_table(cs[site][0], token_vectors(model, site, "q", ids), token_vectors(model, site, "kv", ids))
    row, col, _ = best_pairs(top, 1)[0]
    assert (int(ids[row]), int(ids[col])) == (A, B)  # the token pair it was built to match

    offsets = preferred_offsets(positional_table(model, cs[site][1], n=30))
    assert offsets[1:].tolist() == [-1] * 29  # every position but the first attends to the one before it
    assert preferred_offsets(positional_table(model, cs[site][0], n=30)).unique().numel() > 1  # not positional

    x = token_vectors(model, ("cross", 0), "kv", ids)
    copier, opposite = cs[("cross", 0)]
    assert copying_score(model, copier, x, ids) > 0.9 and copying_score(model, opposite, x, ids) < -0.9
    promoted = ov_table(model, copier, x, ids, k=1).ids[:, 0]
    assert torch.equal(promoted, ids)  # reading token t raises the logit of t, for every t


def test_copying_score_from_the_small_matrix_is_the_vocabularys():
    torch.manual_seed(2)
    model = (
        make_model(src_vocab=30, tgt_vocab=30, N=2, d_model=16, d_ff=8, h=2, share_embeddings=True, tie_generator=True)
        .double()
        .eval()
    )
    ids = torch.arange(30)
    for site in (("cross", 0), ("dec_self", 1)):
        c = circuits(model)[site][1]
        x = token_vectors(model, site, "kv", ids)
        written = through(layer_norms_after(model, site), c.OV.apply(x))  # (V, d_model)
        lam = torch.linalg.eigvals(written @ model.generator.weight.detach().T)  # the V x V matrix itself
        expected = float(lam.real.sum() / lam.abs().sum())
        assert abs(copying_score(model, c, x, ids) - expected) < 1e-9


# ---------------------------------------------------------------- which norm, which table, which keys


def test_a_pre_norm_direct_path_passes_each_sublayers_own_norm():
    """Pre-norm: an attention reads LN(x) of its own sublayer's norm (the encoder's final norm for the
    cross-attention's keys). In a model whose sublayers write nothing the stream is the embedding everywhere, so
    the weights-only reading (that norm's centring and gamma) divided by that norm's divisor, plus its beta, is
    the attention's real input, at every site and both sides: each norm has its own random gain and bias."""
    torch.manual_seed(0)
    pre = _silent(make_model(src_vocab=30, tgt_vocab=30, N=2, d_model=16, d_ff=8, h=2, norm="pre").double().eval())
    with torch.no_grad():
        for m in pre.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.uniform_(0.3, 2.0), m.bias.normal_()
    g = torch.Generator().manual_seed(1)
    src, tgt = torch.randint(4, 30, (2, 6), generator=g), torch.randint(4, 30, (2, 5), generator=g)
    real = attention_inputs(pre, src, tgt, PAD)
    divisors = norm_divisors(pre, src, tgt, PAD)
    ids = {"src": src, "tgt": tgt}
    for site in real:
        for k, side in enumerate(("q", "kv")):
            [name] = norms_before(pre, site, side)
            ln = pre.get_submodule(name)
            read = sentence_vectors(pre, site, side, ids[SIDES[site[0]][k]])  # (2, T, d_model)
            got = read / divisors[name].unsqueeze(-1) + ln.bias
            assert (got - real[site][k]).abs().max() < TOL, (site, side)


def test_token_pairs_are_ranked_on_scores_centred_per_query():
    """Key b is k_b = 5 e_0 + e_b; query 0 is 10 e_0, which scores every key 50 (no preference: the softmax
    ignores it), query 1 is 2 e_2, which prefers key 1 by 2. Centred per query, the best pair is (1, 1);
    ranked on raw scores it would be query 0 with any key."""
    eye = torch.eye(4, dtype=torch.float64)
    one = Factored(eye, eye)
    c = HeadCircuit(("enc_self", 0), 0, one, one, None, None, None, None, scale=1.0)
    x_kv = 5 * eye[0] + eye[1:]  # (3, 4)
    x_q = torch.stack([10 * eye[0], 2 * eye[2]])  # (2, 4)
    top = top_table(c, x_q, x_kv, k=3)
    assert best_pairs(top, 1)[0][:2] == (1, 1)
    assert top.values[0].abs().max() < TOL  # query 0's centred row is flat
    assert abs(top.values[1].sum()) < TOL  # each row centred over its keys


def _rotations(forward: bool, d: int, d_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """W_Q, W_K (d, d_k) that make position m's query match key m + 1 (forward) or m - 1: each sinusoid pair
    rotated by one position (the planted previous-token head's construction)."""
    W_Q, W_K = torch.zeros(d, d_k, dtype=torch.float64), torch.zeros(d, d_k, dtype=torch.float64)
    sign = -1.0 if forward else 1.0
    for j in range(d_k // 2):
        w = 10000 ** (-2 * j / d)
        c, s = math.cos(w), sign * math.sin(w)
        W_Q[2 * j : 2 * j + 2, 2 * j : 2 * j + 2] = 4 * torch.tensor([[c, s], [-s, c]])
        W_K[2 * j : 2 * j + 2, 2 * j : 2 * j + 2] = 4 * torch.eye(2)
    return W_Q, W_K


def test_the_decoder_position_table_hides_the_future():
    """A decoder self-attention head built to prefer the next position: its position table gives every future
    key -inf and is centred over the keys each query may see, so no preferred offset and no label points
    forward, though the same reading with the future shown prefers +1 at every query but the last."""
    from annotated.circuits.readout import weights_record

    model, _, _ = _planted()
    att = attention_at(model, "dec_self", 0)
    with torch.no_grad():
        W_Q, W_K = _rotations(True, att.d_model, att.d_k)
        att.W_Q[1].copy_(W_Q), att.W_K[1].copy_(W_K)
    c = circuits(model)[("dec_self", 0)][1]
    n = 24
    p = position_vectors(model, c.site, "q", n)
    shown = c.matching(p, p).argmax(-1) - torch.arange(n)
    assert shown[:-1].eq(1).all()  # the head wants the next position
    table = positional_table(model, c, n)
    future = torch.ones(n, n, dtype=torch.bool).triu(1)
    assert table[future].eq(float("-inf")).all() and table[~future].isfinite().all()
    assert max(abs(float(table[a, : a + 1].sum())) for a in range(n)) < 1e-9  # centred over the visible keys
    assert preferred_offsets(table).max() <= 0
    positions = weights_record(model, c)["positions"]
    assert max(positions["offsets"]) <= 0 and positions["label"] != "next" and "+" not in positions["label"]


def test_a_decoder_self_attention_heads_writes_pass_its_own_norm_first():
    """Decoder self-attention head 0 of the planted model made a copier (W_V = W_O = I) and its own sublayer's
    norm given gain -1: read through that norm its copying score is -1 and its OV table never promotes the
    token read; the cross-attention copier, whose write meets no such norm, still copies."""
    model, _, _ = _planted()
    att = attention_at(model, "dec_self", 0)
    with torch.no_grad():
        att.W_V[0].copy_(torch.eye(att.d_model)), att.W_O[0].copy_(torch.eye(att.d_model))
        model.decoder.layers[0].res_self.ln.weight.fill_(-1.0)
    ids = torch.arange(4, 40)
    cs = circuits(model)
    c = cs[("dec_self", 0)][0]
    x = token_vectors(model, c.site, "kv", ids)
    assert copying_score(model, c, x, ids) < -0.9
    assert not ov_table(model, c, x, ids, k=1).ids[:, 0].eq(ids).any()
    copier = cs[("cross", 0)][0]
    assert copying_score(model, copier, token_vectors(model, copier.site, "kv", ids), ids) > 0.9


def test_decoder_side_tokens_are_read_through_the_target_table():
    """Separate source and target tables (of different sizes): where the direct path is the whole input (the
    first layer's self-attentions) it is the real input, the encoder's from the source table and the decoder's
    from the target table; the cross-attention reads target tokens at its queries and source tokens at its keys."""
    torch.manual_seed(0)
    model = make_model(src_vocab=23, tgt_vocab=19, N=2, d_model=16, d_ff=16, h=2).double().eval()
    assert model.src_embed is not model.tgt_embed
    g = torch.Generator().manual_seed(1)
    src, tgt = torch.randint(4, 23, (2, 6), generator=g), torch.randint(4, 19, (2, 5), generator=g)
    real = attention_inputs(model, src, tgt, PAD)
    for site, ids in ((("enc_self", 0), src), (("dec_self", 0), tgt)):
        for k, side in enumerate(("q", "kv")):
            assert (sentence_vectors(model, site, side, ids) - real[site][k]).abs().max() < TOL, (site, side)
    ids = torch.arange(4, 19)
    for layer in range(2):
        site = ("cross", layer)
        q, kv = layer_norms_before(model, site, "q"), layer_norms_before(model, site, "kv")
        assert (
            token_vectors(model, site, "q", ids) - through(q, model.tgt_embed(ids.unsqueeze(0))[0])
        ).abs().max() < TOL
        assert (
            token_vectors(model, site, "kv", ids) - through(kv, model.src_embed(ids.unsqueeze(0))[0])
        ).abs().max() < TOL
