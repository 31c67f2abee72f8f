"""annotated/door.py: every command chooses its checkpoint, places its outputs and names itself through one door;
its refusals are one line, exit 2, with the fix as the user types it (under make, the make line)."""

import ast
import io
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from annotated.plumbing.scripts import COMMANDS, ROOT

DOORS = ("choose_checkpoint", "outputs_beside", "checkpoint_file")  # the door's own calls
DOOR_OPTIONS = ("--checkpoint", "--runs-dir", "--force")  # declared by the door only
RESOLVED = (("args", "checkpoint"), ("args", "out"))  # set by the door only


def command_file(module: str) -> Path:
    return ROOT / (module.replace(".", "/") + ".py")


def bypasses(module: str) -> list[str]:
    """What in a command's module does the door's work itself: (line) what."""
    found = []
    for node in ast.walk(ast.parse(command_file(module).read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in DOORS:
                found.append(f"{node.lineno}: calls {name}")
            if name == "add_argument" and any(
                isinstance(a, ast.Constant) and a.value in DOOR_OPTIONS for a in node.args
            ):
                found.append(f"{node.lineno}: declares {node.args[0].value}")  # type: ignore[attr-defined]
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign) else []
        )
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and (t.value.id, t.attr) in RESOLVED:
                found.append(f"{node.lineno}: sets args.{t.attr}")
    return found


@pytest.mark.parametrize("module", sorted(COMMANDS))
def test_every_command_goes_through_the_door(module):
    """No command chooses its checkpoint, declares --checkpoint/--force or places its outputs itself; each that
    takes a checkpoint (the door's option, or a positional one) opens the door (`Door(__file__)`) and asks it."""
    assert bypasses(module) == []
    text = command_file(module).read_text(encoding="utf-8")
    if "checkpoint_options(" in text or 'add_argument("checkpoint"' in text:
        assert "Door(__file__" in text and (".checkpoint(args)" in text or ".given_checkpoint(args)" in text)


def test_the_check_sees_a_command_that_bypasses_the_door(tmp_path, monkeypatch):
    """The check above, on a command written the old way: it is caught."""
    bad = tmp_path / "annotated" / "old.py"
    bad.parent.mkdir()
    bad.write_text(
        "def main(argv):\n"
        "    p.add_argument('--checkpoint')\n"
        "    args = p.parse_args(argv)\n"
        "    args.checkpoint = choose_checkpoint(args.checkpoint)\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert sorted(bypasses("annotated.old")) == [
        "2: declares --checkpoint",
        "4: calls choose_checkpoint",
        "4: sets args.checkpoint",
    ]


def test_runs_is_named_only_in_the_run_folder():
    """The runs folder's name is `RUNS` of annotated/run_folder.py: no other module writes "runs" itself."""
    files = [*ROOT.glob("annotated/**/*.py"), *ROOT.glob("benchmarks/**/*.py"), *ROOT.glob("docs/*.py")]
    found = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in files + [ROOT / "train_wmt.py"]
        if path != ROOT / "annotated" / "run_folder.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Constant) and node.value == "runs"
    ]
    assert found == []


# ---------------------------------------------------------------- how a fix is typed


def test_a_fix_is_typed_at_a_shell_and_under_make(monkeypatch):
    from annotated.door import MAKE_TARGET, Door

    door = Door(ROOT / "annotated" / "circuits" / "command.py")
    for name in (MAKE_TARGET, "ARGS", "CHECKPOINT", "OUT", "HF", "TEXT"):
        monkeypatch.delenv(name, raising=False)
    assert door.typed("--force") == "add --force"
    monkeypatch.setenv(MAKE_TARGET, "circuits")
    assert door.typed("--force") == "run make circuits ARGS=--force"
    monkeypatch.setenv("ARGS", "--head cross:1:2")
    monkeypatch.setenv("CHECKPOINT", "my runs/x.pt")
    assert door.typed("--force") == "run make circuits CHECKPOINT='my runs/x.pt' ARGS='--head cross:1:2 --force'"


def test_a_checkpoint_to_name_is_typed_at_a_shell_and_under_make(monkeypatch, capsys):
    """The floors below write `pass --checkpoint PATH`; under make the door writes the make line with CHECKPOINT."""
    import argparse

    from annotated.door import MAKE_TARGET, Door

    for name in (MAKE_TARGET, "ARGS", "CHECKPOINT", "OUT", "HF", "TEXT"):
        monkeypatch.delenv(name, raising=False)
    door = Door(ROOT / "annotated" / "decoding" / "translate.py")
    fixes = []
    for env in ({}, {MAKE_TARGET: "translate", "CHECKPOINT": "shipped:fr-en", "ARGS": "--beam 2"}):
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(SystemExit):
            door.checkpoint(argparse.Namespace(checkpoint="shipped:fr-en"))
        err = capsys.readouterr().err
        assert err.startswith("translate: error: there is no shipped fr->en model") and err.count("\n") == 1
        fixes.append(err.rstrip().rsplit(" or ", 1)[1])
    assert fixes == ["pass --checkpoint PATH", "run make translate CHECKPOINT=PATH ARGS='--beam 2'"]


