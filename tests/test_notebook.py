"""`make notebook` (docs/notebook.py): the chapter as a notebook that runs top to bottom and shows its work."""

from __future__ import annotations

import base64
import doctest
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

nbformat = pytest.importorskip("nbformat")  # installed with jupytext
from docs import build as B  # noqa: E402 only once nbformat is known to be installed
from docs import notebook as NB  # noqa: E402 only once nbformat is known to be installed

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    path = B.build_notebook("transformer", tmp_path_factory.mktemp("nb"))
    return nbformat.read(path, as_version=4)


def test_the_chapter_cells_are_all_there_verbatim_and_in_order_but_the_command(built):
    import jupytext

    chapter = jupytext.read(ROOT / "annotated" / "transformer.py", fmt="py:percent").cells
    commands = [c for c in chapter if c.cell_type == "code" and 'if __name__ == "__main__":' in c.source]
    assert len(commands) == 1  # the chapter has its command: leaving it out is a real choice
    ours = iter(c for c in built.cells if not c.metadata.get("tags"))
    for cell in chapter:
        mine = next(ours)
        assert mine.cell_type == cell.cell_type
        if cell is commands[0]:  # everything before the command, verbatim
            head = cell.source[: cell.source.index('if __name__ == "__main__":')].rstrip()
            assert mine.source == head
        else:
            assert mine.source == cell.source
    assert next(ours, None) is None
    assert not [c for c in built.cells if c.cell_type == "code" and "__main__" in c.source]  # Run All trains nothing
    [note] = [c for c in built.cells if "note" in c.metadata.get("tags", [])]
    assert "make copy" in note.source and note.cell_type == "markdown"


def test_at_least_ten_code_cells_show_outputs(built):
    shown = [c for c in built.cells if c.cell_type == "code" and c.outputs]
    assert len(shown) >= 10, len(shown)
    assert all(c.execution_count for c in built.cells if c.cell_type == "code")  # every code cell ran, in order


def test_every_prose_example_runs_and_shows_the_result_its_doctest_checks(built):
    shown = 0
    for i, cell in enumerate(built.cells):
        if cell.cell_type != "markdown":
            continue
        wants = [
            ex.want.strip()
            for ex in doctest.DocTestParser().get_examples(cell.source)
            if ex.want.strip() and "..." not in ex.want
        ]
        examples = []
        for nxt in built.cells[i + 1 :]:
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
    assert len(figures) == len(NB.FIGURES) == 5  # scaling, masks, positional encoding, learning rate, copy attention
    assert any("rate(" in c.source for c in figures)
    for cell in figures:
        pngs = [o["data"]["image/png"] for o in cell.outputs if o["output_type"] == "display_data"]
        assert pngs, cell.source.splitlines()[0]
        pixels = matplotlib.image.imread(io.BytesIO(base64.b64decode(pngs[0])), format="png")
        assert pixels[..., :3].std() > 0.05  # not a blank image


def colour_bar_columns(pixels: np.ndarray, table: np.ndarray) -> list[int]:
    """The x of every pixel column that holds a colour bar of `table`: a run of at least 40 pixels whose
    colours are the table's (within 0.03) and run smoothly (steps of at most 3% of the map, never back up)
    from its top end (>= 95%) down to its bottom (<= 5%): a heatmap's cells jump, a bar does not."""
    found = []
    for x in range(pixels.shape[1]):
        column = pixels[:, x, :3]  # (H, 3)
        dist = np.linalg.norm(column[:, None, :] - table[None, :, :3], axis=-1)  # (H, n)
        idx = np.where(dist.min(1) < 0.03, dist.argmin(1) / (len(table) - 1), np.nan)  # (H,) position in the map
        start = None
        for y in range(len(idx) + 1):
            inside = y < len(idx) and not np.isnan(idx[y])
            if inside and start is None:
                start = y
            elif not inside and start is not None:
                run = idx[start:y]
                steps = np.diff(run)
                if (
                    y - start >= 40
                    and run[0] >= 0.95
                    and run[-1] <= 0.05
                    and ((steps >= -0.03) & (steps <= 0.005)).all()
                ):
                    found.append(x)
                start = None
    return found


