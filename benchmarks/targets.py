# %% [markdown]
# # The targets (`make bench`)
#
# The project's targets, each reported beside the number it is about, as
# `met`, `not met`, or `not measured` (with the command that measures it):
#
# - our fused training step at least 1.0x the `torch.nn.Transformer`
#   reference, on the CPU and on the GPU (every size): a change that makes
#   our step slower shows here;
# - cached greedy decoding at least 3x the recomputing one, on the CPU;
# - per-head attention within 2x of fused (per-head step time / fused step
#   time <= 2) at the gpu preset on the GPU (bf16, eager);
# - MFU at least 30% for the base model in bf16 on one H100 (the better of
#   eager and compiled);
# - the cpu size's bf16 step on every core at least 40% of the same CPU's
#   measured bf16 matmul peak (`benchmarks/arithmetic.py`), on a CPU with
#   bf16 instructions.

# %%
from __future__ import annotations

from collections.abc import Callable

from benchmarks.sizes import SIZES

GPU_COMMAND = "make bench PYTHON=python3"  # on a machine with one CUDA GPU (an H100 for the MFU target)
CPU_COMMAND = "make bench ARGS='--device cpu'"
BF16_CPU_COMMAND = "make bench ARGS='--device cpu --sizes cpu' on a CPU with avx512_bf16 or amx_bf16"


def _target(
    target: str, size: str, where: str, value: float | None, ok: Callable[[float], bool], unit: str, command: str
) -> dict:
    t = {
        "target": target,
        "size": size,
        "device": where,
        "measured": value,
        "unit": unit,
        "status": "not measured" if value is None else ("met" if ok(value) else "not met"),
    }
    if value is None:
        t["command"] = command
    return t


def _fused_vs_reference(size: str, dev: str, train) -> list[dict]:
    out = []
    for where in ("cpu", "cuda"):
        rows = [r for r in train if r.size == size and r.key == "fused_sdpa" and dev == where]
        for r in rows:
            setting = f"{where} {r.dtype}" + (" compiled" if r.compiled else "")
            out.append(
                _target(
                    "fused >= 1.0x torch.nn.Transformer",
                    size,
                    setting,
                    r.ratio_vs_reference,
                    lambda v: v >= 1.0,
                    "x",
                    GPU_COMMAND if where == "cuda" else CPU_COMMAND,
                )
            )
        if not rows:
            out.append(
                _target(
                    "fused >= 1.0x torch.nn.Transformer",
                    size,
                    where,
                    None,
                    lambda v: v >= 1.0,
                    "x",
                    GPU_COMMAND if where == "cuda" else CPU_COMMAND,
                )
            )
    return out


def _per_head_vs_fused(dev: str, train) -> dict:
    def step_s(key):
        rows = [r for r in train if r.size == "gpu" and r.key == key and not r.compiled and dev == "cuda"]
        return rows[0].step_s if rows else None

    fused, per_head = step_s("fused_sdpa"), step_s("per_head")
    return _target(
        "per-head step time <= 2x fused",
        "gpu",
        "cuda, eager",
        per_head / fused if fused and per_head else None,
        lambda v: v <= 2.0,
        "x",
        GPU_COMMAND,
    )


def evaluate_targets(result: dict) -> list[dict]:
    """One entry per target and size (and per dtype/compile setting where several were run)."""
    dev, name = result["meta"]["device_type"], result["meta"]["device_name"]
    train, dec = result["train"], result["decode"]
    out = []
    for size in dict.fromkeys(list(SIZES) + result["meta"]["sizes"]):  # the standard sizes, then any others
        out += _fused_vs_reference(size, dev, train)
        cached = [r for r in dec if r.size == size and r.key == "greedy_cached" and dev == "cpu"]
        out.append(
            _target(
                "cached greedy >= 3x recompute",
                size,
                "cpu",
                cached[0].ratio_vs_recompute if cached else None,
                lambda v: v >= 3.0,
                "x",
                CPU_COMMAND,
            )
        )
    out.append(_per_head_vs_fused(dev, train))
    mfus = [
        r.mfu
        for r in train
        if r.size == "base"
        and r.key == "fused_sdpa"
        and r.mfu is not None
        and dev == "cuda"
        and r.dtype == "bf16"
        and "H100" in name
    ]
    out.append(
        _target(
            "MFU >= 30% (fused)",
            "base",
            "one H100, bf16",
            max(mfus) if mfus else None,
            lambda v: v >= 0.30,
            "fraction",
            GPU_COMMAND,
        )
    )
    shares = [
        r.share_of_peak
        for r in result.get("cpu_arithmetic", [])
        if r.size == "cpu"
        and r.precision == "bf16"
        and r.share_of_peak is not None
        and r.threads == max(x.threads for x in result["cpu_arithmetic"])
    ]
    out.append(
        _target(
            "share of the bf16 matmul peak >= 40%",
            "cpu",
            "cpu bf16, every core",
            shares[0] if shares else None,
            lambda v: v >= 0.40,
            "fraction",
            BF16_CPU_COMMAND,
        )
    )
    return out
