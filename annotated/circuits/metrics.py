# %% [markdown]
# # Scoring a head against the aligner: precision@k, AER, and subwords to words
#
# Three measures compare a cross-attention head with the reference of
# `aligner.py`: the **precision@k** of a dictionary read from the head
# against the aligner's lexicon, the **alignment error rate** of its
# attention against the aligner's links, and the **conversion** of attention
# over subword pieces into word links, which the second needs. All three
# work on `aligner.words`' words, so the head's numbers and the aligner's
# refer to the same words.

# %%
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import numpy as np

from annotated.circuits.aligner import Links, normalize_word
from annotated.tokens import SPECIAL_LABELS

TOP = 500  # the most frequent source words a dictionary is scored on
MIN_SHARE = 0.1  # a lexicon translation counts from this share of the source word's links on
SPECIALS = frozenset(SPECIAL_LABELS.values())  # the labels of PAD, BOS and EOS
STEPS = ("predicts", "reads")
BYTE_PIECE = re.compile(r"<0x([0-9A-F]{2})>")  # sentencepiece's byte-fallback pieces

# %% [markdown]
# ## 1. precision@k of a dictionary
#
# A dictionary's ranked target words for source word `s` are **correct at k**
# when one of the first `k` is an accepted translation:
#
# `accepted(s) = {t_1(s)} ∪ {t : p(t | s) >= min_share}`,
#
# the lexicon's best and every word with at least 10% of `s`'s links: a word
# has several right translations (*spielt*: *playing*, *plays*), and the
# aligner's stray links to neighbours (*Hund* to *brown*) are each a small
# share (`test_precision_at_k_by_hand`). precision@k is the share of correct
# words among those scored: the lexicon's `top` first words, or the `words`
# given (the readout gives those that occur in the pairs it read, and says
# how many: `coverage`). An OV dictionary proposes word-initial *pieces*, so
# a word whose every accepted translation takes two pieces cannot be right
# (`unmatchable`; `test_precision_counts_only_the_words_scored`).


# %%
def accepted(translations: Sequence[tuple[str, float]], min_share: float = MIN_SHARE) -> set[str]:
    """The lexicon's best translation and every translation with p(t | s) >= min_share.

    >>> sorted(accepted([("playing", 0.55), ("plays", 0.3), ("a", 0.05)]))
    ['playing', 'plays']
    """
    return {t for n, (t, p) in enumerate(translations) if n == 0 or p >= min_share}


def precision_at_k(
    dictionary: Mapping[str, Sequence[str]],
    lexicon: Mapping[str, Sequence[tuple[str, float]]],
    k: int,
    top: int = TOP,
    min_share: float = MIN_SHARE,
    words: Sequence[str] | None = None,
) -> float:
    """Share of the words scored (`words`, else the lexicon's `top` most frequent source words) whose first `k`
    dictionary words hold an accepted one."""
    if k < 1 or top < 1:
        raise ValueError(f"k and top must be at least 1, got k={k}, top={top}")
    sources = list(lexicon)[:top] if words is None else list(words)
    if not sources:
        raise ValueError("no source words to score: align some pairs first, or give words that occur")
    correct = sum(1 for s in sources if accepted(lexicon[s], min_share) & set(dictionary.get(s, ())[:k]))
    return correct / len(sources)


def unmatchable(
    lexicon: Mapping[str, Sequence[tuple[str, float]]],
    words: Sequence[str],
    spelled: set[str],
    min_share: float = MIN_SHARE,
) -> list[str]:
    """The `words` none of whose accepted translations is in `spelled` (the words a single piece spells).

    >>> unmatchable({"hund": [("dog", 1.0)], "skater": [("skateboarder", 0.9)]}, ["hund", "skater"], {"dog"})
    ['skater']
    """
    return [w for w in words if not accepted(lexicon[w], min_share) & spelled]


# %% [markdown]
# ## 2. Alignment error rate
#
# Och and Ney (2003): `AER = 1 - (|A ∩ S| + |A ∩ P|) / (|A| + |S|)` for
# predicted links `A`, *sure* links `S` and *possible* links `P ⊇ S`, the
# counts summed over the corpus before the ratio. Our reference is the
# aligner's links, **S = P**, so AER is one minus the F1 of `A` against `S`
# (`test_aer_by_hand`, `test_aer_of_perfect_and_wrong_attention`).


