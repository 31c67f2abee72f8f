"""The reference word aligner (annotated/circuits/aligner.py): words, symmetrization, eflomal, cache, lexicon."""

import random

import pytest
from made_up_language import make_corpus

from annotated.circuits import aligner
from annotated.circuits.metrics import aer, precision_at_k


def test_words_keep_numbers_and_drop_punctuation():
    sentence = 'Ein  "Hund", -  T-Shirt\tblau Zwei\xa0Männer .'
    assert aligner.words(sentence) == ["ein", "hund", "", "t-shirtblau", "zweimänner", ""]
    line, kept = aligner._kept(sentence)  # what eflomal reads, and the word number of each of its words
    assert line == "ein hund t-shirtblau zweimänner"
    assert kept == [0, 1, 3, 4]


def test_grow_diag_final_and_by_hand():
    forward = {(0, 0), (1, 1), (1, 0), (3, 3)}
    reverse = {(0, 0), (1, 1), (2, 1), (4, 1)}
    # start: the intersection (0, 0), (1, 1).
    # grow-diag: (1, 0) neighbours both, but source 1 and target 0 are aligned -> not added;
    #   (2, 1) neighbours (1, 1) and source 2 is unaligned -> added; (4, 1) neighbours nothing kept.
    # final-and: (3, 3) of the forward links has both words unaligned -> added; (4, 1) has target 1
    #   aligned -> not added.
    assert aligner.grow_diag_final_and(forward, reverse) == {(0, 0), (1, 1), (2, 1), (3, 3)}
    # grow-diag goes on from links it added: (2, 1)'s diagonal neighbour (3, 2) comes in, then (3, 3)
    assert aligner.grow_diag_final_and({(1, 1), (2, 1), (3, 3)}, {(1, 1), (3, 2)}) == {(1, 1), (2, 1), (3, 2), (3, 3)}


def test_grow_diag_final_and_lies_between_intersection_and_union():
    rng = random.Random(0)
    for _ in range(200):
        m, n = rng.randint(1, 7), rng.randint(1, 7)
        forward = {(rng.randrange(m), j) for j in range(n) if rng.random() < 0.8}
        reverse = {(i, rng.randrange(n)) for i in range(m) if rng.random() < 0.8}
        links = aligner.grow_diag_final_and(forward, reverse)
        assert forward & reverse <= links <= forward | reverse
        # every link of the union whose two words are both left unaligned would have been added by final-and
        src, tgt = {i for i, _ in links}, {j for _, j in links}
        assert not [(i, j) for i, j in forward | reverse if i not in src and j not in tgt]


def test_aligner_recovers_a_known_dictionary(tmp_path):
    corpus = make_corpus()  # 80 words, 1,000 pairs: about 1-2 s of eflomal on one core
    links = aligner.align(corpus.pairs, cache_dir=tmp_path, show_progress=False)
    lexicon = aligner.lexicon(corpus.pairs, links)
    truth = {s: [t] for s, t in corpus.dictionary.items()}
    # eflomal samples with a seed from the system, so runs differ. In 15 runs on this corpus precision@1
    # was 1.0 every time and AER 0 to 0.014 (0.014 when its fertility model leaves one frequent word pair
    # to NULL in part); on corpora of other seeds and sizes, 2 runs of 12 got 79 of 80 words right. The
    # thresholds, precision@1 >= 0.95 (at most 4 of 80 words wrong) and AER <= 0.05, leave room for that
    # and still fail on a systematic error (links transposed, numbers not mapped back past punctuation, a
    # lexicon keyed by the wrong side: each seen failing).
    assert precision_at_k(truth, lexicon, 1, top=80) >= 0.95
    assert aer(links, corpus.links) <= 0.05


def fake_eflomal(calls):
    def run(pairs, settings=None, show_progress=True):
        calls.append(len(pairs))
        forward = [{(0, 0), (1, 1)} if len(s.split()) > 1 else {(0, 0)} for s, _ in pairs]
        return forward, forward

    return run


