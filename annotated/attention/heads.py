"""`python -m annotated.attention.heads [--checkpoint PATH] [--sentences N] [--prune [--finetune-steps N]]` (`make heads`).

For every head of every attention: Michel et al.'s importance, the change of validation BLEU and loss without
it (each with a paired bootstrap interval), measures of where it looks and the label they give; one table on
stdout, `heads.json`, one heat map per attention kind (`heads_<kind>.png`), one inspection page
(`heads_inspect.png`) and one example sentence per head (`heads_examples.png`), written beside the checkpoint
or in `--out`. With `--prune`: greedy pruning (ranked on half the validation sentences, stopped on the other
half's loss), optionally fine-tuned, saved as `pruned.pt`, with test BLEU and decoding speed of both models, and
the whole greedy path drawn in `heads_pruning.png`. The chapters are `annotated/attention/importance.py`,
`bootstrap.py`, `profiles.py`, `prune.py` and `curve.py`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from typing import Any

import numpy as np
import torch
from matplotlib.patches import Rectangle

from annotated.attention.bootstrap import CONFIDENCE, RESAMPLES, SEED, Change, paired_bleu_change, paired_loss_change
from annotated.attention.curve import curve_figure
from annotated.attention.dump import ROWS_COLS, collect_attention, token_labels
from annotated.attention.importance import ablate, head_importance, normalise_per_attention, sentence_losses
from annotated.attention.pictures import CMAP, figure, label_font_size, panel_rows
from annotated.attention.profiles import bilinear_spectra, head_labels, inspect_figure, position_profiles, profile_rows
from annotated.attention.prune import (
    FINETUNE_CHECK_EVERY,
    FINETUNE_PATIENCE,
    MAX_LOSS_INCREASE,
    alternating_speed,
    count_parameters,
    finetune,
    greedy_prune,
    save_pruned,
    speed_ratio,
    split_sentences,
)
from annotated.checkpoint import CheckpointError, languages_of, load_checkpoint, read_case_table
from annotated.checks import check_tokenizer
from annotated.decoding.settings import Decoding, model_length_penalty
from annotated.door import Door
from annotated.plumbing.files import atomic_write, json_safe, save_figure
from annotated.plumbing.options import at_least, device, number
from annotated.shipped import typed_name
from annotated.sites import KINDS, attention_at, head_counts, sites
from annotated.tokens import BOS, EOS
from annotated.training.data import DataError, encode_pairs, load_multi30k, make_batches, split_long
from annotated.training.evaluate import evaluate_bleu, score
from annotated.training.train import evaluate_loss

DOOR = Door(__file__)
WINDOW = 4  # offsets -4 ... +4 in the position profiles
SPEED_ROUNDS = 3  # timings alternate unpruned / pruned this many times (the ratio: the median round's)
NOISY_BLEU = 1.0  # the command warns when the typical BLEU interval is wider than this
STOP_RULE = (
    "Pruning ranks heads by importance on the validation sentences at even positions (0, 2, 4, ...) "
    "and judges each removal on those at odd positions: it removes one head at a time, least important first, and stops "
    "at the first removal that raises the held-out validation loss (cross-entropy per target token) "
    "more than --max-loss-increase above the unpruned model's, keeping the model from before it."
)


def build_parser() -> argparse.ArgumentParser:
    p = DOOR.parser(description=__doc__.split("\n\n")[1].replace("\n", " "), epilog=STOP_RULE)
    DOOR.checkpoint_options(p)
    DOOR.output_options(p)
    p.add_argument(
        "--sentences",
        type=at_least(2),
        default=None,
        help="the first n validation sentences for ablation, importance and the pruning search "
        "(default: all of the split, 1,014 in Multi30k; fewer give wider intervals)",
    )
    p.add_argument(
        "--resamples",
        type=at_least(1),
        default=RESAMPLES,
        help=f"bootstrap resamples for every interval (default {RESAMPLES})",
    )
    p.add_argument("--seed", type=at_least(0), default=SEED, help=f"bootstrap and fine-tuning seed (default {SEED})")
    p.add_argument("--prune", action="store_true", help="prune heads greedily and save pruned.pt")
    p.add_argument(
        "--max-loss-increase",
        type=number(0, None),
        default=None,
        help=f"with --prune: the most the held-out validation loss may rise, in nats per token "
        f"(default {MAX_LOSS_INCREASE})",
    )
    p.add_argument(
        "--finetune-steps",
        type=at_least(0),
        default=None,
        help="with --prune: at most this many training steps on Multi30k's training split after "
        f"pruning, keeping the model with the lowest held-out loss (checked every "
        f"{FINETUNE_CHECK_EVERY} steps; stops after {FINETUNE_PATIENCE} checks without a new "
        f"lowest) (default 0)",
    )
    Decoding.add_options(
        p, "beam", "length_penalty", purpose="with --prune", beam_help="beam width for test BLEU and speed"
    )
    p.add_argument(
        "--test-sentences",
        type=at_least(1),
        default=None,
        help="with --prune: score and time only the first n test sentences (default: all 1,000)",
    )
    p.add_argument("--threads", type=at_least(1), default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--device", type=device, default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, checked before any data or model work: one line and exit 2 (SystemExit) if wrong."""
    args = build_parser().parse_args(argv)
    DOOR.checkpoint(args)
    for flag, value in (
        ("--max-loss-increase", args.max_loss_increase),
        ("--test-sentences", args.test_sentences),
        ("--finetune-steps", args.finetune_steps),
        ("--length-penalty", args.length_penalty),
    ):
        if value is not None and not args.prune:
            DOOR.fail(f"{flag} only applies with --prune ({DOOR.typed('--prune')}, or drop {flag})")
    args.max_loss_increase = MAX_LOSS_INCREASE if args.max_loss_increase is None else args.max_loss_increase
    args.finetune_steps = args.finetune_steps or 0
    names = ["heads.json", *(f"heads_{k}.png" for k in KINDS), "heads_inspect.png", "heads_examples.png"]
    DOOR.outputs(args, names + (["heads_pruning.png", "pruned.pt"] if args.prune else []), args.checkpoint)
    args.device = torch.device(args.device)
    return args


