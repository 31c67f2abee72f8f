"""The Makefile's targets that take a checkpoint (translate, attention, docs, heads, equivalence) pass TEXT and CHECKPOINT to the command exactly as typed.

Each target is run by `make` itself, with PYTHON set to a stand-in interpreter that prints the arguments it
was given, so the test sees the command line the shell built, without loading any model.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAKE = shutil.which("make")
HOSTILE_TEXT = "Er zahlt $5 für $HOME, sagt 'Tom' \"laut\"; `date` $(id) & \\n"
HOSTILE_CHECKPOINT = "my runs/$USER;touch pwned/best.pt"


def make(tmp_path: Path, target: str, *variables: str) -> list[str]:
    echo = tmp_path / "python"
    echo.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    echo.chmod(0o755)
    r = subprocess.run(
        [MAKE, "-s", "-f", str(ROOT / "Makefile"), target, f"PYTHON={echo}", *variables],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.skipif(MAKE is None, reason="no `make` on PATH")
@pytest.mark.parametrize(
    "target, module",
    [
        ("translate", "annotated.decoding.translate"),
        ("attention", "annotated.attention.dump"),
        ("docs", "docs.build"),
        ("heads", "annotated.attention.heads"),
        ("equivalence", "annotated.proof.equivalence"),
    ],
)
def test_variables_reach_the_command_as_typed(target, module, tmp_path):
    argv = make(tmp_path, target, f"CHECKPOINT={HOSTILE_CHECKPOINT}", f"TEXT={HOSTILE_TEXT}")
    assert argv[:4] == ["-m", module, "--checkpoint", HOSTILE_CHECKPOINT]
    if target == "translate":
        assert argv[4:] == [HOSTILE_TEXT]  # `$5`, `$HOME`, quotes, `;`, backquotes: all kept, one argument
    assert sorted(p.name for p in tmp_path.iterdir()) == ["python"]  # the `;` ran nothing (no file "pwned")
    assert make(tmp_path, target) == ["-m", module]  # unset: no option, no empty argument
