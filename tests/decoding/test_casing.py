"""annotated/decoding/casing.py: which lines are recased, and that recasing gives back the written sentence.

The tokenizer is a real sentencepiece model trained on a few German sentences in which each word has one
casing (nouns capitalised, the rest lower case, the first word of a sentence capitalised and not used
elsewhere), so "each word in the casing it was seen in" has one right answer.
"""

import pytest

from annotated.decoding import casing
from annotated.training.data import train_tokenizer

SENTENCES = [
    "Ein Hund rennt über die Wiese.",
    "Zwei Männer spielen Fußball im Park.",
    "Eine Frau liest das Buch am Fenster.",
    "Drei Kinder essen Eis vor dem Haus.",
    "Jener Mann fährt mit dem Fahrrad durch die Stadt.",
    "Viele Leute stehen an der Straße.",
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_tokenizer(SENTENCES * 8, 560, cache_dir=tmp_path_factory.mktemp("spm"))


@pytest.mark.parametrize("sentence", SENTENCES)
def test_capitals_and_lower_case_are_recased_into_the_written_sentence(tokenizer, sentence):
    assert casing.normalise(sentence.upper(), tokenizer) == (sentence, "upper")
    assert casing.normalise(sentence.lower(), tokenizer) == (sentence, "lower")
    assert casing.normalise(casing.swap_case(sentence), tokenizer) == (sentence, "inverted")
    assert casing.normalise(sentence, tokenizer) == (sentence, None)  # as people write: untouched


def test_an_acronym_in_capitals_keeps_its_capitals(tmp_path):
    tok = train_tokenizer(["Ein Zug der DB fährt.", "Die DB ist pünktlich."] * 20, 300, cache_dir=tmp_path)
    assert casing.recase("EIN ZUG DER DB FÄHRT.", tok, keep_capitals=True) == "Ein Zug der DB fährt."


def test_the_case_table_wins_over_the_tokenizer_and_the_tokenizer_fills_its_gaps(tokenizer):
    table = {"hund": "hUnd"}  # a form the tokenizer would never choose: only the table can give it
    assert casing.recase("ein hund im park rennt", tokenizer, table=table) == "Ein hUnd im Park rennt"
    assert casing.normalise("EIN HUND IM PARK.", tokenizer, table)[0] == "Ein hUnd im Park."


def test_ties_go_to_the_piece_merged_first_then_lower_case():
    class Pieces:  # every form one piece; "Wiese" merged before "wiese", "rennt" and "Rennt" equal
        scores = {"wiese": -5.0, "Wiese": -1.0, "rennt": -2.0, "Rennt": -2.0, "WIESE": -9.0, "RENNT": -9.0}

        def encode(self, form):
            return [form]

        def spells_unseen(self, ids):
            return False

        def score(self, ids):
            return sum(self.scores.get(i, -99.0) for i in ids)

    assert casing.recase("wiese rennt wiese", Pieces()) == "Wiese rennt Wiese"


@pytest.mark.parametrize("line", ["EIN MANN FÄHRT Fahrrad.", "DREI KINDER SPIELEN IM Park.", "Zwei HUNDE RENNEN."])
def test_a_line_mostly_in_capitals_is_upper_case(line):
    """The rule says "most of its words": one word typed as usual in a line in capitals does not change it."""
    assert casing.style(line) == "upper"
    assert casing.style("Ein MANN fährt Fahrrad.") is None  # one word of four: as people write