def figure_pixels(cell) -> np.ndarray:
    import matplotlib.image

    [png] = [o["data"]["image/png"] for o in cell.outputs if o["output_type"] == "display_data"]
    return matplotlib.image.imread(io.BytesIO(base64.b64decode(png)), format="png")


def test_the_copy_attention_figure_has_the_pictures_colour_map_and_bar(built):
    import matplotlib

    from annotated.attention.pictures import CMAP

    [cell] = [c for c in built.cells if "figure" in c.metadata.get("tags", []) and "copy_model" in c.source]
    table = matplotlib.colormaps[CMAP].resampled(256)(np.arange(256))  # (256, 4)
    assert colour_bar_columns(figure_pixels(cell), table), "no colour bar of CMAP from 1 (top) to 0 (bottom)"
    [masks] = [c for c in built.cells if "figure" in c.metadata.get("tags", []) and "target_mask" in c.source]
    assert not colour_bar_columns(figure_pixels(masks), table)  # the check can fail: no bar there


def test_the_try_it_cells_show_what_their_comments_say(built):
    tries = {c.source.splitlines()[0]: c for c in built.cells if "try" in c.metadata.get("tags", [])}
    assert len(tries) == len(NB.TRIES) == 5

    def shown(word):
        [cell] = [c for first, c in tries.items() if word in first]
        [out] = cell.outputs
        return out["text"] if out["output_type"] == "stream" else out["data"]["text/plain"]

    assert shown("PerHeadAttention") == "((2, 5, 16), 4)"
    assert float(shown("fused conversion").split(":")[1]) < 1e-12  # the same function, to rounding
    assert shown("small model").endswith("(1, 3, 11))")
    from annotated.tokens import EOS

    decoded = eval(shown("greedy decoding").removeprefix("tensor(").removesuffix(")"))[0]
    assert decoded[:5] != [3, 4, 5, 6, EOS]  # untrained: no copy
    assert float(shown("exact-match accuracy")) >= 0.9  # the figure's copy model copies


def test_the_copy_model_figure_shows_a_model_that_copies(built):
    [cell] = [c for c in built.cells if "figure" in c.metadata.get("tags", []) and "copy" in c.source]
    text = "".join(o["text"] for o in cell.outputs if o["output_type"] == "stream")
    first, verdict = text.splitlines()
    source, output = first.split("source:")[1].split("output:")
    assert eval(output)[:-1] == eval(source)  # the sequence copied, then eos
    assert verdict == "the output is a correct copy"


def test_the_copy_figure_says_when_the_copy_is_wrong():
    """The figure's cell says "a WRONG copy" when the output is not the source: run on an untrained model."""
    import contextlib
    import io as _io

    import matplotlib

    matplotlib.use("Agg")
    import torch

    from annotated import transformer

    [code] = [c for _, c in NB.FIGURES if "copy_model" in c]
    code = code.replace('train_copy_task("fused", steps=400)', 'train_copy_task("fused", steps=0)')
    namespace = {name: getattr(transformer, name) for name in dir(transformer) if not name.startswith("__")}
    namespace["torch"] = torch
    out = _io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(code, namespace)
    assert out.getvalue().splitlines()[-1].startswith("the output is a WRONG copy")


def test_a_failing_cell_stops_the_build_naming_it():
    """Executed by nbclient in a real kernel: the cells before the failure ran, the error names the cell."""
    cells = [nbformat.v4.new_code_cell("x = 1"), nbformat.v4.new_code_cell("x + 1"), nbformat.v4.new_code_cell("1 / 0")]
    with pytest.raises(NB.CellError, match=r"notebook cell 3 failed: ZeroDivisionError"):
        NB.execute(cells, "failing_notebook")
    assert cells[0].outputs == [] and cells[1].outputs[0]["data"]["text/plain"] == "2"


