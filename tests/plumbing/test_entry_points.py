"""pyproject.toml: the console scripts of `pip install -e .` run the commands' own main functions through the one
start-up and Ctrl-C protocol (annotated/plumbing/scripts.py, which finds each by the script's name), and the package it describes holds every subpackage and the
viewer's web assets. Read and imported, not installed; `test_interrupts.py` runs the scripts."""

import importlib
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
SCRIPTS = PROJECT["project"]["scripts"]
# make target -> the module it runs (Makefile); each has a console script named annotated-<target>
TARGETS = {
    "train": "train_wmt",
    "translate": "annotated.decoding.translate",
    "equivalence": "annotated.proof.equivalence",
    "attention": "annotated.attention.dump",
    "heads": "annotated.attention.heads",
    "circuits": "annotated.circuits.command",
}


@pytest.mark.parametrize("target, module", TARGETS.items())
def test_console_scripts_resolve_to_the_commands_main_functions(target, module):
    assert f"$(RUN) {'train_wmt.py' if module == 'train_wmt' else '-m ' + module}" in (ROOT / "Makefile").read_text()
    name, function = SCRIPTS[f"annotated-{target}"].split(":")
    assert (name, function) == ("annotated.plumbing.scripts", "script")
    scripts = importlib.import_module(name)
    assert callable(getattr(scripts, function))
    assert scripts.COMMANDS[module] == target  # annotated-<target> runs the command named <target>
    main = importlib.import_module(module).main
    assert callable(main) and main.__module__ == module and main.__name__ == "main"


def test_every_console_script_is_a_make_target():
    assert set(SCRIPTS) == {f"annotated-{target}" for target in TARGETS}


def test_the_package_holds_every_subpackage_and_the_web_assets():
    setuptools = PROJECT["tool"]["setuptools"]
    assert setuptools["packages"]["find"]["include"] == ["annotated", "annotated.*"]
    assert setuptools["py-modules"] == ["train_wmt"]
    for package, page in (("attention", "viewer"), ("circuits", "circuits")):
        assets = setuptools["package-data"][f"annotated.{package}"]
        web = sorted(p.name for pattern in assets for p in (ROOT / "annotated" / package).glob(pattern))
        assert web == sorted(p.name for p in (ROOT / "annotated" / package / "web").iterdir() if p.is_file())
        assert {f"{page}.html", f"{page}.js", f"{page}.css"} <= set(web)
    assert PROJECT["tool"]["setuptools"]["dynamic"]["dependencies"] == {"file": ["requirements.txt"]}
