# %% [markdown]
# # An independent reference: word alignments from a statistical aligner
#
# To say that a cross-attention head *aligns* words, or that its QK circuit
# is a *dictionary*, we need something to compare it with that owes nothing
# to the model. Garg et al. (EMNLP 2019, "Jointly Learning to Align and
# Translate with Transformer Models") read word alignments off the
# cross-attention of a Transformer trained only to translate (the argmax of
# the attention at the step that predicts each target token) and measured
# their alignment error rate against human alignments and against a
# statistical aligner, GIZA++: the penultimate layer aligned best, still
# behind GIZA++, and training one of its heads on the statistical aligner's
# links made the model align better than GIZA++. We score every
# cross-attention head in the same way, on Multi30k, which has no human
# alignments: a statistical aligner's links stand in for them.
#
# The aligner is **eflomal** (Östling and Tiedemann 2016; the `eflomal`
# package, version 2.0.0): a Bayesian IBM model 1, then HMM, then HMM with
# fertility, estimated by collapsed Gibbs sampling, in C. It is the
# maintained successor of efmaral, more accurate than fast_align at a
# fraction of GIZA++'s cost, and it installs from the package index. Each
# run aligns both ways: *forward*, each target word to at most one source
# word, and *reverse*, each source word to at most one target word. We
# combine the two with **grow-diag-final-and** (Koehn et al. 2005), the
# symmetrization eflomal's README applies (with fast_align's `atools`), and
# keep the result as the reference.
#
# Four choices, each explained in its section below:
#
# 1. **Words** are the space-separated words of the sentence, lowercased,
#    with punctuation stripped from their edges. They are exactly the words
#    the model's sentencepiece pieces form (one `▁`-piece to the next), so
#    an attention-derived alignment and the aligner's share word numbers.
# 2. **Symmetrization**: grow-diag-final-and.
# 3. **The run**: eflomal's own defaults (model 3, three samplers, null
#    prior 0.2, its iteration schedule), training and test pairs together.
# 4. **The cache**: the links of Multi30k's training pairs and
#    test_2016_flickr are computed once and kept in the data cache, keyed by
#    the texts and the settings.
#
# Then section 5 reads the aligner's **lexicon** off the training links:
# for each source word, its target words ranked by `p(t | s)`.

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
# sacreBLEU's `13a` tokenizer splits punctuation off words (`Büsche.` becomes
# `Büsche .`, `T-Shirt` becomes `T - Shirt`). We use a simpler rule on
# purpose: a **word** is what lies between spaces (U+0020, the only
# character the project's sentencepiece turns into `▁`), so that word `k` of
# a sentence is also the `k`-th `▁`-word of its pieces, and an alignment
# read from the attention needs no map of character offsets to be compared
# with the aligner's. For the aligner each word is *normalized*: lowercased
# (so `Ein` at the start of a sentence and `ein` inside it are one word),
# punctuation (Unicode categories `P*`) stripped from both ends
# (`young,` is `young`, `"Hallo"` is `hallo`; `T-Shirt`'s inner hyphen
# stays), and any other whitespace inside (Multi30k's German has a few tabs
# and no-break spaces) removed. A word that is only punctuation normalizes to
# `""`: it keeps its number but is not aligned at all, neither by eflomal
# nor from the attention (`test_words_keep_numbers_and_drop_punctuation`).


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
# The forward links let a source word take many target words but give each
# target word one source word at most; the reverse links the other way
# round. Their **intersection** is precise but misses every one-to-many
# link; their **union** finds those and much noise. grow-diag-final-and
# starts from the intersection and adds links of the union in two passes
# (Koehn, Axelrod, Mayne, Callison-Burch, Osborne and Talbot, IWSLT 2005; the
# procedure of Moses' `symal` and fast_align's `atools`):
#
# - **grow-diag**: while anything changes, for each link `(i, j)` already
#   kept (in order of `i`, then `j`), look at its eight neighbours
#   `(i ± 1, j)`, `(i, j ± 1)`, `(i ± 1, j ± 1)`; a neighbour in the union is
#   added if its source word *or* its target word is still unaligned;
# - **final-and**: then each link of the forward set, then of the reverse
#   set, is added if *both* its words are still unaligned.
#
# The result always lies between the intersection and the union
# (`test_grow_diag_final_and_by_hand`, `test_grow_diag_final_and_lies_between_intersection_and_union`),
# and it is what `align` keeps: the intersection would lose every
# one-to-many link (`test_align_symmetrizes_with_grow_diag_final_and`).


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
# We use eflomal as its README describes. `eflomal.Aligner.prepare_files`
# turns the sentences (one a line, words separated by spaces) into the
# binary's input files; then the `eflomal` binary that the package installs
# aligns both directions and writes the links, one line a sentence,
# `i-j` for source word `i` and target word `j` (both files in source-target
# order). We call the binary ourselves, with the same arguments that
# `Aligner.align` would pass, only to read its progress lines (one for each
# of the three models and the final pass, in each direction) into a progress
# bar. The settings are `Aligner`'s defaults: model 3 (IBM model 1, then
# HMM, then HMM with fertility), three independent samplers whose counts are
# pooled for the final alignment, a null prior of 0.2, and eflomal's
# iteration schedule: `max(2, round(5000 / sqrt(n)))` sweeps of the last
# model for `n` sentence pairs, a quarter of that for each of the first two
# (7, 7 and 29 for Multi30k's 30,000 pairs). What aligning them costs in
# time and memory is in benchmarks/README.md, "Reading the circuits".
#
# **Unsupervised, so test pairs go in too.** The aligner learns from the
# very pairs it aligns; aligning test_2016_flickr together with the 29,000
# training pairs gives its 1,000 pairs the statistics of all 30,000, the
# usual practice for statistical aligners.
#
# **Not bit-reproducible.** eflomal seeds its sampler from the system's
# randomness and has no seed option, so two runs differ in a few links.
# This is what the cache (section 4) is for: once computed, the reference of
# a data set stays fixed.
#
# Punctuation-only words are left out of eflomal's input; their numbers are
# put back afterwards (`test_aligner_recovers_a_known_dictionary`).

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
# `align` returns the symmetrized links of each pair and keeps them in
# `<cache_dir>/alignments/<key>.json.gz` (`cache_dir` defaults to the data
# cache, `$ANNOTATED_CACHE` or `~/.cache/annotated`, as for downloads and
# tokenizers). The key is the sha256 of the eflomal version, the settings
# and every sentence of every pair, so different data or settings never
# read another's links, and the same ones never run eflomal again
# (`test_align_caches_by_texts_and_settings`). The file is written
# atomically; one that does not read back is computed again.
#
# eflomal aligns both directions in every run, and grow-diag-final-and
# combines them by the same rules whichever language is called the source
# (only the order in which links are visited differs). So
# `multi30k_alignments` aligns each language pair once, in alphabetical
# order of the languages, and transposes the links for the other direction:
# de->en and en->de are scored against one and the same set of links
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


def _encode(links: list[Links]) -> bytes:
    lines = [" ".join(f"{i}-{j}" for i, j in sorted(sentence)) for sentence in links]
    return gzip.compress(json.dumps({"links": lines}).encode(), mtime=0)


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
    atomic_write(path, _encode(links))
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
# Counting the links of the training pairs gives, for each source word `s`
# and target word `t`, `c(s, t)`: how often they were linked. The lexicon
# ranks each source word's target words by
#
# `p(t | s) = c(s, t) / sum_t' c(s, t')`,
#
# the share of `s`'s links that go to `t` (ties broken alphabetically, so
# the order is fixed). Its keys come in order of the source word's
# frequency in the training text (ties alphabetically), most frequent first:
# "the 500 most frequent source words" are its first 500 keys. A source
# word that was never linked has no entry (`test_lexicon_by_hand`).


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
