"""The README is the front door: what it promises a newcomer must be true of the repository.

- it stays short (at most 12 KB; the long material lives in docs/*.md and benchmarks/README.md);
- its set-up block is what CI runs (`.ci/run` ends in the README's test command, then `make test-arith`);
- every `make` target it or the long pages name exists in `make help`;
- every local file it links to exists, and every test it, the long pages, CONTRIBUTING.md or a module's prose
  cites exists in tests/;
- no figure is a placeholder ("not yet measured"): an unmeasured figure is simply absent.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
MODULES = sorted((ROOT / "annotated").rglob("*.py"))


def _code_blocks(text: str) -> list[str]:
    return re.findall(r"```(?:sh|console|bash)?\n(.*?)```", text, flags=re.S)


def test_readme_is_a_front_door_of_at_most_12_kb():
    assert README.stat().st_size <= 12 * 1024, f"README.md is {README.stat().st_size} bytes"


def test_the_first_commands_are_the_ones_ci_runs():
    first = _code_blocks(README.read_text(encoding="utf-8"))[0]
    commands = [line.split("#")[0].strip() for line in first.splitlines() if line.strip()]
    assert commands[:2] == ["make test", "make train"], commands
    ci = [
        line.strip()
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert ci[-2:] == ["make test", "make test-arith"], (
        "CI must run exactly the README's test command, then the arithmetic check"
    )


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_every_make_target_the_pages_name_is_in_make_help():
    helped = subprocess.run(["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    listed = set(re.findall(r"^make ([a-z][a-z-]*)", helped, flags=re.M))
    named = set()
    for page in PAGES:
        for block in _code_blocks(page.read_text(encoding="utf-8")):
            named |= set(re.findall(r"(?:^|\s)make ([a-z][a-z-]*)", block))
        named |= set(re.findall(r"`make ([a-z][a-z-]*)", page.read_text(encoding="utf-8")))
    assert named, "no make target found: the pattern is wrong"
    assert named <= listed, f"named but not in `make help`: {sorted(named - listed)}"


def test_local_links_exist():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)\)", page.read_text(encoding="utf-8")):
            if "://" in target or target.startswith("mailto:"):
                continue
            if target.startswith("docs/_build"):  # built by `make docs`
                continue
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links to missing {target}"


def test_every_cited_test_exists():
    defined = set()
    for path in (ROOT / "tests").rglob("test_*.py"):
        defined |= set(re.findall(r"^(?:async )?def (test_\w+)", path.read_text(encoding="utf-8"), flags=re.M))
    for page in [*PAGES, *MODULES]:
        cited = set(re.findall(r"\b(test_\w+)\b", page.read_text(encoding="utf-8")))
        # a test's name here is a sentence (`test_fully_masked_query_gives_zeros`), which tells it from a
        # data name (`test_2016_flickr`, the JSON key `test_bleu_lowercase`); `test_once_escaped_*` is a family
        cited = {c for c in cited if c.count("_") >= 3 and not c.endswith("_")}
        missing = sorted(c for c in cited if c not in defined and not any((ROOT / "tests").rglob(f"{c}.py")))
        assert not missing, f"{page.relative_to(ROOT)} cites tests that do not exist: {missing}"


def test_no_placeholder_figures():
    for page in PAGES:
        text = page.read_text(encoding="utf-8").lower()
        for phrase in ("not yet measured", "not measured yet", "tbd", "todo"):
            assert phrase not in text, f"{page.relative_to(ROOT)} contains {phrase!r}"
