# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # The attention viewer: one offline page to browse a dump
#
# `python -m annotated.attention.dump` (`annotated/attention/dump.py`) writes
# `viewer.html` beside each dump. This module makes that page from the dump's
# index and arrays; the page itself, its script and its style are plain files
# in `annotated/attention/web/`.

# %%
from __future__ import annotations

import html
import importlib.resources
import json
import os
import string
from pathlib import Path
from typing import Optional

import numpy as np


# %% [markdown]
# ## The page
#
# `viewer.html` is one self-contained file: the data is inlined as JSON, the
# page, its script and its style are the plain files
# `annotated/attention/web/viewer.{html,js,css}` (read with `importlib.resources`),
# copied into the page; nothing is fetched (no CDN, no fonts, no images). Open
# it from disk in any browser. Choose a sentence, a kind, a layer and a head
# (or the mean over heads); the heatmap shows the chosen matrix, and two
# token columns show the queries and the keys. Hovering a query token (or a
# heatmap row) shades the keys by how much it attends to each; hovering a key
# token shades the queries by how much they attend to it. The state is kept
# in the address (`#s=0&kind=cross&layer=1&head=mean&view=head`) so a view can
# be bookmarked. (`test_viewer_in_headless_chromium` opens it, hovers a token,
# compares the shading with the arrays, and checks that the page made no
# network request.)
#
# The **model view** (`view=model`) shows every layer x head of one kind at
# once, as in bertviz's model view: one thumbnail per head, one pixel per
# (query, key) weight, in the heatmap's colours (a legend gives the scale).
# Clicking a thumbnail zooms into that head. When `python -m annotated.attention.heads`
# has written `heads.json` beside the checkpoint, each head's importance
# score (Michel et al., 2019: how much the loss depends on the head) is
# written under its thumbnail and beside the zoomed head.
# (`test_model_view_in_headless_chromium`.)
#
# A pruned model (`annotated/attention/prune.py`) may keep a different number of heads
# in every attention. The page reads each kind's and layer's count from the
# index (`head_counts`): the head menu offers the chosen layer's heads only,
# and in the model view a layer's row holds exactly its heads' thumbnails,
# the row header saying how many when the layers differ.
# (`test_a_pruned_model_dumps_and_shows_each_layer_with_its_own_heads`.)
#
# The sentences are data, and data must not become markup. Inside a
# `<script>` element the HTML parser looks only for `</script` and, after a
# `<!--`, for `<script`: a sentence holding `<!--<script>` would swallow the
# viewer's own script. So every `<`, `>` and `&` of the JSON is written as its
# `\u003c`-style escape (JSON reads them back unchanged), and so are U+2028
# and U+2029, which some JavaScript parsers take for line ends
# (`test_viewer_survives_markup_in_the_sentences`).

# %%
_SCRIPT_SAFE = {ord(c): f"\\u{ord(c):04x}" for c in "<>&\u2028\u2029"}


def script_json(value) -> str:
    """JSON that can sit inside a <script> element: no character of it can end or open an element.

    >>> script_json({"s": "<!--<script>&"})
    '{"s": "\\\\u003c!--\\\\u003cscript\\\\u003e\\\\u0026"}'
    >>> json.loads(script_json(["</script>"]))
    ['</script>']
    """
    return json.dumps(value, ensure_ascii=False).translate(_SCRIPT_SAFE)


def viewer_file(name: str) -> str:
    """The text of `annotated/attention/web/<name>` (package data)."""
    return importlib.resources.files("annotated.attention").joinpath("web", name).read_text(encoding="utf-8")


