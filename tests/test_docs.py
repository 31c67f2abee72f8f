"""The rendered page (docs/build.py, docs/figures.py), seen by a browser. (The notebook: test_notebook.py.)

The page is built once per test session into a temporary folder, with the
copy-task model trained for only a few steps (its attention picture need not
be good to test the page). The browser test drives headless Chromium through
its DevTools protocol over a pipe (`--remote-debugging-pipe`, standard library
only), so it can watch every network request the page makes.
"""

import base64
import doctest
import html
import io
import json
import os
import re
import shutil
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
from browser import CHROMIUM, Chromium

from annotated import transformer
from docs import build as B
from docs import figures as F
from docs import model_figures as M

ROOT = Path(__file__).resolve().parent.parent
COPY_STEPS = 20  # the page's attention picture needs a model, not a good one


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    result = B.build(out, checkpoint=None, copy_steps=COPY_STEPS, progress=False, say=lambda s: None)
    return result, result.index.read_text(encoding="utf-8")


def _text(fragment: str) -> str:
    """The text of an HTML fragment (tags dropped, entities decoded)."""
    return html.unescape(re.sub(r"<[^>]+>", "", fragment))


def _chapter(page: str, name: str) -> str:
    """The HTML of one chapter or guide: from its <h1 id=name> to the next article or part."""
    start = page.index(f'<h1 id="{name}"')
    end = re.compile(r'<article |<h1 class="part"').search(page, start)
    return page[start : end.start() if end else len(page)]


def _guides(page: str) -> str:
    """The HTML of the part "Guides"."""
    return page[page.index('<h1 class="part" id="guides">') : page.index("</main>")]


def _inline(text: str, kind: str) -> list:
    """The inline tokens of one kind in a Markdown text (as the guides' renderer parses it)."""
    tokens = B.make_markdown(math=False).parse(text)
    return [c for t in tokens for c in (t.children or []) if c.type == kind]


def _headings(text: str) -> list[tuple[str, str]]:
    """(tag, text) of the h1 and h2 headings of a Markdown text."""
    tokens = B.make_markdown(math=False).parse(text)
    return [
        (t.tag, B._heading_text(tokens[i + 1]))
        for i, t in enumerate(tokens)
        if t.type == "heading_open" and t.tag in ("h1", "h2")
    ]


def _toc(page: str) -> list[tuple[str, str]]:
    """(id, text) of every entry of the table of contents, in order."""
    nav = page[page.index('<nav id="contents">') : page.index("</nav>")]
    return [(i, _text(t)) for i, t in re.findall(r'<a href="#([^"]+)">(.*?)</a>', nav)]


# ---------------------------------------------------------------- the page's content


