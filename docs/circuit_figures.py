"""The figures of Part V (annotated/circuits/), drawn from the book's model alone: no data is read.

The pictures that need sentences (faithfulness, the dictionaries in context) come from `make circuits`; the book
shows what the weights say by themselves: every head's singular values, every self-attention head's position
table, what the last layer's cross-attention heads write when they read each word of the book's example
sentence, and how strongly each pair of heads composes.
"""

from __future__ import annotations

import torch
from matplotlib.figure import Figure as MplFigure

from annotated.attention.pictures import LAYOUT
from annotated.circuits.circuits import circuits
from annotated.circuits.composition import composition_figure, composition_record, compositions
from annotated.circuits.direct import ov_table, token_vectors
from annotated.circuits.pictures import positions_figure, spectra_figure
from annotated.circuits.readout import weights_record


def _records(ctx) -> list[dict]:
    model = ctx.shown_sentence().model.eval()
    return [weights_record(model, c) for cs in circuits(model).values() for c in cs]


def draw_circuit_spectra(ctx) -> tuple[MplFigure, str]:
    where = ctx.shown_sentence().name
    caption = (
        f"The singular values of every head's W_QK (solid) and W_OV (dashed), largest first, in {where}: each is a "
        "d_model x d_model matrix of rank at most d_k, computed from its two factors."
    )
    return spectra_figure(_records(ctx)), caption


def draw_circuit_positions(ctx) -> tuple[MplFigure, str]:
    where = ctx.shown_sentence().name
    caption = (
        f"Every self-attention head's position table in {where}: the score the QK circuit gives query position "
        "(down) and key position (across) through the sinusoids alone, each row centred, grey where the decoder "
        "may not look. In the first layer this is an exact part of the score; deeper, a reading through the norms."
    )
    return positions_figure(_records(ctx)), caption


def draw_circuit_writes(ctx) -> tuple[MplFigure, str]:
    shown = ctx.shown_sentence()
    model, src, labels = shown.model.eval(), shown.src[0], shown.labels
    last = model.config.N - 1
    heads = circuits(model)[("cross", last)]
    out_ids = torch.arange(4, model.config.tgt_vocab)  # every token but the special ones
    x = token_vectors(model, ("cross", last), "kv", src)  # (S, d_model) the sentence's tokens, as keys
    tops = [ov_table(model, c, x, out_ids, k=3).ids for c in heads]  # per head (S, 3)
    fig = MplFigure(figsize=(2.2 + 2.3 * len(heads), 0.32 * len(labels) + 1.0), dpi=90, layout=LAYOUT)
    ax = fig.subplots()
    ax.axis("off")
    n = len(labels)
    ax.text(0.0, 1.0, "reads", fontsize=9, fontweight="bold", transform=ax.transAxes, va="bottom")
    for i, c in enumerate(heads):
        x0 = 0.16 + i * 0.84 / len(heads)
        ax.text(x0, 1.0, f"head {c.head} writes", fontsize=9, fontweight="bold", transform=ax.transAxes, va="bottom")
    for r, token in enumerate(labels):
        y = 1 - (r + 1) / (n + 0.5)
        ax.text(0.0, y, token, fontsize=9, transform=ax.transAxes, style="italic")
        for i, top in enumerate(tops):
            x0 = 0.16 + i * 0.84 / len(heads)
            ax.text(x0, y, "  ".join(shown.label(top[r].tolist())), fontsize=9, transform=ax.transAxes)
    caption = (
        f"What each cross-attention head of the last layer writes when it reads a word of the example sentence "
        f"({shown.name}): the three output tokens whose logits x W_OV raises most, through the norms after the head "
        "and the generator (the direct path, from the weights alone)."
    )
    return fig, caption


def draw_circuit_composition(ctx) -> tuple[MplFigure, str]:
    shown = ctx.shown_sentence()
    caption = (
        f"How strongly each pair of heads composes in {shown.name}: the Q-, K- and V-composition score of every "
        "earlier head (down) with every later head (across) that reads its stream, over the mean score of random "
        "matrices with the same singular values (1 is chance); grey where the pair cannot compose that way, a white "
        "dot where the score lies above the random baseline's 95% interval."
    )
    return composition_figure(composition_record(compositions(shown.model.eval()))), caption
