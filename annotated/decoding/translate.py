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
# # The translator: a checkpoint, a sentence in, a sentence out
#
# ```sh
# python -m annotated.decoding.translate --checkpoint runs/<run>/best.pt "Ein Hund rennt über die Wiese."
# echo "Zwei Männer spielen Fußball." | python -m annotated.decoding.translate   # the latest run's best.pt
# make translate TEXT="Ein Hund rennt über die Wiese."
# ```
#
# With sentences on the command line it translates each and prints one line
# per sentence. Without, it reads standard input, one sentence a line, and
# prints one translation a line, flushed at once, so it can sit at the end of
# a pipe or serve another program line by line. Output line `i` always
# answers input line `i`: a bad line gets an (empty) answer too, and the
# reason goes to standard error.
#
# Everything the model needs comes from the checkpoint (see
# `annotated/plumbing/checkpoint.py`): the config, the parameters, and the
# sentencepiece model the training data was cut with, so the translator
# splits words into exactly the subwords the model knows.

# %%
from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Iterable, Iterator, Optional, TextIO


from annotated.plumbing.interrupts import quiet_ctrl_c_while_starting, still_starting

if __name__ == "__main__":  # as a command; `main()` hands Ctrl-C back to Python once the model is loaded
    quiet_ctrl_c_while_starting(None)  # Ctrl-C while torch and the model load: exit 130, stderr stays empty

import torch

from annotated.plumbing.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint
from annotated.decoding.search import translate_ids
from annotated.plumbing.options import Parser, at_least, device, number
from annotated.transformer import EncoderDecoder

# %% [markdown]
# ## 1. Which checkpoint
#
# `--checkpoint PATH`, or else the best checkpoint of the latest training
# run, found by `latest_checkpoint` (`annotated/plumbing/checkpoint.py`, section
# "Which checkpoint"): `runs/latest/best.pt`, else the most recently written
# `runs/*/best.pt`, else an error that says how to get one.

# %% [markdown]
# ## 2. From text to subword ids, and the input rules
#
# A line of text becomes the model's source by sentencepiece alone: no `bos`,
# no `eos`, exactly as training and evaluation encode sources. Some input
# cannot be used as it stands; each case has one rule, and the process goes
# on with the next line:
#
# | input | what happens |
# | --- | --- |
# | empty, or only whitespace | an empty output line; on stderr `line N: empty input, printed an empty line` |
# | longer than `MAX_LINE_BYTES` (64 KiB) | an empty output line; on stderr `line N: longer than 65536 bytes, printed an empty line` |
# | more subwords than the model's `max_len` | the first `max_len` subwords are translated; on stderr `line N: K subwords, more than the model's max_len=M; translated the first M` |
# | characters never seen in training | spelled as UTF-8 byte pieces by the tokenizer's byte fallback (`annotated/training/data.py`); translated as usual |
# | bytes that are not UTF-8 (stdin) | each undecodable byte becomes U+FFFD, itself an unseen character; on stderr `line N: not valid UTF-8, undecodable bytes replaced by U+FFFD` |
# | anything else the decoder rejects with a `ValueError` | an empty output line; on stderr `line N: error: ...` |
#
# Standard input is read as bytes and decoded line by line for this reason:
# a text-mode `sys.stdin` would raise on the first bad byte and end the
# process, losing every later line. It is read at most `MAX_LINE_BYTES + 2`
# bytes at a time, so a line of 50 MB costs no more memory than a short one:
# the rest of a line that long is read and dropped in pieces of that size
# (`test_a_huge_line_is_never_held_in_memory`). No sentence comes near the
# limit: the models' `max_len` subwords are a few hundred words. Lines are
# counted from 1; a sentence on the command line is "argument N".

# %%
MAX_LINE_BYTES = 1 << 16


def read_lines(stream, limit: int = MAX_LINE_BYTES) -> Iterator[Optional[bytes]]:
    """Each line of a binary stream without its line end, or None for a line longer than `limit` bytes.

    >>> import io
    >>> list(read_lines(io.BytesIO(b"short\\r\\n" + b"x" * 9 + b"\\nlast"), limit=8))
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


def decode_line(raw: bytes) -> tuple[str, Optional[str]]:
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


def source_ids(text: str, tokenizer, max_len: int) -> tuple[list[int], Optional[str]]:
    """Subword ids of one sentence, cut to `max_len`, and a note saying what a rule did (or None)."""
    if not text.strip():
        return [], "empty input, printed an empty line"
    ids = tokenizer.encode(text)
    if not ids:
        return [], "no subwords after tokenisation, printed an empty line"
    if len(ids) > max_len:
        return ids[:max_len], (f"{len(ids)} subwords, more than the model's max_len={max_len}; "
                               f"translated the first {max_len}")
    return ids, None


# %% [markdown]
# ## 3. One sentence
#
# The source goes through `beam_search` (or `greedy` for `--beam 1`, which is
# the same search, faster; see `annotated/decoding/search.py`). The output may be
# at most `min(max_len, S + max_extra)` subwords for a source of `S`
# subwords: the Transformer paper's "input length + 50" (section 6.1),
# capped by the model's positional table. The ids up to `eos` are turned
# back into text by sentencepiece. The output must stay one line per
# sentence, but byte pieces can spell any character, a line break included:
# each line break in a translation becomes a space.

# %%
def translate(model: EncoderDecoder, tokenizer, text: str, beam_size: int = 4, length_penalty: float = 0.6,
              max_extra: int = 50) -> tuple[str, Optional[str]]:
    """One sentence -> (translation on one line, note from the input rules or None)."""
    ids, note = source_ids(text, tokenizer, model.config.max_len)
    if not ids:
        return "", note
    translation = tokenizer.decode(translate_ids(model, [ids], beam_size, length_penalty, max_extra=max_extra)[0])
    return " ".join(translation.splitlines()), note  # a line break from byte pieces would shift the output


# %% [markdown]
# ## 4. The command line
#
# Expected failures end the process with one line on stderr and exit code 2,
# without a traceback: a missing, corrupt or incompatible checkpoint (the
# message names the file), a checkpoint without a tokenizer, or an option
# that makes no sense (`--beam 0`, a negative or non-finite
# `--length-penalty`, `--device tpu`, `--device cuda` without CUDA), which is
# refused by `annotated/plumbing/options.py` before the checkpoint is even opened.
# Ctrl-C ends it quietly with exit code 130, also while torch and the model
# are still loading; a closed output pipe (`... | head -1`) ends it with 0.

# %%
RULES = """\
input rules (each bad line still gets one output line, and the next line is served):
  empty or whitespace-only line  -> prints an empty line; message on stderr
  line longer than 65536 bytes   -> prints an empty line; message on stderr (memory stays flat)
  more subwords than max_len     -> translates the first max_len subwords; warning on stderr
                                    naming the line and both lengths
  characters unseen in training  -> spelled as byte pieces by the tokenizer; translated as usual
  non-UTF-8 bytes on stdin       -> replaced by U+FFFD; warning on stderr naming the line
  any other error for one line   -> prints an empty line; the error on stderr
