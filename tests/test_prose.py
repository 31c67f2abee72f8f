"""The examples written in the prose cells (`# >>> ...` lines) run as doctests.

pytest's --doctest-modules only sees docstrings; examples inside markdown
comment cells would otherwise never run. This test strips the comment marks
from every `# %% [markdown]` cell of every annotated module and runs the
examples found there in the module's namespace.
"""

import ast
import doctest
import importlib
import io
import re
import tokenize
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


# The code's prose states a rule and why; what was measured for it (durations, speed-ups, throughputs, shares
# of a step's time) lives once in benchmarks/README.md or docs/*.md, beside the command that measures it, and the
# prose cites the section (`benchmarks/README.md#which-products-int8-pays-for`). These are the shapes a timing
# takes; a tensor's shape `(1, h, T, S)`, a product's size `128 x 512`, an accuracy `97%` or a BLEU is none.
TIMINGS = (
    r"\b\d[\d,]*(\.\d+)?\s?(ns|us|µs|μs|ms|s|sec|seconds?|min|minutes?|hours?)\b",  # 229 us, 1.26 s, 27 min
    r"\b\d+(\.\d+)?x\b(?!\s?\d)",  # 1.13x (not 2x2)
    r"\b(\d+(\.\d+)?|two|three|four|five|ten|twice|half)\s(times\s)?(as\s(fast|slow|long)|faster|slower)\b",
    r"\b\d[\d,.]*\s?(tok|tokens|sentences|steps|it)/s\b",  # 390 sentences/s
    r"\b\d[\d,.]*\s(tokens|sentences|steps)\s(per|a)\ssecond\b",
    r"\b\d+(\.\d+)?%\s(of\s)?(its|the|a|each|every|one)?\s?([\w'`]+\s){0,3}(time|step)\b",  # 40% of the loop's time
    r"\b(a|one|two)\s(fifth|third|quarter|half)\s(of\s)?(its|the|a|each|every)\s([\w'`-]+\s){0,3}(time|step)\b",
    r"\b(a|one)\s(micro|milli|nano)second\b|\bhalf\san?\s(hour|minute)\b|\bunder\sa\s(second|minute)\b",
)
# Durations that are settings of the code, not measurements: (file, the words around them).
SETTINGS = (
    ("annotated/decoding/translate.py", "back in this code every 0.2 s"),  # arrived_windows' timeout
    ("annotated/training/config.py", "within the goal of half an hour"),  # the cpu preset's budget
)


def timings(text: str) -> list[str]:
    """The timing figures in `text`.

    >>> timings("PyTorch's kernel took 229 us against 44 us; 1.13x (de -> en), 1.5 to 3 times faster in int8")
    ['229 us', '44 us', '1.13x', '3 times faster']
    >>> timings("390.2 sentences/s, 1,200 tok/s; the products took 40% of the readable loop's time")
    ['390.2 sentences/s', '1,200 tok/s', "40% of the readable loop's time"]
    >>> timings("a fifth of the bfloat16 training step; 800 steps take twice as long; one string loads in a millisecond")
    ['a fifth of the bfloat16 training step', 'twice as long', 'a millisecond']
    >>> timings("(1, h, T, S): 128 x 512 weights, 2x2 blocks, 0.3 x the rate; copied 97% of 1000 sequences, BLEU 38.77")
    []
    """
    return [m.group(0) for m in sorted((m for p in TIMINGS for m in re.finditer(p, text)), key=lambda m: m.start())]


def code_prose(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of every comment, docstring and bare string of the module at `path`, lines apart."""
    source = path.read_text(encoding="utf-8")
    lines = [
        (t.start[0], t.string)
        for t in tokenize.generate_tokens(io.StringIO(source).readline)
        if t.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            lines += [
                (node.lineno + i, line) for i, line in enumerate(source.splitlines()[node.lineno - 1 : node.end_lineno])
            ]
    return sorted(set(lines))


def test_no_timing_figures_in_the_codes_prose():
    """Prose, comments and docstrings of annotated/ cite the page of a measurement, never its figures."""
    hits = []
    for path in sorted(ANNOTATED.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for n, line in code_prose(path):
            for file, words in SETTINGS:
                line = line.replace(words, "") if file == rel else line
            hits += [f"{rel}:{n}: {t!r} in {line.strip()!r}" for t in timings(line)]
    assert hits == [], "timings in the code's prose (move them to benchmarks/README.md or docs/):\n" + "\n".join(hits)


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lowercased, punctuation but hyphens dropped, spaces as hyphens.

    >>> github_anchor("Which products int8 pays for: `benchmarks.int8_products`")
    'which-products-int8-pays-for-benchmarksint8_products'
    """
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of the headings of the Markdown file `page` (outside its fenced code)."""
    found, fenced = set(), False
    for line in page.read_text(encoding="utf-8").splitlines():
        fenced ^= line.startswith("```")
        if not fenced and re.match(r"#{1,6} ", line):
            found.add(github_anchor(line.lstrip("#")))
    return found


def test_the_sections_the_code_cites_exist():
    """Every `benchmarks/README.md#...` or `docs/*.md#...` in annotated/ names a heading of that page."""
    cited = [
        (path.relative_to(ROOT).as_posix(), page, anchor)
        for path in sorted(ANNOTATED.rglob("*.py"))
        for page, anchor in re.findall(r"((?:benchmarks|docs)/[\w-]+\.md)#([\w-]+)", path.read_text(encoding="utf-8"))
    ]
    missing = [f"{rel}: {page}#{anchor}" for rel, page, anchor in cited if anchor not in anchors(ROOT / page)]
    assert missing == [], "cited sections that do not exist:\n" + "\n".join(missing)
