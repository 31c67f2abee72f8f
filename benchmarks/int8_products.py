"""Which products int8 speeds up: each matrix product of a checkpoint's model, float32 against int8, in one process.

    python -m benchmarks.int8_products                          # the shipped de -> en model, one thread, 256 rows
    python -m benchmarks.int8_products --checkpoint runs/x/averaged.pt --rows 64 --threads 2

For each distinct weight shape (n, m) of the model (attention projections, feed-forward network, generator)
it times x W + b on `--rows` rows of random activations (256 = a beam step of 64 sentences with beam 4):
float32 `torch.addmm` against `annotated/decoding/quantize.py`'s `Int8Affine` (x quantized at each call,
int8 weights packed for oneDNN), each the best of 7 repeats of 200 calls, in alternation. The ratio is
float32's time over int8's: above 1, int8 pays. `quantize.py`'s MIN_WEIGHTS comes from this table.
Speed is never asserted by a test; `tests/test_int8_products_bench.py` checks that it runs.
"""

from __future__ import annotations

import functools
import time

import torch


def best_of(f, calls: int = 200, repeats: int = 7) -> float:
    """The best mean time of one call, in microseconds, over `repeats` runs of `calls` calls (after warming up)."""
    for _ in range(10):
        f()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            f()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def shapes(config) -> dict[str, tuple[int, int]]:
    """The model's product shapes (n, m) by role."""
    d_k = config.d_k or config.d_model // config.h
    return {
        "attention projection": (config.d_model, config.h * d_k),
        "feed-forward W_1": (config.d_model, config.d_ff),
        "feed-forward W_2": (config.d_ff, config.d_model),
        "generator": (config.d_model, config.tgt_vocab),
    }


def measure(config, rows: int, calls: int = 200) -> list[dict]:
    from annotated.decoding.quantize import ENGINE, Int8Affine, _packing_for

    out = []
    for role, (n, m) in shapes(config).items():
        W, b, x = torch.randn(n, m) / n**0.5, torch.randn(m), torch.randn(rows, n)
        with _packing_for(ENGINE):
            layer = Int8Affine(W, b)
        with _packing_for(ENGINE), torch.inference_mode():
            float32 = best_of(functools.partial(torch.addmm, b, x, W), calls)
            int8 = best_of(functools.partial(layer, x), calls)
        out.append(dict(role=role, n=n, m=m, weights=n * m, float32_us=round(float32), int8_us=round(int8)))
        out[-1]["float32 / int8"] = round(float32 / int8, 2)
    return out


def main(argv: list[str] | None = None) -> int:
    from annotated.checkpoint import CheckpointError, load_checkpoint
    from annotated.door import Door
    from annotated.plumbing.options import at_least

    door = Door(__file__)
    p = door.parser(description=__doc__.split("\n")[0])
    door.checkpoint_options(
        p, languages=False, default="shipped:de-en", help="checkpoint file or shipped:NAME (default shipped:de-en)"
    )
    p.add_argument("--rows", type=at_least(1), default=256)
    p.add_argument("--threads", type=at_least(1), default=1)
    p.add_argument("--calls", type=at_least(1), default=200, help="calls per repeat (default 200)")
    args = p.parse_args(argv)
    try:
        model = load_checkpoint(door.checkpoint(args))[0]
    except CheckpointError as e:
        door.fail(str(e))
    torch.set_num_threads(args.threads)
    print("| product | n x m | weights | float32 us | int8 us | float32 / int8 |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for r in measure(model.config, args.rows, args.calls):
        print(
            f"| {r['role']} | {r['n']} x {r['m']} | {r['weights']:,} | {r['float32_us']} | {r['int8_us']} | "
            f"{r['float32 / int8']} |"
        )
    print(f"\n{args.rows} rows, {args.threads} thread(s)")
    return 0


if __name__ == "__main__":
    from annotated.plumbing.scripts import run_main

    run_main(main)
