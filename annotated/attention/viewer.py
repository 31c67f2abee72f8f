# %% [markdown]
# # The attention viewer: one offline page to browse a dump
#
# `python -m annotated.attention.dump` (`annotated/attention/dump.py`) writes
# `viewer.html` beside each dump; this module makes it from the dump's index and arrays.

# %%
from __future__ import annotations

import base64
import hashlib
import html
import importlib.resources
import json
import os
import string
from pathlib import Path

import numpy as np

from annotated.attention.pictures import KIND_LABELS, MASKED, READING, WORD_MARK, caption, colour_table, head_colours
from annotated.sites import KINDS

LINE_MIN = 0.02  # the lines view draws a line for every weight at least this large
CIRCUITS_PAGE = "circuits.html"  # the page `make circuits` writes (annotated/circuits/page.py)
CIRCUITS = (CIRCUITS_PAGE, f"../{CIRCUITS_PAGE}")  # the circuits page beside a dump, or beside its folder


# %% [markdown]
# ## The page
#
# `viewer.html` is one self-contained file: the data inlined as JSON, the
# files of `annotated/attention/web/` copied in; nothing is fetched, and the
# page's Content-Security-Policy says so: no source at all but its own
# script, allowed by its SHA-256 hash, so no injected script could run.
#
# Above the views: a view, a kind, a layer, a head (or the mean over heads)
# and a sentence, wrapping on a narrow screen
# (`test_the_controls_wrap_on_a_narrow_screen`); the **arrow keys** move
# between heads and layers. Captions, colours and labels are the pictures'
# (`annotated/attention/pictures.py`). Heads and layers count from 0.
#
# * **Head view** (`view=head`): the chosen matrix as a heatmap as wide as
#   the page, every row and column labelled; hovering a row or a column
#   shades the other axis's labels by its weights.
# * **Lines view** (`view=lines`), bertviz's head view: query tokens on the
#   left, key tokens on the right, a line for every weight of at least
#   `LINE_MIN`, its opacity the weight, its colour its head's; a head's
#   swatch shows or hides it, and hovering a token keeps only its lines.
# * **Model view** (`view=model`), as bertviz's: the three kinds, each a layer
#   x head grid of small heatmaps, each head's importance under it (below);
#   a click opens that head in the head view.
#
# The state is kept in the address
# (`#s=0&kind=cross&layer=1&head=mean&view=head`) so a view can be
# bookmarked. (`tests/attention/test_dump.py`: `test_head_view_fills_the_page_and_labels_every_token`,
# `test_lines_view_draws_one_path_per_weight_above_the_threshold`,
# `test_model_view_in_headless_chromium`, `test_arrow_keys_move_between_heads_and_layers`.)
#
# A pruned model's layers each show their own heads (`head_counts`).
#
# **The circuits of a head.** When `make circuits` has written
# `circuits.html` beside the dump or in the folder above it, the heading links
# to it, opened on the head shown; the circuits page links back
# (`annotated/circuits/page.py`), so whichever page is written second finds
# the other (`test_the_viewer_links_the_circuits_page_beside_it`).
#
# **Inside another page** (`embedded`, for an `<iframe>`), it tells the page
# around it its height (`postMessage`).
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


def circuits_beside(folder: os.PathLike | str) -> str | None:
    """`circuits.html` (written by `make circuits`) in `folder` or the folder above, relative to `folder`; or None."""
    return next((name for name in CIRCUITS if (Path(folder) / name).is_file()), None)


def viewer_file(name: str, package: str = "annotated.attention") -> str:
    """The text of `<package>/web/<name>` (package data: the viewer's files; the circuits page's, package
    `annotated.circuits`)."""
    return importlib.resources.files(package).joinpath("web").joinpath(name).read_text(encoding="utf-8")


def page_html(template: str, title, css: str, js: str, footer: str, data, **fields: str) -> str:
    """A self-contained page: `template` (string.Template) filled with the escaped title and footer, the style, the
    script with the policy that lets only it run, and `data` as JSON the script reads."""
    return string.Template(template).substitute(
        title=html.escape(str(title)),
        css=css,
        csp=content_security_policy(js),
        footer=html.escape(footer),
        data=script_json(data),
        js=js,
        **fields,
    )


def viewer_html(
    index: dict,
    arrays: list[dict],
    decimals: int = 4,
    *,
    embedded: bool = False,
    start: str | None = None,
    circuits: str | None = None,
) -> str:
    """The self-contained viewer page for a dump (`index` as in index.json, `arrays` per sentence as
    `load_sentence` gives them).

    `embedded`: without heading and footer, for an <iframe>; `start`: the view it opens on when the
    address names none, as in the address (`"s=0&kind=cross&layer=1&head=mean&view=lines"`); `circuits`: the
    circuits page (`circuits.html`) relative to this one, linked from the heading on the chosen head."""
    sentences = []
    kinds = index["kinds"]
    counts = index.get("head_counts") or {k: [index["heads"]] * index["layers"] for k in kinds}
    for entry, attn in zip(index["sentences"], arrays):
        keep = ("source", "translation", "reference", "src_tokens", "tgt_in_tokens", "tgt_out_tokens")
        s = {k: entry.get(k) for k in keep}
        s["attn"] = {k: [np.round(a[0].astype(np.float64), decimals).tolist() for a in attn[k]] for k in kinds}
        sentences.append(s)
    data = {
        "kinds": kinds,
        "layers": index["layers"],
        "heads": index["heads"],
        "head_counts": counts,
        "rows_cols": index["rows_cols"],
        "kind_names": KIND_LABELS,
        "captions": {k: caption(k) for k in kinds},
        "reading": READING,
        "word_mark": WORD_MARK,
        "colours": colour_table(64),
        "masked": MASKED,
        "head_colours": head_colours(index["heads"]),
        "line_min": LINE_MIN,
        "start": start if start is not None else opening_view(arrays, counts),
        "importance": index.get("head_importance"),
        "circuits": circuits,
        "sentences": sentences,
    }
    decoder = index.get("decoder") or {}
    search = f"beam {decoder['beam_size']}" if decoder.get("beam_size", 1) > 1 else "greedy"
    uniform = all(h == index["heads"] for k in kinds for h in counts[k])
    shape = (
        f"{index['layers']} layers x {index['heads']} heads"
        if uniform
        else (
            f"{index['layers']} layers, pruned to " + ", ".join(f"{k} {counts[k]}" for k in kinds) + " heads per layer"
        )
    )
    opened = ""
    if start is None and data["start"]:  # "s=0&kind=cross&layer=L&head=H&view=head"
        layer, head = (part.split("=")[1] for part in data["start"].split("&")[2:4])
        opened = f"; opens on the cross-attention head that aligns best, layer {layer}, head {head}"
    footer = (
        f"checkpoint: {index.get('checkpoint')}; {shape}; "
        f"translated as make translate does ({search}); weights rounded to {decimals} decimals"
        f"{opened}; heads and layers count from 0"
    )
    css, js = viewer_file("viewer.css"), viewer_file("viewer.js")
    body_class = "embedded" if embedded else ""
    return page_html(viewer_file("viewer.html"), index.get("checkpoint"), css, js, footer, data, body_class=body_class)