def test_align_caches_by_texts_and_settings(tmp_path, monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(aligner, "run_eflomal", fake_eflomal(calls))
    pairs = [("Ein Hund", "A dog"), ("Hallo", "Hello")]
    first = aligner.align(pairs, cache_dir=tmp_path)
    assert first == [{(0, 0), (1, 1)}, {(0, 0)}] and calls == [2]
    assert aligner.align(pairs, cache_dir=tmp_path) == first and calls == [2]  # read from the cache
    aligner.align(pairs, cache_dir=tmp_path, settings={"null_prior": 0.3})
    aligner.align(pairs[:1] + [("Hallo", "Hi")], cache_dir=tmp_path)
    assert calls == [2, 2, 2]  # other settings, other text: computed again
    key = aligner.alignment_cache_key(pairs, aligner.SETTINGS)
    (tmp_path / "alignments" / f"{key}.json.gz").write_bytes(b"not gzip")
    assert aligner.align(pairs, cache_dir=tmp_path) == first and calls == [2, 2, 2, 2]  # damaged: again


def test_multi30k_directions_share_one_run(tmp_path, monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(aligner, "run_eflomal", fake_eflomal(calls))
    splits = {"train": [("Ein Hund", "A dog"), ("Hallo", "Hello")], "test_2016_flickr": [("Zwei Männer", "Two men")]}

    def load(split, src_lang, tgt_lang, cache_dir=None, base_url=None):
        assert (src_lang, tgt_lang) == ("de", "en")  # always aligned in alphabetical order
        return splits[split]

    monkeypatch.setattr(aligner.data, "load_multi30k", load)
    de_en = aligner.multi30k_alignments("de", "en", cache_dir=tmp_path, show_progress=False)
    en_de = aligner.multi30k_alignments("en", "de", cache_dir=tmp_path, show_progress=False)
    assert calls == [3]  # one run for both directions, train and test together
    assert de_en["train"] == (splits["train"], [{(0, 0), (1, 1)}, {(0, 0)}])
    assert de_en["test_2016_flickr"] == (splits["test_2016_flickr"], [{(0, 0), (1, 1)}])
    for split in splits:
        pairs, links = de_en[split]
        assert en_de[split] == ([(t, s) for s, t in pairs], [{(j, i) for i, j in ls} for ls in links])


def test_lexicon_by_hand():
    pairs = [("Der Hund spielt.", "The dog plays."), ("Der Hund spielt", "The dog is playing"), ("Ein Hund", "A dog")]
    links = [{(0, 0), (1, 1), (2, 2)}, {(0, 0), (1, 1), (2, 3), (2, 2)}, {(1, 1)}]
    lexicon = aligner.lexicon(pairs, links)
    # keys by frequency of the source word (hund 3, der 2, spielt 2, ein 1: ties alphabetically); ein unlinked
    assert list(lexicon) == ["hund", "der", "spielt"]
    assert lexicon["hund"] == [("dog", 1.0)]
    # spielt: linked to plays once, is once, playing once: 1/3 each, ties alphabetically
    assert lexicon["spielt"] == [("is", 1 / 3), ("playing", 1 / 3), ("plays", 1 / 3)]
    with pytest.raises(ValueError, match="one link set per pair"):
        aligner.lexicon(pairs, links[:2])
    with pytest.raises(ValueError, match=r"pair 2 has 2 source and 2 target words, but links \[\(1, 2\)\]"):
        aligner.lexicon(pairs, links[:2] + [{(1, 2)}])
    assert aligner.align([]) == []  # nothing to align: no eflomal run, no cache file


def test_align_symmetrizes_with_grow_diag_final_and(tmp_path, monkeypatch):
    """eflomal's forward links hold a one-to-many link that its reverse links (one target word per source word)
    cannot: "Spielplatz" is "play ground". grow-diag-final-and keeps it beside the two links both directions
    share; the intersection would lose it, as it would lose every one-to-many link of Multi30k."""
    forward, reverse = {(0, 0), (1, 1), (1, 2)}, {(0, 0), (1, 1)}
    monkeypatch.setattr(aligner, "run_eflomal", lambda pairs, settings=None, show_progress=True: ([forward], [reverse]))
    links = aligner.align([("Der Spielplatz", "The play ground")], cache_dir=tmp_path)
    assert links == [{(0, 0), (1, 1), (1, 2)}]
