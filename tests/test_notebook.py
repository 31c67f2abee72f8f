"""`make notebook` (docs/notebook.py): the chapter as a notebook that runs top to bottom and shows its work."""
from __future__ import annotations

import base64
import doctest
import io
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")  # installed with jupytext
from docs import build as B  # noqa: E402
from docs import notebook as NB  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    path = B.build_notebook("transformer", tmp_path_factory.mktemp("nb"))
    return nbformat.read(path, as_version=4)


def test_the_chapter_cells_are_all_there_verbatim_and_in_order(built):
    import jupytext

    chapter = jupytext.read(ROOT / "annotated" / "transformer.py", fmt="py:percent").cells
    ours = iter(c for c in built.cells if not c.metadata.get("tags"))
    for cell in chapter:
        mine = next(ours)
        assert (mine.cell_type, mine.source) == (cell.cell_type, cell.source)
    assert next(ours, None) is None


def test_every_prose_example_runs_and_shows_the_result_its_doctest_checks(built):
    shown = 0
    for i, cell in enumerate(built.cells):
        if cell.cell_type != "markdown":
            continue
        wants = [ex.want.strip() for ex in doctest.DocTestParser().get_examples(cell.source)
                 if ex.want.strip() and "..." not in ex.want]
        examples = []
        for nxt in built.cells[i + 1:]:
            if "example" not in nxt.metadata.get("tags", []):
                break
            examples.append(nxt)
        outputs = []
        for ex in examples:
            for out in ex.outputs:
                outputs.append(out["text"] if out["output_type"] == "stream" else out["data"]["text/plain"])
        assert [o.strip() for o in outputs] == wants, cell.source.splitlines()[0]
        shown += len(wants)
    assert shown >= 3, "the chapter's prose examples did not reach the notebook"


def test_the_figures_are_drawn_inline(built):
    import matplotlib.image

    figures = [c for c in built.cells if "figure" in c.metadata.get("tags", [])]
    assert len(figures) == len(NB.FIGURES)
    for cell in figures:
        pngs = [o["data"]["image/png"] for o in cell.outputs if o["output_type"] == "display_data"]
        assert pngs, cell.source.splitlines()[0]
        pixels = matplotlib.image.imread(io.BytesIO(base64.b64decode(pngs[0])), format="png")
        assert pixels[..., :3].std() > 0.05  # not a blank image


def test_the_copy_model_figure_shows_a_model_that_copies(built):
    [cell] = [c for c in built.cells if "figure" in c.metadata.get("tags", []) and "copy" in c.source]
    [text] = [o["text"] for o in cell.outputs if o["output_type"] == "stream"]
    source, output = text.split("source:")[1].split("output:")
    assert eval(output)[:-1] == eval(source)  # the sequence copied, then eos


def test_a_failing_cell_stops_the_build_naming_it():
    cells = [nbformat.v4.new_code_cell("x = 1"), nbformat.v4.new_code_cell("1 / 0")]
    with pytest.raises(NB.CellError, match=r"notebook cell 2 failed: ZeroDivisionError"):
        NB.execute(cells, "failing_notebook")
    assert cells[0].outputs == []
