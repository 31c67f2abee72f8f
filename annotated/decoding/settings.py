"""How a translation is searched for, written once: `Decoding`, the value every command, `translate_ids`' defaults,
the shipped models' cards and the export's `generation_config.json` read.

The three settings' defaults are written here only. A command adds the options it offers with `add_options`
(`--beam`, `--length-penalty`, `--max-extra`); an unset `--length-penalty` is the model's own
(`model_length_penalty`).

>>> Decoding(), model_length_penalty({})
(Decoding(beam=4, length_penalty=0.6, max_extra=50), 0.6)
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from annotated.checkpoint import CheckpointError
from annotated.plumbing.options import at_least, number


@dataclass(frozen=True)
class Decoding:
    """The search's settings: beam width, GNMT length penalty (alpha), and how far an output may outrun its
    source."""

    beam: int = 4  # the beam search's width (annotated/decoding/search.py); 1 is greedy decoding
    length_penalty: float = 0.6  # GNMT's alpha, score = log P / ((5 + |Y|) / 6)^alpha: the paper's (section 6.1)
    max_extra: int = 50  # an output runs at most this many subwords past its source (the paper's 6.1), within max_len

    @staticmethod
    def add_options(p: argparse.ArgumentParser, *options: str, purpose: str = "", beam_help: str = "") -> None:
        """`--beam`, `--length-penalty`, `--max-extra` (those of `options`: "beam", "length_penalty",
        "max_extra"; default all three) on the parser `p`; `purpose` ends each help ("with --prune: ...")."""
        options = options or ("beam", "length_penalty", "max_extra")
        prefix = f"{purpose}: " if purpose else ""
        if "beam" in options:
            p.add_argument(
                "--beam",
                type=at_least(1),
                default=Decoding.beam,
                help=f"{prefix}{beam_help or 'beam width; 1 = greedy'} (default {Decoding.beam})",
            )
        if "length_penalty" in options:
            p.add_argument(
                "--length-penalty",
                type=number(0, None),
                default=None,
                help=f"{prefix}GNMT alpha: score = log P / ((5 + |Y|) / 6)^alpha (default: the alpha the model's "
                f"run chose on validation data, else the paper's {Decoding.length_penalty})",
            )
        if "max_extra" in options:
            p.add_argument(
                "--max-extra",
                type=at_least(0),
                default=Decoding.max_extra,
                help=f"{prefix}output at most source length + this many subwords, capped at max_len "
                f"(default {Decoding.max_extra})",
            )


PAPER_LENGTH_PENALTY = Decoding.length_penalty  # the paper's alpha (section 6.1), tuned on WMT for its big models


def model_length_penalty(meta: dict) -> float:
    """The beam search's length penalty (GNMT alpha) a checkpoint was scored with: the one its run chose on
    validation data (meta `length_penalty`), else the paper's.

    >>> model_length_penalty({"length_penalty": 4.0})
    4.0
    """
    alpha = meta.get("length_penalty")
    if alpha is None:
        return PAPER_LENGTH_PENALTY
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha < float("inf"):
        raise CheckpointError(f"the checkpoint's length_penalty must be a finite number >= 0, got {alpha!r}")
    return float(alpha)
