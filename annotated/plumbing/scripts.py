"""Every command's name, start-up and Ctrl-C protocol, in one place: the `python -m` modules, `train_wmt.py` and
the console scripts of `pip install -e .` (`pyproject.toml`, `[project.scripts]`) all come through here.

**Each command is named once**, in `COMMANDS`: its module -> the name that starts its lines on stderr
(`translate: error: ...`, `translate: interrupted`). A command module writes its name nowhere: it ends with

```python
if __name__ == "__main__":
    from annotated.plumbing.scripts import run_main

    run_main(main)
```

and `run_main` finds the name here, by the module's file; its own messages and its options parser take it through
`Door(__file__)` (`annotated/door.py`) or `Parser(command=__file__)` (`annotated/plumbing/options.py`).

**Start-up.** The Ctrl-C handler of the protocol (`annotated/plumbing/interrupts.py`) must be in place before torch
loads. Python imports a module's packages before it runs the module, so the packages' `__init__.py` (`annotated/`,
`benchmarks/`, `docs/`) call `starting()`, which installs it only when this process is starting one of `COMMANDS`
(not in a notebook or a test); a console script runs `script()`, which does the same. This module imports nothing
heavy (`tests/plumbing/test_interrupts.py`).
"""

import importlib
import sys
from collections.abc import Callable
from pathlib import Path

from annotated.plumbing.interrupts import quiet_ctrl_c_while_starting, run_command

ROOT = Path(__file__).resolve().parents[2]  # the folder that holds annotated/ (in a clone: benchmarks/, docs/ too)
SCRIPT_PREFIX = "annotated-"  # the console script of command NAME is annotated-NAME (pyproject.toml)

COMMANDS = {  # module -> the command's name
    "train_wmt": "train",
    "annotated.decoding.translate": "translate",
    "annotated.attention.dump": "attention",
    "annotated.attention.heads": "heads",
    "annotated.circuits.command": "circuits",
    "annotated.proof.equivalence": "equivalence",
    "annotated.interop.folders": "export-import",  # its subcommands name themselves: export, import
    "annotated.training.pack": "pack",
    "annotated.training.add_case_table": "add_case_table",
    "annotated.training.choose_length_penalty": "choose_length_penalty",
    "benchmarks.bench": "bench",
    "benchmarks.gpu_report": "gpu-report",
    "benchmarks.profiling": "profiling",
    "benchmarks.case": "case-bench",
    "benchmarks.padding": "padding-bench",
    "benchmarks.allocator": "allocator-bench",
    "benchmarks.commands_memory": "memory-table",
    "benchmarks.bf16_memory": "bf16-memory-bench",
    "benchmarks.translate": "translate-bench",
    "benchmarks.int8_products": "int8-bench",
    "benchmarks.circuits": "circuits-bench",
    "benchmarks.alignment": "alignment-bench",
    "benchmarks.agreement": "agreement",
    "benchmarks.annotated_transformer": "annotated-transformer-bench",
    "docs.build": "docs",
    "docs.notebook": "notebook",
    "docs.screenshots": "screenshots",
}


def module_of(file: str | Path) -> str | None:
    """The module of a file of this tree (`annotated/decoding/translate.py` -> annotated.decoding.translate), else
    None.

    >>> module_of(ROOT / "annotated" / "decoding" / "translate.py"), module_of("/usr/bin/annotated-translate")
    ('annotated.decoding.translate', None)
    """
    try:
        parts = Path(file).resolve().relative_to(ROOT).with_suffix("").parts
    except ValueError:
        return None
    return ".".join(parts)


def name_of(file: str | Path) -> str:
    """The name of the command whose module is `file` (pass `__file__`).

    >>> name_of(ROOT / "annotated" / "attention" / "dump.py")
    'attention'
    """
    return COMMANDS[module_of(file) or str(file)]


def usage_of(file: str | Path) -> str:
    """How the command whose module is `file` is typed: `python -m MODULE`, or the file of a script at the root.

    >>> usage_of(ROOT / "annotated" / "attention" / "dump.py"), usage_of(ROOT / "train_wmt.py")
    ('python -m annotated.attention.dump', 'train_wmt.py')
    """
    module = module_of(file) or str(file)
    return f"{module}.py" if "." not in module else f"python -m {module}"


def _starting_module() -> str | None:
    """The module this process runs as its main program: `python -m M` or `python FILE` (None for `-c` or a REPL)."""
    if sys.argv[:1] == ["-m"]:  # `python -m M`: argv[0] is "-m" while Python imports M's packages
        args = sys.orig_argv
        return next((a[2:] or b for a, b in zip(args, args[1:]) if a.startswith("-m")), None)
    file = getattr(sys.modules.get("__main__"), "__file__", None)  # `python train_wmt.py`
    return module_of(file) if file is not None else None


def starting() -> None:
    """Called by the packages' `__init__.py`: a Ctrl-C while a command of `COMMANDS` starts (torch loads) prints
    one line and exits 130; for anything else, nothing."""
    module = _starting_module()
    if module in COMMANDS:
        quiet_ctrl_c_while_starting(COMMANDS[module])


def run_main(main: Callable[[], object]) -> None:
    """Run a command's `main()` under the one Ctrl-C protocol, with the command's name; exits with its code."""
    run_command(main, name_of(main.__code__.co_filename))


def script() -> None:
    """The console script `annotated-NAME`: the quiet handler first, then the command's module (torch and the rest
    load), then its `main()` under the protocol. (Pointing a script at `main` itself would skip both, and a Ctrl-C
    would print a traceback.)"""
    name = Path(sys.argv[0]).stem.removeprefix(SCRIPT_PREFIX)
    module = next(m for m, n in COMMANDS.items() if n == name)
    quiet_ctrl_c_while_starting(name)
    run_command(importlib.import_module(module).main, name)
