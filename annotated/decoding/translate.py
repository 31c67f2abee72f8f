# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # The translator: a checkpoint, sentences in, translations out
#
# ```sh
# python -m annotated.decoding.translate --checkpoint runs/<run>/best.pt "Ein Hund rennt über die Wiese."
# python -m annotated.decoding.translate < sentences.de > sentences.en   # the latest run's best.pt
# make translate TEXT="Ein Hund rennt über die Wiese."
# annotated-translate "Ein Hund rennt."                                  # after `pip install -e .`, anywhere
# ```
#
# With sentences on the command line it translates them and prints one line
# per sentence. Without, it reads standard input, one sentence a line, and
# prints one translation a line: a file or a pipe in windows of lines, a
# terminal line by line (section 4). Output line `i` always answers input
# line `i`: a bad line gets an (empty) answer too, and the reason goes to
# standard error.
#
# Everything the model needs comes from the checkpoint
# (`annotated/checkpoint.py`): the config, the parameters, the sentencepiece
# model its training data was cut with, and the length penalty its run chose
# on validation (`model_length_penalty`, `annotated/decoding/settings.py`),
# else the paper's 0.6; `--length-penalty` overrides it
# (`test_the_translator_decodes_at_the_models_length_penalty_unless_told`).

# %%
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import operator
import os
import queue
import re
import stat
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NamedTuple, TextIO

import torch

from annotated.checkpoint import CheckpointError, case_table_in, loaded_from_state, read_checkpoint
from annotated.checks import check_tokenizer
from annotated.decoding import casing
from annotated.decoding.alignment import alignment, pharaoh, word_numbers
from annotated.decoding.quantize import QUANTIZATIONS, quantize_int8
from annotated.decoding.search import translate_ids
from annotated.decoding.settings import Decoding, model_length_penalty
from annotated.door import Door
from annotated.plumbing.allocator import keep_freed_memory
from annotated.plumbing.devices import default_device
from annotated.plumbing.options import at_least, device
from annotated.shipped import direction_asked
from annotated.transformer import EncoderDecoder

DOOR = Door(__file__)
NAME = DOOR.name

# %% [markdown]
# ## 1. Which checkpoint
#
# `--checkpoint PATH`, or else the door's rule (`annotated/door.py`), said in
# one line on stderr. The shipped models learnt from Multi30k's image
# captions: they translate photo captions, not everyday language.

# %% [markdown]
# ## 2. From text to subword ids, and the input rules
#
# A line of text becomes the model's source by sentencepiece alone: no `bos`,
# no `eos`, as training encodes sources. Input that cannot be used as it
# stands has one rule per case, which `--help` prints (`RULES`); `prepare`
# applies them and names the line in a note on stderr; a bad line gets an
# empty answer, and the next line is served. Two rules need a reason:
#
# - **A sentence longer than `LONG_SENTENCE` characters** is split at clause
#   ends even within `max_len` (`clauses_within`): a model that never saw a
#   longer sentence tends to end one after its first clauses.
# - **Unseen characters** (emoji, symbols, other scripts) are set aside: the
#   tokenizer could spell them in UTF-8 byte pieces, but the model never saw
#   those, and one emoji could change the whole translation. Set aside, a
#   sentence with an emoji translates as the sentence without it, and the
#   emoji follows its sentence's translation: an untrained source position
#   says nothing about where it belongs in the target
#   (`test_unseen_characters_are_set_aside_and_put_back_at_the_end`).
#
# Standard input is read as bytes, at most `MAX_LINE_BYTES + 2` at a time,
# and decoded line by line: a text-mode `sys.stdin` would raise on the first
# bad byte and lose every later line, and a line of 50 MB costs no more
# memory than a short one (`test_a_huge_line_is_never_held_in_memory`).
# Lines are counted from 1; a sentence on the command line is "argument N".

