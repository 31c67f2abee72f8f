"""Where the training step's time goes: the torch profiler's table of top operators.

    python -m benchmarks.profiling                       # the cpu size, fp32, torch's threads, 3 steps
    python -m benchmarks.profiling --size base --threads 1 --precision bf16 --steps 5 --rows 25
    python -m benchmarks.profiling --decode --threads 1        # beam search, not training (below)

The fused SDPA training step of `make bench` (`benchmarks/trainees.py`: forward, label-smoothed loss,
backward, fused Adam and its schedule) runs twice untimed, then `--steps` times unprofiled and `--steps`
times under `torch.profiler`; the table lists the operators by their own (self) CPU time, and the last lines
the share of the top ones and what the profiler itself changed.

What it changes: a profiled step can ask the kernel for many more fresh pages than the same step outside
the profiler under `keep_freed_memory` (most likely the profiler's own small allocations take the holes
that the step's large tensors leave in the heap; not traced further); the kernel zeroes each fresh page,
and that time counts against the operator that first writes it (`fill_` and `add` at the base size, in
benchmarks/README.md's measurement). The command therefore prints the minor page faults
and the milliseconds per step with and without the profiler (`Profiled`); where the two disagree, the
table overstates the operators that write fresh memory, and `make bench`'s unprofiled times are what to
read. benchmarks/README.md says what dominates at the cpu size.

`--decode` profiles translating instead: beam search (beam 4) over the first 64 sentences of
test_2016_flickr, one batch, with the shipped de -> en model (`--checkpoint` another), through the fast loop
and through the readable one (`annotated/decoding/search.py`, sections 6 and 7); it prints each loop's
table and its time split into the matrix products (linear layers and attention) and the rest.
"""

from __future__ import annotations

import mmap
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.autograd.profiler_util import EventList
from torch.profiler import ProfilerActivity, profile

from annotated.door import Door
from annotated.plumbing.allocator import keep_freed_memory
from annotated.plumbing.devices import autocast, cpu_has_bf16
from benchmarks.sizes import SIZES, Size, make_batches
from benchmarks.trainees import build_trainees, make_step


def profile_step(size: Size, steps: int = 3, precision: str = "fp32", seed: int = 0) -> Profiled:
    """`steps` fused SDPA training steps on the CPU under the profiler, after the unprofiled ones (`profiled`)."""
    cpu = torch.device("cpu")
    batches = make_batches(2, size.train_sentences["cpu"], size.train.vocab_size, seed)
    [t] = build_trainees(size, cpu, seed, keys=("fused_sdpa",))
    step = make_step(t, t.model, batches, size.train.label_smoothing, lambda: autocast(cpu, precision))
    return profiled(step, steps)


PRODUCTS = (
    "aten::addmm",
    "aten::mm",
    "aten::bmm",
    "aten::baddbmm",
    "quantized::linear_dynamic",
    "aten::_scaled_dot_product",
)


def profile_decoding(checkpoint: Path, steps: int, readable: bool) -> Profiled:
    """`steps` beam searches over one batch of 64 test sentences under the profiler (after unprofiled ones)."""
    from annotated.checkpoint import load_checkpoint
    from annotated.decoding import search
    from annotated.decoding.settings import Decoding, model_length_penalty
    from annotated.training.data import load_multi30k

    model, tokenizer, meta = load_checkpoint(checkpoint)
    pairs = load_multi30k("test_2016_flickr", meta.get("src_lang", "de"), meta.get("tgt_lang", "en"))[:64]
    sources, alpha = [tokenizer.encode(s) for s, _ in pairs], model_length_penalty(meta)

    def step() -> None:
        with torch.inference_mode():
            search.translate_ids(model, sources, Decoding.beam, alpha, fast=not readable)

    return profiled(step, steps)


def product_share(averages) -> float:
    """The share of all self CPU time spent in matrix products (`PRODUCTS`: linear layers and attention)."""
    total = sum(e.self_cpu_time_total for e in averages) or 1.0
    return sum(e.self_cpu_time_total for e in averages if e.key.startswith(PRODUCTS)) / total


def minor_page_faults() -> int | None:
    """This process's minor page faults so far (pages the kernel mapped, and zeroed, on first touch);
    None where the platform does not count them (Windows)."""
    try:
        import resource
    except ImportError:
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def fresh_mib(pages: float, page_size: int = mmap.PAGESIZE) -> float:
    """MiB of `pages` memory pages of `page_size` bytes each (the platform's by default)."""
    return pages * page_size / 2**20


