"""Interventions (annotated/circuits/interventions.py) and the dictionaries (dictionary.py) on a model built by
hand: what was planted is found, and is lost when the code reads the wrong circuit or the wrong axis."""

import dataclasses

import torch
from planted import PERM, lexicon, ov_dictionary, pieces, planted_batch, planted_means, planted_model

from annotated.circuits.circuits import circuit, circuits
from annotated.circuits.dictionary import dictionary_precision, ov_controls, qk_dictionary
from annotated.circuits.interventions import HOWS, donors, intervene, replacements, run_pass
from annotated.sites import attention_at, remove_heads
from annotated.tokens import PAD
from annotated.transformer import make_model, padding_mask, target_mask


def _planted_head():
    model = planted_model()
    return model, circuit(attention_at(model, "cross", 0), 0, ("cross", 0))


def test_the_planted_dictionary_is_found_in_ov_and_qk():
    """Each dictionary finds the planted pairs (precision@1 1.0 against the planted lexicon)."""
    model, c = _planted_head()
    means, sources = planted_means(), [f"src{j}" for j in range(5)]
    ov = ov_dictionary(model, c, means, sources, pieces)
    qk = qk_dictionary(c, means, sources)
    assert {w: ov[w][0] for w in sources} == {f"src{j}": f"tgt{PERM[j]}" for j in range(5)}
    assert {w: qk[w][0] for w in sources} == {f"src{j}": f"tgt{PERM[j]}" for j in range(5)}
    assert dictionary_precision(ov, lexicon(), 5)[0] == dictionary_precision(qk, lexicon(), 5)[0] == 1.0


def test_the_planted_dictionary_is_lost_through_the_other_circuit():
    """QK and OV swapped: the OV reading through W_QK writes nothing its generator reads, the QK reading
    through W_OV matches nothing; neither finds more than one pair in five (the ties' first index)."""
    model, c = _planted_head()
    swapped = dataclasses.replace(c, QK=c.OV, OV=c.QK)
    means, sources = planted_means(), [f"src{j}" for j in range(5)]
    assert dictionary_precision(ov_dictionary(model, swapped, means, sources, pieces), lexicon(), 5)[0] <= 0.2
    assert dictionary_precision(qk_dictionary(swapped, means, sources), lexicon(), 5)[0] <= 0.2


def test_the_ov_dictionarys_controls_on_the_planted_head():
    """The planted map is in W_OV and reads the bare token: the weights-only path and the word alone through the
    encoder find it too; without the head (the key input read by the generator directly) it is not found, and
    a random OV of the same shapes and norms finds what chance does: the generator can say only the five
    planted words, so a random map is right for one word in five on average (two of five with seed 0)."""
    model, c = _planted_head()
    sources = [f"src{j}" for j in range(5)]
    controls = ov_controls(model, c, planted_means(), sources, pieces)
    p1 = {name: dictionary_precision(d, lexicon(), 5)[0] for name, d in controls.items()}
    assert p1["in context"] == p1["weights only"] == p1["whole path"] == 1.0, p1
    assert p1["no head"] == 0.0 and p1["random OV"] <= 0.4, p1


def test_the_qk_dictionary_normalises_over_the_source_words():
    """The softmax runs over the keys (source words) of one query: the "loud" target word, whose query scores
    every source word higher than the planted pairs do, wins no column. Normalised over the queries instead
    (the wrong axis) it would win every one: the planted scores below show that it would."""
    _, c = _planted_head()
    means, sources = planted_means(), [f"src{j}" for j in range(5)]
    qk = qk_dictionary(c, means, sources)
    assert all("loud" not in qk[w][:1] for w in sources)
    x_q = means.target(c.site, means.frequent_targets())  # (6, d_model), "loud" last
    scores = c.matching(x_q, means.source(c.site, sources))  # (6, 5)
    assert bool((scores[-1] > scores[:-1].max(0).values).all())  # raw scores: loud is highest in every column
    assert dictionary_precision(qk, lexicon(), 5)[0] == 1.0


