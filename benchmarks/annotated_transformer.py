"""Our training step against the Annotated Transformer's own model code, in one process, alternating rounds.

    curl -LO https://raw.githubusercontent.com/harvardnlp/annotated-transformer/\
debc9fd747bb2123160a98046ad1c2d4da44a567/the_annotated_transformer.py
    python -m benchmarks.annotated_transformer --source the_annotated_transformer.py --sizes cpu base --threads 1
    python -m benchmarks.annotated_transformer --source the_annotated_transformer.py --threads 1 --profile 5

The Annotated Transformer (harvardnlp/annotated-transformer, commit `debc9fd`) is the code this project
replaces. No line of it is in this repository: the command reads the file you downloaded, keeps only its
model definitions (`DEFINITIONS`: the classes and functions from `EncoderDecoder` to `make_model`, found by
name with `ast`, nothing else of the file is run), and builds its model with the size's `N`, `d_model`,
`d_ff`, `h`, dropout and vocabulary. Everything around the two models is the same, so only the model code
differs:

- the batches (`benchmarks/sizes.py`: Multi30k-like lengths, the size's sentences per batch);
- the loss: training's label-smoothed loss (`label_smoothed_loss`) on the logits, which for theirs are its
  generator's projection (its `Generator` would add a `log_softmax` that the loss does itself) of every
  target position, as their `SimpleLossCompute` does, and for ours training's `batch_loss`, which projects
  only the real (non-pad) positions;
- the optimiser and schedule (`make_optimizer`: fused Adam, the paper's betas);
- fp32, the same thread count, and `benchmarks/timing.py`'s interleaved rounds, after a warm-up.

Their model keeps separate source, target and generator tables (ours ties all three in these presets), so it
has more parameters for Adam to update; the matrix products per token are the same. Each size prints both
steps' target tokens per second and **ours / theirs**, the median over the rounds of the per-round ratios.

With `--profile N` it times nothing: each step runs twice untimed, then N times under `torch.profiler`, and
each size prints both steps' top operators by self CPU time (`benchmarks.profiling.top_operators`), the
matrix products' share (`mm`, `addmm`, `bmm`) and the rest, in seconds, and theirs / ours in total self CPU
time, so what separates the two steps is named.
"""

from __future__ import annotations

import argparse
import ast
import copy
import itertools
import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from annotated.plumbing.scripts import name_of

NAME = name_of(__file__)
URL = (
    "https://raw.githubusercontent.com/harvardnlp/annotated-transformer/"
    "debc9fd747bb2123160a98046ad1c2d4da44a567/the_annotated_transformer.py"
)
DEFINITIONS = (
    "EncoderDecoder",
    "Generator",
    "clones",
    "Encoder",
    "LayerNorm",
    "SublayerConnection",
    "EncoderLayer",
    "Decoder",
    "DecoderLayer",
    "subsequent_mask",
    "attention",
    "MultiHeadedAttention",
    "PositionwiseFeedForward",
    "Embeddings",
    "PositionalEncoding",
    "make_model",
)


class SourceError(ValueError):
    pass


def load_definitions(path: Path) -> dict:
    """The model definitions of the Annotated Transformer's file at `path`, executed alone: name -> object."""
    if not path.is_file():
        raise SourceError(f"--source {path}: no such file; download it with: curl -LO {URL}")
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (SyntaxError, UnicodeDecodeError) as e:
        raise SourceError(f"--source {path}: not Python source ({e})") from None
    wanted: list[ast.stmt] = [
        n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in DEFINITIONS
    ]
    missing = sorted(set(DEFINITIONS) - {getattr(n, "name", "") for n in wanted})
    if missing:
        raise SourceError(f"--source {path}: lacks {', '.join(missing)}; is it {URL}?")
    namespace = {
        "torch": torch,
        "nn": nn,
        "math": math,
        "copy": copy,
        "log_softmax": torch.nn.functional.log_softmax,
    }  # the file's imports that the definitions use
    exec(compile(ast.Module(body=wanted, type_ignores=[]), str(path), "exec"), namespace)
    return namespace


