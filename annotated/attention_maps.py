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
# # Looking at attention: dumps, pictures and a viewer
#
# The first chapter asked what queries, keys and values *do*. This chapter
# lets you watch them on your own trained translator: for a few sentences it
# saves every attention weight of every layer and head, draws them, and
# writes one HTML page to browse them offline.
#
# ```sh
# make attention                                   # best.pt of runs/latest, first 3 test sentences
# python -m annotated.attention_maps --checkpoint runs/x/best.pt "Ein Hund rennt über die Wiese."
# ```
#
# A Transformer translator has three kinds of attention, each with `N` layers
# of `h` heads:
#
# | kind | queries | keys | shape per layer |
# | --- | --- | --- | --- |
# | `encoder` | source tokens | source tokens | `(1, h, S, S)` |
# | `decoder_self` | target positions | target positions (masked) | `(1, h, T, T)` |
# | `cross` | target positions | source tokens (the encoder output) | `(1, h, T, S)` |
#
# Section 6 explains how to read each picture. Every claim that can be checked
# is checked in `tests/test_attention_maps.py` (test names in parentheses).

# %%
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import html
import importlib.resources
import json
import os
import shutil
import string
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

if __name__ == "__main__":  # as a command: a Ctrl-C while torch loads is one line, exit 130
    from annotated.cli import quiet_ctrl_c_while_starting
    quiet_ctrl_c_while_starting("python -m annotated.attention_maps")

import numpy as np
import torch
import matplotlib
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from annotated.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint
from annotated.decoding import translate_ids
from annotated.files import new_file_mode
from annotated.options import Parser, at_least, device, writable_dir
from annotated.transformer import BOS, EOS, PAD, EncoderDecoder, padding_mask, subsequent_mask


KINDS = ("encoder", "decoder_self", "cross")
FORMAT = "annotated-attention-v1"

# %% [markdown]
# ## 1. Which tokens are the rows and the columns
#
# An attention weight `p[0, i, q, k]` says how much query position `q` of
# head `i` takes from key position `k`; every row `p[0, i, q, :]` is a
# probability distribution (non-negative, sums to one). The pictures are only
# honest if the labels on each axis are exactly the tokens at those
# positions, so here they are, for a source `x_1 ... x_S` and a translation
# `y_1 ... y_n` (the model's own output, as `make translate` prints it,
# `eos` included when it was produced):
#
# * **source tokens** (`src_tokens`, length `S`): the subwords of the
#   sentence, `x_1 ... x_S`; the source carries no `bos`/`eos` (as in
#   training).
# * **decoder input** (`tgt_in_tokens`, length `T = n`): `<s> y_1 ... y_{n-1}`,
#   what the decoder *reads*; position `t` reads `tgt_in_tokens[t]`.
# * **decoder output** (`tgt_out_tokens`, length `T = n`): `y_1 ... y_n`, what
#   position `t` *produces*. The last output is `</s>` when the model stopped
#   by itself; `</s>` is never read.
#
# So the rows and columns of each kind are:
#
# * `encoder`: rows and columns `src_tokens`.
# * `decoder_self`: rows and columns `tgt_in_tokens` (the diagonal is "a
#   position looking at itself").
# * `cross`: rows `tgt_out_tokens`, columns `src_tokens`. Row `t` is the
#   decoder position that reads `tgt_in_tokens[t]` and produces
#   `tgt_out_tokens[t]`; labelling it by what it produces gives the classic
#   alignment picture of Bahdanau et al. (2015): "to write *dog*, the model
#   looked at *Hund*".
#
# `index.json` records this table (`rows_cols`: kind -> [row tokens, column
# tokens]) and every sentence's three token lists, so any reader labels the
# arrays correctly; bertviz, which labels decoder positions by their input,
# gets `tgt_in_tokens` (section 4). (`test_dump_files_and_index` checks that
# every array's shape matches its two token lists.)

# %%
ROWS_COLS = {"encoder": ("src_tokens", "src_tokens"),
             "decoder_self": ("tgt_in_tokens", "tgt_in_tokens"),
             "cross": ("tgt_out_tokens", "src_tokens")}


def token_labels(tokenizer, ids: Sequence[int]) -> list[str]:
    """Subword strings for `ids`, with the special ids spelled `<pad>`, `<s>`, `</s>`."""
    specials = {PAD: "<pad>", BOS: "<s>", EOS: "</s>"}
    plain = [i for i in ids if i not in specials]
    pieces = iter(tokenizer.pieces(plain) if plain else [])
    return [specials[i] if i in specials else next(pieces) for i in ids]


