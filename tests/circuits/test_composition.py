"""Composition scores between heads (annotated/circuits/composition.py): the ratio, its baseline, the pairs of an
encoder-decoder, and a planted previous-token head found by K-composition."""

import math

import torch

from annotated.circuits.circuits import Factored, circuits
from annotated.circuits.composition import (
    composition_figure,
    composition_paths,
    composition_record,
    composition_score,
    compositions,
    frobenius,
    norm_matrix,
    norms_between,
    random_baselines,
    random_overlaps,
    reading,
    standing_out,
)
from annotated.circuits.score_terms import read_scores
from annotated.tokens import PAD
from annotated.transformer import make_model


def dense(f: Factored) -> torch.Tensor:
    return f.left @ f.right  # (m, n)


def _factored(g, m, r, n):
    return Factored(
        torch.randn(m, r, generator=g, dtype=torch.float64), torch.randn(r, n, generator=g, dtype=torch.float64)
    )


def test_composition_score_is_the_materialised_ratio():
    g = torch.Generator().manual_seed(0)
    a, b = _factored(g, 20, 4, 20), _factored(g, 20, 3, 20)
    A, B = dense(a), dense(b)
    # float64 products of small matrices: agree to rounding, ~1e-15 relative; 1e-12 leaves room and catches any
    # wrong product (using B^T instead of B changes the score at the first digit)
    assert abs(frobenius(a) - A.norm()) < 1e-12 * A.norm()
    assert abs(composition_score(a, b) - (A @ B).norm() / (A.norm() * B.norm())) < 1e-12
    assert (
        abs(composition_score(a, a.__class__(b.right.T, b.left.T)) - (A @ B.T).norm() / (A.norm() * B.norm())) < 1e-12
    )
    c = circuits(make_model(src_vocab=9, tgt_vocab=9, N=1, d_model=12, d_ff=8, h=2).double())[("cross", 0)][0]
    QK = dense(c.QK)
    assert torch.allclose(dense(reading(c, "K")), QK.T) and torch.equal(dense(reading(c, "Q")), QK)


def test_the_baseline_is_that_of_random_matrices():
    """random_baselines (overlaps of random frames) = the score of U S V^T with random singular vectors, drawn whole."""
    g = torch.Generator().manual_seed(1)
    d, s_a, s_b = 16, torch.tensor([3.0, 1.0, 0.5], dtype=torch.float64), torch.tensor([2.0, 0.1], dtype=torch.float64)
    mean, low, high = random_baselines(s_a[None], s_b[None], random_overlaps(d, 3, 2, samples=4000))[0]
    frame = lambda r: torch.linalg.qr(torch.randn(d, r, generator=g, dtype=torch.float64))[0]
    direct = []
    for _ in range(4000):
        A = frame(3) @ torch.diag(s_a) @ frame(3).T
        B = frame(2) @ torch.diag(s_b) @ frame(2).T
        direct.append(float((A @ B).norm() / (A.norm() * B.norm())))
    direct_t = torch.tensor(direct, dtype=torch.float64)
    # two independent Monte Carlo estimates of 4,000 draws each: their means differ by about
    # sqrt(2) * std / sqrt(4000) ~ 0.02 std; 0.1 std is five of those
    assert abs(mean - direct_t.mean()) < 0.1 * direct_t.std()
    assert abs(high - direct_t.quantile(0.975)) < 0.3 * direct_t.std() and low < mean < high
    assert abs(mean - 1 / math.sqrt(d)) < 0.3 / math.sqrt(d)  # about 1 / sqrt(d): random subspaces overlap a little


