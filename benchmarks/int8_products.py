"""Which products int8 speeds up: each matrix product of a checkpoint's model, float32 against int8, in one process.

    python -m benchmarks.int8_products                          # the shipped de -> en model, one thread
    python -m benchmarks.int8_products --shapes 256x1024,128x4096 --rows 16,256 --threads 2

For each distinct weight shape (n, m) of the model (attention projections, feed-forward network, generator),
and each `--shapes` n x m after them, it times x W + b on each `--rows` count of random activations (a beam
step of 64 sentences with beam 4 runs 256 rows; as sentences finish, fewer, down to 4): float32 `torch.addmm`
against `annotated/decoding/quantize.py`'s `Int8Affine` (x quantized at each call, int8 weights packed for
oneDNN), each the best of 7 repeats of 200 calls, in alternation. A cell is float32's time over int8's: above
1, int8 pays at that row count. `quantize.py`'s MIN_WEIGHTS comes from this table: the fewest weights from
which int8 paid at every row count. Speed is never asserted by a test; `tests/test_int8_products_bench.py`
checks that it runs.
"""

from __future__ import annotations

import argparse
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


def measure(products: dict[str, tuple[int, int]], rows: list[int], calls: int = 200) -> list[dict]:
    """For each product (role: (n, m)), float32's time over int8's at each row count (`ratios`, by rows)."""
    from annotated.decoding.quantize import ENGINE, Int8Affine, _packing_for

    out = []
    for role, (n, m) in products.items():
        W, b = torch.randn(n, m) / n**0.5, torch.randn(m)  # (n, m), (m,)
        with _packing_for(ENGINE):
            layer = Int8Affine(W, b)
        ratios = {}
        for r in rows:
            x = torch.randn(r, n)  # (rows, n)
            with _packing_for(ENGINE), torch.inference_mode():
                float32 = best_of(functools.partial(torch.addmm, b, x, W), calls)
                int8 = best_of(functools.partial(layer, x), calls)
            ratios[r] = round(float32 / int8, 2)
        out.append(dict(role=role, n=n, m=m, weights=n * m, ratios=ratios))
    return out


def shape(text: str) -> tuple[int, int]:
    """'256x1024' -> (256, 1024): a product's n x m, each side a whole number >= 1."""
    sides = text.lower().split("x")
    if len(sides) != 2 or not all(s.isdigit() and int(s) >= 1 for s in sides):
        raise argparse.ArgumentTypeError(f"must be a shape NxM of whole numbers >= 1, e.g. 256x1024, got {text!r}")
    return int(sides[0]), int(sides[1])


def main(argv: list[str] | None = None) -> int:
    from annotated.checkpoint import CheckpointError, load_checkpoint
    from annotated.door import Door
    from annotated.plumbing.options import at_least, comma_list

    door = Door(__file__)
    p = door.parser(description=__doc__.split("\n")[0])
    door.checkpoint_options(
        p, languages=False, default="shipped:de-en", help="checkpoint file or shipped:NAME (default shipped:de-en)"
    )
    p.add_argument(
        "--rows", type=comma_list(at_least(1)), default=[4, 16, 32, 64, 256], help="row counts (default 4,16,32,64,256)"
    )
    p.add_argument(
        "--shapes", type=comma_list(shape), default=[], help="more products n x m to time, e.g. 256x1024,128x4096"
    )
    p.add_argument("--threads", type=at_least(1), default=1)
    p.add_argument("--calls", type=at_least(1), default=200, help="calls per repeat (default 200)")
    args = p.parse_args(argv)
    try:
        model = load_checkpoint(door.checkpoint(args))[0]
    except CheckpointError as e:
        door.fail(str(e))
    torch.set_num_threads(args.threads)
    products = shapes(model.config) | {f"--shapes {n}x{m}": (n, m) for n, m in args.shapes}
    print("| product | n x m | weights | " + " | ".join(f"{r} rows" for r in args.rows) + " |")
    print("| --- | --- | ---: |" + " ---: |" * len(args.rows))
    for r in measure(products, args.rows, args.calls):
        cells = " | ".join(str(r["ratios"][rows]) for rows in args.rows)
        print(f"| {r['role']} | {r['n']} x {r['m']} | {r['weights']:,} | {cells} |")
    print(f"\nfloat32's time over int8's (above 1: int8 faster), {args.threads} thread(s)")
    return 0


if __name__ == "__main__":
    from annotated.plumbing.scripts import run_main

    run_main(main)