@pytest.mark.skipif(shutil.which("make") is None, reason="no `make` on PATH")
def test_make_circuits_on_an_earlier_output_says_the_make_line_to_type(tmp_path):
    """The Makefile tells the command it runs under make; the refusal is the make line with ARGS=... --force."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "circuits.json").write_text("an earlier result")
    variables = [f"PYTHON={sys.executable}", "CHECKPOINT=shipped:de-en", f"ARGS=--out {tmp_path / 'out'}"]
    r = subprocess.run(
        ["make", "-s", "-f", str(ROOT / "Makefile"), "circuits", *variables],
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = r.stderr.splitlines()[0]
    assert r.returncode != 0 and line.startswith(f"circuits: error: {tmp_path / 'out' / 'circuits.json'} exists; ")
    assert f"run make circuits CHECKPOINT=shipped:de-en ARGS='--out {tmp_path / 'out'} --force' to replace it" in line
    assert (tmp_path / "out" / "circuits.json").read_text() == "an earlier result"


# ---------------------------------------------------------------- what is not a checkpoint


def _translate(argv) -> tuple[int, str]:
    from annotated.decoding import translate

    err = io.StringIO()
    code = translate.main(argv, stdin=io.BytesIO(b"Hallo\n"), stdout=io.BytesIO(), stderr=err)
    return code, err.getvalue()


@pytest.mark.parametrize(
    "kind, looks",
    [
        ("text", "is not a checkpoint: it is text (it begins '# My notes')"),
        ("zip", "is not a checkpoint: it is a zip archive of 1 file(s) (notes.txt), not one torch.save wrote"),
        ("bytes", "is not a checkpoint: it is binary data, not a torch file (it begins 9b c0 e5"),
        ("pickle", "is not a checkpoint: it is a Python pickle"),
        ("empty", "is not a checkpoint: it is an empty file"),
    ],
)
def test_a_file_that_is_no_checkpoint_is_said_to_be_what_it_looks_like(kind, looks, tmp_path):
    import pickle

    path = tmp_path / "model.pt"
    if kind == "text":
        path.write_text("# My notes\nnot a model\n")
    elif kind == "zip":
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("notes.txt", "hello")
    elif kind == "bytes":
        path.write_bytes(bytes((155 + 37 * i) % 256 for i in range(4000)))
    elif kind == "pickle":
        path.write_bytes(pickle.dumps({"weights": [1, 2]}))
    else:
        path.write_bytes(b"")
    code, err = _translate(["--checkpoint", str(path)])
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"translate: error: {path} {looks}"), err
    assert "Python objects" not in err and "weights_only" not in err


@pytest.fixture
def marian_folder(tmp_path) -> Path:
    folder = tmp_path / "opus-mt-de-en"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "marian", "d_model": 512}')
    return folder


def test_a_marian_folder_given_as_a_checkpoint_points_to_make_import(marian_folder, capsys):
    from annotated.attention.heads import main as heads
    from annotated.circuits.command import main as circuits

    code, err = _translate(["--checkpoint", str(marian_folder)])
    want = f"is a transformers MarianMTModel folder, not a checkpoint; import it first: make import HF={marian_folder}"
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"translate: error: {marian_folder} {want}")
    for name, main in (("circuits", circuits), ("heads", heads)):
        assert main(["--checkpoint", str(marian_folder)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"{name}: error: {marian_folder} {want}"), err
    (marian_folder / "config.json").write_text('{"model_type": "bert"}')  # another folder: the file in it, asked for
    assert "is a directory; give the checkpoint file in it" in _translate(["--checkpoint", str(marian_folder)])[1]


def test_export_and_import_name_themselves(tmp_path, capsys):
    from annotated.interop.folders import main

    for argv, name in (
        (["export", str(tmp_path / "none.pt"), str(tmp_path / "out")], "export"),
        (["export", "--bogus"], "export"),
        (["import", str(tmp_path), str(tmp_path / "x.pt")], "import"),
    ):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        err = capsys.readouterr().err
        assert stop.value.code == 2 and err.count("\n") == 1 and err.startswith(f"{name}: error: "), err
