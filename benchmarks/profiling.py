"""Where the training step's time goes: the torch profiler's table of top operators.

    python -m benchmarks.profiling                       # the cpu size, fp32, torch's threads, 3 steps
    python -m benchmarks.profiling --size base --threads 1 --precision bf16 --steps 5 --rows 25

The fused SDPA training step of `make bench` (`benchmarks/trainees.py`: forward, label-smoothed loss,
backward, fused Adam and its schedule) runs twice untimed, then `--steps` times under `torch.profiler`; the
table lists the operators by their own (self) CPU time, and the last line the share of the top ones.
benchmarks/README.md says what dominates at the cpu size.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python benchmarks/profiling.py` works too
    sys.path.insert(0, str(ROOT))

if __name__ == "__main__":  # as a command: a Ctrl-C while Python and torch load is one line, exit 130
    from annotated.plumbing.interrupts import quiet_ctrl_c_while_starting
    quiet_ctrl_c_while_starting("profiling")

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from annotated.plumbing.allocator import keep_freed_memory  # noqa: E402
from annotated.plumbing.devices import autocast, cpu_has_bf16  # noqa: E402
from benchmarks.sizes import SIZES, Size, make_batches  # noqa: E402
from benchmarks.trainees import build_trainees, make_step  # noqa: E402


def profile_step(size: Size, steps: int = 3, precision: str = "fp32", seed: int = 0):
    """The profiler's key averages over `steps` fused SDPA training steps on the CPU, after two untimed ones."""
    cpu = torch.device("cpu")
    batches = make_batches(2, size.train_sentences["cpu"], size.train.vocab_size, seed)
    [t] = build_trainees(size, cpu, seed, keys=("fused_sdpa",))
    step = make_step(t, t.model, batches, size.train.label_smoothing, lambda: autocast(cpu, precision))
    return profiled(step, steps)


def profiled(step, steps: int):
    """The profiler's key averages over `steps` calls of `step`, after two untimed ones."""
    for _ in range(2):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    return prof.key_averages()


def top_operators(averages, n: int) -> list[tuple[str, float, int]]:
    """(operator, share of all self CPU time, calls) for the `n` operators with the most self CPU time."""
    total = sum(e.self_cpu_time_total for e in averages) or 1.0
    ranked = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:n]
    return [(e.key, e.self_cpu_time_total / total, e.count) for e in ranked]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.profiling", description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=list(SIZES), default="cpu")
    p.add_argument("--steps", type=int, default=3, help="profiled steps (after 2 untimed ones)")
    p.add_argument("--threads", type=int, default=None, help="torch's CPU threads (default: torch's choice)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--rows", type=int, default=15, help="operators in the table")
    args = p.parse_args(argv)
    if args.steps < 1 or args.rows < 1 or (args.threads is not None and args.threads < 1):
        p.error(f"--steps, --rows and --threads must be >= 1, got {args.steps}, {args.rows}, {args.threads}")
    if args.precision == "bf16" and not cpu_has_bf16():
        print("profiling: note: this CPU has no bf16 instructions; PyTorch emulates bf16 here", file=sys.stderr)
    if args.threads:
        torch.set_num_threads(args.threads)
    keep_freed_memory()  # as training on the CPU does
    averages = profile_step(SIZES[args.size], args.steps, args.precision)
    print(averages.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    top = top_operators(averages, 5)
    print(f"{args.size} size, {args.precision}, {torch.get_num_threads()} threads, {args.steps} steps; top 5 by self "
          f"CPU time: " + ", ".join(f"{name} {share:.0%} ({calls} calls)" for name, share, calls in top))


if __name__ == "__main__":
    from annotated.plumbing.interrupts import run_command
    run_command(main, "profiling")