# %%
MAX_LINE_BYTES = 1 << 16
WINDOW = 1024  # lines read, translated and flushed together from a file or pipe (section 4)
BATCH_SIZE = 64  # sentences searched together (translate_ids' default; --batch-size)
PART_V = "make docs, docs/_build/index.html#part-5; docs/circuits.md"  # the book's Part V, circuits/
RULES = f"""\
input rules (each bad line still gets one output line, and the next line is served):
  empty or whitespace-only line  -> prints an empty line; message on stderr
  line longer than 65536 bytes   -> prints an empty line; message on stderr (memory stays flat)
  more subwords than max_len     -> split at sentence ends, then clause ends, then between words;
                                    the parts are translated and joined in order; note on stderr
  characters unseen in training  -> (emoji, symbols, other scripts) set aside; the rest is translated
                                    and they are put back at the end of the translation, in order;
                                    a line of nothing else is printed as typed; note on stderr
  all capitals / all lower case  -> recased (each word in its most frequent casing in the training data,
                                    the checkpoint's case table), translated, and answered in capitals /
                                    lower case; caps lock (eIN mANN) is swapped back; note on stderr
                                    (--case as-typed: translated as typed)
  non-UTF-8 bytes on stdin       -> replaced by U+FFFD; warning on stderr naming the line
  any other error for one line   -> prints an empty line; the error on stderr
reading stdin: a file or pipe is read {WINDOW} lines at a time, translated in batches, answered in
input order and flushed (a progress bar on a terminal's stderr); typed on a terminal, line by line
(Ctrl-D ends).
output length: at most min(max_len, source subwords + --max-extra) subwords.
checkpoint missing, corrupt or incompatible, or a bad option: one line on stderr, exit code 2.
Ctrl-C: "translate: interrupted" on stderr, exit code 130.
"""


def bounded_lines(stream, limit: int = MAX_LINE_BYTES) -> Iterator[bytes | None]:
    """Each line of a binary stream without its line end, or None for a line longer than `limit` bytes;
    never more than `limit + 2` bytes of a line in memory.

    >>> import io
    >>> list(bounded_lines(io.BytesIO(b"short\\r\\n" + b"x" * 9 + b"\\nlast"), limit=8))
    [b'short', None, b'last']
    """
    while True:
        chunk = stream.readline(limit + 2)  # room for the content and "\r\n"
        if not chunk:
            return
        if len(chunk) == limit + 2 and not chunk.endswith(b"\n"):
            while chunk and not chunk.endswith(b"\n"):  # drop the rest of the line, piece by piece
                chunk = stream.readline(limit + 2)
            yield None
            continue
        line = chunk.rstrip(b"\r\n")
        yield line if len(line) <= limit else None


def decode_line(raw: bytes) -> tuple[str, str | None]:
    """UTF-8 bytes (newline already removed) -> (text, note or None); bad bytes become U+FFFD.

    >>> decode_line("Straße".encode())
    ('Straße', None)
    >>> text, note = decode_line(b"Stra\\xdfe")  # latin-1, not UTF-8
    >>> text == "Stra\\ufffde", note
    (True, 'not valid UTF-8, undecodable bytes replaced by U+FFFD')
    """
    try:
        return raw.decode("utf-8"), None
    except UnicodeDecodeError:
        return raw.decode("utf-8", errors="replace"), "not valid UTF-8, undecodable bytes replaced by U+FFFD"


def set_aside_unseen(text: str, tokenizer) -> tuple[str, list[str]]:
    """(the text without its unseen characters, each run of them in order)."""
    unseen = tokenizer.unseen_characters(text)
    if not unseen:
        return text, []
    runs = "[" + re.escape("".join(sorted(unseen))) + "]+"
    return " ".join(re.sub(runs, " ", text).split()), re.findall(runs, text)


SENTENCE_END = re.compile(r"(?<=[.!?…])\s+")
CLAUSE_END = re.compile(r"(?<=[,;:])\s+")
BETWEEN_WORDS = re.compile(r"\s+")


LONG_SENTENCE = 200  # characters: 99.9% of Multi30k's German training sentences are shorter (the longest: 257)


def sentences_that_fit(text: str, tokenizer, max_len: int) -> list[tuple[list[list[int]], list[str]]]:
    """The text as segments (subword ids of its parts, its set-aside characters): one segment when the text
    without its unseen characters fits in `max_len` subwords and `LONG_SENTENCE` characters, else one per
    sentence; a sentence longer than `LONG_SENTENCE` characters in parts of whole clauses within it."""
    kept, aside = set_aside_unseen(text, tokenizer)
    sentences = [s for s in SENTENCE_END.split(text) if s]
    if (len(tokenizer.encode(kept)) <= max_len and len(kept) <= LONG_SENTENCE) or len(sentences) == 1:
        return [([ids for run in clauses_within(kept) for ids in parts_that_fit(run, tokenizer, max_len)], aside)]
    return [segment for s in sentences for segment in sentences_that_fit(s, tokenizer, max_len)]


