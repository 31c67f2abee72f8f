# %% [markdown]
# # An independent reference: word alignments from a statistical aligner
#
# To say that a cross-attention head *aligns* words, or is a *dictionary*, we
# need a reference that owes nothing to the model. Garg et al. (EMNLP 2019)
# read word alignments off a translator's cross-attention (the argmax at the
# step that predicts each target token) and scored them against human
# alignments and GIZA++; Multi30k has none, so a statistical aligner's links
# stand in: **eflomal** (Östling and Tiedemann 2016, the `eflomal` package
# 2.0.0: IBM model 1, HMM, HMM with fertility, by collapsed Gibbs sampling,
# more accurate than fast_align at a fraction of GIZA++'s cost), aligning both
# ways, the two combined with **grow-diag-final-and** (Koehn et al. 2005) as
# its README does. Below: the words (1), the symmetrization (2), the run
# (3), the cache (4), and the **lexicon** read off the training links (5).

# %%
from __future__ import annotations

import gzip
import hashlib
import json
import os
import subprocess
import tempfile
import unicodedata
from collections import Counter
from collections.abc import Iterable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, Union

from annotated.plumbing.files import atomic_write
from annotated.plumbing.progress import progress
from annotated.training import data

PathLike = Union[str, "os.PathLike[str]"]
Links = set[tuple[int, int]]  # (source word index, target word index)


class AlignerError(RuntimeError):
    """eflomal is missing or failed: the message says what happened and what to do."""


# %% [markdown]
# ## 1. Words
#
# A **word** is what lies between spaces (U+0020, the only character the
# project's sentencepiece turns into `▁`), so word `k` is also the `k`-th
# `▁`-word of the pieces. For the aligner it is *normalized*: lowercased,
# punctuation (Unicode `P*`) stripped from both ends, inner whitespace
# removed; a punctuation-only word normalizes to `""`, keeps its number and
# is never aligned (`test_words_keep_numbers_and_drop_punctuation`).


# %%
def normalize_word(word: str) -> str:
    """A word as the aligner sees it: lowercased, punctuation stripped from both ends, no whitespace inside.

    >>> normalize_word("Büsche."), normalize_word('"T-Shirt"'), normalize_word("—"), normalize_word("▁Hund")
    ('büsche', 't-shirt', '', '▁hund')
    """
    chars = [c for c in word.lower() if not c.isspace()]
    start, end = 0, len(chars)
    while start < end and unicodedata.category(chars[start]).startswith("P"):
        start += 1
    while end > start and unicodedata.category(chars[end - 1]).startswith("P"):
        end -= 1
    return "".join(chars[start:end])


def words(sentence: str) -> list[str]:
    """The normalized words of `sentence` split at spaces; a punctuation-only word is "" (kept, so numbers stay).

    >>> words("Zwei junge  Männer , im Freien.")
    ['zwei', 'junge', 'männer', '', 'im', 'freien']
    """
    return [normalize_word(w) for w in sentence.split(" ") if w]


# %% [markdown]
# ## 2. Symmetrization: grow-diag-final-and
#
# The forward links give each target word at most one source word, the
# reverse links the other way round. grow-diag-final-and (Moses' `symal`,
# fast_align's `atools`) starts from their intersection; **grow-diag** adds,
# while anything changes, each union link next to a kept one (eight
# neighbours) whose source or target word is still unaligned; **final-and**
# adds each forward, then reverse, link whose two words are both unaligned
# (`test_grow_diag_final_and_by_hand`,
# `test_grow_diag_final_and_lies_between_intersection_and_union`,
# `test_align_symmetrizes_with_grow_diag_final_and`).

# %%
NEIGHBOURS = ((-1, 0), (0, -1), (1, 0), (0, 1), (-1, -1), (-1, 1), (1, -1), (1, 1))


