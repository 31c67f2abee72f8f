"""The translators in the box: a trained de -> en and en -> de model, shipped inside the package.

A fresh clone (or `pip install`) can translate, draw attention and study heads before anything is trained: this
folder holds one model per direction, each the model (`averaged.pt`) of a run of the `cpu` preset's model and its
earlier recipe of 4,200 steps, packed by `python -m annotated.training.pack RUN_DIR` into `de-en.pt` (float16
weights, loaded as float32) and its card `de-en.json` (`annotated/training/pack.py` says what they hold). Both
learnt from Multi30k's 29,000 image captions: "Ein Hund rennt über die Wiese." translates well, everyday language
("Ich habe heute keine Zeit, weil ich arbeiten muss.") is out of their domain.

Each checkpoint carries the length penalty that a run's own rule picks on validation (`choose_length_penalty`;
alpha 4 for both), and every command that decodes it uses it; its card records the choice
(`tests/shipped/test_shipped_length_penalty.py`: `test_the_shipped_alpha_is_the_one_the_rule_picks_on_validation`).

A model file is used only if its sha256 is its card's (`shipped_model`). Which model a command uses is
`choose_checkpoint`'s rule; the box is read-only (`outputs_beside`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from annotated.checkpoint import CheckpointError, load_checkpoint
from annotated.plumbing.files import sha256_of
from annotated.run_folder import RUNS, latest_run

FOLDER = Path(__file__).resolve().parent  # the box; the tests point it elsewhere
DIRECTIONS = ("de-en", "en-de")
DEFAULT = "de-en"
NAME_PREFIX = "shipped:"  # --checkpoint shipped:de-en
CARD_FORMAT = "annotated-shipped-v1"


def direction_asked(src: str | None, tgt: str | None) -> str | None:
    """ "src-tgt" from --src/--tgt; one of de/en alone implies the other; None when neither is given.

    >>> direction_asked("en", None), direction_asked(None, None), direction_asked("fr", "en")
    ('en-de', None, 'fr-en')
    """
    if src is None and tgt is None:
        return None
    other = {"de": "en", "en": "de"}
    src = src if src is not None else other.get(tgt or "")
    tgt = tgt if tgt is not None else other.get(src or "")
    if src is None or tgt is None:
        raise CheckpointError("give both --src and --tgt (only de and en imply each other)")
    if src == tgt:
        raise CheckpointError(f"--src and --tgt are both {src!r}; give two different languages")
    return f"{src}-{tgt}"


def read_card(direction: str, folder: Path | None = None) -> dict:
    """The card (`<direction>.json`) of a shipped model; CheckpointError when there is none or it is unreadable."""
    folder = FOLDER if folder is None else Path(folder)
    path = folder / f"{direction}.json"
    if direction not in DIRECTIONS:
        raise CheckpointError(
            f"there is no shipped {direction.replace('-', '->')} model (the box holds "
            f"{', '.join(d.replace('-', '->') for d in DIRECTIONS)}); train one "
            f"(make train ARGS='--src {direction.split('-')[0]} --tgt {direction.split('-')[-1]}') "
            f"or pass --checkpoint PATH"
        )
    if not path.is_file():
        raise CheckpointError(
            f"no shipped {direction.replace('-', '->')} model: {path} is missing (this copy of "
            f"the package was made without it); train one (make train) or pass --checkpoint PATH"
        )
    try:
        card = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"{path} is not a readable card ({e}); restore it (git checkout -- {path.name}, or reinstall the package)"
        ) from None
    if not isinstance(card, dict) or card.get("format") != CARD_FORMAT or not isinstance(card.get("sha256"), str):
        raise CheckpointError(f"{path} is not a shipped model's card (format {CARD_FORMAT!r} with a sha256)")
    return card


def shipped_model(direction: str = DEFAULT, folder: Path | None = None) -> Path:
    """The path of the shipped model for `direction`, after checking that its sha256 is its card's."""
    folder = FOLDER if folder is None else Path(folder)
    card = read_card(direction, folder)
    path = folder / card.get("file", f"{direction}.pt")
    if not path.is_file():
        raise CheckpointError(
            f"no shipped {direction.replace('-', '->')} model: {path} is missing; restore it "
            f"(git checkout -- {path.name}, or reinstall the package) or pass --checkpoint PATH"
        )
    found = sha256_of(path)
    if found != card["sha256"]:
        raise CheckpointError(
            f"{path} does not match the sha256 in {path.with_suffix('.json').name} (file {found[:16]}..., card "
            f"{card['sha256'][:16]}...): it changed after it was packed and is not used; restore it (git checkout "
            f"-- {path.name} in {folder}, or reinstall the package) or pack it again from its run "
            f"(python -m annotated.training.pack RUN_DIR --force)"
        )
    return path