def clauses_within(sentence: str, limit: int = LONG_SENTENCE) -> list[str]:
    """A sentence longer than `limit` characters as runs of whole clauses (cut after `,` `;` `:`) of at most
    `limit` characters each (a clause longer than that stays whole); a shorter sentence as it is (section 2).

    >>> clauses_within("Ein Hund rennt, eine Frau liest; ein Mann schläft.", limit=20)
    ['Ein Hund rennt,', 'eine Frau liest;', 'ein Mann schläft.']
    >>> clauses_within("Ein Hund rennt, eine Frau liest.", limit=40)
    ['Ein Hund rennt, eine Frau liest.']
    """
    if len(sentence) <= limit:
        return [sentence]
    return _packed([c for c in CLAUSE_END.split(sentence) if c], limit, lambda a, b: f"{a} {b}")


def parts_that_fit(text: str, tokenizer, max_len: int) -> list[list[int]]:
    """Subword ids of one sentence in parts of at most `max_len`: one part if it fits, else packed from its
    clauses, a clause too long from its words, a word too long cut into pieces.

    Sentencepiece splits at whitespace, so the parts' ids together are the text's ids."""
    ids = tokenizer.encode(text)
    if len(ids) <= max_len:
        return [ids] if ids else []
    for boundary in (CLAUSE_END, BETWEEN_WORDS):
        pieces = [p for p in boundary.split(text) if p]
        if len(pieces) > 1:
            return _packed([part for p in pieces for part in parts_that_fit(p, tokenizer, max_len)], max_len)
    return [ids[i : i + max_len] for i in range(0, len(ids), max_len)]


def _packed(parts: list, limit: int, join: Callable = operator.add) -> list:
    """Consecutive parts (id lists, or clauses with `join`) joined while the result is at most `limit` long."""
    packed: list = []
    for part in parts:
        if packed and len(join(packed[-1], part)) <= limit:
            packed[-1] = join(packed[-1], part)
        else:
            packed.append(part)
    return packed


