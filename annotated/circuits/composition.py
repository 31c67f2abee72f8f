# %% [markdown]
# # Which earlier heads a head reads through: composition
#
# Head `A` adds `x W_OV^A` to the stream; a later head `B` reads it through
# `W_QK^B` and `W_OV^B`, so the part of `B` that reads `A` is a product of the
# two circuits, and how much of the two survives it says how strongly they
# **compose** (Elhage et al. 2021; TransformerLens's `all_composition_scores`):
#
# $$Q:\ \frac{\lVert W_{OV}^{A}\, W_{QK}^{B} \rVert_F}{\lVert W_{OV}^{A}\rVert_F\, \lVert W_{QK}^{B}\rVert_F}$$
#
# $$K:\ \frac{\lVert W_{OV}^{A}\, {W_{QK}^{B}}^{\top} \rVert_F}{\lVert W_{OV}^{A}\rVert_F\, \lVert W_{QK}^{B}\rVert_F}$$
#
# $$V:\ \frac{\lVert W_{OV}^{A}\, W_{OV}^{B} \rVert_F}{\lVert W_{OV}^{A}\rVert_F\, \lVert W_{OV}^{B}\rVert_F}$$
#
# for `A` writing into `B`'s queries, keys (as a previous-token head builds
# an induction head's keys) or values, each between 0 and 1. Encoder heads
# compose with later encoder heads and with every cross-attention's keys and
# values; decoder heads with later decoder heads and with the queries of
# cross-attention at or after their layer (`composition_paths`;
# `test_composition_pairs_are_the_encoder_decoders_paths`). The LayerNorms
# between (`norms_between`) divide by one number per position, which the
# ratio does not see, but their centring and gains change the product: `A`
# is scored *as it arrives*, `W_OV^A N` with `N` those as one matrix, and
# also without the gains. Random matrices compose too, about
# `1 / sqrt(d_model)`, so each score stands beside a **baseline** (section
# 2), and a pair stands out above its baseline's 95% interval.
#
# <!-- figure: circuit_composition -->

# %%
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import matplotlib
import numpy as np
import torch
from matplotlib.figure import Figure
from torch import Tensor, nn

from annotated.attention.pictures import CMAP, LAYOUT, MASKED
from annotated.circuits.circuits import Factored, HeadCircuit, circuits
from annotated.circuits.direct import layer_norms, norms_on_the_way, point
from annotated.sites import Site, sites
from annotated.transformer import EncoderDecoder

SAMPLES = 1000  # random draws of the baseline
SEED = 0  # the baseline's draws are the same on every run
KINDS = ("Q", "K", "V")

# %% [markdown]
# ## 1. The Frobenius norm of a product, from its factors
#
# With `M = L R`, `||M||_F^2 = trace((L^T L)(R R^T))`: the two `r x r` Gram
# matrices multiplied entry by entry and summed; and `(L_1 R_1)(L_2 R_2) =
# L_1 (R_1 L_2 R_2)` is factored again. So no score needs a
# `d_model x d_model` matrix, and all are in float64
# (`test_composition_score_is_the_materialised_ratio`).


# %%
def frobenius(f: Factored) -> float:
    """||left @ right||_F from the r x r Gram matrices of the factors, in float64."""
    L, R = f.left.double(), f.right.double()
    return math.sqrt(max(float(((L.T @ L) * (R @ R.T)).sum()), 0.0))


def product(a: Factored, b: Factored) -> Factored:
    """a @ b, kept factored: L_a (R_a L_b R_b)."""
    return Factored(a.left, (a.right @ b.left) @ b.right)


def composition_score(left: Factored, right: Factored) -> float:
    """Elhage et al.'s ratio ||left right||_F / (||left||_F ||right||_F), between 0 and 1."""
    denominator = frobenius(left) * frobenius(right)
    return frobenius(product(left, right)) / denominator if denominator > 0 else 0.0


def reading(c: HeadCircuit, kind: str) -> Factored:
    """What head c reads an earlier head's write through: its QK for Q, QK^T for K, its OV for V."""
    return {
        "Q": c.QK,  # W_Q W_K^T: the write enters on the query's side
        "K": Factored(c.QK.right.T, c.QK.left.T),  # W_K W_Q^T: on the key's side
        "V": c.OV,
    }[kind]


