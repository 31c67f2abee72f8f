"""Capitals, lower case and caps lock: test BLEU with the translator's recasing (`--case auto`) and without.

    python -m benchmarks.case                                 # the latest run's model, all of test_2016_flickr
    python -m benchmarks.case --checkpoint runs/x/best.pt --sentences 200 --out /tmp/case.json

The test set's sources are given as written, in capitals (`str.upper`), in lower case (`str.lower`) and as
typed with caps lock on (`casing.swap_case`); each goes through the translator's own input rules
(`annotated.decoding.translate.prepare`) with `case="as-typed"` and with `case="auto"`, is translated by
beam search, and is scored by sacreBLEU against the unchanged references, cased and lowercased. The
lowercased score is the one that compares the variants (an answer in capitals is right in capitals).
It also counts the sources that recasing turns back into exactly the written sentence, with the checkpoint's
case table (`annotated/decoding/casing.py`), or by the tokenizer alone for a checkpoint without one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from annotated.checkpoint import CheckpointError, load_checkpoint, read_case_table
from annotated.decoding import casing
from annotated.decoding.settings import Decoding
from annotated.decoding.translate import prepare, translate_prepared
from annotated.door import Door
from annotated.plumbing.files import atomic_write
from annotated.plumbing.options import at_least
from annotated.training.data import load_multi30k
from annotated.training.evaluate import score

VARIANTS = {"as written": lambda s: s, "capitals": str.upper, "lower case": str.lower, "caps lock": casing.swap_case}


def measure(
    model, tokenizer, pairs: list[tuple[str, str]], beam: int, progress: bool = True, table: dict | None = None
) -> dict:
    """{variant: {case mode: scores}} and the exact-recasing counts, with the checkpoint's case `table`."""
    from tqdm.auto import tqdm

    references = [t for _, t in pairs]
    results: dict[str, dict] = {}
    jobs = [(v, mode) for v in VARIANTS for mode in ("as-typed", "auto")]
    for variant, mode in tqdm(jobs, desc="case", unit="run", disable=not progress):
        lines = [
            prepare(str(i), VARIANTS[variant](s), None, tokenizer, model.config.max_len, mode, table)
            for i, (s, _) in enumerate(pairs)
        ]
        with torch.inference_mode():
            hyps = [answers[0].text for answers in translate_prepared(model, tokenizer, lines, beam)]
        scores = score(hyps, references)
        scores.pop("signature")
        results.setdefault(variant, {})[mode] = scores
    exact = {
        name: sum(casing.normalise(f(s), tokenizer, table)[0] == s for s, _ in pairs)
        for name, f in VARIANTS.items()
        if name != "as written"
    }
    return {
        "scores": results,
        "recased_exactly": exact,
        "case_table": table is not None,
        "sentences": len(pairs),
        "beam": beam,
    }


def table(result: dict) -> str:
    """Markdown: one row per variant, BLEU cased / lowercased with and without recasing."""
    base = result["scores"]["as written"]["as-typed"]["bleu_lowercase"]
    rows = [
        "| source | as typed: BLEU cased / lowercased | `--case auto`: BLEU cased / lowercased "
        "| lowercased, auto minus as written |",
        "| --- | --- | --- | --- |",
    ]
    for variant, modes in result["scores"].items():
        typed, auto = modes["as-typed"], modes["auto"]
        rows.append(
            f"| {variant} | {typed['bleu']:.2f} / {typed['bleu_lowercase']:.2f} | {auto['bleu']:.2f} / "
            f"{auto['bleu_lowercase']:.2f} | {auto['bleu_lowercase'] - base:+.2f} |"
        )
    return "\n".join(rows)


def main(argv=None) -> int:
    door = Door(__file__)
    p = door.parser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    door.checkpoint_options(p, languages=False)
    p.add_argument("--sentences", type=at_least(1), help="only the first n test sentences (default: all)")
    Decoding.add_options(p, "beam")
    door.output_options(p, type=Path, help="also write the figures as JSON here", force=False)
    args = p.parse_args(argv)
    door.keep(args, [args.out], flag="", elsewhere="name a new file")
    path = door.checkpoint(args)
    try:
        model, tokenizer, meta = load_checkpoint(path)
    except CheckpointError as e:
        door.fail(str(e))
    model.eval()
    src, tgt = meta.get("src_lang", "de"), meta.get("tgt_lang", "en")
    pairs = load_multi30k("test_2016_flickr", src, tgt)[: args.sentences]
    result = dict(
        measure(model, tokenizer, pairs, args.beam, progress=sys.stderr.isatty(), table=read_case_table(path)),
        checkpoint=str(path),
        direction=f"{src}->{tgt}",
    )
    print(f"{path}, test_2016_flickr {src}->{tgt}, {result['sentences']} sentences, beam {args.beam}")
    print(table(result))
    for variant, n in result["recased_exactly"].items():
        print(f"sources in {variant} recased into exactly the written sentence: {n} of {result['sentences']}")
    print(
        "case table: "
        + ("the checkpoint's" if result["case_table"] else "none in the checkpoint (the tokenizer alone recases)")
    )
    if args.out:
        atomic_write(args.out, json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    from annotated.plumbing.scripts import run_main

    run_main(main)