# %% [markdown]
# ## 2. One teacher-forced pass collects everything
#
# The decoder (section 3) produces the translation one token at a time. To get
# its attention we do not record anything during decoding and we keep no state on
# the modules: we run the model **once more**, teacher-forced, on the finished
# translation, and keep the probabilities that `encode_with_attention` and
# `decode_with_attention` hand back.
#
# This gives exactly the weights the model used while translating: under the
# causal mask position `t` sees the same inputs `<s> y_1 ... y_{t-1}` in both
# runs, so its attention row is the same (the cached decoder equals the full
# recomputation, `test_cached_decoding_equals_full_recomputation` in the first
# chapter). A beam search keeps several prefixes, but the one it returns was
# extended one token at a time like any other, so the same holds.
# `test_rows_are_the_steps_of_greedy_decoding` checks it row by row against
# the incremental decoder, and, for greedy decoding, that position `t`'s
# logits pick `tgt_out_tokens[t]`. (`test_shapes_rows_and_masks` checks that every row
# sums to one and that the decoder's future is exactly zero.)
#
# `tgt_ids` may be any target, not only the model's output (for instance a
# reference translation followed by `EOS`): the pass feeds `BOS + tgt_ids[:-1]`
# and its `T = len(tgt_ids)` rows are the positions that predict `tgt_ids`.

# %%
def _check_ids(name: str, ids: Sequence[int], vocab: int, max_len: int, allow_pad: bool) -> list[int]:
    ids = [int(i) for i in ids]
    if not ids:
        raise ValueError(f"{name} is empty: need at least one token")
    if len(ids) > max_len:
        raise ValueError(f"{name} has {len(ids)} tokens, more than the model's max_len={max_len}")
    bad = [i for i in ids if not 0 <= i < vocab or (i == PAD and not allow_pad)]
    if bad:
        raise ValueError(f"{name} holds ids outside [0, {vocab})"
                         f"{'' if allow_pad else f' or the pad id {PAD} (it would be masked)'}: {bad[:5]}")
    return ids


@torch.no_grad()
def collect_attention(model: EncoderDecoder, src_ids: Sequence[int], tgt_ids: Sequence[int], *,
                      dtype=np.float32) -> dict:
    """Every attention weight of one sentence pair, from one teacher-forced pass.

    Returns {"encoder": [...], "decoder_self": [...], "cross": [...]}, each a
    list with one numpy array per layer (layer 0 nearest the embeddings) of
    shape (1, h, S, S), (1, h, T, T) and (1, h, T, S), T = len(tgt_ids).

    >>> from annotated.transformer import make_model
    >>> _ = torch.manual_seed(0)
    >>> m = make_model(src_vocab=20, tgt_vocab=20, N=2, d_model=16, d_ff=32, h=4).eval()
    >>> a = collect_attention(m, [5, 6, 7], [8, 9, EOS])
    >>> [(k, len(a[k]), a[k][0].shape) for k in KINDS]
    [('encoder', 2, (1, 4, 3, 3)), ('decoder_self', 2, (1, 4, 3, 3)), ('cross', 2, (1, 4, 3, 3))]
    >>> a["decoder_self"][0][0, 0].round(3).tolist()[0]  # <s> can only look at itself
    [1.0, 0.0, 0.0]
    """
    if model.training:
        raise ValueError("collect_attention needs the model in eval mode (call model.eval()): "
                         "dropout would change the weights")
    cfg = model.config
    src_ids = _check_ids("source", src_ids, cfg.src_vocab, cfg.max_len, allow_pad=False)
    # an untrained model may emit pad or bos as words; the pass feeds them back exactly as greedy did
    tgt_ids = _check_ids("target", tgt_ids, cfg.tgt_vocab, cfg.max_len, allow_pad=True)
    device = next(model.parameters()).device
    src = torch.tensor([src_ids], dtype=torch.long, device=device)  # (1, S)
    tgt_in = torch.tensor([[BOS] + tgt_ids[:-1]], dtype=torch.long, device=device)  # (1, T)
    src_mask = padding_mask(src, PAD)  # (1, 1, S)
    tgt_mask = subsequent_mask(tgt_in.size(1)).to(device)  # (1, T, T)
    memory, enc = model.encode_with_attention(src, src_mask)  # (1, S, d_model), N x (1, h, S, S)
    _, dec_self, cross = model.decode_with_attention(memory, src_mask, tgt_in,
                                                     tgt_mask)  # N x (1, h, T, T), N x (1, h, T, S)
    wide = torch.float64 if np.dtype(dtype) == np.float64 else torch.float32

    def to_numpy(probs):
        return [p.detach().to("cpu", wide).numpy().astype(dtype, copy=False) for p in probs]

    return {"encoder": to_numpy(enc), "decoder_self": to_numpy(dec_self), "cross": to_numpy(cross)}