# ---------------------------------------------------------------- data and evaluation


def _batches(encoded, indices, max_len: int, **order):
    """Batches of the pairs `encoded[i]`, i in `indices`, that fit the model; `order`: make_batches' shuffle, seed."""
    chosen = [encoded[i] for i in indices]
    kept, _ = split_long(chosen, max_len)  # teacher-forced passes need pairs that fit the model
    return make_batches([chosen[i] for i in kept], max_tokens=4000, **order)


def _data(meta: dict, tokenizer, n: int, max_len: int, prune: bool, n_test: int | None):
    src, tgt = languages_of(meta)
    every = load_multi30k("val", src, tgt)
    val = every[:n]
    encoded = encode_pairs(val, tokenizer)
    test = load_multi30k("test_2016_flickr", src, tgt)[:n_test] if prune else None
    return val, encoded, _batches(encoded, range(len(val)), max_len), test, len(every)


def evaluation(model, tokenizer, pairs, batches, device) -> dict:
    """Greedy translations of `pairs` and per-sentence losses on `batches`: what the bootstrap resamples."""
    scores, hyps = evaluate_bleu(model, tokenizer, pairs, 1, 0.0, device)
    loss, tokens = sentence_losses(model, batches)
    return {"bleu": scores["bleu"], "loss": float(loss.sum() / tokens.sum()), "hyps": hyps, "losses": (loss, tokens)}


def changes(base: dict, other: dict, refs: list[str], resamples: int, seed: int) -> dict[str, Change]:
    """BLEU and loss of `other` minus those of `base`, with paired bootstrap intervals."""
    (loss_a, tokens_a), (loss_b, tokens_b) = base["losses"], other["losses"]
    return {
        "bleu": paired_bleu_change(base["hyps"], other["hyps"], refs, resamples, seed),
        "loss": paired_loss_change(loss_a, tokens_a, loss_b, tokens_b, resamples, seed),
    }


def change_json(c: Change) -> dict:
    return {"value": c.value, "low": c.low, "high": c.high, "significant": c.significant}


def format_change(c: dict, fmt: str) -> str:
    """`-1.20 [-2.31, -0.12]*`: a `change_json`, its interval, and `*` when the interval excludes 0."""
    return f"{c['value']:{fmt}} [{c['low']:{fmt}}, {c['high']:{fmt}}]{'*' if c['significant'] else ' '}"