@dataclass(frozen=True)
class Profiled:
    """The profiler's key averages, and the same number of steps timed and counted with and without it."""

    averages: EventList  # torch.profiler's key averages over the profiled steps
    ms_per_step: float  # wall time of a step outside the profiler
    ms_per_step_profiled: float
    faults_per_step: float | None  # minor page faults per step outside the profiler (None: not counted here)
    faults_per_step_profiled: float | None

    def summary(self) -> str:
        """One line: what the profiler changed in the step's time and its page faults."""
        line = (
            f"a step takes {self.ms_per_step:,.0f} ms outside the profiler, {self.ms_per_step_profiled:,.0f} ms "
            f"under it"
        )
        if self.faults_per_step is None or self.faults_per_step_profiled is None:
            return line + "; page faults not counted on this platform"
        line += (
            f"; minor page faults per step: {self.faults_per_step:,.0f} outside it, "
            f"{self.faults_per_step_profiled:,.0f} under it"
        )
        extra = self.faults_per_step_profiled - self.faults_per_step
        if extra <= 0:
            return line
        return line + (
            f" (about {fresh_mib(extra):,.0f} MiB more of fresh pages a step, whose zeroing the table charges to "
            f"the operators that first write them)"
        )


def _timed(step, steps: int) -> tuple[float, float | None]:
    """(milliseconds, minor page faults) per call over `steps` calls of `step`."""
    faults, start = minor_page_faults(), time.perf_counter()
    for _ in range(steps):
        step()
    seconds, after = time.perf_counter() - start, minor_page_faults()
    return seconds * 1e3 / steps, None if faults is None or after is None else (after - faults) / steps


def profiled(step, steps: int) -> Profiled:
    """`steps` calls of `step` under the profiler, after two untimed ones and `steps` timed unprofiled ones."""
    for _ in range(2):
        step()
    ms, faults = _timed(step, steps)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        ms_profiled, faults_profiled = _timed(step, steps)
    return Profiled(prof.key_averages(), ms, ms_profiled, faults, faults_profiled)


def top_operators(averages, n: int) -> list[tuple[str, float, int]]:
    """(operator, share of all self CPU time, calls) for the `n` operators with the most self CPU time."""
    total = sum(e.self_cpu_time_total for e in averages) or 1.0
    ranked = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:n]
    return [(e.key, e.self_cpu_time_total / total, e.count) for e in ranked]


def main(argv=None) -> None:
    door = Door(__file__)
    p = door.parser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=list(SIZES), default="cpu")
    p.add_argument("--steps", type=int, default=3, help="profiled steps (after 2 untimed ones)")
    p.add_argument("--threads", type=int, default=None, help="torch's CPU threads (default: torch's choice)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--rows", type=int, default=15, help="operators in the table")
    p.add_argument("--decode", action="store_true", help="profile beam search on the shipped model instead")
    door.checkpoint_options(
        p, languages=False, default="shipped:de-en", help="with --decode: the model (default shipped:de-en)"
    )
    args = p.parse_args(argv)
    if args.steps < 1 or args.rows < 1 or (args.threads is not None and args.threads < 1):
        p.error(f"--steps, --rows and --threads must be >= 1, got {args.steps}, {args.rows}, {args.threads}")
    if args.precision == "bf16" and not cpu_has_bf16():
        door.say("note: this CPU has no bf16 instructions; PyTorch emulates bf16 here")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.decode:
        checkpoint = door.checkpoint(args)
        for name, readable in (("fast loop", False), ("readable loop", True)):
            result = profile_decoding(checkpoint, args.steps, readable)
            print(result.averages.table(sort_by="self_cpu_time_total", row_limit=args.rows))
            top = top_operators(result.averages, 5)
            print(
                f"{name}, {torch.get_num_threads()} threads, {args.steps} searches of 64 sentences: matrix products "
                f"{product_share(result.averages):.0%} of self CPU time; top 5: "
                + ", ".join(f"{op} {share:.0%} ({calls} calls)" for op, share, calls in top)
            )
            print(f"the profiler's cost: {result.summary().replace('a step takes', 'a search takes')}")
        return
    keep_freed_memory()  # as training on the CPU does
    result = profile_step(SIZES[args.size], args.steps, args.precision)
    print(result.averages.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    top = top_operators(result.averages, 5)
    print(
        f"{args.size} size, {args.precision}, {torch.get_num_threads()} threads, {args.steps} steps; top 5 by self "
        f"CPU time: " + ", ".join(f"{name} {share:.0%} ({calls} calls)" for name, share, calls in top)
    )
    print(f"the profiler's cost: {result.summary()}")


if __name__ == "__main__":
    from annotated.plumbing.scripts import run_main

    run_main(main)
