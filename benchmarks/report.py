# %% [markdown]
# # The table and the file (`make bench`)
#
# The result is a dict: `meta` (device, versions, settings, load average),
# the rows of `benchmarks/rows.py` (`train`, `decode`, `cpu_arithmetic`) and
# plain dicts for the rest (targets, host syncs, compile speed-ups, the
# translator). `markdown` prints it as tables; `write_json` writes it, every
# round's timing included, to `benchmarks/results/<device>-<date>.json`.

# %%
from __future__ import annotations

import contextlib
import json
import os
import platform
import re
from pathlib import Path

import torch

from benchmarks.rows import VARIANTS

ROOT = Path(__file__).resolve().parent.parent


def _fmt(x, spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


def _mb(r, key: str) -> str:
    if r.memory_error:
        return "error"
    value = getattr(r, key)
    return _fmt(value and value / 2**20, ".1f", "n/a")


def _ms(seconds) -> str:
    return _fmt(seconds and seconds * 1e3, ".0f")


def _train_table(rows) -> list[str]:
    lines = [
        "| size | implementation | compiled | batch (sent., src x tgt) | tokens/s | x reference | "
        "step ms | resident MiB | step peak MiB | MFU |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r.size} | {r.label} | {'yes' if r.compiled else 'no'} | {r.sentences}, "
            f"{r.src_shape[1]} x {r.tgt_shape[1]} | {_fmt(r.tokens_per_s, ',.0f', 'error')} | "
            f"{_fmt(r.ratio_vs_reference, '.2f')} | {_ms(r.step_s)} | "
            f"{_mb(r, 'resident_bytes')} | {_mb(r, 'step_peak_bytes')} | {_fmt(r.mfu, '.1%', 'n/a')} |"
        )
    return lines


def _decode_table(rows) -> list[str]:
    lines = ["| size | decoder | sentences x steps | sentences/s | x recompute |", "| --- | --- | --- | ---: | ---: |"]
    for r in rows:
        lines.append(
            f"| {r.size} | {r.label} | {r.sentences} x {r.steps} | "
            f"{_fmt(r.sentences_per_s, ',.1f', 'error')} | {_fmt(r.ratio_vs_recompute, '.2f')} |"
        )
    return lines


def _arithmetic_table(rows, clock: str) -> list[str]:
    per = "CPU-second" if clock == "cpu" else "s"
    lines = [
        f"| size | precision | threads | step ms | tokens/s | x fp32, all threads | model GFLOP/step | "
        f"step GFLOP/{per} | matmul peak GFLOP/{per} | share of peak |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        shown = r.note or r.error or _fmt(r.speedup_vs_fp32_all_threads, ".2f")
        achieved, peak = (_fmt(f and f / 1e9, ".1f") for f in (r.achieved_flops, r.peak_flops))
        lines.append(
            f"| {r.size} | {r.precision} | {r.threads} | {_ms(r.step_s)} | {_fmt(r.tokens_per_s, ',.0f')} | "
            f"{shown} | {r.flops_per_step / 1e9:.2f} | {achieved} | {peak} | {_fmt(r.share_of_peak, '.1%')} |"
        )
    return lines


def _targets_table(targets) -> list[str]:
    lines = ["| target | size | device | measured | status |", "| --- | --- | --- | ---: | --- |"]
    for t in targets:
        value = t["measured"]
        shown = "-" if value is None else (f"{value:.1%}" if t["unit"] == "fraction" else f"{value:.2f}x")
        status = t["status"] + (f" (`{t['command']}`)" if t["status"] == "not measured" else "")
        lines.append(f"| {t['target']} | {t['size']} | {t['device']} | {shown} | {status} |")
    return lines


def _notes(result: dict) -> list[str]:
    m, lines = result["meta"], []
    if m.get("device_type") == "cuda":
        lines.append(
            f"\n{VARIANTS['fused_sdpa']}: on CUDA its training step runs the explicit softmax wherever a mask "
            f"is given (transformer.sdpa_is_safe: SDPA's gradients turned NaN now and then in "
            f"training on CUDA), as training does; decoding keeps SDPA"
        )
    if result.get("host_syncs"):
        h = result["host_syncs"]
        lines.append(
            f"\nhost syncs per training step: {h['per_step']:g} (train.train_step, {h['size']} size, "
            f"{h['steps']} steps counted on {m['device_type']})"
        )
    if result.get("translator_cli", {}).get("ratio"):
        t = result["translator_cli"]
        lines.append(
            f"\ntranslator from stdin / batched translate_ids: {t['ratio']:.2f}x ({t['sentences']} sentences, "
            f"beam {t['beam']}, CPU, tiny random model; the CLI loads the checkpoint each run)"
        )
    for c in result.get("compile_speedup", []):
        lines.append(
            f"\ntorch.compile speed-up, {c['size']} {VARIANTS[c['key']]}: {c['speedup']:.2f}x "
            f"(eager step time / compiled, this run)"
        )
    for r in [r for r in result["train"] + result["decode"] if r.error]:
        lines.append(
            f"\nerror in {r.size} {r.label}{' (compiled)' if getattr(r, 'compiled', False) else ''}: {r.error}"
        )
    return lines


def markdown(result: dict) -> str:
    m = result["meta"]
    lines = [
        f"Device: {m['device_name']}; torch {m['torch']}; {m['date']}; {m['dtype']}; {m['clock']} clock; "
        f"load average {m['load_average_start'][0]:.1f} at start, {m['load_average_end'][0]:.1f} at end.",
        "",
    ]
    lines += _train_table(result["train"])
    if result["decode"]:
        lines += [""] + _decode_table(result["decode"])
    if result.get("cpu_arithmetic"):
        lines += [""] + _arithmetic_table(result["cpu_arithmetic"], m["clock"])
    lines += [""] + _targets_table(result["targets"])
    return "\n".join(lines + _notes(result))


def to_json(result: dict) -> dict:
    """The result with its rows as plain dicts (each row's fields and derived figures)."""
    return {
        k: [r.to_json() if hasattr(r, "to_json") else r for r in v] if isinstance(v, list) else v
        for k, v in result.items()
    }


def default_out_path(result: dict) -> Path:
    dev = result["meta"]["device_type"]
    if dev == "cuda":
        dev = re.sub(r"[^a-z0-9]+", "-", result["meta"]["device_name"].lower()).strip("-")
    return ROOT / "benchmarks" / "results" / f"{dev}-{result['meta']['date'][:10]}.json"


def write_json(result: dict, path: Path) -> None:
    """Write atomically (`annotated.plumbing.files.atomic_write`: a temporary file, then a rename)."""
    from annotated.plumbing.files import atomic_write

    atomic_write(path, json.dumps(to_json(result), indent=1) + "\n")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    return f"{name}, {os.cpu_count()} cores, {torch.get_num_threads()} threads"