output length: at most min(max_len, source subwords + --max-extra) subwords.
checkpoint missing, corrupt or incompatible, or a bad option: one line on stderr, exit code 2.
"""


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m annotated.decoding.translate", name="translate", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Translate sentences with a trained checkpoint: the arguments if given, "
                    "else stdin, one sentence a line, one translation a line.",
        epilog=RULES)
    p.add_argument("sentences", nargs="*", help="sentences to translate (default: read stdin)")
    p.add_argument("--checkpoint", type=Path, default=None,
                   help="checkpoint file (default: runs/latest/best.pt, else the newest runs/*/best.pt)")
    p.add_argument("--runs-dir", type=Path, default=Path("runs"), help="where to look without --checkpoint")
    p.add_argument("--beam", type=at_least(1), default=4, help="beam width; 1 = greedy (default 4)")
    p.add_argument("--length-penalty", type=number(0, None), default=0.6,
                   help="GNMT alpha: score = log P / ((5 + |Y|) / 6)^alpha (default 0.6)")
    p.add_argument("--max-extra", type=at_least(0), default=50,
                   help="output at most source length + this many subwords, capped at max_len (default 50)")
    p.add_argument("--device", type=device, default=None, help="cpu, cuda, cuda:1 (default: cuda if available)")
    return p


def _say(stream: TextIO, message: str) -> None:
    print(message, file=stream, flush=True)


def _lines(sentences: list[str], stdin) -> Iterable[tuple[str, Optional[str], Optional[str]]]:
    """(where, text or None when too long, note) for each command-line sentence, or each line of stdin."""
    if sentences:
        # arguments undecodable in the locale arrive as surrogate escapes: same rule as stdin
        raws = (s.encode("utf-8", errors="surrogateescape") for s in sentences)
        raws = (raw if len(raw) <= MAX_LINE_BYTES else None for raw in raws)
    else:
        raws = read_lines(stdin)
    for i, raw in enumerate(raws, 1):
        where = f"{'argument' if sentences else 'line'} {i}"
        if raw is None:
            yield where, None, f"longer than {MAX_LINE_BYTES} bytes, printed an empty line"
        else:
            yield (where, *decode_line(raw))


def main(argv: Optional[list[str]] = None, stdin=None, stdout=None, stderr: Optional[TextIO] = None) -> int:
    """Run the translator; `stdin`/`stdout` are binary streams (default: the process's)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or a bad option (2, its one line already on stderr)
        return e.code
    stdin = sys.stdin.buffer if stdin is None else stdin
    stdout = sys.stdout.buffer if stdout is None else stdout
    stderr = sys.stderr if stderr is None else stderr
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        path = args.checkpoint if args.checkpoint is not None else latest_checkpoint(args.runs_dir)
        if args.checkpoint is None:
            _say(stderr, f"translate: using {path}")
        model, tokenizer, _ = load_checkpoint(path)
        if tokenizer is None:
            raise CheckpointError(f"checkpoint {path} holds no tokenizer, so it cannot translate text")
    except CheckpointError as e:
        _say(stderr, f"translate: error: {e}")
        return 2
    model = model.to(args.device)
    if still_starting():  # loaded: now Ctrl-C ends the loop below, exit 130
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        for where, text, note in _lines(args.sentences, stdin):
            if note:
                _say(stderr, f"{where}: {note}")
            try:
                translation, rule = ("", None) if text is None else translate(
                    model, tokenizer, text, args.beam, args.length_penalty, args.max_extra)
            except ValueError as e:  # a clear error about this input: report it, answer empty, go on
                translation, rule = "", f"error: {e}; printed an empty line"
            if rule:
                _say(stderr, f"{where}: {rule}")
            stdout.write((translation + "\n").encode("utf-8"))
            stdout.flush()
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (`| head -1`): stop quietly
        if stdout is getattr(sys.stdout, "buffer", None):  # and keep Python's exit-time flush quiet
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
