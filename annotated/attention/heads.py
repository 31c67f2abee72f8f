"""`python -m annotated.attention.heads [--checkpoint PATH] [--prune [--threshold 0.5]] [--sentences N]` (`make heads`).

For every head of every attention: Michel et al.'s importance, validation BLEU and loss without it, and its
average attention by relative position; one table on stdout, `heads.json`, one heat map per attention kind
(`heads_<kind>.png`) and one inspection page (`heads_inspect.png`), written beside the checkpoint or in
`--out`. With `--prune`: greedy pruning on the same validation sentences, `pruned.pt`, and test BLEU and
decoding speed of both models, measured in this run. The chapters are `annotated/attention/importance.py`,
`annotated/attention/prune.py` and `annotated/attention/profiles.py`.
"""
from __future__ import annotations

if __name__ == "__main__":  # as a command: a Ctrl-C while torch loads is one line, exit 130
    from annotated.plumbing.interrupts import quiet_ctrl_c_while_starting
    quiet_ctrl_c_while_starting("python -m annotated.attention.heads")

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from annotated.plumbing.options import Parser, at_least, device, fail, number, writable_dir
from annotated.sites import KINDS, attention_at, sites
from annotated.attention.importance import ablate, head_importance, normalise_per_attention

NAME = "python -m annotated.attention.heads"
WINDOW = 4  # offsets -4 ... +4 in the position profiles
SPEED_ROUNDS = 3  # timings alternate unpruned / pruned this many times; the fastest of each counts


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog=NAME, description=__doc__.split("\n\n")[1].replace("\n", " "))
    p.add_argument("--checkpoint", type=Path, default=None,
                   help="checkpoint file (default: runs/latest/best.pt, else the newest runs/*/best.pt)")
    p.add_argument("--out", type=writable_dir, default=None, help="output folder (default: the checkpoint's folder)")
    p.add_argument("--sentences", type=at_least(1), default=300,
                   help="validation sentences for ablation, importance and the pruning search (default 300)")
    p.add_argument("--prune", action="store_true", help="prune heads greedily and save pruned.pt")
    p.add_argument("--threshold", type=number(0, None), default=None,
                   help="with --prune: the most validation BLEU the pruned model may lose (default 0.5)")
    p.add_argument("--beam", type=at_least(1), default=4,
                   help="beam width for test BLEU and speed with --prune (default 4)")
    p.add_argument("--test-sentences", type=at_least(1), default=None,
                   help="with --prune: score and time only the first n test sentences (default: all 1,000)")
    p.add_argument("--threads", type=at_least(1), default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--device", type=device, default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--force", action="store_true", help="overwrite outputs of an earlier run in the output folder")
    return p


def outputs(prune: bool) -> list[str]:
    names = ["heads.json"] + [f"heads_{k}.png" for k in KINDS] + ["heads_inspect.png"]
    return names + (["pruned.pt"] if prune else [])


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """The options, checked before any data or model work: one line and exit 2 (SystemExit) if wrong."""
    args = build_parser().parse_args(argv)
    if args.checkpoint is None:
        from annotated.plumbing.checkpoint import CheckpointError, latest_checkpoint

        try:
            args.checkpoint = latest_checkpoint("runs")
        except CheckpointError as e:
            fail(NAME, str(e))
        print(f"{NAME}: using {args.checkpoint}", file=sys.stderr)
    if not args.checkpoint.is_file():
        fail(NAME, f"--checkpoint {args.checkpoint}: no such file")
    for flag, value in (("--threshold", args.threshold), ("--test-sentences", args.test_sentences)):
        if value is not None and not args.prune:
            fail(NAME, f"{flag} only applies with --prune (add --prune, or drop {flag})")
    args.threshold = 0.5 if args.threshold is None else args.threshold
    args.out = args.out if args.out is not None else args.checkpoint.parent
    existing = [n for n in outputs(args.prune) if (args.out / n).exists()]
    if existing and not args.force:
        fail(NAME, f"{args.out / existing[0]} exists (from an earlier run); add --force to overwrite, or pick --out")
    args.device = torch.device(args.device)
    return args