def test_build_doctests():
    result = doctest.testmod(B, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted >= 3 and result.failed == 0


def test_chapters_follow_the_parts_and_skip_missing_modules(site):
    result, page = site
    present = [m for m in B.READING_ORDER if (ROOT / "annotated" / f"{m}.py").is_file()]
    assert [c for c in result.chapters if c in present] == present  # PARTS order, parts in order
    assert result.skipped == [m for m in B.READING_ORDER if m not in present]
    positions = [page.index(f'<h1 id="{m}"') for m in result.chapters]
    assert positions == sorted(positions)
    parts = [(page.index(f'<h1 class="part" id="{pid}">'), pid) for pid, _, _ in B.PARTS]
    assert [p for _, p in sorted(parts)] == [pid for pid, _, _ in B.PARTS]  # Part I ... Appendix
    for m in result.chapters:  # under the heading of its own part
        at = page.index(f'<h1 id="{m}"')
        assert max((pos, pid) for pos, pid in parts if pos < at)[1] == B.part_of(m), m
    assert B.part_of("transformer") == "part-1" and B.part_of("proof/equivalence") == "part-2"
    assert B.part_of("decoding/search") == B.part_of("training/train") == "part-3"
    assert B.part_of("sites") == B.part_of("attention/dump") == "part-4"
    assert B.part_of("plumbing/files") == B.part_of("proof/harness") == B.part_of("recording") == "appendix"
    assert "Build notes" not in page and 'class="notes"' not in page  # the reader sees chapters, not the build
    footer = page[page.index("<footer>") :]
    assert B.GENERATED in footer and B.GENERATED not in page[: page.index("<footer>")]


def test_an_unlisted_module_lands_in_the_part_of_its_folder(tmp_path):
    (tmp_path / "annotated" / "training").mkdir(parents=True)
    shutil.copy(ROOT / "annotated" / "transformer.py", tmp_path / "annotated" / "transformer.py")
    (tmp_path / "annotated" / "training" / "extra.py").write_text("# %% [markdown]\n# # Extra\n\n# %%\nx = 1\n")
    result = B.build(tmp_path / "out", root=tmp_path, modules=("transformer",), with_figures=False, progress=False)
    assert result.chapters == ["transformer", "training/extra"]
    assert (
        "annotated/training/extra.py is in no part of PARTS (docs/build.py): shown in Part III. Data, "
        "training and decoding, by its folder."
    ) in result.notes
    page = result.index.read_text(encoding="utf-8")
    assert (
        page.index('id="part-1"')
        < page.index('id="transformer"')
        < page.index('id="part-3"')
        < page.index('id="training/extra"')
    )


def test_reading_order_names_every_module():
    """Every module of every folder has its place in PARTS, so `make docs` prints no maintainer's note."""
    package = ROOT / "annotated"
    modules = {p.relative_to(package).with_suffix("").as_posix() for p in package.rglob("*.py")}
    modules = {m for m in modules if not m.rsplit("/", 1)[-1].startswith("_")}
    assert sorted(modules - set(B.READING_ORDER)) == []
    assert len(set(B.READING_ORDER)) == len(B.READING_ORDER)


def test_missing_module_is_skipped_with_a_note_for_the_console_only(tmp_path):
    result = B.build(tmp_path, modules=("no_such_module", "transformer"), with_figures=False, progress=False)
    assert result.chapters[0] == "transformer" and result.skipped == ["no_such_module"]
    assert "annotated/no_such_module.py does not exist: its chapter is missing." in result.notes
    assert "no_such_module" not in result.index.read_text(encoding="utf-8")


# ---------------------------------------------------------------- the guides


def test_guides_follow_the_chapters_with_their_headings_in_the_contents(site):
    result, page = site
    assert result.guides == [g for g in B.GUIDES if (ROOT / g).is_file()] and len(result.guides) >= 4
    ids = re.findall(r' id="([^"]+)"', page)
    assert len(ids) == len(set(ids))  # unique on the page
    toc, positions = _toc(page), []
    toc_ids = [i for i, _ in toc]
    assert ("guides", "Guides") in toc and toc_ids.index("guides") > toc_ids.index(result.chapters[-1])
    for rel in result.guides:
        text = (ROOT / rel).read_text(encoding="utf-8")
        headings, gid = _headings(text), B.guide_id(rel)
        assert headings[0][0] == "h1" and len(headings) >= 2, rel
        start = toc.index((gid, headings[0][1]))  # titled by the file's first heading
        shown = toc[start : start + len(headings)]
        assert [t for _, t in shown] == [t for _, t in headings], rel  # every h1/h2, in the file's order
        assert all((i == gid or i.startswith(f"{gid}-")) and i in ids for i, _ in shown), shown
        article = _chapter(page, gid)
        assert f'<p class="source">Source: <code>{rel}</code>.' in article
        positions.append(page.index(f'<h1 id="{gid}"'))
    assert page.index(f'<h1 id="{result.chapters[-1]}"') < page.index('id="guides"') < positions[0]
    assert positions == sorted(positions)  # in GUIDES order


def test_links_between_guides_land_on_the_linked_article(site):
    result, page = site
    ids, followed = set(re.findall(r' id="([^"]+)"', page)), 0
    for rel in result.guides:
        article = _chapter(page, B.guide_id(rel))
        for link in _inline((ROOT / rel).read_text(encoding="utf-8"), "link_open"):
            path = link.attrGet("href").partition("#")[0]
            target = os.path.normpath(os.path.join(os.path.dirname(rel), path))
            if path and target in result.guides:
                hrefs = re.findall(r'<a href="#(' + re.escape(B.guide_id(target)) + r'[^"]*)">', article)
                assert hrefs and all(h in ids for h in hrefs), (rel, link.attrGet("href"))
                followed += 1
    assert followed >= 1  # docs/training.md links to faults.md
    assert not re.search(r'<a href="(?!#)', _guides(page))  # no link leaves the page


def test_dollars_in_guides_stay_text(site):
    """`$MULTI30K_URL`, `TEXT='Er zahlt $5 für $HOME'`: shell, not math; the guides are rendered without it."""
    result, page = site
    guides = _guides(page)
    assert "<math" not in guides
    shown = {html.unescape(c) for c in re.findall(r"<code>(.*?)</code>", guides, re.S)}
    spans = [
        c.content
        for rel in result.guides
        for c in _inline((ROOT / rel).read_text(encoding="utf-8"), "code_inline")
        if "$" in c.content
    ]
    assert len(spans) >= 3 and "$MULTI30K_URL" in spans
    assert [s for s in spans if s not in shown] == []  # each shown as written


GUIDE_A = """# Alpha `guide`

Costs `TEXT='Er zahlt $5'` and $x$ or $$y$$; see [b](b.md), [its part](b.md#part-two), [notes](../notes/README.md),
[home](../README.md), [web](https://example.org/), [the model](../annotated/transformer.py),
![a picture](https://example.org/p.png) and [top](#contents).

## Part two

```sh
echo "$HOME"
```
"""
GUIDE_B = '## Part two\n\nBack to [a](a.md "title").\n'
GUIDE_NOTES = "# Notes\n\nSee [a's part](../docs/a.md#part-two).\n"


@pytest.fixture(scope="module")
def guide_site(tmp_path_factory):
    """A repository with one module and three guides (one of four missing), built without figures."""
    root = tmp_path_factory.mktemp("repo")
    (root / "annotated").mkdir()
    shutil.copy(ROOT / "annotated" / "transformer.py", root / "annotated" / "transformer.py")
    for rel, text in (("docs/a.md", GUIDE_A), ("docs/b.md", GUIDE_B), ("notes/README.md", GUIDE_NOTES)):
        (root / rel).parent.mkdir(exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    result = B.build(
        root / "out",
        root=root,
        modules=("transformer",),
        with_figures=False,
        progress=False,
        guides=("docs/a.md", "docs/missing.md", "docs/b.md", "notes/README.md"),
    )
    return result, result.index.read_text(encoding="utf-8")


def test_guide_links_resolve_within_the_page_or_become_text(guide_site):
    result, page = guide_site
    assert result.guides == ["docs/a.md", "docs/b.md", "notes/README.md"]
    assert "docs/missing.md does not exist: its guide is missing." in result.notes and "missing" not in page
    toc = _toc(page)
    assert toc[toc.index(("guides", "Guides")) :] == [
        ("guides", "Guides"),
        ("guide-a", "Alpha guide"),
        ("guide-a-part-two", "Part two"),
        ("guide-b", "docs/b.md"),
        ("guide-b-part-two", "Part two"),  # no title: the file's name
        ("guide-notes", "Notes"),
    ]
    a, b, notes = (_chapter(page, i) for i in ("guide-a", "guide-b", "guide-notes"))
    for href, text in (
        ("guide-b", "b"),
        ("guide-b-part-two", "its part"),
        ("guide-notes", "notes"),
        ("transformer", "the model"),
        ("contents", "top"),
    ):
        assert f'<a href="#{href}">{text}</a>' in a
    assert '<a href="#guide-a">a</a>' in b and '<a href="#guide-a-part-two">a\'s part</a>' in notes
    prose = _text(a)
    for text in ("home", "web", "a picture"):  # not on the page: plain text
        assert text in prose and f">{text}</a>" not in a
    assert "<img" not in page and "example.org" not in page
    # $ is text in the guides, in code and out of it
    assert "<math" not in _guides(page) and "<code>TEXT='Er zahlt $5'</code>" in a and "$x$ or $$y$$" in prose
    assert '<pre class="highlight"><code>' in a and 'echo "$HOME"' in html.unescape(_text(a))
    ids = re.findall(r' id="([^"]+)"', page)
    assert len(ids) == len(set(ids)) and set(re.findall(r'href="#([^"]+)"', page)) <= set(ids)


@pytest.mark.skipif(CHROMIUM is None, reason="no `chromium` on PATH (.ci/run installs Debian's package)")
def test_guide_page_in_headless_chromium(guide_site, tmp_path):
    """A guide's web link and remote image stay off the network; every in-page link lands."""
    result, _ = guide_site
    report, requests, failed, _log, _ = browse(result.index, tmp_path)
    assert requests == [result.index.resolve().as_uri()] and not failed
    assert report["guides"] == ["guide-a", "guide-b", "guide-notes"]
    assert report["broken_links"] == [] and report["other_links"] == [] and report["images"] == []


def files_under(path: Path) -> dict:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_a_build_replaces_and_removes_only_its_own_files(tmp_path, monkeypatch, capsys):
    """Only what an earlier build recorded is removed; a file of the user's is never overwritten without
    --overwrite (the old rule removed every unknown figures/*.png and replaced any index.html)."""
    cheap = {f.name: f for f in F.FIGURES if f.name in ("subsequent_mask", "positional_encoding")}
    out = tmp_path / "site"
    (out / "figures").mkdir(parents=True)
    mine = {"figures/holiday.png": b"\x89PNG my picture", "notes.txt": b"my notes"}
    for name, data in mine.items():
        (out / name).write_bytes(data)
    kw = dict(
        modules=("transformer",), checkpoint=None, copy_steps=0, progress=False, say=lambda s: None, embeds={}
    )  # the viewer's file: test_the_viewer_file_is_the_builds_own
    monkeypatch.setattr(F, "FIGURES", tuple(cheap.values()))
    first = B.build(out, **kw)
    assert sorted(p.name for p in first.figures) == ["positional_encoding.png", "subsequent_mask.png"]
    monkeypatch.setattr(F, "FIGURES", (cheap["subsequent_mask"],))
    second = B.build(out, **kw)  # the page and its own figure replaced, the figure it no longer draws removed
    assert second.removed == [out / "figures" / "positional_encoding.png"]
    after = files_under(out)
    assert {k: after[k] for k in mine} == mine  # the user's files, byte for byte
    assert sorted(after) == [
        ".docs-build.json",
        "figures/holiday.png",
        "figures/subsequent_mask.png",
        "index.html",
        "notes.txt",
    ]

    theirs = tmp_path / "theirs"  # a folder with someone else's page
    theirs.mkdir()
    (theirs / "index.html").write_text("<h1>my home page</h1>")
    before = files_under(theirs)
    with pytest.raises(B.OutputError, match=r"index\.html exists and was not written by a docs build"):
        B.build(theirs, **kw)
    assert B.main(["--out", str(theirs), "--no-figures", "--checkpoint", "none"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("docs: error: ") and "--overwrite" in err and len(err.splitlines()) == 1
    assert files_under(theirs) == before  # untouched, nothing added
    B.build(theirs, overwrite=True, **kw)
    assert "my home page" not in (theirs / "index.html").read_text(encoding="utf-8")

    old = tmp_path / "old"  # a build's folder without a record: its page (with the builder's header) is ours
    shutil.copytree(out, old)
    (old / B.MANIFEST).unlink()
    B.build(old, **kw)
    assert files_under(old)["figures/holiday.png"] == mine["figures/holiday.png"]

    victim = tmp_path / "victim.txt"  # a record naming a file outside the folder removes nothing
    victim.write_text("keep")
    record = json.loads((theirs / B.MANIFEST).read_text())
    record["page"] += ["../victim.txt", "notes.txt"]
    (theirs / B.MANIFEST).write_text(json.dumps(record))
    (theirs / "notes.txt").write_text("mine")
    assert B.build(theirs, **kw).removed == []
    assert victim.read_text() == "keep" and (theirs / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize(
    "option, message",
    [
        (["--copy-steps", "-1"], "argument --copy-steps: must be a whole number >= 0, got '-1'"),
        (["--out", "/dev/null/site"], "argument --out: '/dev/null/site': /dev/null is not a folder"),
        (["--checkpoint", "{tmp}"], "checkpoint {tmp} is a directory; give the checkpoint file in it"),
        (["--checkpoint", "{tmp}/none.pt"], "checkpoint {tmp}/none.pt: no such file"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_bad_options_are_one_line_and_exit_2_before_any_work(option, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        B.main([o.format(tmp=tmp_path) for o in option])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"docs: error: {message.format(tmp=tmp_path)}")
    assert len(err.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_code_is_the_files_code_verbatim_in_source_order(site):
    """Every code cell is on the page, cut at blank lines into pieces that together are its lines, in order."""
    _, page = site
    chapter = _chapter(page, "transformer")
    blocks = re.findall(
        r'<div class="code" id="transformer-L(\d+)">.*?, lines (\d+)–(\d+)</a>(.*?)</pre>', chapter, flags=re.S
    )
    lines = (ROOT / "annotated" / "transformer.py").read_text(encoding="utf-8").split("\n")
    for anchor, first, last, block in blocks:
        assert anchor == first and _text(block).strip("\n") == "\n".join(lines[int(first) - 1 : int(last)]).strip("\n")
    shown = [(int(a), int(b)) for _, a, b, _ in blocks]
    cells = [c for c in B.read_cells(ROOT / "annotated" / "transformer.py") if c.kind == "code"]
    covered = [[(a, b) for a, b in shown if cell.line <= a and b <= cell.end] for cell in cells]
    assert sum(map(len, covered)) == len(shown) and len(cells) > 10  # each piece inside one cell
    for cell, pieces in zip(cells, covered):  # the pieces tile the cell, in order
        assert pieces[0][0] == cell.line and pieces[-1][1] == cell.end
        assert all(b + 1 == a for (_, b), (a, _) in zip(pieces, pieces[1:]))
    assert max(b - a + 1 for a, b in shown) < max(c.end - c.line + 1 for c in cells)  # long cells were cut
    texts = [_text(b) for *_, b in blocks]
    assert any("def attention_explicit" in t for t in texts) and 'if __name__ == "__main__":' in texts[-1]


def test_math_becomes_mathml_and_no_tex_is_left(site):
    _, page = site
    chapter = _chapter(page, "transformer")
    source = (ROOT / "annotated" / "transformer.py").read_text(encoding="utf-8")
    display = re.findall(r"\$\$(.+?)\$\$", source)  # every $$...$$ of the prose
    assert len(display) >= 5
    assert chapter.count("<math ") > len(display)  # the display formulas and the inline ones
    assert chapter.count('display="block"') == len(display)
    prose = re.sub(r'<math .*?</math>|<pre class="highlight">.*?</pre>', "", chapter, flags=re.S)
    assert "$$" not in prose and "\\frac" not in prose and "\\mathrm" not in prose


def test_latex_errors_name_the_file_and_line(tmp_path):
    (tmp_path / "annotated").mkdir()
    module = tmp_path / "annotated" / "transformer.py"
    for formula, complaint in ((r"\nosuch{x}", r"\nosuch"), (r"\frac{a}", "<mfrac> 1 arguments")):
        module.write_text(f"# %% [markdown]\n# # Title\n#\n# Broken: ${formula}$\n\n# %%\nx = 1\n", encoding="utf-8")
        with pytest.raises(B.DocsError, match=re.escape(f"annotated/transformer.py:4: the formula ${formula}$")) as e:
            B.build(tmp_path / "out", root=tmp_path, with_figures=False, progress=False)
        assert complaint in str(e.value)
        assert not (tmp_path / "out" / "index.html").exists()  # nothing half-written


def test_doctest_examples_render_as_highlighted_code_not_quotes(site):
    _, page = site
    chapter = _chapter(page, "transformer")
    source = (ROOT / "annotated" / "transformer.py").read_text(encoding="utf-8")
    prose_blocks = len(re.findall(r"(?m)^#$\n^# >>> ", source))  # doctest blocks in prose start after a blank
    assert prose_blocks >= 2
    opening = '<pre class="highlight"><code><span class="l"><span class="gp">&gt;&gt;&gt; </span>'
    assert chapter.count(opening) == prose_blocks
    assert "<blockquote>" not in chapter
    assert "&gt;&gt;&gt; d_k = 64" not in _text(chapter) and ">>> d_k = 64" in _text(chapter)
    assert '<span class="gp">&gt;&gt;&gt; </span>' in chapter  # Pygments' console prompt token


def test_figures_sit_after_the_prose_they_illustrate(site):
    result, page = site
    assert len(result.figures) == len(F.FIGURES)
    for fig in F.FIGURES:
        if fig.module == F.INTRODUCTION:  # in the book's introduction, before the contents and the parts
            intro = page[page.index('<section id="introduction">') : page.index("</section>")]
            assert result.placed[fig.name] == "introduction" and f'<figure id="fig-{fig.name}">' in intro
            continue
        if fig.module not in result.chapters:
            assert result.placed[fig.name] == "appendix"
            continue
        assert result.placed[fig.name] == fig.module
        chapter = _chapter(page, fig.module)
        at = chapter.index(f'<figure id="fig-{fig.name}">')
        if fig.at_end:  # end of the chapter: no heading after it
            assert not re.search(r"<h[1-3] ", chapter[at:])
            continue
        # the prose cites it (<!-- figure: name -->): it sits in the section of the citation, after its prose
        source = (ROOT / "annotated" / f"{fig.module}.py").read_text(encoding="utf-8")
        cited = source.index(f"# <!-- figure: {fig.name} -->")
        heading = re.findall(r"(?m)^# #+ (.*)$", source[:cited])[-1]
        headings = [(m.start(), _text(m.group(1))) for m in re.finditer(r"<h[1-3] [^>]*>(.*?)</h[1-3]>", chapter)]
        before = [text for pos, text in headings if pos < at]
        assert before and before[-1].rstrip(" ¶") == _text(B.make_markdown().renderInline(heading)), (
            fig.name,
            before[-1:],
            heading,
        )
        assert "<!-- figure" not in chapter and "&lt;!-- figure" not in chapter  # the citation shows nothing


def test_figure_files_are_pngs_of_the_stated_size(site):
    import matplotlib.image

    result, page = site
    for path in result.figures:
        pixels = matplotlib.image.imread(path)
        h, w = pixels.shape[:2]
        assert f'src="figures/{path.name}" width="{w}" height="{h}"' in page
        assert pixels[..., :3].std() > 0.05  # a drawing, not a blank canvas


def test_no_external_resources_and_every_local_one_exists(site):
    result, page = site

    class Refs(HTMLParser):
        def __init__(self):
            super().__init__()
            self.refs = []

        def handle_starttag(self, tag, attrs):
            for key, value in attrs:
                if key in ("src", "href", "srcset", "poster", "data", "action", "formaction"):
                    self.refs.append((tag, key, value))

    parser = Refs()
    parser.feed(page)
    assert parser.refs
    for tag, key, value in parser.refs:
        assert not re.match(r"^\s*([a-z][a-z0-9+.-]*:|//)", value, re.I), (tag, key, value)  # no scheme at all
        if not value.startswith("#"):
            assert (result.index.parent / value).is_file(), (tag, key, value)
    for tag in ("object", "embed", "link"):
        assert f"<{tag}" not in page
    # one script, the page's own (allowed by its hash): it fits the viewer's frame to the viewer's height
    assert page.count("<script") == 1 and re.findall(r"<script>(.*?)</script>", page, re.S) == [B.FIT_FRAMES]
    assert re.findall(r"<iframe [^>]*>", page) == [f'<iframe src="{F.VIEWER}" title="attention viewer">']
    styles = "".join(re.findall(r"<style>(.*?)</style>", page, re.S))
    assert "@import" not in styles and "url(" not in styles
    # the page's CSP forbids any fetch but its own images and frames of its own folder (the viewer)
    assert f'content="{B.CSP}{B.FRAMES}"' in page and "default-src 'none'" in B.CSP


def test_find_checkpoint_prefers_latest_then_newest(tmp_path):
    from annotated.shipped import shipped_model

    assert F.find_checkpoint(tmp_path) == shipped_model("de-en")  # no run: the model in the box
    older, newer = tmp_path / "runs" / "a" / "best.pt", tmp_path / "runs" / "b" / "best.pt"
    for i, p in enumerate((older, newer)):
        p.parent.mkdir(parents=True)
        p.write_bytes(b"x")
        os.utime(p, (1000 + i, 1000 + i))
    assert F.find_checkpoint(tmp_path) == newer
    (tmp_path / "runs" / "latest").symlink_to("a")
    assert F.find_checkpoint(tmp_path) == tmp_path / "runs" / "latest" / "best.pt"


def test_unusable_checkpoint_falls_back_only_when_found_automatically(tmp_path):
    bad = tmp_path / "runs" / "x" / "best.pt"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"not a checkpoint")
    (tmp_path / "annotated").mkdir()
    shutil.copy(ROOT / "annotated" / "transformer.py", tmp_path / "annotated" / "transformer.py")
    ctx = F.FigureContext(root=tmp_path, checkpoint=bad, copy_steps=0, say=lambda s: None)
    fig, caption = F.draw_attention(ctx)
    assert "copy-task model" in caption and str(bad) in ctx.notes[0]
    panels = _panels(fig)  # encoder self-attention and cross-attention, every head
    assert len(panels) == 2 * 4 and all(abs(p.sum(axis=1) - 1).max() < 1e-5 for p in panels)
    ctx = F.FigureContext(root=tmp_path, checkpoint=bad, copy_steps=0, checkpoint_required=True)
    with pytest.raises(ValueError, match=re.escape(str(bad))):
        F.draw_attention(ctx)


# ---------------------------------------------------------------- the browser

PAGE_REPORT = """(async () => {
  const images = [...document.images];
  await Promise.all(images.map(i => i.complete ? null : new Promise(r => { i.onload = i.onerror = r; })));
  const maths = [...document.querySelectorAll('math')];
  const laidOut = m => { const r = m.getBoundingClientRect(), d = getComputedStyle(m).display;
                         return r.width > 0 && r.height > 0 && ['math', 'inline math', 'block math'].includes(d); };
  const hrefs = [...document.querySelectorAll('a[href]')].map(a => a.getAttribute('href'));
  const frac = document.querySelector('math[display="block"] mfrac');
  return {
    title: document.title,
    images: images.map(i => ({src: i.getAttribute('src'), loaded: i.complete && i.naturalWidth > 0})),
    math: maths.length,
    mathml: maths.filter(m => m instanceof MathMLElement).length,
    laid_out: maths.filter(laidOut).length,
    fraction_stacked: frac ? frac.children[0].getBoundingClientRect().bottom
                             <= frac.children[1].getBoundingClientRect().top + 1 : null,
    internal_links: hrefs.filter(h => h.startsWith('#')).length,
    broken_links: hrefs.filter(h => h.startsWith('#') && !document.getElementById(decodeURIComponent(h.slice(1)))),
    other_links: hrefs.filter(h => !h.startsWith('#')),
    guides: [...document.querySelectorAll('article.guide > h1')].map(h => h.id),
  };
})()"""


def browse(index: Path, tmp: Path, width: int = 1000, height: int = 1300, scroll_to: str | None = None):
    """Open the page; returns (report from PAGE_REPORT, request URLs, failed loads, log entries, PNG bytes)."""
    browser = Chromium(CHROMIUM, tmp / "profile", tmp / "chromium.log")
    try:
        browser.open(index.resolve().as_uri(), width, height, domains=("Network", "Page", "Runtime", "Log"))
        report = browser.page("Runtime.evaluate", expression=PAGE_REPORT, awaitPromise=True, returnByValue=True)[
            "result"
        ]["value"]
        if scroll_to:
            browser.js(f"document.getElementById({scroll_to!r}).scrollIntoView()")
            time.sleep(0.3)
        png = base64.b64decode(browser.page("Page.captureScreenshot", format="png")["data"])
        failed = [e["params"] for e in browser.events if e.get("method") == "Network.loadingFailed"]
        log = [e["params"]["entry"] for e in browser.events if e.get("method") == "Log.entryAdded"]
        return report, browser.requests(), failed, log, png
    finally:
        browser.close()


@pytest.mark.skipif(CHROMIUM is None, reason="no `chromium` on PATH (.ci/run installs Debian's package)")
def test_page_in_headless_chromium(site, tmp_path):
    import matplotlib.image

    result, page = site
    report, requests, failed, log, png = browse(result.index, tmp_path)
    # the page, its figures and the viewer's frame, nothing else, all from disk
    assert requests[0] == result.index.resolve().as_uri()
    assert all(url.startswith("file://") for url in requests), requests
    assert sorted(requests[1:]) == sorted(
        p.resolve().as_uri() for p in result.figures + [result.index.parent / F.VIEWER]
    )
    assert not failed and not [entry for entry in log if entry["level"] == "error"], (failed, log)
    # every figure loaded
    assert len(report["images"]) == len(result.figures) and all(i["loaded"] for i in report["images"])
    # math present, parsed as MathML, laid out by the browser's MathML engine
    assert report["math"] == page.count("<math ") >= 20
    assert report["mathml"] == report["math"] and report["laid_out"] == report["math"]
    assert report["fraction_stacked"] is True  # numerator drawn above denominator: real math layout
    # internal links all land; there are no others
    assert report["internal_links"] > 50 and report["broken_links"] == [] and report["other_links"] == []
    assert report["guides"] == [B.guide_id(g) for g in result.guides] != []  # the guides, their links checked too
    assert report["title"] == B.TITLE
    # the screenshot shows something
    pixels = matplotlib.image.imread(io.BytesIO(png), format="png")
    assert pixels.shape[:2] == (1300, 1000)
    assert pixels[..., :3].std() > 0.05 and (pixels[..., :3] < 0.5).mean() > 0.005  # dark text on light


def _panels(fig):
    """The attention matrices drawn in a figure, one per panel."""
    return [ax.images[0].get_array() for ax in fig.axes if ax.images]


def tiny_run(tmp_path, sentence: str) -> Path:
    """runs/r1/best.pt (a 1-layer model with a tokenizer) and a results.json whose first sample is `sentence`."""
    from tiny import tiny_translator

    from annotated.checkpoint import save_checkpoint

    words = [
        "zwei",
        "junge",
        "männer",
        "spielen",
        "fußball",
        "auf",
        "einer",
        "wiese",
        "ein",
        "hund",
        "läuft",
        "durch",
        "das",
        "hohe",
        "gras",
        "eine",
        "frau",
        "liest",
        "ein",
        "buch",
        "im",
        "park",
        "kinder",
        "bauen",
        "eine",
        "sandburg",
        "am",
        "strand",
        "der",
        "mann",
        "fährt",
        "fahrrad",
    ]
    gen = torch.Generator().manual_seed(0)
    texts = [
        " ".join(words[i] for i in torch.randint(len(words), (6,), generator=gen)).capitalize() + "."
        for _ in range(300)
    ]
    model, tokenizer = tiny_translator(texts, 350, tmp_path / "cache", h=4, max_len=80, tied=False)
    run = tmp_path / "runs" / "r1"
    save_checkpoint(run / "best.pt", model, tokenizer, {"src_lang": "de", "tgt_lang": "en"})
    (run / "results.json").write_text(json.dumps({"samples": [{"source": sentence}]}), encoding="utf-8")
    return run / "best.pt"


def test_text_from_data_stays_text_in_the_caption(tmp_path):
    """A results.json sentence is data: no math (`$\\frac{$` once stopped the build), no remote image, no markup."""
    sentence = "Er zahlt $\\frac{$ für ![t](https://example.invalid/t.png) <b>*so*</b> & $x$."
    tiny_run(tmp_path, sentence)
    ctx = F.FigureContext(root=tmp_path, checkpoint=F.find_checkpoint(tmp_path), checkpoint_required=True)
    fig, caption = F.draw_attention(ctx)
    assert F.png_bytes(fig).startswith(b"\x89PNG")  # the `$` of the token labels is no mathtext either
    rendered = B.make_markdown().renderInline(caption)
    for markup in ("<math", "<img", "<b>", "<em>", "<a "):
        assert markup not in rendered
    assert f"“{sentence}”" in html.unescape(rendered)  # shown exactly as written


def test_attention_figure_from_a_checkpoint(tmp_path):
    from annotated.checkpoint import load_checkpoint

    sentence = "Zwei junge Männer spielen."
    _, tokenizer, _ = load_checkpoint(tiny_run(tmp_path, sentence))
    ctx = F.FigureContext(root=tmp_path, checkpoint=F.find_checkpoint(tmp_path), checkpoint_required=True)
    fig, caption = F.draw_attention(ctx)
    text = html.unescape(_text(B.make_markdown().renderInline(caption)))
    assert "r1/best.pt" in text and sentence in text and "de→en" in text
    panels = _panels(fig)
    assert len(panels) == 4  # every head of the last decoder layer
    for probs in panels:  # (target positions, source subwords), each row a distribution
        assert probs.shape[1] == len(tokenizer.encode(sentence))
        torch.testing.assert_close(torch.as_tensor(probs.sum(axis=1)), torch.ones(probs.shape[0], dtype=torch.float32))
    from docs import model_figures as M

    for draw in (M.draw_one_head, M.draw_architecture):  # the same translator, the same sentence
        fig, caption = draw(ctx)
        assert "r1/best.pt" in html.unescape(_text(B.make_markdown().renderInline(caption)))
        assert F.png_bytes(fig).startswith(b"\x89PNG")
    viewer = viewer_data(F.viewer_page(ctx))["sentences"][0]  # the viewer: the same translator and sentence
    assert viewer["source"] == sentence and viewer["src_tokens"] == ctx.shown_sentence().labels
    assert viewer["src_tokens"] == tokenizer.pieces(tokenizer.encode(sentence))  # subwords, not ids


# ---------------------------------------------------------------- the model's own figures


def test_block_matrix_numbers_are_the_modules():
    """Figure 1's panels: the fused heads are the per-head products, and both ends are the modules' outputs."""
    from docs import model_figures as M

    n = M.block_numbers()
    assert torch.equal(n.W_Q, torch.cat(n.W_Q_blocks, dim=1))  # W_Q = [W_Q[1] | ... | W_Q[h]]
    for i, W in enumerate(n.W_Q_blocks):
        assert W.shape == (n.per_head.d_model, n.per_head.d_k)  # a d_model x d_k rectangle
        torch.testing.assert_close(n.heads_q[i], n.X @ W)  # the view's head i is X W_Q[i]
    with torch.no_grad():
        torch.testing.assert_close(n.out, n.fused(n.X[None], n.X[None])[0])
        torch.testing.assert_close(n.out, n.per_head(n.X[None], n.X[None])[0])
    torch.testing.assert_close(n.terms.sum(0), n.out)  # Concat(heads) W_O = sum_i head_i W_O[i]


def test_one_head_figure_is_the_modules_head():
    """The figure's weights and weighted sum for each head are the module's, masked keys included."""
    from annotated.recording import attend_with_probabilities
    from annotated.sites import attention_at
    from docs import model_figures as M

    torch.manual_seed(0)
    model = transformer.make_model(
        src_vocab=11, tgt_vocab=11, N=2, d_model=16, d_ff=32, h=4, dropout=0.0, attention="per_head"
    ).eval()
    src = torch.tensor([[5, 6, 7, 8, 9, transformer.PAD]])  # the padding key must get no weight
    x, mask = M.attention_input(model, src)
    att = attention_at(model, "enc_self", 1)
    with torch.no_grad():
        out, p = attend_with_probabilities(att, x[None], x[None], mask)  # (1, T, d_model), (1, h, T, T)
        V = att.keys_values(x[None])[1]  # (1, h, T, d_v)
    query, total = 2, 0
    for i in range(att.h):
        n = M.one_head(att, x, mask, [str(t) for t in src[0].tolist()], query, i)
        torch.testing.assert_close(n.p, p[0, i, query])
        assert n.p[-1] == 0 and n.scores[-1] == float("-inf")
        torch.testing.assert_close(n.out, p[0, i, query] @ V[0, i])  # the head's output
        total = total + n.out @ att.W_O[i]
    torch.testing.assert_close(total + att.b_O, out[0, query])  # and the heads make the module's output


def test_attention_figure_labels_decoder_rows_by_the_predicted_token(tmp_path):
    from annotated.attention.dump import translate_sentence

    ctx = F.FigureContext(root=ROOT, checkpoint=None, copy_steps=0, cache_dir=tmp_path, say=lambda s: None)
    fig, caption = F.draw_attention(ctx)
    assert F.ROW_CONVENTION in caption
    shown = ctx.shown_sentence()
    tgt_in, out = F.decoded(shown.model, shown.src)
    assert out[0].tolist() == translate_sentence(shown.model, shown.src[0].tolist(), beam_size=4)  # the command's
    h = shown.model.config.h
    cross = [ax for ax in fig.axes if ax.images][h]  # the first cross-attention panel
    assert [t.get_text() for t in cross.get_yticklabels()] == shown.label(out[0].tolist())
    assert tgt_in[0, 0] == transformer.BOS and torch.equal(tgt_in[0, 1:], out[0, :-1])  # fed: <s> and all but the last


def test_each_highlighted_line_hangs_under_its_own_indent():
    """A piece that starts with blank lines (the lexer drops them) still gives every line its own indent: the
    `--i` of a line is that line's, not its neighbour's."""
    html_ = B.highlight_code('\n\ndef f():\n    """Doc.\n\n    >>> f()\n    """\n    return 1\n')
    lines = re.findall(r'<span class="l"( style="--i:(\d+)")?>(.*?)\n</span>', html_, re.S)
    text = [re.sub(r"<[^>]+>", "", body) for _, _, body in lines]
    indents = [int(i) if i else 0 for _, i, _ in lines]
    assert text[0].startswith("def f") and len(text) == 6
    assert indents == [len(t) - len(t.lstrip(" ")) if t.strip() else 0 for t in text] == [0, 4, 0, 4, 4, 4]


def test_logs_and_shell_are_not_highlighted_as_python(site):
    _, page = site
    guides = _guides(page)
    blocks = re.findall(r'<pre class="highlight"><code>(.*?)</code></pre>', guides, re.S)
    prompts = [b for b in blocks if "$ python -m annotated.decoding.translate" in html.unescape(_text(b))]
    logs = [b for b in blocks if "val BLEU" in _text(b)]
    assert prompts and logs
    assert all('class="gp"' in b for b in prompts)  # a console prompt, not an error
    assert all(re.search(r'class="(k|kn|nb|err)"', b) is None for b in logs)  # plain text: no Python keywords
    assert 'class="err"' not in guides


BOOK_REPORT = """(() => {
  const boxes = e => e.getBoundingClientRect();
  const codes = [...document.querySelectorAll('div.code')];
  const beside = codes.filter(c => { const p = c.parentElement.querySelector(':scope > .prose');
    if (!p || !p.textContent.trim()) return false;
    const a = boxes(p), b = boxes(c); return a.right <= b.left && a.top < b.bottom && b.top < a.bottom; });
  const first = document.querySelector('body h1');
  const intro = document.getElementById('introduction');
  const figures = ['architecture', 'block_matrices', 'one_head', 'attention'].map(n => {
    const f = document.getElementById('fig-' + n), img = f && f.querySelector('img'),
          cap = f && f.querySelector('figcaption');
    return {name: n, present: !!f, loaded: !!img && img.complete && img.naturalWidth > 0,
            caption: cap ? cap.textContent : ''}; });
  return {
    pres: document.querySelectorAll('pre').length,
    scrolling: [...document.querySelectorAll('pre')].filter(p => p.scrollWidth > p.clientWidth + 1)
                 .map(p => p.textContent.slice(0, 80)),
    page_wider: document.documentElement.scrollWidth > window.innerWidth,
    codes: codes.length, beside: beside.length,
    first_h1: first ? first.textContent : null,
    intro_top: intro ? boxes(intro).top : null, intro_text: intro ? intro.textContent : '',
    intro_figure: !!(intro && intro.querySelector('#fig-block_matrices')),
    figures,
  };
})()"""


def book_report(index: Path, tmp: Path, width: int):
    browser = Chromium(CHROMIUM, tmp / "profile", tmp / "chromium.log")
    try:
        browser.open(index.resolve().as_uri(), width, 1000, domains=("Network", "Page", "Runtime", "Log"))
        report = browser.js(BOOK_REPORT)
        log = [e["params"]["entry"] for e in browser.events if e.get("method") == "Log.entryAdded"]
        return report, log
    finally:
        browser.close()


@pytest.mark.skipif(CHROMIUM is None, reason="no `chromium` on PATH (.ci/run installs Debian's package)")
def test_the_book_at_1400_px(site, tmp_path):
    """Title and introduction first; prose beside code; no code block scrolls sideways; every figure captioned."""
    result, _ = site
    report, log = book_report(result.index, tmp_path, 1400)
    assert [e for e in log if e["level"] == "error"] == []
    assert report["first_h1"] == B.TITLE and report["intro_top"] < 300  # in the first screenful
    assert "per-head" in report["intro_text"] and "fused" in report["intro_text"] and report["intro_figure"]
    assert report["pres"] > 100 and report["scrolling"] == [] and not report["page_wider"]
    assert report["beside"] > 0.5 * report["codes"], (report["beside"], report["codes"])
    for fig in report["figures"]:
        assert fig["present"] and fig["loaded"] and len(fig["caption"]) > 100, fig
    captions = {f["name"]: f["caption"] for f in report["figures"]}
    assert "rows" in captions["block_matrices"] and "columns" in captions["block_matrices"]
    assert "Rows are the key positions" in captions["one_head"]
    assert F.ROW_CONVENTION in captions["attention"]


@pytest.mark.skipif(CHROMIUM is None, reason="no `chromium` on PATH (.ci/run installs Debian's package)")
def test_the_book_is_one_column_on_a_narrow_screen(site, tmp_path):
    result, _ = site
    report, _ = book_report(result.index, tmp_path, 700)
    assert report["beside"] == 0 and report["scrolling"] == [] and not report["page_wider"]


def test_an_embed_ends_its_chapter(tmp_path):
    """EMBEDS: an `Embed` whose function of the output folder and the figures' context returns the HTML that
    closes one chapter (the slot of the attention viewer); without figures no embed is made by default."""
    seen = []
    embed = B.Embed((), lambda out, ctx: seen.append((out, type(ctx))) or '<p id="embedded">the viewer</p>')
    kw = dict(modules=("transformer", "tokens"), with_figures=False, progress=False)
    result = B.build(tmp_path / "out", embeds={"transformer": embed}, **kw)
    page = result.index.read_text(encoding="utf-8")
    assert seen == [(tmp_path / "out", F.FigureContext)]
    chapter = _chapter(page, "transformer")
    assert chapter.rstrip().endswith('<div class="embed"><p id="embedded">the viewer</p></div>\n</article>')
    assert page.count('id="embedded"') == 1 and "frame-src" in page
    plain = B.build(tmp_path / "plain", **kw).index.read_text(encoding="utf-8")
    assert "<iframe" not in plain and "frame-src" not in plain and f'content="{B.CSP}"' in plain


def test_the_viewer_file_is_the_builds_own(tmp_path, monkeypatch):
    """viewer/index.html is recorded like the figures: a user's file there stops the build untouched; the
    build's own is replaced by the next build and removed by one that no longer embeds it."""
    monkeypatch.setattr(F, "FIGURES", ())
    kw = dict(modules=("transformer",), checkpoint=None, copy_steps=0, progress=False, say=lambda s: None)
    out, viewer = tmp_path / "site", tmp_path / "site" / F.VIEWER
    viewer.parent.mkdir(parents=True)
    viewer.write_text("my own page")
    with pytest.raises(B.OutputError, match=r"viewer/index\.html exists and was not written by a docs build"):
        B.build(out, **kw)
    assert viewer.read_text() == "my own page" and not (out / "index.html").exists()
    viewer.unlink()
    B.build(out, **kw)
    assert F.VIEWER in json.loads((out / B.MANIFEST).read_text())["page"]
    first = viewer.read_text(encoding="utf-8")
    assert 'id="attention-data"' in first and '<body class="embedded">' in first
    assert B.build(out, **kw).removed == [] and viewer.read_text(encoding="utf-8") == first  # replaced
    assert B.build(out, embeds={}, **kw).removed == [viewer] and not viewer.exists()


def viewer_data(page: str) -> dict:
    """The data a viewer page carries (its JSON script element)."""
    return json.loads(
        re.search(r'<script type="application/json" id="attention-data">(.*?)</script>', page, re.S).group(1)
    )


def test_the_viewer_shows_the_figures_model_and_sentence(tmp_path):
    """The copy task: its symbols are the labels, source as in the figure, rows what the model predicts."""
    from annotated.attention.dump import translate_sentence

    ctx = F.FigureContext(root=ROOT, checkpoint=None, copy_steps=0, cache_dir=tmp_path, say=lambda s: None)
    data = viewer_data(F.viewer_page(ctx))
    shown = ctx.shown_sentence()
    sentence = data["sentences"][0]
    assert sentence["src_tokens"] == shown.labels == [str(t) for t in shown.src[0].tolist()]
    predicted = translate_sentence(shown.model, shown.src[0].tolist(), beam_size=4)  # beam 4, as make translate
    assert sentence["tgt_out_tokens"] == shown.label(predicted)
    assert sentence["tgt_in_tokens"] == ["<s>"] + shown.label(predicted[:-1])
    assert data["start"] == f"s=0&kind=cross&layer={shown.model.config.N - 1}&head=mean&view=head"
    assert [p.name[:7] for p in tmp_path.iterdir()] == ["copy-0-"]  # the cached model; no dump left behind


VIEWER_REPORT = """[document.body.dataset.rendered || '', document.body.className,
  [...document.querySelectorAll('th.row')].map(t => t.textContent),
  [...document.querySelectorAll('th.col')].map(t => t.textContent),
  (() => { const r = document.querySelector('table.heat'); return r ? r.getBoundingClientRect().width : 0; })()]"""


def embedded_viewer(browser: Chromium, rendered: str, timeout: float = 20) -> list:
    """VIEWER_REPORT from inside the page's one frame, once its viewer shows `rendered`."""
    frames = browser.page("Page.getFrameTree")["frameTree"].get("childFrames", [])
    assert len(frames) == 1, frames
    world = browser.page("Page.createIsolatedWorld", frameId=frames[0]["frame"]["id"])["executionContextId"]
    deadline, report = time.time() + timeout, None
    while time.time() < deadline:
        report = browser.page("Runtime.evaluate", expression=VIEWER_REPORT, contextId=world, returnByValue=True)[
            "result"
        ]["value"]
        if report[0] == rendered:
            return report
        time.sleep(0.05)
    raise TimeoutError(f"the embedded viewer never showed {rendered}: {report}")


@pytest.mark.skipif(CHROMIUM is None, reason="no `chromium` on PATH (.ci/run installs Debian's package)")
def test_the_viewer_is_embedded_at_the_end_of_the_chapter(site, tmp_path):
    """At 1400 px the chapter ends with the viewer in a frame: it loads, shows the head view of the last
    decoder layer's cross-attention with every token labelled, and nothing logs an error."""
    result, page = site
    chapter = _chapter(page, "transformer")
    end = chapter[chapter.rindex('<div class="embed">') :]
    assert f'<iframe src="{F.VIEWER}"' in end and end.rstrip().endswith("</figure></div>\n</article>")
    caption = html.unescape(_text(end))
    assert F.ROW_CONVENTION in caption and "each row sums to 1" in caption and "copy-task model" in caption
    ctx = F.FigureContext(
        root=ROOT, checkpoint=None, copy_steps=COPY_STEPS, cache_dir=result.index.parent / ".cache", say=lambda s: None
    )
    expected = viewer_data((result.index.parent / F.VIEWER).read_text(encoding="utf-8"))["sentences"][0]
    assert expected["src_tokens"] == ctx.shown_sentence().labels  # the figure's model and sentence
    browser = Chromium(CHROMIUM, tmp_path / "profile", tmp_path / "chromium.log")
    try:
        browser.open(result.index.resolve().as_uri(), 1400, 1000, domains=("Network", "Page", "Runtime", "Log"))
        browser.js("document.getElementById('viewer').scrollIntoView()")
        last = ctx.shown_sentence().model.config.N - 1
        _rendered, body, rows, cols, heat = embedded_viewer(browser, f"0/cross/{last}/mean")
        assert body == "embedded" and rows == expected["tgt_out_tokens"] and cols == expected["src_tokens"]
        frame = browser.js(
            "(() => { const r = document.querySelector('#viewer iframe').getBoundingClientRect();"
            " return [r.width, r.height]; })()"
        )
        assert frame[0] >= 0.6 * 1400 and frame[1] >= 150 and heat >= 0.5 * frame[0], (frame, heat)
        # the frame is as tall as the view it shows: nothing cut off, no scrolling inside; it grows with the view
        for view, rendered in (("head", f"0/cross/{last}/mean"), ("model", "0/model")):
            frames = browser.page("Page.getFrameTree")["frameTree"]["childFrames"]
            world = browser.page("Page.createIsolatedWorld", frameId=frames[0]["frame"]["id"])["executionContextId"]
            browser.page(
                "Runtime.evaluate",
                contextId=world,
                expression=f"location.hash = 's=0&kind=cross&layer={last}&head=mean&view={view}'",
            )
            embedded_viewer(browser, rendered)
            deadline, inner, outer = time.time() + 20, None, None
            while time.time() < deadline:
                inner = browser.page(
                    "Runtime.evaluate",
                    contextId=world,
                    returnByValue=True,
                    expression="document.documentElement.scrollHeight",
                )["result"]["value"]
                outer = browser.js("document.querySelector('#viewer iframe').clientHeight")
                if abs(outer - inner) <= 4:
                    break
                time.sleep(0.1)
            assert abs(outer - inner) <= 4, (view, outer, inner)
            sizes = getattr(browser, "sizes", {}) | {view: outer}
            browser.sizes = sizes
        assert browser.sizes["model"] > browser.sizes["head"] + 100, browser.sizes
        errors = [
            e["params"]
            for e in browser.events
            if e["method"] in ("Runtime.exceptionThrown", "Network.loadingFailed")
            or (e["method"] == "Runtime.consoleAPICalled" and e["params"]["type"] in ("error", "warning"))
            or (e["method"] == "Log.entryAdded" and e["params"]["entry"]["level"] in ("error", "warning"))
        ]
        assert errors == []
    finally:
        browser.close()


FORMULAS = """(() => [...document.querySelectorAll('div.math')].map(d => {
  const m = d.querySelector('math'), col = d.closest('.prose') || d.parentElement;
  return [m.getAttribute('alttext').slice(0, 50), m.getBoundingClientRect().width, m.scrollWidth,
          d.scrollWidth, d.clientWidth, col.getBoundingClientRect().width]; }))()"""


@pytest.mark.skipif(CHROMIUM is None, reason="no `chromium` on PATH (.ci/run installs Debian's package)")
@pytest.mark.parametrize("width", [1400, 800])
def test_no_display_formula_is_wider_than_its_column(site, tmp_path, width):
    """Every display formula fits its prose column whole (long ones are set one equation, one `=`, a line),
    so none is cut or needs scrolling at 1400 px (beside the code) or 800 px (one column)."""
    result, _ = site
    browser = Chromium(CHROMIUM, tmp_path / "profile", tmp_path / "chromium.log")
    try:
        browser.open(result.index.resolve().as_uri(), width, 1000, domains=("Page", "Runtime"))
        formulas = browser.js(FORMULAS)
    finally:
        browser.close()
    assert len(formulas) >= 15
    too_wide = [f for f in formulas if max(f[1], f[2], f[3]) > min(f[4], f[5]) + 1]
    assert too_wide == []
    assert any(f[0].startswith("\\mathrm{MultiHead}(Q, K, V) = \\mathrm{Concat}") for f in formulas)


def test_long_formulas_are_set_one_equation_and_one_equals_sign_a_line():
    multihead = (
        r"\mathrm{MultiHead}(Q, K, V) = \mathrm{Concat}(\mathrm{head}_0, \dots, \mathrm{head}_{h-1})\, W_O"
        r" = \sum_i \mathrm{head}_i\, W_O^{(i)}"
    )
    assert B.formula_lines(multihead) == [
        multihead[: multihead.rindex(" = ")],
        multihead[multihead.rindex(" = ") + 1 :],
    ]
    pe = r"PE_{(pos, 2i)} = \sin(pos / 10000^{2i/d_{model}}),\quad PE_{(pos, 2i+1)} = \cos(pos / 10000^{2i/d_{model}})"
    assert B.formula_lines(pe) == [pe[: pe.index(r"\quad")], pe[pe.index(r"\quad") + len(r"\quad") + 1 :]]
    assert B.formula_lines(r"\mathrm{head}_i = \mathrm{Attention}(Q W_Q^{(i)},\ K W_K^{(i)},\ V W_V^{(i)})") == [
        r"\mathrm{head}_i = \mathrm{Attention}(Q W_Q^{(i)},\ K W_K^{(i)},\ V W_V^{(i)})"
    ]  # short: one line
    nested = (
        r"f(\{a = b, c = d\}) = \frac{x = 1}{y} = z + \sum_{i=1}^{h} \mathrm{head}_i\, W_O^{(i)} w"
        r" + \mathrm{Concat}(u, v, w, x, y)"
    )  # an `=` inside braces or \{ \} is no line's start
    assert B.visible_length(nested) > B.FORMULA_CHARS
    assert B.formula_lines(nested) == [nested[: nested.index(" = z")], nested[nested.index(" = z") + 1 :]]
    html_ = B.display_mathml(multihead)  # one <math> element, a table of two lines, the whole TeX as its alttext
    assert html_.count("<math ") == 1 and html_.count("<mtr>") == 2 and 'class="cont"' in html_


WRAPS = """(() => {
  const lines = [...document.querySelectorAll('#transformer pre .l, article.chapter pre .l')];
  const out = [];
  for (const l of lines) {
    const rects = [...l.getClientRects()];
    if (rects.length !== 1) continue;
    const range = document.createRange(); range.selectNodeContents(l);
    const boxes = [...range.getClientRects()].filter(r => r.width > 0);
    const tops = [...new Set(boxes.map(r => Math.round(r.top)))];
    if (tops.length < 2) continue;  // not wrapped
    const text = l.textContent, indent = text.length - text.trimStart().length;
    const first = boxes.filter(r => Math.round(r.top) === tops[0]);
    const rest = boxes.filter(r => Math.round(r.top) !== tops[0]);
    const ch = (() => { const s = document.createElement('span'); s.textContent = 'x'; l.appendChild(s);
                        const w = s.getBoundingClientRect().width; s.remove(); return w; })();
    const lineLeft = l.getBoundingClientRect().left + parseFloat(getComputedStyle(l).paddingLeft)
                     + parseFloat(getComputedStyle(l).textIndent);
    out.push({text: text.slice(0, 60), indent, ch, lineLeft,
              cont: Math.min(...rest.map(r => r.left)) - lineLeft});
    if (out.length >= 200) break;
  }
  return out;
})()"""


@pytest.mark.skipif(CHROMIUM is None, reason="no `chromium` on PATH (.ci/run installs Debian's package)")
def test_a_wrapped_code_line_continues_deeper_than_its_own_indent(site, tmp_path):
    """At 800 px many long code lines wrap; each continues at least two characters deeper than the line's own
    indent, so a continuation never reads as a statement of an outer block."""
    result, _ = site
    browser = Chromium(CHROMIUM, tmp_path / "profile", tmp_path / "chromium.log")
    try:
        browser.open(result.index.resolve().as_uri(), 800, 1000, domains=("Page", "Runtime"))
        wraps = browser.js(WRAPS)
    finally:
        browser.close()
    assert len(wraps) >= 20, len(wraps)
    assert any(w["indent"] >= 8 for w in wraps)
    shallow = [w for w in wraps if w["cont"] < (w["indent"] + 2) * w["ch"] - 1]
    assert shallow == [], shallow[:3]


def test_prose_sits_beside_the_code_it_names(site):
    """Section 3's prose on `PerHeadAttention` sits in the row of the class, not beside the helpers before it,
    and its prose on `_Attention` in the row of `_Attention`, not below it;
    the section's opening (its heading and formulas) stays at the top, beside the first piece."""
    _, page = site
    chapter = _chapter(page, "transformer")
    rows = re.findall(
        r'<div class="row[^"]*"><div class="prose">\n(.*?)</div><div class="code" id="[^"]+">'
        r'.*?<pre class="highlight"><code>(.*?)</code></pre>',
        chapter,
        re.S,
    )
    [(prose, _)] = [(p, c) for p, c in rows if "class PerHeadAttention" in _text(c)]
    assert _text(prose).strip().startswith("PerHeadAttention stores exactly the 4h rectangular matrices")
    # the interface's prose beside the interface, not beside the class after it
    [(prose, _)] = [(p, c) for p, c in rows if "class _Attention" in _text(c)]
    assert _text(prose).strip().startswith("One interface, two implementations. _Attention is what every")
    [(opening, code)] = [(p, c) for p, c in rows if "3. Multi-head attention, one head at a time" in _text(p)]
    assert "def _head_sizes" in _text(code) and "PerHeadAttention stores" not in _text(opening)
    assert "<!--mentions" not in page


@pytest.mark.skipif(CHROMIUM is None, reason="no `chromium` on PATH (.ci/run installs Debian's package)")
def test_no_table_scrolls_sideways_at_800_px(site, tmp_path):
    """The guides' tables (the benchmarks' nine columns among them) fit the column at 800 px."""
    result, _ = site
    browser = Chromium(CHROMIUM, tmp_path / "profile", tmp_path / "chromium.log")
    try:
        browser.open(result.index.resolve().as_uri(), 800, 1000, domains=("Page", "Runtime"))
        tables = browser.js(
            "[...document.querySelectorAll('table')].map(t => [t.textContent.slice(0, 60), "
            "t.scrollWidth, t.clientWidth, t.getBoundingClientRect().right])"
        )
        page_width = browser.js("document.documentElement.clientWidth")
    finally:
        browser.close()
    assert len(tables) >= 10 and any("step peak MiB" in t[0] or "implementation" in t[0] for t in tables)
    assert [t for t in tables if t[1] > t[2] + 1 or t[3] > page_width] == []


def test_reading_figure_rows_sum_to_one():
    """The hand-written patterns of "How to read the pictures" are attention: rows sum to 1, masked cells 0."""
    import numpy as np

    panels = F.reading_panels()
    assert len(panels) == 5
    for title, weights, rows, cols, causal in panels:
        assert weights.shape == (len(rows), len(cols)), title
        np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-12)
        if causal:
            assert (np.triu(weights, 1) == 0).all()
    _fig, caption = F.draw_reading(None)
    assert "written by hand" in caption and "not taken from a model" in caption


def test_the_copy_caption_says_whether_the_copy_is_right():
    assert F.copy_verdict([5, 6, transformer.EOS], [5, 6]) == "Its output copies the source exactly."
    wrong = F.copy_verdict([5, 7, transformer.EOS], [5, 6])
    assert "wrong copy" in wrong and "position 1" in wrong


def test_figures_count_heads_and_positions_from_zero(tmp_path):
    """One convention everywhere: the figures say head 0 for the head of W_Q[0], as the code and the viewer do."""
    ctx = F.FigureContext(root=ROOT, checkpoint=None, copy_steps=0, cache_dir=tmp_path, say=lambda s: None)
    fig, _ = F.draw_attention(ctx)
    titles = [ax.get_title() for ax in fig.axes if ax.images]
    assert "encoder, head 0" in titles and "cross, head 0" in titles
    h = ctx.shown_sentence().model.config.h
    assert f"cross, head {h}" not in titles
    drawing = M.draw_block_matrices(ctx)[0]
    texts = [t.get_text() for t in drawing.texts] + [
        t.get_text() for ax in drawing.axes for t in [ax.title, *ax.texts, ax.xaxis.label, ax.yaxis.label]
    ]
    assert any("W_Q[0]" in t for t in texts) and not any("W_Q[3]" in t for t in texts)  # h = 3 there
    assert "counted from 0" in B.INTRODUCTION


def test_one_head_figure_keeps_its_numbers_clear_of_the_bars(tmp_path):
    """Figure 4: no text (a score, a weight, a title, a token) overlaps a bar of the q·k or softmax panel, and
    every label is set in at least M.ONE_HEAD_FONT points."""
    import matplotlib.text
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    ctx = F.FigureContext(root=ROOT, checkpoint=None, copy_steps=0, cache_dir=tmp_path, say=lambda s: None)
    fig, _ = M.draw_one_head(ctx)
    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    texts = [t for t in fig.findobj(matplotlib.text.Text) if t.get_visible() and t.get_text().strip()]
    assert min(t.get_fontsize() for t in texts) >= M.ONE_HEAD_FONT
    bars = [p.get_window_extent(renderer) for ax in fig.axes for p in ax.patches if p.get_width()]
    assert len(bars) >= 2 * ctx.shown_sentence().src.shape[1] - 2  # the scores' bars and the weights'
    drawn = [(t.get_text(), t.get_window_extent(renderer)) for t in texts]
    over = [(s, b) for s, box in drawn for b in bars if b.width > 0.5 and box.overlaps(b)]
    assert over == [], over


@pytest.mark.skipif(CHROMIUM is None, reason="no `chromium` on PATH (.ci/run installs Debian's package)")
@pytest.mark.parametrize("width", [1000, 1400])
def test_one_head_figure_is_readable_at_1000_px(site, tmp_path, width):
    """Figure 4 is shown at (nearly) its own size at 1000 and 1400 px: its smallest label, M.ONE_HEAD_FONT points
    at F.DPI, is at least 9 CSS pixels on the page (it was about 5 when the 1,217 px picture shrank to 735)."""
    result, _ = site
    browser = Chromium(CHROMIUM, tmp_path / "profile", tmp_path / "chromium.log")
    try:
        browser.open(result.index.resolve().as_uri(), width, 1000, domains=("Page",))
        shown, natural = browser.js(
            "(() => { const i = document.querySelector('#fig-one_head img');"
            " return [i.getBoundingClientRect().width, i.naturalWidth]; })()"
        )
    finally:
        browser.close()
    assert natural > 0
    label_px = M.ONE_HEAD_FONT * F.DPI / 72 * shown / natural
    assert label_px >= 9, (shown, natural, label_px)


@pytest.mark.skipif(CHROMIUM is None, reason="no `chromium` on PATH (.ci/run installs Debian's package)")
def test_make_screenshots_writes_every_picture_into_its_folder(site, tmp_path):
    """`make screenshots` (docs/screenshots.py) photographs a built book and a dump of the shipped model: one
    1400 px PNG per name, into the folder it is given, and nothing else beside it."""
    import matplotlib.image

    from docs import screenshots as S

    result, _ = site
    written = S.make_screenshots(tmp_path / "shots", say=lambda line: None, book=result.index)
    assert sorted(p.name for p in written) == sorted([*S.BOOK_SHOTS, "viewer.png"])
    for path in written:
        pixels = matplotlib.image.imread(path)
        assert pixels.shape[1] == S.WIDTH and pixels[..., :3].std() > 0.05, path  # a page, not a blank
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shots"]  # the book, the dump: temporary, gone