def noisy_advice(widths: list[float], n: int, available: int) -> str | None:
    """A line when the median BLEU interval is wider than NOISY_BLEU; intervals shrink about as 1 / sqrt(n).
    `available`: how many validation sentences there are.

    >>> noisy_advice([0.5, 0.8], 300, 1014) is None
    True
    >>> noisy_advice([2.0, 2.0, 3.0], 300, 1014)
    'noisy: the median BLEU interval is 2.00 wide on 300 sentences, and even all 1014 validation sentences would leave it wider than 1; read the intervals, not the values'
    >>> noisy_advice([2.0, 2.0, 3.0], 100, 1014)
    'noisy: the median BLEU interval is 2.00 wide on 100 sentences; use --sentences 400 (or more)'
    """
    median = float(np.median(widths))
    if median <= NOISY_BLEU:
        return None
    want = math.ceil(n * (median / NOISY_BLEU) ** 2 / 100) * 100
    if want > available:
        return (
            f"noisy: the median BLEU interval is {median:.2f} wide on {n} sentences, and even all {available} "
            f"validation sentences would leave it wider than {NOISY_BLEU:g}; read the intervals, not the values"
        )
    return f"noisy: the median BLEU interval is {median:.2f} wide on {n} sentences; use --sentences {want} (or more)"


# ---------------------------------------------------------------- table, JSON, pictures


def measure_ranges(report: dict) -> dict[str, tuple[float, float]]:
    """One colour range per measure over all three kinds: importance from 0, changes symmetric about 0."""

    def top(key, field=None) -> float:  # the measure's largest size (1 if all are 0); importance is never negative
        return (
            max(abs(v if field is None else v[field]) for k in KINDS for row in report["kinds"][k][key] for v in row)
            or 1.0
        )

    importance, bleu, loss = top("importance"), top("bleu_change", "value"), top("loss_change", "value")
    return {"importance": (0.0, importance), "bleu_change": (-bleu, bleu), "loss_change": (-loss, loss)}


PANELS = (
    ("importance", "importance E|dL/dxi|", ".3g", "importance"),
    ("bleu_change", "val BLEU change without the head", "+.2f", "BLEU change"),
    ("loss_change", "val loss change without the head", "+.3f", "loss change (nats per token)"),
)


def heat_map(kind: str, report: dict, ranges: dict[str, tuple[float, float]]):
    """One row of (N layers x h heads) panels, one per measure, in the colour range shared by all kinds.
    Hatched: a change whose bootstrap interval contains 0 (not significant)."""
    k = report["kinds"][kind]
    fig = figure(figsize=(4.4 * len(PANELS), 1.6 + 0.7 * len(k["importance"])))
    for ax, (key, title, fmt, bar) in zip(fig.subplots(1, len(PANELS), squeeze=False)[0], PANELS):
        change = key != "importance"
        rows = [[v["value"] for v in row] for row in k[key]] if change else k[key]  # [layer][head]
        width = max(len(r) for r in rows)
        data = np.array([list(r) + [math.nan] * (width - len(r)) for r in rows], dtype=float)  # (N, max h): nan, pruned
        low, high = ranges[key]
        im = ax.imshow(data, cmap=CMAP, vmin=low, vmax=high, aspect="auto")
        for (l, i), v in np.ndenumerate(data):
            if math.isnan(v):
                continue
            quiet = change and not k[key][l][i]["significant"]
            if quiet:
                ax.add_patch(Rectangle((i - 0.5, l - 0.5), 1, 1, fill=False, hatch="//", edgecolor="0.6", lw=0))
            dark = (v - low) / ((high - low) or 1.0) < 0.5  # viridis-like maps: light text on the dark half
            colour = ("0.75" if dark else "0.35") if quiet else ("w" if dark else "k")
            ax.text(i, l, format(v, fmt), ha="center", va="center", fontsize=8, color=colour)
        ax.set_xticks(range(data.shape[1]))
        ax.set_yticks(range(data.shape[0]))
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_title(f"{kind}: {title}" + ("\n(hatched, grey: 95% interval contains 0)" if change else ""), fontsize=9)
        fig.colorbar(im, ax=ax, label=bar)
    fig.suptitle("colour scales shared by heads_enc_self.png, heads_dec_self.png and heads_cross.png", fontsize=8)
    fig.tight_layout()
    return fig