# %% [markdown]
# ## 3. Translating, and what counts as bad input
#
# The translation is the translator's: `translate_ids` of
# `annotated/decoding.py` with `make translate`'s settings (beam search of
# width 4, length penalty 0.6; `--beam 1` is greedy), at most 50 tokens longer
# than the source and never longer than the model's positional table, so the
# viewer and the translator show the same sentence
# (`test_the_dump_translates_as_the_translator_does`). `translate_ids` returns
# the ids before `eos`; a translation shorter than its limit stopped at `eos`,
# which is put back: the position that produced it is a row of the pictures
# too. (Training's tensorboard picture, section 9, decodes greedily: it is
# drawn every epoch, and the cheapest search shows the alignment as well.)
#
# A sentence is rejected, before anything is computed or written, when it is
# empty (nothing to look at) or longer than the model's `max_len` subwords
# (the model has no position for the rest; truncating would show attention on
# a sentence nobody typed).

# %%
def encode_sentence(tokenizer, sentence: str, max_len: int, name: str = "sentence") -> list[int]:
    """Source subword ids of `sentence`, or a ValueError naming what is wrong with it."""
    if not isinstance(sentence, str) or not sentence.strip():
        raise ValueError(f"{name} is empty")
    ids = tokenizer.encode(sentence)
    if not ids:
        raise ValueError(f"{name} encodes to no subwords: {sentence!r}")
    if len(ids) > max_len:
        short = sentence if len(sentence) <= 60 else sentence[:57] + "..."
        raise ValueError(f"{name} has {len(ids)} subwords, more than the model's max_len={max_len}: {short!r}")
    return ids


@torch.no_grad()
def translate_sentence(model: EncoderDecoder, src_ids: Sequence[int], beam_size: int = 4,
                       length_penalty: float = 0.6, max_extra: int = 50) -> list[int]:
    """What `make translate` prints for `src_ids`, as ids y_1 ... y_n (eos kept when the search stopped there)."""
    ids = translate_ids(model, [list(src_ids)], beam_size, length_penalty, max_extra=max_extra)[0]
    limit = min(model.config.max_len, len(src_ids) + max_extra)
    return ids + [EOS] if len(ids) < limit else ids


@torch.no_grad()
def translate_greedy(model: EncoderDecoder, src_ids: Sequence[int], max_extra: int = 50) -> list[int]:
    """The model's greedy output ids y_1 ... y_n (eos kept when produced, nothing after it)."""
    from annotated import decoding

    device = next(model.parameters()).device
    src = torch.tensor([list(src_ids)], dtype=torch.long, device=device)  # (1, S)
    max_len = min(model.config.max_len, len(src_ids) + max_extra)
    row = decoding.greedy(model, src, padding_mask(src, PAD), max_len)[0].tolist()  # (<= max_len,)
    return row[:row.index(EOS) + 1] if EOS in row else row  # no eos: no pad either (greedy pads after eos)


# %% [markdown]
# ## 4. On disk: `.npz` arrays, a JSON index, and the bertviz layout
#
# A dump directory holds, for sentence `i`:
#
# * `sentence_{i:03d}.npz` with arrays `encoder_layer0 ... encoder_layer{N-1}`,
#   `decoder_self_layer0 ...`, `cross_layer0 ...`, each `(1, h, q, k)`
#   (axes: batch of one, head, query, key);
# * PNG pictures (section 5);
#
# and once: `index.json` (the tokens and ids on both sides of every sentence,
# the shapes, the row/column token lists of each kind, the layer and head
# order, the checkpoint path and its model config, the translations) and
# `viewer.html` (section 7).
#
# Head `i` is the model's head `i`: `W_Q[i]` of `PerHeadAttention`, column
# block `i` of `FusedAttention`'s `W_Q`. Since the two forms are the same
# function (first chapter, section 4), a per-head model and its fused
# conversion give the same dump (`test_per_head_and_fused_give_identical_dumps`).
#
# **bertviz.** `head_view` and `model_view` of bertviz take, per kind, a
# sequence with one tensor per layer of shape `(1, h, q, k)`, plus
# `encoder_tokens` and `decoder_tokens` (the decoder's *input* tokens). That is
# exactly how the arrays are stored, so `bertviz_args` is a rearrangement:
#
# ```python
# from bertviz import head_view                                   # pip install bertviz
# attn, entry = load_sentence("runs/latest/attention", 0)
# head_view(**bertviz_args(attn, entry))
# ```
#
# (`test_bertviz_layout` checks the shapes, the order and the token counts the
# way bertviz's own checks do, without installing it.)

