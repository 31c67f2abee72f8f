# %% [markdown]
# # Timing: warmed up, interleaved, median (`make bench`)
#
# Every function first runs once untimed (first calls allocate memory, pick
# kernels, compile) and once timed, which fixes how many calls a timing
# window holds (about `window` seconds). Then `reps` rounds time each function
# for one window, in an order that rotates from round to round, so a slow
# spell of the machine (other processes, thermal throttling) hits every
# implementation alike. We keep the median per call over the rounds. A
# function that raises (out of memory, a compiler error) is dropped and its
# error recorded instead of stopping the benchmark.
#
# `Settings` gathers how to measure. The clock is the wall clock by default.
# On a shared CPU machine other processes steal time at random; `clock="cpu"`
# then measures this process's CPU time instead (`time.process_time`), which
# with one thread (`--threads 1`) is the time the benchmark actually ran, and
# equals the wall time on an idle machine. CUDA work is always timed by the
# wall clock, after a synchronisation.

# %%
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from annotated.plumbing.devices import autocast


def interleaved_times(
    fns: dict,
    reps: int,
    window: float,
    sync: Callable[[], None],
    progress: Callable[[str], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[dict, dict, dict]:
    """-> (seconds per call: name -> list over rounds, calls per window, errors: name -> message)."""
    fns, iters, errors = dict(fns), {}, {}

    def run(name, n):
        try:
            sync()
            t0 = clock()
            for _ in range(n):
                fns[name]()
            sync()
            return (clock() - t0) / n
        except Exception as e:  # noqa: BLE001 recorded in the results, the other rows go on
            errors[name] = error_text(e)
            del fns[name]
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            return None

    for name in list(fns):
        if progress:
            progress(f"warm-up {name}")
        if run(name, 1) is not None:  # untimed: first-call costs
            dt = run(name, 1)
            if dt is not None:
                iters[name] = max(1, min(100, round(window / max(dt, 1e-9))))
    times: dict = {name: [] for name in fns}
    names = list(fns)
    for r in range(reps):
        if progress:
            progress(f"round {r + 1}/{reps}")
        k = r % max(len(names), 1)
        for name in names[k:] + names[:k]:
            if name in fns:
                dt = run(name, iters[name])
                if dt is not None:
                    times[name].append(dt)
    return {n: t for n, t in times.items() if n in fns}, iters, errors


def median(xs: list[float]) -> float | None:
    """The median, or None for no rounds (a row whose function failed)."""
    return statistics.median(xs) if xs else None


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:500]


@dataclass(frozen=True)
class Settings:
    device: torch.device = torch.device("cpu")
    dtype: str = "fp32"  # "fp32", or "bf16" autocast
    compile_modes: tuple = (False,)  # False: eager; True: torch.compile
    reps: int = 5  # timing rounds
    window: float = 1.0  # seconds per timing window
    train_batches: int = 2  # batches cycled through by the training steps
    decode_batches: int = 1  # batches each decoding call translates
    memory: bool = True
    decode: bool = True
    arithmetic: bool = True  # on the CPU: fp32 vs bf16, one thread vs all, share of the matmul peak
    peak_n: int = 2048  # the CPU peak's square matmul: (peak_n x peak_n) @ (peak_n x peak_n)
    seed: int = 0
    peak_tflops: float | None = None  # for MFU; default from PEAK_BF16_TFLOPS on CUDA with bf16
    clock: str = "wall"  # "wall" or "cpu" (process CPU time, CPU device only)
    compile_keys: tuple | None = None  # the rows that get a compiled twin (None: all)
    sync_steps: int = 8  # training steps under the host-sync counter (0: skip)

    def __post_init__(self):
        if self.dtype not in ("fp32", "bf16"):
            raise ValueError(f"dtype must be 'fp32' or 'bf16', got {self.dtype!r}")
        if self.clock not in ("wall", "cpu") or (self.clock == "cpu" and self.device.type != "cpu"):
            raise ValueError(f"clock must be 'wall', or 'cpu' on the CPU device; got {self.clock!r} on {self.device}")
        if self.reps < 1 or self.window <= 0 or self.train_batches < 1 or self.decode_batches < 1 or self.peak_n < 1:
            raise ValueError(
                f"need reps >= 1, window > 0, train_batches >= 1, decode_batches >= 1, peak_n >= 1; "
                f"got {self.reps}, {self.window}, {self.train_batches}, {self.decode_batches}, "
                f"{self.peak_n}"
            )

    def amp(self):
        """A factory of autocast contexts: bf16 autocast (as training's --precision bf16), or none."""
        return lambda: autocast(self.device, self.dtype)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def timer(self) -> Callable[[], float]:
        return time.process_time if self.clock == "cpu" else time.perf_counter
