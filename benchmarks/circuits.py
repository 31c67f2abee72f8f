"""How long `make circuits` takes and how much memory it needs, for each shipped model.

    python -m benchmarks.circuits [--threads 2] [--directions de-en en-de]

Each direction's readout runs as the user runs it (`python -m annotated.circuits.command --checkpoint
shipped:NAME`), in a child process of its own, after one untimed run that fills the aligner's cache (a fresh clone
aligns Multi30k once, about a minute and a half on two cores, then reads the cache). Each row prints the wall time
of the timed run and the child's peak resident memory, beside the budgets the whole readout (composition, score
terms and roles included) is held to (90 s, 1 GiB on two cores), as shares of them. Nothing here is asserted by a
test.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

from annotated.plumbing.options import Parser, at_least

BUDGET_S = 90.0
BUDGET_MIB = 1024.0


CHILD = """
import resource, sys
from annotated.circuits.command import main
code = main(sys.argv[1:])
usage = resource.getrusage(resource.RUSAGE_SELF)
print(usage.ru_maxrss, usage.ru_utime + usage.ru_stime)  # KiB on Linux: this process's peak; its CPU seconds
sys.exit(code)
"""


def run(direction: str, out: str, threads: int) -> tuple[float, float, float]:
    """(wall seconds, peak resident MiB, CPU seconds) of one readout of shipped:`direction` in a child process of
    its own. On a machine others share, the CPU seconds move less than the wall time."""
    argv = ["--checkpoint", f"shipped:{direction}", "--out", out, "--force", "--threads", str(threads)]
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CHILD, *argv], check=True, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    kib, cpu = done.stdout.strip().splitlines()[-1].split()
    return seconds, int(kib) / 1024, float(cpu)


def main(argv: list[str] | None = None) -> int:
    p = Parser(command=__file__, description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=at_least(1), default=2, help="torch threads of the readout (default 2)")
    p.add_argument("--directions", nargs="+", default=["de-en", "en-de"], help="shipped models to read")
    args = p.parse_args(argv)
    print(f"CPU: {os.cpu_count()} cores; load average {os.getloadavg()[0]:.2f} before the runs", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for direction in args.directions:
            run(direction, tmp, args.threads)  # fills the aligner's cache; not timed
        rows = [(d, *run(d, tmp, args.threads)) for d in args.directions]
    print(
        f"{'model':<10} {'seconds':>8} {'of ' + str(round(BUDGET_S)) + ' s':>8} {'CPU s':>7} {'peak MiB':>9} {'of 1 GiB':>9}"
    )
    for direction, seconds, mib, cpu in rows:
        print(
            f"{direction:<10} {seconds:>8.1f} {seconds / BUDGET_S:>8.2f} {cpu:>7.1f} {mib:>9.0f} {mib / BUDGET_MIB:>9.2f}"
        )
    print(f"load average {os.getloadavg()[0]:.2f} after the runs", flush=True)
    return 0


if __name__ == "__main__":
    from annotated.plumbing.scripts import run_main

    run_main(main)
