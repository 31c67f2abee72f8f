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
- **CTranslate2 float32 / int8**: the model in the layout CTranslate2 needs (the export's, for its
  `ctranslate2/` model: `write_ctranslate2_layout`, `annotated/interop/folders.py`) converted by CTranslate2's
  stock `TransformersConverter` (the code of `ct2-transformers-converter`, nothing patched), and
  `Translator.translate_batch(beam_size=4, max_batch_size=64)`.

On n > 1 threads each engine runs as it does best with n threads, and the table's "threads" column says how:
ours translates n batches side by side, one thread each (`search.py` section 8); `generate` uses n PyTorch
threads; CTranslate2 is timed in both of its configurations, `intra_threads=n, inter_threads=1` (one batch
at a time on n threads) and `inter_threads=n, intra_threads=1` (n batches side by side, one thread each, as
ours), in the same rounds, and its row is the faster one's (`configurations`; every configuration's times
are in `--out`'s JSON).

That layout is OPUS-MT's (a `<pad>` row appended as the decoder start, zero, with the start vector in the
decoder's first positional row: section 1 of `annotated/interop/marian.py`), which is what CTranslate2's Marian
loader assumes, so its stock conversion computes our model's function (`tests/interop/test_ctranslate2.py`). Each row prints sentences per second, corpus BLEU
(sacreBLEU, cased), its speed as a multiple of CTranslate2 float32's and of CTranslate2's at the same precision
(float32 rows against float32, int8 rows against int8), and its BLEU minus the same engine's float32 BLEU.
Timings are the fastest of `--rounds` rounds in a rotating order (every run's time is kept in `--out`'s
JSON): on a shared machine other jobs only ever slow a run down, and the same search of the 1,000 test
sentences took 3.2 s in one run and 4.8 s in the next on the 2-core Xeon, so a median of three can land on
a slow run of one tool and a fast run of another. With `--processes each` (the default)
every timed run is a fresh process of its own (`--worker`), which translates everything once to warm up and
then once more, timed: CTranslate2 brings its own copy of the OpenMP runtime, and with two threads the two
runtimes' thread pools in one process slowed `translate_ids` by about a fifth after CTranslate2 had run
(0.65-0.70 s against 0.81 s for 300 sentences, de -> en, on the 2-core Xeon). With `--processes one` every
tool runs in this process, after one warm-up round per tool (quicker; what the tests use). The machine's load
average is printed before and after (other jobs on the machine slow every tool, so read the ratios, measured
in the same rounds, rather than the sentences per second). On a shared machine `--clock cpu --threads 1`
times each run by its process's CPU time instead of the wall clock: time other jobs take from the process is
not counted (for one thread only: on n threads the CPU time adds the threads up). Speed is never asserted by a test;
`tests/test_translate_bench.py` checks that every tool runs and translates, in both modes.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from annotated.plumbing.allocator import keep_freed_memory
from annotated.plumbing.scripts import name_of

NAME = name_of(__file__)


def convert_ctranslate2(hf_dir: Path, out: Path, quantization: str | None) -> Path:
    """CTranslate2's stock TransformersConverter (what `ct2-transformers-converter` runs), unpatched."""
    from ctranslate2.converters import TransformersConverter

    TransformersConverter(str(hf_dir)).convert(str(out), quantization=quantization, force=True)
    return out


INT8 = ("translator int8 (stdin)", "translate_ids int8")
NAMES = ("translator (stdin)", "translate_ids", *INT8, "generate", "CTranslate2 float32", "CTranslate2 int8")


def configurations(name: str, threads: int) -> list[int]:
    """The configurations tool `name` is timed in on `threads` threads, as its `inter` (batches at once, each
    on threads // inter threads): CTranslate2 both of its own on n > 1 threads, every other tool its one."""
    return [1, threads] if name.startswith("CTranslate2") and threads > 1 else [1]


