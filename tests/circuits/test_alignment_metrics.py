"""Scoring a head against the aligner (annotated/circuits/metrics.py): precision@k, AER, pieces to word links."""

import numpy as np
import pytest
from made_up_language import make_corpus

from annotated.circuits import aligner, metrics
from annotated.circuits.metrics import aer, attention_to_word_links, piece_words, precision_at_k


def test_precision_at_k_by_hand():
    lexicon = {  # keys most frequent first, as aligner.lexicon gives them
        "ein": [("a", 0.9), ("an", 0.05), ("one", 0.05)],
        "spielt": [("playing", 0.6), ("plays", 0.3), ("is", 0.1)],
        "hund": [("dog", 0.95), ("brown", 0.05)],
        "rot": [("red", 1.0)],
    }
    dictionary = {
        "ein": ["an", "a"],  # an: 5% < 10%, not accepted; a at rank 2
        "spielt": ["plays"],  # second translation, 30% >= 10%: accepted at rank 1
        "hund": ["brown", "cat", "mouse", "house", "tree", "dog"],  # dog only at rank 6
        # rot: no entry, wrong at every k
    }
    assert precision_at_k(dictionary, lexicon, 1) == 1 / 4  # spielt
    assert precision_at_k(dictionary, lexicon, 2) == 2 / 4  # + ein
    assert precision_at_k(dictionary, lexicon, 5) == 2 / 4  # dog at 6 is too late
    assert precision_at_k(dictionary, lexicon, 6) == 3 / 4
    assert precision_at_k(dictionary, lexicon, 1, top=2) == 1 / 2  # the 2 most frequent: ein, spielt
    # "is" takes exactly 10% of spielt's links: accepted at the threshold, not above it
    assert precision_at_k({"spielt": ["is"]}, lexicon, 1, top=2) == 1 / 2
    assert precision_at_k({"spielt": ["is"]}, lexicon, 1, top=2, min_share=0.11) == 0
    # the best translation is accepted whatever its share
    assert precision_at_k({"w": ["x"]}, {"w": [("x", 0.05), ("y", 0.04)]}, 1) == 1
    with pytest.raises(ValueError, match="k and top"):
        precision_at_k(dictionary, lexicon, 0)


def test_aer_by_hand():
    assert aer([{(0, 0), (1, 1)}], [{(0, 0), (1, 1)}]) == 0
    assert aer([{(0, 1), (1, 0)}], [{(0, 0), (1, 1)}]) == 1
    # summed over the corpus: |A| = 3, |S| = 3, |A ∩ S| = 2 -> 1 - 4/6
    assert aer([{(0, 0)}, {(0, 0), (1, 2)}], [{(0, 0), (1, 1)}, {(0, 0)}]) == pytest.approx(1 - 4 / 6)
    # with possible links: (1, 2) is possible, not sure: |A ∩ S| = 1, |A ∩ P| = 2, |A| = 2, |S| = 1
    assert aer([{(0, 0), (1, 2)}], [{(0, 0)}], [{(1, 2)}]) == pytest.approx(1 - 3 / 3)
    with pytest.raises(ValueError, match="one link set per sentence"):
        aer([set()], [set(), set()])
    with pytest.raises(ValueError, match="no links"):
        aer([set()], [set()])


def test_words_from_pieces():
    # as the shipped tokenizer splits "Ein Spielhaus  „Hallo“ - ☃": a lone ▁ before "-" and before the bytes
    pieces = ["<s>", "▁Ein", "▁Spiel", "haus", "▁", "▁„", "Hallo", "“", "▁", "-", "▁", "<0xE2>", "<0x98>", "<0x83>"]
    number, texts = piece_words(pieces + ["</s>"])
    # the first lone ▁ (two spaces) is no word; „Hallo“ is one word, - a punctuation-only word, ☃ spelled in bytes
    assert number == [None, 0, 1, 1, None, 2, 2, 2, 3, 3, 4, 4, 4, 4, None]
    assert texts == ["ein", "spielhaus", "hallo", "", "☃"]
    assert texts == aligner.words("Ein Spielhaus  „Hallo“ - ☃")
    # a piece without ▁ after a special, or at the start, opens a word
    assert piece_words(["ab", "c", "</s>", "d"]) == ([0, 0, None, 1], ["abc", "d"])


def test_piece_words_match_aligner_words_on_the_shipped_tokenizer():
    from annotated.checkpoint import read_checkpoint
    from annotated.shipped import __file__ as shipped
    from annotated.tokens import Tokenizer

    tokenizer = Tokenizer.from_bytes(read_checkpoint(shipped.replace("__init__.py", "de-en.pt"))["tokenizer"])
    sentences = [
        "Zwei junge weiße Männer sind im Freien in der Nähe vieler Büsche.",
        'Ein Mann mit einem orangefarbenen Hut, der etwas anstarrt - "Hallo"!',
        "Zwei  Leute\tstehen vor einem\xa0Schneemann ☃ .",
        "Two young, White males are outside near many bushes.",
    ]
    for sentence in sentences:
        _, texts = piece_words(tokenizer.pieces(tokenizer.encode(sentence)))
        assert texts == aligner.words(sentence)


def test_piece_words_match_aligner_words_on_multi30k(data_url, cache):
    from annotated.checkpoint import read_checkpoint
    from annotated.shipped import __file__ as shipped
    from annotated.tokens import Tokenizer
    from annotated.training.data import load_multi30k

    tokenizer = Tokenizer.from_bytes(read_checkpoint(shipped.replace("__init__.py", "de-en.pt"))["tokenizer"])
    for pair in load_multi30k("test_2016_flickr", "de", "en", cache, data_url):
        for sentence in pair:
            assert piece_words(tokenizer.pieces(tokenizer.encode(sentence)))[1] == aligner.words(sentence)


