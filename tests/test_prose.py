"""The examples written in the prose cells (`# >>> ...` lines) run as doctests.

pytest's --doctest-modules only sees docstrings; examples inside markdown
comment cells would otherwise never run. This test strips the comment marks
from every `# %% [markdown]` cell of every annotated module and runs the
examples found there in the module's namespace.
"""

import doctest
import importlib
import re
from pathlib import Path

import pytest

ANNOTATED = Path(__file__).resolve().parents[1] / "annotated"
MODULES = sorted(
    p.relative_to(ANNOTATED).with_suffix("").as_posix().replace("/", ".")
    for p in ANNOTATED.rglob("*.py")
    if p.stem != "__init__"
)


def markdown_text(source: str) -> str:
    """The text of the markdown cells, comment marks removed, one cell after another."""
    out, in_md = [], False
    for line in source.splitlines():
        if line.startswith("# %%"):
            in_md = "[markdown]" in line
            out.append("")
            continue
        if in_md and (line.startswith("#") or not line.strip()):
            out.append(line[2:] if line.startswith("# ") else line.lstrip("#"))
        else:
            in_md = False
    return "\n".join(out)


@pytest.mark.parametrize("name", MODULES)
def test_prose_examples_run(name):
    module = importlib.import_module(f"annotated.{name}")
    path = ANNOTATED / (name.replace(".", "/") + ".py")
    text = markdown_text(path.read_text(encoding="utf-8"))
    test = doctest.DocTestParser().get_doctest(text, dict(vars(module)), f"annotated.{name} prose", str(path), 0)
    if not test.examples:
        pytest.skip(f"{path.relative_to(ANNOTATED.parent)} has no examples in its prose")
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    runner.run(test)
    assert runner.failures == 0, (
        f"{runner.failures} prose example(s) of {path.relative_to(ANNOTATED.parent)} failed (output above)"
    )


def test_markdown_text_finds_examples():
    src = "# %% [markdown]\n# Some prose.\n#\n# >>> 1 + 1\n# 2\n\n# %%\nx = 1  # >>> not prose\n"
    examples = doctest.DocTestParser().get_examples(markdown_text(src))
    assert [(e.source.strip(), e.want.strip()) for e in examples] == [("1 + 1", "2")]


# Heads count from 0 everywhere (`docs/build.py`'s introduction says so): an enumeration of heads or blocks that
# starts at 1 (`W_Q[1] | ...`, `head_1, \dots`, `W^{(1)} \mid \dots`) or ends at h (`... | W_Q[h]`, `\dots,
# head_h`) is the paper's numbering, not the code's. A range of sizes (`h = 1..8`) is no enumeration of heads.
ONE = r"(\[1\]|_1\b|_\{1\}|\^\{\(1\)\}|\^\(1\)|\(1\))"
H = r"(\[h\]|_h\b|_\{h\}|\^\{\(h\)\}|\^\(h\)|\(h\))"
ELLIPSIS = r"(\.\.\.|\\\\?dots|\\\\?vdots|…)"
ONE_BASED = (
    rf"{ONE}\s*(\\,)?\s*(\||\\\\?mid|,|;|\\\\)\s*{ELLIPSIS}",  # W_Q[1] | ... ; head_1, \dots
    rf"{ELLIPSIS}\s*(\||\\\\?mid|,|;|\\\\)\s*[^\s|;,]*?{H}",  # ... | W_Q[h] ; \dots, head_h
    r"\b(block|head) 1, then\b",  # block 1, then block 2
)
ROOT = ANNOTATED.parent
PROSE = sorted(
    [*ANNOTATED.rglob("*.py"), *(ROOT / "docs").glob("*.py"), *(ROOT / "docs").glob("*.md")]
    + [ROOT / "README.md", ROOT / "benchmarks" / "README.md", ROOT / "CONTRIBUTING.md"]
)


def one_based(text: str) -> list[str]:
    """The lines of `text` that number heads from 1, but those that say how the paper numbers them.

    >>> one_based("W_Q = [W_Q[1] | ... | W_Q[h]]\\nW_O[0], ..., W_O[h-1]\\nfor every h = 1..8\\nhead 0\\n")
    ['W_Q = [W_Q[1] | ... | W_Q[h]]']
    >>> one_based(r"\\mathrm{Concat}(\\mathrm{head}_1, \\dots, \\mathrm{head}_h)")
    ['\\\\mathrm{Concat}(\\\\mathrm{head}_1, \\\\dots, \\\\mathrm{head}_h)']
    >>> one_based("numbers of block 1, then block 2\\nthe paper's head_1, ..., head_h is head_0 here")
    ['numbers of block 1, then block 2']
    """
    return [line for line in text.splitlines() if numbers_from_1(line) and "paper" not in line]  # the paper's, named


ZERO = r"(\[0\]|_0\b|_\{0\}|\^\{\(0\)\}|\^\(0\)|\(0\))"


def numbers_from_1(line: str) -> bool:
    """Whether `line` enumerates from 1 or up to h; `[0] | [1] | ...` starts at 0 (its 1 is the second item).

    >>> numbers_from_1(r"W_Q^{(0)} \\mid W_Q^{(1)} \\mid \\dots"), numbers_from_1("W(1) | ... | W(h-1)")
    (False, True)
    """
    first, *rest = ONE_BASED
    starts_at_1 = any(not re.search(ZERO, line[max(0, m.start() - 40) : m.start()]) for m in re.finditer(first, line))
    return starts_at_1 or any(re.search(p, line) for p in rest)


def test_heads_are_counted_from_0_in_all_prose():
    """The chapter, the book, the guides and README.md number heads 0 ... h-1, as the code does."""
    hits = [f"{p.relative_to(ROOT)}: {line.strip()}" for p in PROSE for line in one_based(p.read_text("utf-8"))]
    assert hits == [], "heads numbered from 1:\n" + "\n".join(hits)
