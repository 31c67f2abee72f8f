# %% [markdown]
# # The figures of the rendered chapters
#
# Every picture on the page is drawn at build time by running the modules'
# own functions (`sinusoidal_encoding`, `subsequent_mask`, `rate`,
# `attention_explicit`, `smoothed_targets`, a trained model's attention
# probabilities as `record_attention` gives them, its configuration and its
# per-head matrices), so a figure cannot disagree with the code next to it.
# The pictures of the model itself (architecture, block matrices, one head at
# work) are drawn in `docs/model_figures.py`; every matrix or attention
# picture uses the colour map `CMAP` of `annotated/attention/pictures.py`.
#
# A `Figure` says what to draw and which chapter (module name) it
# illustrates. The chapter's prose cites it where it belongs, with a line of
# its own, `<!-- figure: name -->` (an HTML comment: Jupyter shows nothing
# there), and the page builder (`docs/build.py`) puts the figure there
# (after the code beside that prose, when the prose ends with it). A figure
# no prose cites goes to an appendix, with a note on the console, and so
# does a citation of a figure that does not exist (naming file and line). `draw(ctx)` returns a matplotlib
# figure and its caption (Markdown; `$...$` is math). Figures are built with
# `matplotlib.figure.Figure` directly, never through `pyplot`, so drawing
# leaves no global state behind.

# %%
from __future__ import annotations

import hashlib
import io
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from matplotlib.figure import Figure as MplFigure

from annotated import transformer
from annotated.attention.pictures import CMAP
from annotated.recording import record_attention
from annotated.tokens import Tokenizer
from docs import circuit_figures as C
from docs import model_figures as M

ROOT = Path(__file__).resolve().parent.parent
DPI = 90


@dataclass
class FigureContext:
    """What the drawing functions may use: where the repository is, which model to show."""

    root: Path = ROOT
    checkpoint: Path | None = None  # a trained translator; None: use the copy-task model
    copy_steps: int = 300  # training steps of the copy-task model (0: untrained)
    cache_dir: Path | None = None  # where the trained copy-task model is kept between builds
    say: Callable[[str], None] = print
    checkpoint_required: bool = False  # True: a checkpoint that does not load is an error, not a fallback
    notes: list[str] = field(default_factory=list)  # what the build should tell the reader
    shown: Shown | None = field(default=None, repr=False)  # shown_sentence's answer, once computed

    def shown_sentence(self) -> Shown:
        """(model, source ids (1, S), one label per source position, a few words naming the model):
        the trained translator and its sentence if a checkpoint loads, else the copy-task model and a
        random source. Computed once per build."""
        if self.shown is None:
            self.shown = _shown_sentence(self)
        return self.shown


@dataclass(frozen=True)
class Figure:
    name: str  # the file is figures/<name>.png; the prose cites it as <!-- figure: name -->
    module: str  # the chapter it illustrates (annotated/<module>.py)
    draw: Callable[[FigureContext], tuple[MplFigure, str]]
    at_end: bool = False  # True: after the chapter's last code, where no prose can cite it


def as_text(value) -> str:
    r"""Text from data (a sentence of results.json, a translation, a run's name) for a Markdown caption:
    every ASCII punctuation character backslash-escaped, so it can be neither math, nor markup, nor an image.

    >>> print(as_text(r"$\frac{$ ![t](https://x.invalid/a.png)"))
    \$\\frac\{\$ \!\[t\]\(https\:\/\/x\.invalid\/a\.png\)
    """
    return re.sub(r"([!-/:-@\[-`{-~])", r"\\\1", str(value))


def label_text(token: str) -> str:
    """A token as a matplotlib label: a `$` would start mathtext."""
    return token.replace("$", r"\$")


