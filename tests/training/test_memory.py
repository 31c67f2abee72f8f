"""annotated/training/memory.py: a run writes down its memory where each phase ends, and a short run's resident
memory stays flat from its second epoch to its last.

The run trains in a process of its own (the smoke preset, five epochs of 14 steps, one thread), so that what
the test process loaded before cannot weigh on the figures; both figures of the ratio come from that one
process."""

import json
import subprocess
import sys

import pytest

EPOCHS = 5
RUN = """
import dataclasses, sys, torch
from pathlib import Path
from annotated.training import train
torch.set_num_threads(1)
cfg = dataclasses.replace(train.PRESETS["smoke"], max_steps=14 * int(sys.argv[4]), val_bleu_sentences=8,
                          test_sentences=8)
train.train(cfg, Path(sys.argv[1]), data_url=sys.argv[2], cache_dir=Path(sys.argv[3]), progress=False,
            log=lambda line: None)
"""


@pytest.fixture(scope="module")
def memory_rows(tmp_path_factory, data_url, cache) -> list[dict]:
    run = tmp_path_factory.mktemp("memory") / "run"
    subprocess.run([sys.executable, "-c", RUN, str(run), data_url, str(cache), str(EPOCHS)], check=True)
    return json.loads((run / "results.json").read_text())["memory"]


def test_every_phase_of_a_run_has_a_memory_row(memory_rows):
    """One row where the data is loaded, two per epoch (its steps, its validation), then the end's phases; each
    with the resident memory, the peak so far (never below it) and malloc's bytes (glibc)."""
    phases = [r["phase"] for r in memory_rows]
    end = ["averaging", "length_penalty", "test_best_greedy", "test_best_beam"]
    assert phases == ["data"] + ["training", "validation"] * EPOCHS + end, phases
    for r in memory_rows:
        # (+1: the kernel's counts behind the two figures are synchronised lazily, and each is rounded to a MiB)
        assert 0 < r["resident_mb"] <= r["peak_mb"] + 1 and 0 < r["released_mb"] <= r["peak_mb"] + 1, r


def test_resident_memory_does_not_grow_from_the_second_epoch_to_the_last(memory_rows):
    """Where the last epoch's steps end, the process holds at most 3% more than where the second's ended,
    before and after freed memory is handed back. The margin: on a footprint of about 350 MB the smoke run's
    figures stayed within 1 MB of each other from the second epoch to the last (about 0.3%); keeping one
    step's logits per step (0.8 MB each, 42 steps between the two figures) grows it by 54%, and keeping one
    step's loss with its graph by 5%: both fail here."""
    training = [r for r in memory_rows if r["phase"] == "training"]
    second, last = training[1], training[-1]
    for key in ("resident_mb", "released_mb"):
        assert last[key] <= 1.03 * second[key], (key, [r[key] for r in training])