def example_sentence(pairs, encoded, max_len: int, shortest: int = 6, longest: int = 12) -> int:
    """Index of the first pair whose source and target both have `shortest` to `longest` subwords
    (else the shortest pair that fits the model), so that each head's grid stays legible."""
    fits = [i for i, (s, t) in enumerate(encoded) if 0 < len(s) <= max_len and len(t) + 1 <= max_len]
    if not fits:
        raise ValueError("no validation sentence fits the model's max_len for the example picture")
    for i in fits:
        if all(shortest <= len(x) <= longest for x in encoded[i]):
            return i
    return min(fits, key=lambda i: max(len(encoded[i][0]), len(encoded[i][1])))


@torch.no_grad()
def examples_figure(model, tokenizer, src_ids: list[int], tgt_ids: list[int], labels: dict, title: str = ""):
    """A row of small grids per attention, one per head: its attention on one sentence, teacher-forced with
    the reference translation; rows and columns labelled as the dump's (`dump.ROWS_COLS`); titles carry each
    head's label."""
    attn = collect_attention(model.eval(), src_ids, tgt_ids + [EOS])  # {kind: per layer (1, h, T_q, T_k)}
    tokens = {
        "src_tokens": token_labels(tokenizer, src_ids),
        "tgt_in_tokens": token_labels(tokenizer, [BOS] + tgt_ids),
        "tgt_out_tokens": token_labels(tokenizer, tgt_ids + [EOS]),
    }
    rows = [
        (
            attn[k][l][0],
            *(tokens[name] for name in ROWS_COLS[k]),
            k,
            [f"{k}[{l}] head {i}: {t}" for i, t in enumerate(labels[k][l])],
        )
        for k, l in sites(model)
    ]
    width = max(attention_at(model, *s).h for s in sites(model))
    fig = figure(figsize=(2.6 * width + 1.5, 2.9 * len(rows) + 0.8), layout="constrained")
    axes = panel_rows(fig, rows, label_font_size(max(len(src_ids), len(tgt_ids) + 1), 2.2), every_column_labelled=True)
    for ax in axes[:, 0]:
        ax.set_ylabel("query", fontsize=7)
    for ax in axes[-1]:
        ax.set_xlabel("key", fontsize=7)
    fig.suptitle(title or "each head on one validation sentence (teacher-forced with its reference)", fontsize=9)
    return fig


def format_table(report: dict) -> str:
    base = report["baseline"]
    lines = [
        f"{'kind':8s} {'layer':>5s} {'head':>4s} {'importance':>10s}  {'val BLEU change [95%]':24s} "
        f"{'val loss change [95%]':27s} label"
    ]
    for kind in KINDS:
        k = report["kinds"][kind]
        for l, row in enumerate(k["importance"]):
            for i, imp in enumerate(row):
                lines.append(
                    f"{kind:8s} {l:5d} {i:4d} {imp:10.4f}  {format_change(k['bleu_change'][l][i], '+6.2f'):24s} "
                    f"{format_change(k['loss_change'][l][i], '+7.3f'):27s} {k['label'][l][i]}"
                )
    v = report["validation"]
    lines.append(
        f"baseline: val BLEU {base['bleu']:.2f} (greedy) and val loss {base['loss']:.3f} ({LOSS_NAME}) on "
        f"{v['sentences']} validation sentences; [low, high]: {v['confidence']:.0%} paired bootstrap "
        f"interval ({v['resamples']} resamples, seed {v['seed']}); *: the interval excludes 0"
    )
    lines.extend(loss_lines(report))
    return "\n".join(lines)


LOSS_NAME = "cross-entropy per target token, no label smoothing"


def loss_lines(report: dict) -> list[str]:
    """What the loss above is next to the val loss of a training run's log, which is label-smoothed."""
    base, log = report["baseline"], report.get("run_log")
    lines = []
    if base.get("loss_label_smoothed") is not None:
        lines.append(
            f"  with the training's label smoothing {base['label_smoothing']:g} the same sentences give "
            f"{base['loss_label_smoothed']:.3f}: the quantity a run's log calls val loss, there on all "
            f"{report['validation']['of']} validation sentences"
        )
    if log is not None:
        which = (
            f"the model of epoch {log['epoch']}, the last of the {log['averaged']} epochs this checkpoint "
            f"averages (the averaged model has no log line of its own)"
            if log.get("averaged")
            else f"this model, epoch {log['epoch']}"
        )
        lines.append(f"  the run's log: val loss {log['val_loss']:.3f} for {which}")
    return lines