# %%
def array_name(kind: str, layer: int) -> str:
    """`encoder_layer0`, `cross_layer5`, ...: the name of one layer's array in a sentence file."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return f"{kind}_layer{layer}"


def load_sentence(out_dir: os.PathLike | str, i: int) -> tuple[dict, dict]:
    """(arrays {kind: [per-layer (1, h, q, k)]}, index entry) of sentence `i` of a dump."""
    out_dir = Path(out_dir)
    index = read_index(out_dir)
    if not 0 <= i < len(index["sentences"]):
        raise ValueError(f"{out_dir} holds sentences 0..{len(index['sentences']) - 1}, not {i}")
    entry = index["sentences"][i]
    with np.load(out_dir / entry["file"]) as f:
        attn = {k: [f[array_name(k, layer)] for layer in range(index["layers"])] for k in KINDS}
    return attn, entry


def read_index(out_dir: os.PathLike | str) -> dict:
    path = Path(out_dir) / "index.json"
    if not path.is_file():
        raise ValueError(f"{path}: no such file (not an attention dump?)")
    index = json.loads(path.read_text(encoding="utf-8"))
    if index.get("format") != FORMAT:
        raise ValueError(f"{path} is not an attention index (expected format {FORMAT!r})")
    return index


def bertviz_args(attn: dict, entry: Optional[dict] = None) -> dict:
    """Keyword arguments for bertviz's `head_view(**...)` / `model_view(**...)`.

    Per kind a tuple of per-layer torch tensors (1, h, q, k), under bertviz's
    names; with an index `entry`, also `encoder_tokens` and `decoder_tokens`.
    """
    out = {"encoder_attention": tuple(torch.from_numpy(np.asarray(a)) for a in attn["encoder"]),
           "decoder_attention": tuple(torch.from_numpy(np.asarray(a)) for a in attn["decoder_self"]),
           "cross_attention": tuple(torch.from_numpy(np.asarray(a)) for a in attn["cross"])}
    if entry is not None:
        out.update(encoder_tokens=list(entry["src_tokens"]), decoder_tokens=list(entry["tgt_in_tokens"]))
    return out


# %% [markdown]
# ## 5. Pictures
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


def grid_figure(arrays: list[np.ndarray], rows: list[str], cols: list[str], kind: str, title: str = "") -> Figure:
    """Layer x head grid of heatmaps for one kind (arrays: per layer (1, h, q, k))."""
    N, h = len(arrays), arrays[0].shape[1]
    q, k = arrays[0].shape[2:]
    panel_w = float(np.clip(0.13 * k + 0.8, 1.6, 3.6))
    panel_h = float(np.clip(0.13 * q + 0.8, 1.6, 3.6))
    font = min(label_font_size(q, panel_h), label_font_size(k, panel_w))
    fig = Figure(figsize=(panel_w * h + 1.8, panel_h * N + 1.6), dpi=90, layout=LAYOUT)
    axes = fig.subplots(N, h, squeeze=False)
    im = None
    for layer in range(N):
        for head in range(h):
            im = _panel(axes[layer][head], arrays[layer][0, head], rows, cols, causal=kind == "decoder_self",
                        cmap=CMAP_GRID, row_labels=head == 0, col_labels=layer == N - 1, font=font,
                        title=f"layer {layer}, head {head}")
    fig.colorbar(im, ax=axes, shrink=0.6, label="attention weight")
    note = "  (grey: future positions, blocked by the causal mask)" if kind == "decoder_self" else ""
    fig.suptitle(f"{title}{kind}: rows = {ROWS_COLS[kind][0]}, columns = {ROWS_COLS[kind][1]}{note}", fontsize=9)
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
# ## 6. How to read the pictures
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

# %% [markdown]
# ## 7. The HTML viewer
#
# `viewer.html` is one self-contained file: the data is inlined as JSON, the
# page, its script and its style are the plain files
# `annotated/viewer/viewer.{html,js,css}` (read with `importlib.resources`),
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
# Clicking a thumbnail zooms into that head. When `python -m annotated.heads`
# has written `heads.json` beside the checkpoint, each head's importance
# score (Michel et al., 2019: how much the loss depends on the head) is
# written under its thumbnail and beside the zoomed head.
# (`test_model_view_in_headless_chromium`.)
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
    """The text of `annotated/viewer/<name>` (package data)."""
    return importlib.resources.files("annotated").joinpath("viewer", name).read_text(encoding="utf-8")


def viewer_html(index: dict, arrays: list[dict], decimals: int = 4) -> str:
    """The self-contained viewer page for a dump (`index` as in index.json, `arrays` per sentence)."""
    sentences = []
    for entry, attn in zip(index["sentences"], arrays):
        keep = ("source", "translation", "reference", "src_tokens", "tgt_in_tokens", "tgt_out_tokens")
        s = {k: entry.get(k) for k in keep}
        s["attn"] = {k: [np.round(a[0].astype(np.float64), decimals).tolist() for a in attn[k]] for k in KINDS}
        sentences.append(s)
    data = {"kinds": list(KINDS), "layers": index["layers"], "heads": index["heads"],
            "rows_cols": {k: list(v) for k, v in ROWS_COLS.items()},
            "kind_names": {"encoder": "encoder self-attention", "decoder_self": "decoder masked self-attention",
                           "cross": "cross-attention (decoder -> encoder)"},
            "importance": index.get("head_importance"), "sentences": sentences}
    decoder = index.get("decoder") or {}
    search = f"beam {decoder['beam_size']}" if decoder.get("beam_size", 1) > 1 else "greedy"
    footer = html.escape(f"checkpoint: {index.get('checkpoint')}; {index['layers']} layers x {index['heads']} heads; "
                         f"translated as make translate does ({search}); weights rounded to {decimals} decimals")
    page = string.Template(viewer_file("viewer.html"))
    return page.substitute(title=html.escape(str(index.get("checkpoint"))), css=viewer_file("viewer.css"),
                           footer=footer, data=script_json(data), js=viewer_file("viewer.js"))


# %% [markdown]
# ## 8. Writing a dump, all or nothing
#
# A dump is written into a fresh temporary directory next to the target and
# renamed into place only when every file is complete; an error on the way
# removes the temporary directory, so a reader never finds half a dump.
#
# The target may be missing, an empty directory, or **one of our dumps**,
# which is replaced (renamed aside, then deleted). A dump is recognised
# positively: its `index.json` carries our format marker, and every entry of
# the directory is a plain file that the index names (`index.json`,
# `viewer.html`, the sentence files and their pictures). Anything else, a
# file, a link, a folder holding one file of the user's, is refused with one
# line before anything is computed, and left untouched.
# (`test_failed_dump_leaves_nothing`, `test_out_dir_that_is_not_our_dump_is_refused_untouched`.)

# %%
def not_a_dump(out_dir: os.PathLike | str) -> Optional[str]:
    """Why `out_dir` may not be replaced by a dump, or None (missing, empty, or a dump of ours)."""
    out_dir = Path(out_dir)
    if out_dir.is_symlink() or (out_dir.exists() and not out_dir.is_dir()):
        return "it is not a directory" if not out_dir.is_symlink() else "it is a symbolic link"
    if not out_dir.exists() or not any(out_dir.iterdir()):
        return None
    try:
        index = json.loads((out_dir / "index.json").read_text(encoding="utf-8"))
        ours = {"index.json", index.get("viewer") or "viewer.html"}
        for entry in index["sentences"]:
            ours |= {entry["file"], *(entry.get("pictures") or {}).values()}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return "it has no readable index.json of an attention dump"
    if index.get("format") != FORMAT:
        return f"its index.json does not carry the format {FORMAT!r}"
    foreign = sorted(p.name for p in out_dir.iterdir() if p.name not in ours or p.is_symlink() or not p.is_file())
    return f"it holds {foreign[0]!r}, which is no file of a dump" if foreign else None


def check_output_dir(out_dir: os.PathLike | str) -> None:
    """ValueError naming the fix when `out_dir` is neither missing, empty, nor one of our dumps."""
    why = not_a_dump(out_dir)
    if why:
        raise ValueError(f"{out_dir} exists and is not an attention dump ({why}); it was left untouched: "
                         f"choose another --out, or move it away yourself")


@contextlib.contextmanager
def staged_directory(out_dir: os.PathLike | str):
    """Yield a temporary directory that becomes `out_dir` only if the block succeeds."""
    out_dir = Path(out_dir)
    check_output_dir(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-"))
    try:
        yield tmp
        os.chmod(tmp, new_file_mode(0o777))  # mkdtemp's 0o700 -> what mkdir would give
        check_output_dir(out_dir)  # still missing, empty or ours after the work
        old = None
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.old-"))
            os.replace(out_dir, old)  # an empty directory may be replaced by a rename
        os.replace(tmp, out_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _pretty_json(value, indent: str = "") -> str:
    """JSON with one key per line but lists of plain values (ids, tokens, shapes) on one line."""
    inner = indent + " "
    if isinstance(value, dict) and value:
        items = [f"{inner}{json.dumps(str(k))}: {_pretty_json(v, inner)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + indent + "}"
    if isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
        return "[\n" + ",\n".join(inner + _pretty_json(v, inner) for v in value) + "\n" + indent + "]"
    return json.dumps(value, ensure_ascii=False)


def _json_safe(value):
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        if isinstance(value, dict):
            return {str(k): _json_safe(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [_json_safe(v) for v in value]
        return repr(value)


def _pictures(tmp: Path, stem: str, attn: dict, entry: dict) -> dict:
    files = {}
    for kind in KINDS:
        rows, cols = (entry[name] for name in ROWS_COLS[kind])
        fig = grid_figure(attn[kind], rows, cols, kind, title=f"{stem}, ")
        files[kind] = f"{stem}_{kind}.png"
        save_figure(fig, tmp / files[kind])
    last = len(attn["cross"]) - 1
    title = f"{stem}: cross-attention of layer {last} (the last)"
    for name, per_head in (("alignment", False), ("alignment_heads", True)):
        fig = alignment_figure(attn["cross"][last], entry["src_tokens"], entry["tgt_out_tokens"], title, per_head)
        files[name] = f"{stem}_{name}.png"
        save_figure(fig, tmp / files[name])
    return files


def dump_model(model: EncoderDecoder, tokenizer, sentences: Sequence[str], out_dir: os.PathLike | str, *,
               checkpoint: Optional[str] = None, meta: Optional[dict] = None,
               references: Optional[Sequence[Optional[str]]] = None, pictures: bool = True,
               viewer: bool = True, dtype=np.float32, progress: bool = False, beam_size: int = 4,
               importance: Optional[dict] = None) -> Path:
    """Translate `sentences` as the translator does and write their attention dump into `out_dir` (atomically).

    `importance`: each head's score per kind, {kind: [per layer [per head]]} (see `read_head_importance`)."""
    if model.training:
        raise ValueError("dump needs the model in eval mode (call model.eval())")
    if not sentences:
        raise ValueError("no sentences to dump")
    if references is not None and len(references) != len(sentences):
        raise ValueError(f"{len(references)} references for {len(sentences)} sentences")
    cfg = model.config
    sources = [encode_sentence(tokenizer, s, cfg.max_len, name=f"sentence {i + 1}") for i, s in enumerate(sentences)]
    index = {"format": FORMAT, "checkpoint": checkpoint, "model_config": dataclasses.asdict(cfg),
             "meta": _json_safe(dict(meta or {})), "kinds": list(KINDS), "layers": cfg.N, "heads": cfg.h,
             "axes": ["batch", "head", "query", "key"], "array_names": "{kind}_layer{layer}",
             "layer_order": "layer 0 is nearest the embeddings, layer N-1 feeds the output",
             "head_order": "head i uses W_Q[i], W_K[i], W_V[i] (per-head form) = column block i (fused form)",
             "rows_cols": {k: list(v) for k, v in ROWS_COLS.items()},
             "dtype": np.dtype(dtype).name, "decoder": {"beam_size": beam_size, "length_penalty": 0.6},
             "head_importance": importance, "sentences": []}
    all_arrays = []
    items = list(enumerate(zip(sentences, sources)))
    if progress:
        from tqdm.auto import tqdm
        items = tqdm(items, desc="attention", leave=False)
    with staged_directory(out_dir) as tmp:
        for i, (sentence, src_ids) in items:
            tgt_ids = translate_sentence(model, src_ids, beam_size)
            attn = collect_attention(model, src_ids, tgt_ids, dtype=dtype)
            stem = f"sentence_{i:03d}"
            words = tokenizer.decode(tgt_ids[:-1] if tgt_ids[-1:] == [EOS] else tgt_ids)
            entry = {"index": i, "file": f"{stem}.npz", "source": sentence,
                     "reference": references[i] if references is not None else None,
                     "translation": " ".join(words.splitlines()), "src_ids": src_ids, "tgt_out_ids": tgt_ids,
                     "src_tokens": token_labels(tokenizer, src_ids),
                     "tgt_in_tokens": token_labels(tokenizer, [BOS] + tgt_ids[:-1]),
                     "tgt_out_tokens": token_labels(tokenizer, tgt_ids),
                     "shapes": {k: list(attn[k][0].shape) for k in KINDS}}
            np.savez(tmp / entry["file"], **{array_name(k, layer): a for k in KINDS for layer, a in enumerate(attn[k])})
            if pictures:
                entry["pictures"] = _pictures(tmp, stem, attn, entry)
            index["sentences"].append(entry)
            all_arrays.append(attn)
        if viewer:
            (tmp / "viewer.html").write_text(viewer_html(index, all_arrays), encoding="utf-8")
            index["viewer"] = "viewer.html"
        (tmp / "index.json").write_text(_pretty_json(index) + "\n", encoding="utf-8")
    return Path(out_dir)


