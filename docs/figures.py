# %% [markdown]
# # The figures of the rendered chapters
#
# Every picture on the page is drawn at build time by running the modules'
# own functions (`sinusoidal_encoding`, `subsequent_mask`, `rate`,
# `attention_explicit`, `smoothed_targets`, a trained model's attention
# probabilities), so a figure cannot disagree with the code next to it.
#
# A `Figure` says what to draw and where it goes: the chapter (module name)
# and the prose heading it illustrates; the page builder (`docs/build.py`)
# puts it right after that heading's prose. `draw(ctx)` returns a matplotlib
# figure and its caption (Markdown; `$...$` is math). Figures are built with
# `matplotlib.figure.Figure` directly, never through `pyplot`, so drawing
# leaves no global state behind.

# %%
from __future__ import annotations

import hashlib
import io
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from matplotlib.figure import Figure as MplFigure

from annotated import transformer as T

ROOT = Path(__file__).resolve().parent.parent
DPI = 90


@dataclass
class FigureContext:
    """What the drawing functions may use: where the repository is, which model to show."""

    root: Path = ROOT
    checkpoint: Optional[Path] = None  # a trained translator; None: use the copy-task model
    copy_steps: int = 300              # training steps of the copy-task model (0: untrained)
    cache_dir: Optional[Path] = None   # where the trained copy-task model is kept between builds
    say: Callable[[str], None] = print
    checkpoint_required: bool = False  # True: a checkpoint that does not load is an error, not a fallback
    notes: list[str] = field(default_factory=list)  # what the build should tell the reader


@dataclass(frozen=True)
class Figure:
    name: str                 # the file is figures/<name>.png
    module: str               # the chapter it illustrates (annotated/<module>.py)
    heading: Optional[str]    # placed after the prose of the heading starting with this; None: chapter end
    draw: Callable[[FigureContext], tuple[MplFigure, str]]


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
    dims = [2 ** i for i in range(0, 10)]  # d_k = 1 ... 512
    var_raw, var_scaled, max_raw, max_scaled = [], [], [], []
    for d_k in dims:
        q = torch.randn(4000, 1, d_k, generator=gen)  # (n, 1, d_k) one query per problem
        k = torch.randn(4000, 16, d_k, generator=gen)  # (n, 16, d_k)
        v = torch.zeros(4000, 16, 1)  # (n, 16, 1) values do not matter here
        raw = (q @ k.transpose(-2, -1)).flatten()  # (n*16,)
        var_raw.append(raw.var().item())
        var_scaled.append((raw / math.sqrt(d_k)).var().item())
        _, p_scaled = T.attention_explicit(q, k, v)  # (n, 1, 16)
        _, p_raw = T.attention_explicit(q * math.sqrt(d_k), k, v)  # (n, 1, 16) = softmax(q k^T)
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
    ax2.set(xlabel=r"$d_k$", ylabel="mean largest weight", ylim=(0, 1.05),
            title="softmax over 16 keys: largest weight")
    ax2.legend()
    caption = ("Random queries and keys with unit-variance components. Unscaled scores have variance "
               "$d_k$ and drive the softmax towards one-hot (largest weight near 1), where its gradients "
               "vanish; divided by $\\sqrt{d_k}$ the variance stays 1 and the weights stay spread, "
               "whatever $d_k$. Drawn with `attention_explicit`.")
    return fig, caption


# %% [markdown]
# ## The subsequent mask and the positional encoding

# %%
def draw_subsequent_mask(ctx: FigureContext) -> tuple[MplFigure, str]:
    T_len = 12
    mask = T.subsequent_mask(T_len)[0]  # (T, T)
    fig = MplFigure(figsize=(3.6, 3.4))
    ax = fig.subplots()
    ax.imshow(mask.int().numpy(), cmap="Greys", vmin=0, vmax=1)
    ax.set(xlabel="key position j", ylabel="query position i", title=f"subsequent_mask({T_len})")
    caption = ("`subsequent_mask(12)[0]`: black where query position $i$ may attend to key position "
               "$j$, that is $j \\le i$; white entries are blocked.")
    return fig, caption