@dataclass
class Line:
    """One input line on its way through: where it came from; its segments, each the subword ids of its
    parts and the unseen characters set aside; what to say on stderr."""

    where: str
    segments: list[tuple[list[list[int]], list[str]]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    case: str | None = None  # the input's style (casing.style), to answer in it

    @property
    def sources(self) -> list[list[int]]:
        return [ids for parts, _ in self.segments for ids in parts]


def prepare(
    where: str,
    text: str | None,
    note: str | None,
    tokenizer,
    max_len: int,
    case: str = "auto",
    table: dict | None = None,
) -> Line:
    """Apply the input rules to one line (text None: longer than MAX_LINE_BYTES); `case="auto"` recases
    capitals, lower case and caps lock (`annotated/decoding/casing.py`, with the checkpoint's case `table`),
    "as-typed" does not."""
    line = Line(where, notes=[note] if note else [])
    if text is None:
        return line
    if not text.strip():
        line.notes.append("empty input, printed an empty line")
        return line
    if case == "auto":
        text, line.case = casing.normalise(text, tokenizer, table)
        if line.case:
            line.notes.append(f"{CASE_NOTES[line.case]}: translated as {text!r}")
    try:
        line.segments = sentences_that_fit(text, tokenizer, max_len)
    except ValueError as e:  # e.g. a lone surrogate from an undecodable argument
        line.notes.append(f"error: {e}; printed an empty line")
        return line
    if not line.sources:  # nothing left to translate: only characters the model never saw
        aside = "".join(run for _, runs in line.segments for run in runs)
        line.notes.append(f"only characters never seen in training ({aside!r}): nothing translated, printed as typed")
    if len(line.sources) > 1:
        n = sum(len(ids) for ids in line.sources)
        longer = (
            f"{n} subwords, more than the model's max_len={max_len}"
            if n > max_len
            else f"{len(text)} characters, longer than the sentences the model learned from ({LONG_SENTENCE})"
        )
        line.notes.append(f"{longer}; translated in {len(line.sources)} parts")
    return line


# %% [markdown]
# ## 3. Translating, many lines at once
#
# The sources go through `translate_ids` (`search.py`, section 8). The ids up
# to `eos` become text again by sentencepiece, the parts of a line joined
# with spaces and its set-aside characters after them; a line break spelt by
# byte pieces becomes a space, so the output stays one line per sentence.
#
# **n-best and scores.** With `nbest=n`, each source's `n` best hypotheses
# come with `log P(Y | X)` and their score `log P / lp(|Y|)` (search.py,
# sections 4 and 6). A line in parts has as many hypotheses as its part with
# the fewest; hypothesis `i` joins the parts' `i`-th, its log-probability and
# score their sums (the parts are searched independently). The first
# hypothesis is the one-best translation
# (`test_the_first_of_the_nbest_is_the_translation_and_scores_are_the_searchs`).


# %%
class Answer(NamedTuple):
    """One hypothesis of a line: its text, its log P(Y | X), its score log P / lp, and its word alignment (None:
    nothing searched, or not asked)."""

    text: str
    log_prob: float | None = None
    score: float | None = None
    alignment: str | None = None  # Pharaoh `i-j` word pairs, when asked for


def _text_of(tokenizer, line: Line, outputs: Iterator[list[int]]) -> str:
    """The line's answer from the output ids of its parts, in order: parts joined, set-aside characters after
    their sentence, recased to the input's style, on one line."""
    words = [
        word for parts, aside in line.segments for word in [tokenizer.decode(next(outputs)) for _ in parts] + aside
    ]
    answer = casing.restore(" ".join(w for w in words if w), line.case)
    return " ".join(answer.splitlines())  # a line break from byte pieces would shift the output


def translate_prepared(
    model: EncoderDecoder,
    tokenizer,
    lines: list[Line],
    beam_size: int = Decoding.beam,
    length_penalty: float = Decoding.length_penalty,
    max_extra: int = Decoding.max_extra,
    batch_size: int = BATCH_SIZE,
    nbest: int = 0,
    alignment_head: tuple[int, int] | None = None,
) -> list[list[Answer]]:
    """The hypotheses of each prepared line, in order: its translation alone (`nbest` 0), or its `nbest` best with
    their scores, best first, and, with an `alignment_head` (layer, head), each one's word alignment read from
    that cross-attention head."""
    sources = [ids for line in lines for ids in line.sources]
    outputs = translate_ids(
        model, sources, beam_size, length_penalty, batch_size=batch_size, max_extra=max_extra, nbest=nbest
    )
    found = iter(outputs)  # each source's ids, or (nbest) its hypotheses, best first
    answers = []
    for line in lines:
        parts = [next(found) for _ in line.sources]
        if not (nbest and parts):
            answers.append([Answer(_text_of(tokenizer, line, iter(parts)))])
            continue
        hypotheses = []
        for i in range(min(map(len, parts))):  # hypothesis i joins each part's i-th
            chosen = [hyps[i] for hyps in parts]
            ids = [h.ids for h in chosen]
            aligned = None if alignment_head is None else _aligned(model, tokenizer, line.sources, ids, alignment_head)
            log_p, score = sum(h.log_prob for h in chosen), sum(h.score for h in chosen)
            hypotheses.append(Answer(_text_of(tokenizer, line, iter(ids)), log_p, score, aligned))
        answers.append(hypotheses)
    return answers


def translate(
    model: EncoderDecoder,
    tokenizer,
    text: str,
    beam_size: int = Decoding.beam,
    length_penalty: float = Decoding.length_penalty,
    max_extra: int = Decoding.max_extra,
    case: str = "auto",
    table: dict | None = None,
) -> tuple[str, str | None]:
    """One sentence -> (translation on one line, what the input rules did, or None)."""
    line = prepare("text", text, None, tokenizer, model.config.max_len, case, table)
    answer = translate_prepared(model, tokenizer, [line], beam_size, length_penalty, max_extra)[0][0].text
    return answer, "; ".join(line.notes) or None


# %% [markdown]
# ## 4. Reading: windows of lines
#
# Sentences are read `WINDOW` lines at a time: the more lines `translate_ids`
# sorts by length, the fewer steps a batch runs for its longest sentence
# (benchmarks/README.md#levers-shared-memory-freed-memory-windows), and
# memory stays bounded by a window. A pipe may deliver its lines slowly, so a
# thread reads it into a queue, and a window is the first line to come and
# those already waiting; a terminal gets windows of one line, after
# `WAITING`; a file on a terminal's stderr gets a progress bar.


# %%
def _numbered(sentences: list[str], stdin) -> Iterator[tuple[str, str | None, str | None]]:
    """(where, text or None when too long, note) for each command-line sentence, or each line of stdin."""
    raws: Iterator[bytes | None]
    if sentences:
        # arguments undecodable in the locale arrive as surrogate escapes: same rule as stdin
        encoded = (s.encode("utf-8", errors="surrogateescape") for s in sentences)
        raws = (raw if len(raw) <= MAX_LINE_BYTES else None for raw in encoded)
    else:
        raws = bounded_lines(stdin)
    for i, raw in enumerate(raws, 1):
        where = f"{'argument' if sentences else 'line'} {i}"
        if raw is None:
            yield where, None, f"longer than {MAX_LINE_BYTES} bytes, printed an empty line"
        else:
            yield (where, *decode_line(raw))


def _is_pipe(stream) -> bool:
    try:
        return stat.S_ISFIFO(os.fstat(stream.fileno()).st_mode) or stat.S_ISSOCK(os.fstat(stream.fileno()).st_mode)
    except (AttributeError, OSError, ValueError):  # io.BytesIO and the like: read at once
        return False


def windows(items: Iterable, size: int) -> Iterator[list]:
    """Consecutive lists of at most `size` items."""
    items = iter(items)
    while window := list(itertools.islice(items, size)):
        yield window


_END = object()


def arrived_windows(items: Iterable, size: int) -> Iterator[list]:
    """Windows of at most `size` items: the next item to come, then those already read (by a thread). It waits
    back in this code every 0.2 s: a Ctrl-C while it waits is raised here (annotated/plumbing/interrupts.py
    raises only in the project's own code, which a bare `waiting.get()` would never return to)."""
    waiting: queue.Queue = queue.Queue(maxsize=size)

    def read() -> None:
        for item in itertools.chain(items, [_END]):
            waiting.put(item)

    threading.Thread(target=read, daemon=True).start()
    while True:
        window: list = []
        while not window:
            with contextlib.suppress(queue.Empty):
                window.append(waiting.get(timeout=0.2))
        with contextlib.suppress(queue.Empty):
            while window[-1] is not _END and len(window) < size:
                window.append(waiting.get_nowait())
        if window[-1] is not _END:
            yield window
            continue
        if window[:-1]:
            yield window[:-1]
        return


# %% [markdown]
# ## 5. The command line
#
# Expected failures end the process with one line on stderr and exit code 2,
# before the checkpoint is opened where the options alone or together are
# wrong (`annotated/plumbing/options.py`, `_refused`); Ctrl-C ends it with
# 130 (`annotated/plumbing/interrupts.py`); a closed output pipe
# (`... | head -1`) ends it quietly with 0. The options' help says what each
# does: an existing `--output` is kept unless `--force`, as the door keeps
# any output (`test_input_and_output_files_and_no_output_overwritten_without_force`,
# `test_input_with_sentences_or_onto_itself_is_refused`); n-best lines are
# numbered from 0, as Moses and Marian number theirs (`formatted`,
# `test_nbest_and_scores_in_text_are_numbered_lines`,
# `test_bad_new_options_exit_2_with_one_line_before_loading`,
# `test_batch_size_and_threads_reach_the_search_and_threads_are_restored`).
#
# **Word alignments.** `--alignment` reads each hypothesis' word alignment
# (`annotated/decoding/alignment.py`) from the cross-attention head
# `--alignment-head` gives, else the checkpoint's (the shipped models carry
# theirs, `test_each_shipped_model_carries_the_head_the_circuits_rule_picks`),
# else the one `make circuits` wrote beside it (`_alignment_head`); without
# one it is refused
# (`test_alignment_reads_the_head_given_or_the_checkpoints_and_is_refused_without_one`,
# `test_alignment_reads_the_head_make_circuits_wrote_beside_the_checkpoint`,
# `test_alignment_in_text_with_every_option`). A line in parts numbers each
# part's words after the parts before it (`_aligned`).


# %%
CASE_NOTES = {"upper": "in capitals", "lower": "all lower case", "inverted": "caps lock"}
WAITING = f"{NAME}: waiting for sentences, one per line (Ctrl-D to end)"


def build_parser() -> argparse.ArgumentParser:
    p = DOOR.parser(
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Translate sentences with a trained checkpoint: the arguments if given,\n"
        "else stdin, one sentence a line, one translation a line.\n\n"
        "What the models know: the shipped models (and every training preset's) learnt from\n"
        "Multi30k, about 29,000 image captions (English, with German translations). They\n"
        "translate descriptions of photos; everyday language is outside what they learnt and\n"
        "comes back as nonsense.",
        epilog=RULES,
    )
    p.add_argument("sentences", nargs="*", help="sentences to translate (default: read stdin)")
    DOOR.checkpoint_options(p, runs=True)
    Decoding.add_options(p)
    p.add_argument(
        "--case",
        choices=("auto", "as-typed"),
        default="auto",
        help="auto: a line in capitals, in lower case or caps-locked is recased before translating and "
        "answered in its style; as-typed: translated as it is (default auto)",
    )
    p.add_argument("--input", type=Path, default=None, help="read the sentences from this file (default: stdin)")
    p.add_argument("--output", type=Path, default=None, help="write the translations to this file (default: stdout)")
    DOOR.force_option(p, help="overwrite an existing --output file")
    p.add_argument(
        "--nbest",
        type=at_least(1),
        default=1,
        help="the N best hypotheses of each sentence, best first: the N best the beam finished, so N <= --beam "
        "(default 1)",
    )
    p.add_argument(
        "--scores",
        action="store_true",
        help="with each hypothesis its log-probability log P(Y|X) and the score the search ranked it by, "
        "log P / ((5 + |Y|) / 6)^alpha",
    )
    p.add_argument(
        "--format",
        choices=("text", "jsonl"),
        default="text",
        help="text: one translation a line, or with --nbest/--scores 'LINE ||| translation [||| log P ||| score]' "
        "lines (LINE counted from 0); jsonl: one JSON object per input line, its source and its hypotheses "
        "with their scores (default text)",
    )
    p.add_argument(
        "--alignment",
        action="store_true",
        help="with each hypothesis its word alignment, source-target pairs 'i-j' (words from 0, as eflomal "
        f"writes them), read from the cross-attention head that aligns best (the book's Part V: {PART_V})",
    )
    p.add_argument(
        "--alignment-head",
        type=layer_head,
        default=None,
        help="LAYER,HEAD of the cross-attention to read alignments from (default: the checkpoint's "
        "alignment_head, else the best_cross_head of the circuits.json make circuits wrote beside it)",
    )
    p.add_argument(
        "--batch-size", type=at_least(1), default=BATCH_SIZE, help=f"sentences searched together (default {BATCH_SIZE})"
    )
    p.add_argument(
        "--threads",
        type=at_least(1),
        default=None,
        help="CPU threads; on the CPU, that many batches are translated side by side (default: PyTorch's)",
    )
    p.add_argument("--device", type=device, default=None, help="cpu, cuda, cuda:1 (default: cuda if available)")
    p.add_argument(
        "--quantize",
        choices=QUANTIZATIONS,
        default=None,
        help="int8: the largest matrix products in int8 on the CPU (annotated/decoding/quantize.py says which; default: float32)",
    )
    return p


def _load(args):
    """(model on the device, tokenizer, case table or None, the model's length penalty) of the checkpoint the door
    chose; CheckpointError when it cannot translate text."""
    path = args.checkpoint
    state = read_checkpoint(path)  # once: the model, its tokenizer and its case table
    model, tokenizer, meta = loaded_from_state(state, path)
    check_tokenizer(tokenizer, path, "translate text")
    asked = direction_asked(args.src, args.tgt)
    if asked and meta.get("src_lang") and asked != f"{meta['src_lang']}-{meta.get('tgt_lang')}":
        raise CheckpointError(
            f"checkpoint {path} translates {meta['src_lang']} -> {meta.get('tgt_lang')}, not "
            f"{asked.replace('-', ' -> ')}; drop --src/--tgt or pick another --checkpoint"
        )
    if args.alignment:
        if _alignment_head(args, meta) is None:
            raise CheckpointError(
                f"checkpoint {path} names no cross-attention head to align with: run make circuits "
                f"CHECKPOINT={path} (it names the head that aligns best, beside the checkpoint), or add "
                "--alignment-head LAYER,HEAD"
            )
        layer, head = args.alignment_head
        if not (0 <= layer < len(model.decoder.layers) and 0 <= head < model.config.h):
            raise CheckpointError(
                f"--alignment-head {layer},{head}: checkpoint {path} has layers 0 to "
                f"{len(model.decoder.layers) - 1} and heads 0 to {model.config.h - 1}"
            )
    return model.to(args.device), tokenizer, case_table_in(state, path), model_length_penalty(meta)


def _input_windows(args, stdin, stderr: TextIO) -> Iterator[list]:
    """The numbered lines in windows: by WINDOW from arguments and files, as arrived from a pipe, one by one
    from a terminal (after saying that it waits)."""
    if args.sentences:
        return windows(_numbered(args.sentences, stdin), WINDOW)
    if stdin.isatty():
        print(WAITING, file=stderr, flush=True)
        return windows(_numbered([], stdin), 1)
    if _is_pipe(stdin):  # the reading thread gets its own reader: one it may still hold when the process ends
        own = open(os.dup(stdin.fileno()), "rb", buffering=MAX_LINE_BYTES + 2)  # noqa: SIM115 the thread holds it
        return arrived_windows(_numbered([], own), WINDOW)
    return windows(_numbered([], stdin), WINDOW)


def _aligned(model, tokenizer, sources: list[list[int]], outputs: list[list[int]], head: tuple[int, int]) -> str:
    """The Pharaoh pairs of a line's parts: each part's links, its words numbered after the parts before it."""
    links, before_src, before_tgt = set(), 0, 0
    for src, ys in zip(sources, outputs):
        links |= {(i + before_src, j + before_tgt) for i, j in alignment(model, tokenizer, src, ys, head)}
        before_src += _words_in(tokenizer.pieces(src))
        before_tgt += _words_in(tokenizer.pieces(ys))
    return pharaoh(links)


def _words_in(pieces: list[str]) -> int:
    return max((n for n in word_numbers(pieces) if n is not None), default=-1) + 1


def _plain(args) -> bool:
    """Whether the output is one translation a line and nothing else (the default)."""
    return args.format == "text" and args.nbest == 1 and not args.scores and not args.alignment


def _translated(model, tokenizer, lines: list[Line], args) -> list[list[Answer]]:
    """Each line's hypotheses: the one-best text alone for plain output, else with their scores."""
    decoding = (args.beam, args.length_penalty, args.max_extra, args.batch_size)
    nbest, head = (0, None) if _plain(args) else (args.nbest, args.alignment_head if args.alignment else None)
    return translate_prepared(model, tokenizer, lines, *decoding, nbest, head)


def _answer(model, tokenizer, table, window: list, args) -> tuple[list[Line], list[list[Answer]]]:
    """Prepared lines and their hypotheses; a window the decoder rejects is answered line by line."""
    prepared = [
        prepare(where, text, note, tokenizer, model.config.max_len, args.case, table) for where, text, note in window
    ]
    try:
        return prepared, _translated(model, tokenizer, prepared, args)
    except ValueError:
        pass
    answers = []
    for line in prepared:
        try:
            answers += _translated(model, tokenizer, [line], args)
        except ValueError as e:  # a clear error about this input: report it, answer empty, go on
            line.notes.append(f"error: {e}; printed an empty line")
            answers.append([Answer("")])
    return prepared, answers


def formatted(index: int, source: str, answers: list[Answer], args) -> str:
    """The output of input line `index` (from 0) with text `source`, its line end(s) included.

    >>> import argparse
    >>> args = argparse.Namespace(format="text", nbest=2, scores=True)
    >>> print(formatted(3, "Ein Hund.", [Answer("A dog.", -1.5, -0.75), Answer("Dog.", -2.0, -1.0)], args), end="")
    3 ||| A dog. ||| -1.500000 ||| -0.750000
    3 ||| Dog. ||| -2.000000 ||| -1.000000
    >>> print(formatted(0, "", [Answer("")], argparse.Namespace(format="jsonl")), end="")
    {"line": 0, "source": "", "hypotheses": [{"translation": "", "log_prob": null, "score": null}]}
    """
    if args.format == "jsonl":
        hypotheses = [{"translation": a.text, "log_prob": a.log_prob, "score": a.score} for a in answers]
        if getattr(args, "alignment", False):
            for hypothesis, a in zip(hypotheses, answers):
                hypothesis["alignment"] = a.alignment
        return json.dumps({"line": index, "source": source, "hypotheses": hypotheses}, ensure_ascii=False) + "\n"
    if _plain(args):
        return answers[0].text + "\n"
    number = lambda x: "-" if x is None else f"{x:.6f}"
    scores = lambda a: f" ||| {number(a.log_prob)} ||| {number(a.score)}" if args.scores else ""
    aligned = lambda a: f" ||| {a.alignment or ''}" if getattr(args, "alignment", False) else ""
    return "".join(f"{index} ||| {a.text}{scores(a)}{aligned(a)}\n" for a in answers)


def main(argv: list[str] | None = None, stdin=None, stdout=None, stderr: TextIO | None = None) -> int:
    """Run the translator; `stdin`/`stdout` are binary streams (default: the process's)."""
    stderr = sys.stderr if stderr is None else stderr
    door = replace(DOOR, stderr=stderr)
    try:  # --help (0), or a refusal: one line on stderr (2)
        args = build_parser().parse_args(argv)
        args.device = default_device(args.device)
        if args.quantize and args.device.type != "cpu":
            door.fail(f"--quantize {args.quantize} runs on the CPU only: add --device cpu")
        refused = _refused(args)
        if refused:
            door.fail(refused)
        door.keep(args, [args.output], elsewhere=f"{DOOR.typed('--output', 'NEW')} to write elsewhere")
        if args.device.type == "cpu":
            keep_freed_memory()  # a beam step's large tensors reuse the previous step's memory (plumbing/allocator.py)
        door.checkpoint(args)
        try:
            model, tokenizer, table, alpha = _load(args)
            if args.quantize:
                model = quantize_int8(model)
        except (CheckpointError, ValueError) as e:
            door.fail(str(e))
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    stdin = sys.stdin.buffer if stdin is None else stdin
    stdout = sys.stdout.buffer if stdout is None else stdout
    if args.length_penalty is None:  # the model's own, unless the user gave one
        args.length_penalty = alpha
    with contextlib.ExitStack() as files:
        if args.threads:
            files.callback(torch.set_num_threads, torch.get_num_threads())  # as it was, after
            torch.set_num_threads(args.threads)
        if args.input is not None:
            stdin = files.enter_context(open(args.input, "rb"))
        if args.output is not None:
            stdout = files.enter_context(open(args.output, "wb"))
        return _serve(model, tokenizer, table, args, stdin, stdout, stderr)


def layer_head(text: str) -> tuple[int, int]:
    """`--alignment-head` "1,2" -> (1, 2).

    >>> layer_head("1,2")
    (1, 2)
    """
    try:
        layer, head = (int(n) for n in text.split(","))
        if layer < 0 or head < 0:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"write LAYER,HEAD, two whole numbers >= 0, e.g. 1,2; got {text!r}") from None
    return layer, head


