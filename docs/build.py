# %% [markdown]
# # `make docs`: the annotated modules as one book
#
# The page is generated from the source, so the two cannot disagree. It opens
# with its title, a short introduction (per-head against fused attention, with
# the block-matrix figure) and a short contents list (parts and chapters; a
# chapter's sections unfold under it). Then come the parts of `PARTS`, which
# follow the package's folders: Part I the chapter, Part II the proof, Part
# III data, training and decoding, Part IV attention and heads, Part V the
# circuits, and an appendix for the plumbing. Each module under `annotated/` is a chapter; a
# module no part lists goes into the part of its folder (`FOLDER_PART`), with
# a note on the console (`test_an_unlisted_module_lands_in_the_part_of_its_folder`).
# What the build has to say about itself (a module missing or in no part, a
# figure drawn from the copy task instead of a checkpoint) goes to the
# console; the line saying the page is generated sits in the footer. Inside
# a chapter the cells keep the file's order:
#
# * the file is split into cells by **jupytext** (the same parser `make
#   notebook` uses), so page and notebook see the same cells;
# * prose cells go through **markdown-it-py**; `$...$` and `$$...$$` (the
#   `dollarmath` plugin) become MathML via **latex2mathml**, which browsers
#   draw natively, with no script and no network; a formula latex2mathml does
#   not understand stops the build with the file and line, instead of showing
#   raw TeX;
# * doctest examples in prose (`>>>` lines up to the next blank line, as
#   Python's `doctest` reads them) become highlighted console blocks instead of
#   Markdown block quotes;
# * code cells are highlighted by **Pygments**, each labelled with its file and
#   line range (and checked to be the file's text verbatim); a long cell is
#   cut at blank lines into pieces (`code_pieces`), its prose goes beside the
#   piece that defines what the prose names in backticks (`pair_prose`: the
#   prose on `PerHeadAttention` beside the class, not beside the helpers
#   before it), and a piece without prose of its own gets its definitions'
#   docstring summaries beside it;
# * on a wide screen each prose cell sits on the left of the code it
#   explains, row by row, as in labml's annotated pages; below 1100 px the rows
#   become one column. Long lines wrap with a hanging indent four
#   characters deeper than the line's own, so no code block scrolls sideways
#   and a continuation never reads as an outer statement
#   (`test_the_book_at_1400_px`, `test_the_book_is_one_column_on_a_narrow_screen`,
#   `test_a_wrapped_code_line_continues_deeper_than_its_own_indent`); a long
#   display formula is set one equation, or one `=`, a line, so it fits the
#   prose column (`test_no_display_formula_is_wider_than_its_column`); a
#   table fits the column too (`test_no_table_scrolls_sideways_at_800_px`);
# * figures come from `docs/figures.py`, drawn at build time, and sit where
#   the prose cites them with a line `<!-- figure: name -->` (after that
#   prose's code, when the prose ends with the citation);
# * Part I's chapter ends with the attention viewer of its example, in an
#   `<iframe>` (section 8);
# * after the parts, the part "Guides": the Markdown files of `GUIDES`,
#   each an article titled by its first heading (section 4). A fence without
#   a language is shown as a console session when a line starts with `$ `,
#   else as plain text, never as Python (`test_logs_and_shell_are_not_highlighted_as_python`).
#
# Output: `docs/_build/index.html`, `docs/_build/figures/*.png` and
# `docs/_build/viewer/index.html` (and the record `.docs-build.json` of what
# was written, section 6), with an inline stylesheet and no external
# resource of any kind; a Content-Security-Policy in the page forbids the
# browser to fetch anything but the page's own images and the viewer's frame,
# and to run any script but the one that fits the frame to the viewer.
#
# This builder lives in `docs/`, not in the `annotated` package: the package is
# the book; the builder is tooling, not a chapter (and so is neither rendered
# nor doctested with the chapters).

# %%
from __future__ import annotations

import base64
import hashlib
import html
import json
import posixpath
import re
import string
import xml.etree.ElementTree as ET
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import jupytext
from latex2mathml.converter import convert as _latex2mathml
from markdown_it import MarkdownIt
from markdown_it.renderer import RendererHTML
from mdit_py_plugins.dollarmath import dollarmath_plugin
from pygments import highlight as _pygments_highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import get_lexer_by_name
from pygments.util import ClassNotFound

from annotated.checkpoint import CheckpointError
from annotated.door import Door
from annotated.plumbing.files import atomic_write
from annotated.plumbing.options import at_least, writable_dir
from docs import figures as figs

ROOT = Path(__file__).resolve().parent.parent

PARTS: tuple[tuple[str, str, tuple[str, ...]], ...] = (  # (id, title, modules: paths under annotated/ without .py)
    ("part-1", "Part I. The chapter", ("transformer", "tokens")),
    (
        "part-2",
        "Part II. The proof",
        (
            "proof/torch_mha",
            "proof/equivalence",
            "interop/layout",
            "interop/marian",
            "interop/folders",
            "interop/card",
        ),
    ),
    (
        "part-3",
        "Part III. Data, training and decoding",
        (
            "training/data",
            "decoding/settings",
            "decoding/search",
            "decoding/quantize",
            "training/loss",
            "training/train",
            "training/distributed",
            "run_folder",
            "training/runs",
            "training/evaluate",
            "training/config",
            "training/results",
            "training/memory",
            "decoding/translate",
            "decoding/casing",
            "decoding/alignment",
            "training/add_case_table",
            "training/choose_length_penalty",
            "training/pack",
        ),
    ),
    (
        "part-4",
        "Part IV. Attention and heads",
        (
            "sites",
            "attention/dump",
            "attention/pictures",
            "attention/viewer",
            "attention/importance",
            "attention/profiles",
            "attention/prune",
            "attention/bootstrap",
            "attention/heads",
            "attention/curve",
        ),
    ),
    (
        "part-5",
        "Part V. Circuits: what a head's own matrices compute",
        (
            "circuits/circuits",
            "circuits/fold",
            "circuits/direct",
            "circuits/faithfulness",
            "circuits/score_terms",
            "circuits/composition",
            "circuits/dictionary",
            "circuits/aligner",
            "circuits/metrics",
            "circuits/interventions",
            "circuits/pictures",
            "circuits/page",
            "circuits/command",
            "circuits/readout",  # last: the part ends with its answer to the seed question
        ),
    ),
    (
        "appendix",
        "Appendix. The plumbing",
        (
            "plumbing/allocator",
            "checks",
            "checkpoint",
            "door",
            "plumbing/devices",
            "plumbing/files",
            "plumbing/interrupts",
            "plumbing/options",
            "plumbing/progress",
            "plumbing/provenance",
            "plumbing/scripts",
            "proof/harness",
            "recording",
        ),
    ),
)
FOLDER_PART = {
    "": "part-1",
    "proof": "part-2",
    "interop": "part-2",
    "training": "part-3",
    "decoding": "part-3",
    "attention": "part-4",
    "circuits": "part-5",
    "plumbing": "appendix",
}  # where a module no part lists goes, by its folder (else the appendix)
READING_ORDER: tuple[str, ...] = tuple(m for _, _, modules in PARTS for m in modules)
GUIDES: tuple[str, ...] = (  # Markdown files, relative to the repository root, in page order
    "docs/training.md",
    "docs/distributed.md",
    "docs/faults.md",
    "docs/heads.md",
    "docs/circuits.md",
    "benchmarks/README.md",
)
DEFAULT_OUT = ROOT / "docs" / "_build"
TITLE = "The Transformer, annotated"


class DocsError(ValueError):
    """The sources cannot be rendered faithfully; the message names the file and line."""


# %% [markdown]
# ## 1. Cells, with their place in the file


# %%
@dataclass(frozen=True)
class Cell:
    kind: str  # "markdown" or "code"
    source: str  # the cell's text (prose without its "# " prefixes)
    line: int  # first line of the cell's text in the file (1-based)
    end: int  # last line