def test_composition_pairs_are_the_encoder_decoders_paths():
    model = make_model(src_vocab=9, tgt_vocab=9, N=2, d_model=8, d_ff=8, h=2)
    paths: dict[tuple, set] = {}
    for w, r, k in composition_paths(model):
        paths.setdefault((w, r), set()).add(k)
    E, D, X = "enc_self", "dec_self", "cross"
    QKV, KV, Q = {"Q", "K", "V"}, {"K", "V"}, {"Q"}
    assert paths == {
        ((E, 0), (E, 1)): QKV,
        **{((E, l), (X, m)): KV for l in (0, 1) for m in (0, 1)},  # the encoder's output: every cross head's keys
        ((D, 0), (D, 1)): QKV,
        ((X, 0), (D, 1)): QKV,
        ((D, 0), (X, 0)): Q,
        ((D, 0), (X, 1)): Q,
        ((X, 0), (X, 1)): Q,
        ((D, 1), (X, 1)): Q,
    }
    dec = model.decoder.layers
    assert norms_between(model, (D, 0), (X, 0), "q") == [dec[0].res_self.ln]  # post-norm: the writer's own norm
    assert norms_between(model, (X, 0), (D, 1), "kv") == [dec[0].res_cross.ln, dec[0].res_ffn.ln]
    assert len(norms_between(model, (E, 0), (X, 0), "kv") or []) == 4  # every encoder sublayer from its own on
    pre = make_model(src_vocab=9, tgt_vocab=9, N=2, d_model=8, d_ff=8, h=2, norm="pre")
    assert norms_between(pre, (D, 0), (X, 1), "q") == [pre.decoder.layers[1].res_cross.ln]  # pre-norm: the reader's
    assert norms_between(pre, (E, 1), (X, 0), "kv") == [pre.encoder.final_ln]
    assert norms_between(pre, (X, 1), (X, 0), "q") is None and norms_between(pre, (E, 0), (D, 1), "q") is None


def test_the_norms_between_are_their_centring_and_gains():
    model = make_model(src_vocab=9, tgt_vocab=9, N=1, d_model=6, d_ff=8, h=2).double()
    lns = norms_between(model, ("dec_self", 0), ("cross", 0), "q")
    assert lns is not None
    with torch.no_grad():
        lns[0].weight.copy_(torch.arange(1.0, 7.0))
    x = torch.randn(3, 6, dtype=torch.float64)
    expected = (x - x.mean(-1, keepdim=True)) * torch.arange(1.0, 7.0, dtype=torch.float64)
    assert torch.allclose(x @ norm_matrix(lns, 6), expected)
    assert torch.allclose(x @ norm_matrix(lns, 6, gains=False), x - x.mean(-1, keepdim=True))


# The planted model: encoder layer 0's head P is a previous-token head (its queries and keys read only the
# sinusoids of the four fastest frequencies, the keys turned one position on), whose OV reads the token
# dimensions 8..15 and writes them into dimensions 56..63; encoder layer 1's head R reads its keys from exactly
# those dimensions (its queries random). Every other weight is random.
D_MODEL, H, D_K = 64, 4, 8
P, R = 1, 2


def _planted():
    torch.manual_seed(0)
    model = make_model(src_vocab=30, tgt_vocab=30, N=2, d_model=D_MODEL, d_ff=32, h=H, d_k=D_K, d_v=D_K)
    model = model.double().eval()
    eye = torch.eye(D_MODEL, dtype=torch.float64)
    freqs = torch.exp(torch.arange(0, 8, 2, dtype=torch.float64) * (-math.log(10000.0) / D_MODEL))
    turn = torch.zeros(8, 8, dtype=torch.float64)  # row vector [sin, cos](pos) @ turn = [sin, cos](pos + 1)
    for i, w in enumerate(freqs.tolist()):
        turn[2 * i : 2 * i + 2, 2 * i : 2 * i + 2] = torch.tensor(
            [[math.cos(w), -math.sin(w)], [math.sin(w), math.cos(w)]]
        )
    block = lambda name, i: (
        (slice(None), slice(i * D_K, (i + 1) * D_K)) if name != "W_O" else (slice(i * D_K, (i + 1) * D_K), slice(None))
    )
    with torch.no_grad():
        model.src_embed.weight[:, :8] = 0.0  # tokens leave the first 8 dimensions to the sinusoids
        first, second = model.encoder.layers[0].self_attn, model.encoder.layers[1].self_attn
        first.W_Q[block("W_Q", P)] = 6.0 * eye[:, :8]  # q_a = PE(a), sharpened
        first.W_K[block("W_K", P)] = torch.cat(
            [turn, torch.zeros(D_MODEL - 8, 8, dtype=torch.float64)]
        )  # k_b = PE(b + 1)
        first.W_V[block("W_V", P)] = eye[:, 8:16]  # reads the token
        first.W_O[block("W_O", P)] = eye[56:64, :]  # writes it into dimensions 56..63
        second.W_K[block("W_K", R)] = eye[:, 56:64]  # R's keys: what P wrote
        for att in (first, second):
            for name in ("b_Q", "b_K"):
                getattr(att, name)[P * D_K : (P + 1) * D_K] = 0.0
    return model


