"""Every GPU figure in one command: `make gpu-report` (or `python -m benchmarks.gpu_report`).

Three parts, each a subprocess with its own time limit, so that each ends within 9 minutes of wall time
and the whole within 27 minutes of GPU time:

  (a) bench   `benchmarks/bench.py` on CUDA in bf16, eager and compiled, sizes gpu and base: tokens/s,
              MFU on the base size, fused against torch.nn.Transformer, host syncs per step (<= 9 min; eager
              only, `--bench-compile off`, <= 4 min: compiling took 26 to 91 s per row on an H100);
  (b) train   the gpu preset de->en, then en->de (`train_wmt.py --preset gpu`, as `make train` runs it: eager),
              each capped at `--train-minutes` of training: test BLEU (cased and lowercased) and optimizer
              steps/s (<= 9 min each). `--train-compile` adds `--compile`; on an H100 with torch 2.11 that was
              slower, not faster (docs/training.md, "GPU figures in one command");
  (c) ddp     a 2-process NCCL smoke run under torchrun when two GPUs exist; otherwise the report says so.

It writes benchmarks/results/<device>-<date>.json (everything, the bench result included) and prints a
markdown table, the one the README's GPU rows are copied from. Without CUDA it exits at once with one line
and code 2. It needs only what training needs (torch, sentencepiece, sacrebleu, tensorboard, tqdm), so it runs
with `make gpu-report PYTHON=python3` where torch is preinstalled; the Multi30k files come from
$MULTI30K_URL or --data-url as in training.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from annotated.plumbing.options import Parser, number
from annotated.plumbing.scripts import name_of
from annotated.run_folder import RUNS

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    p = Parser(command=__file__, description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="bench,train,ddp", help="comma-separated subset of bench, train, ddp")
    p.add_argument(
        "--train-minutes",
        type=number(0, None, above=True),
        default=6.5,
        help="cap on each training run's minutes (the preset's steps end it sooner on a fast GPU); "
        "the run's whole limit is this plus 2.5 minutes (data, compiling, the test set)",
    )
    p.add_argument(
        "--train-compile",
        action="store_true",
        help="train under torch.compile (CUDA graphs); on an H100 with torch 2.11 it was slower than eager",
    )
    p.add_argument("--directions", default="de-en,en-de", help="comma-separated training directions: de-en, en-de")
    p.add_argument(
        "--bench-compile",
        choices=("off", "on", "both"),
        default="both",
        help="the bench's torch.compile rows: eager only (off), compiled only (on), or both",
    )
    p.add_argument("--data-url", help="Multi30k files (default $MULTI30K_URL)")
    p.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/<device>-<date>.json)")
    args = p.parse_args(argv)
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    if not parts or set(parts) - {"bench", "train", "ddp"}:
        p.error(f"--parts {args.parts!r}: choose from bench, train, ddp")
    args.parts = parts
    directions = [tuple(x.strip().split("-")) for x in args.directions.split(",") if x.strip()]
    if not directions or set(directions) - {("de", "en"), ("en", "de")}:
        p.error(f"--directions {args.directions!r}: choose from de-en, en-de")
    args.directions = directions
    return args


def run(cmd: list[str], limit_s: int, log: Path) -> dict:
    """Run one part; its output goes to `log`. Returns code, wall seconds and whether the limit stopped it."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            code = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=limit_s).returncode
            timed_out = False
        except subprocess.TimeoutExpired:
            code, timed_out = None, True
    return {
        "command": " ".join(map(str, cmd)),
        "code": code,
        "timed_out": timed_out,
        "wall_s": round(time.perf_counter() - t0, 1),
        "log": str(log),
    }


def bench_part(out_dir: Path, stamp: str, compile_rows: str = "both") -> dict:
    path = out_dir / f"{stamp}-bench.json"
    r = run(
        [
            sys.executable,
            "-m",
            "benchmarks.bench",
            "--device",
            "cuda",
            "--dtype",
            "bf16",
            "--compile",
            compile_rows,
            "--sizes",
            "gpu,base",
            "--reps",
            "3",
            "--window",
            "0.5",
            "--out",
            str(path),
        ],
        540 if compile_rows != "off" else 240,
        out_dir / f"{stamp}-bench.log",
    )
    if path.is_file():
        r["result"] = json.loads(path.read_text())
    return r


