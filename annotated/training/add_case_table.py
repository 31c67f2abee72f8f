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

from annotated.checkpoint import CheckpointError, add_case_table, languages_of, read_checkpoint
from annotated.decoding.casing import case_table
from annotated.door import Door
from annotated.training.data import load_multi30k


def main(argv=None) -> int:
    door = Door(__file__)
    p = door.parser(
        description="Write a copy of a checkpoint with the case table of its Multi30k "
        "training data (for checkpoints trained without one).",
    )
    door.checkpoint_options(p, languages=False, required=True, help="the checkpoint to read (left unchanged)")
    door.output_options(p, type=Path, help="the new checkpoint file (must not exist)", force=False, required=True)
    args = p.parse_args(argv)
    door.keep(args, [args.out], flag="", elsewhere="name a new file")
    try:
        src, tgt = languages_of(read_checkpoint(door.checkpoint(args)).get("meta", {}))
    except CheckpointError as e:
        door.fail(str(e))
    pairs = load_multi30k("train", src, tgt)
    add_case_table(args.checkpoint, args.out, case_table(s for s, _ in pairs))
    print(f"{args.out}: {args.checkpoint} with the case table of Multi30k train.{src}")
    return 0


if __name__ == "__main__":
    from annotated.plumbing.scripts import run_main

    run_main(main)
