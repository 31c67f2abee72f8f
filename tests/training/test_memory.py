"""annotated/training/memory.py: a run writes down its memory where each phase ends, and a short run's resident
memory stays flat from its second epoch to its last.

The run trains in a process of its own (the smoke preset, five epochs of 14 steps, one thread), so that what
the test process loaded before cannot weigh on the figures; both figures of the ratio come from that one
process. The growth test runs in fp32 and in bf16 autocast (bf16's matrix products go through oneDNN, fp32's
through MKL). Where the CPU has no bf16 instructions the run is told bf16 all the same (`resolve_precision`
refuses it there only because it is slow): PyTorch emulates the bf16 products through the same oneDNN calls.
The smoke model is too small to show the growth a cut run of the cpu preset shows in bf16
(benchmarks/README.md, "bf16 autocast on the CPU: memory grows over the epochs, fp32's does not"); the
test guards against what a step keeps."""

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
precision = sys.argv[5]
train.resolve_precision = lambda requested, device: (precision, "the test's")  # bf16 even where it is emulated
cfg = dataclasses.replace(train.PRESETS["smoke"], max_steps=14 * int(sys.argv[4]), val_bleu_sentences=8,
                          test_sentences=8, precision=precision)
train.train(cfg, Path(sys.argv[1]), source=train.DataSource(sys.argv[2], Path(sys.argv[3])), progress=False,
            log=lambda line: None)
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_url, cache):
    """precision -> the memory rows of its run, each run once for the module."""
    rows: dict[str, list[dict]] = {}

    def memory_rows(precision: str) -> list[dict]:
        if precision not in rows:
            run = tmp_path_factory.mktemp("memory") / precision
            argv = [sys.executable, "-c", RUN, str(run), data_url, str(cache), str(EPOCHS), precision]
            subprocess.run(argv, check=True)
            rows[precision] = json.loads((run / "results.json").read_text())["memory"]
        return rows[precision]

    return memory_rows


@pytest.fixture
def memory_rows(runs) -> list[dict]:
    return runs("fp32")


def test_every_phase_of_a_run_has_a_memory_row(memory_rows):
    """One row where the data is loaded, two per epoch (its steps, its validation), then the end's phases; each
    with the resident memory, the peak so far (never below it) and malloc's bytes (glibc)."""
    phases = [r["phase"] for r in memory_rows]
    end = ["averaging", "length_penalty", "test_best_greedy", "test_best_beam"]
    assert phases == ["data"] + ["training", "validation"] * EPOCHS + end, phases
    for r in memory_rows:
        # (+1: the kernel's counts behind the two figures are synchronised lazily, and each is rounded to a MiB)
        assert 0 < r["resident_mb"] <= r["peak_mb"] + 1 and 0 < r["released_mb"] <= r["peak_mb"] + 1, r


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_resident_memory_does_not_grow_from_the_second_epoch_to_the_last(runs, precision):
    """Where the last epoch's steps end, the process holds at most 3% more than where the second's ended,
    before and after freed memory is handed back. The margin: on a footprint of about 350 MB the smoke run's
    figures stayed within 1 MB of each other from the second epoch to the last (about 0.3%); keeping one
    step's logits per step (0.8 MB each, 42 steps between the two figures) grows it by 54%, and keeping one
    step's loss with its graph by 5%: both fail here. In bf16 the smoke run went from 382 to 385 MB (0.8%);
    keeping each bf16 step's loss with its graph, from 381 to 393 MB (3.1%): it fails, if only just."""
    training = [r for r in runs(precision) if r["phase"] == "training"]
    second, last = training[1], training[-1]
    for key in ("resident_mb", "released_mb"):
        assert last[key] <= 1.03 * second[key], (key, [r[key] for r in training])