def _commented(prose: str) -> str:
    """How jupytext writes a prose line block in a percent-format file."""
    return "\n".join(f"# {line}" if line else "#" for line in prose.split("\n"))


def read_cells(path: Path) -> list[Cell]:
    """Split a percent-format module into cells (via jupytext) and locate each in the file.

    A code cell whose text does not appear verbatim in the file would make
    the page disagree with the source: that raises DocsError.
    """
    text = path.read_text(encoding="utf-8")
    notebook = jupytext.reads(text, fmt="py:percent")
    cells: list[Cell] = []
    pos = 0
    for cell in notebook.cells:
        if not cell.source.strip():
            continue
        needle = cell.source if cell.cell_type == "code" else _commented(cell.source)
        at = text.find(needle, pos)
        if at < 0 and cell.cell_type == "code":
            raise DocsError(
                f"{path}: a code cell is not the file's text verbatim (jupytext changed it?): "
                f"{cell.source.splitlines()[0]!r}"
            )
        if at >= 0:
            pos = at + len(needle)
        line = text.count("\n", 0, max(at, 0)) + 1 if at >= 0 else (cells[-1].end + 1 if cells else 1)
        cells.append(Cell(cell.cell_type, cell.source, line, line + cell.source.count("\n")))
    return cells


# %% [markdown]
# ## 2. Math: LaTeX to MathML, checked
#
# latex2mathml passes an unknown command through as text (`\foo` becomes an
# identifier "\foo") and builds a fraction with one argument from `\frac{a}`.
# Both would show broken math without any error, so the result is parsed and
# checked: no backslash command left in any text, and every MathML element
# that takes a fixed number of arguments has them.

# %%
_MATHML = "{http://www.w3.org/1998/Math/MathML}"
_ARITY = {"mfrac": 2, "msub": 2, "msup": 2, "msubsup": 3, "mroot": 2, "munder": 2, "mover": 2, "munderover": 3}
ET.register_namespace("", _MATHML[1:-1])  # serialise as <math xmlns=...>, not <ns0:math>


def latex_to_mathml(tex: str, display: bool, where: str = "<formula>") -> str:
    """One formula as a <math> element (display block or inline); DocsError if it does not convert.

    >>> latex_to_mathml("x^2", display=False)
    '<math xmlns="http://www.w3.org/1998/Math/MathML" display="inline" alttext="x^2"><mrow><msup><mi>x</mi><mn>2</mn></msup></mrow></math>'
    >>> latex_to_mathml(r"\\log p", display=False)  # a thin space after "log", as TeX sets it
    '<math xmlns="http://www.w3.org/1998/Math/MathML" display="inline" alttext="\\\\log p"><mrow><mi>log</mi><mspace width="0.1667em" /><mi>p</mi></mrow></math>'
    >>> latex_to_mathml(r"\\nosuchcommand x", display=True)
    Traceback (most recent call last):
    ...
    docs.build.DocsError: <formula>: the formula $\\nosuchcommand x$ uses \\nosuchcommand, which latex2mathml does not know
    """
    try:
        mathml = _latex2mathml(tex, display="block" if display else "inline")
        root = ET.fromstring(mathml)
    except Exception as e:  # noqa: BLE001 latex2mathml raises many kinds on bad input
        raise DocsError(f"{where}: cannot convert the formula ${tex}$ to MathML ({type(e).__name__}: {e})") from None
    for element in root.iter():
        unknown = re.search(r"\\[A-Za-z]+", element.text or "")
        if unknown:
            raise DocsError(f"{where}: the formula ${tex}$ uses {unknown.group()}, which latex2mathml does not know")
        tag = element.tag.removeprefix(_MATHML)
        if tag in _ARITY and len(element) != _ARITY[tag]:
            raise DocsError(
                f"{where}: the formula ${tex}$ gives <{tag}> {len(element)} arguments instead of "
                f"{_ARITY[tag]} (a missing brace group?)"
            )
    _polish(root)
    root.set("alttext", tex)  # what screen readers and copy-paste get
    return ET.tostring(root, encoding="unicode")


# %% [markdown]
# ### Long display formulas: one line per equation, one per `=`
#
# Browsers do not break a formula across lines, and the prose column is
# about 520 px wide beside the code. A display formula longer than
# `FORMULA_CHARS` visible characters is set as a one-column table: each
# equation of a `\quad`-separated list starts a line, and each further `=` of
# a chain (`a = b = c`) starts a line of its own, indented, as a TeX author
# would align it. A formula still wider than a phone scrolls inside its own
# box, never under the code (`test_no_display_formula_is_wider_than_its_column`).

# %%
FORMULA_CHARS = 44  # visible characters that fit the prose column beside the code at 1400 px
LIST_CHARS = 30  # a list of equations (`a = b,\\quad c = d`) longer than this: one equation a line


def visible_length(tex: str) -> int:
    """About how many characters a formula shows: a command counts one, braces and scripts' marks none.

    >>> visible_length(r"\\mathrm{head}_i = x")
    7
    """
    words = re.sub(r"\\(?:mathrm|text|texttt|mathbb|left|right|begin\{\w+\}|end\{\w+\}|[,;: !])", "", tex)
    return len(re.sub(r"\\[A-Za-z]+", "#", re.sub(r"[{}^_\s]", "", words)))


def _top_level(tex: str):
    """(index, piece) of each top-level `=` and `\\quad`/`\\qquad` (outside braces, `\\left`..`\\right`,
    environments)."""
    depth, i = 0, 0
    while i < len(tex):
        m = re.match(r"\\(left|right|begin|end|qquad|quad)\b|\\.|[{}=]", tex[i:])
        if not m:
            i += 1
            continue
        token = m.group(0)
        if token in ("{", r"\left", r"\begin"):
            depth += 1
        elif token in ("}", r"\right", r"\end"):
            depth -= 1
        elif depth == 0 and token in ("=", r"\quad", r"\qquad"):
            yield i, token
        i += len(token)


def formula_lines(tex: str) -> list[str]:
    """A long display formula as its lines: each `\\quad`-separated equation, each `=` of a chain.

    >>> print(*formula_lines(r"\\mathrm{MultiHead}(Q, K, V) = \\mathrm{Concat}(\\mathrm{head}_0, \\dots, \\mathrm{head}_{h-1})\\, W_O = \\sum_i \\mathrm{head}_i\\, W_O^{(i)}"), sep="\\n")
    \\mathrm{MultiHead}(Q, K, V) = \\mathrm{Concat}(\\mathrm{head}_0, \\dots, \\mathrm{head}_{h-1})\\, W_O
    = \\sum_i \\mathrm{head}_i\\, W_O^{(i)}
    >>> formula_lines("a = b")
    ['a = b']
    """
    if visible_length(tex) <= LIST_CHARS:
        return [tex]
    equations, start = [], 0
    for at, token in _top_level(tex):
        if token != "=":
            equations.append(tex[start:at].strip())
            start = at + len(token)
    equations.append(tex[start:].strip())
    lines = []
    for eq in filter(None, equations):
        cuts = [at for at, token in _top_level(eq) if token == "="][1:]  # the first `=` stays on its line
        if visible_length(eq) <= FORMULA_CHARS:
            cuts = []
        pieces = [eq[a:b].strip() for a, b in zip([0, *cuts], [*cuts, len(eq)])]
        merged = [pieces[0]]  # a short continuation joins the line before it when both fit
        for piece in pieces[1:]:
            joined = f"{merged[-1]} {piece}"
            merged[-1:] = [joined] if visible_length(joined) <= FORMULA_CHARS else [merged[-1], piece]
        lines += merged
    return lines


