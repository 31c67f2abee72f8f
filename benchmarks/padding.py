"""Training's step on real Multi30k batches: padded to multiples of 8 or not, every position scored or only the
real ones, the chapter's dropout or torch's, in one process, alternating rounds.

    python -m benchmarks.padding                                # the cpu preset, de -> en, precision auto
    python -m benchmarks.padding --precision fp32 --threads 1

`make bench` times synthetic batches that all share one shape; a training epoch is not like that. Its
batches (`data.make_batches`, length buckets of `max_tokens` tokens) are padded, on top of their longest
row, to columns that are multiples of `pad_to`, and the loss ignores the padded target positions that the
model has computed anyway. This benchmark takes the first `--batches` batches of a seeded training epoch
and times training's own step (`train.train_step`: forward, the label-smoothed loss, backward, clipping,
fused Adam, the schedule) on them five ways:

- `pad 8, every position`: columns padded to multiples of 8, every decoder position projected onto the
  vocabulary (the padded ones masked out of the loss afterwards), given to the step as its positions, so
  it also pays one copy of the decoder's output (n x d_model) that the old step did not;
- `pad 8, real positions`: the same batches, only the real target positions projected (`Batch.real`);
- `pad 1, every position` and `pad 1, real positions`: the batches padded to their longest row only;
- `pad 1, real, torch dropout`: the last, with each of the chapter's `Dropout` modules replaced by
  `nn.Dropout` (the chapter's draws 16 random bits per entry on the CPU; torch's a random number).

Each way has its own model and optimiser, built from the same seed; the batches hold the same sentences in
every way, so the target tokens per step are the same. It prints the share of padded positions, each way's
target tokens per second (the median over the rounds) and its speed over the first way's (the median of
the per-round ratios).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import statistics
from collections.abc import Callable, Sequence

import torch

from annotated.plumbing.scripts import name_of

NAME = name_of(__file__)
WAYS = {
    "pad 8, every position": (8, False, False),
    "pad 8, real positions": (8, True, False),
    "pad 1, every position": (1, False, False),
    "pad 1, real positions": (1, True, False),
    "pad 1, real, torch dropout": (1, True, True),
}


def padding_share(batches) -> dict:
    """The share of source and of predicted target positions that are padding."""
    from annotated.tokens import PAD

    src = sum(int((b.src == PAD).sum()) for b in batches) / sum(b.src.numel() for b in batches)
    tgt = sum(int((b.tgt[:, 1:] == PAD).sum()) for b in batches) / sum(b.tgt[:, 1:].numel() for b in batches)
    return {"source": src, "target": tgt}


def stepper(cfg, batches, real: bool, precision: str, seed: int, torch_dropout: bool = False) -> Callable[[], None]:
    """One `train.train_step` per call on the next of `batches`; without `real`, every position is scored; with
    `torch_dropout`, the model's `Dropout` modules are `nn.Dropout`."""
    from annotated.training import train
    from annotated.training.data import Batch
    from annotated.transformer import Dropout, make_model

    torch.manual_seed(seed)
    model = make_model(cfg.model).train()
    for parent in list(model.modules()) if torch_dropout else []:
        for name, child in parent.named_children():
            if isinstance(child, Dropout):
                setattr(parent, name, torch.nn.Dropout(child.p))
    opt, sched = train.make_optimizer(model, cfg)
    if not real:  # every position "real": the model projects all of them, the loss masks the padding
        batches = [Batch(b.src, b.tgt, b.index, torch.arange(b.tgt[:, 1:].numel())) for b in batches]
    cpu, cycle = torch.device("cpu"), itertools.cycle(batches)

    def step():
        b = next(cycle)
        train.train_step(model, opt, sched, [b], b.ntokens, cfg, cpu, precision=precision)

    return step


def compare(cfg, encoded: Sequence, n_batches: int, rounds: int, window: float, precision: str, seed: int = 0) -> dict:
    """Tokens per second of each way in `WAYS` on the first `n_batches` batches of epoch `seed`'s shuffle."""
    from annotated.training import data
    from benchmarks.timing import interleaved_times

    padded = {
        k: data.make_batches(encoded, cfg.max_tokens, shuffle=True, seed=seed, pad_to=k, max_len=cfg.model.max_len)[
            :n_batches
        ]
        for k in (8, 1)
    }
    assert [b.index.tolist() for b in padded[8]] == [b.index.tolist() for b in padded[1]]  # the same sentences
    fns = {
        way: stepper(cfg, padded[k], real, precision, seed, torch_dropout)
        for way, (k, real, torch_dropout) in WAYS.items()
    }
    times, _, errors = interleaved_times(fns, rounds, window, lambda: None)
    if errors:
        raise RuntimeError(str(errors))
    tokens = sum(b.ntokens for b in padded[1]) / n_batches
    first = next(iter(WAYS))
    return {
        "batches": n_batches,
        "tokens_per_step": tokens,
        "threads": torch.get_num_threads(),
        "precision": precision,
        "rounds": rounds,
        "padding": {k: padding_share(padded[k]) for k in (8, 1)},
        "tokens_per_second": {w: tokens / statistics.median(t) for w, t in times.items()},
        "speed_over_first": {w: statistics.median(a / b for a, b in zip(times[first], t)) for w, t in times.items()},
    }


def main(argv: list[str] | None = None) -> int:
    from annotated.plumbing.allocator import keep_freed_memory
    from annotated.plumbing.devices import resolve_precision
    from annotated.plumbing.options import Parser, at_least, number
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
    p.add_argument("--batches", type=at_least(1), default=24, help="batches of the epoch to cycle (default 24)")
    p.add_argument("--rounds", type=at_least(1), default=5, help="alternating rounds (default 5)")
    p.add_argument(
        "--window", type=number(0, None, above=True), default=3.0, help="seconds of steps per timing (default 3)"
    )
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    keep_freed_memory()  # as training on the CPU does
    try:
        precision, why = resolve_precision(args.precision, torch.device("cpu"))
    except ValueError as e:
        p.error(str(e))
    cfg = dataclasses.replace(PRESETS["cpu"], src_lang=args.src, tgt_lang=args.tgt)
    pairs = data.load_multi30k("train", args.src, args.tgt)
    tokenizer = data.train_tokenizer([s for s, _ in pairs] + [t for _, t in pairs], cfg.vocab_size)
    encoded = data.encode_pairs(pairs, tokenizer)
    r = compare(cfg, encoded, args.batches, args.rounds, args.window, precision)
    for k, share in r["padding"].items():
        print(
            f"pad to multiples of {k}: {share['source']:.1%} of source and {share['target']:.1%} of target "
            f"positions are padding"
        )
    print(
        f"the cpu preset, {args.src} -> {args.tgt}, {precision} ({why}), {r['threads']} threads, "
        f"{r['tokens_per_step']:.0f} target tokens a step, median of {args.rounds} rounds:"
    )
    for way, tps in r["tokens_per_second"].items():
        print(f"  {way:<26} {tps:8,.0f} target tokens/s  {r['speed_over_first'][way]:.2f}x")
    return 0


if __name__ == "__main__":
    from annotated.plumbing.scripts import run_main

    run_main(main)