def draw_positional_encoding(ctx: FigureContext) -> tuple[MplFigure, str]:
    pe = T.sinusoidal_encoding(100, 64)  # (100, 64)
    fig = MplFigure(figsize=(10, 3.2))
    ax1, ax2 = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.1, 1]})
    im = ax1.imshow(pe.T.numpy(), aspect="auto", cmap="RdBu", vmin=-1, vmax=1, origin="lower",
                    interpolation="nearest")
    ax1.set(xlabel="position", ylabel="dimension", title="sinusoidal_encoding(100, 64)")
    fig.colorbar(im, ax=ax1)
    for dim in (4, 5, 12, 20):
        ax2.plot(pe[:, dim].numpy(), label=f"dim {dim}")
    ax2.set(xlabel="position", ylim=(-1.3, 1.1), title="four dimensions")
    ax2.legend(loc="lower left", ncol=4, fontsize="small")
    caption = ("The positional encoding for $d_{model} = 64$: even dimensions are sines, odd ones cosines, "
               "with wavelengths growing geometrically from $2\\pi$ to $10000 \\cdot 2\\pi$ along the "
               "dimensions. Right: dimensions 4 and 5, the sine and cosine of one frequency, and the slower "
               "sines of dimensions 12 and 20.")
    return fig, caption


# %% [markdown]
# ## The learning-rate schedule

# %%
def draw_rate(ctx: FigureContext) -> tuple[MplFigure, str]:
    steps = range(1, 20001, 20)
    fig = MplFigure(figsize=(6, 3.2))
    ax = fig.subplots()
    for d_model, warmup in ((512, 4000), (512, 8000), (256, 4000)):
        ax.plot(list(steps), [T.rate(s, d_model, warmup) for s in steps],
                label=f"d_model={d_model}, warmup={warmup}")
    ax.set(xlabel="step", ylabel="learning rate", title="rate(step, d_model, warmup)")
    ax.legend()
    caption = ("`rate(step, d_model, warmup)`: linear warm-up, peak $d_{model}^{-0.5} \\cdot "
               "warmup^{-0.5}$ at step = warmup, then decay as $step^{-0.5}$.")
    return fig, caption


# %% [markdown]
# ## Label smoothing
#
# Drawn with the training module's `smoothed_targets` and
# `label_smoothed_loss` when `annotated/training/train.py` provides them; otherwise with
# the same definition written here, `q(k) = (1 - eps) [k = y] + eps / V`
# (PyTorch's `label_smoothing`), and the caption says so.

# %%
def _smoothing_functions(ctx: FigureContext):
    """(targets(y, V, eps) -> (n, V), loss(logits (B, T, V), y (B, T), eps) -> sum, source note)."""
    try:
        from annotated.training.train import label_smoothed_loss, smoothed_targets
    except ImportError as e:
        ctx.notes.append(f"label smoothing figure: annotated.training.train not importable ({e}); "
                         f"drawn with the formula in docs/figures.py")

        def smoothed_targets(target, vocab, eps):
            q = torch.full((target.numel(), vocab), eps / vocab)  # (n, V)
            q[torch.arange(target.numel()), target.reshape(-1)] += 1 - eps
            return q

        def label_smoothed_loss(logits, target, eps, pad=T.PAD):
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(),
                                                     label_smoothing=eps, reduction="none")
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
    caption = (f"Label smoothing with $\\epsilon = {eps}$ over $V = {V}$ tokens. Left: the training target. "
               "Right: without smoothing the loss keeps falling as the model grows surer of $y$; with "
               "smoothing it is smallest at $p(y) = 1 - \\epsilon + \\epsilon / V$ and penalises "
               f"overconfidence. Drawn with {source}.")
    return fig, caption


# %% [markdown]
# ## Attention pictures
#
# From a trained translator when a checkpoint exists (`runs/latest/best.pt`,
# else the newest `runs/*/best.pt`): the cross-attention of the last decoder
# layer while it translates one sentence, every head. Otherwise from the copy
# task of the first chapter (trained for `copy_steps` steps, and kept in
# `cache_dir` so the next build does not train again): there the decoder
# should read the source one position at a time.

