"""annotated/plumbing/scripts.py: every command is named once, in `COMMANDS`, and nowhere else.

A command's name starts its lines on stderr (`translate: error: ...`) and its usage line shows how it is typed
(`python -m annotated.decoding.translate`); both come from `name_of(__file__)` and `usage_of(__file__)`. A command
file that writes either itself (a `"translate: ..."` literal, a `prog="python -m ..."`) names itself a second time
and fails here, as does a name given to two commands or a console script that names no command.
"""

import ast
from pathlib import Path

import pytest
import tomllib

from annotated.plumbing.scripts import COMMANDS, ROOT, module_of, name_of, usage_of

SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]


def file_of(module: str) -> Path:
    return ROOT / (module.replace(".", "/") + ".py")


def strings(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every string in the code of `path` (f-string pieces too), docstrings left out."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]


def test_each_name_belongs_to_one_command_and_each_command_exists():
    assert len(set(COMMANDS.values())) == len(COMMANDS), "two commands share a name"
    assert [m for m in COMMANDS if not file_of(m).is_file()] == []
    assert all(module_of(file_of(m)) == m and name_of(file_of(m)) == n for m, n in COMMANDS.items())


def test_every_console_script_runs_a_named_command_through_the_one_route():
    assert set(SCRIPTS.values()) == {"annotated.plumbing.scripts:script"}
    assert {name.removeprefix("annotated-") for name in SCRIPTS} <= set(COMMANDS.values())


@pytest.mark.parametrize("module", sorted(COMMANDS))
def test_a_command_file_does_not_write_its_own_name(module):
    name, usage = COMMANDS[module], usage_of(file_of(module))
    written = [
        f"{file_of(module).relative_to(ROOT)}:{line}: {text!r}"
        for line, text in strings(file_of(module))
        if text.startswith(f"{name}:") or usage in text
    ]
    assert written == [], f"the name {name!r} and the usage {usage!r} come from name_of/usage_of(__file__)"
