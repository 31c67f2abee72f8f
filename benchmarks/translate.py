"""Translation speed against the engines people would pick: test_2016_flickr with beam 4, in one process.

    python -m benchmarks.translate                                   # the latest run's model, all 1,000 sentences
    python -m benchmarks.translate --checkpoint runs/x/averaged.pt --sentences 200 --threads 1 --out /tmp/t.json

Each tool translates the same sources (the checkpoint's tokenizer, no `</s>` on the source, as our model was
trained) on the same number of threads, batched as it does best:

- **translator (stdin)**: `annotated.decoding.translate.main` reading the sentences as a file on stdin, text in
  and text out, recasing off (`--case as-typed`);
- **translate_ids**: our batched beam search on subword ids (`annotated/decoding/search.py`), batches of 64
  sentences of similar length;
- **translator int8 (stdin)** and **translate_ids int8** (unless `--quantize none`): the same with the model's
  matrix products in int8 (`--quantize int8`, `annotated/decoding/quantize.py`);
- **generate**: `transformers` `MarianMTModel.generate(num_beams=4, early_stopping=True)` on the export
  (`annotated/interop/marian.py`), on translate_ids' batches;
- **CTranslate2 float32 / int8**: the export converted by CTranslate2's stock `TransformersConverter` (the code
  of `ct2-transformers-converter`, nothing patched), and `Translator.translate_batch(beam_size=4,
  max_batch_size=64)`.

The export is laid out as OPUS-MT's models are (a `<pad>` row appended as the decoder start, zero, with the
start vector in the decoder's first positional row: section 1 of `annotated/interop/marian.py`), which is what
CTranslate2's Marian loader assumes, so its stock conversion computes our model's function
(`tests/interop/test_ctranslate2.py`). Each row prints sentences per second, corpus BLEU
(sacreBLEU, cased), its speed as a multiple of CTranslate2 float32's and of CTranslate2's at the same precision
(float32 rows against float32, int8 rows against int8), and its BLEU minus the same engine's float32 BLEU.
Timings are the median of `--rounds` rounds in a rotating order, after one warm-up round per tool; the
machine's load average is printed before and after (other jobs on the machine slow every tool, so read the
ratios, measured in the same rounds, rather than the sentences per second). Speed is never asserted by a test;
`tests/test_translate_bench.py` checks that every tool runs and translates.
"""

from __future__ import annotations

import io
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from annotated.plumbing.scripts import name_of

NAME = name_of(__file__)


def convert_ctranslate2(hf_dir: Path, out: Path, quantization: str | None) -> Path:
    """CTranslate2's stock TransformersConverter (what `ct2-transformers-converter` runs), unpatched."""
    from ctranslate2.converters import TransformersConverter

    TransformersConverter(str(hf_dir)).convert(str(out), quantization=quantization, force=True)
    return out


INT8 = ("translator int8 (stdin)", "translate_ids int8")


def tools(
    checkpoint: Path, folder: Path, sources: list[list[int]], texts: list[str], threads: int, int8: bool = True
) -> dict:
    """{name: a function translating every source, returning the texts}."""
    import ctranslate2
    from transformers import MarianMTModel

    from annotated.checkpoint import load_checkpoint, model_length_penalty
    from annotated.decoding.quantize import quantize_int8
    from annotated.decoding.search import translate_ids
    from annotated.decoding.translate import main as translator
    from annotated.interop.agreement import generate_ids
    from annotated.interop.folders import export_marian

    model, tokenizer, meta = load_checkpoint(checkpoint)
    alpha = model_length_penalty(meta)  # ours: GNMT alpha, the translator's default
    hf_dir = export_marian(checkpoint, folder / "hf")
    hf = MarianMTModel.from_pretrained(str(hf_dir), local_files_only=True).float().eval()
    engines = {
        q or "float32": ctranslate2.Translator(
            str(convert_ctranslate2(hf_dir, folder / f"ct2-{q}", q)),
            device="cpu",
            intra_threads=threads,
            inter_threads=1,
        )
        for q in (None, "int8")
    }
    pieces = [tokenizer.pieces(s) for s in sources]
    piece_id = {p: i for i, p in enumerate(tokenizer.pieces(range(tokenizer.vocab_size)))}
    stdin = ("\n".join(texts) + "\n").encode("utf-8")

    def from_stdin(*options: str) -> Callable[[], list[str]]:
        def run() -> list[str]:
            out = io.BytesIO()
            translator(
                ["--checkpoint", str(checkpoint), "--case", "as-typed", "--beam", "4", "--device", "cpu", *options],
                stdin=io.BytesIO(stdin),
                stdout=out,
                stderr=io.StringIO(),
            )
            return out.getvalue().decode("utf-8").splitlines()

        return run

    def ours(m) -> Callable[[], list[str]]:
        def run() -> list[str]:
            with torch.inference_mode():
                return [tokenizer.decode(h) for h in translate_ids(m, sources, 4, alpha)]

        return run

    def generate() -> list[str]:
        return [tokenizer.decode(h) for h in generate_ids(hf, sources, length_penalty=1.0)]

    def ctranslate(engine) -> Callable[[], list[str]]:
        def run() -> list[str]:
            results = engine.translate_batch(
                pieces, beam_size=4, max_batch_size=64, batch_type="examples", max_decoding_length=256
            )
            return [tokenizer.decode([piece_id[p] for p in r.hypotheses[0]]) for r in results]

        return run

    runs = {"translator (stdin)": from_stdin(), "translate_ids": ours(model)}
    if int8:
        runs |= {INT8[0]: from_stdin("--quantize", "int8"), INT8[1]: ours(quantize_int8(model))}
    return runs | {
        "generate": generate,
        "CTranslate2 float32": ctranslate(engines["float32"]),
        "CTranslate2 int8": ctranslate(engines["int8"]),
    }