def display_mathml(tex: str, where: str = "<formula>") -> str:
    """A display formula as one <math> element: a single line, or a one-column table of `formula_lines`."""
    lines = formula_lines(tex)
    if len(lines) == 1:
        return latex_to_mathml(tex, True, where)
    rows = []
    for line in lines:
        inner = ET.fromstring(latex_to_mathml(line, False, where))  # checked like any formula
        cell = ET.Element(
            f"{_MATHML}mtd", {"class": "cont" if line.startswith("=") else "first", "displaystyle": "true"}
        )
        cell.extend(list(inner))
        row = ET.Element(f"{_MATHML}mtr")
        row.append(cell)
        rows.append(row)
    root = ET.Element(f"{_MATHML}math", {"display": "block", "class": "lines"})
    table = ET.SubElement(root, f"{_MATHML}mtable", {"displaystyle": "true"})
    table.extend(rows)
    root.set("alttext", tex)
    return ET.tostring(root, encoding="unicode")


# MathML Core (what browsers implement) dropped the named space widths latex2mathml still writes.
_NAMED_SPACES = {
    "negativeveryverythinmathspace": "-0.0556em",
    "negativeverythinmathspace": "-0.1111em",
    "negativethinmathspace": "-0.1667em",
    "negativemediummathspace": "-0.2222em",
    "negativethickmathspace": "-0.2778em",
    "veryverythinmathspace": "0.0556em",
    "verythinmathspace": "0.1111em",
    "thinmathspace": "0.1667em",
    "mediummathspace": "0.2222em",
    "thickmathspace": "0.2778em",
}


def _polish(root: ET.Element) -> None:
    """Named widths to ems, and TeX's thin space after an operator name (`\\log p`) that browsers omit."""
    for element in root.iter():
        width = element.get("width")
        if width is not None and width in _NAMED_SPACES:
            element.set("width", _NAMED_SPACES[width])
    for parent in list(root.iter()):
        children = list(parent)
        for i in reversed(range(len(children) - 1)):
            name, following = children[i], children[i + 1]
            if name.tag == f"{_MATHML}mi" and len((name.text or "").strip()) > 1 and following.tag != f"{_MATHML}mo":
                parent.insert(i + 1, ET.Element(f"{_MATHML}mspace", {"width": "0.1667em"}))


# %% [markdown]
# ## 3. Prose: Markdown, math, doctest blocks, headings with anchors

# %%
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")


def fence_doctests(prose: str) -> str:
    """Wrap each doctest example block (`>>>` up to the next blank line) in a ```pycon fence.

    >>> fence_doctests("Text:\\n\\n>>> 1 + 1\\n2\\n\\nMore.").split("\\n")
    ['Text:', '', '```pycon', '>>> 1 + 1', '2', '```', '', 'More.']
    """
    lines, out, i, fence = prose.split("\n"), [], 0, None
    while i < len(lines):
        line = lines[i]
        opening = _FENCE.match(line)
        if fence is not None:  # inside a fenced block: copy until its closing fence
            if opening and opening.group(1)[0] == fence[0] and len(opening.group(1)) >= len(fence):
                fence = None
        elif opening:
            fence = opening.group(1)
        elif line.lstrip().startswith(">>>"):
            indent = len(line) - len(line.lstrip())
            out.append("```pycon")
            while i < len(lines) and lines[i].strip():
                out.append(lines[i][indent:] if not lines[i][:indent].strip() else lines[i].lstrip())
                i += 1
            out.append("```")
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


def fence_language(code: str, lang: str) -> str:
    """The Pygments lexer for a fence: its own word, else `console` for shell sessions (`$ ` prompts), else text.

    >>> fence_language("$ make test\\nok", ""), fence_language("epoch 1 loss 4.2", ""), fence_language("x", "sh")
    ('console', 'text', 'sh')
    """
    if lang:
        return lang
    return "console" if any(line.startswith("$ ") for line in code.split("\n")) else "text"


def highlight_code(code: str, lang: str = "python") -> str:
    """Pygments HTML (class-based; the stylesheet is inline in the page) in a <pre>, one <span class="l"> a line,
    so a long line wraps under itself with a hanging indent instead of scrolling."""
    code = code.strip("\n")  # as the lexer strips it (`stripnl`), so its lines and `code`'s stay paired
    try:
        lexer = get_lexer_by_name(fence_language(code, lang))
    except ClassNotFound:
        lexer = get_lexer_by_name("text")
    body = _pygments_highlight(code, lexer, HtmlFormatter(nowrap=True))
    lines = "".join(
        f'<span class="l"{_indent(text)}>{line}\n</span>'
        for line, text in zip(body.rstrip("\n").split("\n"), code.split("\n") + [""] * len(body))
    )
    return f'<pre class="highlight"><code>{lines}</code></pre>\n'


def _indent(line: str) -> str:
    """The style attribute that hangs a wrapped line under its own text, four characters deeper than its
    indent (none for an unindented line: the stylesheet's default).

    >>> _indent("        return x"), _indent("x = 1")
    (' style="--i:8"', '')
    """
    n = len(line) - len(line.lstrip(" "))
    return f' style="--i:{n}"' if n else ""


def slugify(text: str) -> str:
    """'1. Attention: a soft lookup' -> '1-attention-a-soft-lookup'."""
    slug = re.sub(r"[^\w\s-]", "", text.lower()).strip()
    return re.sub(r"[\s_-]+", "-", slug) or "section"


def _heading_text(inline) -> str:
    return "".join(
        child.content for child in (inline.children or []) if child.type in ("text", "code_inline", "math_inline")
    ).strip()


def _where(env: dict, snippet: str) -> str:
    """'file:line' of `snippet` in the prose being rendered (env holds file, first line, source)."""
    if "file" not in env:
        return env.get("where", "<prose>")
    offset = env["source"].find(snippet)
    line = env["line"] + (env["source"].count("\n", 0, offset) if offset >= 0 else 0)
    return f"{env['file']}:{line}"


def make_markdown(math: bool = True) -> MarkdownIt:
    """CommonMark + tables (+ $math$ unless math=False); raw HTML in prose is escaped, not passed through."""
    md = MarkdownIt("commonmark", {"html": False, "highlight": lambda code, lang, attrs: highlight_code(code, lang)})
    md.enable("table")
    if math:
        dollarmath_plugin(md, allow_labels=False, allow_space=False, allow_digits=False)

    def math_inline(self, tokens, idx, options, env):
        return latex_to_mathml(tokens[idx].content, False, _where(env, tokens[idx].content))

    def math_block(self, tokens, idx, options, env):
        formula = display_mathml(tokens[idx].content.strip(), _where(env, tokens[idx].content.strip()))
        return f'<div class="math">{formula}</div>\n'

    def heading_close(self, tokens, idx, options, env):
        anchor = tokens[idx].meta.get("id")
        link = f' <a class="anchor" href="#{anchor}" aria-label="link to this section">¶</a>' if anchor else ""
        return f"{link}</{tokens[idx].tag}>\n"

    md.add_render_rule("math_inline", math_inline)
    md.add_render_rule("math_block", math_block)
    md.add_render_rule("heading_close", heading_close)
    return md


# %% [markdown]
# ## 4. Chapters
#
# A chapter renders its cells in order. Headings get ids that are unique on
# the page (prefixed by the chapter's name) and feed the table of contents.
# A figure goes where the prose cites it: a paragraph that is only
# `<!-- figure: name -->` (Jupyter shows nothing there) becomes the figure.
# A prose cell followed by another prose cell is a row of its own, without
# code beside it.


# %%
@dataclass
class Heading:
    level: int
    text_html: str
    id: str


@dataclass
class Page:
    """What the chapters accumulate: ids in use, headings, figures placed."""

    md: MarkdownIt
    figure_html: dict[str, str]  # figure name -> <figure> element (number filled in later)
    ids: set[str] = field(default_factory=set)
    headings: list[Heading] = field(default_factory=list)
    placed: list[str] = field(default_factory=list)  # figure names, in page order
    notes: list[str] = field(default_factory=list)  # for the console

    def free_id(self, base: str) -> str:
        candidate, n = base, 2
        while candidate in self.ids:
            candidate, n = f"{base}-{n}", n + 1
        return candidate

    def unique_id(self, base: str) -> str:
        candidate = self.free_id(base)
        self.ids.add(candidate)
        return candidate


