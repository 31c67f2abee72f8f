# %% [markdown]
# # Figures of the model itself: its architecture, its block matrices, one head at work
#
# Three pictures drawn from real modules, so their sizes and numbers are the
# code's: the architecture from a model's `TransformerConfig` and its
# attentions; the block matrices from a small `PerHeadAttention` and its
# `fuse`d twin; one head's computation for one query of a real sentence,
# with the per-head matrices `W_Q[i]`, `W_K[i]`, `W_V[i]` of the model shown
# on the page. Every matrix is drawn with the colour map of the attention
# pictures (`CMAP` of `annotated/attention/pictures.py`), one square per
# number, so a `d_model x d_k` matrix is drawn as a `d_model x d_k` rectangle.

# %%
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from matplotlib.figure import Figure as MplFigure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle

from annotated import transformer
from annotated.attention.pictures import CMAP
from annotated.sites import attention_at

CELL = 0.2  # inches per matrix entry: every matrix at the same scale, so shapes are true
# Figure 4 (one head) fits a 1000 px screen at its own size: its matrices at most ONE_HEAD_MATRIX inches wide,
# the bars BARS wide with NUMBERS beside them for their values, every label ONE_HEAD_FONT points
# (`test_one_head_figure_is_readable_at_1000_px`).
ONE_HEAD_MATRIX, BARS, NUMBERS, ONE_HEAD_FONT = 1.6, 1.0, 0.5, 9


# %% [markdown]
# ## Matrices at true size
#
# A `Canvas` places matrices by their top-left corner in inches; each entry
# is a `CELL`-inch square. Block boundaries are drawn as white lines.


# %%
class Canvas:
    def __init__(self, width: float, height: float):
        self.fig, self.w, self.h = MplFigure(figsize=(width, height)), width, height

    def matrix(
        self,
        x: float,
        y: float,
        M: torch.Tensor,
        title: str = "",
        *,
        lim: float = 1.0,
        col_blocks: int = 0,
        row_blocks: int = 0,
        row_labels=None,
        col_labels=None,
        font: float = 11,
    ):
        """Draw M (rows, cols) with its top-left corner at (x, y) inches from the top-left of the canvas."""
        rows, cols = M.shape
        ax = self.fig.add_axes((x / self.w, 1 - (y + rows * CELL) / self.h, cols * CELL / self.w, rows * CELL / self.h))
        ax.imshow(M.detach().numpy(), cmap=CMAP, vmin=-lim, vmax=lim, interpolation="nearest", aspect="auto")
        ax.set_xticks([] if col_labels is None else range(cols), col_labels or [], fontsize=font - 1, rotation=90)
        ax.set_yticks([] if row_labels is None else range(rows), row_labels or [], fontsize=font - 1)
        ax.tick_params(length=0)
        for c in range(col_blocks, cols, col_blocks or cols + 1):
            ax.axvline(c - 0.5, color="white", lw=2.5)
        for r in range(row_blocks, rows, row_blocks or rows + 1):
            ax.axhline(r - 0.5, color="white", lw=2.5)
        if title:
            ax.set_title(title, fontsize=font, pad=3)
        return ax

    def text(self, x: float, y: float, s: str, size: float = 14, **kw):
        self.fig.text(x / self.w, 1 - y / self.h, s, fontsize=size, ha="center", va="center", **kw)


# %% [markdown]
# ## The block matrices, from a real small pair
#
# `PerHeadAttention(d_model=6, h=3, d_k=2)` and its `fuse`d twin. The
# numbers of every panel are computed by the modules' own parameters; the
# test `test_block_matrix_numbers_are_the_modules` checks that the fused
# heads are the per-head ones and that both ends are the modules' outputs.


