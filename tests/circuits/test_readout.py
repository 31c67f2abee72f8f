"""The readout (annotated/circuits/readout.py): which pieces its vocabulary tables range over, and which lexicon
words its dictionaries are scored on."""

from collections import Counter

import torch

from annotated.circuits.readout import Inputs, frequent_pieces, read_model
from annotated.tokens import BOS, EOS
from annotated.transformer import make_model


def _labels(ids) -> list[str]:
    return [["<pad>", "<s>", "</s>", "<unk>"][i] if i < 4 else f"\u2581w{i}" for i in map(int, ids)]


def test_frequent_pieces_are_the_most_frequent_first():
    counts = Counter({7: 3, 5: 3, 9: 5, 4: 1, 12: 2})
    assert frequent_pieces(counts).tolist() == [9, 5, 7, 12, 4]  # by count, ties by id
    assert frequent_pieces(counts, n=2).tolist() == [9, 5]


def test_the_readout_ranges_over_the_frequent_pieces_and_scores_the_lexicons_first_words():
    """Each side's tables range over the pieces of that side's training text, most frequent first: the rows of
    the encoder's table are the source pieces in order of frequency and its keys source pieces; the
    cross-attention's rows are target pieces and its keys source pieces. The dictionaries are scored on the
    lexicon's `top` first words (its most frequent, in its own order, not alphabetically) that occur."""
    torch.manual_seed(0)
    model = make_model(src_vocab=30, tgt_vocab=30, N=1, d_model=16, d_ff=16, h=2).eval()
    src_counts = Counter({8: 9, 5: 7, 10: 4, 7: 2, 11: 1})  # the source side's pieces
    tgt_counts = Counter({20: 6, 17: 5, 22: 3, 19: 1})  # the target side's: none shared with the source
    pairs = [
        (torch.tensor([[8, 5, 10, 7]]), torch.tensor([[BOS, 20, 17, 22, EOS]])),
        (torch.tensor([[5, 8, 11]]), torch.tensor([[BOS, 17, 20, 19, EOS]])),
    ]
    lexicon = {w: [(w, 1.0)] for w in ("w8", "w5", "w99", "w10", "w7")}  # w99 never occurs
    inputs = Inputs(_labels, src_counts, tgt_counts, pairs, pairs, [], lexicon, None, top=4)
    report = read_model(model, inputs)
    label = lambda ids: _labels(ids.tolist())
    src_order, tgt_order = label(frequent_pieces(src_counts)), label(frequent_pieces(tgt_counts))
    for h in report["heads"]:
        rows, keys = src_order if h["site"][0] == "enc_self" else tgt_order, src_order
        if h["site"][0] == "dec_self":
            keys = tgt_order
        assert [r for r, _ in h["qk_rows"]] == rows, h["site"]
        assert {k for _, best in h["qk_rows"] for k, _ in best} <= set(keys), h["site"]
        assert [r for r, _ in h["ov_rows"]] == keys, h["site"]
        if h["site"][0] == "cross":
            d = h["dictionary"]
            assert list(d["qk"]) == list(d["ov"]) == ["w8", "w5", "w10"]  # the first 4 words, w99 left out
            assert d["coverage"] == [3, 4]