# ---------------------------------------------------------------- data and evaluation

def _data(meta: dict, tokenizer, n: int, max_len: int, prune: bool, n_test: Optional[int]):
    from annotated.training.data import encode_pairs, load_multi30k, make_batches, split_long

    src, tgt = meta.get("src_lang", "de"), meta.get("tgt_lang", "en")
    val = load_multi30k("val", src, tgt)[:n]
    encoded = encode_pairs(val, tokenizer)
    kept, _ = split_long(encoded, max_len)  # teacher-forced passes need pairs that fit the model
    batches = make_batches([encoded[i] for i in kept], max_tokens=4000)
    test = load_multi30k("test_2016_flickr", src, tgt)[:n_test] if prune else None
    return val, batches, test


def _evaluators(tokenizer, val, batches, device):
    from annotated.training.evaluate import evaluate_bleu
    from annotated.training.train import evaluate_loss

    def bleu(model) -> float:
        return evaluate_bleu(model, tokenizer, val, 1, 0.0, device)[0]["bleu"]

    def loss(model) -> float:
        return evaluate_loss(model, batches, 0.0, device)  # cross-entropy per token (no smoothing)

    return bleu, loss


# ---------------------------------------------------------------- table, JSON, pictures

def _grid(rows: list[list[float]]) -> np.ndarray:
    """Ragged [layer][head] -> (N, max h) array, nan where a layer has fewer heads."""
    width = max(len(r) for r in rows)
    return np.array([list(r) + [math.nan] * (width - len(r)) for r in rows], dtype=float)


def heat_map(kind: str, panels: list[tuple[str, list[list[float]], str, Optional[str]]], path: Path) -> None:
    """One row of (N layers x h heads) panels: (title, values, number format, diverging colour map or None).

    A change is coloured around 0, red where the model gets worse."""
    from annotated.attention.profiles import save_figure
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.2 * len(panels), 1.2 + 0.7 * len(panels[0][1])))
    FigureCanvasAgg(fig)
    for ax, (title, rows, fmt, cmap) in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels):
        data = _grid(rows)
        top = float(np.nanmax(np.abs(data))) or 1.0
        im = ax.imshow(data, cmap=cmap or "viridis", aspect="auto", **({"vmin": -top, "vmax": top} if cmap else {}))
        for (l, i), v in np.ndenumerate(data):
            if not math.isnan(v):
                dark = not cmap or abs(v) > 0.6 * top  # white text on a dark cell
                ax.text(i, l, format(v, fmt), ha="center", va="center", color="w" if dark else "k", fontsize=8)
        ax.set_xticks(range(data.shape[1]))
        ax.set_yticks(range(data.shape[0]))
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_title(f"{kind}: {title}", fontsize=9)
        fig.colorbar(im, ax=ax)
    fig.tight_layout()
    save_figure(fig, path)


