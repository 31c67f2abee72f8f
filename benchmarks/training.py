# %% [markdown]
# # The training step's rows (`make bench`)
#
# Every implementation of `benchmarks/trainees.py` trains on the same
# batches, in interleaved rounds (`benchmarks/timing.py`), eagerly and, where
# asked, under `torch.compile`. A row's "x reference" is the
# `torch.nn.Transformer` row's median step time over its own, from the same
# rounds. Memory comes from `benchmarks/memory.py`. Besides the rows: the
# compile speed-up of each row measured both ways, and the host syncs of the
# real training step (`annotated.training.train.train_step`).

# %%
from __future__ import annotations

from collections.abc import Callable

import torch

from annotated.training.train import make_optimizer
from annotated.transformer import make_model
from benchmarks.flops import training_flops
from benchmarks.memory import cuda_step_peak, resident_bytes, run_memory_probe
from benchmarks.rows import TrainRow
from benchmarks.sizes import Size, make_batches, real_lengths
from benchmarks.timing import Settings, error_text, interleaved_times, median
from benchmarks.trainees import build_trainees, make_step


def _step_fns(trainees, batches, size: Size, st: Settings) -> dict:
    """(key, compiled) -> one training step per call; one compiled wrapper per module (the fused rows share it)."""
    fns = {}
    for compiled in st.compile_modes:
        compiled_models = {}
        for t in trainees:
            if compiled and st.compile_keys is not None and t.key not in st.compile_keys:
                continue
            model = t.model
            if compiled:
                if id(t.model) not in compiled_models:
                    compiled_models[id(t.model)] = torch.compile(t.model)  # lazy: compiles at the first call
                model = compiled_models[id(t.model)]
            fns[(t.key, compiled)] = make_step(t, model, batches, size.train.label_smoothing, st.amp())
    return fns


def _cpu_memory(size: Size, st: Settings, sentences: int, trainees, log) -> dict:
    if not (st.memory and st.device.type == "cpu"):
        return {}
    log(f"[{size.name}] memory probe (subprocess)")
    try:
        return run_memory_probe(size, st.train_batches, sentences, st.seed, [t.key for t in trainees])
    except Exception as e:  # noqa: BLE001 reported in the rows
        return {t.key: {"error": error_text(e)} for t in trainees}


def _add_memory(row: TrainRow, t, step, st: Settings, cpu_memory: dict) -> None:
    if st.device.type == "cuda" and st.memory and row.error is None:
        try:
            row.resident_bytes = resident_bytes(t)
            row.step_peak_bytes = cuda_step_peak(step, t, st.device)
        except Exception as e:  # noqa: BLE001 recorded in the row, the other rows go on
            row.memory_error = error_text(e)
    elif t.key in cpu_memory:
        m = cpu_memory[t.key]
        row.memory_error = m.get("error")
        row.resident_bytes, row.step_peak_bytes = m.get("resident_bytes"), m.get("step_peak_bytes")


def bench_training(size: Size, st: Settings, log: Callable[[str], None]) -> list[TrainRow]:
    device = st.device
    sentences = size.train_sentences[device.type]
    batches = [
        (s.to(device), t.to(device))
        for s, t in make_batches(st.train_batches, sentences, size.train.vocab_size, st.seed)
    ]
    src_l, tgt_l, tokens = real_lengths(batches)
    trainees = build_trainees(size, device, st.seed)
    fns = _step_fns(trainees, batches, size, st)
    log(
        f"[{size.name}] training: {len(fns)} rows, {sentences} sentences/batch, shape src {tuple(batches[0][0].shape)} "
        f"tgt {tuple(batches[0][1].shape)}"
    )
    times, iters, errors = interleaved_times(
        fns, st.reps, st.window, st.sync, lambda s: log(f"[{size.name}] training {s}"), st.timer()
    )
    cpu_memory = _cpu_memory(size, st, sentences, trainees, log)
    rows = []
    for compiled in st.compile_modes:
        for t in trainees:
            name = (t.key, compiled)
            if name not in fns:
                continue
            row = TrainRow(
                size=size.name,
                key=t.key,
                device=device.type,
                dtype=st.dtype,
                compiled=compiled,
                sentences=sentences,
                batches=len(batches),
                src_shape=list(batches[0][0].shape),
                tgt_shape=list(batches[0][1].shape),
                target_tokens_per_step=tokens / len(batches),
                flops_per_step=training_flops(size.model_config(), src_l, tgt_l) / len(batches),
                step_s_rounds=times.get(name, []),
                calls_per_round=iters.get(name),
                reference_step_s=median(times.get(("reference", compiled), [])),
                peak_tflops=st.peak_tflops,
                error=errors.get(name),
            )
            _add_memory(row, t, fns[name], st, cpu_memory)
            rows.append(row)
    return rows


def compile_speedups(rows: list[TrainRow]) -> list[dict]:
    """Eager step time / compiled step time of each row measured both ways in this run."""
    eager = {(r.size, r.key): r.step_s for r in rows if not r.compiled and r.step_s}
    return [
        {"size": r.size, "key": r.key, "speedup": round(eager[(r.size, r.key)] / r.step_s, 3)}
        for r in rows
        if r.compiled and r.step_s and (r.size, r.key) in eager
    ]


def host_syncs_per_step(size: Size, st: Settings) -> dict:
    """Synchronising operators per step of the real training step (`train.train_step`), counted over
    `st.sync_steps` steps with `benchmarks.syncs.SyncCounter` (after one uncounted step)."""
    from annotated.training.data import Batch
    from annotated.training.train import Meter, train_step
    from benchmarks.syncs import SyncCounter

    torch.manual_seed(st.seed)
    model = make_model(size.model_config()).to(st.device).train()
    opt, sched = make_optimizer(model, size.train)
    batches = [
        Batch(s, t, torch.arange(s.size(0)))
        for s, t in make_batches(2, size.train_sentences[st.device.type], size.train.vocab_size, st.seed)
    ]
    n = [int((b.tgt[:, 1:] != 0).sum()) for b in batches]
    meter = Meter(st.device)
    meter.add(*train_step(model, opt, sched, [batches[0]], n[0], size.train, st.device))
    with SyncCounter() as counter:
        for i in range(st.sync_steps):
            meter.add(*train_step(model, opt, sched, [batches[i % 2]], n[i % 2], size.train, st.device))
    return {
        "size": size.name,
        "steps": st.sync_steps,
        "per_step": counter.total / st.sync_steps,
        "ops": dict(counter.counts),
    }
