# %% [markdown]
# # A run's folder, its logs and its checkpoints
#
# Everything `train()` (`annotated/training/train.py`) keeps on disk lives in one run
# folder: `config.json`, `train.log`, `train_loss.tsv` (a row per read of the
# running loss), `tb/` (tensorboard), `last.pt`, `best.pt`, `epoch{n}.pt`
# (with `average_last`), `averaged.pt` and `results.json`. Checkpoints and
# JSON files are written atomically (`annotated/plumbing/files.py`).
#
# **The folder is the user's.** `check_run_dir` refuses, before any work,
# a folder that is neither new, empty, nor (with `--resume`) a run, and
# `point_latest` links `runs/latest` to runs in `runs/` only
# (`docs/faults.md#your-folders-and-files`).
#
# **Resuming** reads `last.pt`, refuses a checkpoint of other settings or
# another tokenizer (`resume_state`), and cuts `train_loss.tsv` back to its
# step, where a killed run's later rows would appear twice (`truncate_log`).
#
# **Which checkpoint.** The folder's names, a run's model (`run_model`) and
# the latest run are `annotated/run_folder.py`'s; which model a command uses
# without `--checkpoint` is `choose_checkpoint`'s (`annotated/shipped/`).

# %%
from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from annotated.checkpoint import CheckpointError, model_from_state, read_checkpoint
from annotated.door import Door
from annotated.plumbing.files import atomic_write
from annotated.run_folder import LAST, LATEST, RUNS
from annotated.training.config import TrainConfig, config_from_dict


class TrainingError(RuntimeError):
    """A run that cannot go on (non-finite loss, a run folder that is not ours, incompatible resume)."""


@dataclass
class RunState:
    epoch: int = 0  # epochs completed
    batch_in_epoch: int = 0  # batches of the current epoch already trained
    step: int = 0  # optimizer steps taken
    best_bleu: float = -1.0
    history: list = field(default_factory=list)
    world_size: int = 1  # processes of the run (batch_in_epoch counts the batches of each one)
    train_s: float = 0.0  # seconds spent in training steps (evaluation excluded), over all sessions


def check_run_dir(run_dir: Path, resume: bool) -> None:
    """A new or empty folder, or with resume one holding last.pt; else one line saying what to do."""
    if run_dir.resolve() == Path.cwd().resolve() or run_dir.name in ("", ".", ".."):
        raise TrainingError(
            f"--run-dir {run_dir}: the run needs a folder of its own; choose a new one, e.g. runs/my-run"
        )
    if run_dir.exists() and not run_dir.is_dir():
        raise TrainingError(f"--run-dir {run_dir} is a file, not a folder; choose another --run-dir")
    if resume:
        if not (run_dir / LAST).is_file():
            raise CheckpointError(
                f"{run_dir / LAST}: no such file; --resume continues the run whose last.pt is in --run-dir"
            )
    elif (run_dir / LAST).exists():
        raise TrainingError(
            f"{run_dir} already holds a run (last.pt); {Door.typed('--resume')} to continue it or choose another --run-dir"
        )
    elif run_dir.is_dir() and any(run_dir.iterdir()):
        raise TrainingError(
            f"{run_dir} is not empty and holds no run; training writes checkpoints, logs and "
            f"results there, so choose a new or empty --run-dir"
        )


def point_latest(run_dir: Path) -> None:
    """runs/latest -> this run (an atomically replaced symlink) for a run in runs/, unless `latest` is the
    user's own file; nothing for a run elsewhere."""
    if run_dir.parent.resolve() != RUNS.resolve():
        return
    link = run_dir.parent / LATEST
    if link.exists() and not link.is_symlink():
        return
    tmp = run_dir.parent / f".latest.{os.getpid()}.tmp"
    try:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        tmp.symlink_to(run_dir.name)
        os.replace(tmp, link)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def log_line(run_dir: Path, text: str) -> None:
    """Print `text` through tqdm's writer (above a progress bar, never into it) and append it to train.log."""
    from tqdm import tqdm

    tqdm.write(text)
    sys.stdout.flush()
    with open(run_dir / "train.log", "a", encoding="utf-8") as f:
        f.write(text + "\n")


def truncate_log(path: Path, step: int) -> None:
    """Drop the rows of train_loss.tsv after `step` (written after the checkpoint a resumed run starts from)."""
    if path.is_file():
        rows = path.read_text().splitlines(keepends=True)
        atomic_write(path, "".join(r for r in rows if r.strip() and int(r.split("\t")[0]) <= step))


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def average_checkpoints(paths: list[Path]) -> dict:
    """Element-wise mean of the model parameters of several checkpoints (same config)."""
    states = [read_checkpoint(p) for p in paths]
    base = dict(states[-1])
    base["model"] = {
        k: sum(s["model"][k].double() for s in states).div(len(states)).to(v.dtype)
        for k, v in states[-1]["model"].items()
    }
    base["meta"] = dict(base.get("meta", {}), averaged=[str(p) for p in paths])
    for key in ("optimizer", "scheduler", "rng", "run_state"):
        base.pop(key, None)
    return base


def settings_that_differ(saved: TrainConfig, now: TrainConfig) -> dict[str, tuple]:
    """{name: (saved, now)} for the settings a resumed run must share with its checkpoint: the data and the
    model (dropout aside, which may change between sessions)."""
    pairs = {k: (getattr(saved, k), getattr(now, k)) for k in ("src_lang", "tgt_lang", "train_limit", "vocab_size")}
    pairs.update(
        {
            k: (getattr(saved.model, k), getattr(now.model, k))  # (the joint vocabulary: vocab_size)
            for k in dataclasses.asdict(now.model)
            if k not in ("dropout", "src_vocab", "tgt_vocab")
        }
    )
    return {k: (a, b) for k, (a, b) in pairs.items() if a != b}


def resume_state(path: Path, cfg: TrainConfig, model, opt, sched, tokenizer=None, read=read_checkpoint) -> RunState:
    """Load model, optimizer, scheduler and random states from a run's last.pt; its RunState."""
    state = read(path)
    if "run_state" not in state:
        raise CheckpointError(f"checkpoint {path} has no training state; it cannot be resumed")
    if "train_config" not in state.get("meta", {}):
        raise CheckpointError(f"checkpoint {path} names no training settings (meta.train_config); it cannot be resumed")
    saved = config_from_dict(state["meta"]["train_config"])
    diff = settings_that_differ(saved, cfg)
    if diff:
        raise CheckpointError(
            f"checkpoint {path} was trained with different settings; cannot resume: "
            + ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in diff.items())
        )
    if tokenizer is not None and state.get("tokenizer") not in (None, tokenizer.to_bytes()):
        raise CheckpointError(
            f"checkpoint {path} was trained with another tokenizer than the one built from "
            f"the training data now (the data or the sentencepiece version changed); "
            f"cannot resume"
        )
    loaded = model_from_state(state, path)
    model.load_state_dict(loaded.state_dict())
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    return RunState(**state["run_state"])
