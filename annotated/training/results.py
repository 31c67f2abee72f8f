# %% [markdown]
# # The end of a run: test scores and results.json
#
# When training stops (out of steps or of time; not on Ctrl-C), rank 0
# scores the test set with the best checkpoint (and the averaged one),
# greedy and with beam search (`annotated/training/evaluate.py`), and writes
# `results.json`: the settings, the arithmetic, the history, the test scores,
# samples and where the run came from (`annotated/plumbing/provenance.py`).
#
# **The length penalty.** The beam search's alpha is the settings' number,
# or, with `TrainConfig.length_penalty` None, `choose_length_penalty`'s
# pick on the whole validation split for the run's model
# (`length_penalty_of_run`), written into the tested checkpoints' meta so
# that the other tools decode with it
# (`test_a_run_chooses_its_length_penalty_on_validation_and_scores_the_test_set_with_it`).
#
# Tensorboard gets the test scores and the settings (its HPARAMS
# tab), so runs with different settings can be compared side by side.

# %%
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from annotated.checkpoint import atomic_torch_save, load_checkpoint, read_checkpoint, with_meta
from annotated.plumbing.allocator import peak_resident_bytes
from annotated.plumbing.files import atomic_write
from annotated.plumbing.provenance import environment
from annotated.run_folder import AVERAGED, BEST, LAST, epoch_files
from annotated.training.config import TrainConfig, config_dict
from annotated.training.evaluate import choose_length_penalty, evaluate_bleu
from annotated.training.memory import MemoryLog
from annotated.training.runs import average_checkpoints


@dataclass(frozen=True)
class Arithmetic:
    """How a run computes: fp32 or bf16 (and why), and the CPU threads torch uses."""

    precision: str
    reason: str
    threads: int


def checkpoints_to_test(cfg: TrainConfig, run_dir: Path) -> dict[str, Path]:
    """{"best": best.pt (last.pt for a run stopped before its first epoch ended), "averaged": averaged.pt (with
    average_last >= 2 and two epoch checkpoints, written here)}."""
    candidates = {"best": run_dir / BEST if (run_dir / BEST).exists() else run_dir / LAST}
    epochs = epoch_files(run_dir)
    if cfg.average_last >= 2 and len(epochs) >= 2:
        atomic_torch_save(average_checkpoints(epochs[-cfg.average_last :]), run_dir / AVERAGED)
        candidates["averaged"] = run_dir / AVERAGED
    return candidates


def score_test_set(
    cfg: TrainConfig,
    run_dir: Path,
    tokenizer,
    test_pairs,
    dev: torch.device,
    say: Callable[[str], None],
    arithmetic: Arithmetic,
    *,
    progress: bool = True,
    test_files=None,
    writer=None,
    val_pairs=None,
    started_in: dict | None = None,
    memory: MemoryLog | None = None,
) -> dict:
    """Test BLEU of the best (and averaged) checkpoint, greedy and beam (at the length penalty of the settings,
    or chosen on `val_pairs`); writes results.json and, given a tensorboard writer, the test scores and the
    settings. `started_in`: the environment the training started in (`environment()` then: the code that
    trained, not the checkout as it is when training ends); else taken now. `memory`: the run's `MemoryLog`,
    given a row where each phase here ends, all of them in results.json."""
    test_set = f"{test_files[0]} + {test_files[1]}" if test_files else "test_2016_flickr"  # named by its files
    results: dict[str, Any] = {
        "run_dir": str(run_dir),
        "device": str(dev),
        "torch": torch.__version__,
        "precision": arithmetic.precision,
        "precision_reason": arithmetic.reason,
        "threads": arithmetic.threads,
        "train_config": config_dict(cfg),
        "test_set": test_set,
        "test": {},
        "environment": started_in or environment(),
    }
    if test_files:
        results["test_files"] = [str(f) for f in test_files]
    last = read_checkpoint(run_dir / LAST)["run_state"]
    results.update(steps=last["step"], train_s=round(last.get("train_s", 0.0), 1), history=last["history"])
    samples: list = []
    memory = memory or MemoryLog()
    step, first_row = last["step"], len(memory.rows)
    tested = checkpoints_to_test(cfg, run_dir)
    memory.phase_end("averaging", step, writer)
    results["length_penalty"] = length_penalty_of_run(cfg, tested, tokenizer, val_pairs, dev, say, progress)
    memory.phase_end("length_penalty", step, writer)
    alpha = results["length_penalty"]["chosen"]
    for name, path in tested.items():
        model, _, meta = load_checkpoint(path)
        model.to(dev)
        greedy, hyps = evaluate_bleu(model, tokenizer, test_pairs, 1, 0.0, dev, progress)
        memory.phase_end(f"test_{name}_greedy", step, writer)
        beam, beam_hyps = evaluate_bleu(model, tokenizer, test_pairs, cfg.beam_size, alpha, dev, progress)
        memory.phase_end(f"test_{name}_beam", step, writer)
        results["test"][name] = {
            "checkpoint": str(path),
            "epoch": meta.get("epoch"),
            "greedy": greedy,
            "beam": dict(beam, length_penalty=alpha),
        }
        say(
            f"{test_set} {cfg.src_lang}->{cfg.tgt_lang} [{name}]: greedy BLEU {greedy['bleu']:.2f} "
            f"(lowercased {greedy['bleu_lowercase']:.2f}), beam {cfg.beam_size} BLEU {beam['bleu']:.2f} "
            f"(lowercased {beam['bleu_lowercase']:.2f}), chrF {beam['chrf']:.2f}"
        )
        if not samples:
            samples = [
                {"source": s, "reference": r, "greedy": g, "beam": b}
                for (s, r), g, b in list(zip(test_pairs, hyps, beam_hyps))[:5]
            ]
    results["samples"] = samples
    results["memory"] = memory.rows  # what the process held where each phase ended (training/memory.py)
    atomic_write(run_dir / "results.json", json.dumps(results, indent=2, ensure_ascii=False))
    if writer is not None:
        log_test_scores(writer, cfg, results)
    for s in samples[:3]:
        say(f"  src : {s['source']}\n  ref : {s['reference']}\n  beam: {s['beam']}")
    peaks = ", ".join(f"{r['phase']} {r['resident_mb']:,}" for r in memory.rows[first_row:])
    say(f"memory (MB resident where each phase ended): {peaks}; the run's peak {peak_resident_bytes() >> 20:,} MB")
    say(f"results: {run_dir / 'results.json'}; checkpoints: {run_dir}; tensorboard --logdir {run_dir / 'tb'}")
    return results