# %% [markdown]
# ## 2. The random baseline
#
# With `A = U_A S_A V_A^T` and `B = U_B S_B V_B^T`,
# `||A B||_F = ||S_A (V_A^T U_B) S_B||_F`: only the overlap `V_A^T U_B` of
# `A`'s input space with `B`'s output space matters, and with random singular
# vectors it is the top `r_A x r_B` block of a random `d x r_B` matrix with
# orthonormal columns. One set of draws serves every pair of a shape
# (`test_the_baseline_is_that_of_random_matrices`).


# %%
def random_overlaps(d: int, r_a: int, r_b: int, samples: int = SAMPLES, seed: int = SEED) -> Tensor:
    """`samples` draws of V_A^T U_B for random orthonormal V_A (d, r_a), U_B (d, r_b): (samples, r_a, r_b)."""
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(samples, d, r_b, generator=g, dtype=torch.float64))  # (samples, d, r_b)
    return Q[:, :r_a, :]  # (samples, r_a, r_b)


def random_baselines(s_a: Tensor, s_b: Tensor, overlaps: Tensor, chunk: int = 64) -> list[tuple[float, float, float]]:
    """(mean, 2.5%, 97.5%) of the score of matrices with singular values s_a (P, r_a), s_b (P, r_b) and random
    singular vectors, for P pairs at once, from one shared set of overlaps.

    `||S_A M S_B||_F^2 = sum_ij s_i^2 M_ij^2 t_j^2`, so the squared overlaps (N, r_a, r_b) times the squared
    singular values is one matrix product for all the pairs of a chunk."""
    N, r_a, r_b = overlaps.shape
    M2 = (overlaps * overlaps).reshape(N * r_a, r_b)  # (N r_a, r_b)
    out = []
    for start in range(0, s_a.size(0), chunk):
        a2, b2 = s_a[start : start + chunk].double() ** 2, s_b[start : start + chunk].double() ** 2  # (P, r)
        squared = ((M2 @ b2.T).reshape(N, r_a, -1) * a2.T).sum(1)  # (N, P)
        scores = squared.sqrt() / (a2.sum(1) * b2.sum(1)).sqrt()  # (N, P)
        q = torch.quantile(scores, torch.tensor([0.025, 0.975], dtype=torch.float64), dim=0)  # (2, P)
        out += list(zip(scores.mean(0).tolist(), q[0].tolist(), q[1].tolist()))
    return out


# %% [markdown]
# ## 3. Which pairs compose, and the norms between them
#
# A head writes into its stream at its own sublayer and reads it just before
# (`direct.py`, section 1: `point`); `A` can compose with `B` on a side when
# both lie on the same stream and `A`'s sublayer comes first.


# %%
def norms_between(model: EncoderDecoder, writer: Site, reader: Site, side: str) -> list[nn.LayerNorm] | None:
    """The LayerNorms between `writer`'s output and `reader`'s input on `side` ("q" or "kv"), in order; None when
    the writer's output never reaches that input along the residual stream."""
    stack, wrote_at = point(model, writer)
    read_stack, read_at = point(model, reader, side)
    if read_stack != stack or wrote_at >= read_at:
        return None
    return layer_norms(model, norms_on_the_way(model, stack, wrote_at, read_at))


def norm_matrix(lns: list[nn.LayerNorm], d_model: int, gains: bool = True) -> Tensor:
    """The norms' centring (and gains) as one (d_model, d_model) matrix acting on row vectors, float64."""
    N = torch.eye(d_model, dtype=torch.float64)
    for ln in lns:
        N = N - N.mean(-1, keepdim=True)  # x - mean(x), for each row x
        if gains and ln.weight is not None:
            N = N * ln.weight.detach().double()
    return N


def composition_paths(model: EncoderDecoder) -> list[tuple[Site, Site, str]]:
    """Every (writer site, reader site, kind) that can compose, writers in the order of `sites`."""
    return [
        (writer, reader, kind)
        for writer, reader, kind in itertools.product(sites(model), sites(model), KINDS)
        if norms_between(model, writer, reader, "q" if kind == "Q" else "kv") is not None
    ]