def grow_diag_final_and(forward: Links, reverse: Links) -> Links:
    """Koehn et al.'s grow-diag-final-and of two link sets, both as (source index, target index) pairs.

    >>> sorted(grow_diag_final_and({(0, 0), (1, 1), (2, 1)}, {(0, 0), (1, 1), (1, 2)}))
    [(0, 0), (1, 1), (1, 2), (2, 1)]
    """
    union = forward | reverse
    links = forward & reverse
    src_aligned = {i for i, _ in links}
    tgt_aligned = {j for _, j in links}

    def add(i: int, j: int) -> None:
        links.add((i, j))
        src_aligned.add(i)
        tgt_aligned.add(j)

    grown = True
    while grown:  # grow-diag
        grown = False
        for i, j in sorted(links):
            for di, dj in NEIGHBOURS:
                new = (i + di, j + dj)
                if new in union and new not in links and (new[0] not in src_aligned or new[1] not in tgt_aligned):
                    add(*new)
                    grown = True
    for direction in (forward, reverse):  # final-and
        for i, j in sorted(direction):
            if i not in src_aligned and j not in tgt_aligned:
                add(i, j)
    return links


# %% [markdown]
# ## 3. Running eflomal
#
# As its README describes, with `Aligner`'s default settings; we call the
# binary ourselves only to show its progress (what it costs:
# benchmarks/README.md, "Reading the circuits"). Unsupervised, it aligns
# test_2016_flickr with the training pairs. Its sampler is seeded from the
# system, so two runs differ in a few links: the cache keeps a reference
# fixed. Punctuation-only words are left out of its input, their numbers put
# back after (`test_aligner_recovers_a_known_dictionary`).

# %%
SETTINGS: dict[str, Any] = {
    "model": 3,
    "n_samplers": 3,
    "null_prior": 0.2,
    "rel_iterations": 1.0,
    "symmetrization": "grow-diag-final-and",
    "words": "split at U+0020; lowercased; punctuation stripped at the edges; punctuation-only words skipped",
}