# %%
def find_checkpoint(root: Path) -> Optional[Path]:
    """The translator's default checkpoint (`latest_checkpoint` of root/runs), or None when there is none."""
    from annotated.plumbing.checkpoint import CheckpointError, latest_checkpoint

    try:
        return latest_checkpoint(root / "runs")
    except CheckpointError:
        return None


def copy_task_model(ctx: FigureContext) -> T.EncoderDecoder:
    """The copy-task model, trained once per version of transformer.py and number of steps."""
    from annotated.plumbing.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

    key = hashlib.sha256((ctx.root / "annotated" / "transformer.py").read_bytes()).hexdigest()[:16]
    cached = ctx.cache_dir / f"copy-{ctx.copy_steps}-{key}.pt" if ctx.cache_dir else None
    if cached is not None and cached.is_file():
        try:
            return load_checkpoint(cached)[0]
        except CheckpointError as e:
            ctx.say(f"ignoring the cached copy-task model: {e}")
    ctx.say(f"training the copy-task model for the attention figure ({ctx.copy_steps} steps, "
            f"about {ctx.copy_steps // 15 + 1} s on one CPU core)")
    model = T.train_copy_task(steps=ctx.copy_steps)
    if cached is not None:
        save_checkpoint(cached, model, None, {"copy_steps": ctx.copy_steps})
    return model