def _figure_slot(name: str) -> str:
    return f"<!--figure:{name}-->"


def render_prose(
    page: Page,
    chapter: str,
    cell: Cell,
    rel: str,
    want: list[figs.Figure],
    first_h1: bool,
    md: MarkdownIt | None = None,
    mark: bool = False,
) -> tuple[str, bool]:
    """HTML of one prose cell (figures marked by slots); returns (html, whether the chapter id was used).
    `md`: another renderer than the page's (the guides' has no math). `mark`: each top-level block starts
    with a comment naming the identifiers it mentions in backticks (`pair_prose` reads them)."""
    md = md or page.md
    env = {"file": rel, "line": cell.line, "source": cell.source}
    tokens = md.parse(fence_doctests(cell.source), env)
    inserts: dict[int, list[str]] = {}
    open_headings = [i for i, t in enumerate(tokens) if t.type == "heading_open"]
    for _n, i in enumerate(open_headings):
        level, text = int(tokens[i].tag[1]), _heading_text(tokens[i + 1])
        if level == 1 and first_h1:
            anchor, first_h1 = page.unique_id(chapter), False
        else:
            anchor = page.unique_id(f"{chapter}-{slugify(text)}")
        tokens[i].attrSet("id", anchor)
        tokens[i + 2].meta["id"] = anchor  # heading_close, for the permalink
        renderer = cast(RendererHTML, md.renderer)  # MarkdownIt's own HTML renderer (make_markdown)
        page.headings.append(
            Heading(level, renderer.renderInline(tokens[i + 1].children or [], md.options, env), anchor)
        )
    for i, t in enumerate(tokens):  # a citation <!-- figure: name --> (a paragraph of its own): the figure
        paragraph = t.type == "inline" and tokens[i - 1].type == "paragraph_open"
        cited = _CITATION.fullmatch(t.content.strip()) if paragraph else None
        if cited is None:
            continue
        name = cited.group(1)
        if name not in {f.name for f in figs.FIGURES}:
            page.notes.append(
                f"{_where(env, cited.group(0))}: the prose cites <!-- figure: {name} -->, but "
                f"FIGURES in docs/figures.py has no figure of that name: nothing shown there"
            )
        t.children, t.content = [], ""  # the citation itself shows nothing
        tokens[i - 1].hidden = tokens[i + 1].hidden = True
        fig = next((f for f in want if f.name == name), None)
        if fig is not None and fig.name not in page.placed:
            inserts.setdefault(i - 1, []).append(fig.name)
            page.placed.append(fig.name)
    if mark:
        for i, t in enumerate(tokens):
            if t.level == 0 and not t.type.endswith("_close"):
                end = (
                    i + 1
                    if not t.type.endswith("_open")
                    else next(
                        j + 1
                        for j in range(i, len(tokens))
                        if tokens[j].level == 0 and tokens[j].type.endswith("_close")
                    )
                )
                block = tokens[i:end]
                names = sorted(
                    {
                        c.content.split("(")[0]
                        for b in block
                        for c in (b.children or [])
                        if c.type == "code_inline" and re.fullmatch(r"\w+(\(.*\))?", c.content)
                    }
                )
                inserts.setdefault(i, []).append(_mention(names))
    parts, start = [], 0
    for at in sorted(inserts):
        parts.append(md.renderer.render(tokens[start:at], md.options, env))
        parts.extend(name if name.startswith("<!--") else _figure_slot(name) for name in inserts[at])
        start = at
    parts.append(md.renderer.render(tokens[start:], md.options, env))
    return "".join(parts), not first_h1


PIECE = 24  # a code cell longer than this is cut at blank lines into pieces of about this many lines


def code_pieces(cell: Cell) -> list[Cell]:
    """A code cell cut at blank lines into pieces of at least PIECE lines (the last may be shorter),
    preferring cuts before a top-level statement; the pieces together are the cell, line for line.

    >>> text = "\\n".join(["def a():"] + ["    x = 1"] * 30 + ["", "def b():"] + ["    pass"] * 3)
    >>> [(p.line, p.end) for p in code_pieces(Cell("code", text, 10, 10 + text.count("\\n")))]
    [(10, 41), (42, 45)]
    """
    lines, pieces, start = cell.source.split("\n"), [], 0
    for i in range(1, len(lines) - 1):
        top_level = lines[i + 1][:1] not in ("", " ", "\t", ")", "]", "}")
        long_enough = i - start >= (PIECE if top_level else 2 * PIECE)
        if not lines[i].strip() and long_enough and len(lines) - i > 3:
            pieces.append((start, i + 1))  # the blank line ends the piece
            start = i + 1
    pieces.append((start, len(lines)))
    return [Cell("code", "\n".join(lines[a:b]), cell.line + a, cell.line + b - 1) for a, b in pieces]


_DEFINITION = re.compile(
    r"^(?:@.*\n)*(?:async )?(def|class) (\w+)[^\n]*\n"  # a definition, then its docstring's
    r'\s*(?:r?"""|\'\'\')\s*([^\n]*?)\s*(?:"""|\'\'\'|$)',
    re.M,
)  # first line


def piece_note(piece: Cell) -> str:
    """The words beside a piece of code that has no prose cell of its own: its definitions' docstring summaries.

    >>> piece_note(Cell("code", "def f(x):\\n    \'\'\'Costs $5 and `x` <b>.\'\'\'\\n    return x", 1, 3))
    '<ul class="defs"><li><code>f</code>: Costs $5 and <code>x</code> &lt;b&gt;.</li></ul>\\n'
    """
    words = lambda text: re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text))  # no math here
    items = [
        f"<li><code>{html.escape(name)}</code>: {words(summary)}</li>"
        for _, name, summary in _DEFINITION.findall(piece.source)
        if summary
    ]
    return f'<ul class="defs">{"".join(items)}</ul>\n' if items else ""


def code_block(page: Page, name: str, rel: str, piece: Cell) -> str:
    anchor = page.unique_id(f"{name}-L{piece.line}")
    return (
        f'<div class="code" id="{anchor}"><div class="where"><a href="#{anchor}">{rel}, '
        f"lines {piece.line}–{piece.end}</a></div>\n{highlight_code(piece.source)}</div>\n"
    )


def row(prose: str, code: str) -> str:
    """One line of the page: prose on the left, the code it explains on the right (one column when narrow)."""
    if not code:
        return f'<div class="row solo"><div class="prose">\n{prose}</div></div>\n'
    kind = "row" if prose.strip() else "row bare"
    return f'<div class="{kind}"><div class="prose">\n{prose}</div>{code}</div>\n'


_SLOT = re.compile(r"(<!--figure:\w+-->)")
_CITATION = re.compile(r"<!--\s*figure:\s*(\w+)\s*-->")
_MENTIONS = re.compile(r"<!--mentions:([\w,]*)-->")
_DEFINED = re.compile(r"^(?:@.*\n)*(?:async )?(?:def|class) (\w+)", re.M)


def _blank(html_text: str) -> bool:
    return not _MENTIONS.sub("", html_text).strip()


def _mention(names: Sequence[str]) -> str:
    return f"<!--mentions:{','.join(names)}-->"