def thread_use(name: str, threads: int, inter: int) -> str:
    """How tool `name` uses `threads` threads in configuration `inter`, in words for the table."""
    if name.startswith("CTranslate2"):
        return f"intra_threads={threads // inter}, inter_threads={inter}"
    if name == "generate" or threads == 1:
        return f"{threads} PyTorch thread(s)"
    return f"{threads} batches side by side, 1 thread each"


def run_name(name: str, threads: int, inter: int) -> str:
    """The key of a tool's timed runs in one configuration (the tool's name when it has only one)."""
    return name if len(configurations(name, threads)) == 1 else f"{name}, {thread_use(name, threads, inter)}"


def prepare(checkpoint: Path, folder: Path) -> None:
    """The export and the two CTranslate2 conversions, made once in `folder` for every tool and process."""
    from annotated.checkpoint import loaded_from_state, read_checkpoint
    from annotated.interop.folders import export_marian, write_ctranslate2_layout

    export_marian(checkpoint, folder / "hf")
    state = read_checkpoint(checkpoint)
    model, tokenizer, meta = loaded_from_state(state, checkpoint)
    layout = write_ctranslate2_layout(model, state.get("heads"), tokenizer, meta, folder / "ct2-layout")
    for q in (None, "int8"):
        convert_ctranslate2(layout, folder / f"ct2-{q}", q)


def tool(
    name: str, checkpoint: Path, folder: Path, sources: list[list[int]], texts: list[str], threads: int, inter: int = 1
) -> Callable[[], list[str]]:
    """A function translating every source with tool `name` in configuration `inter` (`configurations`),
    returning the texts (from a `prepare`d `folder`)."""
    from annotated.checkpoint import load_checkpoint
    from annotated.decoding.quantize import quantize_int8
    from annotated.decoding.search import translate_ids
    from annotated.decoding.settings import Decoding, model_length_penalty
    from annotated.decoding.translate import main as translator

    model, tokenizer, meta = load_checkpoint(checkpoint)
    if name.startswith("CTranslate2"):
        import ctranslate2

        engine = ctranslate2.Translator(
            str(folder / f"ct2-{'int8' if name.endswith('int8') else None}"),
            device="cpu",
            intra_threads=threads // inter,
            inter_threads=inter,  # > 1: translate_batch runs its batches of max_batch_size side by side
        )
        pieces = [tokenizer.pieces(s) for s in sources]
        piece_id = {p: i for i, p in enumerate(tokenizer.pieces(range(tokenizer.vocab_size)))}

        def ctranslate() -> list[str]:
            results = engine.translate_batch(
                pieces, beam_size=Decoding.beam, max_batch_size=64, batch_type="examples", max_decoding_length=256
            )
            return [tokenizer.decode([piece_id[p] for p in r.hypotheses[0]]) for r in results]

        return ctranslate
    if name == "generate":
        from transformers import MarianMTModel

        from benchmarks.agreement import generate_ids

        hf = MarianMTModel.from_pretrained(str(folder / "hf"), local_files_only=True).float().eval()
        return lambda: [tokenizer.decode(h) for h in generate_ids(hf, sources, length_penalty=1.0)]
    if name.startswith("translator"):
        stdin = ("\n".join(texts) + "\n").encode("utf-8")
        options = ["--quantize", "int8"] if name in INT8 else []

        def from_stdin() -> list[str]:
            out = io.BytesIO()
            argv = ["--checkpoint", str(checkpoint), "--case", "as-typed", "--beam", "4", "--device", "cpu"]
            translator(argv + options, stdin=io.BytesIO(stdin), stdout=out, stderr=io.StringIO())
            return out.getvalue().decode("utf-8").splitlines()

        return from_stdin
    m = quantize_int8(model) if name in INT8 else model
    alpha = model_length_penalty(meta)  # ours: GNMT alpha, the translator's default

    def ours() -> list[str]:  # as any caller runs it (it enters inference mode itself)
        return [tokenizer.decode(h) for h in translate_ids(m, sources, Decoding.beam, alpha)]

    return ours


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}  # cpu: this process's CPU time, all its threads