def their_loss(defs: dict) -> Callable:
    """`train.batch_loss` for their model: the same masks' meaning (True = may attend), the same loss."""
    from annotated.tokens import PAD
    from annotated.training.loss import label_smoothed_loss

    def loss(model, src, tgt, eps, real=None):
        # their training (`SimpleLossCompute`) projects every position, padding included; so does this (`real`
        # unused), while ours projects only the real ones
        tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]  # (B, T-1), (B, T-1)
        src_mask = (src != PAD).unsqueeze(-2)  # (B, 1, S)
        tgt_mask = (tgt_in != PAD).unsqueeze(-2) & defs["subsequent_mask"](tgt_in.size(-1))  # (B, T-1, T-1)
        hidden = model(src, tgt_in, src_mask, tgt_mask)  # (B, T-1, d_model)
        return label_smoothed_loss(model.generator.proj(hidden), tgt_out, eps), (tgt_out != PAD).sum()

    return loss


def stepper(model: nn.Module, loss_fn: Callable, size, batches) -> Callable[[], None]:
    """One training step per call (the bench's `make_step`, on the CPU in fp32); `loss_fn` gets each batch's
    real target positions (`real_positions`, made here, outside the timed step) as its last argument."""
    from annotated.training.data import real_positions
    from annotated.training.train import make_optimizer

    opt, sched = make_optimizer(model, size.train)
    batch_iter = itertools.cycle([(src, tgt, real_positions(tgt)) for src, tgt in batches])

    def step():
        src, tgt, real = next(batch_iter)
        opt.zero_grad(set_to_none=True)
        loss, n = loss_fn(model, src, tgt, size.train.label_smoothing, real)
        (loss / n).backward()
        opt.step()
        sched.step()

    return step


def _steps(defs: dict, size_name: str, seed: int):
    """({"ours": step, "theirs": step}, {"ours": model, "theirs": model}, batches) at one size."""
    from annotated.training.train import batch_loss
    from annotated.transformer import make_model
    from benchmarks.sizes import SIZES, make_batches

    size = SIZES[size_name]
    cfg = size.model_config()
    batches = make_batches(4, size.train_sentences["cpu"], cfg.src_vocab, seed)
    torch.manual_seed(seed)
    ours = make_model(cfg).train()
    torch.manual_seed(seed)
    theirs = defs["make_model"](
        cfg.src_vocab, cfg.tgt_vocab, N=cfg.N, d_model=cfg.d_model, d_ff=cfg.d_ff, h=cfg.h, dropout=cfg.dropout
    ).train()
    fns = {"ours": stepper(ours, batch_loss, size, batches), "theirs": stepper(theirs, their_loss(defs), size, batches)}
    return fns, {"ours": ours, "theirs": theirs}, batches


def compare(defs: dict, size_name: str, rounds: int, window: float, seed: int = 0) -> dict:
    """Tokens per second of both steps at one size, and ours / theirs (median of the rounds' ratios)."""
    from annotated.tokens import PAD
    from benchmarks.timing import interleaved_times

    fns, models, batches = _steps(defs, size_name, seed)
    ours, theirs = models["ours"], models["theirs"]
    times, _, errors = interleaved_times(fns, rounds, window, lambda: None)
    if errors:
        raise RuntimeError(f"{size_name}: {errors}")
    tokens = sum(int((t[:, 1:] != PAD).sum()) for _, t in batches) / len(batches)
    ratios = [b / a for a, b in zip(times["ours"], times["theirs"])]
    return {
        "size": size_name,
        "tokens_per_step": tokens,
        "threads": torch.get_num_threads(),
        "rounds": rounds,
        "tokens_per_second": {k: tokens / statistics.median(v) for k, v in times.items()},
        "parameters": {
            "ours": sum(p.numel() for p in ours.parameters()),
            "theirs": sum(p.numel() for p in theirs.parameters()),
        },
        "ours_over_theirs": statistics.median(ratios),
        "ratios": ratios,
    }


PRODUCTS = ("aten::mm", "aten::addmm", "aten::bmm")