# %%
@dataclass
class BlockNumbers:
    X: torch.Tensor  # (T, d_model) the input rows
    W_Q_blocks: list  # h x (d_model, d_k): PerHeadAttention.W_Q[i]
    W_Q: torch.Tensor  # (d_model, h*d_k): FusedAttention.W_Q
    XW_Q: torch.Tensor  # (T, h*d_k)
    heads_q: torch.Tensor  # (h, T, d_k): XW_Q.view(1, T, h, d_k).transpose(1, 2)[0]
    heads: torch.Tensor  # (h, T, d_v): head_i
    concat: torch.Tensor  # (T, h*d_v)
    W_O: torch.Tensor  # (h*d_v, d_model)
    terms: torch.Tensor  # (h, T, d_model): head_i W_O[i]
    out: torch.Tensor  # (T, d_model): Concat(heads) W_O
    per_head: transformer.PerHeadAttention
    fused: transformer.FusedAttention


@torch.no_grad()
def block_numbers(d_model: int = 6, h: int = 3, T_len: int = 4, seed: int = 0) -> BlockNumbers:
    torch.manual_seed(seed)
    per_head = transformer.PerHeadAttention(d_model, h, bias=False).eval()
    fused = transformer.fuse(per_head).eval()
    d_k = fused.d_k
    X = torch.randn(1, T_len, d_model)  # (1, T, d_model)
    XW_Q = X @ fused.W_Q  # (1, T, h*d_k)
    heads_q = XW_Q.view(1, T_len, h, d_k).transpose(1, 2)[0]  # (h, T, d_k)
    K, V = per_head.keys_values(X)  # (1, h, T, d_k), (1, h, T, d_v)
    heads = transformer.attention_explicit(per_head.queries(X), K, V)[0][0]  # (h, T, d_v)
    concat = heads.transpose(0, 1).reshape(T_len, h * fused.d_v)  # (T, h*d_v)
    terms = torch.stack([heads[i] @ per_head.W_O[i] for i in range(h)])  # (h, T, d_model)
    return BlockNumbers(
        X[0],
        [w.detach() for w in per_head.W_Q],
        fused.W_Q.detach(),
        XW_Q[0],
        heads_q,
        heads,
        concat,
        fused.W_O.detach(),
        terms,
        concat @ fused.W_O,
        per_head,
        fused,
    )


