# %% [markdown]
# # The circuits page: pick a head and a token
#
# `python -m annotated.circuits.command` writes `circuits.html` beside
# `circuits.json`: one offline page, made as the attention viewer's
# (`annotated/attention/viewer.py`): the records inlined as JSON that cannot
# end its `<script>` (`script_json`), the page, script and style plain files
# (`annotated/circuits/web/circuits.{html,js,css}`, with the viewer's style
# first), and a Content-Security-Policy that lets nothing be fetched and no
# script run but its own (`content_security_policy`). Open it from disk.
#
# * **It opens on the best cross head's dictionary in context** (the head
#   with the lowest alignment error rate:
#   `test_the_best_cross_head_is_the_one_with_the_lowest_aer`; for a
#   cross-attention head the panel stands first): its OV and QK
#   dictionaries, their precision with the words scored and the controls of
#   `dictionary.py`, and, for a head `make circuits` tested by intervention
#   (`interventions.py`), what replacing its output does, beside its
#   neighbour. The weights-only tables follow.
# * **The copying score** is glossed "1: it writes what it reads" only for
#   the decoder's self-attention, whose input and output are the target
#   language. Elsewhere the head reads the source language and is read
#   through the target's generator, in one shared vocabulary: the page calls
#   it the shared-vocabulary score, says it is positive when reading a piece
#   raises that same piece's logit on average, and gives the share of the
#   tokens read whose top write is the token itself (`reads_itself`); a
#   cross head, it says, translates.
# * **The head picker** lists every head of every attention, grouped by kind
#   and layer as `KIND_LABELS` names them, each with the label of its
#   position table (`previous`, `self`, `position 0`, `mixed`...), the rank
#   correlation rho of its weights-only reading with its real scores, and for
#   a cross-attention head its alignment error rate and the precision@1 of
#   its OV dictionary, when the aligner ran.
# * **The token picker**: one search box filters two lists, the head's query
#   tokens (its `qk_rows`: the most frequent tokens of the query side) and
#   its key tokens (its `ov_rows`). Choosing a query token shows the keys it
#   matches best (**QK**); choosing a key token shows what the head writes
#   when it reads that token (**OV**): each as bars with their numbers, in
#   the record's order. Where a token is on both lists (self-attention: one
#   language) choosing it shows both.
# * The head's **position table** as a small heat map in the pictures'
#   colour map, centred per row and divided by its largest magnitude (-1 to
#   1, as `circuits_positions.png`), the decoder's future grey; its
#   **singular values** (W_QK's and W_OV's, the rank marked); for a
#   cross-attention head its two **dictionaries** in context.
#
# Each panel has a one-line caption in plain words. Where the direct path is
# the head's whole input (`exact_direct_path`: the first layer's
# self-attentions of a post-norm model) the page says the tables are exact;
# everywhere else it says they are the weights-only approximation and puts
# the measured faithfulness beside it. A pruned model's removed heads have
# no record; when an attention has fewer heads than the others, the page
# says so. The state is kept in the address
# (`#kind=cross&layer=1&head=2&q=...&k=...`).
# (`tests/circuits/test_circuits_page.py`: `test_circuits_page_shows_the_chosen_rows`,
# `test_circuits_page_of_a_pruned_model`.)

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


# %% [markdown]
# ## Written beside circuits.json, linked with the attention viewer
#
# `write_page` writes `circuits.html` into the command's output folder.
# `python -m annotated.attention.dump` puts its viewer in `attention/` of the
# same folder by default (`outputs_beside`): when one is there (or a
# `viewer.html` beside), the heading links to it, opened on the chosen head;
# the viewer links back the same way (`annotated/attention/viewer.py`).


# %%
def write_page(folder: os.PathLike | str, report: dict[str, Any]) -> Path:
    """Write `circuits.html` of `report` into `folder`, linking the attention viewer found there."""
    folder = Path(folder)
    viewer = next((name for name in VIEWERS if (folder / name).is_file()), None)
    return atomic_write(folder / CIRCUITS_PAGE, circuits_html(report, viewer))