def label_smoothing_of(meta: dict) -> float | None:
    """The label smoothing the checkpoint was trained with, if it says (`train_config`)."""
    value = (meta.get("train_config") or {}).get("label_smoothing")
    return None if value is None else float(value)


def run_log_loss(meta: dict) -> dict | None:
    """The val loss a run's log printed for the checkpoint's epoch, if the checkpoint carries it."""
    if meta.get("val_loss") is None:
        return None
    return {
        "val_loss": float(meta["val_loss"]),
        "epoch": meta.get("epoch"),
        "averaged": len(meta["averaged"]) if meta.get("averaged") else None,
    }


# ---------------------------------------------------------------- the command


def analyse(model, tokenizer, val, batches, args) -> tuple[dict, dict]:
    """(the report's numbers, the attention measures of `position_profiles`)."""
    refs = [t for _, t in val]
    baseline = evaluation(model, tokenizer, val, batches, args.device)
    importance = head_importance(model, batches, progress=True)
    normalised = normalise_per_attention(importance)
    ablation = ablate(
        model,
        lambda m: changes(
            baseline, evaluation(m, tokenizer, val, batches, args.device), refs, args.resamples, args.seed
        ),
        progress=True,
    )
    profiles = position_profiles(model, batches, WINDOW, progress=True)
    labels = head_labels(profiles)
    kinds = {}
    for kind in KINDS:
        spectra = [bilinear_spectra(attention_at(model, kind, l)) for l in range(model.config.N)]
        kinds[kind] = {
            "importance": importance[kind],
            "importance_normalised": normalised[kind],
            "bleu_change": [[change_json(r["bleu"]) for r in row] for row in ablation[kind]],
            "loss_change": [[change_json(r["loss"]) for r in row] for row in ablation[kind]],
            "label": labels[kind],
            "entropy": [m["entropy"] for m in profiles[kind]],
            "position_profile": [profile_rows(m) for m in profiles[kind]],
            "uniform_position_profile": [
                list(m["uniform_offsets"]) + [m.get("uniform_last", math.nan)] for m in profiles[kind]
            ],
            "first_key": [m["first"] for m in profiles[kind]],
            "qk_singular_values": [s["qk"].tolist() for s in spectra],
            "vo_singular_values": [s["vo"].tolist() for s in spectra],
        }
        if kind == "cross":
            kinds[kind]["diagonal_share"] = [m["diagonal"] for m in profiles[kind]]
    return {
        "baseline": {"bleu": baseline["bleu"], "loss": baseline["loss"]},
        "kinds": kinds,
        "position_profile_offsets": list(range(-WINDOW, WINDOW + 1)) + ["last source token"],
    }, profiles