def measure(
    checkpoint: Path,
    sentences: int | None,
    threads: int,
    rounds: int,
    data_url: str | None = None,
    int8: bool = True,
) -> dict:
    from annotated.checkpoint import load_checkpoint
    from annotated.plumbing.allocator import keep_freed_memory
    from annotated.training.data import load_multi30k
    from annotated.training.evaluate import score

    torch.set_num_threads(threads)
    keep_freed_memory()  # as the translator does on the CPU; every tool runs under it, in this one process
    _, tokenizer, meta = load_checkpoint(checkpoint)
    pairs = load_multi30k(
        "test_2016_flickr", meta.get("src_lang", "de"), meta.get("tgt_lang", "en"), base_url=data_url
    )[:sentences]
    texts, references = [s for s, _ in pairs], [t for _, t in pairs]
    sources = [tokenizer.encode(s) for s in texts]
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as folder:
        runs = tools(checkpoint, Path(folder), sources, texts, threads, int8)
        names = list(runs)
        seconds: dict[str, list[float]] = {n: [] for n in names}
        outputs = {n: runs[n]() for n in names}  # warm-up, and the translations scored
        for r in range(rounds):
            for n in names[r % len(names) :] + names[: r % len(names)]:  # a rotating order
                start = time.perf_counter()
                runs[n]()
                seconds[n].append(time.perf_counter() - start)
    rows = {}
    for n in names:
        rows[n] = {
            "sentences_per_s": round(len(pairs) / statistics.median(seconds[n]), 1),
            "bleu": score(outputs[n], references)["bleu"],
        }
    base = rows["CTranslate2 float32"]["sentences_per_s"]
    for n, row in rows.items():
        int8_row = n in INT8 or n == "CTranslate2 int8"
        same = rows["CTranslate2 int8" if int8_row else "CTranslate2 float32"]
        own_float32 = rows["translate_ids" if n in INT8 else "CTranslate2 float32" if int8_row else n]
        row["x CTranslate2 float32"] = round(row["sentences_per_s"] / base, 2)
        row["x CTranslate2 same precision"] = round(row["sentences_per_s"] / same["sentences_per_s"], 2)
        row["BLEU - own float32"] = round(row["bleu"] - own_float32["bleu"], 2)
    return {
        "checkpoint": str(checkpoint),
        "sentences": len(pairs),
        "threads": threads,
        "rounds": rounds,
        "load average (1 min) before, after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "rows": rows,
    }


COLUMNS = ("sentences_per_s", "bleu", "BLEU - own float32", "x CTranslate2 float32", "x CTranslate2 same precision")


def table(result: dict) -> str:
    lines = [
        "| tool | sentences/s | BLEU | BLEU - own float32 | x CTranslate2 float32 | x CTranslate2 same precision |"
    ]
    lines += ["| --- | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {n} | " + " | ".join(str(r[c]) for c in COLUMNS) + " |" for n, r in result["rows"].items()]
    before, after = result["load average (1 min) before, after"]
    lines.append(f"\n{result['threads']} thread(s), {result['sentences']} sentences; load average {before} -> {after}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import sys

    from annotated.checkpoint import CheckpointError
    from annotated.plumbing.files import atomic_write
    from annotated.plumbing.options import Parser, at_least
    from annotated.shipped import choose_checkpoint

    p = Parser(command=__file__, description=__doc__.split("\n")[0])
    p.add_argument(
        "--checkpoint",
        default=None,
        help="checkpoint file, or shipped:de-en / shipped:en-de (default: the latest run's model; with no "
        "run, the shipped de -> en model)",
    )
    p.add_argument("--sentences", type=at_least(1), default=None, help="the first N test sentences (default all)")
    p.add_argument("--threads", type=at_least(1), default=1)
    p.add_argument("--rounds", type=at_least(1), default=3)
    p.add_argument(
        "--quantize",
        choices=("int8", "none"),
        default="int8",
        help="int8: also time our translator with --quantize int8 (default); none: float32 only",
    )
    p.add_argument("--out", type=Path, default=None, help="also write the result as JSON here")
    args = p.parse_args(argv)
    try:
        checkpoint = choose_checkpoint(args.checkpoint, say=lambda line: print(f"{NAME}: {line}", file=sys.stderr))
    except CheckpointError as e:
        p.error(str(e))
    if not checkpoint.is_file():
        p.error(f"--checkpoint {checkpoint}: no such file")
    result = measure(checkpoint, args.sentences, args.threads, args.rounds, int8=args.quantize == "int8")
    print(table(result))
    if args.out is not None:
        atomic_write(args.out, json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    from annotated.plumbing.scripts import run_main

    run_main(main)
