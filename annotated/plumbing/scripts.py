"""The console scripts that installing the package makes (`pyproject.toml`, `[project.scripts]`).

Each goes through the one Ctrl-C protocol (`annotated/plumbing/interrupts.py`) as the `python -m` commands do:
the quiet handler first, then the command's module (torch and the rest load), then `run_command(main, name)`.
Pointing a script at the module's `main` itself would skip both, and a Ctrl-C would print a traceback.
This module imports nothing heavy, so that the handler is in place before torch loads
(`tests/plumbing/test_interrupts.py` runs each script as the installed one would and checks all of this).
"""

import importlib

from annotated.plumbing.interrupts import quiet_ctrl_c_while_starting, run_command

# console script -> the module whose main() it runs
SCRIPTS = {
    "annotated-train": "train_wmt",
    "annotated-translate": "annotated.decoding.translate",
    "annotated-equivalence": "annotated.proof.equivalence",
    "annotated-attention": "annotated.attention.dump",
    "annotated-heads": "annotated.attention.heads",
}


def run_script(name: str) -> None:
    """Run console script `name`: one line and exit code 130 on Ctrl-C, at any moment, as its module's command."""
    quiet_ctrl_c_while_starting(name)
    main = importlib.import_module(SCRIPTS[name]).main
    run_command(main, name)


def train() -> None:
    run_script("annotated-train")


def translate() -> None:
    run_script("annotated-translate")


def equivalence() -> None:
    run_script("annotated-equivalence")


def attention() -> None:
    run_script("annotated-attention")


def heads() -> None:
    run_script("annotated-heads")
