"""A made-up language pair with a known dictionary and known alignments, for the aligner and its metrics.

Source word `k` is always translated by target word `perm[k]`, one for one; the target sentence holds the
translations in a shuffled order. Source words are sometimes capitalized or carry a comma, and a
punctuation-only word ("-" in the source, "—" in the target) is sometimes inserted: none of these may change
what is aligned (the aligner lowercases, strips edge punctuation and skips punctuation-only words), and the
word numbers count the punctuation words. Word frequencies follow a mild Zipf law (exponent 0.25), so the
rarest of 80 words still occurs 42 times in the 1,000 pairs of seed 0.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Corpus:
    pairs: list[tuple[str, str]]
    links: list[set[tuple[int, int]]]  # the true (source word, target word) links of each pair
    dictionary: dict[str, str]  # normalized source word -> its one translation


ZIPF = 0.25


def source_word(k: int) -> str:
    return f"qu{k}ab"


def target_word(k: int) -> str:
    return f"ze{k}ol"


def make_corpus(n_words: int = 80, n_pairs: int = 1000, seed: int = 0) -> Corpus:
    rng = random.Random(seed)
    perm = list(range(n_words))
    rng.shuffle(perm)
    weights = [1 / (k + 1) ** ZIPF for k in range(n_words)]
    pairs, links = [], []
    for _ in range(n_pairs):
        length = rng.randint(3, 8)
        chosen: list[int] = []
        while len(chosen) < length:  # distinct words: a word's link is then unambiguous
            k = rng.choices(range(n_words), weights)[0]
            if k not in chosen:
                chosen.append(k)
        order = list(range(length))
        rng.shuffle(order)  # target position of each source word
        src = [source_word(k) for k in chosen]
        src = [w.capitalize() if rng.random() < 0.2 else w for w in src]
        src = [w + "," if rng.random() < 0.1 else w for w in src]
        tgt = [""] * length
        for i, k in enumerate(chosen):
            tgt[order[i]] = target_word(perm[k])
        src_numbers, tgt_numbers = list(range(length)), list(range(length))
        if rng.random() < 0.3:  # a punctuation-only word shifts the numbers after it
            at = rng.randint(0, length)
            src.insert(at, "-")
            src_numbers = [n + (n >= at) for n in src_numbers]
        if rng.random() < 0.3:
            at = rng.randint(0, length)
            tgt.insert(at, "—")
            tgt_numbers = [n + (n >= at) for n in tgt_numbers]
        pairs.append((" ".join(src), " ".join(tgt)))
        links.append({(src_numbers[i], tgt_numbers[order[i]]) for i in range(length)})
    dictionary = {source_word(k): target_word(perm[k]) for k in range(n_words)}
    return Corpus(pairs, links, dictionary)