def timed(run: Callable[[], list[str]], clock: str = "wall") -> tuple[float, list[str]]:
    """(seconds on `clock`, texts) of one run."""
    start = CLOCKS[clock]()
    texts = run()
    return CLOCKS[clock]() - start, texts


def worker(name: str, checkpoint: Path, folder: Path, threads: int, inter: int = 1, clock: str = "wall") -> None:
    """One tool in a process of its own: a warm-up run, then one timed run; prints {seconds, texts} as JSON."""
    torch.set_num_threads(threads)
    keep_freed_memory()  # as the translator does on the CPU
    inputs = json.loads((folder / "inputs.json").read_text(encoding="utf-8"))
    run = tool(name, checkpoint, folder, inputs["sources"], inputs["texts"], threads, inter)
    _, texts = timed(run)
    seconds, _ = timed(run, clock)
    print(json.dumps({"seconds": seconds, "texts": texts}))


def in_its_own_process(
    name: str, checkpoint: Path, folder: Path, threads: int, inter: int = 1, clock: str = "wall"
) -> tuple[float, list[str]]:
    """`worker` run as `python -m benchmarks.translate --worker NAME ...`: (seconds, texts)."""
    command = [sys.executable, "-m", "benchmarks.translate", "--worker", name, "--checkpoint", str(checkpoint)]
    command += ["--worker-folder", str(folder), "--threads", str(threads), "--worker-inter", str(inter)]
    command += ["--clock", clock]
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(command, capture_output=True, text=True, check=False, cwd=root)
    if done.returncode != 0:
        raise RuntimeError(f"{NAME}: the {name!r} process failed:\n{done.stderr[-2000:]}")
    result = json.loads(done.stdout.splitlines()[-1])
    return result["seconds"], result["texts"]


PROCESSES = ("each", "one")


def measure(
    checkpoint: Path,
    sentences: int | None,
    threads: int,
    rounds: int,
    data_url: str | None = None,
    int8: bool = True,
    processes: str = "one",
    clock: str = "wall",
) -> dict:
    """Every tool's speed and BLEU. `processes="one"`: every tool in this process, each warmed up once, then
    `rounds` rotating rounds; `"each"`: every timed run in a fresh process of its own, after a warm-up there."""
    from annotated.checkpoint import load_checkpoint
    from annotated.training.data import load_multi30k
    from annotated.training.evaluate import score

    torch.set_num_threads(threads)
    keep_freed_memory()  # as the translator does on the CPU; every tool runs under it
    _, tokenizer, meta = load_checkpoint(checkpoint)
    pairs = load_multi30k(
        "test_2016_flickr", meta.get("src_lang", "de"), meta.get("tgt_lang", "en"), base_url=data_url
    )[:sentences]
    texts, references = [s for s, _ in pairs], [t for _, t in pairs]
    sources = [tokenizer.encode(s) for s in texts]
    names = [n for n in NAMES if int8 or n not in INT8]
    runs = [(n, inter) for n in names for inter in configurations(n, threads)]  # every tool in every configuration
    load_before = os.getloadavg()
    seconds: dict[str, list[float]] = {run_name(n, threads, i): [] for n, i in runs}
    outputs: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory() as folder:
        prepare(checkpoint, Path(folder))
        if processes == "each":
            (Path(folder) / "inputs.json").write_text(json.dumps({"sources": sources, "texts": texts}))
            for r in range(rounds):
                for n, i in runs[r % len(runs) :] + runs[: r % len(runs)]:  # a rotating order
                    spent, outputs[run_name(n, threads, i)] = in_its_own_process(
                        n, checkpoint, Path(folder), threads, i, clock
                    )
                    seconds[run_name(n, threads, i)].append(spent)
        else:
            tools = {
                run_name(n, threads, i): tool(n, checkpoint, Path(folder), sources, texts, threads, i) for n, i in runs
            }
            outputs = {key: run() for key, run in tools.items()}  # warm-up, and the translations scored
            for r in range(rounds):
                keys = list(tools)
                for key in keys[r % len(keys) :] + keys[: r % len(keys)]:  # a rotating order
                    seconds[key].append(timed(tools[key], clock)[0])
    rows = {}
    for n in names:  # each tool in its fastest configuration
        inter = min(configurations(n, threads), key=lambda i: min(seconds[run_name(n, threads, i)]))
        key = run_name(n, threads, inter)
        rows[n] = {
            "threads": thread_use(n, threads, inter),
            "sentences_per_s": round(len(pairs) / min(seconds[key]), 1),
            "bleu": score(outputs[key], references)["bleu"],
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
        "processes": processes,
        "clock": clock,
        "load average (1 min) before, after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "rows": rows,
        "seconds": seconds,
    }