# %% [markdown]
# ## 4. Every pair of heads
#
# `compositions` scores every pair on every path, through the norms and
# without their gains, beside its baseline; the pairs that **stand out** lie
# above their baseline's interval (`standing_out`). In a two-layer model with
# a planted previous-token head feeding a second-layer head's keys, that pair
# and no other stands out
# (`test_a_planted_previous_token_head_is_found_by_k_composition`).


# %%
@dataclass(frozen=True)
class Composition:
    """One pair: earlier head `writer` and later head `reader` composing by `kind` (Q, K or V)."""

    writer: tuple[str, int, int]  # (kind, layer, head)
    reader: tuple[str, int, int]
    kind: str
    score: float  # through the norms between: centring and gains
    without_gains: float  # through their centring only
    baseline: tuple[float, float, float]  # mean, 2.5%, 97.5% of random matrices with the same singular values

    @property
    def above(self) -> float:
        """The score over the baseline's mean: 1 is chance."""
        return self.score / self.baseline[0]

    def record(self) -> dict[str, Any]:
        return {
            "writer": list(self.writer),
            "reader": list(self.reader),
            "kind": self.kind,
            "score": self.score,
            "without_gains": self.without_gains,
            "baseline": list(self.baseline),
        }


@torch.no_grad()
def compositions(model: EncoderDecoder, samples: int = SAMPLES, seed: int = SEED) -> list[Composition]:
    """Every pair of heads that can compose, with its three numbers; float64 throughout."""
    heads = circuits(model)
    d = model.config.d_model
    readings: dict[tuple[Site, int, str], tuple[Factored, Tensor]] = {}  # each reader's matrix and singular values
    found: list[tuple[tuple, tuple, str, float, float, Tensor, Tensor]] = []
    for writer, reader, kind in composition_paths(model):
        lns = norms_between(model, writer, reader, "q" if kind == "Q" else "kv")
        assert lns is not None
        N, centring = norm_matrix(lns, d), norm_matrix(lns, d, gains=False)
        for a in heads[writer]:
            V, O = a.OV.left.double(), a.OV.right.double()
            left, plain = Factored(V, O @ N), Factored(V, O @ centring)  # W_OV^A as it arrives at the reader
            s_a = left.singular_values()
            for b in heads[reader]:
                if (reader, b.head, kind) not in readings:
                    right = reading(b, kind)
                    right = Factored(right.left.double(), right.right.double())
                    readings[reader, b.head, kind] = right, right.singular_values()
                right, s_b = readings[reader, b.head, kind]
                score, without = composition_score(left, right), composition_score(plain, right)
                found.append(((*writer, a.head), (*reader, b.head), kind, score, without, s_a, s_b))
    baselines: dict[int, tuple[float, float, float]] = {}
    shapes = sorted({(f[5].numel(), f[6].numel()) for f in found})
    for shape in shapes:  # one set of random overlaps per shape, every pair of that shape at once
        index = [i for i, f in enumerate(found) if (f[5].numel(), f[6].numel()) == shape]
        s_a, s_b = torch.stack([found[i][5] for i in index]), torch.stack([found[i][6] for i in index])
        overlaps = random_overlaps(d, *shape, samples=samples, seed=seed)
        baselines.update(zip(index, random_baselines(s_a, s_b, overlaps)))
    return [
        Composition(writer=w, reader=r, kind=k, score=sc, without_gains=wg, baseline=baselines[i])
        for i, (w, r, k, sc, wg, _, _) in enumerate(found)
    ]


def standing_out(pairs: list[Composition], n: int | None = None) -> list[Composition]:
    """The pairs above their baseline's interval, the highest score over baseline first (the first n)."""
    found = sorted((p for p in pairs if p.score > p.baseline[2]), key=lambda p: -p.above)
    return found if n is None else found[:n]


def head_name(head: tuple[str, int, int] | list) -> str:
    """'cross 1.2': kind, layer.head, as the table of `make circuits` names heads.

    >>> head_name(("enc_self", 0, 3))
    'enc_self 0.3'
    """
    return f"{head[0]} {head[1]}.{head[2]}"


