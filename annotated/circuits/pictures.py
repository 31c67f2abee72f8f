# %% [markdown]
# # Pictures of the circuits
#
# Drawn from `circuits.json` in the colours of `annotated/attention/pictures.py`:
# each head's singular values (`circuits_spectra.png`, `W_QK` solid, `W_OV`
# dashed), every self-attention head's position table titled with the label
# its weights give and the role measured on its attention
# (`circuits_positions.png`), each head's faithfulness (both readings, with
# intervals), and the best cross head's dictionaries, the aligner's
# translation in bold (`circuits_dictionary.png`).

# %%
from __future__ import annotations

from typing import Any

import matplotlib
import numpy as np
from matplotlib.figure import Figure

from annotated.attention.pictures import CMAP, KIND_LABELS, LAYOUT, head_colours


def _sites(heads: list[dict]) -> list[tuple[str, int]]:
    return sorted({(h["site"][0], h["site"][1]) for h in heads}, key=lambda s: (list(KIND_LABELS).index(s[0]), s[1]))


def spectra_figure(heads: list[dict]) -> Figure:
    sites = _sites(heads)
    layers = max(s[1] for s in sites) + 1
    fig = Figure(figsize=(3.2 * layers + 1, 2.4 * 3 + 0.6), dpi=90, layout=LAYOUT)
    axes = fig.subplots(3, layers, squeeze=False, sharey=True)
    colours = head_colours(max(h["head"] for h in heads) + 1)
    for r, kind in enumerate(KIND_LABELS):
        for layer in range(layers):
            ax = axes[r][layer]
            for h in (h for h in heads if h["site"] == [kind, layer]):
                ax.semilogy(h["qk"]["singular_values"], color=colours[h["head"]], label=f"head {h['head']}")
                ax.semilogy(h["ov"]["singular_values"], color=colours[h["head"]], linestyle="--")
            ax.set_title(f"{KIND_LABELS[kind]}, layer {layer}", fontsize=9)
            ax.set_xlabel("singular value number", fontsize=8)
    for row in axes:
        row[0].set_ylabel("singular value", fontsize=8)
    fig.suptitle("Singular values of each head's circuits: W_QK solid, W_OV dashed", fontsize=10)
    axes[0][0].legend(fontsize=7)
    return fig


def positions_figure(heads: list[dict]) -> Figure:
    rows = [h for h in heads if h["site"][0] != "cross"]
    sites = _sites(rows)
    n_heads = max(h["head"] for h in rows) + 1
    fig = Figure(figsize=(2.1 * n_heads + 1.2, 2.1 * len(sites) + 0.8), dpi=90, layout=LAYOUT)
    axes = fig.subplots(len(sites), n_heads, squeeze=False)
    im = None
    for r, site in enumerate(sites):
        for i in range(n_heads):
            ax = axes[r][i]
            found = [h for h in rows if tuple(h["site"]) == site and h["head"] == i]
            if not found:  # pruned away
                ax.axis("off")
                continue
            t = np.array(found[0]["positions"]["table"], dtype=float)
            t[~np.isfinite(t)] = np.nan
            bound = np.nanmax(np.abs(t)) or 1.0
            colours = matplotlib.colormaps[CMAP].with_extremes(bad="#d0d0d0")
            im = ax.imshow(t / bound, cmap=colours, vmin=-1, vmax=1, interpolation="nearest")
            exact = " (exact)" if found[0]["exact_direct_path"] else ""
            role = found[0].get("roles", {}).get("label")  # measured on the real attention, when it was
            measured = f"; argmax: {role}" if role else ""
            ax.set_title(
                f"{site[0]} {site[1]}, head {i}{exact}\nweights: {found[0]['positions']['label']}{measured}", fontsize=8
            )
            ax.set_xticks([0, 10, 20]), ax.set_yticks([0, 10, 20])
            ax.tick_params(labelsize=7)
    fig.supxlabel("key position", fontsize=9)
    fig.supylabel("query position", fontsize=9)
    if im is not None:
        fig.colorbar(im, ax=axes, shrink=0.6, label="score, centred per row, / the head's largest")
    return fig


def faithfulness_figure(heads: list[dict]) -> Figure:
    rows = [h for h in heads if "faithfulness" in h]
    fig = Figure(figsize=(max(6.0, 0.42 * len(rows) + 1.5), 3.4), dpi=90, layout=LAYOUT)
    ax = fig.subplots()
    kinds = list(KIND_LABELS)
    colours = matplotlib.colormaps[CMAP](np.linspace(0.15, 0.85, len(kinds)))
    readings = (
        ("faithfulness", -0.2, 0.45, "weights only"),
        ("faithfulness_exact_norms", 0.2, 1.0, "norms exact"),
    )
    for x, h in enumerate(rows):
        c = colours[kinds.index(h["site"][0])]
        for field, dx, alpha, label in readings:
            if field not in h:
                continue
            value, low, high = h[field]["rho"]
            hatch = "" if h["exact_direct_path"] else "//"
            ax.bar(
                x + dx,
                value,
                width=0.4,
                color=c,
                alpha=alpha,
                hatch=hatch,
                edgecolor="white",
                label=label if x == 0 else None,
            )
            ax.errorbar(x + dx, value, yerr=[[value - low], [high - value]], color="black", capsize=2)
    ax.set_xticks(
        range(len(rows)), [f"{h['site'][0]} {h['site'][1]}.{h['head']}" for h in rows], rotation=90, fontsize=7
    )
    ax.set_ylim(-0.1, 1.05)
    ax.set_ylabel("rank correlation, reading vs real scores", fontsize=8)
    ax.legend(fontsize=7, loc="upper right")
    ax.set_title(
        "How much of each head the direct path explains: weights only (pale), with the norms exact (full);\n"
        "hatched: the sublayers' writes left out; 95% intervals",
        fontsize=9,
    )
    return fig


MIN_LETTERS = 4  # the dictionary picture shows the most frequent source words of at least this many letters


def dictionary_figure(head: dict[str, Any], lexicon: dict[str, list[tuple[str, float]]], n: int = 16) -> Figure:
    """The head's two dictionaries for the first n source words: what it writes (OV), whose queries pick it (QK)."""
    words = [w for w in head["dictionary"]["ov"] if len(w) >= MIN_LETTERS][:n]  # content words, mostly
    fig = Figure(figsize=(10.0, 0.3 * n + 1.4), dpi=90, layout=LAYOUT)
    ax = fig.subplots()
    ax.axis("off")
    site, i = head["site"], head["head"]
    ov, qk = head["dictionary"]["ov_precision"], head["dictionary"]["qk_precision"]
    ax.set_title(
        f"{site[0]} layer {site[1]}, head {i}, in context. Bold: the aligner's best translation.\n"
        f"reads -> writes (OV: precision@1 {ov[0]:.2f}, @5 {ov[1]:.2f})"
        f"{'':<30}queries that pick it (QK: @1 {qk[0]:.2f}, @5 {qk[1]:.2f})",
        fontsize=9,
    )
    for r, word in enumerate(words):
        y = 1 - (r + 0.5) / n
        best = lexicon.get(word, [("", 0.0)])[0][0]
        ax.text(0.0, y, word, fontsize=9, ha="left", va="center", transform=ax.transAxes, style="italic")
        for x0, part in ((0.12, "ov"), (0.56, "qk")):
            for k, t in enumerate(head["dictionary"][part][word][:4]):
                weight = "bold" if t == best else "normal"
                ax.text(x0 + 0.105 * k, y, t, fontsize=9, va="center", transform=ax.transAxes, fontweight=weight)
    return fig