def _alignment_head(args, meta: dict) -> tuple[int, int] | None:
    """The head --alignment reads, also set as `args.alignment_head`: --alignment-head, else the checkpoint's
    `alignment_head`, else the best_cross_head of the circuits.json `make circuits` wrote beside this checkpoint
    after it was saved; None when there is none."""
    found = args.alignment_head or meta.get("alignment_head")
    report = Path(args.checkpoint).resolve().parent / "circuits.json"  # where make circuits writes, but for the box
    try:
        if found is None and report.stat().st_mtime >= Path(args.checkpoint).stat().st_mtime:
            read = json.loads(report.read_text(encoding="utf-8"))
            if Path(read["checkpoint"]).name == Path(args.checkpoint).name:
                found = (read["best_cross_head"] or [None])[1:]  # ["cross", layer, head], None without the aligner
    except (OSError, ValueError, KeyError, TypeError):  # no report, or not one make circuits wrote
        pass
    args.alignment_head = (int(found[0]), int(found[1])) if found else None
    return args.alignment_head


def _refused(args) -> str | None:
    """What is wrong with the options together, said as the fix; None when nothing is."""
    if args.nbest > args.beam:
        return (
            f"--nbest {args.nbest} is more than --beam {args.beam}: the n best come from the beam's finished "
            f"hypotheses; add --beam {args.nbest}, or ask for --nbest {args.beam} or fewer"
        )
    if args.input is not None and args.sentences:
        return "sentences given both as arguments and by --input: drop one of them"
    if args.input is not None and not args.input.is_file():
        return f"--input {args.input}: no such file; name a file of sentences, one a line"
    if args.output is not None and args.output.is_dir():
        return f"--output {args.output} is a folder: name a file, e.g. --output {args.output / 'translations.txt'}"
    if args.input is not None and args.output is not None and args.output.resolve() == args.input.resolve():
        return f"--output {args.output} is the --input file: name another one"
    return None


def _serve(model, tokenizer, table, args, stdin, stdout, stderr: TextIO) -> int:
    """Translate every window of input to `stdout`, notes to `stderr`: the exit code."""
    bar = None
    if not args.sentences and not stdin.isatty() and stderr.isatty():
        from tqdm.auto import tqdm

        bar = tqdm(unit=" sentences", desc=NAME, file=stderr, leave=False)
    try:
        index = 0
        for window in _input_windows(args, stdin, stderr):
            prepared, answers = _answer(model, tokenizer, table, window, args)
            for (_, text, _), line, answer in zip(window, prepared, answers):
                for note in line.notes:  # above the bar, where there is one
                    (bar.write if bar is not None else print)(f"{line.where}: {note}", file=stderr)
                stdout.write(formatted(index, text or "", answer, args).encode("utf-8"))
                index += 1
            stdout.flush()
            if bar is not None:
                bar.update(len(window))
    except BrokenPipeError:  # the reader went away (`| head -1`): stop quietly
        if stdout is getattr(sys.stdout, "buffer", None):  # and keep Python's exit-time flush quiet
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    finally:
        if bar is not None:
            bar.close()
    return 0


if __name__ == "__main__":
    from annotated.plumbing.scripts import run_main

    run_main(main)