def eflomal_iterations(n_pairs: int, model: int = 3, rel_iterations: float = 1.0) -> tuple[int, int, int]:
    """The sweeps of models 1, 2, 3 that eflomal's `align` chooses for `n_pairs` pairs.

    >>> eflomal_iterations(30_000)
    (7, 7, 29)
    """
    iters = max(2, round(rel_iterations * 5000 / n_pairs**0.5))
    quarter = max(1, iters // 4)
    return {1: (iters, 0, 0), 2: (max(2, quarter), iters, 0)}.get(model, (max(2, quarter), quarter, iters))


def _eflomal() -> Any:
    try:
        import eflomal
    except ImportError:
        raise AlignerError(
            "the word aligner needs the eflomal package: pip install -r requirements.lock "
            "(or pip install eflomal==2.0.0; it compiles with gcc)"
        ) from None
    return eflomal


def _kept(sentence: str) -> tuple[str, list[int]]:
    """eflomal's input line for `sentence` (its non-empty normalized words) and their word numbers."""
    normalized = words(sentence)
    kept = [k for k, w in enumerate(normalized) if w]
    return " ".join(normalized[k] for k in kept), kept


def _read_links(path: Path, src_kept: list[list[int]], tgt_kept: list[list[int]]) -> list[Links]:
    lines = path.read_text(encoding="utf-8").split("\n")[: len(src_kept)]
    out: list[Links] = []
    for line, src_k, tgt_k in zip(lines, src_kept, tgt_kept):
        pairs = (link.split("-") for link in line.split())
        out.append({(src_k[int(i)], tgt_k[int(j)]) for i, j in pairs})
    if len(out) != len(src_kept):
        raise AlignerError(f"eflomal wrote {len(out)} alignment lines for {len(src_kept)} sentence pairs")
    return out


def _run_binary(args: list[str], n_stages: int, show_progress: bool) -> None:
    """Run the eflomal binary; a progress bar counts the stages it reports on stderr."""
    if not show_progress:
        result = subprocess.run(args + ["-q"], stderr=subprocess.PIPE, text=True)
        returncode, log = result.returncode, result.stderr
    else:
        lines: list[str] = []
        with subprocess.Popen(args, stderr=subprocess.PIPE, text=True) as proc, progress(n_stages, "eflomal") as bar:
            assert proc.stderr is not None
            for line in proc.stderr:
                lines.append(line)
                if line.startswith(("Done:", "Final argmax iteration")):
                    bar.update(1)
        returncode, log = proc.returncode, "".join(lines)
    if returncode != 0:
        raise AlignerError(f"eflomal failed with exit status {returncode}: {log.strip()[-500:]}")


def run_eflomal(
    pairs: Sequence[tuple[str, str]], settings: dict[str, Any] | None = None, show_progress: bool = True
) -> tuple[list[Links], list[Links]]:
    """eflomal's forward and reverse links of `pairs`, as (source word, target word) numbers of `words`."""
    settings = {**SETTINGS, **(settings or {})}
    eflomal = _eflomal()
    src_lines, src_kept = zip(*(_kept(s) for s, _ in pairs)) if pairs else ((), ())
    tgt_lines, tgt_kept = zip(*(_kept(t) for _, t in pairs)) if pairs else ((), ())
    model = settings["model"]
    iters = eflomal_iterations(len(pairs), model, settings["rel_iterations"])
    aligner = eflomal.Aligner(
        model=model,
        n_samplers=settings["n_samplers"],
        null_prior=settings["null_prior"],
        rel_iterations=settings["rel_iterations"],
    )
    with tempfile.TemporaryDirectory(prefix="eflomal-") as tmp:
        d = Path(tmp)
        with open(d / "src", "wb") as src_f, open(d / "tgt", "wb") as tgt_f:
            aligner.prepare_files(src_lines, src_f, tgt_lines, tgt_f, None, None)
        binary = Path(eflomal.__file__).parent / "bin" / "eflomal"
        args = [str(binary), "-m", str(model), "-s", str(d / "src"), "-t", str(d / "tgt")]
        args += ["-n", str(settings["n_samplers"]), "-N", str(settings["null_prior"])]
        args += [a for m in range(model) for a in (f"-{m + 1}", str(iters[m]))]
        args += ["-f", str(d / "fwd"), "-r", str(d / "rev")]
        _run_binary(args, 2 * (sum(1 for i in iters[:model] if i) + 1), show_progress)
        forward = _read_links(d / "fwd", list(src_kept), list(tgt_kept))
        reverse = _read_links(d / "rev", list(src_kept), list(tgt_kept))
    return forward, reverse


# %% [markdown]
# ## 4. The cache
#
# `align` keeps the links in `<cache_dir>/alignments/<key>.json.gz`, keyed by
# the sha256 of the eflomal version, the settings and every sentence
# (`test_align_caches_by_texts_and_settings`). grow-diag-final-and treats
# both languages alike, so `multi30k_alignments` aligns each language pair
# once and transposes the links for the other direction
# (`test_multi30k_directions_share_one_run`).


# %%
def alignment_cache_key(pairs: Sequence[tuple[str, str]], settings: dict[str, Any]) -> str:
    """sha256 over the eflomal version, the settings and the texts (length-prefixed)."""
    try:
        version = metadata.version("eflomal")
    except metadata.PackageNotFoundError:
        version = None
    h = hashlib.sha256(json.dumps({"eflomal": version, "settings": settings}, sort_keys=True).encode())
    for s, t in pairs:
        for text in (s, t):
            b = text.encode("utf-8")
            h.update(len(b).to_bytes(8, "little") + b)
    return h.hexdigest()


def _decode(blob: bytes, n: int) -> list[Links] | None:
    try:
        lines = json.loads(gzip.decompress(blob))["links"]
        links = [{(int(a), int(b)) for a, b in (x.split("-") for x in line.split())} for line in lines]
    except (OSError, EOFError, ValueError, KeyError, TypeError):
        return None
    return links if len(links) == n else None


def align(
    pairs: Sequence[tuple[str, str]],
    *,
    settings: dict[str, Any] | None = None,
    cache_dir: PathLike | None = None,
    show_progress: bool = True,
) -> list[Links]:
    """The symmetrized word links (source word, target word) of each pair, from the cache or from eflomal."""
    pairs = list(pairs)
    if not pairs:
        return []
    settings = {**SETTINGS, **(settings or {})}
    root = Path(cache_dir if cache_dir is not None else data.default_cache_dir()) / "alignments"
    path = root / f"{alignment_cache_key(pairs, settings)}.json.gz"
    if path.is_file():
        cached = _decode(path.read_bytes(), len(pairs))
        if cached is not None:
            return cached
    forward, reverse = run_eflomal(pairs, settings, show_progress)
    links = [grow_diag_final_and(f, r) for f, r in zip(forward, reverse)]
    lines = [" ".join(f"{i}-{j}" for i, j in sorted(sentence)) for sentence in links]
    atomic_write(path, gzip.compress(json.dumps({"links": lines}).encode(), mtime=0))
    return links


def transpose(links: Iterable[Links]) -> list[Links]:
    """The same links with source and target swapped."""
    return [{(j, i) for i, j in sentence} for sentence in links]


def multi30k_alignments(
    src_lang: str = "de",
    tgt_lang: str = "en",
    cache_dir: PathLike | None = None,
    base_url: str | None = None,
    show_progress: bool = True,
) -> dict[str, tuple[list[tuple[str, str]], list[Links]]]:
    """{"train": (pairs, links), "test_2016_flickr": (pairs, links)} for one Multi30k direction."""
    first, second = sorted((src_lang, tgt_lang))
    splits = ("train", "test_2016_flickr")
    loaded = {s: data.load_multi30k(s, first, second, cache_dir, base_url) for s in splits}
    links = align(loaded["train"] + loaded["test_2016_flickr"], cache_dir=cache_dir, show_progress=show_progress)
    n = len(loaded["train"])
    out = {"train": (loaded["train"], links[:n]), "test_2016_flickr": (loaded["test_2016_flickr"], links[n:])}
    if first == src_lang:
        return out
    return {s: ([(t, u) for u, t in pairs], transpose(ls)) for s, (pairs, ls) in out.items()}


# %% [markdown]
# ## 5. The lexicon
#
# Counting the training pairs' links gives `c(s, t)`, how often source word
# `s` and target word `t` were linked; the lexicon ranks each source word's
# target words by `p(t | s) = c(s, t) / sum_t' c(s, t')` (ties
# alphabetically), and its keys come most frequent source word first, so "the
# 500 most frequent source words" are its first 500 keys
# (`test_lexicon_by_hand`).


# %%
def lexicon(pairs: Sequence[tuple[str, str]], links: Sequence[Links]) -> dict[str, list[tuple[str, float]]]:
    """{source word: [(target word, p(t | s)), ...] best first}, keys most frequent source word first.

    >>> lexicon([("Ein Hund.", "A dog."), ("Ein Mann", "A man")], [{(0, 0), (1, 1)}, {(0, 0), (1, 1)}])
    {'ein': [('a', 1.0)], 'hund': [('dog', 1.0)], 'mann': [('man', 1.0)]}
    """
    if len(pairs) != len(links):
        raise ValueError(f"{len(pairs)} sentence pairs but {len(links)} link sets: give one link set per pair")
    frequency: Counter[str] = Counter()
    counts: dict[str, Counter[str]] = {}
    for n, ((s, t), sentence) in enumerate(zip(pairs, links)):
        src, tgt = words(s), words(t)
        frequency.update(w for w in src if w)
        outside = [(i, j) for i, j in sentence if not (0 <= i < len(src) and 0 <= j < len(tgt))]
        if outside:
            raise ValueError(
                f"pair {n} has {len(src)} source and {len(tgt)} target words, but links {sorted(outside)} point "
                f"outside them: give the links of these very pairs, numbered as aligner.words numbers words"
            )
        for i, j in sentence:
            counts.setdefault(src[i], Counter())[tgt[j]] += 1
    out: dict[str, list[tuple[str, float]]] = {}
    for s in sorted(counts, key=lambda w: (-frequency[w], w)):
        total = sum(counts[s].values())
        out[s] = [(t, c / total) for t, c in sorted(counts[s].items(), key=lambda tc: (-tc[1], tc[0]))]
    return out
