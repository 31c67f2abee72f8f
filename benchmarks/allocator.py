"""Training's step under malloc's settings, the bounded ones of `annotated/plumbing/allocator.py` against the
unbounded ones it replaced, in one process, alternating rounds.

    python -m benchmarks.allocator                  # the cpu preset, de -> en, precision auto
    python -m benchmarks.allocator --threads 1 --rounds 15

`mallopt` can be called at any time, so one process can time the same step (`train.train_step` on the first
`--batches` batches of a seeded epoch, as `benchmarks/padding.py` does) under each way in turn. Before each
way's window its settings are applied, every free page is handed back (`malloc_trim(0)`, as training does
where a phase ends) and one untimed step lets the heap grow back; then the window times one step on each of
the `--batches` batches, so every window of every round times the same batches, the steady state of an epoch
under that way, page faults included. The ways take turns going first from round to round. It prints each
way's target tokens per second (the median over the rounds), its speed over the first way's (the median of
the per-round ratios, and their range and quartiles: on a shared machine the spread is the figure to read
beside the median), its minor page faults per step, and the process's resident memory after its last
window. Both ways share one model and optimiser: the state they carry is the same size.

The ways:

- `1 GiB kept, never trimmed`: the settings before (blocks below 1 GiB from the heap, 1 GiB trim threshold,
  256 MiB top pad);
- `256 MiB kept, released between phases`: `allocator.SETTINGS`.
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import statistics
import time

import torch

from annotated.plumbing.allocator import (
    M_MMAP_THRESHOLD,
    M_TOP_PAD,
    M_TRIM_THRESHOLD,
    SETTINGS,
    _libc,
    release_freed_memory,
    resident_bytes,
)
from annotated.plumbing.scripts import name_of

NAME = name_of(__file__)
WAYS = {
    "1 GiB kept, never trimmed": ((M_MMAP_THRESHOLD, 1 << 30), (M_TRIM_THRESHOLD, 1 << 30), (M_TOP_PAD, 256 << 20)),
    "256 MiB kept, released between phases": SETTINGS,
}


def compare(cfg, encoded, n_batches: int, rounds: int, precision: str) -> dict:
    """Tokens per second, page faults per step and resident memory of the step under each way of `WAYS`."""
    from annotated.training import data
    from benchmarks.padding import stepper

    libc = _libc()
    if libc is None:
        raise RuntimeError("this is no glibc: malloc's settings cannot be changed here")
    batches = data.make_batches(encoded, cfg.max_tokens, shuffle=True, seed=0, max_len=cfg.model.max_len)[:n_batches]
    step = stepper(cfg, batches, True, precision, seed=0)
    names = list(WAYS)
    seconds: dict[str, list[float]] = {w: [] for w in names}
    faults: dict[str, list[float]] = {w: [] for w in names}
    resident: dict[str, int] = {}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # each way first in turn
            for param, value in WAYS[name]:
                libc.mallopt(param, value)
            release_freed_memory()
            step()  # untimed: the heap grows back to what a step needs under these settings
            before, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
            for _ in range(n_batches):  # each batch once: every window times the same steps
                step()
            seconds[name].append((time.perf_counter() - t0) / n_batches)
            faults[name].append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / n_batches)
            resident[name] = resident_bytes()
    tokens = sum(b.ntokens for b in batches) / n_batches
    first = names[0]
    ratios = {w: [a / b for a, b in zip(seconds[first], t)] for w, t in seconds.items()}  # per round
    return {
        "batches": n_batches,
        "tokens_per_step": tokens,
        "threads": torch.get_num_threads(),
        "precision": precision,
        "rounds": rounds,
        "tokens_per_second": {w: tokens / statistics.median(t) for w, t in seconds.items()},
        "speed_over_first": {w: statistics.median(r) for w, r in ratios.items()},
        "ratios": ratios,
        "faults_per_step": {w: statistics.median(f) for w, f in faults.items()},
        "resident_mb": {w: resident[w] >> 20 for w in names},
    }


def main(argv: list[str] | None = None) -> int:
    from annotated.plumbing.devices import resolve_precision
    from annotated.plumbing.options import Parser, at_least
    from annotated.training import data
    from annotated.training.config import PRESETS

    p = Parser(
        command=__file__,
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--src", default="de"), p.add_argument("--tgt", default="en")
    p.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto")
    p.add_argument("--threads", type=at_least(1), default=None, help="CPU threads (default: torch's)")
    p.add_argument("--batches", type=at_least(1), default=8, help="batches of the epoch, one window (default 8)")
    p.add_argument("--rounds", type=at_least(1), default=15, help="alternating rounds (default 15)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        precision, why = resolve_precision(args.precision, torch.device("cpu"))
    except ValueError as e:
        p.error(str(e))
    cfg = dataclasses.replace(PRESETS["cpu"], src_lang=args.src, tgt_lang=args.tgt)
    pairs = data.load_multi30k("train", args.src, args.tgt)
    tokenizer = data.train_tokenizer([s for s, _ in pairs] + [t for _, t in pairs], cfg.vocab_size)
    r = compare(cfg, data.encode_pairs(pairs, tokenizer), args.batches, args.rounds, precision)
    print(
        f"the cpu preset's step, {args.src} -> {args.tgt}, {precision} ({why}), {r['threads']} threads, "
        f"{r['tokens_per_step']:.0f} target tokens a step, median of {args.rounds} rounds:"
    )
    for w, tps in r["tokens_per_second"].items():
        print(
            f"  {w:<38} {tps:8,.0f} target tokens/s  {r['speed_over_first'][w]:.2f}x  "
            f"{r['faults_per_step'][w]:9,.0f} page faults a step  {r['resident_mb'][w]:,} MB resident"
        )
    for w, rs in list(r["ratios"].items())[1:]:
        q = statistics.quantiles(rs, n=4, method="inclusive") if len(rs) > 1 else rs * 3
        print(
            f"  {w} over the first, per round: median {statistics.median(rs):.3f}, quartiles {q[0]:.3f} to "
            f"{q[2]:.3f}, range {min(rs):.3f} to {max(rs):.3f}; {', '.join(f'{x:.2f}' for x in rs)}"
        )
    return 0


if __name__ == "__main__":
    from annotated.plumbing.scripts import run_main

    run_main(main)