def test_a_planted_previous_token_head_is_found_by_k_composition():
    model = _planted()
    g = torch.Generator().manual_seed(2)
    src, tgt = torch.randint(4, 30, (40, 12), generator=g), torch.randint(4, 30, (40, 9), generator=g)
    # P is a previous-token head in its real attention: every query past the first puts its argmax one back
    roles = read_scores(model, [(src, tgt)], PAD)[(("enc_self", 0), P)].roles
    assert min(roles["previous"]) == 1.0

    pairs = compositions(model)
    planted = [p for p in pairs if p.writer == ("enc_self", 0, P) and p.reader == ("enc_self", 1, R) and p.kind == "K"]
    assert len(planted) == 1
    best = max(pairs, key=lambda p: p.score)
    assert best == planted[0], best  # the largest score of every pair and kind, exactly there
    assert planted[0].above > 2.5 and planted[0].score > 2 * planted[0].baseline[2]  # far above chance
    others = [p.above for p in pairs if p is not planted[0]]
    # Elsewhere the weights are random, so each score is a draw from its own baseline: their mean is chance (1.0;
    # 335 draws, whose mean has a spread of about 0.006) and none is beyond 1.5 times it (the baseline's 97.5% point
    # lies near 1.2 times its mean for these sizes: 1.5 is far into its tail, and the planted pair is at 2.8)
    assert abs(sum(others) / len(others) - 1.0) < 0.05 and max(others) < 1.5, (sum(others) / len(others), max(others))
    assert standing_out(pairs)[0] == planted[0]


def test_the_composition_picture_has_one_panel_per_kind_and_greys_what_cannot_compose():
    record = composition_record(compositions(make_model(src_vocab=9, tgt_vocab=9, N=2, d_model=8, d_ff=8, h=2)))
    fig = composition_figure(record)
    panels = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title() for ax in panels] == ["Q-composition", "K-composition", "V-composition"]
    # writers: enc 0, enc 1, dec 0, cross 0, dec 1 (2 heads each); readers: enc 1, cross 0, dec 1, cross 1
    grid = panels[1].get_images()[0].get_array()
    assert grid.shape == (10, 8)
    writers = [t.get_text() for t in panels[1].get_yticklabels()]
    readers = [t.get_text() for t in panels[1].get_xticklabels()]
    # in the streams' order: the encoder, then each decoder layer's self-attention before its cross-attention
    names = lambda *sites: [f"{kind} {layer}.{i}" for kind, layer in sites for i in (0, 1)]
    assert writers == names(("enc_self", 0), ("enc_self", 1), ("dec_self", 0), ("cross", 0), ("dec_self", 1))
    assert readers == names(("enc_self", 1), ("cross", 0), ("dec_self", 1), ("cross", 1))
    k_pairs = {(w, r) for w in range(10) for r in range(8) if not grid.mask[w, r]}
    assert len(k_pairs) == sum(p["kind"] == "K" for p in record["pairs"])  # the others grey
    assert grid.mask[writers.index("dec_self 0.0"), readers.index("cross 0.0")]  # a decoder head never writes keys