def test_step_predicts_or_reads():
    src = ["▁Ein", "▁Hund", "</s>"]
    tgt = ["<s>", "▁A", "▁dog"]
    attn = np.array(
        [
            [0.8, 0.1, 0.1],  # reads <s>, predicts A
            [0.1, 0.8, 0.1],  # reads A, predicts dog
            [0.1, 0.1, 0.8],  # reads dog, predicts </s>
        ]
    )
    assert attention_to_word_links(attn, src, tgt) == {(0, 0), (1, 1)}  # Garg et al.: the predicting row
    assert attention_to_word_links(attn, src, tgt, step="predicts") == {(0, 0), (1, 1)}
    assert attention_to_word_links(attn, src, tgt, step="reads") == {(1, 0)}  # dog's row looks at </s>
    with pytest.raises(ValueError, match="step must be"):
        attention_to_word_links(attn, src, tgt, step="next")
    with pytest.raises(ValueError, match=r"\(3, 3\), got shape \(3, 2\)"):
        attention_to_word_links(attn[:, :2], src, tgt)


def test_attention_to_word_links_by_hand():
    src = ["▁Ein", "▁Spiel", "haus", "▁,", "▁rot", "</s>"]  # words: 0 ein, 1 spielhaus, 2 "," 3 rot
    tgt = ["<s>", "▁A", "▁play", "house", "▁,", "▁red", "dish"]  # words: 0 a, 1 playhouse, 2 "," 3 reddish
    # the source position each row attends to most (step="predicts": row p - 1 speaks for target piece p)
    argmax = [0, 1, 2, 4, 3, 5, 4]
    attn = np.full((len(tgt), len(src)), 0.01)
    attn[np.arange(len(tgt)), argmax] = 0.9
    # A (row 0) -> Ein; play (row 1) -> Spiel, house (row 2) -> haus: one word, one link;
    # "," (row 3) is punctuation: no link; red (row 4) -> "," punctuation: no link; dish (row 5) -> </s>: none
    assert attention_to_word_links(attn, src, tgt) == {(0, 0), (1, 1)}
    # union over a word's pieces: red -> rot, dish -> Spiel: reddish links to both
    argmax = [0, 1, 2, 4, 4, 1, 4]
    attn = np.full((len(tgt), len(src)), 0.01)
    attn[np.arange(len(tgt)), argmax] = 0.9
    assert attention_to_word_links(attn, src, tgt) == {(0, 0), (1, 1), (3, 3), (1, 3)}


def pieces_of(sentence: str) -> list[str]:
    """A hand-made subword split: each word's first three characters, then the rest."""
    out = []
    for word in sentence.split(" "):
        out += ["▁" + word[:3]] + ([word[3:]] if word[3:] else [])
    return out


def attention_pointing_at(corpus_links, src_pieces, tgt_in, choose):
    """(T, S): row p - 1 of target piece p peaks on the first piece of source word choose(j) for target word j."""
    src_number, _ = piece_words(src_pieces)
    tgt_number, _ = piece_words(tgt_in)
    first_piece = {w: p for p, w in reversed(list(enumerate(src_number))) if w is not None}
    attn = np.full((len(tgt_in), len(src_pieces)), 0.01)
    attn[:, -1] = 0.5  # </s>: where rows look when they have nothing to say
    for p, j in enumerate(tgt_number):
        if j is not None and choose(j) is not None:
            attn[p - 1, first_piece[choose(j)]] = 0.9
    return attn


def test_aer_of_perfect_and_wrong_attention():
    corpus = make_corpus(n_pairs=200)
    perfect, wrong = [], []
    for (s, t), links in zip(corpus.pairs, corpus.links):
        src, tgt_in = pieces_of(s) + ["</s>"], ["<s>"] + pieces_of(t)
        truth = {j: i for i, j in links}  # one source word for each content target word
        content = sorted(truth.values())
        shifted = {i: content[(content.index(i) + 1) % len(content)] for i in content}  # another content word
        for predicted, choose in ((perfect, truth.get), (wrong, lambda j: shifted.get(truth.get(j)))):
            predicted.append(attention_to_word_links(attention_pointing_at(links, src, tgt_in, choose), src, tgt_in))
    assert aer(perfect, corpus.links) == 0
    assert aer(wrong, corpus.links) == 1
    assert metrics.aer([a | b for a, b in zip(perfect, wrong)], corpus.links) == pytest.approx(1 - 2 / 3)


def test_precision_counts_only_the_words_scored():
    """Given the words that occur, precision is over them alone: a frequent word the pairs never showed is not a
    miss. And unmatchable names the words none of whose accepted translations a single piece spells."""
    lexicon = {"ein": [("a", 1.0)], "hund": [("dog", 1.0)], "skater": [("skateboarder", 1.0)]}
    dictionary = {"ein": ["a"], "hund": ["dog"]}  # "skater" never occurred in the pairs read: no entry
    assert precision_at_k(dictionary, lexicon, 1) == 2 / 3
    assert precision_at_k(dictionary, lexicon, 1, words=["ein", "hund"]) == 1.0
    with pytest.raises(ValueError, match="no source words"):
        precision_at_k(dictionary, lexicon, 1, words=[])
    assert metrics.unmatchable(lexicon, list(lexicon), {"a", "dog", "skate"}) == ["skater"]