def pair_prose(prose: str, pieces: list[Cell]) -> list[str]:
    """The prose of a code cell shared among its pieces, so that it sits beside the code it explains: block by
    block, in order, the prose stays beside the piece it is at until a block names (in backticks) something
    that a later piece defines and this one does not; from there on it sits beside that piece.

    >>> pieces = [Cell("code", "def helper():\\n    pass", 1, 2), Cell("code", "class Big:\\n    pass", 3, 4)]
    >>> pair_prose("<h2>Title</h2>" + _mention([]) + "<p>intro</p>" + _mention(["Big"]) + "<p>Big does</p>", pieces)
    ['<h2>Title</h2><p>intro</p>', '<p>Big does</p>']
    """
    defined = [set(_DEFINED.findall(p.source)) for p in pieces]
    chunks = _MENTIONS.split(prose)  # text, names, text, names, text, ...
    shares, at = [chunks[0]] + [""] * (len(pieces) - 1), 0
    for names, text in zip(chunks[1::2], chunks[2::2]):
        named = set(filter(None, names.split(",")))
        if not _blank(text) and not named & defined[at]:
            at = next((j for j in range(at + 1, len(pieces)) if named & defined[j]), at)
        shares[at] += text
    return shares


def render_chapter(page: Page, name: str, path: Path, root: Path, want: list[figs.Figure]) -> str:
    """The chapter as rows: each prose cell beside the code cell after it, long code cut into pieces (each
    beside its definitions' summaries), figures in rows of their own where the prose placed them."""
    rel = path.relative_to(root).as_posix()
    parts: list[str] = []
    after: list[str] = []  # figures that close the pending prose
    used_chapter_id, prose = False, ""
    for cell in read_cells(path):
        if cell.kind == "markdown":
            body, used = render_prose(page, name, cell, rel, want, first_h1=not used_chapter_id, mark=True)
            used_chapter_id |= used
            if not _blank(prose):  # prose without code of its own (another prose cell follows): a row alone
                parts.append(row(prose, ""))
                prose = ""
            chunks, after = _SLOT.split(prose + "".join(after) + body), []  # text, slot, text, ..., text
            while len(chunks) >= 3 and _blank(chunks[-1]):  # figures that end the prose follow its code
                blank, slot = chunks.pop(), chunks.pop()
                after.insert(0, slot + "\n")
                chunks[-1] += blank
            *before, prose = chunks
            for i, chunk in enumerate(before):
                parts.append((row(chunk, "") if not _blank(chunk) else "") if i % 2 == 0 else f"{chunk}\n")
            continue
        pieces = code_pieces(cell)
        shares = pair_prose(prose, pieces)
        last = max((n for n, share in enumerate(shares) if not _blank(share)), default=0)
        for n, piece in enumerate(pieces):
            words = shares[n] if not _blank(shares[n]) else piece_note(piece)
            parts.append(row(words, code_block(page, name, rel, piece)))
            if n == last:  # figures that end the prose follow the code beside its last words
                parts.extend(after)
        prose, after = "", []
    if not _blank(prose):
        parts.append(row(prose, ""))
    parts.extend(after)
    if not used_chapter_id:  # a module without a title: give it one
        page.ids.add(name)
        page.headings.append(Heading(1, f"<code>{rel}</code>", name))
        parts.insert(0, f'<h1 id="{name}"><code>{rel}</code></h1>\n')
    for fig in want:
        if fig.at_end and fig.name not in page.placed:
            parts.append(_figure_slot(fig.name) + "\n")
            page.placed.append(fig.name)
    lines = sum(1 for _ in path.open(encoding="utf-8"))
    source = f'<p class="source">Source: <code>{rel}</code>, {lines} lines. <a href="#contents">Contents</a></p>\n'
    title = next(i for i, part in enumerate(parts) if f'<h1 id="{name}"' in part)
    head, tail = parts[title].split("</h1>\n", 1)  # right under the chapter's title
    parts[title] = f"{head}</h1>\n{source}{tail}"
    return _MENTIONS.sub("", f'<article class="chapter">\n{"".join(parts)}</article>\n')


def link_module_mentions(body: str, chapters: Sequence[str]) -> str:
    """`annotated/<name>.py` in prose links to that chapter when it is on the page (not inside a link).

    >>> link_module_mentions('<code>annotated/training/data.py</code> <a href="#x"><code>annotated/training/data.py</code></a>', ["training/data"])
    '<a href="#training/data"><code>annotated/training/data.py</code></a> <a href="#x"><code>annotated/training/data.py</code></a>'
    """

    def link(m: re.Match) -> str:
        if m.group(1) or m.group(3) not in chapters:
            return m.group(0)
        return f'<a href="#{m.group(3)}">{m.group(0)}</a>'

    return re.sub(r"(<a [^>]*>.*?</a>)|<code>(annotated/([\w/]+)\.py)</code>", link, body, flags=re.S)


# %% [markdown]
# ### Guides
#
# The long pages of the repository, Markdown files (`GUIDES`), follow the
# chapters as articles of their own, through the prose's renderer without
# math: their `$` are shell variables and prices (`$MULTI30K_URL`, `TEXT='Er
# zahlt $5'`), never formulas. Each is titled by its first heading; its ids
# start with `guide-` and the file's name. A link to another guide, a chapter
# or a heading of either becomes a link within the page; any other link
# (another file of the repository, the web) becomes its text, and an image
# its alt text, since the page reaches nothing outside itself.


# %%
def guide_id(rel: str) -> str:
    """'docs/faults.md' -> 'guide-faults'; 'benchmarks/README.md' -> 'guide-benchmarks'."""
    path = Path(rel)
    return "guide-" + slugify(path.parent.name if path.stem.lower() == "readme" else path.stem)


def render_guide(page: Page, rel: str, root: Path, md: MarkdownIt) -> tuple[str, str]:
    """(the article of one guide, its id); headings join page.headings."""
    text = (root / rel).read_text(encoding="utf-8")
    gid, first = page.free_id(guide_id(rel)), len(page.headings)
    body, titled = render_prose(page, gid, Cell("markdown", text, 1, text.count("\n") + 1), rel, [], True, md)
    source = f'<p class="source">Source: <code>{rel}</code>. <a href="#contents">Contents</a></p>\n'
    if titled:
        head, tail = body.split("</h1>\n", 1)
        body = f"{head}</h1>\n{source}{tail}"
    else:  # no "# Title": the file's name is the title
        page.ids.add(gid)
        page.headings.insert(first, Heading(1, f"<code>{rel}</code>", gid))
        body = f'<h1 id="{gid}"><code>{rel}</code></h1>\n{source}{body}'
    return f'<article class="guide">\n{body}</article>\n', gid


_LINK = re.compile(r'<a href="([^"]*)"(?: title="[^"]*")?>(.*?)</a>|<img src="[^"]*" alt="([^"]*)"[^>]*>', re.S)


def resolve_links(body: str, rel: str, targets: dict[str, str], ids: set[str]) -> str:
    """The Markdown links of the file `rel`, as the page can follow them. `targets`: file (relative to the
    root) -> id of its article or chapter; `ids`: the page's ids, for a link to a heading (`#...`).

    >>> resolve_links('<a href="faults.md#data-annotateddatapy">D</a>, <a href="../README.md">R</a>, '
    ...               '<a href="https://x.org/">W</a>, <img src="p.png" alt="P" />, <a href="#contents">C</a>',
    ...               "docs/training.md", {"docs/faults.md": "guide-faults", "docs/training.md": "guide-training"},
    ...               {"guide-faults-data-annotateddatapy", "contents"})
    '<a href="#guide-faults-data-annotateddatapy">D</a>, R, W, P, <a href="#contents">C</a>'
    """

    def link(m: re.Match) -> str:
        if m.group(3) is not None:  # an image: its alt text
            return m.group(3)
        path, _, fragment = html.unescape(m.group(1)).partition("#")
        target = targets.get(posixpath.normpath(posixpath.join(posixpath.dirname(rel), path)) if path else rel)
        if target is None:
            return m.group(2)
        heading = f"{target}-{slugify(fragment)}"
        if fragment and heading not in ids and not path and fragment in ids:
            return m.group(0)  # an id of the page itself, as `#contents`
        return f'<a href="#{heading if fragment and heading in ids else target}">{m.group(2)}</a>'

    return _LINK.sub(link, body)


