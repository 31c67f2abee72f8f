"""The front door of every command: which checkpoint it uses, where its outputs go, how it names itself.

A command keeps only what is its own; this is the rest, written once. It ends each command's `parse_args`:

```python
DOOR = Door(__file__)                       # the name of COMMANDS (plumbing/scripts.py) starts every line

p = DOOR.parser(description=...)
DOOR.checkpoint_options(p)                  # --checkpoint, --src, --tgt (and --runs-dir where asked)
DOOR.output_options(p)                      # --out, --force
args = p.parse_args(argv)
DOOR.checkpoint(args)                       # args.checkpoint: chosen, announced once on stderr, a file
DOOR.outputs(args, OUTPUTS, args.checkpoint)    # args.out: --out, else beside it; no earlier output lost
```

The checkpoint is `choose_checkpoint`'s (`annotated/shipped/`); outputs go beside it (`outputs_beside`: the box is
read-only); a refusal is one line, exit 2, its fix written as the user types it, at a shell or under `make`
(`typed`; `tests/plumbing/test_door.py`).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn, TextIO

from annotated.checkpoint import CheckpointError, checkpoint_file
from annotated.plumbing.options import Parser, writable_dir
from annotated.plumbing.scripts import name_of
from annotated.run_folder import RUNS
from annotated.shipped import choose_checkpoint, outputs_beside

MAKE_TARGET = "ANNOTATED_MAKE"  # set by the Makefile, for the commands it runs, to its target (`circuits`)
MAKE_VARIABLES = ("CHECKPOINT", "HF", "OUT", "TEXT")  # the Makefile's variables that build a command line, but ARGS
NAME_ONE = (
    "pass --checkpoint PATH"  # the fix the floors below write where no checkpoint is found; `checkpoint` types it
)
CHECKPOINT_HELP = (
    "a checkpoint file, or shipped:de-en / shipped:en-de (default: the latest run's model, runs/latest/averaged.pt "
    "or best.pt; with no run, the model shipped for --src/--tgt, default de -> en)"
)


@dataclass(frozen=True)
class Door:
    """One command's door: `file` is the command's module (`__file__`); `name` starts its lines (default: its
    name in COMMANDS); `stderr` gets them (default: the process's, looked up when written)."""

    file: str | Path
    name: str = ""
    stderr: TextIO | None = None

    def __post_init__(self):
        if not self.name:
            object.__setattr__(self, "name", name_of(self.file))

    def parser(self, **kwargs) -> Parser:
        """The command's options parser: its errors are one line that starts with the name."""
        return Parser(command=self.file, name=self.name, **kwargs)

    # ------------------------------------------------------------------ lines

    def say(self, line: str) -> None:
        print(f"{self.name}: {line}", file=self.stderr or sys.stderr, flush=True)

    def fail(self, message: str) -> NoReturn:
        """One line, `<name>: error: <message>`, and exit code 2 (SystemExit)."""
        self.say(f"error: {message}")
        raise SystemExit(2)

    @staticmethod
    def typed(*options: str) -> str:
        """How the user adds `options` to the command that runs: `add --force` at a shell; under make, the make
        line with them added to ARGS (`run make circuits CHECKPOINT=shipped:en-de ARGS='--head cross:1:2 --force'`).
        Static: the floors above the door that know no command (`training/runs.py`) type their fixes with it."""
        return Door.make_line(options) if os.environ.get(MAKE_TARGET) else f"add {' '.join(options)}"

    @staticmethod
    def make_line(options: tuple[str, ...] = (), **variables: str) -> str:
        """The make line that ran this command with `options` added to ARGS and `variables` set."""
        args = " ".join([os.environ.get("ARGS", "").strip(), *options]).strip()
        given = {v: shlex.quote(os.environ[v]) for v in MAKE_VARIABLES if os.environ.get(v)} | variables
        line = [os.environ[MAKE_TARGET], *(f"{k}={v}" for k, v in given.items())]
        return f"run make {' '.join(line + ([f'ARGS={shlex.quote(args)}'] if args else []))}"

    # ------------------------------------------------------------------ the checkpoint

    def checkpoint_options(
        self,
        p: argparse.ArgumentParser,
        *,
        languages: bool = True,
        runs: bool = False,
        default: str | None = None,
        required: bool = False,
        help: str = CHECKPOINT_HELP,
    ) -> None:
        """--checkpoint (`default`: none, the rule chooses); --src/--tgt, which pick the run or shipped model
        without it (unless `languages=False`); --runs-dir (with `runs=True`)."""
        p.add_argument("--checkpoint", default=default, required=required, help=help)
        if languages:
            p.add_argument("--src", default=None, help="source language of the model to use without --checkpoint")
            p.add_argument("--tgt", default=None, help="its target language (--src en alone means en -> de)")
        if runs:
            p.add_argument("--runs-dir", type=Path, default=RUNS, help="where to look without --checkpoint")

    def checkpoint(self, args: argparse.Namespace) -> Path:
        """The checkpoint file the command uses, from `args.checkpoint` (an empty one counts as none), `src`,
        `tgt` and `runs_dir` where the parser has them; set as `args.checkpoint` too, the value the command
        reads (what was typed: `args.typed_checkpoint`). Refused in one line (exit 2) when there is none, or it is no file."""
        given = getattr(args, "checkpoint", None) or None
        args.typed_checkpoint = None if given is None else str(given)  # as typed, for pictures and cards
        try:
            path = choose_checkpoint(
                given,
                getattr(args, "runs_dir", RUNS),
                getattr(args, "src", None),
                getattr(args, "tgt", None),
                say=self.say,
            )
            args.checkpoint = checkpoint_file(path)
            return args.checkpoint
        except CheckpointError as e:  # naming a checkpoint under make: CHECKPOINT=PATH
            named = self.make_line(CHECKPOINT="PATH") if os.environ.get(MAKE_TARGET) else NAME_ONE
            self.fail(str(e).replace(NAME_ONE, named))

    def given_checkpoint(self, args: argparse.Namespace) -> Path | None:
        """`checkpoint` for a command that uses one only when it is given (None otherwise)."""
        return self.checkpoint(args) if getattr(args, "checkpoint", None) else None

    # ------------------------------------------------------------------ the outputs

    def output_options(
        self,
        p: argparse.ArgumentParser,
        *,
        type: Callable[[str], Path] = writable_dir,
        help: str = "output folder (default: beside the model; runs/shipped-<src>-<tgt>/ for a shipped one)",
        force: bool = True,
        required: bool = False,
    ) -> None:
        """--out (by default a folder that can be written) and --force (unless `force=False`)."""
        p.add_argument("--out", type=type, default=None, required=required, help=help)
        if force:
            self.force_option(p)

    def force_option(self, p: argparse.ArgumentParser, help: str = "overwrite outputs of an earlier run") -> None:
        """--force alone, for a command whose output is a file it names itself (the translator's --output),
        checked with `keep`."""
        p.add_argument("--force", action="store_true", help=help)

    def outputs(
        self,
        args: argparse.Namespace,
        names: Iterable[str],
        checkpoint: Path | None = None,
        *,
        under: str = "",
        flag: str = "--force",
    ) -> Path:
        """The folder the outputs `names` go to, set as `args.out` too: `args.out`, else beside `checkpoint`
        (`outputs_beside`; in its folder `under`). Refused (exit 2) when one of them is there already and `flag`
        was not given."""
        beside = outputs_beside(checkpoint) / under if checkpoint is not None else None
        out = args.out if args.out is not None else beside
        if out is None:
            self.fail(f"name the folder to write: {self.typed('--out', 'FOLDER')}")
        self.keep(args, [Path(out) / n for n in names], flag=flag)
        args.out = Path(out)
        return args.out

    def keep(
        self, args: argparse.Namespace, paths: Iterable[Path], *, flag: str = "--force", elsewhere: str = ""
    ) -> None:
        """Refuse (exit 2) when one of `paths` exists and `flag` was not given: nothing of the user's is lost.
        `flag=""`: the command replaces nothing. `elsewhere`: how to write somewhere else (default: another --out)."""
        existing = [p for p in paths if p is not None and Path(p).exists()]
        if not existing or (flag and getattr(args, flag.lstrip("-").replace("-", "_"), False)):
            return
        elsewhere = elsewhere or f"{self.typed('--out', 'NEW')} to write elsewhere"
        if not flag:
            self.fail(f"{existing[0]} exists and is not overwritten; {elsewhere}")
        self.fail(f"{existing[0]} exists; {self.typed(flag)} to replace it, or {elsewhere}")