def prune_and_measure(model, tokenizer, meta, val, encoded, test, args, say) -> dict:
    ranking, held_out = split_sentences(len(val))
    rank_batches = _batches(encoded, ranking, model.config.max_len)
    held_batches = _batches(encoded, held_out, model.config.max_len)
    held_pairs, refs = [val[i] for i in held_out], [t for _, t in test]

    def held_out_loss(m) -> float:
        loss, tokens = sentence_losses(m, held_batches)
        return float(loss.sum() / tokens.sum())

    def greedy_bleu(m, pairs) -> float:  # along the path: a greedy decoding per point is what the curve costs
        return evaluate_bleu(m, tokenizer, pairs, 1, 0.0, args.device)[0]["bleu"]

    def point(m, loss: float, kept: bool) -> dict:
        return {
            "held_out_loss": loss,
            "held_out_bleu": greedy_bleu(m, held_pairs),
            "test_bleu": greedy_bleu(m, test),
            "kept": kept,
        }

    path: list[dict] = []  # one point per removal, past the stop too
    result = greedy_prune(
        model,
        held_out_loss,
        lambda m: head_importance(m, rank_batches),
        args.max_loss_increase,
        progress=True,
        beyond_stop=True,
        on_step=lambda step, m: path.append(point(m, step.held_out_loss, step.kept)),
    )
    path.insert(0, point(model, result.baseline_loss, True))  # the unpruned model starts the curve
    curve = [{"heads_removed": i, **p} for i, p in enumerate(path)]
    batches = []
    if args.finetune_steps:
        train = encode_pairs(load_multi30k("train", *languages_of(meta)), tokenizer)
        batches = _batches(train, range(len(train)), model.config.max_len, shuffle=True, seed=0)
    tuning = finetune(result.model, batches, args.finetune_steps, held_out_loss, progress=True, seed=args.seed)
    pruned, steps, final_loss = tuning.model, tuning.steps, min(loss for _, loss in tuning.checks)
    total = sum(attention_at(model, *s).h for s in sites(model))
    alpha = model_length_penalty(meta) if args.length_penalty is None else args.length_penalty
    hyps = [evaluate_bleu(m, tokenizer, test, args.beam, alpha, args.device)[1] for m in (model, pruned)]
    test_change = change_json(paired_bleu_change(hyps[0], hyps[1], refs, args.resamples, args.seed))
    # decoding speed, timed alone: SPEED_ROUNDS alternating rounds of translating the test sources
    sources = [tokenizer.encode(s) for s, _ in test]
    speeds = alternating_speed(
        {"before": model, "after": pruned}, sources, args.beam, alpha, SPEED_ROUNDS, progress=True
    )

    def measured(k: str, m, hyps: list[str]) -> dict:
        s = score(hyps, refs)
        return {
            "test_bleu": s["bleu"],
            "test_bleu_lowercase": s["bleu_lowercase"],
            "parameters": count_parameters(m),
            "heads": sum(attention_at(m, *x).h for x in sites(m)),
            "sentences_per_second": round(max(speeds[k]), 2),
            "speeds": [round(x, 3) for x in speeds[k]],
        }

    b, a = measured("before", model, hyps[0]), measured("after", pruned, hyps[1])
    removed = [f"{r.kind}[{r.layer}].{r.head}" for r in result.removed]
    counts = head_counts(pruned)
    facts = dict(pruned_from=str(args.checkpoint), heads_removed=removed, head_counts=counts, finetune_steps=steps)
    save_pruned(args.out / "pruned.pt", pruned, tokenizer, dict(meta, **facts), read_case_table(args.checkpoint))
    tuned = None
    if args.finetune_steps:
        tuned = {"finetune_steps": steps, "held_out_loss": final_loss, "test_bleu": greedy_bleu(pruned, test)}
    figure = curve_figure(
        curve,
        result.baseline_loss,
        args.max_loss_increase,
        len(removed),
        len(test),
        tuned,
        title=typed_name(args.checkpoint),
    )
    save_figure(figure, args.out / "heads_pruning.png")
    ratio = speed_ratio(a["speeds"], b["speeds"])
    say(f"pruning: removed {len(removed)} of {total} heads ({len(removed) / total:.0%}): {', '.join(removed) or '-'}")
    say(
        f"  held-out validation loss ({len(held_out)} sentences, not used for ranking; cross-entropy per target "
        f"token, no label smoothing): {result.baseline_loss:.4f} -> "
        f"{result.removed[-1].held_out_loss if result.removed else result.baseline_loss:.4f} "
        f"(stop rule: at most +{args.max_loss_increase:g})"
        + (
            f", {final_loss:.4f} after {steps} fine-tuning steps (the lowest of the checks every "
            f"{FINETUNE_CHECK_EVERY} steps; at most {args.finetune_steps})"
            if args.finetune_steps
            else ""
        )
    )
    say(f"  parameters: {b['parameters']:,} -> {a['parameters']:,}")
    say(
        f"  test_2016_flickr BLEU (beam {args.beam}, {len(test)} sentences): {b['test_bleu']:.2f} -> "
        f"{a['test_bleu']:.2f}, change {format_change(test_change, '+.2f')} (95% paired bootstrap)"
    )
    say(
        f"  decoding speed: {b['sentences_per_second']:.1f} -> {a['sentences_per_second']:.1f} sentences/s "
        f"(fastest round of each), {ratio:.2f}x (median of the {SPEED_ROUNDS} rounds' ratios); beam {args.beam}, "
        f"{args.device}, {torch.get_num_threads()} threads; timed alone, alternating rounds"
    )
    say(f"  the path, past the stop to one head per attention: {args.out / 'heads_pruning.png'}")
    say(f"  pruned checkpoint: {args.out / 'pruned.pt'}")
    return {
        "stop_rule": STOP_RULE,
        "max_loss_increase": args.max_loss_increase,
        "ranking_sentences": len(ranking),
        "held_out_sentences": len(held_out),
        "baseline_held_out_loss": result.baseline_loss,
        "steps": [dataclasses.asdict(s) for s in result.steps],
        "beyond_stop": [dataclasses.asdict(r) for r in result.beyond],
        "curve": curve,
        "finetune_steps": steps,
        "finetune_max_steps": args.finetune_steps,
        "finetune_checks": [list(c) for c in tuning.checks] if args.finetune_steps else [],
        "held_out_loss_final": final_loss,
        "finetuned": tuned,
        "removed": removed,
        "heads_total": total,
        "before": b,
        "after": a,
        "test_bleu_change": test_change,
        "speed_ratio": ratio,
        "beam": args.beam,
        "length_penalty": alpha,
        "speed_rounds": SPEED_ROUNDS,
        "test_sentences": len(test),
        "device": str(args.device),
        "threads": torch.get_num_threads(),
        "checkpoint": str(args.out / "pruned.pt"),
    }