# %% [markdown]
# ## 5. The page
#
# What surrounds the chapters is two plain files beside this builder: the
# page, `docs/templates/page.html` (a `string.Template`: `${title}`,
# `${intro}`, `${toc}`, `${body}` and the others are filled in here), and its
# style, `docs/static/book.css`. Both are read at every build and copied into
# the page, which stays one file with nothing to fetch.

# %%
CSS_FILE = Path(__file__).resolve().parent / "static" / "book.css"  # the page's stylesheet
TEMPLATE_FILE = Path(__file__).resolve().parent / "templates" / "page.html"  # the page around the chapters

# The browser may load nothing but this page's own images: no scripts, fonts, frames or connections;
# a page with an embed (section 8) may also frame pages of its own folder (which run their own scripts) and
# run one script of its own, `FIT_FRAMES` (allowed by its hash): a frame that says how tall its page is
# (the viewer does, after each drawing) is made that tall, so no view of it is cut off or scrolls inside.
CSP = "default-src 'none'; img-src 'self'; style-src 'unsafe-inline'"
FIT_FRAMES = """addEventListener('message', e => {
  const h = e.data && e.data.viewerHeight;
  for (const f of document.querySelectorAll('iframe'))
    if (f.contentWindow === e.source && Number.isFinite(h) && h > 0) f.style.height = `${Math.min(h, 5000) + 2}px`;
});"""
FRAMES = (
    f"; frame-src 'self'; script-src 'sha256-{base64.b64encode(hashlib.sha256(FIT_FRAMES.encode()).digest()).decode()}'"
)


def _toc(headings: list[Heading]) -> str:
    """Parts, each with its chapters; a chapter's sections unfold under it (<details>, no script)."""
    items: list[str] = []
    state: list[str] = []  # the open elements, innermost last

    def close(down_to: int) -> None:
        while len(state) > down_to:
            items.append(state.pop())

    for hd in headings:
        link = f'<a href="#{hd.id}">{hd.text_html}</a>'
        if hd.level == 0:
            close(0)
            items.append(f"<li>{link}<ol>")
            state.append("</ol></li>")
        elif hd.level == 1:
            close(1)
            items.append(f"<li><details><summary>{link}</summary><ul>")
            state.append("</ul></details></li>")
        elif hd.level == 2 and state:
            items.append(f"<li>{link}</li>")
    close(0)
    return ("<ol>" + "".join(items) + "</ol>").replace("<ul></ul></details>", "</details>")


INTRODUCTION = """\
Multi-head attention can be written in two ways, and this book writes both. In the **per-head** form
(`PerHeadAttention`) head $i$ owns rectangular matrices $W_Q[i]$, $W_K[i]$, $W_V[i]$ of $d_{model}$ rows and
$d_k$ columns and a block $W_O[i]$ of the output matrix, and a loop runs the paper's formula one head at a
time. In the **fused** form (`FusedAttention`) the same matrices lie side by side in one matrix, one product
computes every head at once and a `view` hands each head its block, so the two forms are the same function
(Figure 1; Part II proves it).

Part I is the chapter: the whole model, trained on a copy task in about 20 seconds on a laptop's CPU. Part II checks the
equivalence symbolically, exactly and numerically, against `torch.nn.MultiheadAttention`, and proves the
conversions to and from Hugging Face's `MarianMTModel` (the OPUS-MT translators) the same function; Part III trains
a translator and decodes with it; Part IV looks at what the heads attend to, measures how much each one
matters, and removes heads; Part V reads what each head's own matrices compute, its QK and OV circuits, and finds
a dictionary in the cross-attention. Each prose cell sits beside the code it explains; the guides follow the parts.

Heads, layers and positions are counted from 0 everywhere, as the code counts them: head 0 is the one that
uses `W_Q[0]`, position 0 holds the first token, and the figures, the attention viewer, its pictures and
`make heads` all say "head 0" for it. The paper's formulas number heads from 1 ($\\mathrm{head}_1$ to
$\\mathrm{head}_h$), so the paper's $\\mathrm{head}_i$ is head $i - 1$ here.
"""


def render_page(chapters_html: list[str], page: Page, intro_html: str = "", frames: bool = False) -> str:
    body = "".join(chapters_html)
    for number, name in enumerate(page.placed, start=1):
        slot = _figure_slot(name)
        intro_html, body = (
            text.replace(slot, page.figure_html[name].replace("{number}", str(number))) for text in (intro_html, body)
        )
    return string.Template(TEMPLATE_FILE.read_text(encoding="utf-8")).substitute(
        csp=CSP + FRAMES if frames else CSP,
        title=TITLE,
        script=f"<script>{FIT_FRAMES}</script>" if frames else "",
        css=HtmlFormatter(style="default").get_style_defs(".highlight") + "\n" + CSS_FILE.read_text(encoding="utf-8"),
        intro=intro_html,
        toc=_toc(page.headings),
        body=body,
        generated=GENERATED,
    )


# %% [markdown]
# ## 6. The output folder: only our own files are replaced or removed
#
# `--out` may be a folder that holds other things. A build records what it
# wrote in `.docs-build.json` (paths relative to the folder: the page and
# its figures under `"page"`, notebooks under `"notebooks"`). The next build
# removes only the recorded page files it no longer writes, and replaces
# only recorded files: a file it would write that is there but not recorded
# (your own `index.html`, a picture of yours in `figures/`) stops the build
# before any work, with one line naming `--overwrite` (`make docs
# ARGS=--overwrite`), which allows it. In a folder without a record, an
# `index.html` that carries this builder's header marks the folder as a
# build's output, and the page's files count as ours.
# Everything else in the folder is never looked at. The record is written
# before the files it lists, so a build stopped half-way leaves nothing
# the next build would take for foreign. (`test_a_build_replaces_and_removes_only_its_own_files`.)

# %%
MANIFEST = ".docs-build.json"
MANIFEST_FORMAT = "annotated-docs-build-v1"


class OutputError(ValueError):
    """The output folder holds a file the build would replace but did not write; the message names the fix."""


_OURS = {"page": re.compile(r"index\.html|figures/\w+\.png|viewer/index\.html"), "notebooks": re.compile(r"\w+\.ipynb")}


def read_manifest(out: Path) -> dict[str, list[str]]:
    """{"page": [...], "notebooks": [...]}: what earlier builds wrote into `out` (empty lists if unknown).
    Only names a build writes count: a record cannot point outside `out` or at a file of another kind."""
    try:
        record = json.loads((out / MANIFEST).read_text(encoding="utf-8"))
        if record.get("format") == MANIFEST_FORMAT:
            return {
                kind: [p for p in record.get(kind, []) if isinstance(p, str) and pattern.fullmatch(p)]
                for kind, pattern in _OURS.items()
            }
    except (OSError, ValueError, AttributeError, TypeError):
        pass
    return {"page": [], "notebooks": []}


def write_manifest(out: Path, record: dict[str, list[str]]) -> None:
    atomic_write(out / MANIFEST, json.dumps({"format": MANIFEST_FORMAT, **record}, indent=1) + "\n")


GENERATED = "Generated by <code>make docs</code>"  # in every page this builder writes (see render_page)


def check_output(out: Path, files: Sequence[str], record: dict[str, list[str]], overwrite: bool) -> None:
    """OutputError unless every file of `files` (relative to `out`) is new, recorded, or --overwrite is given.

    In a folder without a record, an index.html that carries the builder's header (GENERATED) marks the
    folder as a build's output: the page's files count as ours."""
    if out.exists() and not out.is_dir():
        raise OutputError(f"--out {out} is a file, not a folder; choose another --out")
    ours = set(record["page"]) | set(record["notebooks"])
    try:
        if not record["page"] and GENERATED in (out / "index.html").read_text(encoding="utf-8", errors="replace"):
            ours |= {name for name in files if _OURS["page"].fullmatch(name)}
    except OSError:
        pass
    for name in files:
        if (out / name).exists() and name not in ours and not overwrite:
            raise OutputError(
                f"{out / name} exists and was not written by a docs build; it was left untouched: "
                f"pass --overwrite to replace it, or choose another --out"
            )


