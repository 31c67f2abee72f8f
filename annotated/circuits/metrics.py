# %% [markdown]
# # Scoring a head against the aligner: precision@k, AER, and subwords to words
#
# Three measures compare what a cross-attention head does with the
# reference of `aligner.py` (eflomal's links of Multi30k and their lexicon):
#
# 1. **precision@k** of a *dictionary* read from a head (for each source
#    word, target words ranked best first) against the aligner's lexicon;
# 2. the **alignment error rate** of an alignment read from a head's
#    attention against the aligner's links;
# 3. the **conversion** of a head's attention over subword pieces into word
#    links, which (2) needs.
#
# All three work on words as `aligner.words` defines them (split at spaces,
# lowercased, punctuation stripped from the edges; a punctuation-only word
# is never linked), so a head's numbers and the aligner's refer to the same
# words.

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
# A head's dictionary proposes, for a source word `s`, a ranked list of
# target words. It is **correct at k** when one of its first `k` words is
# an accepted translation of `s`. The accepted translations of `s` are the
# lexicon's best translation and every other target word that takes at
# least `min_share` (10% by default) of `s`'s links:
#
# `accepted(s) = {t_1(s)} ∪ {t : p(t | s) >= min_share}`.
#
# Why not the lexicon's top-1 alone: a German word has several right
# English words. *spielt* is *playing* in "A boy is playing" and *plays* in
# "A boy plays", *rot* is *red* whatever the noun's gender, and which of
# them the aligner ranks first depends on the corpus's habits, not on what
# the word means; a head that says *plays* for *spielt* has the right word.
# Why not every linked word: the aligner also links a word to its
# neighbours now and then (*Hund* to *brown* in "brauner Hund"), links that
# are each a small share of the word's links. A share of 10% keeps the
# translations that are a real sense or form of the word and leaves out
# that noise (`test_precision_at_k_by_hand`).
#
# precision@k is the number of correct source words among the words scored,
# divided by their number. The words scored are the lexicon's `top` most
# frequent source words (500 by default; all of them when the lexicon has
# fewer), or the `words` given: a dictionary read from a head's mean inputs
# over some training pairs has no entry for a frequent word that never occurs
# in those pairs, and scoring it as a miss would measure the sample, not the
# head. So the readout scores only the words that occur and says how many of
# the `top` that is (`coverage`). A word the dictionary has no entry for
# still counts as wrong. The dictionary's words must be normalized as the
# aligner's are (`normalize_word`: a piece `▁Hund` is the word `hund`).
#
# One more limit is the dictionary's, not the lexicon's: an OV dictionary
# proposes word-initial *pieces*, so a source word whose every accepted
# translation is spelled by two pieces or more (*skateboarder*) cannot be
# right at any k. `unmatchable` counts those words, and the readout reports
# them beside the precision (`test_precision_counts_only_the_words_scored`).


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
# Och and Ney (2003) score a predicted link set `A` against *sure* links `S`
# and *possible* links `P ⊇ S` (links annotators were unsure of):
#
# `AER = 1 - (|A ∩ S| + |A ∩ P|) / (|A| + |S|)`.
#
# The counts are summed over all sentences before the ratio, as in Och and
# Ney (a corpus measure, not a mean of sentence scores). Our reference is
# one set of links, the aligner's, so **S = P = the aligner's links**, and
# AER is then `1 - 2|A ∩ S| / (|A| + |S|)`, one minus the F1 of `A` against
# `S`: 0 when `A` is exactly the reference, 1 when they share no link
# (`test_aer_by_hand`, `test_aer_of_perfect_and_wrong_attention`). With
# human alignments, `possible` takes the extra links.


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
# A head's attention is a matrix over subword pieces: one row for each
# decoder position, one column for each source position. Three steps make it
# word links.
#
# **Words from pieces.** Sentencepiece marks a piece that follows a space
# with `▁`, so a word is the pieces from one `▁`-piece up to the next (a
# piece without `▁` at the very start opens a word too). Word `k` is thus
# the `k`-th space-separated word of the sentence, the same numbering as
# `aligner.words`. The special pieces `<s>`, `</s>` and `<pad>` belong to no
# word. The tokenizer writes ` .` as a lone `▁` then `.`, so a lone `▁` opens
# the word of the pieces after it; when another `▁`-piece follows at once
# (two spaces in a row) it is no word at all. Byte pieces (`<0xE2>`, sentencepiece's spelling of
# a character its vocabulary lacks) are read as the bytes they stand for. A word whose text is only punctuation (`.` , `-`)
# is kept in the numbering but never linked (`test_words_from_pieces`; the
# shipped tokenizer's words are `aligner.words` on every sentence of
# test_2016_flickr, both languages:
# `test_piece_words_match_aligner_words_on_multi30k`,
# `test_piece_words_match_aligner_words_on_the_shipped_tokenizer`).
#
# **Which row speaks for a target piece.** The decoder reads `<s> y_1 ...
# y_n` and predicts `y_1 ... y_n </s>`; row `p` is the position whose input
# is piece `p` of that row of labels. Garg et al. align target token `y_p`
# with the attention of the step that *predicts* it, whose input is the
# previous token: row `p - 1`. That is the default, `step="predicts"`. The
# other reading, `step="reads"`, takes the row whose input is `y_p`, row
# `p`. Under "predicts" the last row (which predicts `</s>`) is not used,
# under "reads" the first (which reads `<s>`) (`test_step_predicts_or_reads`).
#
# **Argmax, then union.** Each target piece links to the source piece its
# row attends to most (the first of equal maxima). When that is a special
# piece (a source that ends in `</s>`, as an imported MarianMT model's does,
# gives heads a place to put their weight when nothing fits) or a
# punctuation-only word (the final `.` plays that part in this project's
# sources), the target piece links to nothing, as an aligner leaves a word
# unaligned. A target word links to **every** source word one
# of its pieces links to (the union, not the majority): the usual
# conversion from subword to word alignments (Zenkel et al. 2019, Garg et al.
# 2019), and right for compounds, where *Spiel|haus*'s two pieces may point
# at *play* and *house*. Punctuation-only target words get no links
# (`test_attention_to_word_links_by_hand`).


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
