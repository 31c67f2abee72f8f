"""How well `annotated-translate --alignment` aligns: its word pairs against eflomal's, on test_2016_flickr.

    python -m benchmarks.alignment [--checkpoints shipped:de-en shipped:en-de] [--threads 1]

For each checkpoint: every cross-attention head's alignment error rate as `make circuits` reads it (the head's
argmax attention, `annotated/circuits/readout.py`) and the head its rule picks (`best_cross_head`, the lowest AER);
the head the translator reads (the checkpoint's meta `alignment_head`); and the AER of the translator's own
alignments (`annotated/decoding/alignment.py`, as `--alignment` prints them) of the 1,000 test pairs, teacher-forced
on the reference translation, against eflomal's links of the same pairs (Part V's reference,
`annotated/circuits/aligner.py`; cached after the first run). Nothing here is asserted by a test but
`test_each_shipped_model_carries_the_head_the_circuits_rule_picks` (tests/shipped/), which runs `rule`.
"""

from __future__ import annotations

import argparse
import os

import torch

from annotated.checkpoint import load_checkpoint
from annotated.circuits.command import best_cross_head, gather_inputs
from annotated.circuits.dictionary import attention_links
from annotated.circuits.metrics import aer
from annotated.decoding.alignment import alignment
from annotated.door import Door
from annotated.plumbing.options import Parser, at_least
from annotated.tokens import PAD


def rule(model, tokenizer, meta: dict, checkpoint) -> tuple[list[dict], tuple[int, int], list]:
    """(each cross head's AER record, the head `make circuits` names best, the test batches and links it read):
    the inputs of `make circuits` (`gather_inputs`, its 1,000 test pairs and eflomal's links of them) read as its
    readout reads them."""
    args = argparse.Namespace(checkpoint=checkpoint, sentences=1, pairs=1, no_aligner=False)
    inputs = gather_inputs(model, tokenizer, meta, args, say=lambda line: None)
    sites = [("cross", layer) for layer in range(len(model.decoder.layers))]
    heads = [
        {"site": list(site), "head": head, "aer": aer(predicted, inputs.test_links)}
        for (site, head), predicted in attention_links(model.eval(), inputs.pieces, inputs.test_batches, sites).items()
    ]
    best = best_cross_head({"heads": heads})
    assert best is not None  # the aligner ran: every cross head has its AER
    return heads, (best["site"][1], best["head"]), list(zip(inputs.test_batches, _split(inputs.test_links)))


def _split(links: list) -> list[list]:
    return [links[s : s + 100] for s in range(0, len(links), 100)]  # gather_inputs' batches hold 100 pairs


def translator_aer(model, tokenizer, batches, head: tuple[int, int]) -> float:
    """AER of `alignment` (the translator's `--alignment`) on each test pair, its reference teacher-forced."""
    predicted, reference = [], []
    for (src, tgt), links in batches:
        for b in range(src.size(0)):
            source = [i for i in src[b].tolist() if i != PAD]
            target = [i for i in tgt[b, 1:].tolist() if i != PAD]  # y_1 .. y_n eos
            predicted.append(alignment(model, tokenizer, source, target, head))
        reference += links
    return aer(predicted, reference)


def main(argv: list[str] | None = None) -> int:
    p = Parser(command=__file__, description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoints", nargs="+", default=["shipped:de-en", "shipped:en-de"], help="models to read")
    p.add_argument("--threads", type=at_least(1), default=1, help="torch threads (default 1)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    door = Door("benchmarks/alignment.py")
    print(f"CPU: {os.cpu_count()} cores", flush=True)
    print(f"{'model':<16} {'cross heads AER (layer.head)':<60} {'rule':>5} {'meta':>5} {'--alignment AER':>16}")
    for name in args.checkpoints:
        path = door.checkpoint(argparse.Namespace(checkpoint=name, src=None, tgt=None))
        model, tokenizer, meta = load_checkpoint(path)
        heads, best, batches = rule(model, tokenizer, meta, path)
        stored = meta.get("alignment_head")
        read = tuple(stored) if stored is not None else best
        table = " ".join(f"{h['site'][1]}.{h['head']}:{h['aer']:.4f}" for h in heads)
        shown = "-" if stored is None else "{}.{}".format(*stored)
        score = translator_aer(model, tokenizer, batches, read)
        print(f"{name:<16} {table:<60} {best[0]}.{best[1]:<3} {shown:>5} {score:>16.4f}", flush=True)
    return 0


if __name__ == "__main__":
    from annotated.plumbing.scripts import run_main

    run_main(main)