COLUMNS = (
    "threads",
    "sentences_per_s",
    "bleu",
    "BLEU - own float32",
    "x CTranslate2 float32",
    "x CTranslate2 same precision",
)


def table(result: dict) -> str:
    lines = [
        "| tool | threads | sentences/s | BLEU | BLEU - own float32 | x CTranslate2 float32 "
        "| x CTranslate2 same precision |"
    ]
    lines += ["| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {n} | " + " | ".join(str(r[c]) for c in COLUMNS) + " |" for n, r in result["rows"].items()]
    before, after = result["load average (1 min) before, after"]
    where = "each run in its own process" if result.get("processes") == "each" else "every tool in one process"
    lines.append(
        f"\n{result['threads']} thread(s), {result['sentences']} sentences, {where}, the fastest of "
        f"{result['rounds']} round(s), {'CPU time' if result.get('clock') == 'cpu' else 'wall clock'}; "
        f"load average {before} -> {after}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from annotated.door import Door
    from annotated.plumbing.files import atomic_write
    from annotated.plumbing.options import at_least

    door = Door(__file__)
    p = door.parser(description=__doc__.split("\n")[0])
    door.checkpoint_options(p, languages=False)
    p.add_argument("--sentences", type=at_least(1), default=None, help="the first N test sentences (default all)")
    p.add_argument("--threads", type=at_least(1), default=1)
    p.add_argument("--rounds", type=at_least(1), default=3)
    p.add_argument(
        "--quantize",
        choices=("int8", "none"),
        default="int8",
        help="int8: also time our translator with --quantize int8 (default); none: float32 only",
    )
    p.add_argument(
        "--processes",
        choices=PROCESSES,
        default="each",
        help="each (default): every timed run in a fresh process of its own; one: every tool in this process",
    )
    p.add_argument(
        "--clock",
        choices=tuple(CLOCKS),
        default="wall",
        help="wall (default), or each run's process CPU time (a shared machine; with --threads 1)",
    )
    door.output_options(p, type=Path, help="also write the result as JSON here", force=False)
    p.add_argument("--worker", choices=NAMES, default=None, help=argparse.SUPPRESS)  # one tool's process
    p.add_argument("--worker-folder", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-inter", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.clock == "cpu" and args.threads > 1 and args.worker is None:
        p.error("--clock cpu adds up the CPU time of every thread: use it with --threads 1, or --clock wall")
    checkpoint = door.checkpoint(args)
    if args.worker is not None:
        worker(args.worker, checkpoint, args.worker_folder, args.threads, args.worker_inter, args.clock)
        return 0
    door.keep(args, [args.out], flag="", elsewhere="name a new file")
    int8 = args.quantize == "int8"
    result = measure(
        checkpoint, args.sentences, args.threads, args.rounds, int8=int8, processes=args.processes, clock=args.clock
    )
    print(table(result))
    if args.out is not None:
        atomic_write(args.out, json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    from annotated.plumbing.scripts import run_main

    run_main(main)
