"""`python -m annotated.circuits.command [--checkpoint PATH] [--head KIND:LAYER:HEAD]` (`make circuits`).

Reads every head's QK and OV circuits from the weights (annotated/circuits/): ranks and singular values, the
direct path through the vocabulary and the positions, the copying score, the faithfulness of the direct path
on validation sentences (weights only, and with the LayerNorms exact), and for cross-attention the dictionaries in
context and the alignment error rate against a statistical aligner; each head's scores split into their terms and
where its real attention falls; and which earlier heads each head composes with. Two tables on stdout;
`circuits.json` and `circuits_*.png` beside the checkpoint or in `--out`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from annotated.attention.viewer import CIRCUITS_PAGE
from annotated.checkpoint import CheckpointError, languages_of, load_checkpoint
from annotated.circuits.aligner import lexicon as make_lexicon
from annotated.circuits.aligner import multi30k_alignments
from annotated.circuits.circuits import attentions
from annotated.circuits.composition import composition_figure, format_composition, reads_through
from annotated.circuits.interventions import format_interventions, role_interventions
from annotated.circuits.page import write_page
from annotated.circuits.pictures import dictionary_figure, faithfulness_figure, positions_figure, spectra_figure
from annotated.circuits.readout import Inputs, read_model
from annotated.door import Door
from annotated.plumbing.files import atomic_write, json_safe
from annotated.plumbing.options import at_least
from annotated.shipped import typed_name
from annotated.sites import KINDS
from annotated.training.data import DataError, collate, encode_pairs, load_multi30k, split_long

DOOR = Door(__file__)
REPORT = "circuits.json"
FIGURES = (
    "circuits_spectra.png",
    "circuits_positions.png",
    "circuits_faithfulness.png",
    "circuits_dictionary.png",
    "circuits_composition.png",
)
OUTPUTS = (REPORT, *FIGURES, CIRCUITS_PAGE)


def build_parser() -> argparse.ArgumentParser:
    p = DOOR.parser(description=__doc__.split("\n\n")[1].replace("\n", " "))
    DOOR.checkpoint_options(p)
    p.add_argument("--head", default=None, help="print one head's reading in full: KIND:LAYER:HEAD, e.g. cross:1:2")
    p.add_argument("--sentences", type=at_least(1), default=200, help="validation sentences for faithfulness")
    p.add_argument("--pairs", type=at_least(1), default=4000, help="training pairs for the dictionaries")
    p.add_argument("--no-aligner", action="store_true", help="skip the statistical aligner (no dictionary scores)")
    p.add_argument("--threads", type=at_least(1), default=None, help="torch CPU threads")
    DOOR.output_options(p)
    return p


def _head_choice(text: str | None) -> tuple[str, int, int] | None:
    if text is None:
        return None
    parts = text.split(":")
    if len(parts) != 3 or parts[0] not in KINDS or not parts[1].isdigit() or not parts[2].isdigit():
        DOOR.fail(f"--head {text!r}: write KIND:LAYER:HEAD with KIND one of {', '.join(KINDS)}, e.g. cross:1:2")
    return parts[0], int(parts[1]), int(parts[2])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, checked before any model or data work: one line and exit 2 (SystemExit) if wrong. The door
    turns `checkpoint` and `out` into the checkpoint file and the output folder."""
    args = build_parser().parse_args(argv)
    DOOR.checkpoint(args)
    args.head = _head_choice(args.head)
    DOOR.outputs(args, OUTPUTS, args.checkpoint)
    return args


def check_model(model, tokenizer, checkpoint: Path, head: tuple[str, int, int] | None) -> None:
    """The checks that need the loaded model: a tokenizer, and the head asked for."""
    if tokenizer is None:
        raise CheckpointError(
            f"checkpoint {checkpoint} holds no tokenizer, so its circuits cannot be read in words; "
            "use a checkpoint saved by train_wmt.py or `make import`"
        )
    cfg = model.config  # (load_checkpoint has checked that the tokenizer fits the model)
    if head is not None:
        kind, layer, i = head
        if layer >= cfg.N:
            raise CheckpointError(f"--head {kind}:{layer}:{i}: the model has layers 0..{cfg.N - 1}")
        h = attentions(model)[(kind, layer)].h
        if i >= h:
            why = (
                f"pruning kept {h} of its {cfg.h} heads (renumbered 0..{h - 1}); a removed head has no circuit"
                if h < cfg.h
                else f"it has heads 0..{h - 1}"
            )
            raise CheckpointError(f"--head {kind}:{layer}:{i}: {kind} layer {layer} has no head {i}: {why}")


def gather_inputs(model, tokenizer, meta: dict, args, say):
    """Counts, batches and the aligner's output for `read_model` (annotated/circuits/readout.py)."""
    src, tgt = languages_of(meta)
    max_len = model.config.max_len

    def batches(pairs, size: int = 100):
        encoded = encode_pairs(pairs, tokenizer)
        kept, _ = split_long(encoded, max_len)
        kept_pairs = [encoded[i] for i in kept]
        out = [collate(kept_pairs, range(s, min(s + size, len(kept_pairs)))) for s in range(0, len(kept_pairs), size)]
        return [(b.src, b.tgt) for b in out], kept

    train = load_multi30k("train", src, tgt)
    encoded = encode_pairs(train, tokenizer)
    src_counts = Counter(i for s, _ in encoded for i in s)
    tgt_counts = Counter(i for _, t in encoded for i in t)
    val_batches, _ = batches(load_multi30k("val", src, tgt)[: args.sentences])
    train_batches, _ = batches(train[: args.pairs])
    lexicon = test_links = None
    test_batches: list = []
    if not args.no_aligner:
        say("word alignments of the training and test pairs (eflomal; cached after the first run)")
        aligned = multi30k_alignments(src, tgt)
        lexicon = make_lexicon(*aligned["train"])
        test_pairs, links = aligned["test_2016_flickr"]
        test_batches, kept = batches(test_pairs)
        test_links = [links[i] for i in kept]
    return Inputs(
        tokenizer.pieces, src_counts, tgt_counts, val_batches, train_batches, test_batches, lexicon, test_links
    )


