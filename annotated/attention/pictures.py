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
# # Drawing attention: heatmap grids, alignments, and how to read them
#
# The pictures of an attention dump (`annotated/attention/dump.py`): for one
# sentence, every weight of one kind of attention as a layer x head grid, and
# the cross-attention of one layer as an alignment. The arrays come in the
# dump's layout, one `(1, h, q, k)` array per layer. Every claim below is
# checked in `tests/attention/test_dump.py`.

# %%
from __future__ import annotations

import os

import numpy as np
import matplotlib
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


# %% [markdown]
# ## 1. Pictures
#
# Three kinds of PNG per sentence, drawn with matplotlib's Agg canvas (no
# window, no global backend switch):
#
# * `sentence_000_{kind}.png`: a **layer x head grid**, one heatmap per head,
#   layer 0 at the top. The colour scale is the same for every panel, 0 to 1,
#   so a bright yellow cell is a weight near one in every panel. Query tokens run
#   down the left column, key tokens along the bottom row.
# * In `decoder_self` the cells above the diagonal are drawn **grey**: they are
#   the future positions the causal mask blocks, whose weight is exactly zero.
# * `sentence_000_alignment.png`: a **Bahdanau-style alignment** of the last
#   layer's cross-attention averaged over heads, source tokens across the top,
#   the produced target tokens down the side, white = weight 1 and black = 0
#   as in Bahdanau et al. (2015), figure 3. `sentence_000_alignment_heads.png`
#   shows the average and each head of that layer side by side.
#
# The average of `h` rows that each sum to one also sums to one, so the
# averaged picture reads like a single head. Labels are the subword strings
# (`▁` marks the start of a word); their font shrinks as sentences grow and
# column labels are rotated so long sentences stay legible.

# %%
CMAP_GRID = "viridis"
LAYOUT = "constrained"


def _tex_safe(label: str) -> str:
    """matplotlib reads `$...$` as mathematics; a literal `$` token must not start a formula."""
    return label.replace("$", r"\$")


def label_font_size(n_tokens: int, inches: float) -> float:
    """Font size (points) so that `n_tokens` labels fit along `inches`, between 4 and 10.

    >>> label_font_size(5, 3.0), label_font_size(40, 3.0), label_font_size(400, 3.0)
    (10.0, 4.32, 4.0)
    """
    return round(float(np.clip(0.8 * 72 * inches / max(n_tokens, 1), 4.0, 10.0)), 2)


def _panel(ax, weights: np.ndarray, rows: list[str], cols: list[str], *, causal: bool, cmap: str,
           row_labels: bool, col_labels: bool, font: float, title: str, cols_on_top: bool = False,
           aspect: str = "auto"):
    q, k = weights.shape
    data = np.ma.masked_where(np.triu(np.ones((q, k), dtype=bool), 1), weights) if causal else weights
    colours = matplotlib.colormaps[cmap].with_extremes(bad="#d0d0d0")  # grey: blocked by the causal mask
    im = ax.imshow(data, cmap=colours, vmin=0.0, vmax=1.0, interpolation="nearest", aspect=aspect)
    ax.set_title(title, fontsize=max(font, 7))
    # tick labels are costly artists: only the panels on the grid's left and bottom edges get them
    ax.set_yticks(range(q) if row_labels else [], [_tex_safe(t) for t in rows] if row_labels else [], fontsize=font)
    ax.set_xticks(range(k) if col_labels else [], [_tex_safe(t) for t in cols] if col_labels else [],
                  fontsize=font, rotation=90)
    if cols_on_top:
        ax.xaxis.tick_top()
        ax.xaxis.set_label_position("top")
    ax.tick_params(length=0)
    return im


def grid_figure(arrays: list[np.ndarray], rows: list[str], cols: list[str], kind: str, title: str = "",
                axis_names: tuple[str, str] = ("queries", "keys")) -> Figure:
    """Layer x head grid of heatmaps for one kind (arrays: per layer (1, h, q, k)); `axis_names` names the
    token lists on the rows and the columns."""
    N, h = len(arrays), max(a.shape[1] for a in arrays)  # a pruned model's layers may have fewer heads
    q, k = arrays[0].shape[2:]
    panel_w = float(np.clip(0.13 * k + 0.8, 1.6, 3.6))
    panel_h = float(np.clip(0.13 * q + 0.8, 1.6, 3.6))
    font = min(label_font_size(q, panel_h), label_font_size(k, panel_w))
    fig = Figure(figsize=(panel_w * h + 1.8, panel_h * N + 1.6), dpi=90, layout=LAYOUT)
    axes = fig.subplots(N, h, squeeze=False)
    im = None
    for layer in range(N):
        for head in range(h):
            if head >= arrays[layer].shape[1]:  # pruned away: an empty cell
                axes[layer][head].axis("off")
                continue
            im = _panel(axes[layer][head], arrays[layer][0, head], rows, cols, causal=kind == "decoder_self",
                        cmap=CMAP_GRID, row_labels=head == 0, col_labels=layer == N - 1, font=font,
                        title=f"layer {layer}, head {head}")
    fig.colorbar(im, ax=axes, shrink=0.6, label="attention weight")
    note = "  (grey: future positions, blocked by the causal mask)" if kind == "decoder_self" else ""
    fig.suptitle(f"{title}{kind}: rows = {axis_names[0]}, columns = {axis_names[1]}{note}", fontsize=9)
    return fig


def alignment_figure(cross_last: np.ndarray, src_tokens: list[str], tgt_out_tokens: list[str],
                     title: str = "", per_head: bool = False) -> Figure:
    """Bahdanau-style alignment (source across, produced target down) of one layer's cross-attention.

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
    fig = Figure(figsize=(w * ncols + 1.2, hgt * nrows + 0.9), dpi=90, layout=LAYOUT)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    im = None
    for ax, (name, weights) in zip(axes, panels):
        im = _panel(ax, weights, tgt_out_tokens, src_tokens, causal=False, cmap="gray", row_labels=True,
                    col_labels=True, font=font, title=name, cols_on_top=True, aspect="equal")
        ax.set_xlabel("source tokens", fontsize=8)
        ax.set_ylabel("produced target tokens", fontsize=8)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    fig.colorbar(im, ax=list(axes[:len(panels)]), shrink=0.7, label="attention weight")
    fig.suptitle(title or "cross-attention alignment", fontsize=9)
    return fig


def save_figure(fig: Figure, path: os.PathLike | str) -> None:
    FigureCanvasAgg(fig)
    fig.savefig(path, format="png")


def figure_rgb(fig: Figure) -> np.ndarray:
    """The figure rendered to an (H, W, 3) uint8 array."""
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()  # (H, W, 3)


# %% [markdown]
# ## 2. How to read the pictures
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