def test_zero_ablation_is_removing_the_head():
    """The hook's term is the head's whole term: replaced by zero, the logits are those of the model without
    the head (sites.remove_heads), on a random model with biases and padding, every attention kind, with the
    encoder's output kept from the clean pass (`memory`, which only a decoder-side head may reuse).
    float64: the same sums in another order, ~1e-15 relative; 1e-10 on logits of size ~1 leaves room."""
    torch.manual_seed(0)
    model = make_model(src_vocab=23, tgt_vocab=19, N=2, d_model=24, d_ff=32, h=3, d_k=5, d_v=7).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".b_" in name:
                p.normal_()
    g = torch.Generator().manual_seed(1)
    src, tgt = torch.randint(4, 19, (3, 6), generator=g), torch.randint(4, 17, (3, 5), generator=g)
    src[0, 4:], tgt[1, 3:] = PAD, PAD
    zero = lambda term, number: torch.zeros_like(term)
    for site, heads in circuits(model).items():
        c, memory = heads[1], {}
        run_pass(model, [(src, tgt)], [c], memory=memory)  # the clean pass keeps the encoder's output
        changed = run_pass(model, [(src, tgt)], [c], zero, memory=memory)
        removed = remove_heads(model, {site: [1]}).eval()
        tgt_in = tgt[:, :-1]
        logits = removed(src, tgt_in, padding_mask(src, PAD), target_mask(tgt_in, PAD)).log_softmax(-1)
        want = logits.gather(-1, tgt[:, 1:].unsqueeze(-1)).squeeze(-1)
        for n, got in enumerate(changed.reference):
            assert (got - want[n, : got.numel()]).abs().max() < 1e-10, (site, n)


def test_ablating_the_planted_head_destroys_its_behaviour():
    """Head 0 was built to write b_j when it reads a_j: zero, mean or resample it and the log-probability of
        the reference (b_j) falls by more than a nat per token, as does that of the translation of the word it
        attends to; the same intervention on head 1 moves both by less than 0.05 (it only moves the LayerNorm's divisor: by
    0.014 at most here)."""
    model = planted_model()
    src, tgt = planted_batch()
    before = model(src, tgt[:, :-1], padding_mask(src, PAD), target_mask(tgt[:, :-1], PAD)).softmax(-1)
    assert before.gather(-1, tgt[:, 1:].unsqueeze(-1)).min() > 0.9  # the planted model translates
    record = intervene(model, [(src, tgt)], ("cross", 0), 0, pieces, lexicon())
    assert record["neighbour"] == 1 and record["translation_positions"] == [15, 15]
    for how in HOWS:
        for measure in ("reference", "translation"):
            head, other = record[measure][how]["head"], record[measure][how]["neighbour"]
            assert head[2] < -1.0, (how, measure, head)  # the whole interval below -1 nat per token
            assert max(abs(other[1]), abs(other[2])) < 0.05, (how, measure, other)


def test_resampling_takes_another_sentence_of_at_least_the_same_length():
    lengths = [2, 5, 3, 5, 4, 1]
    d = donors(lengths)
    assert all(d[n] != n and lengths[d[n]] >= lengths[n] for n in range(len(lengths)))
    assert donors([2, 7])[1] == 0  # the longest has none: the longest other
    terms = [torch.full((t, 2), float(n)) for n, t in enumerate([2, 3])]  # sentence n writes n everywhere
    swaps, fallback = replacements(terms, [(torch.zeros(2, 1), None)])
    assert fallback == 1  # sentence 1 (3 positions) from sentence 0 (2): one position takes the mean
    out = swaps["resample"](torch.zeros(2, 3, 2), 0)
    assert out[0, :2].eq(1).all() and out[1, :2].eq(0).all() and out[1, 2].eq(torch.cat(terms).mean(0)).all()


def test_role_heads_are_chosen_by_the_measured_share():
    """On shipped de -> en the weights label encoder layer 1's heads 0 and 2 `previous` (head 0 first), but the
    real argmax of head 2 looks back more often: the previous-position head tested is head 2, the measured one."""
    from annotated.circuits.circuits import circuit
    from annotated.circuits.interventions import role_heads
    from annotated.circuits.readout import weights_record
    from annotated.circuits.score_terms import read_scores, reading_records
    from annotated.shipped import load_shipped
    from annotated.tokens import BOS

    model, tok, _ = load_shipped("de-en")
    model = model.double().eval()
    pad = lambda seqs: torch.nn.utils.rnn.pad_sequence([torch.tensor(s) for s in seqs], True, PAD)
    src = pad([tok.encode(s) for s in ["Ein Hund rennt über die Wiese.", "Zwei Männer spielen Fußball im Park."]])
    tgt = pad([[BOS, *tok.encode(t)] for t in ["A dog runs across the meadow.", "Two men play soccer in the park."]])
    measured = reading_records(read_scores(model, [(src, tgt)], PAD), resamples=20)
    site = ("enc_self", 1)
    heads = [
        {**weights_record(model, circuit(attention_at(model, *site), i, site)), **measured[(site, i)]}
        for i in range(attention_at(model, *site).h)
    ]
    by_weights = next(h["head"] for h in heads if h["positions"]["label"] == "previous")
    shares = [h["roles"]["previous"][0] for h in heads]
    assert by_weights == 0 and shares[2] > shares[0]  # the two readings disagree here
    assert role_heads({"heads": heads}) == [("previous", site, 2)]