def png_bytes(fig: MplFigure) -> bytes:
    """The figure as PNG bytes (no timestamp in the metadata, so builds are repeatable)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight", metadata={"Software": None})
    return buf.getvalue()


# %% [markdown]
# ## Why divide by sqrt(d_k): variance and saturation
#
# Left: the variance of `q . k` for random unit-variance vectors grows like
# `d_k`; divided by `sqrt(d_k)` it stays 1. Right: what that does to the
# softmax over 16 keys. The unscaled scores are computed with the module's own
# `attention_explicit` by feeding it `q * sqrt(d_k)` (its division then cancels).


# %%
def draw_scaling(ctx: FigureContext) -> tuple[MplFigure, str]:
    gen = torch.Generator().manual_seed(0)
    dims = [2**i for i in range(0, 10)]  # d_k = 1 ... 512
    var_raw, var_scaled, max_raw, max_scaled = [], [], [], []
    for d_k in dims:
        q = torch.randn(4000, 1, d_k, generator=gen)  # (n, 1, d_k) one query per problem
        k = torch.randn(4000, 16, d_k, generator=gen)  # (n, 16, d_k)
        v = torch.zeros(4000, 16, 1)  # (n, 16, 1) values do not matter here
        raw = (q @ k.transpose(-2, -1)).flatten()  # (n*16,)
        var_raw.append(raw.var().item())
        var_scaled.append((raw / math.sqrt(d_k)).var().item())
        _, p_scaled = transformer.attention_explicit(q, k, v)  # (n, 1, 16)
        _, p_raw = transformer.attention_explicit(q * math.sqrt(d_k), k, v)  # (n, 1, 16) = softmax(q k^T)
        max_scaled.append(p_scaled.amax(-1).mean().item())
        max_raw.append(p_raw.amax(-1).mean().item())
    fig = MplFigure(figsize=(9, 3.2))
    ax1, ax2 = fig.subplots(1, 2)
    ax1.loglog(dims, var_raw, "o-", label=r"$q \cdot k$")
    ax1.loglog(dims, var_scaled, "s-", label=r"$q \cdot k / \sqrt{d_k}$")
    ax1.loglog(dims, dims, "k:", lw=1, label=r"$d_k$")
    ax1.set(xlabel=r"$d_k$", ylabel="variance of the score", title="score variance")
    ax1.legend()
    ax2.semilogx(dims, max_raw, "o-", label="unscaled")
    ax2.semilogx(dims, max_scaled, "s-", label="scaled")
    ax2.axhline(1 / 16, color="k", ls=":", lw=1, label="uniform (1/16)")
    ax2.set(xlabel=r"$d_k$", ylabel="mean largest weight", ylim=(0, 1.05), title="softmax over 16 keys: largest weight")
    ax2.legend()
    caption = (
        "Random queries and keys with unit-variance components. Unscaled scores have variance "
        "$d_k$ and drive the softmax towards one-hot (largest weight near 1), where its gradients "
        "vanish; divided by $\\sqrt{d_k}$ the variance stays 1 and the weights stay spread, "
        "whatever $d_k$. Drawn with `attention_explicit`."
    )
    return fig, caption


# %% [markdown]
# ## The subsequent mask and the positional encoding


# %%
def draw_subsequent_mask(ctx: FigureContext) -> tuple[MplFigure, str]:
    T_len = 12
    mask = transformer.subsequent_mask(T_len)[0]  # (T, T)
    fig = MplFigure(figsize=(3.6, 3.4))
    ax = fig.subplots()
    ax.imshow(mask.int().numpy(), cmap="Greys", vmin=0, vmax=1)
    ax.set(xlabel="key position j", ylabel="query position i", title=f"subsequent_mask({T_len})")
    caption = (
        "`subsequent_mask(12)[0]`: black where query position $i$ may attend to key position "
        "$j$, that is $j \\le i$; white entries are blocked."
    )
    return fig, caption


def draw_positional_encoding(ctx: FigureContext) -> tuple[MplFigure, str]:
    pe = transformer.sinusoidal_encoding(100, 64)  # (100, 64)
    fig = MplFigure(figsize=(10, 3.2))
    ax1, ax2 = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.1, 1]})
    im = ax1.imshow(pe.T.numpy(), aspect="auto", cmap="RdBu", vmin=-1, vmax=1, origin="lower", interpolation="nearest")
    ax1.set(xlabel="position", ylabel="dimension", title="sinusoidal_encoding(100, 64)")
    fig.colorbar(im, ax=ax1)
    for dim in (4, 5, 12, 20):
        ax2.plot(pe[:, dim].numpy(), label=f"dim {dim}")
    ax2.set(xlabel="position", ylim=(-1.3, 1.1), title="four dimensions")
    ax2.legend(loc="lower left", ncol=4, fontsize="small")
    caption = (
        "The positional encoding for $d_{model} = 64$: even dimensions are sines, odd ones cosines, "
        "with wavelengths growing geometrically from $2\\pi$ to $10000 \\cdot 2\\pi$ along the "
        "dimensions. Right: dimensions 4 and 5, the sine and cosine of one frequency, and the slower "
        "sines of dimensions 12 and 20."
    )
    return fig, caption


# %% [markdown]
# ## The learning-rate schedule


# %%
def draw_rate(ctx: FigureContext) -> tuple[MplFigure, str]:
    steps = range(1, 20001, 20)
    fig = MplFigure(figsize=(6, 3.2))
    ax = fig.subplots()
    for d_model, warmup in ((512, 4000), (512, 8000), (256, 4000)):
        ax.plot(
            list(steps),
            [transformer.rate(s, d_model, warmup) for s in steps],
            label=f"d_model={d_model}, warmup={warmup}",
        )
    ax.set(xlabel="step", ylabel="learning rate", title="rate(step, d_model, warmup)")
    ax.legend()
    caption = (
        "`rate(step, d_model, warmup)`: linear warm-up, peak $d_{model}^{-0.5} \\cdot "
        "warmup^{-0.5}$ at step = warmup, then decay as $step^{-0.5}$."
    )
    return fig, caption


# %% [markdown]
# ## Label smoothing
#
# Drawn with the training module's `smoothed_targets` and
# `label_smoothed_loss` when `annotated/training/loss.py` provides them; otherwise with
# the same definition written here, `q(k) = (1 - eps) [k = y] + eps / V`
# (PyTorch's `label_smoothing`), and the caption says so.


# %%
def _smoothing_functions(ctx: FigureContext):
    """(targets(y, V, eps) -> (n, V), loss(logits (B, T, V), y (B, T), eps) -> sum, source note)."""
    try:
        from annotated.training.loss import label_smoothed_loss, smoothed_targets
    except ImportError as e:
        ctx.notes.append(
            f"label smoothing figure: annotated.training.loss not importable ({e}); "
            f"drawn with the formula in docs/figures.py"
        )

        def smoothed_targets(target: torch.Tensor, vocab: int, eps: float) -> torch.Tensor:
            q = torch.full((target.numel(), vocab), eps / vocab)  # (n, V)
            q[torch.arange(target.numel()), target.reshape(-1)] += 1 - eps
            return q

        def label_smoothed_loss(
            logits: torch.Tensor, target: torch.Tensor, eps: float, pad: int = transformer.PAD
        ) -> torch.Tensor:
            loss = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), target.flatten(), label_smoothing=eps, reduction="none"
            )
            return loss.masked_fill(target.flatten() == pad, 0.0).sum()

        return smoothed_targets, label_smoothed_loss, "the formula above (written in docs/figures.py)"
    return smoothed_targets, label_smoothed_loss, "`smoothed_targets` and `label_smoothed_loss`"


def draw_label_smoothing(ctx: FigureContext) -> tuple[MplFigure, str]:
    targets, loss_fn, source = _smoothing_functions(ctx)
    V, y, eps = 10, 4, 0.1
    q = targets(torch.tensor([y]), V, eps)[0]  # (V,)
    one_hot = targets(torch.tensor([y]), V, 0.0)[0]  # (V,)
    fig = MplFigure(figsize=(9, 3.2))
    ax1, ax2 = fig.subplots(1, 2)
    ks = torch.arange(V).numpy()
    ax1.bar(ks - 0.2, one_hot.numpy(), width=0.4, label="one-hot")
    bars = ax1.bar(ks + 0.2, q.numpy(), width=0.4, label=f"smoothed, eps={eps}")
    ax1.bar_label(bars, [f"{v:.2f}" for v in q.tolist()], fontsize="x-small")
    ax1.set(xlabel="token k", ylabel="q(k)", xticks=ks, ylim=(0, 1.15), title=f"target y={y}, V={V}")
    ax1.legend(loc="center right")
    # The loss when the model puts probability p on y and spreads the rest evenly.
    p = torch.linspace(0.02, 0.999, 300, dtype=torch.float64)  # (n,)
    probs = ((1 - p) / (V - 1)).unsqueeze(1).repeat(1, V)  # (n, V)
    probs[:, y] = p
    target = torch.full((1, 1), y)  # (1, 1)
    for e in (0.0, eps):
        losses = [loss_fn(row.log().view(1, 1, V), target, e, pad=-1).item() for row in probs]
        ax2.plot(p.numpy(), losses, label=f"eps={e}")
    ax2.axvline(q[y].item(), color="k", ls=":", lw=1, label=f"p(y) = q(y) = {q[y].item():.2f}")
    ax2.set(xlabel="p(y), the rest spread evenly", ylabel="loss", ylim=(0, 4), title="loss for one position")
    ax2.legend()
    caption = (
        f"Label smoothing with $\\epsilon = {eps}$ over $V = {V}$ tokens. Left: the training target. "
        "Right: without smoothing the loss keeps falling as the model grows surer of $y$; with "
        "smoothing it is smallest at $p(y) = 1 - \\epsilon + \\epsilon / V$ and penalises "
        f"overconfidence. Drawn with {source}."
    )
    return fig, caption


# %% [markdown]
# ## Attention pictures
#
# From a trained translator when a checkpoint exists (the latest run's model,
# `runs/latest/averaged.pt` or `best.pt`): the cross-attention of the last decoder
# layer while it translates one sentence, every head. Otherwise from the copy
# task of the first chapter (trained for `copy_steps` steps, and kept in
# `cache_dir` so the next build does not train again): there the decoder
# should read the source one position at a time. The same model and sentence
# (`FigureContext.shown_sentence`) serve the architecture and one-head figures.
#
# The probabilities are recorded with `record_attention` while the model
# encodes the source and decodes, fed `<s>` and its own output but the last
# token, the output being the translator's: beam search of width 4
# (`BEAM`), as `make translate` and the attention viewer decode, so the page
# shows the command's translation. The copy task's caption says whether the
# output is a correct copy, and where a wrong one goes wrong. The rows follow the convention of every attention picture of
# the project (`ROW_CONVENTION`): a decoder row (query) is labelled by the
# token the decoder predicts at that position; a key column by the token fed
# in at that position (`test_attention_figure_labels_decoder_rows_by_the_predicted_token`).


# %%
def find_checkpoint(root: Path) -> Path | None:
    """The translator's default model (`choose_checkpoint`: the latest run under root/runs, else the de -> en model
    shipped in the package), or None when there is neither."""
    from annotated.checkpoint import CheckpointError
    from annotated.run_folder import RUNS
    from annotated.shipped import choose_checkpoint

    try:
        return choose_checkpoint(None, root / RUNS)
    except CheckpointError:
        return None


def copy_task_model(ctx: FigureContext) -> transformer.EncoderDecoder:
    """The copy-task model, trained once per version of transformer.py and number of steps."""
    from annotated.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

    key = hashlib.sha256((ctx.root / "annotated" / "transformer.py").read_bytes()).hexdigest()[:16]
    cached = ctx.cache_dir / f"copy-{ctx.copy_steps}-{key}.pt" if ctx.cache_dir else None
    if cached is not None and cached.is_file():
        try:
            return load_checkpoint(cached)[0]
        except CheckpointError as e:
            ctx.say(f"ignoring the cached copy-task model: {e}")
    ctx.say(
        f"training the copy-task model for the attention figure ({ctx.copy_steps} steps, "
        f"about {ctx.copy_steps // 15 + 1} s on one CPU core)"
    )
    model = transformer.train_copy_task(steps=ctx.copy_steps)
    if cached is not None:
        save_checkpoint(cached, model, None, {"copy_steps": ctx.copy_steps})
    return model


def _checkpoint_sentence(path: Path, src_lang: str) -> str:
    """A sentence to translate: the run's first test sample if recorded, else a fixed one."""
    import json

    results = path.parent / "results.json"
    if results.is_file():
        try:
            samples = json.loads(results.read_text(encoding="utf-8")).get("samples") or []
            if samples and samples[0].get("source"):
                return samples[0]["source"]
        except (OSError, ValueError):
            pass
    return {
        "de": "Zwei junge Männer spielen Fußball auf einer Wiese.",
        "fr": "Deux jeunes hommes jouent au football dans un champ.",
        "cs": "Dva mladí muži hrají fotbal na louce.",
    }.get(src_lang, "Two young men play soccer in a field.")