def draw_block_matrices(ctx) -> tuple[MplFigure, str]:
    n = block_numbers()
    h, (T_len, d_model), d_k = len(n.W_Q_blocks), n.X.shape, n.W_Q_blocks[0].shape[1]
    lim = max(float(t.abs().max()) for t in (n.W_Q, n.XW_Q, n.W_O, n.out, n.X))
    c = Canvas(11.6, 7.4)
    # row 1: the h rectangles and their concatenation
    x = 0.3
    for i, W in enumerate(n.W_Q_blocks):
        c.matrix(x, 0.5, W, f"$W_Q[{i}]$", lim=lim)
        x += d_k * CELL + 0.45
    c.text(x + 0.05, 0.5 + d_model * CELL / 2, "→")
    c.matrix(
        x + 0.45, 0.5, n.W_Q, "$W_Q = [" + " | ".join(f"W_Q[{i}]" for i in range(h)) + "]$", lim=lim, col_blocks=d_k
    )
    c.fig.text(
        (x + 0.45 + h * d_k * CELL + 0.3) / c.w,
        1 - (0.5 + d_model * CELL / 2) / c.h,
        f"each $W_Q[i]$: $d_{{model}} \\times d_k$ = {d_model} × {d_k}\n"
        f"$W_Q$: $d_{{model}} \\times h\\,d_k$ = {d_model} × {h * d_k}",
        fontsize=12,
        va="center",
    )
    # row 2: one product, then the view that picks out each head
    y = 2.6
    c.matrix(0.3, y, n.X, "$X$  (T × $d_{model}$)", lim=lim)
    c.text(0.3 + d_model * CELL + 0.25, y + T_len * CELL / 2, "·")
    c.matrix(0.3 + d_model * CELL + 0.5, y, n.W_Q, "$W_Q$", lim=lim, col_blocks=d_k)
    x = 0.3 + 2 * d_model * CELL + 0.5 + 0.3
    c.text(x, y + T_len * CELL / 2, "=")
    c.matrix(x + 0.3, y, n.XW_Q, "$X W_Q$  (T × $h\\,d_k$)", lim=lim, col_blocks=d_k)
    x += 0.3 + h * d_k * CELL + 0.2
    c.fig.text(
        x / c.w,
        1 - (y + T_len * CELL / 2) / c.h,
        "view(B, T, h, $d_k$)\n.transpose(1, 2)  →",
        fontsize=10.5,
        va="center",
    )
    x += 1.75
    for i in range(h):
        c.matrix(x, y, n.heads_q[i], f"head {i}:\n$X W_Q[{i}]$", lim=lim)
        x += d_k * CELL + 0.55
    # row 3: W_O as row blocks, and the concatenation times W_O as a sum over heads
    y = 4.5
    c.matrix(0.3, y, n.concat, "Concat(heads)", lim=lim, col_blocks=n.heads.shape[-1])
    x = 0.3 + n.concat.shape[1] * CELL + 0.25
    c.text(x, y + T_len * CELL / 2, "·")
    c.matrix(x + 0.25, y, n.W_O, "$W_O$: rows $W_O[0]$, …", lim=lim, row_blocks=n.heads.shape[-1])
    x += 0.25 + d_model * CELL + 0.3
    c.text(x, y + T_len * CELL / 2, "=")
    c.matrix(x + 0.3, y, n.out, "Concat(heads) $W_O$", lim=lim)
    x += 0.3 + d_model * CELL + 0.3
    c.text(x, y + T_len * CELL / 2, "=")
    x += 0.3
    for i in range(h):
        c.matrix(x, y, n.terms[i], f"$head_{i}\\, W_O[{i}]$", lim=lim)
        x += d_model * CELL
        if i < h - 1:
            c.text(x + 0.2, y + T_len * CELL / 2, "+")
            x += 0.4
    caption = (
        f"The block matrices of a real `PerHeadAttention` ($d_{{model}} = {d_model}$, $h = {h}$, "
        f"$d_k = d_v = {d_k}$) and the `FusedAttention` that `fuse` makes of it, one square per number, "
        "one colour scale "
        f"(`CMAP`). Top: each $W_Q[i]$ has $d_{{model}}$ rows and $d_k$ columns; "
        "$W_Q$ lays them side by side. Middle: the rows of $X$ are $T = "
        f"{T_len}$ positions; one product $X W_Q$ computes every head's queries, and "
        "`view(B, T, h, d_k).transpose(1, 2)` hands column block $i$ to head $i$. Bottom: "
        "$W_O$ stacks the row blocks $W_O[i]$ ($d_v$ rows each), so Concat(heads) $W_O$ is the sum "
        "of the heads' terms $head_i W_O[i]$: the white lines mark the blocks."
    )
    return c.fig, caption


# %% [markdown]
# ## One head, one query, step by step
#
# The attention under the microscope: head `i` of the last encoder layer's
# self-attention, at one query position of a real sentence (the checkpoint's
# sentence, or the copy task's source). The input rows `x` are what the
# module received (caught with a forward hook); the numbers are computed
# with the module's own `W_Q[i]`, `W_K[i]`, `W_V[i]` and biases after
# `split` into the per-head form. `test_one_head_figure_is_the_modules_head`
# checks the weighted sum against the module's head output.


# %%
@dataclass
class OneHead:
    tokens: list  # key labels, one per position
    query: int  # the query position
    head: int  # 0-based
    q: torch.Tensor  # (d_k,)   x_query W_Q[i] + b_Q[i]
    K: torch.Tensor  # (T, d_k) x W_K[i] + b_K[i]
    scores: torch.Tensor  # (T,)     q . k / sqrt(d_k) (masked keys -inf)
    p: torch.Tensor  # (T,)     softmax of the scores
    V: torch.Tensor  # (T, d_v) x W_V[i] + b_V[i]
    out: torch.Tensor  # (d_v,)   sum_j p_j V_j
    x: torch.Tensor  # (T, d_model) the attention's input
    mask: torch.Tensor | None  # the call's mask