# %% [markdown]
# ## 7. Building: figures, chapters, page


# %%
@dataclass
class BuildResult:
    index: Path
    chapters: list[str]  # modules rendered, in page order
    skipped: list[str]  # modules of READING_ORDER that do not exist
    figures: list[Path]  # PNG files written
    placed: dict[str, str]  # figure name -> chapter it was placed in ("appendix" if none)
    notes: list[str]  # for the console, never on the page
    removed: list[Path] = field(default_factory=list)  # files of the previous build this one no longer writes
    guides: list[str] = field(default_factory=list)  # GUIDES rendered, in page order


def chapter_list(root: Path, modules: Sequence[str]) -> tuple[list[str], list[str], list[str]]:
    """(present modules in reading order, then unlisted ones alphabetically; missing; unlisted)."""
    present = [m for m in modules if (root / "annotated" / f"{m}.py").is_file()]
    missing = [m for m in modules if m not in present]
    unlisted = sorted(
        p.relative_to(root / "annotated").with_suffix("").as_posix()
        for p in (root / "annotated").rglob("*.py")
        if not p.stem.startswith("_") and p.relative_to(root / "annotated").with_suffix("").as_posix() not in modules
    )
    return present + unlisted, missing, unlisted


def part_of(module: str) -> str:
    """The id of the part a module belongs to: the part that lists it, else the part of its folder.

    >>> part_of("proof/harness"), part_of("training/new_thing"), part_of("plumbing/x"), part_of("elsewhere/y")
    ('appendix', 'part-3', 'appendix', 'appendix')
    """
    listed = [pid for pid, _, modules in PARTS if module in modules]
    return listed[0] if listed else FOLDER_PART.get(posixpath.dirname(module), "appendix")


def in_parts(chapters: Sequence[str]) -> list[tuple[str, str, list[str]]]:
    """(part id, title, its chapters in reading order) for every part with a chapter, in PARTS order."""
    grouped = [(pid, title, [c for c in chapters if part_of(c) == pid]) for pid, title, _ in PARTS]
    return [g for g in grouped if g[2]]


def draw_figures(
    out: Path, ctx: figs.FigureContext, selected: Sequence[figs.Figure], md: MarkdownIt, progress: bool = True
) -> tuple[dict[str, str], list[Path]]:
    """Draw each figure to out/figures/<name>.png; returns (name -> <figure> html, files)."""
    from tqdm.auto import tqdm

    html_of, files = {}, []
    for fig in tqdm(selected, desc="figures", disable=not progress, leave=False):
        mpl_figure, caption = fig.draw(ctx)
        data = figs.png_bytes(mpl_figure)
        path = out / "figures" / f"{fig.name}.png"
        atomic_write(path, data)
        files.append(path)
        width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")  # PNG IHDR
        env = {"where": f"docs/figures.py ({fig.name})"}
        alt = html.escape(re.sub(r"[`$\\]", "", caption.split(". ")[0]), quote=True)
        html_of[fig.name] = (
            f'<figure id="fig-{fig.name}"><img src="figures/{fig.name}.png" width="{width}" '
            f'height="{height}" alt="{alt}">\n<figcaption><strong>Figure {{number}}.</strong> '
            f"{md.renderInline(caption, env)}</figcaption></figure>\n"
        )
    return html_of, files


def build(
    out: Path = DEFAULT_OUT,
    *,
    root: Path = ROOT,
    modules: Sequence[str] = READING_ORDER,
    guides: Sequence[str] = GUIDES,
    checkpoint: Path | str | None = "auto",
    copy_steps: int = 300,
    with_figures: bool = True,
    progress: bool = True,
    say=print,
    overwrite: bool = False,
    embeds: Mapping[str, Embed] | None = None,
) -> BuildResult:
    """Render the modules, then the guides, into out/index.html (+ out/figures/). Returns what was built.

    `checkpoint`: "auto" uses the latest run's model (runs/latest/averaged.pt or best.pt), else the shipped
    de -> en model, for the attention figure (else the copy task); a path uses
    that checkpoint (an error if it does not load); None always uses the copy task.
    `overwrite`: replace files in `out` that no docs build wrote (else OutputError).
    `embeds`: module -> the `Embed` placed at the end of that module's chapter (default: EMBEDS with the
    figures, none without).
    """
    out, root = Path(out), Path(root)
    if copy_steps < 0:
        raise ValueError(f"copy_steps must be >= 0, got {copy_steps}")
    chapters, missing, unlisted = chapter_list(root, modules)
    if not chapters:
        raise DocsError(f"no module of {list(modules)} exists under {root / 'annotated'}")
    notes = [f"annotated/{m}.py does not exist: its chapter is missing." for m in missing]
    titles = {pid: title for pid, title, _ in PARTS}
    notes += [
        f"annotated/{m}.py is in no part of PARTS (docs/build.py): shown in {titles[part_of(m)]}, by its folder."
        for m in unlisted
    ]
    selected = list(figs.FIGURES) if with_figures else []
    embeds = {m: e for m, e in (EMBEDS if embeds is None and with_figures else embeds or {}).items() if m in chapters}
    writes = (
        ["index.html"] + [f"figures/{f.name}.png" for f in selected] + [f for e in embeds.values() for f in e.files]
    )
    record = read_manifest(out)
    check_output(out, writes, record, overwrite)  # before any work
    write_manifest(out, {"page": sorted(set(record["page"]) | set(writes)), "notebooks": record["notebooks"]})
    md = make_markdown()

    auto = checkpoint == "auto"
    ckpt = figs.find_checkpoint(root) if auto else (Path(checkpoint) if checkpoint is not None else None)
    ctx = figs.FigureContext(
        root=root,
        checkpoint=ckpt,
        copy_steps=copy_steps,
        cache_dir=out / ".cache",
        say=say,
        checkpoint_required=not auto,
    )
    figure_html, files = draw_figures(out, ctx, selected, md, progress)
    notes += ctx.notes

    page = Page(md, figure_html)
    page.ids.update(
        {"top", "introduction", "contents", "appendix-figures", "guides"}
        | {f"fig-{f.name}" for f in selected}
        | {pid for pid, _, _ in PARTS}
    )
    intro = md.render(INTRODUCTION, {"where": "docs/build.py (INTRODUCTION)"})
    for f in selected:
        if f.module == figs.INTRODUCTION:
            intro += _figure_slot(f.name) + "\n"
            page.placed.append(f.name)
    chapters_html, chapters = [], [c for _, _, members in in_parts(chapters) for c in members]
    for pid, title, members in in_parts(chapters):
        page.headings.append(Heading(0, html.escape(title), pid))
        chapters_html.append(f'<h1 class="part" id="{pid}">{html.escape(title)}</h1>\n')
        for name in members:
            chapter = render_chapter(
                page, name, root / "annotated" / f"{name}.py", root, [f for f in selected if f.module == name]
            )
            if name in embeds:
                end = embeds[name].make(out, ctx)
                chapter = chapter.replace("</article>", f'<div class="embed">{end}</div>\n</article>')
            chapters_html.append(chapter)
    notes += page.notes
    placed = {name: next(f.module for f in selected if f.name == name) for name in page.placed}
    leftover = [f for f in selected if f.name not in page.placed and f.module != figs.INTRODUCTION]
    appendix = ""
    if leftover:
        appendix = (
            '<article class="chapter"><h1 id="appendix-figures">Figures without a place</h1>\n'
            "<p>These figures illustrate chapters that are not on this page, or no prose cites them "
            "(see <code>FIGURES</code> in <code>docs/figures.py</code>).</p>\n"
        )
        page.headings.append(Heading(1, "Figures without a place", "appendix-figures"))
        for f in leftover:
            why = "not built" if f.module not in chapters else f"its prose cites no <!-- figure: {f.name} -->"
            notes.append(f"figure {f.name} belongs to annotated/{f.module}.py ({why}): shown in the appendix.")
            appendix += _figure_slot(f.name)
            page.placed.append(f.name)
            placed[f.name] = "appendix"
        appendix += "</article>\n"
    present = [g for g in guides if (root / g).is_file()]
    notes += [f"{g} does not exist: its guide is missing." for g in guides if g not in present]
    if present:  # the part "Guides", after the chapters and their appendix
        page.headings.append(Heading(0, "Guides", "guides"))
        appendix += '<h1 class="part" id="guides">Guides</h1>\n'
    guide_md = make_markdown(math=False)
    articles = {g: render_guide(page, g, root, guide_md) for g in present}  # file -> (html, id)
    targets = {**{f"annotated/{m}.py": m for m in chapters}, **{g: gid for g, (_, gid) in articles.items()}}
    appendix += "".join(resolve_links(a, g, targets, page.ids) for g, (a, _) in articles.items())
    body = [link_module_mentions(c, chapters) for c in chapters_html + [appendix]]
    index = out / "index.html"
    atomic_write(index, render_page(body, page, link_module_mentions(intro, chapters), frames=bool(embeds)))
    removed = [out / name for name in record["page"] if name not in writes and (out / name).is_file()]
    for stale in removed:  # recorded by an earlier build, not written by this one
        stale.unlink()
    write_manifest(out, {"page": writes, "notebooks": record["notebooks"]})
    return BuildResult(index, chapters, missing, files, placed, notes, removed, present)


