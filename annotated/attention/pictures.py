# %% [markdown]
# # Drawing attention: heatmap grids, alignments, and how to read them
#
# The pictures of an attention dump (`annotated/attention/dump.py`), from its
# arrays, one `(1, h, q, k)` per layer. Every claim below is checked in
# `tests/attention/test_dump.py`.

# %%
from __future__ import annotations

from typing import Final

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

# %% [markdown]
# ## 1. One vocabulary, one colour map, one way to label
#
# The three kinds of attention are named as everywhere else in the package
# (`annotated/sites.py`: `enc_self`, `dec_self`, `cross`); people read them
# under the labels of `KIND_LABELS`. Every picture, the viewer's included,
# uses one colour map, `CMAP`, on one fixed range, 0 to 1, with a colour bar
# saying so, and labels its rows and columns by one rule, `READING` (why:
# `annotated/attention/dump.py`, section 1;
# `test_pictures_follow_the_label_convention`).

# %%
CMAP = "viridis"  # every attention picture: grids, alignments, the viewer's colour table
HEAD_COLOURS = "tab10"  # the viewer's lines view: one colour per head
RANGE = (0.0, 1.0)  # attention weights are probabilities
MASKED = "#d0d0d0"  # grey: a weight the causal mask forces to zero
LAYOUT: Final = "constrained"

KIND_LABELS = {
    "enc_self": "encoder self-attention",
    "dec_self": "decoder self-attention (masked)",
    "cross": "cross-attention (decoder -> source)",
}
AXIS_LABELS = {  # kind -> (the token labelling a row, the token labelling a column)
    "enc_self": ("the source token", "the source token"),
    "dec_self": ("the token the decoder predicts there", "the token fed in there"),
    "cross": ("the token the decoder predicts there", "the source token"),
}
WORD_MARK = "\u2581 marks the start of a word (sentencepiece)"
READING = (
    "a row is a query and sums to 1; a decoder row (query) is labelled by the token the decoder "
    "predicts at that position; a key column by the token fed in at that position; " + WORD_MARK
)
COLOUR_BAR = "attention weight (0 to 1)"


def colour_table(n: int = 64, cmap: str = CMAP) -> list[str]:
    """`n` colours of `cmap`, evenly from weight 0 to weight 1, as '#rrggbb' (the viewer's colour scale).

    >>> t = colour_table(5); len(t), t[0], t[-1]
    (5, '#440154', '#fde725')
    """
    colours = matplotlib.colormaps[cmap].resampled(n)(np.arange(n))  # (n, 4) floats
    return [matplotlib.colors.to_hex(c) for c in colours]


def head_colours(n: int) -> list[str]:
    """One '#rrggbb' per head from `HEAD_COLOURS` (repeating after 10 heads)."""
    table = matplotlib.colormaps[HEAD_COLOURS]  # a listed map of `table.N` colours
    return [matplotlib.colors.to_hex(table(i % table.N)) for i in range(n)]


# %% [markdown]
# ## 2. Pictures
#
# Drawn with matplotlib's Agg canvas (no window, no global backend switch),
# per sentence: `sentence_000_{kind}.png`, a **layer x head grid** of
# heatmaps (`grid_figure`), `dec_self`'s future cells **grey** (the causal
# mask makes them exactly zero); and `sentence_000_alignment.png`, the last
# layer's cross-attention averaged over heads as a **Bahdanau-style
# alignment** (Bahdanau et al., 2015, figure 3), and beside each head in
# `sentence_000_alignment_heads.png`. The mean of `h` rows that each sum to one
# sums to one, so the averaged picture reads like a single head.


# %%
def _tex_safe(label: str) -> str:
    """matplotlib reads `$...$` as mathematics; a literal `$` token must not start a formula."""
    return label.replace("$", r"\$")


def label_font_size(n_tokens: int, inches: float) -> float:
    """Font size (points) so that `n_tokens` labels fit along `inches`, between 4 and 10.

    >>> label_font_size(5, 3.0), label_font_size(40, 3.0), label_font_size(400, 3.0)
    (10.0, 4.32, 4.0)
    """
    return round(float(np.clip(0.8 * 72 * inches / max(n_tokens, 1), 4.0, 10.0)), 2)


