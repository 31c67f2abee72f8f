# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # `make bench`: how fast is our Transformer, and how close to the hardware?
#
# Absolute speeds depend on the machine, its load and the library versions,
# so this benchmark judges our code by **ratios measured side by side in one
# process**: the same batches, the same sizes, the same optimiser, timed in
# interleaved rounds. It measures
#
# 1. **one training step** (forward, backward, Adam step) in target tokens
#    per second, and the peak memory of the step, for four implementations:
#    our model with fused attention on the SDPA path
#    (`annotated.transformer.FAST_PATH = True`), the same with the explicit
#    softmax and `nn.Dropout` (`FAST_PATH = False`), our per-head attention, and a
#    **reference built from `torch.nn.Transformer`** that does the same work;
# 2. **decoding** in sentences per second: greedy with the key/value cache,
#    greedy recomputing the whole prefix at every step (the original
#    Annotated Transformer's way), and beam search with 4 beams;
# 3. on CUDA: the same in bf16 autocast, eagerly and under `torch.compile`,
#    and the **model FLOPs utilisation** (MFU) against the GPU's peak;
# 4. on the CPU: training's `--precision` and `--threads` side by side, and
#    the step's model FLOP/s as a share of this CPU's own measured matmul
#    peak at the same precision and thread count.
#
# One module per concern, each read top to bottom:
#
# | module | what |
# | --- | --- |
# | `sizes.py` | the sizes (presets, the paper's base) and batches like Multi30k's |
# | `reference.py` | `torch.nn.Transformer` doing the same work as ours |
# | `trainees.py` | the implementations compared, and one training step |
# | `timing.py` | interleaved, warmed-up rounds; `Settings` |
# | `training.py` | the training-step rows, compile speed-ups, host syncs |
# | `memory.py` | resident and step-peak memory (a subprocess on the CPU) |
# | `flops.py` | model FLOPs of a step (the formula), GPU peaks, MFU |
# | `arithmetic.py` | the CPU's matmul peak, fp32/bf16, 1/all threads, share of the peak |
# | `decoders.py` | decoding at a fixed length; the translator from stdin |
# | `rows.py` | one dataclass per kind of result row |
# | `targets.py` | the project's targets beside the numbers |
# | `report.py` | the markdown tables and the JSON file |
# | `profiling.py` | `python -m benchmarks.profiling`: the step's top operators |
#
# The results go to a table on stdout and to
# `benchmarks/results/<device>-<date>.json`. `python -m benchmarks.bench
# --help` lists the options; `make bench ARGS=...` passes them on.

# %%
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from annotated.plumbing.allocator import keep_freed_memory
from annotated.plumbing.devices import default_device
from annotated.plumbing.options import Parser, at_least, device, number
from annotated.plumbing.scripts import name_of, usage_of
from benchmarks.arithmetic import bench_cpu_arithmetic, distinct_models
from benchmarks.decoders import bench_decoding, bench_translator_cli
from benchmarks.flops import peak_tflops
from benchmarks.report import default_out_path, device_name, markdown, write_json
from benchmarks.sizes import SIZES, Size
from benchmarks.targets import evaluate_targets
from benchmarks.timing import Settings
from benchmarks.training import bench_training, compile_speedups, host_syncs_per_step

__all__ = ["Settings", "bench_translator_cli", "main", "markdown", "parse_args", "run_benchmarks"]