def reads_through(pairs: list[dict[str, Any]], reader: list | tuple, n: int = 3) -> dict[str, list]:
    """For one reader head, its n best-composing writers of each kind from the records of `composition_record`:
    {kind: [[writer, score, score over the baseline's mean, above its interval]]}, the most above chance first."""
    out: dict[str, list] = {}
    for kind in KINDS:
        mine = [p for p in pairs if p["reader"] == list(reader) and p["kind"] == kind]
        mine.sort(key=lambda p: -p["score"] / p["baseline"][0])
        if mine:
            out[kind] = [
                [p["writer"], p["score"], p["score"] / p["baseline"][0], p["score"] > p["baseline"][2]]
                for p in mine[:n]
            ]
    return out


def composition_record(pairs: list[Composition], shown: int = 12) -> dict[str, Any]:
    """The JSON of `make circuits`: every pair, the ones that stand out, and what the gains change."""
    changes = [abs(p.score - p.without_gains) for p in pairs]
    return {
        "samples": SAMPLES,
        "pairs": [p.record() for p in pairs],
        "standing_out": [p.record() for p in standing_out(pairs, shown)],
        "stand_out_count": len(standing_out(pairs)),
        "largest_gain_change": max(changes) if changes else 0.0,
    }


def format_composition(record: dict[str, Any]) -> str:
    """The table of the pairs that stand out, for stdout."""
    lines = [
        f"composition: {record['stand_out_count']} of {len(record['pairs'])} pairs above their random baseline's "
        f"95% interval; the norms' gains move a score by at most {record['largest_gain_change']:.3f}",
        f"{'writer':<14} {'reader':<14} {'kind':>4} {'score':>6} {'baseline [95%]':>22} {'x chance':>8}",
    ]
    for p in record["standing_out"]:
        mean, low, high = p["baseline"]
        lines.append(
            f"{head_name(p['writer']):<14} {head_name(p['reader']):<14} {p['kind']:>4} {p['score']:>6.3f} "
            f"{mean:>7.3f} [{low:.3f}, {high:.3f}] {p['score'] / mean:>8.2f}"
        )
    return "\n".join(lines)


# %% [markdown]
# ## 5. The picture
#
# `circuits_composition.png`: one panel per kind, earlier heads down, later
# heads across, the score over its baseline's mean in the project's colour
# map (`CMAP`); grey where a pair cannot compose, a white dot above the
# baseline's interval.


# %%
def composition_figure(record: dict[str, Any]) -> Figure:
    pairs = record["pairs"]
    order = lambda h: (h[0] != "enc_self", h[1], h[0] == "cross", h[2])  # encoder, then each decoder layer's two
    writers = sorted({tuple(p["writer"]) for p in pairs}, key=order)
    readers = sorted({tuple(p["reader"]) for p in pairs}, key=order)
    top = max([p["score"] / p["baseline"][0] for p in pairs] + [1.0])
    fig = Figure(figsize=(4.2 * len(KINDS) + 1.2, 0.22 * len(writers) + 2.4), dpi=90, layout=LAYOUT)
    axes = fig.subplots(1, len(KINDS), squeeze=False)[0]
    colours = matplotlib.colormaps[CMAP].with_extremes(bad=MASKED)
    im = None
    for ax, kind in zip(axes, KINDS):
        grid = np.full((len(writers), len(readers)), np.nan)
        marks = []
        for p in (p for p in pairs if p["kind"] == kind):
            r, c = writers.index(tuple(p["writer"])), readers.index(tuple(p["reader"]))
            grid[r, c] = p["score"] / p["baseline"][0]
            if p["score"] > p["baseline"][2]:
                marks.append((c, r))
        im = ax.imshow(grid, cmap=colours, vmin=0.0, vmax=top, interpolation="nearest", aspect="auto")
        if marks:
            ax.scatter(*zip(*marks), s=6, color="white")
        ax.set_title(f"{kind}-composition", fontsize=9)
        ax.set_yticks(range(len(writers)), [head_name(h) for h in writers], fontsize=6)
        ax.set_xticks(range(len(readers)), [head_name(h) for h in readers], fontsize=6, rotation=90)
        ax.set_xlabel("later head (reads)", fontsize=8)
    axes[0].set_ylabel("earlier head (writes)", fontsize=8)
    if im is not None:
        fig.colorbar(im, ax=axes, shrink=0.8, label="score / random baseline's mean (1: chance)")
    fig.suptitle("How strongly each pair of heads composes (white dot: above the baseline's 95% interval)", fontsize=10)
    return fig
