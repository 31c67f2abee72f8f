"""Command-line options checked at the door: one rule per kind of value, one line per mistake.

The translator, `python -m annotated.attention.dump` and the docs build parse their options with
`Parser`: a wrong option prints one line, `<prog>: error: <what is wrong and what is allowed>`, on stderr and
exits with status 2 before any data or model work, never a traceback and never a silent fallback (a beam of 0
is not "greedy", a negative count is not "all"). The value checkers are argparse `type=` functions.

>>> p = Parser(prog="demo")
>>> _ = p.add_argument("--beam", type=at_least(1))
>>> p.parse_args(["--beam", "4"]).beam
4
>>> at_least(1)("0")
Traceback (most recent call last):
...
argparse.ArgumentTypeError: must be a whole number >= 1, got '0'
>>> number(0, None)("nan")
Traceback (most recent call last):
...
argparse.ArgumentTypeError: must be a finite number >= 0, got 'nan'
>>> device("tpu")
Traceback (most recent call last):
...
argparse.ArgumentTypeError: must be cpu, cuda or cuda:N (cuda only where CUDA is available), got 'tpu'
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from annotated.plumbing.scripts import name_of, usage_of


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr (no usage block), exit code 2.

    `name` starts the line (default: `prog`), so that every error of one command reads alike. A command passes
    `command=__file__`: its name and its usage line then come from `annotated/plumbing/scripts.py`, where each
    command is named once."""

    def __init__(self, *args, name: str | None = None, command: str | Path | None = None, **kwargs):
        if command is not None:
            kwargs.setdefault("prog", usage_of(command))
            name = name or name_of(command)
        super().__init__(*args, **kwargs)
        self.name = name or self.prog

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.name}: error: {message}\n")


def at_least(low: int) -> Callable[[str], int]:
    """A whole number >= `low`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {low}, got {text!r}")
        return value

    return parse


def comma_list(item: Callable[[str], object]) -> Callable[[str], list]:
    """Values separated by commas, each checked by `item`; an error names the entry that is wrong.

    >>> comma_list(at_least(1))("4,16, 256")
    [4, 16, 256]
    >>> comma_list(at_least(1))("4,0")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: entry '0' of '4,0' must be a whole number >= 1, got '0'
    """

    def parse(text: str) -> list:
        entries = [e.strip() for e in text.split(",")]
        if not all(entries):
            raise argparse.ArgumentTypeError(f"must be entries separated by commas, none empty, got {text!r}")
        values = []
        for e in entries:
            try:
                values.append(item(e))
            except argparse.ArgumentTypeError as error:
                raise argparse.ArgumentTypeError(f"entry {e!r} of {text!r} {error}") from None
        return values

    return parse


def number(low: float | None, high: float | None, *, above: bool = False) -> Callable[[str], float]:
    """A finite number in [low, high] (either end may be None: open); `above=True` excludes `low` itself.

    >>> number(0, None, above=True)("0")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: must be a finite number > 0, got '0'
    """

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        too_low = low is not None and (value <= low if above else value < low)
        if not math.isfinite(value) or too_low or (high is not None and value > high):
            bounds = [f"{'>' if above else '>='} {low:g}"] if low is not None else []
            bounds += [f"<= {high:g}"] if high is not None else []
            raise argparse.ArgumentTypeError(
                f"must be a finite number {' and '.join(bounds)}".rstrip() + f", got {text!r}"
            )
        return value

    return parse


def device(text: str) -> str:
    """cpu, cuda or cuda:N, where that device exists here (torch is imported only for cuda)."""
    match = re.fullmatch(r"cpu|cuda(?::(\d+))?", text)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"must be cpu, cuda or cuda:N (cuda only where CUDA is available), got {text!r}"
        )
    if text.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{text!r} asked for, but CUDA is not available here; use cpu")
        if match.group(1) is not None and int(match.group(1)) >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(
                f"{text!r} asked for, but there are {torch.cuda.device_count()} CUDA devices here"
            )
    return text


def writable_dir(text: str) -> Path:
    """A folder that exists and can be written, or can be created (its nearest existing parent is writable)."""
    path = Path(text).expanduser()
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: {probe} is not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text!r}: {probe} is not writable; choose another folder")
    return path