def test_the_setup_cell_finds_the_checkout_it_sits_in(built, tmp_path):
    """The notebook carries no path of the machine that built it. Run from a folder inside the checkout (and
    without PYTHONPATH), the setup cell lets the chapter's `from annotated.tokens import ...` work; from a
    folder outside any checkout it stops with the fix; it comes after the title, before the first code."""
    assert str(ROOT) not in NB.SETUP and str(ROOT) not in nbformat.writes(built)
    first_code = next(c for c in built.cells if c.cell_type == "code")
    assert built.cells[0].cell_type == "markdown" and built.cells[0].source.startswith("# ")
    assert "setup" in first_code.metadata.get("tags", [])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    chapter_import = "from annotated.tokens import BOS, EOS, PAD; print('imported')"
    for code, cwd, works in (
        (NB.SETUP + "\n" + chapter_import, ROOT / "docs", True),
        (chapter_import, ROOT / "docs", False),
        (NB.SETUP + "\n" + chapter_import, tmp_path, False),
    ):
        r = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
        assert (r.returncode == 0 and "imported" in r.stdout) == works, r.stderr
        if cwd == tmp_path:
            assert "pip install -e ." in r.stderr and "inside the repository's checkout" in r.stderr


def test_the_command_prints_its_help():
    r = subprocess.run(
        [sys.executable, "-m", "docs.notebook", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0 and r.stdout.startswith("usage: python -m docs.notebook")
    assert "--out" in r.stdout and "transformer.ipynb" in r.stdout


def test_the_shipped_translator_translates_and_draws_one_head_at_the_end(built):
    if not (ROOT / "annotated" / "shipped" / "de-en.pt").is_file():
        pytest.skip("no shipped de -> en model in this checkout")
    cells = [c for c in built.cells if "shipped" in c.metadata.get("tags", [])]
    assert [c.cell_type for c in cells] == ["markdown", "code", "code"] and built.cells[-3:] == cells
    # a kernel may send stdout in several chunks, and stderr (a warning) beside it
    text = "".join(o["text"] for o in cells[1].outputs if o["output_type"] == "stream" and o["name"] == "stdout")
    translations = [line.split("  ->  ")[1] for line in text.splitlines() if "  ->  " in line]
    assert len(translations) == 2 and all(t.strip() for t in translations)
    assert any(o.get("data", {}).get("image/png") for o in cells[2].outputs)


def test_the_copy_steps_agree():
    """The copy model's steps: the cells train COPY_STEPS, and `make help`, `--help` and the prose say so."""
    said = {
        "cells": " ".join(source for _, source in NB.FIGURES + NB.TRIES),
        "module": (ROOT / "docs" / "notebook.py").read_text(encoding="utf-8"),
        "make help": subprocess.run(
            ["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
        )
        .stdout.split("make notebook", 1)[1]
        .split("\nmake ", 1)[0],
        "--help": subprocess.run(
            [sys.executable, "-m", "docs.notebook", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
        ).stdout,
    }
    for where, text in said.items():
        counts = {int(n) for n in re.findall(r"\b(\d+) steps\b|steps=(\d+)", text) for n in n if n}
        assert counts == {NB.COPY_STEPS}, (where, counts)


def test_execution_shows_cells_done_and_keeps_the_kernels_stderr_to_itself(capfd):
    """A line per tenth of the cells (a bar on a terminal); what the kernel writes on its stderr (ipykernel's
    `[IPKernelApp] WARNING ...`) does not reach ours."""
    warn = "import os; os.write(2, b'[IPKernelApp] WARNING | a stray line\\n'); 1"
    cells = [nbformat.v4.new_code_cell(code) for code in ("x = 1", warn, "x + 1")]
    said = io.StringIO()
    NB.execute(cells, "quiet_notebook", stream=said)
    lines = said.getvalue().splitlines()
    assert lines[0] == "quiet_notebook: cells executed: 0/3" and lines[-1].startswith(
        "quiet_notebook: cells executed: 3/3"
    )
    assert cells[2].outputs[0]["data"]["text/plain"] == "2"
    assert "IPKernelApp" not in capfd.readouterr().err