def attention_input(model: transformer.EncoderDecoder, src: torch.Tensor, kind: str = "enc_self", layer: int = -1):
    """(x_q (T, d_model), mask or None) that the attention at (kind, layer) receives while encoding src."""
    layer = layer % model.config.N
    seen: dict[str, torch.Tensor] = {}  # x, and mask where there is one

    def hook(att, args, kwargs):
        seen["x"] = args[0] if args else kwargs["x_q"]
        mask = args[2] if len(args) > 2 else kwargs.get("mask")
        if mask is not None:
            seen["mask"] = mask

    handle = attention_at(model, kind, layer).register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            model.encode(src, transformer.padding_mask(src, transformer.PAD))
    finally:
        handle.remove()
    return seen["x"][0], seen.get("mask")


@torch.no_grad()
def one_head(att: transformer.PerHeadAttention, x: torch.Tensor, mask, tokens: list, query: int, head: int) -> OneHead:
    """Head `head` of `att` at position `query` of x (T, d_model), computed by hand from W_Q[i] etc."""
    bias = lambda b: 0 if b is None else b[head]
    q = x[query] @ att.W_Q[head] + bias(att.b_Q)  # (d_k,)
    K = x @ att.W_K[head] + bias(att.b_K)  # (T, d_k)
    V = x @ att.W_V[head] + bias(att.b_V)  # (T, d_v)
    scores = K @ q / math.sqrt(att.d_k)  # (T,)
    if mask is not None:
        allowed = mask.expand(1, x.size(0), x.size(0))[0, query]  # (T,)
        scores = scores.masked_fill(~allowed, float("-inf"))
    p = scores.softmax(-1)  # (T,)
    return OneHead(tokens, query, head, q, K, scores, p, V, p @ V, x, mask)


