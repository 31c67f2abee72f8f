# %% [markdown]
# # A length penalty for an older checkpoint
#
# A run that chose its length penalty on validation
# (`annotated/training/results.py`) stores it in its checkpoints' meta; a
# checkpoint trained with a fixed alpha (the `gpu` preset's 0.6) names none.
# This command makes the run's choice for it (`choose_length_penalty` of
# `annotated/training/evaluate.py`, on Multi30k's validation split in the
# checkpoint's languages) and writes a copy of the checkpoint with the winner
# in its meta, never overwriting a file without `--force`
# (`tests/training/test_length_penalty.py`).
#
# ```sh
# python -m annotated.training.choose_length_penalty --checkpoint runs/<run>/averaged.pt --out runs/<run>/averaged-lp.pt
# ```

# %%
from __future__ import annotations

import sys
from pathlib import Path

from annotated.checkpoint import CheckpointError, languages_of, load_checkpoint, with_meta
from annotated.decoding.settings import Decoding
from annotated.door import Door
from annotated.training.data import DataError, load_multi30k
from annotated.training.evaluate import LENGTH_PENALTIES, choose_length_penalty

DOOR = Door(__file__)


def main(argv=None) -> int:
    p = DOOR.parser(
        description="Write a copy of a checkpoint with the beam search's length penalty (GNMT "
        "alpha) that gives the best BLEU on Multi30k's validation split, of "
        f"{', '.join(f'{a:g}' for a in LENGTH_PENALTIES)}.",
    )
    DOOR.checkpoint_options(p, languages=False, required=True, help="the checkpoint to read (left unchanged)")
    DOOR.output_options(
        p, type=Path, help="the new checkpoint file (with --force it may be --checkpoint)", required=True
    )
    Decoding.add_options(p, "beam", beam_help="beam width of the choice, the translator's")
    p.add_argument("--data-url", help="base URL of the Multi30k files (default $MULTI30K_URL, else GitHub)")
    args = p.parse_args(argv)
    DOOR.keep(args, [args.out], elsewhere="name a new file")
    try:
        model, tokenizer, meta = load_checkpoint(DOOR.checkpoint(args))
        val = load_multi30k("val", *languages_of(meta), base_url=args.data_url)
    except (CheckpointError, DataError) as e:
        DOOR.fail(str(e))
    alpha, bleu = choose_length_penalty(model, tokenizer, val, args.beam, progress=sys.stderr.isatty())
    with_meta(args.checkpoint, args.out, length_penalty=alpha)
    table = ", ".join(f"{a:g}: {b:.2f}" for a, b in bleu.items())
    print(
        f"{args.out}: {args.checkpoint} with length penalty {alpha:g}, the best beam {args.beam} BLEU on the "
        f"{len(val)} Multi30k validation sentences ({table})"
    )
    return 0


if __name__ == "__main__":
    from annotated.plumbing.scripts import run_main

    run_main(main)