# %% [markdown]
# ## 8. Embeds: an interactive piece at the end of a chapter
#
# An `Embed` names the files it writes into the output folder (recorded in
# the build's record like the figures, so a later build replaces or removes
# them, and a file of the user's there stops the build) and a function of
# the output folder and the figures' context that writes them and returns
# the HTML closing its chapter. The chapter ends with the attention viewer
# of its example (`viewer_page` in `docs/figures.py`: the trained
# translator when a checkpoint is found, else the copy-task model) in an
# `<iframe>`; the viewer page carries its own Content-Security-Policy,
# which allows its script by hash, and the book's policy allows only frames
# of its own folder (`frame-src 'self'`) besides its images
# (`test_the_viewer_is_embedded_at_the_end_of_the_chapter`).


# %%
@dataclass(frozen=True)
class Embed:
    files: tuple[str, ...]  # what `make` writes, relative to the output folder
    make: Callable[[Path, figs.FigureContext], str]  # (out, context) -> HTML that ends the chapter


VIEWER_CAPTION = (
    "**The attention viewer** for {name}, translating with beam search (beam 4) as `make "
    "translate` does, opened on the mean over the heads of the last decoder "
    "layer's cross-attention, as a heatmap: rows are queries, columns keys, and each row sums "
    "to 1. " + figs.ROW_CONVENTION + " The menus above the heatmap choose another kind of "
    "attention (the encoder's or the decoder's self-attention), layer or head, or the lines "
    "and model views; the arrow keys move between heads and layers (after a click on the "
    "picture: while a menu has the focus, they are the menu's). The frame grows with the view "
    "it shows."
)


def embed_viewer(out: Path, ctx: figs.FigureContext) -> str:
    """Write out/viewer/index.html (the embedded attention viewer) and return its <iframe> and caption."""
    atomic_write(out / figs.VIEWER, figs.viewer_page(ctx))
    caption = make_markdown().renderInline(
        VIEWER_CAPTION.format(name=ctx.shown_sentence().name), {"where": "docs/build.py (VIEWER_CAPTION)"}
    )
    return (
        f'<figure id="viewer"><iframe src="{figs.VIEWER}" title="attention viewer"></iframe>\n'
        f"<figcaption>{caption}</figcaption></figure>"
    )


EMBEDS: dict[str, Embed] = {"transformer": Embed((figs.VIEWER,), embed_viewer)}  # module -> its chapter's end


# %% [markdown]
# ## 9. The notebook
#
# `make notebook` writes the chapter as a Jupyter notebook: the same cells,
# prose as Markdown cells, plus the prose's examples and a few figures as
# code cells, executed at build time (`docs/notebook.py`). Only
# `annotated/transformer.py` by default: it imports nothing from the package,
# so the notebook runs from any directory; the other chapters import
# `annotated` and need the repository root on `sys.path`.


# %%
def build_notebook(
    module: str = "transformer", out: Path = DEFAULT_OUT, root: Path = ROOT, overwrite: bool = False
) -> Path:
    """annotated/<module>.py -> out/<module>.ipynb (written atomically; recorded like the page's files)."""
    src, out = Path(root) / "annotated" / f"{module}.py", Path(out)
    if not src.is_file():
        raise DocsError(f"no module {src} to convert to a notebook")
    record = read_manifest(out)
    check_output(out, [f"{module}.ipynb"], record, overwrite)
    record["notebooks"] = sorted(set(record["notebooks"]) | {f"{module}.ipynb"})
    write_manifest(out, record)
    from docs.notebook import render_notebook

    return atomic_write(out / f"{module}.ipynb", render_notebook(src))


def main(argv: Sequence[str] | None = None) -> int:
    door = Door(__file__)
    p = door.parser(
        description="Render annotated/*.py and the guides (docs/*.md, benchmarks/README.md) into "
        "docs/_build/index.html, or convert a chapter to a notebook.",
    )
    p.add_argument("--out", type=writable_dir, default=DEFAULT_OUT, help="output folder (default docs/_build)")
    door.checkpoint_options(
        p,
        languages=False,
        default="auto",
        help="checkpoint for the attention figure: auto (the latest run's model, averaged.pt or best.pt, "
        "else the shipped de->en model, else the copy task), none (copy task), or a path",
    )
    p.add_argument("--copy-steps", type=at_least(0), default=300, help="training steps of the copy-task model")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace files in --out that no docs build wrote (an index.html of yours, say)",
    )
    p.add_argument("--no-figures", action="store_true", help="skip drawing figures and the attention viewer (faster)")
    p.add_argument(
        "--notebook",
        nargs="*",
        metavar="MODULE",
        default=None,
        help="write notebooks instead of the page (default: transformer)",
    )
    args = p.parse_args(argv)
    auto = args.checkpoint in ("auto", "none")  # the book's own rule (`build`): the copy task where none is found
    checkpoint = None if args.checkpoint == "none" else "auto" if auto else door.checkpoint(args)
    import torch

    torch.set_num_threads(1)  # the figures' models are tiny: more threads only contend for the cores
    try:
        if args.notebook is not None:
            for module in args.notebook or ["transformer"]:
                print(f"wrote {build_notebook(module, args.out, overwrite=args.overwrite)}")
            return 0
        result = build(
            args.out,
            checkpoint=checkpoint,
            copy_steps=args.copy_steps,
            with_figures=not args.no_figures,
            overwrite=args.overwrite,
        )
    except (DocsError, ValueError) as e:  # a refused --out or checkpoint: 2, like other bad input; else 1
        door.say(f"error: {e}")
        return 2 if isinstance(e, (OutputError, CheckpointError)) else 1
    for note in result.notes:
        print(f"note: {note}")
    print(
        f"wrote {result.index} ({len(result.chapters)} chapters: {', '.join(result.chapters)}; "
        f"{len(result.guides)} guides; {len(result.figures)} figures)\nopen {result.index.resolve().as_uri()}"
    )
    return 0


if __name__ == "__main__":
    from annotated.plumbing.scripts import run_main

    run_main(main)