def _attention_grid(
    panels: list[tuple[str, torch.Tensor, list[str], list[str]]], ncols: int, width: float
) -> MplFigure:
    """Panels (title, probs (T_q, T_k), query labels, key labels), `ncols` to a row."""
    nrows = -(-len(panels) // ncols)
    fig = MplFigure(figsize=(width, 0.4 + 1.05 * width / ncols * nrows))
    axes = fig.subplots(nrows, ncols, squeeze=False).flatten()
    for j, ax in enumerate(axes):
        if j >= len(panels):
            ax.set_axis_off()
            continue
        title, probs, q_labels, k_labels = panels[j]
        ax.imshow(probs.numpy(), cmap=CMAP, vmin=0, vmax=1)
        ax.set_title(title, fontsize="small")
        ax.set_xticks(range(len(k_labels)), [label_text(t) for t in k_labels], rotation=90, fontsize="x-small")
        ax.set_yticks(
            range(len(q_labels)), [label_text(t) for t in q_labels] if j % ncols == 0 else [], fontsize="x-small"
        )
    return fig


_NAMES = {transformer.BOS: "<s>", transformer.EOS: "</s>", transformer.PAD: "<pad>"}
ROW_CONVENTION = (
    "A decoder row (query) is labelled by the token the decoder predicts at that position; a key "
    "column by the token fed in at that position."
)


@dataclass
class Shown:
    """The model the page's model pictures show, and one sentence for it."""

    model: transformer.EncoderDecoder
    src: torch.Tensor  # (1, S) source ids
    labels: list[str]  # one per source position
    name: str  # a few words naming the model, for captions
    label: Callable[[list[int]], list[str]]  # ids -> one label per id
    tokenizer: Tokenizer | None = None  # the checkpoint's, or None for the copy task
    meta: dict = field(default_factory=dict)
    sentence: str = ""
    short: str = "copy-task model"  # the name without markup, for a picture's title


def _copy_shown(ctx: FigureContext) -> Shown:
    model = copy_task_model(ctx)
    gen = torch.Generator().manual_seed(7)
    src = torch.randint(3, model.config.src_vocab, (1, 8), generator=gen)  # (1, S)
    label = lambda ids: [_NAMES.get(t, str(t)) for t in ids]
    return Shown(
        model,
        src,
        label(src[0].tolist()),
        f"the copy-task model (trained {ctx.copy_steps} steps, no checkpoint in `runs/`)",
        label,
    )


def _checkpoint_shown(ctx: FigureContext, checkpoint: Path) -> Shown:
    from annotated.checkpoint import CheckpointError, load_checkpoint

    model, tokenizer, meta = load_checkpoint(checkpoint)
    if tokenizer is None:
        raise CheckpointError(f"checkpoint {checkpoint} holds no tokenizer, so no sentence can be encoded")
    sentence = _checkpoint_sentence(checkpoint, meta.get("src_lang", ""))
    ids = tokenizer.encode(sentence)[: model.config.max_len]
    label = lambda ids: [_NAMES.get(t) or "".join(tokenizer.pieces([t])) for t in ids]
    languages = as_text(f"{meta.get('src_lang', '?')}→{meta.get('tgt_lang', '?')}")
    name = f"the trained translator {as_text(f'{checkpoint.parent.name}/{checkpoint.name}')} ({languages})"
    return Shown(
        model.eval(),
        torch.tensor([ids]),
        label(ids),
        name,
        label,
        tokenizer,
        meta,
        sentence,
        f"translator {checkpoint.parent.name}",
    )


def _shown_sentence(ctx: FigureContext) -> Shown:
    if ctx.checkpoint is not None:
        from annotated.checkpoint import CheckpointError

        try:
            return _checkpoint_shown(ctx, ctx.checkpoint)
        except CheckpointError as e:
            if ctx.checkpoint_required:
                raise
            ctx.notes.append(f"model figures: {e}; drawn from the copy-task model instead")
            ctx.say(f"note: {e}; using the copy-task model")
    return _copy_shown(ctx)


BEAM = 4  # the figures and the viewer decode as `make translate` does: beam search of width 4


def decoded(model: transformer.EncoderDecoder, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(what the decoder is fed (1, T): <s> and its own output but the last token; what it predicts (1, T)),
    translated as `make translate` translates (`translate_sentence`, beam `BEAM`)."""
    from annotated.attention.dump import translate_sentence

    out = torch.tensor([translate_sentence(model, src[0].tolist(), beam_size=BEAM)])  # (1, T)
    return torch.cat([torch.tensor([[transformer.BOS]]), out[:, :-1]], dim=1), out  # (1, T), (1, T)


def copy_verdict(out: list[int], src: list[int]) -> str:
    """What the caption says of a copy-task output: right, or wrong and where.

    >>> copy_verdict([5, 6, 2], [5, 6]), copy_verdict([5, 7, 7, 2], [5, 6])
    ('Its output copies the source exactly.', 'Its output is a wrong copy: 5 7 7 instead of 5 6, wrong from position 1 on (positions count from 0); the model has not learnt the task yet.')
    """
    got = out[:-1] if out[-1:] == [transformer.EOS] else out
    if got == src:
        return "Its output copies the source exactly."
    first = next((i for i, (a, b) in enumerate(zip(got, src)) if a != b), min(len(got), len(src)))
    return (
        f"Its output is a wrong copy: {' '.join(map(str, got))} instead of {' '.join(map(str, src))}, "
        f"wrong from position {first} on (positions count from 0); the model has not learnt the task yet."
    )


def last_layer_attention(model: transformer.EncoderDecoder, src: torch.Tensor, tgt_in: torch.Tensor) -> dict:
    """{"enc_self": (h, S, S), "cross": (h, T, S)}: the last layer's probabilities, via record_attention."""
    src_mask, last = transformer.padding_mask(src, transformer.PAD), model.config.N - 1
    with torch.no_grad(), record_attention(model) as probs:
        memory = model.encode(src, src_mask)
        model.decode(memory, src_mask, tgt_in, transformer.target_mask(tgt_in, transformer.PAD))
    return {kind: probs[kind, last][0][0] for kind in ("enc_self", "cross")}


def draw_attention(ctx: FigureContext) -> tuple[MplFigure, str]:
    shown = ctx.shown_sentence()
    model, src = shown.model, shown.src
    tgt_in, out = decoded(model, src)
    probs = last_layer_attention(model, src, tgt_in)
    predicted = shown.label(out[0].tolist())
    h = probs["cross"].size(0)
    if shown.tokenizer is None:  # the copy task: the encoder's self-attention too
        panels = [(f"encoder, head {i}", probs["enc_self"][i], shown.labels, shown.labels) for i in range(h)] + [
            (f"cross, head {i}", probs["cross"][i], predicted, shown.labels) for i in range(h)
        ]
        fig = _attention_grid(panels, ncols=h, width=2.4 * h)
        caption = (
            f"Attention of {shown.name}: top, the last encoder layer's self-attention over the source "
            f"{' '.join(shown.labels)}; bottom, the last decoder layer's cross-attention, one row per "
            f"target position, while the model decodes with beam search (beam {BEAM}, as `make translate` "
            f"does). {copy_verdict(out[0].tolist(), src[0].tolist())} "
            "Rows are queries, columns keys; each row sums to 1. " + ROW_CONVENTION
        )
        return fig, caption
    panels = [(f"head {i}", probs["cross"][i], predicted, shown.labels) for i in range(h)]
    fig = _attention_grid(panels, ncols=min(4, h), width=12)
    caption = (
        f"Cross-attention of the last decoder layer of {shown.name}, every head, translating "
        f"“{as_text(shown.sentence)}” with beam {BEAM}, as `make translate` does, into "
        f"“{as_text(shown.tokenizer.decode(out[0].tolist()))}”. "
        "Rows are target subwords (queries), columns source subwords (keys); each row sums to 1. " + ROW_CONVENTION
    )
    return fig, caption


# %% [markdown]
# ## How to read the pictures: the patterns, drawn
#
# Part IV's "How to read the pictures" names the patterns a trained model's
# heads show. This figure draws each one as the pictures of
# `annotated/attention/pictures.py` draw a head (`_panel`: the colour map
# `CMAP` from 0 to 1, grey where the causal mask blocks a cell), on small
# matrices written here by hand, every row summing to 1: they are
# illustrations of the patterns, not a model's weights, and the caption says
# so (`test_reading_figure_rows_sum_to_one`).


# %%
def _rows(n_cols: int, peaks: list[list[tuple[int, float]]], floor: float = 0.02) -> np.ndarray:
    """A (len(peaks), n_cols) matrix: each row `floor` everywhere plus its (column, weight) peaks, normalised."""
    import numpy as np

    m = np.full((len(peaks), n_cols), floor)
    for r, row in enumerate(peaks):
        for c, w in row:
            m[r, c] += w
    return m / m.sum(-1, keepdims=True)


def reading_panels() -> list[tuple[str, np.ndarray, list[str], list[str], bool]]:
    """(title, weights, row labels, column labels, causal) of each pattern of "How to read the pictures"."""
    import numpy as np

    src = ["▁Ein", "▁Hund", "▁rennt", "▁über", "▁die", "▁Wiese", "."]
    fed = ["<s>", "▁A", "▁dog", "▁runs", "▁across", "▁the", "▁meadow", "."]
    out = fed[1:] + ["</s>"]
    S, T = len(src), len(out)
    causal = np.tril(np.ones((T, T)))
    prev = _rows(T, [[(max(t - 1, 0), 1.0)] for t in range(T)]) * causal
    prev /= prev.sum(-1, keepdims=True)
    cross = [[(0, 1.0)], [(1, 1.0)], [(2, 1.0)], [(3, 1.0)], [(4, 1.0)], [(5, 1.0)], [(6, 1.0)], [(6, 0.6), (5, 0.3)]]
    return [
        ("encoder: diagonal\n(each token keeps itself)", _rows(S, [[(i, 1.0)] for i in range(S)]), src, src, False),
        (
            "encoder: shifted diagonal\n(the previous token)",
            _rows(S, [[(max(i - 1, 0), 1.0)] for i in range(S)]),
            src,
            src,
            False,
        ),
        (
            "encoder: a vertical stripe\n(everyone reads the period)",
            _rows(S, [[(S - 1, 1.0)]] * S, 0.05),
            src,
            src,
            False,
        ),
        ("decoder self: triangular\n(grey: blocked, exactly 0)", prev, out, fed, True),
        ("cross: a diagonal band\n(word by word)", _rows(S, cross), out, src, False),
    ]


def draw_reading(ctx: FigureContext) -> tuple[MplFigure, str]:
    from annotated.attention.pictures import _panel, add_colour_bar

    panels = reading_panels()
    fig = MplFigure(figsize=(13, 3.6), layout="constrained")
    axes = fig.subplots(1, len(panels))
    im = None
    for ax, (title, weights, rows, cols, causal) in zip(axes, panels):
        im = _panel(
            ax,
            weights,
            rows,
            cols,
            causal=causal,
            row_labels=True,
            col_labels=True,
            font=7,
            title=title,
            aspect="equal",
        )
    add_colour_bar(fig, im, list(axes))
    caption = (
        "The patterns of “How to read the pictures”, drawn as every attention picture is drawn "
        "(one colour map from 0 to 1; rows are queries and each sums to 1; grey cells are blocked by "
        "the causal mask). These matrices are written by hand to show each pattern, not taken from a "
        "model: from left to right, an encoder head that keeps each token, one that reads the previous "
        "token, one that every token uses to read the final period, the decoder's triangular "
        "self-attention reading the previous word, and a cross-attention head whose diagonal band "
        "lines *Ein Hund rennt über die Wiese.* up with *A dog runs across the meadow.*, its `</s>` "
        "row on the final period. " + ROW_CONVENTION
    )
    return fig, caption


# %% [markdown]
# ## The attention viewer at the end of the chapter
#
# The chapter ends with the attention viewer (`annotated/attention/viewer.py`)
# for the model and sentence of the attention figure (`shown_sentence`),
# decoded with beam search as in the figure and as `make translate` does. The attention is dumped by `dump_model`
# of `annotated/attention/dump.py` into a temporary folder of the cache, read
# back with `read_index` and `load_sentence`, and written as one embedded
# viewer page (`viewer_html(..., embedded=True)`), which the page builder
# shows in an `<iframe>`. It opens on the mean over heads of the last decoder
# layer's cross-attention, the attention of the figure. The copy task has no
# subword tokenizer: its symbols are the token labels (`SymbolTokens`), as in
# the figure.

# %%
VIEWER = "viewer/index.html"  # where the page builder writes the viewer, relative to the output folder


class SymbolTokens:
    """The copy task's tokenizer for a dump: a sentence is its symbol ids written out, each id its own label."""

    def encode(self, sentence: str) -> list[int]:
        return [int(word) for word in sentence.split()]

    def pieces(self, ids: list[int]) -> list[str]:
        return [str(i) for i in ids]

    def decode(self, ids: list[int]) -> str:
        return " ".join(str(i) for i in ids)


def viewer_start(model: transformer.EncoderDecoder) -> str:
    """The view the viewer opens on: the last layer's cross-attention, mean over heads, as a heatmap."""
    return f"s=0&kind=cross&layer={model.config.N - 1}&head=mean&view=head"


def viewer_page(ctx: FigureContext) -> str:
    """The embedded viewer page (HTML) for the shown model and sentence."""
    import tempfile

    from annotated.attention.dump import dump_model, load_sentence, read_index
    from annotated.attention.viewer import viewer_html

    shown = ctx.shown_sentence()
    tokenizer: Tokenizer | SymbolTokens = shown.tokenizer or SymbolTokens()
    ids = shown.src[0].tolist()
    sentence = shown.sentence if shown.sentence and tokenizer.encode(shown.sentence) == ids else tokenizer.decode(ids)
    if ctx.cache_dir is not None:
        ctx.cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=ctx.cache_dir, prefix="viewer-") as tmp:
        folder = dump_model(
            shown.model,
            tokenizer,
            [sentence],
            Path(tmp) / "dump",
            checkpoint=shown.short,
            meta=shown.meta,
            pictures=False,
            viewer=False,
            beam_size=BEAM,
        )
        index, arrays = read_index(folder), [load_sentence(folder, 0)[0]]
    return viewer_html(index, arrays, embedded=True, start=viewer_start(shown.model))


# %% [markdown]
# ## The list the page builder reads
#
# A figure of the module `INTRODUCTION` goes into the book's introduction,
# before the first part.

# %%
INTRODUCTION = "introduction"
FIGURES: tuple[Figure, ...] = (
    Figure("scaling", "transformer", draw_scaling),
    Figure("subsequent_mask", "transformer", draw_subsequent_mask),
    Figure("positional_encoding", "transformer", draw_positional_encoding),
    Figure("rate", "transformer", draw_rate),
    Figure("attention", "transformer", draw_attention, at_end=True),
    Figure("block_matrices", INTRODUCTION, M.draw_block_matrices),
    Figure("one_head", "transformer", M.draw_one_head),
    Figure("architecture", "transformer", M.draw_architecture),
    Figure("label_smoothing", "training/loss", draw_label_smoothing),
    Figure("reading", "attention/pictures", draw_reading),
    Figure("circuit_spectra", "circuits/circuits", C.draw_circuit_spectra),
    Figure("circuit_positions", "circuits/direct", C.draw_circuit_positions),
    Figure("circuit_writes", "circuits/direct", C.draw_circuit_writes),
    Figure("circuit_composition", "circuits/composition", C.draw_circuit_composition),
)
