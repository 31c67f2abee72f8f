# %% [markdown]
# # The circuits page: pick a head and a token
#
# `python -m annotated.circuits.command` writes `circuits.html` beside
# `circuits.json`, one offline page made as the attention viewer's
# (`annotated/attention/viewer.py`; its files in `annotated/circuits/web/`).
# It opens on the best cross head (the lowest AER:
# `test_the_best_cross_head_is_the_one_with_the_lowest_aer`) with its
# dictionaries, controls and interventions; a head picker lists every head
# with its labels and scores; a token picker shows the keys a query token
# matches best (QK) and what the head writes reading a key token (OV); the
# position table, singular values and dictionaries follow, each captioned,
# the measured faithfulness beside every table that is not exact. A pruned
# model's removed heads have no record, and the page says so
# (`test_circuits_page_shows_the_chosen_rows`, `test_circuits_page_of_a_pruned_model`).

# %%
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from annotated.attention.pictures import KIND_LABELS, MASKED, WORD_MARK, colour_table
from annotated.attention.viewer import CIRCUITS_PAGE, page_html, viewer_file
from annotated.plumbing.files import atomic_write, json_safe

DIGITS = 4  # decimals kept of every number on the page
VIEWERS = ("attention/viewer.html", "viewer.html")  # where the attention viewer sits beside circuits.html


def page_file(name: str) -> str:
    """The text of `annotated/circuits/web/<name>` (package data)."""
    return viewer_file(name, "annotated.circuits")


def circuits_html(report: dict[str, Any], viewer: str | None = None) -> str:
    """The self-contained circuits page of `report` (as `circuits.json` holds it).

    `viewer`: the attention viewer's page relative to this one, linked from the heading (None: no link)."""
    heads = report.get("heads")
    if not isinstance(heads, list) or not heads:
        raise ValueError("the report holds no head records: run python -m annotated.circuits.command again")
    data = {
        "checkpoint": report.get("checkpoint"),
        "direction": report.get("direction"),
        "best_cross_head": report.get("best_cross_head"),
        "interventions": json_safe(report.get("interventions", []), DIGITS),
        "heads": json_safe(heads, DIGITS),
        "kind_names": KIND_LABELS,
        "word_mark": WORD_MARK,
        "colours": colour_table(64),
        "masked": MASKED,
        "viewer": viewer,
    }
    footer = (
        f"checkpoint: {report.get('checkpoint')} ({report.get('direction')}); numbers rounded to {DIGITS} "
        "decimals; layers and heads count from 0, a pruned model's heads as it numbers them"
    )
    css, js = viewer_file("viewer.css") + page_file("circuits.css"), page_file("circuits.js")
    return page_html(page_file("circuits.html"), report.get("checkpoint"), css, js, footer, data)


# %%
def write_page(folder: os.PathLike | str, report: dict[str, Any]) -> Path:
    """Write `circuits.html` of `report` into `folder`, linking the attention viewer that `make attention` puts
    there (in `attention/` or beside), opened on the chosen head; the viewer links back the same way."""
    folder = Path(folder)
    viewer = next((name for name in VIEWERS if (folder / name).is_file()), None)
    return atomic_write(folder / CIRCUITS_PAGE, circuits_html(report, viewer))
