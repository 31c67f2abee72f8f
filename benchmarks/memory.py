# %% [markdown]
# # Memory of a training step (`make bench`)
#
# We report two numbers per row. **Resident**: the bytes of the parameters
# and of Adam's two moment estimates, counted exactly from the tensors.
# **Step peak**: the most memory the step needs *on top of* that: activations
# kept for the backward pass, gradients, and temporaries.
#
# - On CUDA the caching allocator counts exactly: reset its peak before a
#   step, subtract the bytes allocated before it.
# - On the CPU PyTorch keeps no such count, and Python's `tracemalloc` does
#   not see PyTorch's allocations. We measure the process's resident memory
#   instead, in a fresh subprocess per size (`python -m benchmarks.memory`):
#   Linux's peak resident size (`VmHWM`) is reset by writing `5` to
#   `/proc/self/clear_refs` just before the step, and the step peak is
#   `VmHWM` after the step minus `VmRSS` before it. This counts pages, not
#   tensors, so glibc must give freed memory back to the system: the
#   subprocess runs with `MALLOC_MMAP_THRESHOLD_=65536`, which puts every
#   block of 64 KiB or more in its own mapping, returned on `free`. Without
#   that, memory freed by one step would be reused by the next one unseen.
#   Small blocks (under 64 KiB) can still be reused, so the CPU number is
#   accurate to a few MB and can only err low.

# %%
from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from benchmarks.sizes import Size, make_batches
from benchmarks.trainees import Trainee, build_trainees, make_step

ROOT = Path(__file__).resolve().parent.parent


def resident_bytes(t: Trainee) -> int:
    """Parameters plus optimiser state, in bytes (a tied table counted once)."""
    params = {id(p): p.numel() * p.element_size() for p in t.model.parameters()}
    state = sum(
        v.numel() * v.element_size()
        for s in t.opt.state.values()
        for v in s.values()
        if isinstance(v, Tensor) and v.dim() > 0
    )
    return sum(params.values()) + state


def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} field")


def cpu_step_peak(step: Callable[[], None], t: Trainee) -> int:
    """Peak resident bytes of one step above the resident bytes before it (see above)."""
    t.opt.zero_grad(set_to_none=True)
    gc.collect()
    before = _proc_status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident size
    step()
    return max(0, _proc_status_kib("VmHWM") - before) * 1024


def cuda_step_peak(step: Callable[[], None], t: Trainee, device: torch.device) -> int:
    t.opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def memory_probe(spec: dict) -> dict:
    """Runs in the CPU memory subprocess: key -> {resident_bytes, step_peak_bytes}."""
    size = Size.from_json(spec["size"])
    torch.set_num_threads(spec["threads"])
    batches = make_batches(spec["n_batches"], spec["sentences"], size.train.vocab_size, spec["seed"])
    out = {}
    for t in build_trainees(size, torch.device("cpu"), spec["seed"], keys=tuple(spec["keys"])):
        step = make_step(t, t.model, batches, size.train.label_smoothing, contextlib.nullcontext)
        step()  # allocates Adam's state and warms up
        peak = cpu_step_peak(step, t)
        out[t.key] = {"resident_bytes": resident_bytes(t), "step_peak_bytes": peak}
    return out


def run_memory_probe(size: Size, n_batches: int, sentences: int, seed: int, keys) -> dict:
    """Start the probe in a fresh interpreter (see above) and return its result."""
    if not os.path.exists("/proc/self/clear_refs"):
        raise RuntimeError("the CPU memory probe needs Linux's /proc/self/clear_refs")
    spec = {
        "size": size.to_json(),
        "n_batches": n_batches,
        "sentences": sentences,
        "seed": seed,
        "keys": list(keys),
        "threads": torch.get_num_threads(),
    }
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.memory", json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(ROOT),
    )
    if proc.returncode != 0:
        raise RuntimeError(f"memory probe failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":  # the subprocess: one JSON argument in, one JSON line out
    print(json.dumps(memory_probe(json.loads(sys.argv[1]))))