def train_part(out_dir: Path, stamp: str, src: str, tgt: str, minutes: float, data_url, compiled: bool = False) -> dict:
    """One direction of the gpu preset, capped at `minutes` of training; limited to that plus 2.5 minutes."""
    run_dir = ROOT / RUNS / f"gpu-report-{stamp}-{src}-{tgt}"
    cmd = [
        sys.executable,
        "train_wmt.py",
        "--preset",
        "gpu",
        "--src",
        src,
        "--tgt",
        tgt,
        "--max-minutes",
        str(minutes),
        "--run-dir",
        str(run_dir),
        "--no-progress",
    ] + (["--compile"] if compiled else [])
    r = run(
        cmd + (["--data-url", data_url] if data_url else []),
        round(60 * minutes) + 150,
        out_dir / f"{stamp}-train-{src}-{tgt}.log",
    )
    results = run_dir / "results.json"
    if results.is_file():
        res = json.loads(results.read_text())
        best = res["test"].get("averaged") or res["test"]["best"]
        r.update(
            compiled=compiled,
            steps=res["steps"],
            train_s=res["train_s"],
            steps_per_s=round(res["steps"] / res["train_s"], 2) if res["train_s"] else None,
            bleu=best["beam"]["bleu"],
            bleu_lowercase=best["beam"]["bleu_lowercase"],
            checkpoint=best["checkpoint"],
            test_set=res["test_set"],
        )
    return r


def ddp_part(out_dir: Path, stamp: str, gpus: int) -> dict:
    if gpus < 2:
        return {"skipped": f"this machine has {gpus} GPU; the 2-process NCCL run needs two"}
    return run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "train_wmt.py",
            "--preset",
            "smoke",
            "--device",
            "cuda",
            "--run-dir",
            str(ROOT / RUNS / f"gpu-report-{stamp}-ddp"),
            "--no-progress",
        ],
        180,
        out_dir / f"{stamp}-ddp.log",
    )


def markdown(report: dict) -> str:
    lines = [
        f"GPU report: {report['device']}, torch {report['torch']}, {report['date']}",
        "",
        "| part | what | result | wall s |",
        "| --- | --- | --- | ---: |",
    ]
    b = report.get("bench")
    if b:
        res = b.get("result") or {}
        for row in res.get("train", []):
            lines.append(
                f"| bench | train {row['size']} {row['label']}{' compiled' if row['compiled'] else ''} | "
                f"{(row.get('tokens_per_s') or 0):,.0f} tok/s, MFU "
                f"{'-' if row.get('mfu') is None else format(row['mfu'], '.1%')} | {b['wall_s']} |"
            )
        if res.get("host_syncs"):
            lines.append(f"| bench | host syncs per training step | {res['host_syncs']['per_step']:g} | |")
        if not res:
            lines.append(
                f"| bench | failed (code {b['code']}, timed out {b['timed_out']}) | see {b['log']} | {b['wall_s']} |"
            )
    for key in ("train_de_en", "train_en_de"):
        t = report.get(key)
        if t:
            what = f"gpu preset {key[6:].replace('_', '->')}{', compiled' if t.get('compiled') else ''}"
            if t.get("bleu") is not None:
                lines.append(
                    f"| train | {what} | test BLEU {t['bleu']:.2f} (lowercased {t['bleu_lowercase']:.2f}), "
                    f"{t['steps']} steps, {t['steps_per_s']} steps/s | {t['wall_s']} |"
                )
            else:
                lines.append(
                    f"| train | {what} | failed (code {t['code']}, timed out {t['timed_out']}) | {t['wall_s']} |"
                )
    d = report.get("ddp")
    if d:
        lines.append(
            f"| ddp | 2-process NCCL smoke | {d.get('skipped') or ('ok' if d.get('code') == 0 else 'failed')}"
            f" | {d.get('wall_s', '')} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(
            f"{name_of(__file__)}: error: no CUDA device (torch.cuda.is_available() is False); run it on a machine "
            "with an NVIDIA GPU, or use `make bench` for CPU figures",
            file=sys.stderr,
        )
        return 2
    name = torch.cuda.get_device_name(0)
    device = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    date = datetime.date.today().isoformat()
    out_dir = ROOT / "benchmarks" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = f"{device}-{date}"
    gpus = torch.cuda.device_count()
    report = {"device": name, "torch": torch.__version__, "date": date, "gpus": gpus}
    data_url = args.data_url or os.environ.get("MULTI30K_URL")
    if "bench" in args.parts:
        report["bench"] = bench_part(out_dir, stamp, args.bench_compile)
    if "train" in args.parts:
        for src, tgt in args.directions:
            report[f"train_{src}_{tgt}"] = train_part(
                out_dir, stamp, src, tgt, args.train_minutes, data_url, args.train_compile
            )
    if "ddp" in args.parts:
        report["ddp"] = ddp_part(out_dir, stamp, gpus)
    report["markdown"] = markdown(report)
    from annotated.plumbing.files import atomic_write

    out = args.out or out_dir / f"{stamp}.json"
    atomic_write(out, json.dumps(report, indent=1) + "\n")
    print(report["markdown"])
    print(f"\nwritten to {out}")
    return 0


if __name__ == "__main__":
    from annotated.plumbing.scripts import run_main

    run_main(main)
