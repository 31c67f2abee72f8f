"""The floors of the house: no module imports a room above its own, read from the imports themselves (`ast`).

`FLOORS` lists the rooms (a folder or a file, as a dotted module prefix) from the ground up. A module may import
its own room and any room on a lower floor; rooms that share a floor may not import each other. So no folder loop
can form (decoding -> shipped -> training -> decoding was one) and `annotated/plumbing/` stays the ground: it
imports nothing of the project but itself. Every module of the project must stand in a room: a new folder is
placed on purpose, not by accident. Tests are no rooms: they may import anything.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FLOORS: tuple[tuple[str, ...], ...] = (  # from the ground up
    ("annotated.plumbing",),  # files, progress bars, options, Ctrl-C, devices: nothing of the model
    ("annotated.tokens",),  # the chapter and what reads its attention
    ("annotated.transformer",),
    ("annotated.sites",),
    ("annotated.recording", "annotated.checkpoint"),  # a model on disk (builds models: above the chapter)
    ("annotated.checks", "annotated.run_folder"),  # checks at the door; the run folder's names and rules
    ("annotated.shipped",),  # the box and the rule that picks a command's model
    ("annotated.door",),  # every command's front door: its checkpoint, its outputs, its name
    ("annotated.decoding",),
    ("annotated.training",),
    ("annotated.attention", "annotated.interop", "annotated.proof"),
    ("annotated.circuits",),  # reads the heads with attention/'s pictures and bootstrap, and training/'s data
    ("benchmarks", "docs", "train_wmt"),  # what reads the whole package
)
PACKAGES = ("annotated", "benchmarks", "docs", "train_wmt")


def module_of(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {
    module_of(p): p
    for p in sorted([*ROOT.glob("annotated/**/*.py"), *ROOT.glob("benchmarks/**/*.py"), *ROOT.glob("docs/**/*.py")])
    if "_build" not in p.parts
} | {"train_wmt": ROOT / "train_wmt.py"}


def room_of(module: str) -> tuple[int, str] | None:
    """(floor, room) of `module`: the longest room that is the module or a package above it."""
    found = [
        (len(room), floor, room)
        for floor, rooms in enumerate(FLOORS)
        for room in rooms
        if module == room or module.startswith(room + ".")
    ]
    return max(found)[1:] if found else None


def imported(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of the project's own modules in `path`, at any depth of the file."""
    package = module_of(path) if path.name == "__init__.py" else module_of(path).rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the file's package up
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([base] if base else [])])
            # `from annotated import sites` imports the module annotated.sites
            found += [(node.lineno, f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base) for a in node.names]
    return [(line, m) for line, m in found if m.split(".")[0] in PACKAGES]


def test_every_module_stands_on_a_floor():
    assert [m for m in MODULES if m != "annotated" and room_of(m) is None] == []
    assert {"annotated.plumbing.files", "annotated.run_folder", "benchmarks.bench", "docs.build"} <= set(MODULES)


def test_the_floors_name_only_rooms_that_exist():
    rooms = [room for rooms in FLOORS for room in rooms]
    assert [r for r in rooms if not any(m == r or m.startswith(r + ".") for m in MODULES)] == []


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != "annotated"))
def test_no_module_imports_a_room_above_its_own_or_beside_it(module):
    floor, room = room_of(module)
    wrong = []
    for line, target in imported(MODULES[module]):
        if target == "annotated":
            continue  # the package's face, empty
        their_floor, their_room = room_of(target)
        if their_room != room and their_floor >= floor:
            wrong.append(
                f"{MODULES[module].relative_to(ROOT)}:{line} imports {target} ({their_room}, floor {their_floor})"
            )
    assert wrong == [], f"{room} is on floor {floor}; it may import only its own room and lower floors"