def load_shipped(direction: str = DEFAULT, folder: Path | None = None):
    """(model in eval mode, float32; tokenizer; meta) of the shipped model for `direction`, checked first."""
    return load_checkpoint(shipped_model(direction, folder))


def is_shipped(path: Path, folder: Path | None = None) -> bool:
    """Whether `path` is a model file of the box (`<direction>.pt` in its folder)."""
    folder = FOLDER if folder is None else Path(folder)
    path = Path(path)
    return path.suffix == ".pt" and path.stem in DIRECTIONS and path.resolve().parent == folder.resolve()


def outputs_beside(checkpoint: Path) -> Path:
    """Where a command writes what belongs beside its checkpoint: the checkpoint's folder, but
    `runs/shipped-<direction>/` for a model of the (read-only) box. Through `runs/latest` it names the run itself,
    which stays where it is when `latest` moves on."""
    checkpoint = Path(checkpoint)
    return RUNS / f"shipped-{checkpoint.stem}" if is_shipped(checkpoint) else checkpoint.resolve().parent


def choose_checkpoint(
    checkpoint: Path | str | None,
    runs_dir: Path | str = RUNS,
    src: str | None = None,
    tgt: str | None = None,
    say: Callable[[str], None] = lambda line: None,
) -> Path:
    """The model a command uses: `checkpoint` when given (a `shipped:<direction>` name is checked), else the
    latest run under `runs_dir` (of the direction asked, if asked), else the shipped model of the direction asked
    (default de-en). `say` gets one line naming what was chosen when `checkpoint` is None.
    CheckpointError when there is nothing to use."""
    if checkpoint is not None:
        name = str(checkpoint)
        if name.startswith(NAME_PREFIX):
            return shipped_model(name[len(NAME_PREFIX) :])
        return shipped_model(Path(name).stem) if is_shipped(Path(name)) else Path(checkpoint)
    direction = direction_asked(src, tgt)
    run = latest_run(Path(runs_dir), direction)
    if run is not None:
        say(f"using {run}")
        return run
    wanted = direction or DEFAULT
    try:
        path = shipped_model(wanted)
    except CheckpointError as e:
        raise CheckpointError(
            f"no checkpoint found: no {wanted.replace('-', '->')} run under {runs_dir}/ and {e}"
        ) from None
    score = read_card(wanted).get("scores", {}).get("test", {}).get("bleu_lowercase")
    say(
        f"no trained {wanted.replace('-', '->')} run under {runs_dir}/: using the shipped model {shown_path(path)} "
        f"(Multi30k image captions{f', test BLEU {score:.1f} lowercased' if score is not None else ''}; "
        f"make train trains your own)"
    )
    return path


def shown_path(path: Path) -> Path:
    """`path` relative to the working folder when it lies below it (annotated/shipped/de-en.pt in a clone)."""
    try:
        return path.resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        return path


def typed_name(path: Path) -> str:
    """How a picture or a dump names a model: `shipped:<direction>` for a shipped model, else `shown_path` (never
    this machine's absolute path for a file below the working folder).

    >>> typed_name(FOLDER / "de-en.pt"), typed_name(Path("runs/x/best.pt").resolve())
    ('shipped:de-en', 'runs/x/best.pt')
    """
    return f"{NAME_PREFIX}{Path(path).stem}" if is_shipped(Path(path)) else str(shown_path(Path(path)))