def _attention_grid(panels: list[tuple[str, torch.Tensor, list[str], list[str]]], ncols: int,
                    width: float) -> MplFigure:
    """Panels (title, probs (T_q, T_k), query labels, key labels), `ncols` to a row."""
    nrows = -(-len(panels) // ncols)
    fig = MplFigure(figsize=(width, 0.4 + 1.05 * width / ncols * nrows))
    axes = fig.subplots(nrows, ncols, squeeze=False).flatten()
    for j, ax in enumerate(axes):
        if j >= len(panels):
            ax.set_axis_off()
            continue
        title, probs, q_labels, k_labels = panels[j]
        ax.imshow(probs.numpy(), cmap="viridis", vmin=0, vmax=1)
        ax.set_title(title, fontsize="small")
        ax.set_xticks(range(len(k_labels)), [label_text(t) for t in k_labels], rotation=90, fontsize="x-small")
        ax.set_yticks(range(len(q_labels)), [label_text(t) for t in q_labels] if j % ncols == 0 else [],
                      fontsize="x-small")
    return fig


def _copy_attention(ctx: FigureContext) -> tuple[MplFigure, str]:
    model = copy_task_model(ctx)
    gen = torch.Generator().manual_seed(7)
    src = torch.randint(3, model.config.src_vocab, (1, 8), generator=gen)  # (1, S)
    src_mask = T.padding_mask(src, T.PAD)  # (1, 1, S)
    out = T.greedy_decode(model, src, src_mask, max_len=src.size(1) + 1, bos=T.BOS, eos=T.EOS, pad=T.PAD)
    tgt = torch.cat([torch.tensor([[T.BOS]]), out], dim=1)  # (1, T)
    with torch.no_grad():
        memory, enc = model.encode_with_attention(src, src_mask)
        _, _, cross = model.decode_with_attention(memory, src_mask, tgt, T.target_mask(tgt, T.PAD))
    names = {T.BOS: "<s>", T.EOS: "</s>", T.PAD: "<pad>"}
    label = lambda ids: [names.get(t, str(t)) for t in ids.tolist()]  # noqa: E731
    src_l, tgt_l = label(src[0]), label(tgt[0])
    h = model.config.h
    panels = ([(f"encoder, head {i + 1}", enc[-1][0, i], src_l, src_l) for i in range(h)]
              + [(f"cross, head {i + 1}", cross[-1][0, i], tgt_l, src_l) for i in range(h)])
    fig = _attention_grid(panels, ncols=h, width=2.4 * h)
    copied = out[0, :src.size(1)].tolist() == src[0].tolist()
    caption = (f"Attention of the copy-task model (trained {ctx.copy_steps} steps, no checkpoint in `runs/`): "
               f"top, the last encoder layer's self-attention over the source {' '.join(src_l)}; bottom, "
               "the last decoder layer's cross-attention, one row per target position (fed `<s>` and its "
               f"own output, which {'copies the source exactly' if copied else 'is not yet a correct copy'}). "
               "Rows are queries, columns keys; each row sums to 1.")
    return fig, caption


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
    return {"de": "Zwei junge Männer spielen Fußball auf einer Wiese.",
            "fr": "Deux jeunes hommes jouent au football dans un champ.",
            "cs": "Dva mladí muži hrají fotbal na louce."}.get(src_lang, "Two young men play soccer in a field.")


def _checkpoint_attention(ctx: FigureContext) -> tuple[MplFigure, str]:
    from annotated.plumbing.checkpoint import CheckpointError, load_checkpoint

    model, tokenizer, meta = load_checkpoint(ctx.checkpoint)
    if tokenizer is None:
        raise CheckpointError(f"checkpoint {ctx.checkpoint} holds no tokenizer, so no sentence can be encoded")
    sentence = _checkpoint_sentence(ctx.checkpoint, meta.get("src_lang", ""))
    ids = tokenizer.encode(sentence)[: model.config.max_len]
    src = torch.tensor([ids])  # (1, S)
    src_mask = T.padding_mask(src, T.PAD)  # (1, 1, S)
    max_len = min(model.config.max_len - 1, src.size(1) + 20)
    out = T.greedy_decode(model, src, src_mask, max_len=max_len, bos=T.BOS, eos=T.EOS, pad=T.PAD)
    tgt = torch.cat([torch.tensor([[T.BOS]]), out], dim=1)  # (1, T)
    with torch.no_grad():
        memory = model.encode(src, src_mask)
        _, _, cross = model.decode_with_attention(memory, src_mask, tgt, T.target_mask(tgt, T.PAD))
    names = {T.BOS: "<s>", T.EOS: "</s>", T.PAD: "<pad>"}
    label = lambda ids: [names.get(t) or "".join(tokenizer.pieces([t])) for t in ids]  # noqa: E731
    src_l, tgt_l = label(ids), label(tgt[0].tolist())  # one label per position
    probs = cross[-1][0]  # (h, T, S)
    panels = [(f"head {i + 1}", probs[i], tgt_l, src_l) for i in range(probs.size(0))]
    fig = _attention_grid(panels, ncols=min(4, len(panels)), width=12)
    translation = tokenizer.decode(out[0].tolist())
    run = ctx.checkpoint.parent.name
    languages = as_text(f"{meta.get('src_lang', '?')}→{meta.get('tgt_lang', '?')}")
    caption = (f"Cross-attention of the last decoder layer of the trained translator "
               f"{as_text(f'{run}/{ctx.checkpoint.name}')} ({languages}), every head, translating "
               f"“{as_text(sentence)}” greedily into “{as_text(translation)}”. Rows are target "
               "subwords (queries), columns source subwords (keys); each row sums to 1.")
    return fig, caption


def draw_attention(ctx: FigureContext) -> tuple[MplFigure, str]:
    if ctx.checkpoint is not None:
        from annotated.plumbing.checkpoint import CheckpointError

        try:
            return _checkpoint_attention(ctx)
        except CheckpointError as e:
            if ctx.checkpoint_required:
                raise
            ctx.notes.append(f"attention figure: {e}; drawn from the copy-task model instead")
            ctx.say(f"note: {e}; using the copy-task model")
    return _copy_attention(ctx)


# %% [markdown]
# ## The list the page builder reads

# %%
FIGURES: tuple[Figure, ...] = (
    Figure("scaling", "transformer", "1. Attention: a soft dictionary lookup", draw_scaling),
    Figure("subsequent_mask", "transformer", "2. Masks for padding and for the future", draw_subsequent_mask),
    Figure("positional_encoding", "transformer", "Embeddings and positional encoding", draw_positional_encoding),
    Figure("rate", "transformer", "8. A first experiment: learning to copy", draw_rate),
    Figure("attention", "transformer", None, draw_attention),
    Figure("label_smoothing", "training/train", "Label smoothing", draw_label_smoothing),
)
