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
# # A case table for an older checkpoint
#
# A checkpoint trained before training stored the case table of
# `annotated/decoding/casing.py` has none; this command writes a copy with
# the table of its training data (Multi30k's `train` split in its source
# language, as its settings name it) to a new file: it never changes the
# checkpoint it reads (`tests/training/test_add_case_table.py`).

# %%
from __future__ import annotations

from pathlib import Path

from annotated.checkpoint import CheckpointError, add_case_table, read_checkpoint
from annotated.decoding.casing import case_table
from annotated.plumbing.options import Parser
from annotated.training.data import load_multi30k


def main(argv=None) -> int:
    p = Parser(
        command=__file__,
        description="Write a copy of a checkpoint with the case table of its Multi30k "
        "training data (for checkpoints trained without one).",
    )
    p.add_argument("--checkpoint", type=Path, required=True, help="the checkpoint to read (left unchanged)")
    p.add_argument("--out", type=Path, required=True, help="the new checkpoint file (must not exist)")
    args = p.parse_args(argv)
    if args.out.exists():
        p.error(f"--out {args.out} exists; name a new file (nothing is overwritten)")
    try:
        meta = read_checkpoint(args.checkpoint).get("meta", {})
    except CheckpointError as e:
        p.error(str(e))
    if "src_lang" not in meta or "tgt_lang" not in meta:
        p.error(f"{args.checkpoint} names no src_lang/tgt_lang; its training data is unknown")
    pairs = load_multi30k("train", meta["src_lang"], meta["tgt_lang"])
    add_case_table(args.checkpoint, args.out, case_table(s for s, _ in pairs))
    print(f"{args.out}: {args.checkpoint} with the case table of Multi30k train.{meta['src_lang']}")
    return 0


if __name__ == "__main__":
    from annotated.plumbing.scripts import run_main

    run_main(main)