def dump(checkpoint_path: os.PathLike | str, sentences: Optional[Sequence[str]] = None,
         out_dir: Optional[os.PathLike | str] = None, *, n: int = 3, data_url: Optional[str] = None,
         cache_dir: Optional[os.PathLike | str] = None, references: Optional[Sequence[Optional[str]]] = None,
         pictures: bool = True, viewer: bool = True, dtype=np.float32, device: Optional[str] = None,
         progress: bool = False, beam_size: int = 4, say=None) -> Path:
    """Load a checkpoint and write the attention dump of `sentences` into `out_dir`; returns `out_dir`.

    No `sentences`: the first `n` of Multi30k's test_2016_flickr in the checkpoint's
    source language, with their references (`data_url`, `cache_dir` as in training).
    No `out_dir`: `attention/` next to the checkpoint. With `dtype=np.float64` the
    model runs in float64 too (exact comparisons). Each head's importance comes from
    `heads.json` beside the checkpoint when there is one for this model (`say` gets a
    line when one is there but does not fit). Raises CheckpointError for an
    unusable checkpoint, ValueError for bad sentences, before writing anything.
    """
    checkpoint = Path(checkpoint_path).resolve()
    out_dir = Path(out_dir) if out_dir is not None else checkpoint.parent / "attention"
    check_output_dir(out_dir)  # before any work
    model, tokenizer, meta = load_checkpoint(checkpoint_path)
    if tokenizer is None:
        raise CheckpointError(f"checkpoint {checkpoint_path} holds no tokenizer; cannot turn sentences into ids")
    model = model.to(device or "cpu", torch.float64 if np.dtype(dtype) == np.float64 else torch.float32)
    if sentences is None:
        sentences, references = flickr_test_sentences(meta, n, data_url, cache_dir)
    importance, note = read_head_importance(checkpoint, model.config)
    if note and say:
        say(note)
    return dump_model(model, tokenizer, sentences, out_dir, checkpoint=str(checkpoint), meta=meta,
                      references=references, pictures=pictures, viewer=viewer, dtype=dtype, progress=progress,
                      beam_size=beam_size, importance=importance)


