"""The dictionaries and the aligner's reading of the attention (annotated/circuits/dictionary.py): which rows and
pieces make a word's mean input, the norms an OV dictionary reads through, the row each target word is linked
from, and a readout from too few pairs to read a QK dictionary."""

from collections import Counter

import torch
from planted import PERM, B, lexicon, ov_dictionary, pieces, planted_batch, planted_means, planted_model

from annotated.circuits.circuits import attention_inputs, circuit
from annotated.circuits.dictionary import MIN_COUNT, attention_links, dictionary_precision, mean_inputs
from annotated.circuits.readout import Inputs, read_model
from annotated.recording import record_attention
from annotated.sites import attention_at
from annotated.tokens import BOS, EOS, PAD
from annotated.transformer import make_model, padding_mask, target_mask

# float64: a mean computed in another order than the test's, ~1e-16 relative on inputs of size ~1
TOL = 1e-12


def _labels(ids) -> list[str]:
    """Pieces 0..3 are the specials; piece i >= 4 starts a word ("▁wi"), except every third, which continues one."""
    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    return [specials[i] if i < 4 else (f"x{i}" if i % 3 == 0 else f"\u2581w{i}") for i in map(int, ids)]


def _random_model(seed: int = 0):
    torch.manual_seed(seed)
    return make_model(src_vocab=30, tgt_vocab=30, N=2, d_model=16, d_ff=16, h=2).double().eval()


def test_a_words_mean_input_is_its_pieces_mean_at_the_row_that_predicts_it():
    """Source word "w5x6" is two pieces: its mean key input is the mean over occurrences of its pieces' mean (not
    their sum). Target word k's query input is that of decoder row p, the row that predicts its first piece
    (input y_p, or <s>), as Garg et al. read alignments, not row p + 1 that reads it."""
    model = _random_model()
    src = torch.tensor([[5, 6, 7, 8], [7, 5, 6, PAD]])  # w5x6 w7 w8 / w7 w5x6
    tgt = torch.tensor([[BOS, 10, 11, 12, 13, EOS], [BOS, 13, 10, EOS, PAD, PAD]])  # w10 w11x12 w13 / w13 w10
    sites = [("cross", 0), ("cross", 1)]
    means = mean_inputs(model, _labels, [(src, tgt)], sites)
    inputs = attention_inputs(model, src, tgt[:, :-1], PAD)
    avg = lambda *vs: torch.stack(vs).mean(0)
    for site in sites:
        x_q, x_kv = inputs[site]  # (2, 5, d_model), (2, 4, d_model)
        keys = {
            "w5x6": avg(avg(x_kv[0, 0], x_kv[0, 1]), avg(x_kv[1, 1], x_kv[1, 2])),
            "w7": avg(x_kv[0, 2], x_kv[1, 0]),
            "w8": x_kv[0, 3],
        }
        queries = {"w10": avg(x_q[0, 0], x_q[1, 1]), "w11x12": x_q[0, 1], "w13": avg(x_q[0, 3], x_q[1, 0])}
        assert sorted(means.src_words) == sorted(keys) and sorted(means.tgt_words) == sorted(queries)
        got = means.source(site, list(keys))
        assert (got - torch.stack(list(keys.values()))).abs().max() < TOL, site
        got = means.target(site, list(queries))
        assert (got - torch.stack(list(queries.values()))).abs().max() < TOL, site


def test_the_ov_dictionary_reads_the_write_through_the_norms_after_the_head():
    """With the gain of the norm right after the planted cross head set to -1, the model writes the opposite of
    the planted translation (its logit falls below every other planted word's), and so does the OV dictionary:
    read through that norm it finds no planted pair within five, where reading the write straight into the
    generator would find all five at the first guess."""
    model = planted_model()
    with torch.no_grad():
        model.decoder.layers[0].res_cross.ln.weight.fill_(-1.0)
    src, tgt = planted_batch()
    logits = model.generator(
        model.decode(model.encode(src, padding_mask(src, PAD)), padding_mask(src, PAD), tgt, target_mask(tgt, PAD))
    )  # (5, 4, V)
    planted = logits[..., B : B + 5]  # the planted target words' logits
    wanted = torch.tensor([PERM[j] for j in range(5)])
    assert torch.equal(planted.argmin(-1), wanted.unsqueeze(1).expand(5, 4))  # the model now suppresses them
    c = circuit(attention_at(model, "cross", 0), 0, ("cross", 0))
    sources = [f"src{j}" for j in range(5)]
    ov = ov_dictionary(model, c, planted_means(), sources, pieces)
    assert dictionary_precision(ov, lexicon(), 5) == (0.0, 0.0), ov


def test_attention_links_read_each_target_word_from_the_row_that_predicts_it():
    """Every one-piece target word j (the decoder reads <s> y_1 .. y_n) is linked from row j, whose input is
    y_j (<s> for the first word): the source word that row attends to most, for every cross head, in a padded
    batch. Dropping <s> from the labels would shift every row and never link the first word."""
    model = _random_model(1)
    labels = lambda ids: ["<pad>", "<s>", "</s>", "<unk>"][int(ids[0])] if int(ids[0]) < 4 else f"\u2581w{int(ids[0])}"
    one_piece = lambda ids: [labels([i]) for i in ids]
    src = torch.tensor([[5, 7, 8, 10, 11], [13, 14, 16, PAD, PAD]])
    tgt = torch.tensor([[BOS, 17, 19, 20, EOS], [BOS, 22, EOS, PAD, PAD]])
    sites = [("cross", 0), ("cross", 1)]
    links = attention_links(model, one_piece, [(src, tgt)], sites)
    tgt_in = tgt[:, :-1]
    with record_attention(model) as probs:
        model(src, tgt_in, padding_mask(src, PAD), target_mask(tgt_in, PAD))
    for site in sites:
        p = probs[site][0]  # (2, h, 4, 5)
        for head in range(p.size(1)):
            for b, (S, n) in enumerate([(5, 3), (3, 1)]):  # source pieces, target words
                want = {(int(p[b, head, j, :S].argmax()), j) for j in range(n)}
                assert links[(site, head)][b] == want, (site, head, b)


def test_a_readout_from_too_few_pairs_to_read_a_qk_dictionary_still_works():
    """One training pair: no target word occurs MIN_COUNT times, so no target word has a mean query and the QK
    dictionary has no entries (its precision is 0), where the mean queries' empty index used to raise IndexError;
    the OV dictionary, which needs source words only, is still read."""
    torch.manual_seed(0)
    model = make_model(src_vocab=30, tgt_vocab=30, N=1, d_model=16, d_ff=16, h=2).eval()
    pair = (torch.tensor([[5, 7, 8, 10]]), torch.tensor([[BOS, 5, 7, 8, EOS]]))
    counts = Counter(range(4, 30))
    words = {f"w{i}": [(f"w{i}", 1.0)] for i in (5, 7, 8, 10)}
    inputs = Inputs(_labels, counts, counts, [pair], [pair], [pair], words, [{(0, 0)}], top=4)
    assert MIN_COUNT > 1
    report = read_model(model, inputs)
    cross = [h for h in report["heads"] if h["site"][0] == "cross"]
    assert cross and all(h["dictionary"]["qk"] == {w: [] for w in words} for h in cross)
    assert all(h["dictionary"]["qk_precision"] == [0.0, 0.0] for h in cross)
    assert all(len(h["dictionary"]["ov"]["w5"]) == 5 for h in cross)