# %% [markdown]
# ## The view it opens on: the cross-attention head that aligns best
#
# Unless told otherwise (`start`), the page opens on the cross-attention
# head that lines target words up with source words most clearly (`alignment`,
# averaged over the dump's sentences; ties go to the later layer, then the
# lower head): a head whose every row sits on one source token is peaked but
# covers one column, and scores low
# (`test_the_viewer_opens_on_the_head_that_aligns`).


# %%
def alignment(weights: np.ndarray) -> float:
    """How cleanly one head's (rows, keys) weights align rows with keys: mean row maximum x share of keys
    that are some row's maximum.

    >>> alignment(np.eye(3)), round(alignment(np.array([[1.0, 0.0], [1.0, 0.0]])), 2)
    (1.0, 0.5)
    """
    rows = np.asarray(weights, dtype=np.float64)
    return float(rows.max(-1).mean() * len(set(rows.argmax(-1).tolist())) / rows.shape[-1])


def opening_view(arrays: list[dict], counts: dict) -> str:
    """The address of the cross-attention head with the best `alignment` (mean over sentences), head view."""
    if not arrays:
        return ""
    best = max(
        (
            (np.mean([alignment(a["cross"][layer][0, head]) for a in arrays]), layer, -head)
            for layer, n in enumerate(counts["cross"])
            for head in range(n)
        )
    )
    return f"s=0&kind=cross&layer={best[1]}&head={-best[2]}&view=head"


def content_security_policy(script: str) -> str:
    """Nothing may be fetched or run but `script` (by its hash); inline styles are allowed.

    >>> content_security_policy("1")
    "default-src 'none'; script-src 'sha256-a4ayc/80/OGda4BO/1o/V0etpOqiLx1JwB5S3beHW0s='; style-src 'unsafe-inline'"
    """
    digest = base64.b64encode(hashlib.sha256(script.encode("utf-8")).digest()).decode("ascii")
    return f"default-src 'none'; script-src 'sha256-{digest}'; style-src 'unsafe-inline'"


# %% [markdown]
# ## Each head's importance
#
# The scores `make heads` writes to `heads.json` beside the checkpoint are
# shown when the file names this checkpoint and fits this model's heads;
# otherwise the dump says why in one line (`read_head_importance`).


# %%
def importance_fits(table, counts: list[int]) -> bool:
    """Whether `table` holds one finite score per head of every layer, `counts[layer]` heads in each."""
    return (
        isinstance(table, list)
        and len(table) == len(counts)
        and all(
            isinstance(row, list)
            and len(row) == h
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) and np.isfinite(x) for x in row)
            for row, h in zip(table, counts)
        )
    )


def read_head_importance(
    checkpoint: os.PathLike | str, cfg, heads: dict | None = None
) -> tuple[dict | None, str | None]:
    """({kind: [per layer [per head score]]}, None) from `heads.json` beside `checkpoint`
    (written by `python -m annotated.attention.heads`); (None, None) without one; (None, why) when it does not fit.

    `heads`: {kind: [heads of each layer]} of a pruned model (default: `cfg.h` in every layer)."""
    path = Path(checkpoint).parent / "heads.json"
    if not path.is_file():
        return None, None
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
        scores = {kind: report["kinds"][kind]["importance"] for kind in KINDS}
        owner = report.get("checkpoint")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return None, f"{path} is not readable as head scores ({type(e).__name__}); the viewer shows none"
    if owner is not None and Path(str(owner)).resolve() != Path(checkpoint).resolve():
        return None, f"{path} scores {owner}, not this checkpoint; the viewer shows no head scores"
    counts = heads or {kind: [cfg.h] * cfg.N for kind in scores}
    uniform = all(h == cfg.h for kind in scores for h in counts[kind])
    for kind, table in scores.items():
        if not importance_fits(table, counts[kind]):
            want = (
                f"{cfg.N} layers x {cfg.h} finite head scores per kind"
                if uniform
                else "one finite score per head of this pruned model (heads per layer: "
                + ", ".join(f"{k} {counts[k]}" for k in scores)
                + ")"
            )
            return None, f"{path} does not hold {want} (another model's?); the viewer shows no head scores"
    return {k: [[float(x) for x in row] for row in v] for k, v in scores.items()}, None