HEADS_KINDS = {"enc_self": "encoder", "dec_self": "decoder_self", "cross": "cross"}  # heads.json -> ours


def read_head_importance(checkpoint: os.PathLike | str, cfg) -> tuple[Optional[dict], Optional[str]]:
    """({kind: [per layer [per head score]]}, None) from `heads.json` beside `checkpoint`
    (written by `python -m annotated.heads`); (None, None) without one; (None, why) when it does not fit."""
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
    for table in scores.values():
        fits = isinstance(table, list) and len(table) == cfg.N and all(
            isinstance(row, list) and len(row) == cfg.h and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and np.isfinite(x) for x in row)
            for row in table)
        if not fits:
            return None, (f"{path} does not hold {cfg.N} layers x {cfg.h} finite head scores per kind (another "
                          f"model's?); the viewer shows no head scores")
    return {k: [[float(x) for x in row] for row in v] for k, v in scores.items()}, None


def flickr_test_sentences(meta: dict, n: int, data_url: Optional[str] = None,
                   cache_dir: Optional[os.PathLike | str] = None) -> tuple[list[str], list[str]]:
    """(sources, references): the first `n` pairs of test_2016_flickr in the checkpoint's languages."""
    from annotated.data import load_multi30k

    if not isinstance(n, int) or n < 1:
        raise ValueError(f"the number of test sentences must be at least 1, got {n!r}")
    src, tgt = meta.get("src_lang"), meta.get("tgt_lang")
    if not src or not tgt:
        raise ValueError("the checkpoint's metadata names no src_lang/tgt_lang; give the sentences explicitly")
    pairs = load_multi30k("test_2016_flickr", src, tgt, cache_dir=cache_dir, base_url=data_url)[:n]
    return [s for s, _ in pairs], [t for _, t in pairs]