def viewer_html(index: dict, arrays: list[dict], decimals: int = 4) -> str:
    """The self-contained viewer page for a dump (`index` as in index.json, `arrays` per sentence)."""
    sentences = []
    kinds = index["kinds"]
    counts = index.get("head_counts") or {k: [index["heads"]] * index["layers"] for k in kinds}
    for entry, attn in zip(index["sentences"], arrays):
        keep = ("source", "translation", "reference", "src_tokens", "tgt_in_tokens", "tgt_out_tokens")
        s = {k: entry.get(k) for k in keep}
        s["attn"] = {k: [np.round(a[0].astype(np.float64), decimals).tolist() for a in attn[k]] for k in kinds}
        sentences.append(s)
    data = {"kinds": kinds, "layers": index["layers"], "heads": index["heads"], "head_counts": counts,
            "rows_cols": index["rows_cols"],
            "kind_names": {"encoder": "encoder self-attention", "decoder_self": "decoder masked self-attention",
                           "cross": "cross-attention (decoder -> encoder)"},
            "importance": index.get("head_importance"), "sentences": sentences}
    decoder = index.get("decoder") or {}
    search = f"beam {decoder['beam_size']}" if decoder.get("beam_size", 1) > 1 else "greedy"
    uniform = all(h == index["heads"] for k in kinds for h in counts[k])
    shape = f"{index['layers']} layers x {index['heads']} heads" if uniform else (
        f"{index['layers']} layers, pruned to " + ", ".join(f"{k} {counts[k]}" for k in kinds) + " heads per layer")
    footer = html.escape(f"checkpoint: {index.get('checkpoint')}; {shape}; "
                         f"translated as make translate does ({search}); weights rounded to {decimals} decimals")
    page = string.Template(viewer_file("viewer.html"))
    return page.substitute(title=html.escape(str(index.get("checkpoint"))), css=viewer_file("viewer.css"),
                           footer=footer, data=script_json(data), js=viewer_file("viewer.js"))


# %% [markdown]
# ## Each head's importance
#
# `python -m annotated.attention.heads` (`annotated/attention/heads.py`) writes `heads.json`
# beside the checkpoint it scored, with Michel et al.'s importance of every
# head of every kind. The viewer shows those scores when the file is there
# and fits the model: the same number of layers, one finite number for each
# head of each layer (of a pruned model too: its own heads, numbered as in
# the dump), and, when the file names the checkpoint it scored, this
# checkpoint. A file that does not fit (say the scores of the model before
# pruning) is left out, and the command says why in one line.

# %%
HEADS_KINDS = {"enc_self": "encoder", "dec_self": "decoder_self", "cross": "cross"}  # heads.json -> ours


def importance_fits(table, counts: list[int]) -> bool:
    """Whether `table` holds one finite score per head of every layer, `counts[layer]` heads in each."""
    return isinstance(table, list) and len(table) == len(counts) and all(
        isinstance(row, list) and len(row) == h and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and np.isfinite(x) for x in row)
        for row, h in zip(table, counts))


def read_head_importance(checkpoint: os.PathLike | str, cfg,
                         heads: Optional[dict] = None) -> tuple[Optional[dict], Optional[str]]:
    """({kind: [per layer [per head score]]}, None) from `heads.json` beside `checkpoint`
    (written by `python -m annotated.attention.heads`); (None, None) without one; (None, why) when it does not fit.

    `heads`: {kind: [heads of each layer]} of a pruned model (default: `cfg.h` in every layer)."""
    path = Path(checkpoint).parent / "heads.json"
    if not path.is_file():
        return None, None
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
        scores = {ours: report["kinds"][theirs]["importance"] for theirs, ours in HEADS_KINDS.items()}
        owner = report.get("checkpoint")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return None, f"{path} is not readable as head scores ({type(e).__name__}); the viewer shows none"
    if owner is not None and Path(str(owner)).resolve() != Path(checkpoint).resolve():
        return None, f"{path} scores {owner}, not this checkpoint; the viewer shows no head scores"
    counts = heads or {kind: [cfg.h] * cfg.N for kind in scores}
    uniform = all(h == cfg.h for kind in scores for h in counts[kind])
    for kind, table in scores.items():
        if not importance_fits(table, counts[kind]):
            want = f"{cfg.N} layers x {cfg.h} finite head scores per kind" if uniform else \
                "one finite score per head of this pruned model (heads per layer: " + \
                ", ".join(f"{k} {counts[k]}" for k in scores) + ")"
            return None, f"{path} does not hold {want} (another model's?); the viewer shows no head scores"
    return {k: [[float(x) for x in row] for row in v] for k, v in scores.items()}, None
