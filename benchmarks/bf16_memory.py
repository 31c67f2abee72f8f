"""A bf16 training run's resident memory, epoch by epoch, with oneDNN's kernel caches bounded (as training
bounds them, `allocator.bound_kernel_caches`) and at their defaults; and how many kernels each way compiles.

    python -m benchmarks.bf16_memory                      # both ways, 12 epochs of the first 2,000 pairs
    python -m benchmarks.bf16_memory --epochs 3 --compiles  # and the kernels compiled, with their time

Each way is a process of its own (the caches' sizes are read once, at a process's first oneDNN product): the
cpu preset's model and batches, its training pairs cut to `--pairs`, 20 validation sentences an epoch, the
length penalty fixed at 0.6, 2 threads, de -> en, bf16 autocast even where the CPU has no bf16 instructions
(PyTorch then emulates the products through the same oneDNN calls, slowly). It prints, per epoch, the resident
memory where the steps ended (MB) and, with `--compiles`, the kernels oneDNN compiled over the run
(`ONEDNN_VERBOSE=profile_create`'s `cache_miss` lines) and the milliseconds it spent compiling them.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

RUN = """
import sys
from annotated.training import train
from annotated.training.config import PRESETS, with_settings
train.resolve_precision = lambda requested, device, flags=None: ("bf16", "benchmarks/bf16_memory.py's")
cfg = with_settings(PRESETS["cpu"], {"train_limit": int(sys.argv[2]), "val_bleu_sentences": 20,
                                      "length_penalty": 0.6, "epochs": int(sys.argv[3]), "test_sentences": 20})
train.train(cfg, sys.argv[1], progress=False, log=lambda line: print(line, flush=True))
"""
DEFAULTS = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024", "LRU_CACHE_CAPACITY": "1024"}  # oneDNN's and ideep's


def run(way: str, pairs: int, epochs: int, compiles: bool) -> tuple[list[int], int, float]:
    """(MB resident where each epoch's steps ended, kernels compiled, milliseconds compiling)."""
    env = dict(os.environ, **(DEFAULTS if way == "defaults" else {}))
    if compiles:
        env["ONEDNN_VERBOSE"] = "profile_create"
    with tempfile.TemporaryDirectory() as run_dir:
        argv = [sys.executable, "-c", RUN, run_dir, str(pairs), str(epochs)]
        out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout
    memory = [int(m.replace(",", "")) for m in re.findall(r"memory ([\d,]+) MB after the steps", out)]
    created = [float(line.rsplit(",", 1)[1]) for line in out.splitlines() if "create:cache_miss" in line]
    return memory, len(created), sum(created)


def main(argv: list[str] | None = None) -> int:
    from annotated.plumbing.options import Parser

    p = Parser(
        command=__file__, description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--pairs", type=int, default=2000, help="the first N training pairs (default: 2000)")
    p.add_argument("--compiles", action="store_true", help="count the kernels oneDNN compiles, and their time")
    args = p.parse_args(argv)
    for way in ("bounded", "defaults"):
        memory, n, ms = run(way, args.pairs, args.epochs, args.compiles)
        print(
            f"{way}: MB after each epoch's steps {memory}" + (f"; {n} kernels compiled in {ms:.0f} ms" * args.compiles)
        )
    return 0


if __name__ == "__main__":
    from annotated.plumbing.scripts import run_main

    run_main(main)
