# %% [markdown]
# # Capitals: shouted, lower-case and caps-lock input
#
# The model learnt from sentences cased as people write them. Typed in
# capitals ("EIN MANN FÄHRT FAHRRAD."), a German sentence becomes single
# letters (`▁E`, `I`, `N`, `▁M`, `A`, `N`, `N`, ...: the `cpu` preset's
# vocabulary has no piece for words in capitals), and what comes out is
# noise (`A pajamasherman egggggggADA"`). The translator therefore looks at the case of each line
# before translating it (`style`):
#
# | style | the line | what the translator does |
# | --- | --- | --- |
# | `"inverted"` | most of its words that mix cases start lower and go on upper (`eIN mANN FÄHRT`: caps lock on, shift for the capitals) | swap every letter's case (`Ein Mann fährt`), translate, answer as usual |
# | `"upper"` | else, most of its words (of two or more letters) all capitals | recase it (below), translate, and answer in capitals |
# | `"lower"` | else, no capital at all (and a word of two or more letters) | recase it, translate, and answer in lower case |
# | `None` | anything else (a sentence as people write it) | translate it as it is |
#
# The rules are checked in that order, each on the words of two or more
# letters (`style`; its examples are the tests).
#
# **Recasing** (`recase`) gives each word the casing it has most often in
# the training data's source sentences, not counting the first word of a
# sentence (`case_table`; training stores this table in every checkpoint,
# beside the tokenizer; `python -m annotated.training.add_case_table` adds it
# to an older one). The table is the better guide: the vocabulary is shared
# by both languages, so by the tokenizer alone the German `Shirt` loses to
# the English `shirt`. A word the table lacks falls back on the tokenizer:
# lower (`ein`), capitalised (`Mann`) or, for a line typed in capitals,
# capitals (`USA`), whichever form spells no unseen character and takes the
# fewest subwords (a frequent word is one piece in the casing it was seen
# in); capitals spell "ß" as "SS", so a word with "ss" also tries "ß"
# (`FUSSBALL` -> `Fußball`), which must then take strictly fewer. Ties go to
# the form whose subwords sentencepiece scores higher, then to the lower
# one. The first letter of the line becomes a capital.
#
# What it is worth on `test_2016_flickr` (the whole source in capitals, in
# lower case, or caps-locked) is measured by `benchmarks/case.py` and given
# in `docs/training.md`; `--case as-typed` turns it off.

# %%
from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Iterable

WORD = re.compile(r"\w+")


def case_table(sentences: Iterable[str]) -> dict[str, str]:
    """{lower-case word: its most frequent form}, the first word of each sentence not counted (ties: the form
    seen first).

    >>> case_table(["Der Mann sieht den Hund.", "Ein Hund und ein Mann.", "Hund"])
    {'mann': 'Mann', 'sieht': 'sieht', 'den': 'den', 'hund': 'Hund', 'und': 'und', 'ein': 'ein'}
    """
    forms: defaultdict[str, Counter] = defaultdict(Counter)
    for sentence in sentences:
        for word in WORD.findall(sentence)[1:]:
            forms[word.lower()][word] += 1
    return {lower: counts.most_common(1)[0][0] for lower, counts in forms.items()}


def style(text: str) -> str | None:
    """ "upper", "lower", "inverted", or None for a line cased as people write.

    >>> [style(s) for s in ("EIN MANN FÄHRT.", "ein mann fährt.", "eIN mANN FÄHRT.", "Ein Mann fährt.", "Der ICE.")]
    ['upper', 'lower', 'inverted', None, None]
    >>> style("eIN HUND RENNT ÜBER DIE wIESE."), style("Ein iPhone."), style("USA")
    ('inverted', None, 'upper')
    >>> [style(s) for s in ("", "A", "42 !", "I", "a")]
    [None, None, None, None, None]
    """
    words = [w for w in WORD.findall(text) if sum(c.isalpha() for c in w) >= 2]
    if not words:
        return None
    mixed = [w for w in words if not w.isupper() and not w.islower()]
    inverted = [w for w in mixed if w[0].islower() and w[1:].isupper()]
    if inverted and len(inverted) * 2 > len(mixed):
        return "inverted"
    if sum(w.isupper() for w in words) * 2 > len(words):
        return "upper"
    if not any(c.isupper() for c in text):
        return "lower"
    return None


def recase(text: str, tokenizer, keep_capitals: bool = False, table: dict | None = None) -> str:
    """Each word in its most frequent casing (`table`), else in the one the tokenizer spells in the fewest
    subwords (see above); the first letter a capital. With `keep_capitals`, a word's all-capitals form is a
    candidate too."""

    def best(match: re.Match) -> str:
        word = match.group()
        lower = word.lower()
        if table and lower in table:
            return table[lower]
        forms = [lower, lower.capitalize()] + ([word.upper()] if keep_capitals else [])
        if "ss" in lower:  # "ß" in capitals is "SS": FUSSBALL may be Fußball
            forms += [lower.replace("ss", "ß"), lower.replace("ss", "ß").capitalize()]
        costs = []
        for n, form in enumerate(forms):
            ids = tokenizer.encode(form)
            costs.append(
                (tokenizer.spells_unseen(ids), len(ids), "ß" in form and "ß" not in lower, -tokenizer.score(ids), n)
            )
        return forms[min(costs)[-1]]

    recased = WORD.sub(best, text)
    first = next((i for i, c in enumerate(recased) if c.isalpha()), None)
    if first is None:
        return recased
    return recased[:first] + recased[first].upper() + recased[first + 1 :]


def swap_case(text: str) -> str:
    """Each letter in the other case, as caps lock types it; a letter whose other case is two letters stays.

    >>> swap_case("Ein Mann auf der Straße"), "Straße".swapcase()
    ('eIN mANN AUF DER sTRAßE', 'sTRASSE')
    """
    return "".join(c.swapcase() if len(c.swapcase()) == 1 else c for c in text)


def normalise(text: str, tokenizer, table: dict | None = None) -> tuple[str, str | None]:
    """(the text to translate, its style); a line cased as people write comes back as it is."""
    kind = style(text)
    if kind == "inverted":
        return swap_case(text), kind
    if kind in ("upper", "lower"):
        return recase(text, tokenizer, keep_capitals=kind == "upper", table=table), kind
    return text, kind


def restore(translation: str, kind: str | None) -> str:
    """The translation in the input's style: capitals for "upper", lower case for "lower".

    >>> restore("A man rides a bike.", "upper"), restore("A man rides a bike.", "lower")
    ('A MAN RIDES A BIKE.', 'a man rides a bike.')
    >>> restore("A man rides a bike.", "inverted"), restore("A man.", None)
    ('A man rides a bike.', 'A man.')
    """
    return {"upper": str.upper, "lower": str.lower}.get(kind or "", str)(translation)