def draw_one_head(ctx) -> tuple[MplFigure, str]:
    from docs.figures import as_text  # (docs.figures imports this module)

    shown = ctx.shown_sentence()
    model, src, labels, where = shown.model, shown.src, shown.labels, shown.name
    per_head = transformer.convert_model(model, "per_head").eval()
    x, mask = attention_input(per_head, src)
    layer = model.config.N
    query = len(labels) // 2
    n = one_head(attention_at(per_head, "enc_self", layer - 1), x, mask, labels, query, 0)
    T_len, d_k, d_v = n.K.shape[0], n.K.shape[1], n.V.shape[1]
    lim = float(max(n.K.abs().max(), n.V.abs().max(), n.q.abs().max()))
    cell = min(CELL, ONE_HEAD_MATRIX / max(d_k, d_v, 1))  # a wide head is drawn narrower, one square per number
    # left to right: row labels | q over k | scores, their numbers | weights, their numbers | v over the output
    k_x = 1.1
    s_x = k_x + d_k * cell + 0.2
    p_x = s_x + BARS + NUMBERS
    v_x = p_x + BARS + NUMBERS
    c = Canvas(v_x + d_v * cell + 0.1, 0.55 + 2 * CELL + 0.5 + T_len * CELL + 0.45 + CELL + 0.1)
    q_y = 0.55  # room for q's two-line title
    top = q_y + CELL + 0.5  # the keys' rows: k, the scores, the weights and v, row for row

    def strip(x0, y0, M, title, ticks=None):
        ax = c.fig.add_axes(
            (x0 / c.w, 1 - (y0 + M.shape[0] * CELL) / c.h, M.shape[1] * cell / c.w, M.shape[0] * CELL / c.h)
        )
        ax.imshow(M.numpy(), cmap=CMAP, vmin=-lim, vmax=lim, aspect="auto", interpolation="nearest")
        ax.set_xticks([])
        ax.set_yticks(range(len(ticks)) if ticks else [], ticks or [], fontsize=ONE_HEAD_FONT)
        ax.tick_params(length=0)
        ax.set_title(title, fontsize=ONE_HEAD_FONT, pad=3)
        return ax

    def bars(x0, values, title, colours, numbers, xlim=None):
        """Horizontal bars, one per key row; their numbers right of the axes, where no bar reaches."""
        ax = c.fig.add_axes((x0 / c.w, 1 - (top + T_len * CELL) / c.h, BARS / c.w, T_len * CELL / c.h))
        ax.barh(range(T_len), values, color=colours)
        ax.axvline(0, color="#57606a", lw=0.6)
        ax.set(ylim=(T_len - 0.5, -0.5), xticks=[])
        if xlim is not None:
            ax.set_xlim(*xlim)
        ax.yaxis.tick_right()
        ax.set_yticks(range(T_len), numbers, fontsize=ONE_HEAD_FONT)
        ax.tick_params(length=0, pad=2)
        ax.set_title(title, fontsize=ONE_HEAD_FONT, pad=3)
        return ax

    strip(k_x, q_y, n.q[None], f"query {_safe(labels[query])}:\nq = x W_Q[{n.head}]", [_safe(labels[query])])
    strip(k_x, top, n.K, f"k = x W_K[{n.head}], a row per key", [_safe(t) for t in labels])
    finite = torch.where(torch.isfinite(n.scores), n.scores, torch.zeros_like(n.scores))
    numbers = [f"{s:.2f}" if math.isfinite(s) else "masked" for s in n.scores.tolist()]
    bars(s_x, finite.numpy(), r"q·k / $\sqrt{d_k}$", "#8c959f", numbers)
    colours = [_colour(p) for p in n.p.tolist()]
    bars(p_x, n.p.numpy(), "softmax: weight p", colours, [f"{p:.2f}" for p in n.p.tolist()], xlim=(0, 1))
    strip(v_x, top, n.V, f"v = x W_V[{n.head}]")
    strip(v_x, top + T_len * CELL + 0.45, n.out[None], "Σ p·v: the head's output")
    caption = (
        f"One head at work: head {n.head} of the last encoder layer's self-attention "
        f"({where}), for the query at position {query}, “{as_text(labels[query])}”. Rows are the key "
        f"positions, labelled by the token fed in there; the columns of q and k are the $d_k = {d_k}$ "
        f"coordinates of the head's space, those of v and of the output its $d_v = {d_v}$. Each key's "
        "score is its row of k dotted with q, divided by $\\sqrt{d_k}$; the softmax turns the "
        "scores into weights that sum to 1; the output is the weighted sum of the rows of v, which "
        "is exactly the module's head output (`test_one_head_figure_is_the_modules_head`). All "
        f"numbers computed with the model's own `W_Q[{n.head}]`, `W_K[{n.head}]`, "
        f"`W_V[{n.head}]` after `split`."
    )
    return c.fig, caption


def _colour(p: float):
    import matplotlib

    return matplotlib.colormaps[CMAP](p)


def _safe(token: str) -> str:
    return token.replace("$", r"\$")


# %% [markdown]
# ## The architecture, from a model's configuration


