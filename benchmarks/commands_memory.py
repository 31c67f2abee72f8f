"""Every command's peak resident memory: each `make` target run in a process of its own, its peak read from the
kernel when it exits.

    python -m benchmarks.commands_memory                       # every row but `make test` and the full train
    python -m benchmarks.commands_memory --only translate heads
    python -m benchmarks.commands_memory --full-train --test   # also the cpu preset's 6,500 steps, the suite

Each row is one command line run through `make` (with `PYTHON=` this interpreter, so no `.venv` is built),
in a fresh process, with its outputs in a temporary folder. Its peak is the `ru_maxrss` that `os.wait4`
reports for that process alone: the largest resident set of the process or of any of its descendants that
it waited for (`make` waits for Python). The commands read the shipped de -> en model (`shipped:de-en`) and
Multi30k from `$MULTI30K_URL`. Rows:

- `train-300`: `make train` with the cpu preset cut to 300 steps and 50 validation sentences (the shape of
  every epoch and the whole end of the run: averaging, the length penalty, the 1,000 test sentences);
  `train` (with `--full-train`): the preset's 6,500 steps;
- `translate`: the 1,000 test sentences (test_2016_flickr, German) on stdin, beam 4;
- `attention`, `heads`, `circuits`, `equivalence`: the targets as they are, beside the shipped model
  (`circuits-en-de`: `make circuits` of the shipped en -> de model);
- `heads-prune`: `--prune` with the smallest honest options (`--sentences 100 --test-sentences 100`): the
  pruning search over 100 validation sentences, test BLEU and speed on 100 test sentences;
- `test` (with `--test`): the whole suite.

It prints a Markdown table (MB = 2^20 bytes) and the seconds each took (on a shared machine only the memory
is a figure to keep).
"""

from __future__ import annotations

import argparse
import gzip
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from annotated.plumbing.scripts import name_of

NAME = name_of(__file__)
ROOT = Path(__file__).resolve().parent.parent
CHECKPOINT = "CHECKPOINT=shipped:de-en"


def rows(out: Path) -> dict[str, tuple[list[str], str | None]]:
    """name -> (make's arguments, the file given on stdin or None)."""
    return {
        "train-300": (
            ["train", "PRESET=cpu", f"ARGS=--max-steps 300 --val-bleu-sentences 50 --run-dir {out}/t300"],
            None,
        ),
        "train": (["train", "PRESET=cpu", f"ARGS=--run-dir {out}/train"], None),
        "translate": (["translate", CHECKPOINT], "test_2016_flickr.de"),
        "attention": (["attention", CHECKPOINT, f"ARGS=--out {out}/attention"], None),
        "heads": (["heads", CHECKPOINT, f"ARGS=--out {out}/heads"], None),
        "heads-prune": (
            ["heads", CHECKPOINT, f"ARGS=--out {out}/prune --prune --sentences 100 --test-sentences 100"],
            None,
        ),
        "circuits": (["circuits", CHECKPOINT, f"ARGS=--out {out}/circuits"], None),
        "circuits-en-de": (["circuits", "CHECKPOINT=shipped:en-de", f"ARGS=--out {out}/circuits-en-de"], None),
        "equivalence": (["equivalence"], None),
        "test": (["test"], None),
    }


def peak(argv: list[str], stdin: Path | None) -> tuple[int, float, int]:
    """(peak resident bytes of the process and its waited-for descendants, seconds, exit status)."""
    t0 = time.perf_counter()
    with open(stdin or os.devnull, "rb") as f:
        proc = subprocess.Popen(argv, cwd=ROOT, stdin=f, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_maxrss * 1024, time.perf_counter() - t0, proc.returncode


def test_sources(out: Path) -> Path:
    """The 1,000 German test sentences as a text file (from Multi30k's cache, downloaded where needed)."""
    from annotated.training.data import default_cache_dir, fetch

    gz = fetch("test_2016_flickr.de.gz", default_cache_dir() / "multi30k")
    path = out / "test_2016_flickr.de"
    path.write_bytes(gzip.decompress(gz.read_bytes()))
    return path


def main(argv: list[str] | None = None) -> int:
    from annotated.plumbing.options import Parser

    p = Parser(
        command=__file__, description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--only", nargs="+", metavar="ROW", help="only these rows (names as in the table)")
    p.add_argument("--full-train", action="store_true", help="also the cpu preset's whole run (half an hour or more)")
    p.add_argument("--test", action="store_true", help="also `make test`, the whole suite")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        table = rows(out)
        names = args.only or [n for n in table if (n != "train" or args.full_train) and (n != "test" or args.test)]
        unknown = sorted(set(names) - set(table))
        if unknown:
            p.error(f"no row {', '.join(unknown)}; the rows are {', '.join(table)}")
        print("| command | peak resident memory | seconds | exit |")
        print("| --- | --- | --- | --- |")
        for name in names:
            make, stdin = table[name]
            source = test_sources(out) if stdin else None
            rss, seconds, code = peak(["make", f"PYTHON={sys.executable}", *make], source)
            shown = " ".join(a if " " not in a else f"'{a}'" for a in make)
            print(f"| `make {shown}` | {rss / 2**20:,.0f} MB | {seconds:,.0f} | {code} |", flush=True)
    return 0


if __name__ == "__main__":
    from annotated.plumbing.scripts import run_main

    run_main(main)