# %% [markdown]
# ## 9. During training: one alignment picture per epoch in tensorboard
#
# `log_alignment_image` translates one fixed sentence (say the first
# validation sentence) with the model as it is, and logs the averaged
# last-layer alignment as an image, so tensorboard's slider shows the
# alignment sharpening from blur to a diagonal over the epochs. It switches
# the model to eval mode for the picture and back afterwards, and draws no
# random numbers.

# %%
def log_alignment_image(writer, model: EncoderDecoder, tokenizer, src_sentence: str, step: int,
                        tag: str = "attention/alignment") -> np.ndarray:
    """Log the alignment figure of `src_sentence` to a tensorboard SummaryWriter; returns the image."""
    was_training = model.training
    model.eval()
    try:
        src_ids = encode_sentence(tokenizer, src_sentence, model.config.max_len, name="alignment sentence")
        tgt_ids = translate_greedy(model, src_ids)
        attn = collect_attention(model, src_ids, tgt_ids)
        last = model.config.N - 1
        fig = alignment_figure(attn["cross"][last], token_labels(tokenizer, src_ids), token_labels(tokenizer, tgt_ids),
                               title=f"step {step}: cross-attention of layer {last}, mean over heads")
        image = figure_rgb(fig)  # (H, W, 3)
        writer.add_image(tag, image, step, dataformats="HWC")
        return image
    finally:
        model.train(was_training)


