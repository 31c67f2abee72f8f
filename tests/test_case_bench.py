"""benchmarks/case.py: every source variant goes through the translator's own rules and is scored as the
training's evaluation scores; the table's last column is the lowercased difference from the written source."""

import pytest
from tiny import tiny_translator

from annotated.decoding import casing
from annotated.decoding.search import translate_ids
from annotated.training.evaluate import score
from benchmarks import case

PAIRS = [
    ("Ein Hund rennt über die Wiese.", "A dog runs across the meadow."),
    ("Zwei Männer spielen Fußball.", "Two men play football."),
    ("Eine Frau liest ein Buch.", "A woman reads a book."),
]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    model, tok = tiny_translator([t for p in PAIRS for t in p] * 6, 300, tmp_path_factory.mktemp("spm"))
    return case.measure(model, tok, PAIRS, beam=2, progress=False), model, tok


def test_each_variant_is_scored_through_the_translators_rules(result):
    measured, model, tok = result
    assert set(measured["scores"]) == set(case.VARIANTS)
    assert all(set(modes) == {"as-typed", "auto"} for modes in measured["scores"].values())
    # the written sources under "auto" are cased as people write, so they translate exactly as typed
    written = measured["scores"]["as written"]
    assert written["auto"] == written["as-typed"]
    # capitals under "auto": the recased source's translation, in capitals, scored against the references
    recased = [casing.normalise(s.upper(), tok)[0] for s, _ in PAIRS]
    hyps = [tok.decode(h).upper() for h in translate_ids(model, [tok.encode(r) for r in recased], 2, 0.6)]
    expected = score(hyps, [t for _, t in PAIRS])
    expected.pop("signature")
    assert measured["scores"]["capitals"]["auto"] == expected
    assert measured["sentences"] == 3 and all(0 <= n <= 3 for n in measured["recased_exactly"].values())


def test_the_table_shows_the_lowercased_change_from_the_written_source():
    scores = {
        v: {"as-typed": {"bleu": 10.0, "bleu_lowercase": 20.0}, "auto": {"bleu": 1.0, "bleu_lowercase": 18.5}}
        for v in case.VARIANTS
    }
    rows = case.table({"scores": scores}).splitlines()
    assert rows[2] == "| as written | 10.00 / 20.00 | 1.00 / 18.50 | -1.50 |"
    assert len(rows) == 2 + len(case.VARIANTS)