def write_pictures(model, tokenizer, report: dict, profiles_for_page, val, encoded, args) -> None:
    ranges = measure_ranges(report)
    for kind in KINDS:
        save_figure(heat_map(kind, report, ranges), args.out / f"heads_{kind}.png")
    save_figure(
        inspect_figure(model, profiles_for_page, WINDOW, title=typed_name(args.checkpoint)),
        args.out / "heads_inspect.png",
    )
    i = example_sentence(val, encoded, model.config.max_len)
    labels = {k: report["kinds"][k]["label"] for k in KINDS}
    (src, tgt), (source, reference) = encoded[i], val[i]
    page = examples_figure(model, tokenizer, src, tgt, labels, f"validation sentence {i}: {source}  ->  {reference}")
    save_figure(page, args.out / "heads_examples.png")


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except SystemExit as e:  # --help (0) or a bad option, already reported in one line (2)
        return e.code if isinstance(e.code, int) else 2
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        model, tokenizer, meta = load_checkpoint(args.checkpoint)
        check_tokenizer(tokenizer, args.checkpoint, "be evaluated")
        val, encoded, batches, test, available = _data(
            meta, tokenizer, args.sentences, model.config.max_len, args.prune, args.test_sentences
        )
    except (CheckpointError, DataError) as e:
        DOOR.say(f"error: {e}")
        return 2
    model = model.to(args.device)
    report: dict[str, Any] = {
        "checkpoint": str(args.checkpoint),
        "validation": {
            "split": "val",
            "sentences": len(val),
            "of": available,
            "decoding": "greedy",
            "loss": LOSS_NAME,
            "loss_label_smoothed": "the same with the training's label smoothing: the val loss of a run's log",
            "resamples": args.resamples,
            "seed": args.seed,
            "confidence": CONFIDENCE,
        },
        "run_log": run_log_loss(meta),
    }
    numbers, profiles = analyse(model, tokenizer, val, batches, args)
    report.update(numbers)
    eps = label_smoothing_of(meta)  # the label-smoothed loss of training's `evaluate_loss` is a run's logged val loss
    report["baseline"].update(
        label_smoothing=eps,
        loss_label_smoothed=None if eps is None else evaluate_loss(model, batches, eps, args.device),
    )
    print(format_table(report), flush=True)
    widths = [c["high"] - c["low"] for k in KINDS for row in report["kinds"][k]["bleu_change"] for c in row]
    advice = noisy_advice(widths, len(val), available)
    if advice:
        print(advice, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write(args.out / "heads.json", json.dumps(json_safe(report, digits=6), indent=1))
    write_pictures(model, tokenizer, report, profiles, val, encoded, args)
    print(
        f"wrote {args.out / 'heads.json'}, heads_<kind>.png, heads_inspect.png and heads_examples.png in {args.out}",
        flush=True,
    )
    if args.prune:
        report["pruning"] = prune_and_measure(
            model, tokenizer, meta, val, encoded, test, args, lambda s: print(s, flush=True)
        )
        atomic_write(args.out / "heads.json", json.dumps(json_safe(report, digits=6), indent=1))
    return 0


if __name__ == "__main__":
    from annotated.plumbing.scripts import run_main

    run_main(main)