# %% [markdown]
# ## 10. The command line
#
# `python -m annotated.attention_maps [--checkpoint PATH] [--out DIR] [--n 3] [--beam 4] [sentence ...]`
# (also `make attention ARGS='...'`). Without `--checkpoint` it takes the
# best checkpoint of the most recent training run, `runs/latest/best.pt`,
# found by `latest_checkpoint` (`annotated/checkpoint.py`), as the translator finds it;
# without sentences, the first `--n` sentences of Multi30k's
# `test_2016_flickr` in the checkpoint's source language (downloaded as in
# training; `$MULTI30K_URL` or `--data-url` choose the mirror), with their
# reference translations in the index. The dump goes to `--out`, by default
# `attention/` next to the checkpoint. Bad input (a missing or incompatible
# checkpoint, an empty sentence, a sentence longer than the model's
# `max_len`, an `--out` that is not one of our dumps, an option out of range:
# `--n 0`, `--device tpu`, an unwritable `--cache-dir`) prints one line on
# stderr and exits with status 2, writing nothing. From Python the same defaults are `dump(checkpoint)`; after a
# training run, `dump(run_dir / "best.pt")` writes `run_dir/attention/`.

# %%
def parse_args(argv=None) -> argparse.Namespace:
    p = Parser(prog="python -m annotated.attention_maps", name="attention",
               description="Dump, draw and browse every attention weight of a trained translator.")
    p.add_argument("sentences", nargs="*", help="source sentences (default: the first --n of test_2016_flickr)")
    p.add_argument("--checkpoint", type=Path, help="checkpoint file (default: runs/latest/best.pt)")
    p.add_argument("--out", type=Path, help="output directory (default: attention/ next to the checkpoint)")
    p.add_argument("--n", type=at_least(1), default=3, help="how many test sentences when none are given (default 3)")
    p.add_argument("--data-url", help="base URL of the Multi30k files (default $MULTI30K_URL, else GitHub)")
    p.add_argument("--cache-dir", type=writable_dir, help="download cache (default as in training)")
    p.add_argument("--device", type=device, help="cpu, cuda, cuda:1 (default cpu)")
    p.add_argument("--beam", type=at_least(1), default=4,
                   help="beam width of the translation, as for make translate (default 4; 1 = greedy)")
    p.add_argument("--no-pictures", action="store_true", help="skip the PNG files")
    p.add_argument("--no-viewer", action="store_true", help="skip viewer.html")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        ckpt = args.checkpoint if args.checkpoint is not None else latest_checkpoint()
        out = dump(ckpt, args.sentences or None, args.out, n=args.n, data_url=args.data_url,
                   cache_dir=args.cache_dir, pictures=not args.no_pictures, viewer=not args.no_viewer,
                   device=args.device, progress=sys.stderr.isatty(), beam_size=args.beam,
                   say=lambda line: print(f"attention: note: {line}", file=sys.stderr))
    except (ValueError, OSError) as e:  # CheckpointError and the data errors are ValueErrors
        print(f"attention: error: {e}", file=sys.stderr)
        return 2
    count = len(read_index(out)["sentences"])
    print(f"wrote the attention of {count} sentence(s) to {out}/: index.json, sentence_*.npz"
          f"{', *.png' if not args.no_pictures else ''}{', viewer.html' if not args.no_viewer else ''}")
    return 0


if __name__ == "__main__":
    from annotated.cli import run_command
    run_command(main, "python -m annotated.attention_maps")  # Ctrl-C: one line and exit code 130, not a traceback
