"""The run folder's names and the rule for the latest run: one place that training, the box and every command read.

Training writes each run into `runs/<name>/` (the names are the constants below) and points `runs/latest` at the
newest run. A run's **model** (`run_model`) is `averaged.pt` where the run averaged its last epochs (the `cpu` and
`gpu` presets do), else `best.pt`: the rule is fixed before any test score is seen, never chosen by it. With no
run at all, a command uses the model shipped in the box (`choose_checkpoint` of `annotated/shipped/`).

>>> run_model(Path("no such run")) is None
True
>>> epoch_file(3)
'epoch3.pt'
"""

from __future__ import annotations

import json
from pathlib import Path

from annotated.checkpoint import CheckpointError

RUNS = Path("runs")  # the runs' default parent, relative to the current directory; `latest` lives only here
LATEST = "latest"  # runs/latest: the newest run (a symlink, or a text file naming it)
LAST = "last.pt"  # written at every save; resumable
BEST = "best.pt"  # the best validation BLEU so far
AVERAGED = "averaged.pt"  # the mean of the last epochs' checkpoints (average_last)
CONFIG = "config.json"  # the run's settings, written when it starts


def epoch_file(epoch: int) -> str:
    """The name of the checkpoint kept at the end of `epoch` for averaging."""
    return f"epoch{epoch}.pt"


def epoch_files(run: Path) -> list[Path]:
    """The epoch checkpoints kept in `run`, oldest epoch first."""
    return sorted(run.glob("epoch*.pt"), key=lambda p: int(p.stem.removeprefix("epoch")))


def run_model(run: Path) -> Path | None:
    """A run's model: `averaged.pt` when the run averaged its last epochs, else `best.pt`; None without either."""
    for name in (AVERAGED, BEST):
        if (run / name).is_file():
            return run / name
    return None


def latest_checkpoint(runs_dir: str | Path = RUNS) -> Path:
    """The model of the latest training run under `runs_dir`."""
    runs = Path(runs_dir)
    latest = runs / LATEST
    if latest.is_dir():  # a symlink to the run directory
        if model := run_model(latest):
            return model
    elif latest.is_file():  # a text file naming it
        name = latest.read_text(encoding="utf-8", errors="replace").strip()
        for run in (runs / name, Path(name)):
            if name and (model := run_model(run)):
                return model
    found = [p for p in runs.glob(f"*/{BEST}") if p.is_file()]
    if found and (model := run_model(max(found, key=lambda p: p.stat().st_mtime).parent)):
        return model
    raise CheckpointError(
        f"no checkpoint found: neither {latest}/{BEST} nor any {runs}/*/{BEST} exists; "
        f"train one (`make train`) or pass --checkpoint PATH"
    )


def run_direction(model: Path) -> str | None:
    """ "src-tgt" of a run's model, from its run's config.json (written by training), else None."""
    try:
        config = json.loads((model.parent / CONFIG).read_text(encoding="utf-8"))
        return f"{config['src_lang']}-{config['tgt_lang']}"
    except (OSError, ValueError, KeyError, TypeError):
        return None


def latest_run(runs_dir: Path, direction: str | None) -> Path | None:
    """The latest run's model (any direction when `direction` is None), else the newest run of `direction`, else
    None."""
    try:
        latest = latest_checkpoint(runs_dir)
    except CheckpointError:
        return None
    if direction is None or run_direction(latest) == direction:
        return latest
    models = [run_model(run) for run in Path(runs_dir).iterdir() if run.is_dir() and run.name != LATEST]
    fitting = [m for m in models if m is not None and run_direction(m) == direction]
    return max(fitting, key=lambda m: m.stat().st_mtime) if fitting else None