# %%
def aer(predicted: Sequence[Links], sure: Sequence[Links], possible: Sequence[Links] | None = None) -> float:
    """Och and Ney's alignment error rate over a corpus (one link set a sentence); possible=None means P = S.

    >>> aer([{(0, 0), (1, 1)}], [{(0, 0), (2, 2)}])
    0.5
    """
    possible = sure if possible is None else possible
    if not len(predicted) == len(sure) == len(possible):
        raise ValueError(
            f"predicted, sure and possible must have one link set per sentence, got "
            f"{len(predicted)}, {len(sure)} and {len(possible)}"
        )
    a_s = a_p = size_a = size_s = 0
    for a, s, p in zip(predicted, sure, possible):
        a_s += len(a & s)
        a_p += len(a & (p | s))  # P includes S by definition
        size_a += len(a)
        size_s += len(s)
    if size_a + size_s == 0:
        raise ValueError("no links to score: the prediction and the reference are both empty")
    return 1 - (a_s + a_p) / (size_a + size_s)


# %% [markdown]
# ## 3. From a head's attention over pieces to word links
#
# **Words from pieces**: a word runs from one `▁`-piece to the next, so word
# `k` is `aligner.words`' word `k`; special pieces belong to no word, a lone
# `▁` opens the word after it (and is no word before another `▁`-piece), byte
# pieces (`<0xE2>`) are read as their bytes, and a punctuation-only word is
# never linked (`test_words_from_pieces`,
# `test_piece_words_match_aligner_words_on_the_shipped_tokenizer`).
# **The row of a target piece**: Garg et al. align `y_p` with the step that
# *predicts* it, row `p - 1` (`step="predicts"`); `step="reads"` takes row
# `p` (`test_step_predicts_or_reads`). **Argmax, then union**: each target
# piece links to the source piece its row attends to most (nothing, when that
# is a special piece or punctuation, where heads put their weight when nothing
# fits), and a target word to every source word one of its pieces links to,
# as for compounds (Zenkel et al. 2019, Garg et al. 2019;
# `test_attention_to_word_links_by_hand`).


# %%
def piece_words(pieces: Sequence[str]) -> tuple[list[int | None], list[str]]:
    """The word number of each piece (None: special, or a lone ▁) and each word's normalized text.

    >>> piece_words(["▁Ein", "▁Spiel", "haus", "▁.", "</s>"])
    ([0, 1, 1, 2, None], ['ein', 'spielhaus', ''])
    """
    number: list[int | None] = []
    spelled: list[bytes] = []  # the UTF-8 of each word read so far
    inside = False  # whether the last piece belongs to a word
    for piece in pieces:
        if piece in SPECIALS:
            number.append(None)
            inside = False
            continue
        if piece.startswith("▁") or not inside:
            spelled.append(b"")
            inside = True
        body = piece.lstrip("▁")
        byte = BYTE_PIECE.fullmatch(body)  # byte fallback: one byte of a character the vocabulary lacks
        spelled[-1] += bytes.fromhex(byte.group(1)) if byte else body.encode()
        number.append(len(spelled) - 1)
    # a word with no characters (a lone ▁) is no word: renumber the others
    real = [k for k, b in enumerate(spelled) if b]
    renumber = {k: n for n, k in enumerate(real)}
    texts = [normalize_word(spelled[k].decode("utf-8", errors="replace")) for k in real]
    return [renumber.get(k) if k is not None else None for k in number], texts


def attention_to_word_links(
    attn: np.ndarray | Sequence[Sequence[float]],
    src_pieces: Sequence[str],
    tgt_pieces: Sequence[str],
    step: str = "predicts",
) -> Links:
    """(source word, target word) links from one head's attention `attn` (T, S).

    `src_pieces` (S,) label the source positions (this project's sources have no "</s>"; MarianMT's end in one),
    `tgt_pieces` (T,) the decoder's inputs
    ("<s>", then y_1 to y_n). step="predicts" (Garg et al., the default) reads y_p's link from row p - 1,
    step="reads" from row p.
    """
    if step not in STEPS:
        raise ValueError(f"step must be one of {STEPS}, got {step!r}")
    weights = np.asarray(attn, dtype=np.float64)  # (T, S)
    if weights.ndim != 2 or weights.shape != (len(tgt_pieces), len(src_pieces)):
        raise ValueError(
            f"attn must be (target pieces, source pieces) = ({len(tgt_pieces)}, {len(src_pieces)}), "
            f"got shape {weights.shape}"
        )
    src_word, src_text = piece_words(src_pieces)
    tgt_word, tgt_text = piece_words(tgt_pieces)
    best = weights.argmax(axis=1)  # (T,) the source position each row attends to most
    links: Links = set()
    for p, j in enumerate(tgt_word):
        if j is None or not tgt_text[j]:
            continue
        row = p - 1 if step == "predicts" else p
        if row < 0:  # "predicts" and the first piece is no <s>: nothing predicted it
            continue
        i = src_word[best[row]]
        if i is not None and src_text[i]:
            links.add((i, j))
    return links
