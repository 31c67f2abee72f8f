"""Faithfulness (annotated/circuits/faithfulness.py): only the keys a query may see, and only real queries, count."""

import torch

from annotated.circuits.circuits import allowed_keys
from annotated.circuits.faithfulness import argmax_agreement, faithfulness
from annotated.tokens import BOS, PAD
from annotated.transformer import make_model


def test_argmax_agreement_never_counts_a_key_the_query_may_not_see():
    """Row 0: the two agree on the keys it may see and disagree on a hidden key that is the largest of both;
    row 1 the other way round. Only what happens on the visible keys counts."""
    a = torch.tensor([[[1.0, 2.0, 9.0], [2.0, 1.0, 9.0]]], dtype=torch.float64)  # (1, 2, 3)
    b = torch.tensor([[[1.0, 2.0, -9.0], [1.0, 2.0, 9.0]]], dtype=torch.float64)
    allowed = torch.tensor([[[True, True, False], [True, True, False]]])
    assert argmax_agreement(a, b, allowed).tolist() == [[1.0, 0.0]]


def test_the_keys_allowed_are_the_real_past_and_the_queries_the_real_ones():
    """Encoder and cross-attention: no padded key; decoder self-attention: no padded and no future key; and no
    padded query row counts, in any kind."""
    src = torch.tensor([[5, 6, 7], [5, PAD, PAD]])
    tgt = torch.tensor([[BOS, 8, 9, 10], [BOS, 8, PAD, PAD]])
    real_src, real_tgt = src != PAD, tgt != PAD
    for kind, q, k in (
        ("enc_self", real_src, real_src),
        ("cross", real_tgt, real_src),
        ("dec_self", real_tgt, real_tgt),
    ):
        allowed = allowed_keys(kind, src, tgt, PAD)  # (B, T_q, T_k)
        want = q.unsqueeze(-1) & k.unsqueeze(-2)
        if kind == "dec_self":
            want = want & torch.ones(4, 4, dtype=torch.bool).tril()
        assert torch.equal(allowed, want), kind


def test_a_sentences_faithfulness_does_not_depend_on_how_its_batch_is_padded():
    """Two sentence pairs read in one padded batch, or each alone with no padding: the same per-sentence
    numbers, so the same means and intervals. float64: the real positions' scores differ by rounding only
    (another batch shape), far below any gap between two keys' scores, so the ranks are the same; 1e-9 leaves
    room for the means' rounding."""
    torch.manual_seed(0)
    model = make_model(src_vocab=30, tgt_vocab=30, N=2, d_model=16, d_ff=16, h=2).double().eval()
    long_src, long_tgt = torch.tensor([[5, 9, 12, 7, 20, 11]]), torch.tensor([[BOS, 8, 15, 21, 9, 4, 17]])
    short_src, short_tgt = torch.tensor([[6, 25, 13]]), torch.tensor([[BOS, 14, 22, 10]])
    pad = lambda x, n: torch.cat([x, torch.full((1, n - x.size(1)), PAD)], 1)
    together = [(torch.cat([long_src, pad(short_src, 6)]), torch.cat([long_tgt, pad(short_tgt, 7)]))]
    apart = [(long_src, long_tgt), (short_src, short_tgt)]
    f_together = faithfulness(model, together, PAD, resamples=50)
    f_apart = faithfulness(model, apart, PAD, resamples=50)
    assert f_together.keys() == f_apart.keys() and len(f_apart) == 12
    for key, readings in f_apart.items():
        for reading, f in readings.items():
            g = f_together[key][reading]
            for measure in ("rho", "argmax"):
                x, y = getattr(f, measure), getattr(g, measure)
                gap = max(abs(x.value - y.value), abs(x.low - y.low), abs(x.high - y.high))
                assert gap < 1e-9, (key, reading, measure, x, y)