def profile_both(defs: dict, size_name: str, steps: int, seed: int = 0) -> dict:
    """Each step's profiler key averages over `steps` steps (after two untimed and `steps` unprofiled ones:
    `profiling.profiled`), at one size: {"ours": ..., "theirs": ...}, with each one's self CPU seconds, of them
    in matrix products, and the `Profiled` result (the step's time and page faults outside and under it)."""
    from benchmarks.profiling import profiled

    fns, _, _ = _steps(defs, size_name, seed)
    out: dict = {}
    for name, fn in fns.items():
        result = profiled(fn, steps)
        averages = result.averages
        total = sum(e.self_cpu_time_total for e in averages) / 1e6
        products = sum(e.self_cpu_time_total for e in averages if e.key in PRODUCTS) / 1e6
        out[name] = {"averages": averages, "seconds": total, "products": products, "profiled": result}
    return out


def print_profiles(defs: dict, sizes: list[str], steps: int, rows: int) -> int:
    """`--profile`: both steps' top operators at each size, their products and the rest, theirs / ours."""
    from benchmarks.profiling import top_operators

    for size in sizes:
        r = profile_both(defs, size, steps)
        for name in ("ours", "theirs"):
            one = r[name]
            print(
                f"{size}, {name}: {one['seconds']:.3f} s of self CPU time over {steps} steps, matrix products "
                f"{one['products']:.3f} s ({one['products'] / one['seconds']:.1%}), the rest "
                f"{one['seconds'] - one['products']:.3f} s; top operators:"
            )
            for op, share, calls in top_operators(one["averages"], rows):
                print(f"  {op:<40} {share:6.1%} {calls:6d} calls")
            print(f"  the profiler's cost: {one['profiled'].summary()}")
        outside = r["theirs"]["profiled"].ms_per_step / r["ours"]["profiled"].ms_per_step
        print(
            f"{size}: theirs / ours in self CPU time {r['theirs']['seconds'] / r['ours']['seconds']:.2f}x "
            f"({torch.get_num_threads()} threads, fp32, under the profiler); in wall time outside it "
            f"{outside:.2f}x ({steps} steps each, one after the other: the timed rounds are the ratio to read)",
            flush=True,
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    from annotated.plumbing.allocator import keep_freed_memory
    from annotated.plumbing.options import Parser, at_least, number
    from benchmarks.sizes import SIZES

    p = Parser(
        command=__file__,
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--source", type=Path, required=True, help=f"the Annotated Transformer's file ({URL})")
    p.add_argument("--sizes", nargs="+", choices=[s for s in SIZES if s != "gpu"], default=["cpu", "base"])
    p.add_argument("--threads", type=at_least(1), default=None, help="CPU threads (default: torch's)")
    p.add_argument("--rounds", type=at_least(1), default=7, help="alternating rounds (default 7)")
    p.add_argument(
        "--window", type=number(0, None, above=True), default=3.0, help="seconds of steps per timing (default 3)"
    )
    p.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    p.add_argument(
        "--profile",
        type=at_least(1),
        default=None,
        metavar="N",
        help="time nothing: profile N steps of each and print their top operators",
    )
    p.add_argument("--rows", type=at_least(1), default=12, help="operators listed with --profile (default 12)")
    args = p.parse_args(argv)
    if args.out is not None and args.out.exists():
        p.error(f"--out {args.out} exists; name a new file (nothing is overwritten)")
    try:
        defs = load_definitions(args.source)
    except SourceError as e:
        p.error(str(e))
    if args.threads:
        torch.set_num_threads(args.threads)
    keep_freed_memory()  # as training on the CPU does
    if args.profile is not None:
        return print_profiles(defs, args.sizes, args.profile, args.rows)
    results = []
    for size in args.sizes:
        r = compare(defs, size, args.rounds, args.window)
        results.append(r)
        tps = r["tokens_per_second"]
        print(
            f"{size}: ours {tps['ours']:,.0f} target tokens/s, the Annotated Transformer's {tps['theirs']:,.0f}: "
            f"ours / theirs {r['ours_over_theirs']:.2f}x (median of {args.rounds} rounds, {r['threads']} threads, "
            f"fp32; parameters {r['parameters']['ours']:,} / {r['parameters']['theirs']:,})",
            flush=True,
        )
    if args.out is not None:
        from annotated.plumbing.files import atomic_write

        atomic_write(
            args.out, json.dumps({"source": str(args.source), "torch": torch.__version__, "results": results}, indent=1)
        )
    return 0


if __name__ == "__main__":
    from annotated.plumbing.scripts import run_main

    run_main(main)
