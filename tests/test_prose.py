"""The examples written in the prose cells (`# >>> ...` lines) run as doctests.

pytest's --doctest-modules only sees docstrings; examples inside markdown
comment cells would otherwise never run. This test strips the comment marks
from every `# %% [markdown]` cell of every annotated module and runs the
examples found there in the module's namespace.
"""

import doctest
import importlib
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