def length_penalty_of_run(
    cfg: TrainConfig, tested: dict[str, Path], tokenizer, val_pairs, dev, say, progress: bool
) -> dict:
    """{"chosen": alpha, "chosen_on": where it came from, ...}: the settings' number, or the alpha with the best
    BLEU on `val_pairs` for the run's model (averaged, else best), then written into every tested checkpoint's
    meta."""
    if cfg.length_penalty is not None:
        return {"chosen": cfg.length_penalty, "chosen_on": "the settings"}
    model, _, _ = load_checkpoint(tested.get("averaged", tested["best"]))
    alpha, bleu = choose_length_penalty(
        model.to(dev), tokenizer, val_pairs, cfg.beam_size, device=dev, progress=progress
    )
    for path in tested.values():
        with_meta(path, path, length_penalty=alpha)
    table = ", ".join(f"{a:g}: {b:.2f}" for a, b in bleu.items())
    say(
        f"length penalty: alpha {alpha:g}, the best beam {cfg.beam_size} BLEU on the {len(val_pairs)} validation "
        f"sentences ({table})"
    )
    return {
        "chosen": alpha,
        "chosen_on": f"validation ({len(val_pairs)} sentences)",
        "validation_bleu": {f"{a:g}": b for a, b in bleu.items()},
    }


def flat_settings(cfg: TrainConfig) -> dict:
    """The settings as one level of name -> number, text or bool (tensorboard's hparams take no None or dict).

    >>> from annotated.training.config import PRESETS
    >>> s = flat_settings(PRESETS["smoke"])
    >>> s["model.d_model"], s["max_tokens"], s["max_minutes"]
    (32, 800, 'none')
    """
    flat = {}
    for key, value in config_dict(cfg).items():
        items = {f"model.{k}": v for k, v in value.items()} if key == "model" else {key: value}
        flat.update({k: "none" if v is None else v for k, v in items.items()})
    return flat


def log_test_scores(writer, cfg: TrainConfig, results: dict) -> None:
    """Each tested checkpoint's beam and greedy BLEU and chrF, as scalars at the last step and as the metrics
    of the run's settings (tensorboard's HPARAMS tab)."""
    metrics = {}
    for name, scores in results["test"].items():
        for search in ("greedy", "beam"):
            for metric in ("bleu", "chrf"):
                metrics[f"test_{name}/{search}_{metric}"] = scores[search][metric]
    for tag, value in metrics.items():
        writer.add_scalar(tag, value, results["steps"])
    writer.add_hparams(
        dict(
            flat_settings(cfg),
            precision_used=results["precision"],
            threads=results["threads"],
            length_penalty_used=results["length_penalty"]["chosen"],
        ),
        {f"hparams/{tag}": value for tag, value in metrics.items()},
        run_name="hparams",
    )
    writer.flush()