def _json_ready(x):
    if isinstance(x, float):
        return None if math.isnan(x) else round(x, 6)
    if isinstance(x, dict):
        return {k: _json_ready(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_ready(v) for v in x]
    if isinstance(x, np.ndarray):
        return _json_ready(x.tolist())
    return x


def format_table(report: dict) -> str:
    base = report["baseline"]
    lines = [f"{'kind':8s} {'layer':>5s} {'head':>4s} {'importance':>10s} {'val BLEU w/o':>14s} "
             f"{'val loss w/o':>16s}  habit (mean attention)",
             ]
    for kind in KINDS:
        k = report["kinds"][kind]
        for l, row in enumerate(k["importance"]):
            for i, imp in enumerate(row):
                b, c = k["ablation_bleu"][l][i], k["ablation_loss"][l][i]
                lines.append(f"{kind:8s} {l:5d} {i:4d} {imp:10.4f} {b:6.2f} ({b - base['bleu']:+5.2f}) "
                             f"{c:7.3f} ({c - base['loss']:+6.3f})  {k['habit'][l][i]}")
    lines.append(f"baseline: val BLEU {base['bleu']:.2f}, val loss {base['loss']:.3f} "
                 f"({report['validation']['sentences']} sentences, greedy)")
    return "\n".join(lines)


# ---------------------------------------------------------------- the command

def analyse(model, tokenizer, val, batches, device) -> dict:
    from annotated.attention.profiles import bilinear_spectra, habit, position_profiles

    bleu, loss = _evaluators(tokenizer, val, batches, device)
    baseline = {"bleu": bleu(model), "loss": loss(model)}
    importance = head_importance(model, batches, progress=True)
    normalised = normalise_per_attention(importance)
    ablation = ablate(model, lambda m: {"bleu": bleu(m), "loss": loss(m)}, progress=True)
    profiles = position_profiles(model, batches, WINDOW, progress=True)
    kinds = {}
    for kind in KINDS:
        spectra = [bilinear_spectra(attention_at(model, kind, l)) for l in range(model.config.N)]
        kinds[kind] = {
            "importance": importance[kind], "importance_normalised": normalised[kind],
            "ablation_bleu": [[r["bleu"] for r in row] for row in ablation[kind]],
            "ablation_loss": [[r["loss"] for r in row] for row in ablation[kind]],
            "position_profile": [p.tolist() for p in profiles[kind]],
            "habit": [[habit(h, WINDOW) for h in p] for p in profiles[kind]],
            "qk_singular_values": [s["qk"].tolist() for s in spectra],
            "vo_singular_values": [s["vo"].tolist() for s in spectra],
        }
    return {"baseline": baseline, "kinds": kinds,
            "position_profile_offsets": list(range(-WINDOW, WINDOW + 1)) + ["last source token"]}


def prune_and_measure(model, tokenizer, meta, val, batches, test, args, say, baseline: float) -> dict:
    from annotated.sites import head_counts
    from annotated.attention.prune import count_parameters, greedy_prune, removal_table, save_pruned, timed_translation
    from annotated.training.evaluate import score
    from tqdm.auto import tqdm

    bleu, _ = _evaluators(tokenizer, val, batches, args.device)
    result = greedy_prune(model, bleu, lambda m: head_importance(m, batches), args.threshold, progress=True,
                          baseline=baseline)
    pruned = result.model
    total = sum(attention_at(model, *s).h for s in sites(model))
    sources, refs = [tokenizer.encode(s) for s, _ in test], [t for _, t in test]
    models, rows = {"before": model, "after": pruned}, {}
    for rnd in tqdm(range(SPEED_ROUNDS), desc="test BLEU and speed", leave=False):
        for name, m in models.items():
            ids, speed = timed_translation(m, sources, args.beam, 0.6)
            if rnd == 0:
                s = score([tokenizer.decode(x) for x in ids], refs)
                rows[name] = {"test_bleu": s["bleu"], "test_bleu_lowercase": s["bleu_lowercase"],
                              "sentences_per_second": speed, "parameters": count_parameters(m),
                              "heads": sum(attention_at(m, *site).h for site in sites(m)),
                              "output_subwords": sum(map(len, ids))}
            row = rows[name]
            row["sentences_per_second"] = round(max(row["sentences_per_second"], speed), 2)
            # outputs of different lengths take different times: subwords per second is the rate per step
            row["subwords_per_second"] = round(row["sentences_per_second"] * row["output_subwords"] / len(ids), 1)
    removed = [f"{r.kind}[{r.layer}].{r.head}" for r in result.removed]
    save_pruned(args.out / "pruned.pt", pruned, tokenizer,
                dict(meta, pruned_from=str(args.checkpoint), heads_removed=removed, head_counts=head_counts(pruned)))
    b, a = rows["before"], rows["after"]
    say(f"pruning: removed {len(removed)} of {total} heads ({len(removed) / total:.0%}): {', '.join(removed) or '-'}")
    say(f"  validation BLEU (greedy, {len(val)} sentences): {result.baseline_bleu:.2f} -> "
        f"{result.removed[-1].val_bleu if result.removed else result.baseline_bleu:.2f} (threshold {args.threshold})")
    say(f"  parameters: {b['parameters']:,} -> {a['parameters']:,}")
    say(f"  test_2016_flickr BLEU (beam {args.beam}, {len(test)} sentences): {b['test_bleu']:.2f} -> "
        f"{a['test_bleu']:.2f} (lowercased {b['test_bleu_lowercase']:.2f} -> {a['test_bleu_lowercase']:.2f})")
    say(f"  decoding speed: {b['sentences_per_second']:.1f} -> {a['sentences_per_second']:.1f} sentences/s "
        f"({a['sentences_per_second'] / b['sentences_per_second']:.2f}x), {b['subwords_per_second']:.0f} -> "
        f"{a['subwords_per_second']:.0f} output subwords/s ({a['subwords_per_second'] / b['subwords_per_second']:.2f}x)"
        f"; beam {args.beam}, {args.device}, {torch.get_num_threads()} threads, fastest of {SPEED_ROUNDS} "
        f"alternating rounds")
    say(f"  pruned checkpoint: {args.out / 'pruned.pt'}")
    return {"threshold": args.threshold, "baseline_val_bleu": result.baseline_bleu, "steps": removal_table(result),
            "removed": removed, "heads_total": total, "before": b, "after": a, "beam": args.beam,
            "speed_rounds": SPEED_ROUNDS, "test_sentences": len(test), "device": str(args.device),
            "threads": torch.get_num_threads(), "checkpoint": str(args.out / "pruned.pt")}


def main(argv: Optional[list[str]] = None) -> int:
    from annotated.plumbing.checkpoint import CheckpointError
    from annotated.training.data import DataError
    from annotated.plumbing.files import atomic_write
    from annotated.attention.profiles import inspect_figure, save_figure
    from annotated.plumbing.checkpoint import load_checkpoint

    try:
        args = parse_args(argv)
    except SystemExit as e:  # --help (0) or a bad option, already reported in one line (2)
        return e.code if isinstance(e.code, int) else 2
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        model, tokenizer, meta = load_checkpoint(args.checkpoint)
        if tokenizer is None:
            raise CheckpointError(f"checkpoint {args.checkpoint} holds no tokenizer, so it cannot be evaluated")
        val, batches, test = _data(meta, tokenizer, args.sentences, model.config.max_len, args.prune,
                                  args.test_sentences)
    except (CheckpointError, DataError) as e:
        print(f"{NAME}: error: {e}", file=sys.stderr)
        return 2
    model = model.to(args.device)
    report = {"checkpoint": str(args.checkpoint),
              "validation": {"split": "val", "sentences": len(val), "decoding": "greedy",
                             "loss": "cross-entropy per target token"}}
    report.update(analyse(model, tokenizer, val, batches, args.device))
    print(format_table(report), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write(args.out / "heads.json", json.dumps(_json_ready(report), indent=1))
    for kind in KINDS:
        k = report["kinds"][kind]
        base = report["baseline"]
        heat_map(kind, [("importance E|dL/dxi|", k["importance"], ".3g", None),
                        ("val BLEU change without the head",
                         [[b - base["bleu"] for b in r] for r in k["ablation_bleu"]], "+.2f", "RdBu"),
                        ("val loss change without the head",
                         [[c - base["loss"] for c in r] for r in k["ablation_loss"]], "+.3f", "RdBu_r")],
                 args.out / f"heads_{kind}.png")
    save_figure(inspect_figure(model, {k: report["kinds"][k]["position_profile"] for k in KINDS}, WINDOW,
                               title=str(args.checkpoint)), args.out / "heads_inspect.png")
    print(f"wrote {args.out / 'heads.json'}, heads_<kind>.png and heads_inspect.png in {args.out}", flush=True)
    if args.prune:
        report["pruning"] = prune_and_measure(model, tokenizer, meta, val, batches, test, args,
                                              lambda s: print(s, flush=True), report["baseline"]["bleu"])
        atomic_write(args.out / "heads.json", json.dumps(_json_ready(report), indent=1))
    return 0


if __name__ == "__main__":
    from annotated.plumbing.interrupts import run_command

    run_command(main, NAME)  # Ctrl-C: one line and exit code 130, not a traceback