# %%
def draw_architecture(ctx) -> tuple[MplFigure, str]:
    shown = ctx.shown_sentence()
    model, where = shown.model, shown.name
    cfg = model.config
    kinds = {kind: attention_at(model, kind, 0) for kind in ("enc_self", "dec_self", "cross")}
    import matplotlib

    colour = {k: matplotlib.colormaps[CMAP](v) for k, v in (("enc_self", 0.25), ("dec_self", 0.6), ("cross", 0.9))}
    fig = MplFigure(figsize=(8.5, 7.4))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set(xlim=(0, 10), ylim=(0, 10))
    ax.set_axis_off()

    def box(x, y, text, face="#f6f8fa", w=3.2, hgt=0.62, colour_text="#1f2328"):
        ax.add_patch(
            FancyBboxPatch((x - w / 2, y - hgt / 2), w, hgt, boxstyle="round,pad=0.04", fc=face, ec="#57606a", lw=1)
        )
        ax.text(x, y, text, ha="center", va="center", fontsize=8.5, color=colour_text)

    def arrow(x0, y0, x1, y1, **kw):
        ax.add_patch(
            FancyArrowPatch((x0, y0), (x1, y1), arrowstyle="-|>", mutation_scale=10, color="#57606a", lw=1, **kw)
        )

    def att_text(kind, what):
        a = kinds[kind]
        return f"{what}\n{kind}: h = {a.h} heads, $d_k$ = {a.d_k}"

    ex, dx, step = 2.6, 7.2, 0.85
    enc = [2.1 + step * k for k in range(4)]
    dec = [2.1 + step * k for k in range(6)]
    box(ex, 0.7, "source ids → Embeddings ($\\times\\sqrt{d_{model}}$)\n+ positional encoding")
    box(dx, 0.7, "target ids (shifted right) → Embeddings\n+ positional encoding")
    for x, ys in ((ex, enc), (dx, dec)):
        ax.add_patch(Rectangle((x - 1.9, ys[0] - 0.5), 3.8, ys[-1] - ys[0] + 1.0, fill=False, ec="#57606a", ls="--"))
    ax.text(ex - 2.0, (enc[0] + enc[-1]) / 2, f"N = {cfg.N} ×", ha="right", va="center", fontsize=11)
    ax.text(dx + 2.0, (dec[0] + dec[-1]) / 2, f"× N = {cfg.N}", ha="left", va="center", fontsize=11)
    box(ex, enc[0], att_text("enc_self", "self-attention"), face=colour["enc_self"], colour_text="white")
    box(dx, dec[0], att_text("dec_self", "masked self-attention"), face=colour["dec_self"], colour_text="white")
    box(dx, dec[2], att_text("cross", "cross-attention (keys, values: memory)"), face=colour["cross"])
    for x, y in ((ex, enc[1]), (ex, enc[3]), (dx, dec[1]), (dx, dec[3]), (dx, dec[5])):
        box(x, y, "add & norm")
    box(ex, enc[2], f"feed-forward ($d_{{ff}}$ = {cfg.d_ff})")
    box(dx, dec[4], f"feed-forward ($d_{{ff}}$ = {cfg.d_ff})")
    top = dec[-1] + 1.1
    box(dx, top, f"Generator: linear to {cfg.tgt_vocab} logits")
    box(dx, top + step, "softmax: next-token probabilities")
    for x, ys in ((ex, [0.7, *enc]), (dx, [0.7, *dec, top, top + step])):
        for y0, y1 in zip(ys, ys[1:]):
            arrow(x, y0 + 0.33, x, y1 - 0.33)
    arrow(ex, enc[-1] + 0.33, dx - 1.6, dec[2], connectionstyle="arc3,rad=-0.3")
    ax.text(ex, enc[-1] + 0.75, f"memory (S × $d_{{model}}$ = {cfg.d_model})", ha="center", fontsize=9)
    ax.text(
        5,
        9.5,
        f"{shown.short}: $d_{{model}}$ = {cfg.d_model}, N = {cfg.N}, h = {cfg.h}, {cfg.norm}-norm",
        ha="center",
        fontsize=10,
    )
    caption = (
        f"The encoder-decoder of {where}, drawn from its `TransformerConfig` and its attention "
        f"modules: $N = {cfg.N}$ layers in each stack, $d_{{model}} = {cfg.d_model}$, and per "
        "attention its number of heads $h$ and head size $d_k$. The three attention kinds, in the "
        "colours of the attention pictures: the encoder's self-attention (`enc_self`), the decoder's "
        "masked self-attention (`dec_self`), and the cross-attention (`cross`), whose queries come "
        "from the decoder and whose keys and values from the encoder's output, the memory. Arrows "
        "run from input to output."
    )
    return fig, caption