def _meta(sizes: list[Size], st: Settings) -> dict:
    return {
        "device_type": st.device.type,
        "device_name": device_name(st.device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "threads": torch.get_num_threads(),
        "clock": st.clock,
        "dtype": st.dtype,
        "compiled": list(st.compile_modes),
        "sizes": [s.name for s in sizes],
        "reps": st.reps,
        "window_s": st.window,
        "seed": st.seed,
        "peak_tflops": st.peak_tflops,
        "peak_n": st.peak_n,
        "size_details": {
            s.name: dict(
                dataclasses.asdict(s.model_config()),
                train_sentences=s.train_sentences[st.device.type],
                decode_sentences=s.decode_sentences[st.device.type],
            )
            for s in sizes
        },
        "load_average_start": list(os.getloadavg()),
    }


def run_benchmarks(sizes: list[Size], settings: Settings | None = None, log: Callable[[str], None] = print) -> dict:
    """Run everything for these sizes; returns the result (`report.to_json` makes it what the JSON file holds)."""
    st = settings or Settings()
    if st.peak_tflops is None and st.device.type == "cuda" and st.dtype == "bf16":
        st = dataclasses.replace(st, peak_tflops=peak_tflops(device_name(st.device)))
    meta = _meta(sizes, st)
    t0 = time.perf_counter()
    train_rows, decode_rows = [], []
    for size in sizes:
        train_rows += bench_training(size, st, log)
        gc.collect()
        if st.decode:
            decode_rows += bench_decoding(size, st, log)
            gc.collect()
    result = {"meta": meta, "train": train_rows, "decode": decode_rows, "compile_speedup": compile_speedups(train_rows)}
    if st.arithmetic and st.device.type == "cpu":
        result["cpu_arithmetic"] = [r for size in distinct_models(sizes) for r in bench_cpu_arithmetic(size, st, log)]
    if st.sync_steps:
        result["host_syncs"] = host_syncs_per_step(sizes[0], st)
    if st.decode:
        result["translator_cli"] = bench_translator_cli(st, log)
    meta.update(load_average_end=list(os.getloadavg()), wall_s=round(time.perf_counter() - t0, 1))
    result["targets"] = evaluate_targets(result)
    return result


def parse_args(argv=None) -> argparse.Namespace:
    p = Parser(command=__file__, description="Benchmark training steps and decoding against torch.nn.Transformer.")
    p.add_argument("--sizes", default="cpu,gpu,base", help="comma-separated subset of: " + ", ".join(SIZES))
    p.add_argument("--device", type=device, default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="2 rounds, short windows, a 1024 matmul peak: a smoke run, not a measurement",
    )
    p.add_argument("--reps", type=at_least(1), default=None, help="timing rounds (default 5; 2 with --quick)")
    p.add_argument(
        "--window",
        type=number(0, None, above=True),
        default=None,
        help="seconds per timed window (default 1.0; 0.2 with --quick)",
    )
    p.add_argument("--dtype", choices=("fp32", "bf16"), default=None, help="default: bf16 on CUDA, fp32 on the CPU")
    p.add_argument(
        "--compile",
        choices=("off", "on", "both"),
        default=None,
        help="torch.compile rows (default: both; on the CPU only for the fused SDPA row)",
    )
    p.add_argument("--no-memory", action="store_true", help="skip the memory measurement")
    p.add_argument("--no-decode", action="store_true", help="skip the decoding benchmark")
    p.add_argument(
        "--no-arithmetic",
        action="store_true",
        help="skip the CPU rows of fp32 vs bf16, one thread vs all, and the share of the matmul peak",
    )
    p.add_argument(
        "--peak-tflops", type=number(0, None, above=True), default=None, help="peak FLOP/s (in TFLOP/s) for MFU"
    )
    p.add_argument(
        "--threads",
        type=at_least(1),
        default=None,
        help="CPU threads for torch (default: torch's choice); 1 is steadier on a loaded machine",
    )
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall clock, or this process's CPU time (CPU only; for a shared machine, with --threads 1)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="JSON path (default benchmarks/results/<device>-<date>.json)")
    args = p.parse_args(argv)
    names = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in names if s not in SIZES]
    if unknown or not names:
        p.error(f"--sizes: unknown size(s) {unknown or args.sizes!r}; choose from {', '.join(SIZES)}")
    args.sizes = names
    return args


def settings_from(args: argparse.Namespace) -> Settings:
    if args.threads:
        torch.set_num_threads(args.threads)
    device = default_device(args.device)  # (cpu, cuda or cuda:N where it exists: checked by the parser)
    if device.type == "cpu":  # as training does (every row runs under it; the memory rows in their own process)
        keep_freed_memory()
    try:
        return Settings(
            device=device,
            dtype=args.dtype or ("bf16" if device.type == "cuda" else "fp32"),
            compile_modes={"off": (False,), "on": (True,), "both": (False, True)}[args.compile or "both"],
            reps=args.reps or (2 if args.quick else 5),
            window=args.window or (0.2 if args.quick else 1.0),
            memory=not args.no_memory,
            decode=not args.no_decode,
            arithmetic=not args.no_arithmetic,
            peak_n=1024 if args.quick else 2048,
            seed=args.seed,
            peak_tflops=args.peak_tflops,
            clock=args.clock,
            compile_keys=None if device.type == "cuda" else ("fused_sdpa",),
        )
    except ValueError as e:
        raise SystemExit(f"{name_of(__file__)}: {e}") from None


def main(argv=None) -> dict:
    args = parse_args(argv)
    settings = settings_from(args)

    from tqdm.auto import tqdm

    bar = tqdm(desc="bench", unit=" phase", leave=False)

    def log(msg: str) -> None:
        bar.set_postfix_str(msg[:70])
        bar.update(1)

    result = run_benchmarks([SIZES[s] for s in args.sizes], settings, log)
    bar.close()
    result["meta"]["command"] = " ".join([usage_of(__file__)] + (argv if argv is not None else sys.argv[1:]))
    result["meta"]["quick"] = args.quick
    out = args.out or default_out_path(result)
    write_json(result, out)
    print(markdown(result))
    print(f"\nwritten to {out}")
    return result


if __name__ == "__main__":
    from annotated.plumbing.scripts import run_main

    run_main(main)