def _panel(
    ax,
    weights: np.ndarray,
    rows: list[str],
    cols: list[str],
    *,
    causal: bool,
    row_labels: bool,
    col_labels: bool,
    font: float,
    title: str,
    cols_on_top: bool = False,
    aspect: str = "auto",
):
    q, k = weights.shape
    data = np.ma.masked_where(np.triu(np.ones((q, k), dtype=bool), 1), weights) if causal else weights
    colours = matplotlib.colormaps[CMAP].with_extremes(bad=MASKED)
    im = ax.imshow(data, cmap=colours, vmin=RANGE[0], vmax=RANGE[1], interpolation="nearest", aspect=aspect)
    ax.set_title(title, fontsize=max(font, 7))
    # tick labels are costly artists: only the panels on the grid's left and bottom edges get them
    ax.set_yticks(range(q) if row_labels else [], [_tex_safe(t) for t in rows] if row_labels else [], fontsize=font)
    ax.set_xticks(
        range(k) if col_labels else [], [_tex_safe(t) for t in cols] if col_labels else [], fontsize=font, rotation=90
    )
    if cols_on_top:
        ax.xaxis.tick_top()
        ax.xaxis.set_label_position("top")
    ax.tick_params(length=0)
    return im


def panel_rows(fig: Figure, rows: list, font: float, every_column_labelled: bool = False) -> np.ndarray:
    """One row of panels per (weights (h, q, k), query tokens, key tokens, kind, a title per head), one panel
    per head, as many columns as the widest row has heads (a pruned row's missing heads: empty cells), and the
    one colour bar; row labels on the left column, column labels on the bottom row (or every row). The axes."""
    width = max(len(weights) for weights, *_ in rows)
    axes = fig.subplots(len(rows), width, squeeze=False)
    for r, (weights, queries, keys, kind, titles) in enumerate(rows):
        for i in range(width):
            if i >= len(weights):  # pruned away: an empty cell
                axes[r, i].axis("off")
                continue
            im = _panel(
                axes[r, i],
                weights[i],
                queries,
                keys,
                causal=kind == "dec_self",
                row_labels=i == 0,
                col_labels=every_column_labelled or r == len(rows) - 1,
                font=font,
                title=titles[i],
            )
    add_colour_bar(fig, im, axes)
    return axes


def add_colour_bar(fig: Figure, im, axes) -> None:
    """The one colour bar: `CMAP` from 0 to 1, labelled `COLOUR_BAR`."""
    bar = fig.colorbar(im, ax=axes, shrink=0.6, label=COLOUR_BAR)
    bar.set_ticks([0.0, 0.25, 0.5, 0.75, 1.0])


def caption(kind: str) -> str:
    """How to read a picture of `kind`: its label, what labels rows and columns, and the grey cells.

    >>> caption("cross")
    'cross-attention (decoder -> source): row = query, it sums to 1, labelled by the token the decoder predicts there; column = key, labelled by the source token'
    """
    rows, cols = AXIS_LABELS[kind]
    note = "; grey: future positions, blocked by the causal mask" if kind == "dec_self" else ""
    return f"{KIND_LABELS[kind]}: row = query, it sums to 1, labelled by {rows}; column = key, labelled by {cols}{note}"


def grid_figure(arrays: list[np.ndarray], rows: list[str], cols: list[str], kind: str, title: str = "") -> Figure:
    """Layer x head grid of heatmaps for one kind (arrays: per layer (1, h, q, k)); `rows` and `cols` are the
    tokens labelling the queries and the keys, as `READING` says."""
    N, h = len(arrays), max(a.shape[1] for a in arrays)  # a pruned model's layers may have fewer heads
    q, k = arrays[0].shape[2:]
    panel_w = float(np.clip(0.13 * k + 0.8, 1.6, 3.6))
    panel_h = float(np.clip(0.13 * q + 0.8, 1.6, 3.6))
    font = min(label_font_size(q, panel_h), label_font_size(k, panel_w))
    fig = Figure(figsize=(max(panel_w * h + 1.8, 7.5), panel_h * N + 1.9), dpi=90, layout=LAYOUT)
    titles = [[f"layer {layer}, head {i}" for i in range(a.shape[1])] for layer, a in enumerate(arrays)]
    panel_rows(fig, [(a[0], rows, cols, kind, t) for a, t in zip(arrays, titles)], font)
    fig.suptitle(f"{title}{caption(kind)}\n\u2581 marks the start of a word (sentencepiece)", fontsize=8)
    return fig


