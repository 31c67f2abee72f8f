"""The shipped models decode at the length penalty their own rule picks on validation (issue: the models in the box).

The rule is a run's: `choose_length_penalty` (annotated/training/evaluate.py), beam 4, Multi30k's whole validation
split, the alphas of LENGTH_PENALTIES, the highest cased BLEU, the smaller alpha on a tie; never the test set.
Running it as it is translates the 1,014 validation sentences five times per direction. These tests run the very
same function, but with the beam search run once per batch for all five alphas (`one_search_for_every_alpha`):

Why that is the same computation. An alpha enters the beam search at one place only: the score of a finished
translation, log P / ((5 + |Y|) / 6)^alpha, appended to the sentence's list of finished translations (the one loop of
annotated/decoding/search.py; the expansion, the pruning to k prefixes and the stopping rule, k finished, never
read it). So the search at alpha 0 finds the same finished translations, with score log P / 1.0 = log P exactly,
and dividing that float by the same `gnmt_lp(|Y|, alpha)` gives, bit for bit, the list the search at alpha would
have built; `_hypotheses` then ranks it as always. `test_one_search_for_every_alpha_translates_as_a_search_per_alpha`
checks the shortcut against a real search per alpha on 64 validation sentences.
"""

import contextlib
import json
from pathlib import Path

import pytest

from annotated.decoding import search
from annotated.decoding.search import gnmt_lp, translate_ids
from annotated.decoding.settings import model_length_penalty
from annotated.shipped import load_shipped
from annotated.training.data import load_multi30k
from annotated.training.evaluate import LENGTH_PENALTIES, choose_length_penalty

REAL = Path(__file__).resolve().parents[2] / "annotated" / "shipped"


@contextlib.contextmanager
def one_search_for_every_alpha():
    """Inside: the beam search loop runs once per distinct batch, at alpha 0, and a later search of the same batch
    at any alpha gets the finished translations of that run, rescored at its alpha (the module's docstring)."""
    runs: dict = {}
    loop = search._search

    def once(model, src, src_mask, max_len, k, length_penalty, bos, eos, use_cache, fast, finished):
        key = (fast, id(model), src.shape, src.numpy().tobytes(), max_len, k)
        if key not in runs:
            runs[key] = [[] for _ in range(src.size(0))]
            loop(model, src, src_mask, max_len, k, 0.0, bos, eos, use_cache, fast, runs[key])
        for mine, found in zip(finished, runs[key]):
            # the loop appends Hypothesis(ids, log P, log P / gnmt_lp(|Y|, alpha)): rescored at this alpha
            mine.extend(h._replace(score=h.log_prob / gnmt_lp(len(h.ids), length_penalty)) for h in found)

    with _patched(search, "_search", once):
        yield


@contextlib.contextmanager
def _patched(module, name, value):
    before = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, before)


def shipped_or_skip(direction):
    if not (REAL / f"{direction}.pt").is_file():
        pytest.skip(f"{REAL / direction}.pt is not in this checkout")
    card = json.loads((REAL / f"{direction}.json").read_text(encoding="utf-8"))
    return (*load_shipped(direction, REAL), card)


def test_one_search_for_every_alpha_translates_as_a_search_per_alpha(data_url):
    model, tokenizer, _, _ = shipped_or_skip("de-en")
    pairs = load_multi30k("val", "de", "en", base_url=data_url)[:64]
    sources = [tokenizer.encode(s) for s, _ in pairs]
    want = {alpha: translate_ids(model, sources, 4, alpha) for alpha in LENGTH_PENALTIES}
    assert len({tuple(map(tuple, out)) for out in want.values()}) > 1  # the alphas do change translations here
    with one_search_for_every_alpha():
        got = {alpha: translate_ids(model, sources, 4, alpha) for alpha in LENGTH_PENALTIES}
    assert got == want


@pytest.mark.parametrize("direction", ["de-en", "en-de"])
def test_the_shipped_alpha_is_the_one_the_rule_picks_on_validation(direction, data_url):
    """The rule run on the whole validation split picks the alpha the checkpoint carries and its card names; its
    BLEU grid is the card's within 0.3 (another CPU's rounding may break a near-tie in a sentence or two, each worth
    about 0.05 BLEU over 1,014 sentences; the alpha the tests require to be the same)."""
    model, tokenizer, meta, card = shipped_or_skip(direction)
    src, tgt = direction.split("-")
    val = load_multi30k("val", src, tgt, base_url=data_url)
    with one_search_for_every_alpha():
        alpha, bleu = choose_length_penalty(model, tokenizer, val, 4)
    assert alpha == model_length_penalty(meta) == card["scores"]["length_penalty"] == card["length_penalty"]["chosen"]
    assert card["length_penalty"]["chosen_on"] == f"validation ({len(val)} sentences)"
    recorded = card["length_penalty"]["validation_bleu"]
    assert set(recorded) == {f"{a:g}" for a in LENGTH_PENALTIES}
    assert all(abs(bleu[a] - recorded[f"{a:g}"]) <= 0.3 for a in LENGTH_PENALTIES), (bleu, recorded)
