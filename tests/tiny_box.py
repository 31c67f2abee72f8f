"""Tiny finished runs and a box packed from them, for the tests of annotated/shipped/.

The model is untrained (its translations are nonsense); what the tests check is the packing, the checks on load
and which model a command takes, none of which depends on the model having learnt anything.
"""

import dataclasses
import json
from pathlib import Path

from tiny import tiny_translator

from annotated.checkpoint import save_checkpoint
from annotated.plumbing.provenance import environment
from annotated.training.config import PRESETS, config_dict
from annotated.training.pack import pack

GERMAN = ["Ein Hund rennt über die Wiese.", "Zwei Männer spielen Fußball im Park.", "Eine Frau liest ein Buch."]
ENGLISH = ["A dog runs across the meadow.", "Two men play football in the park.", "A woman reads a book."]
PAIRS = {"de-en": list(zip(GERMAN, ENGLISH)) * 2, "en-de": list(zip(ENGLISH, GERMAN)) * 2}


def make_run(folder: Path, direction: str = "de-en", seed: int = 0) -> Path:
    """A finished run of the smoke preset's settings: best.pt (a tiny untrained model, its tokenizer, a case
    table, training state), config.json and results.json."""
    src, tgt = direction.split("-")
    folder.mkdir(parents=True)
    model, tok = tiny_translator((GERMAN + ENGLISH) * 4, 320, folder / "cache", seed=seed, max_len=24)
    settings = config_dict(dataclasses.replace(PRESETS["smoke"], src_lang=src, tgt_lang=tgt, seed=seed))
    meta = {
        "src_lang": src,
        "tgt_lang": tgt,
        "train_config": settings,
        "epoch": 2,
        "step": 28,
        "averaged": [str(folder / "epoch1.pt"), str(folder / "epoch2.pt")],
    }
    save_checkpoint(
        folder / "best.pt",
        model,
        tok,
        meta,
        casing={"hund": "Hund", "dog": "dog"},
        optimizer={"state": {}},
        run_state={"step": 28},
    )
    (folder / "config.json").write_text(json.dumps(settings))
    beam = {"bleu": 1.5, "bleu_lowercase": 2.5, "chrf": 3.5, "beam_size": 2, "sentences": 20}
    results = {
        "train_config": settings,
        "precision": "fp32",
        "precision_reason": "fp32 asked for",
        "threads": 1,
        "steps": 28,
        "train_s": 3.0,
        "device": "cpu",
        "test_set": "test_2016_flickr",
        "test": {"best": {"checkpoint": str(folder / "best.pt"), "beam": beam}},
        "environment": environment(),
    }
    (folder / "results.json").write_text(json.dumps(results))
    return folder


def make_box(folder: Path) -> Path:
    """A box holding de-en and en-de, packed from tiny runs."""
    for direction in PAIRS:
        pack(
            make_run(folder / "runs" / direction, direction),
            folder / "box",
            pairs=PAIRS[direction],
            say=lambda line: None,
        )
    return folder / "box"
