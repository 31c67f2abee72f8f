# %% [markdown]
# # The CPU's arithmetic: its own peak, and the step's share of it (`make bench`)
#
# Training's `--precision` and `--threads` side by side, and how close the
# training step comes to what this CPU can do. For each size (each distinct
# model among the sizes asked for), the fused SDPA training step runs in
# fp32 and in bf16 autocast, on one thread and on every core this process
# may use; in the same interleaved rounds (`benchmarks/timing.py`) a large
# square matrix product, `(n x n) @ (n x n)` with `n = 2048` (1024 with
# `--quick`), runs at the same precision and thread count. That product is
# the best case of dense arithmetic, the flat part of the roofline: its
# `2 n^3 / seconds` is the **measured peak**. Each row then shows
#
# - the step's speed-up over fp32 on every core (its median step time over
#   the row's own, > 1: faster);
# - the step's **achieved FLOP/s**: the model FLOPs of one step
#   (`benchmarks/flops.py`: forward and backward, attention included,
#   padding not counted) over its median step time;
# - its **share of the peak**: achieved FLOP/s over the matmul's FLOP/s at
#   the same precision and thread count, timed in the same rounds, so a busy
#   spell of the machine slows both alike.
#
# bf16 rows are measured only where the CPU multiplies bf16 in hardware
# (`avx512_bf16` or `amx_bf16`, `annotated.plumbing.devices.cpu_has_bf16`).
# Elsewhere PyTorch emulates bf16 with fp32 arithmetic plus conversions, a
# figure that says nothing about the hardware; the row says so instead.

# %%
from __future__ import annotations

from collections.abc import Callable

import torch

from annotated.plumbing.devices import all_cores, autocast, cpu_has_bf16
from benchmarks.flops import training_flops
from benchmarks.rows import ArithmeticRow
from benchmarks.sizes import Size, make_batches, real_lengths
from benchmarks.timing import Settings, interleaved_times, median
from benchmarks.trainees import build_trainees, make_step

ARITHMETIC: tuple[tuple[str, int | None], ...] = (("fp32", None), ("fp32", 1), ("bf16", None), ("bf16", 1))
# (precision, threads; None: all cores), the baseline first
NO_BF16 = "not measured: this CPU has no bf16 instructions (avx512_bf16 or amx_bf16)"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def with_threads(fn: Callable[[], object], threads: int) -> Callable[[], None]:
    def run():
        torch.set_num_threads(threads)
        fn()

    return run


def matmul(n: int, precision: str, seed: int) -> Callable[[], torch.Tensor]:
    """One `(n x n) @ (n x n)` product per call at this precision, 2 n^3 FLOPs, into (and returning) one output."""
    gen = torch.Generator().manual_seed(seed)
    a, b = (torch.randn(n, n, generator=gen).to(DTYPES[precision]) for _ in range(2))  # (n, n)
    out = torch.empty(n, n, dtype=DTYPES[precision])  # (n, n)
    return lambda: torch.mm(a, b, out=out)  # (n, n)


def distinct_models(sizes: list[Size]) -> list[Size]:
    """The first size of each model (the gpu preset trains the cpu preset's model on larger batches)."""
    seen, out = set(), []
    for size in sizes:
        if repr(size.model_config()) not in seen:
            seen.add(repr(size.model_config()))
            out.append(size)
    return out


def bench_cpu_arithmetic(size: Size, st: Settings, log: Callable[[str], None]) -> list[ArithmeticRow]:
    """Rows of (precision, threads) for the fused SDPA training step on the CPU, each beside the matmul peak."""
    cpu, cores, threads_before = torch.device("cpu"), all_cores(), torch.get_num_threads()
    batches = make_batches(st.train_batches, size.train_sentences["cpu"], size.train.vocab_size, st.seed)
    src_l, tgt_l, tokens = real_lengths(batches)
    [t] = build_trainees(size, cpu, st.seed, keys=("fused_sdpa",))
    wanted = sorted({(p, cores if n is None else n) for p, n in ARITHMETIC}, key=lambda k: (k[0], -k[1]))
    runnable = [k for k in wanted if k[0] == "fp32" or cpu_has_bf16()]  # with one core, 1 and "all" are one row
    fns = {}
    for precision, threads in runnable:
        amp = lambda precision=precision: autocast(cpu, precision)
        fns[("step", precision, threads)] = with_threads(
            make_step(t, t.model, batches, size.train.label_smoothing, amp), threads
        )
        fns[("peak", precision, threads)] = with_threads(matmul(st.peak_n, precision, st.seed), threads)
    log(f"[{size.name}] CPU arithmetic: {len(runnable)} settings, {cores} cores, matmul n = {st.peak_n}")
    try:
        times, _, errors = interleaved_times(
            fns, st.reps, st.window, st.sync, lambda s: log(f"[{size.name}] CPU arithmetic {s}"), st.timer()
        )
    finally:
        torch.set_num_threads(threads_before)
    base = median(times.get(("step", "fp32", cores), []))
    rows = []
    for precision, threads in wanted:
        step, peak = ("step", precision, threads), ("peak", precision, threads)
        error = "; ".join(f"{k[0]}: {errors[k]}" for k in (step, peak) if k in errors) or None
        rows.append(
            ArithmeticRow(
                size=size.name,
                precision=precision,
                threads=threads,
                target_tokens_per_step=tokens / len(batches),
                flops_per_step=training_flops(size.model_config(), src_l, tgt_l) / len(batches),
                step_s_rounds=times.get(step, []),
                baseline_step_s=base,
                peak_n=st.peak_n,
                peak_s_rounds=times.get(peak, []),
                error=error,
                note=None if (precision, threads) in runnable else NO_BF16,
            )
        )
    return rows