def format_table(report: dict[str, Any]) -> str:
    lines = [
        f"{'head':<14} {'rank QK':>7} {'faithful rho [95%]':>22} {'argmax':>6} {'rho LN':>6} {'positions':>10} "
        f"{'role':>8} "
        f"{'copying':>7} {'P@1 QK':>6} {'P@1 OV':>6} {'AER':>5}"
    ]
    for h in report["heads"]:
        f = h.get("faithfulness", {}).get("rho", [float("nan")] * 3)
        exact_ln = h.get("faithfulness_exact_norms", {}).get("rho", [float("nan")])[0]  # through the norms
        d = h.get("dictionary")
        p_qk = f"{d['qk_precision'][0]:.2f}" if d else "-"
        p_ov = f"{d['ov_precision'][0]:.2f}" if d else "-"
        a = f"{h['aer']:.2f}" if "aer" in h else "-"
        lines.append(
            f"{h['site'][0]} {h['site'][1]}.{h['head']:<6} {h['qk']['rank']:>7} "
            f"{f[0]:>8.2f} [{f[1]:.2f}, {f[2]:.2f}] {h.get('faithfulness', {}).get('argmax', [0])[0]:>6.2f} {exact_ln:>6.2f} "
            f"{h['positions']['label']:>10} {h.get('roles', {}).get('label', '-'):>8} "
            f"{h['copying_score']:>7.2f} {p_qk:>6} {p_ov:>6} {a:>5}"
        )
    return "\n".join(lines)


def pruned_lines(report: dict[str, Any], h: int) -> list[str]:
    """One line per attention that pruning left with fewer than h heads: removed heads have no circuit.

    >>> heads = [{"site": ["cross", 1], "head": 0}, {"site": ["enc_self", 0], "head": 0}, {"site": ["enc_self", 0], "head": 1}]
    >>> pruned_lines({"heads": heads}, 2)
    ['cross layer 1 keeps 1 of 2 heads after pruning (renumbered from 0): removed heads have no circuit']
    """
    counts = Counter((h_["site"][0], h_["site"][1]) for h_ in report["heads"])
    return [
        f"{kind} layer {layer} keeps {n} of {h} heads after pruning (renumbered from 0): removed heads have no circuit"
        for (kind, layer), n in counts.items()
        if n < h
    ]


def best_cross_head(report: dict[str, Any]) -> dict | None:
    """The cross-attention head with the lowest alignment error rate (None without the aligner)."""
    scored = [h for h in report["heads"] if "aer" in h]
    return min(scored, key=lambda h: h["aer"]) if scored else None


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    if args.threads:
        torch.set_num_threads(args.threads)
    say = lambda line: print(line, file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        model, tokenizer, meta = load_checkpoint(args.checkpoint)
        check_model(model, tokenizer, args.checkpoint, args.head)
        inputs = gather_inputs(model, tokenizer, meta, args, say)
    except (CheckpointError, DataError) as e:
        DOOR.say(f"error: {e}")
        return 2
    report: dict[str, Any] = {
        "checkpoint": typed_name(args.checkpoint),
        "direction": f"{meta['src_lang']}-{meta['tgt_lang']}",
    }
    report.update(read_model(model, inputs))
    best = best_cross_head(report)
    report["best_cross_head"] = None if best is None else [*best["site"], best["head"]]
    if best is not None:
        report["composition"]["best_cross_head_reads"] = reads_through(
            report["composition"]["pairs"], report["best_cross_head"]
        )
    report["interventions"] = role_interventions(model, inputs.val_batches, report, inputs.pieces, inputs.lexicon)
    report["seconds"] = round(time.perf_counter() - start, 1)
    print(format_table(report), flush=True)
    print(format_composition(report["composition"]), flush=True)
    for line in format_interventions(report["interventions"]):
        print(line, flush=True)
    for line in pruned_lines(report, model.config.h):
        print(line, flush=True)
    if args.head is not None:
        chosen = next(h for h in report["heads"] if h["site"] == list(args.head[:2]) and h["head"] == args.head[2])
        print(json.dumps(json_safe({k: v for k, v in chosen.items() if k != "positions"}, digits=3), indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write(args.out / REPORT, json.dumps(json_safe(report, digits=5), indent=1))
    spectra, positions, faithfulness, dictionary, composition = FIGURES
    figures = {
        spectra: spectra_figure(report["heads"]),
        positions: positions_figure(report["heads"]),
        faithfulness: faithfulness_figure(report["heads"]),
        composition: composition_figure(report["composition"]),
    }
    if best is not None and inputs.lexicon is not None:
        figures[dictionary] = dictionary_figure(best, inputs.lexicon)
    for name, fig in figures.items():
        fig.savefig(args.out / name)
    write_page(args.out, report)
    print(f"wrote {args.out / REPORT}, {CIRCUITS_PAGE} and {', '.join(figures)} in {args.out} ({report['seconds']} s)")
    return 0


if __name__ == "__main__":
    from annotated.plumbing.scripts import run_main

    run_main(main)