def alignment_figure(
    cross_last: np.ndarray, src_tokens: list[str], tgt_out_tokens: list[str], title: str = "", per_head: bool = False
) -> Figure:
    """Bahdanau-style alignment (source across, predicted target down) of one layer's cross-attention.

    `cross_last` is (1, h, T, S). With `per_head`, panels show the mean and every head.
    """
    heads = cross_last[0]  # (h, T, S)
    mean = heads.mean(axis=0)  # (T, S) rows still sum to one
    panels = [("mean over heads", mean)] + ([(f"head {i}", heads[i]) for i in range(len(heads))] if per_head else [])
    T, S = mean.shape
    cell = min(0.22, 7.0 / max(S, T)) if per_head else min(0.32, 10.0 / max(S, T))  # inches per token
    w, hgt = cell * S + 1.6, cell * T + 1.4
    font = min(label_font_size(S, cell * S), label_font_size(T, cell * T))
    ncols = int(np.ceil(np.sqrt(len(panels))))  # 1, 2x2 for 3 heads + mean, 3x3 for 8 + mean
    nrows = -(-len(panels) // ncols)
    fig = Figure(figsize=(max(w * ncols + 1.2, 5.5), hgt * nrows + 1.2), dpi=90, layout=LAYOUT)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    im = None
    rows, cols = AXIS_LABELS["cross"]
    for ax, (name, weights) in zip(axes, panels):
        im = _panel(
            ax,
            weights,
            tgt_out_tokens,
            src_tokens,
            causal=False,
            row_labels=True,
            col_labels=True,
            font=font,
            title=name,
            cols_on_top=True,
            aspect="equal",
        )
        ax.set_xlabel(f"key: {cols}", fontsize=7)
        ax.set_ylabel(f"query: {rows}", fontsize=7)
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    add_colour_bar(fig, im, list(axes[: len(panels)]))
    fig.suptitle(
        f"{title or KIND_LABELS['cross']}\nrow = query, it sums to 1; \u2581 marks the start of a word (sentencepiece)",
        fontsize=8,
    )
    return fig


def figure(**kwargs) -> Figure:
    """A `Figure(**kwargs)` with its Agg canvas, drawn without pyplot (`tight_layout` measures text with it)."""
    fig = Figure(**kwargs)
    FigureCanvasAgg(fig)
    return fig


def figure_rgb(fig: Figure) -> np.ndarray:
    """The figure rendered to an (H, W, 3) uint8 array."""
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()  # (H, W, 3)


# %% [markdown]
# ## 3. How to read the pictures
#
# **Encoder self-attention** (`S x S`, rows and columns the source). Row `q`
# is source token `q` gathering context. A bright **diagonal** means tokens
# mostly keep their own content; a diagonal shifted by one to the left or
# right is a head that looks at the previous or next token, the cheapest way
# to learn local word order from the sinusoidal positions; **vertical
# stripes** are a token everybody consults (often the final period, used as a
# "nothing in particular" slot); small bright **blocks** tie the subwords of
# one word together (`▁Fußball` + `spieler`).
#
# **Decoder self-attention** (`T x T`) is **triangular** because the causal
# mask forbids position `t` to look at positions after `t`: the model must
# predict `y_{t+1}` without seeing it, in training as in decoding. The grey
# upper triangle is exactly zero, not "small". The first row is always
# `[1, 0, 0, ...]`: `<s>` can only attend to itself. Heads here often look at
# the previous one or two target words (local fluency) or back at `<s>`.
#
# **Cross-attention** (`T x S`) is where translation happens. Row `t` is the
# distribution over source tokens while producing target token `t`. A bright
# cell `(t, j)` means: to write `y_t` the decoder mostly read `x_j`.
#
# * A **diagonal** band means the two languages line up word by word, in the
#   same order: *Ein Hund rennt* / *A dog runs*.
# * A band that **jumps** off the diagonal and back is reordering, for example
#   a German verb at the end of a clause that English needs early.
# * **Several target rows on one source column** is one word becoming many
#   (`▁Fußballspieler` -> *soccer player*); **one row spread over several
#   columns** is the reverse, or a word split into subwords.
# * `</s>` and punctuation rows often spread out or land on the source's final
#   period: the model is deciding to stop rather than translating a word.
#
# **Heads specialising.** In a layer x head grid, compare the panels of one
# row: in a trained model they differ. One head is a sharp shifted diagonal
# (position), one is a few bright points (a specific word relation), one is
# nearly uniform (an average of the whole sentence). That variety is the
# point of several heads (section 3 of the first chapter: each head compares
# queries and keys in its own `d_k`-dimensional space). Voita et al. (2019)
# found such positional, syntactic and rare-word heads in translation
# models, and that most other heads can be pruned with little loss. A freshly
# initialised model, or the `smoke` preset, shows blurry near-uniform panels
# everywhere: nothing has specialised yet.
#
# **Caveats.** A weight says where a head *read*, not why the model chose a
# word: after the first layer every position already mixes information from
# the whole sentence, so column `j` of a deep layer is "position `j`", not
# "word `j`". Alignment is usually clearest in a middle-to-late layer rather
# than always in the last one (Garg et al., 2019), so compare with the
# `cross` grid, which shows all of them.
#
# <!-- figure: reading -->
