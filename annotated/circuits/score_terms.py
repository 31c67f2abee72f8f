# %% [markdown]
# # Where each score comes from, and what the attention does
#
# The direct path reads a head from its weights alone; this page asks the
# converse of its *real* scores on real sentences: how much comes from the
# tokens, the positions, and what the sublayers before wrote; and where the
# attention actually falls, so that every role the book gives a head is a
# measured share.
#
# With dropout off, every vector a head reads is exactly the sum of four
# parts: **token** (`E[t] sqrt(d_model)`), **position** (`PE[pos]`), **norm
# bias** (the LayerNorms' `beta`) and **written** (what the sublayers wrote);
# a LayerNorm is affine once its divisor is fixed at the real pass's value,
# so each part goes through it. Splitting query and key into the parts (the
# head's biases counted with the norms') gives six terms of the score: token
# x token, position x position, token x position, position x token, **bias**
# (a bias on one side, nothing written) and **written**, adding up to the
# model's own scores within 1e-12 in float64
# (`test_score_terms_sum_to_the_real_scores`). Centred over each query's
# allowed keys (the softmax sees the scores up to a constant), the total `s`
# is the sum of the centred terms `t_k`, and its variance splits exactly:
#
# $$\sum s^2 = \sum_k \sum t_k\, s, \qquad \text{share}_k = \frac{\sum t_k s}{\sum s^2}$$
#
# per sentence, averaged with a 95% bootstrap interval
# (`test_the_record_has_every_term_and_its_interval`). And where each query's
# real argmax falls: the **first** key, itself (**self**), the one before
# (**previous**), the **last** key, and for cross-attention a piece of the
# source word the aligner links to the word being predicted (**aligned**). A
# head's **role** takes at least half its queries, else it is `mixed`
# (`test_roles_are_read_from_the_real_attention`).

# %%
from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
from torch import Tensor, nn

from annotated.attention.bootstrap import CONFIDENCE, RESAMPLES, SEED, resample_counts
from annotated.circuits.circuits import (
    HeadCircuit,
    allowed_keys,
    attention_inputs,
    attentions,
    circuits,
    head_matrices,
    teacher_forced,
)
from annotated.circuits.fold import STREAMS, sublayers
from annotated.circuits.metrics import piece_words
from annotated.sites import Site
from annotated.transformer import EncoderDecoder, Residual, padding_mask

PARTS = ("token", "position", "norm_bias", "written")  # the residual stream, exactly
TERMS = ("token x token", "position x position", "token x position", "position x token", "bias", "written")
ROLES = ("first", "self", "previous", "last", "aligned")
ROLE_SHARE = 0.5  # a role names a head when it takes at least this share of the queries
SENTENCES = 20  # sentences split at once: their parts at every sublayer, in float64, are what a pass keeps

# %% [markdown]
# ## 1. The stream's parts at every attention
#
# `stream_parts` runs the model once with forward hooks on every `Residual`
# sublayer and its LayerNorm, which give each sublayer's output (`z - x`
# post-norm, `output - x` pre-norm); the parts are then carried along each
# stream in the model's order, and those each attention reads are kept.

# %%
Parts = dict[str, Tensor]  # part name -> (B, T, d_model)


def _through_norm(parts: Parts, ln: nn.Module, z: Tensor) -> Parts:
    """The parts of LayerNorm(z) when `parts` sum to z: each centred, scaled by gamma / sigma(z), beta added."""
    if not isinstance(ln, nn.LayerNorm):  # the post-norm stacks' final_ln is the identity
        return parts
    sigma = (z.var(-1, unbiased=False, keepdim=True) + ln.eps).sqrt()  # (B, T, 1): the real pass's divisor
    gamma = ln.weight if ln.weight is not None else torch.ones_like(z[0, 0])
    out = {name: (v - v.mean(-1, keepdim=True)) / sigma * gamma for name, v in parts.items()}
    if ln.bias is not None:
        out["norm_bias"] = out["norm_bias"] + ln.bias
    return out


@torch.no_grad()
def stream_parts(model: EncoderDecoder, src: Tensor, tgt: Tensor, pad: int) -> dict[Site, tuple[Parts, Parts]]:
    """For every attention site: (the parts of its queries' input, of its keys' input), each (B, T, d_model)."""
    pre = model.config.norm == "pre"
    seen: dict[int, dict[str, Tensor]] = {}

    def watch(module: nn.Module, what: str):
        def hook(mod, args, output) -> None:
            seen.setdefault(id(module), {})[what] = args[0]
            seen[id(module)][what + "_out"] = output

        return hook

    residuals = [name for stack in STREAMS for name in sublayers(model, stack)]  # in the streams' order
    modules = cast(list[Residual], [model.get_submodule(name) for name in residuals])
    handles = [m.register_forward_hook(watch(m, "x")) for m in modules]
    handles += [m.ln.register_forward_hook(watch(m, "z")) for m in modules]
    handles += [f.register_forward_hook(watch(f, "z")) for f in (model.encoder.final_ln, model.decoder.final_ln)]
    teacher_forced(model, src, tgt, pad, handles)

    def start(embed: nn.Module, ids: Tensor) -> Parts:
        token = embed(ids)  # (B, T, d_model)
        position = model.pos.pe[: ids.size(1)].to(token.dtype).expand_as(token)
        return {
            "token": token,
            "position": position,
            "norm_bias": torch.zeros_like(token),
            "written": torch.zeros_like(token),
        }

    reads = {"res_attn": "enc_self", "res_self": "dec_self", "res_cross": "cross"}
    queries: dict[Site, Parts] = {}
    streams = {"encoder": start(model.src_embed, src), "decoder": start(model.tgt_embed, tgt)}
    memory: Parts = {}
    for residual, module in zip(residuals, modules):
        stack, _, l, name = residual.split(".")
        if stack == "decoder" and not memory:  # the encoder is done: its output is every cross-attention's keys
            final = seen.get(id(model.encoder.final_ln))
            memory = (
                _through_norm(streams["encoder"], model.encoder.final_ln, final["z"]) if final else streams["encoder"]
            )
        parts, record = streams[stack], seen[id(module)]
        if name in reads:  # what this sublayer's attention reads
            queries[(reads[name], int(l))] = _through_norm(parts, module.ln, record["z"]) if pre else parts
        if pre:  # x + sublayer(LayerNorm(x))
            parts = {**parts, "written": parts["written"] + (record["x_out"] - record["x"])}
        else:  # LayerNorm(x + sublayer(x))
            z = record["z"]
            parts = _through_norm({**parts, "written": parts["written"] + (z - record["x"])}, module.ln, z)
        streams[stack] = parts
    return {site: (queries[site], memory if site[0] == "cross" else queries[site]) for site in attentions(model)}


# %% [markdown]
# ## 2. One head's score in six terms
#
# Each part is projected once per side (`x W_Q`, `x W_K`), the head's own
# bias joining the bias part. With `t`, `p`, `b`, `w` the token, position,
# bias and written parts and `f` the whole, eight products give the six
# terms, each of the 16 pairs of parts in exactly one:
#
# $$\text{written} = q_f k_w^{\top} + q_w (k_f - k_w)^{\top}, \qquad
# \text{bias} = q_b (k_t + k_p + k_b)^{\top} + (q_t + q_p) k_b^{\top}$$
#
# and `q_t k_t^T`, `q_p k_p^T`, `q_t k_p^T`, `q_p k_t^T`, each over `sqrt(d_k)`.


# %%
def score_terms(c: HeadCircuit, W: dict[str, Tensor | None], q_parts: Parts, k_parts: Parts) -> dict[str, Tensor]:
    """The six terms (B, T_q, T_k) of head c's scores; `W` holds its W_Q, W_K, b_Q, b_K (`head_matrices`)."""
    W_Q, W_K, b_Q, b_K = W["W_Q"], W["W_K"], W["b_Q"], W["b_K"]
    assert W_Q is not None and W_K is not None

    def project(parts: Parts, M: Tensor, bias: Tensor | None) -> dict[str, Tensor]:
        out = {name: parts[name] @ M for name in ("token", "position", "written")}  # (B, T, d_k) each
        out["bias"] = parts["norm_bias"] @ M + (bias if bias is not None else 0.0)
        out["whole"] = out["token"] + out["position"] + out["bias"] + out["written"]
        return out

    q, k = project(q_parts, W_Q, b_Q), project(k_parts, W_K, b_K)
    dot = lambda a, b: a @ b.transpose(-1, -2)  # (B, T_q, T_k)
    terms = {
        "token x token": dot(q["token"], k["token"]),
        "position x position": dot(q["position"], k["position"]),
        "token x position": dot(q["token"], k["position"]),
        "position x token": dot(q["position"], k["token"]),
        "bias": dot(q["bias"], k["token"] + k["position"] + k["bias"]) + dot(q["token"] + q["position"], k["bias"]),
        "written": dot(q["whole"], k["written"]) + dot(q["written"], k["whole"] - k["written"]),
    }
    return {name: t * c.scale for name, t in terms.items()}


# %% [markdown]
# ## 3. Shares of the score, and what the attention does, per sentence


# %%
def variance_shares(terms: dict[str, Tensor], allowed: Tensor) -> dict[str, Tensor]:
    """Per sentence (B,): each term's share sum(t_k s) / sum(s^2) of the scores centred over allowed keys."""
    n = allowed.sum(-1, keepdim=True).clamp(min=1)  # (B, T_q, 1)
    centred = {
        name: (t - (t * allowed).sum(-1, keepdim=True) / n) * allowed for name, t in terms.items()
    }  # (B, T_q, T_k), 0 where not allowed
    total = sum(centred.values())
    assert isinstance(total, Tensor)
    energy = (total * total).sum((-1, -2)).clamp(min=1e-300)  # (B,)
    return {name: (t * total).sum((-1, -2)) / energy for name, t in centred.items()}


def argmax_roles(scores: Tensor, allowed: Tensor, kind: str) -> dict[str, Tensor]:
    """Per sentence (B,): the share of queries whose argmax key is the first, the query itself, the previous
    position, the last allowed key. Queries counted: those with two keys or more (and for self-attention not the
    first position, so every role is possible for each); NaN for a role the kind cannot have."""
    B, T_q, _ = scores.shape  # (B, T_q, T_k)
    best = scores.masked_fill(~allowed, float("-inf")).argmax(-1)  # (B, T_q)
    a = torch.arange(T_q).expand(B, T_q)
    counted = allowed.sum(-1) >= 2
    if kind != "cross":
        counted = counted & (a >= 1)
    last = (allowed.cumsum(-1) == allowed.sum(-1, keepdim=True)).to(torch.int64).argmax(-1)  # (B, T_q)
    hits = {"first": best == 0, "self": best == a, "previous": best == a - 1, "last": best == last}
    if kind == "cross":  # query and key positions lie in two sentences
        hits.pop("self"), hits.pop("previous")
    if kind == "dec_self":  # a decoder query's last key is itself
        hits.pop("last")
    n = counted.sum(-1).clamp(min=1).to(torch.float64)
    out = {role: (hit & counted).sum(-1) / n for role, hit in hits.items()}
    return {role: out.get(role, torch.full((B,), float("nan"), dtype=torch.float64)) for role in ROLES[:4]}


@dataclass
class HeadReading:
    """Per sentence, for one head: each term's share of the score variance, and where the argmax falls."""

    shares: dict[str, list[float]]
    roles: dict[str, list[float]]


@torch.no_grad()
def read_scores(
    model: EncoderDecoder, batches: Iterable[tuple[Tensor, Tensor]], pad: int, chunk: int = SENTENCES
) -> dict[tuple[Site, int], HeadReading]:
    """Every head's per-sentence shares and roles over (src (B, S), tgt (B, T): the decoder's input) batches.

    Computed in float64 on a float64 copy of `model` (the split is then exact to rounding), `chunk` sentences of a
    batch at a time: every part of every sublayer is kept during a pass, and a smaller pass keeps less."""
    model64 = copy.deepcopy(model).double().eval()
    heads, atts = circuits(model64), attentions(model64)
    matrices = {(s, c.head): head_matrices(atts[s], c.head) for s, cs in heads.items() for c in cs}
    out: dict[tuple[Site, int], HeadReading] = {}
    pieces = ((s[i : i + chunk], t[i : i + chunk]) for s, t in batches for i in range(0, s.size(0), chunk))
    for src, tgt in pieces:
        parts = stream_parts(model64, src, tgt, pad)
        for site, cs in heads.items():
            allowed = allowed_keys(site[0], src, tgt, pad)
            real = (allowed.sum(-1) >= 2).any(-1)  # (B,): the sentences with a query that has a choice of keys
            for c in cs:
                terms = score_terms(c, matrices[site, c.head], *parts[site])
                shares = variance_shares(terms, allowed)
                roles = argmax_roles(sum(terms.values()), allowed, site[0])  # type: ignore[arg-type]
                reading = out.setdefault((site, c.head), HeadReading({t: [] for t in TERMS}, {r: [] for r in ROLES}))
                for name, v in shares.items():
                    reading.shares[name] += v[real].tolist()
                for name, v in roles.items():
                    reading.roles[name] += v[real].tolist()
    return out


# %% [markdown]
# ## 4. On the aligned word: cross-attention on the aligner's test pairs
#
# A head's share is, per sentence, the fraction of the aligner-linked target
# words whose predicting row (as `metrics.py` reads alignments) puts its
# argmax on a piece of a source word linked to them.


# %%
def aligned_share(best: Sequence[int], src_pieces: Sequence[str], y_pieces: Sequence[str], links) -> float | None:
    """For one pair: the share of the aligner-linked target words whose predicting row's argmax (`best[row]`, a
    source position) lies on a piece of a source word linked to them; None when no target word is linked.
    `y_pieces` are y_1 .. y_n: row p reads y_p (row 0 reads <s>) and predicts y_{p+1}, piece p of `y_pieces`.

    >>> src, y = ["▁ein", "▁Hund", "▁."], ["▁a", "▁d", "og"]
    >>> aligned_share([0, 1, 2], src, y, {(0, 0), (1, 1)}), aligned_share([0, 2, 1], src, y, {(0, 0), (1, 1)})
    (1.0, 0.5)
    """
    src_word, _ = piece_words(src_pieces)
    tgt_word, texts = piece_words(y_pieces)
    rows: dict[int, int] = {}  # target word -> the row that predicts its first piece
    for p, j in enumerate(tgt_word):
        if j is not None and texts[j] and j not in rows:
            rows[j] = p
    linked = {j: {i for i, jj in links if jj == j} for j in rows}
    linked = {j: words for j, words in linked.items() if words}
    if not linked:
        return None
    return sum(src_word[best[rows[j]]] in words for j, words in linked.items()) / len(linked)


@torch.no_grad()
def aligned_shares(
    model: EncoderDecoder,
    pieces: Callable[[Sequence[int]], list[str]],
    batches: Iterable[tuple[Tensor, Tensor]],
    links: Sequence[set[tuple[int, int]]],
    pad: int,
) -> dict[tuple[Site, int], list[float]]:
    """Per cross head, per test sentence with linked words: its `aligned_share`. `batches` hold (src, BOS +
    target + EOS), `links` the aligner's links of each pair, in batch order."""
    out: dict[tuple[Site, int], list[float]] = {}
    heads = [c for s, cs in circuits(model).items() if s[0] == "cross" for c in cs]
    n = 0
    for src, tgt in batches:
        inputs = attention_inputs(model, src, tgt[:, :-1], pad)
        never = ~padding_mask(src, pad)  # (B, 1, S)
        best = {c: c.matching(*inputs[c.site]).masked_fill(never, float("-inf")).argmax(-1) for c in heads}  # (B, T)
        for b in range(src.size(0)):
            src_pieces = pieces([i for i in src[b].tolist() if i != pad])
            y_pieces = pieces([i for i in tgt[b, 1:].tolist() if i != pad][:-1])  # y_1 .. y_n, EOS dropped
            for c in heads:
                share = aligned_share(best[c][b].tolist(), src_pieces, y_pieces, links[n])
                if share is not None:
                    out.setdefault((c.site, c.head), []).append(share)
            n += 1
    return out


# %% [markdown]
# ## 5. The record of `make circuits`


# %%
def role_label(shares: dict[str, float], share: float = ROLE_SHARE) -> str:
    """The measured role that takes at least `share` of the queries (the largest), else 'mixed'.

    >>> role_label({"first": 0.7, "self": 0.1, "previous": float("nan")}), role_label({"first": 0.3, "last": 0.4})
    ('first', 'mixed')
    """
    found = {r: v for r, v in shares.items() if v == v and v >= share}
    return max(found, key=lambda r: found[r]) if found else "mixed"


def reading_records(
    readings: dict[tuple[Site, int], HeadReading],
    aligned: dict[tuple[Site, int], list[float]] | None = None,
    resamples: int = RESAMPLES,
    seed: int = SEED,
) -> dict[tuple[Site, int], dict]:
    """Per head, JSON-ready: {"score_terms": {term: [mean, low, high]}, "roles": {role: [...], "label": ...}}."""
    counts: dict[int, np.ndarray] = {}

    def interval(values: list[float]) -> list[float]:  # `mean_interval`, its resample counts drawn once per length
        v = np.asarray(values, dtype=np.float64)
        if len(v) not in counts:
            counts[len(v)] = resample_counts(len(v), resamples, seed)
        tail = 100 * (1 - CONFIDENCE) / 2
        low, high = np.percentile(counts[len(v)] @ v / len(v), [tail, 100 - tail])
        return [float(v.mean()), float(low), float(high)]

    out = {}
    for key, r in readings.items():
        roles = {name: interval(v) for name, v in r.roles.items() if v and not np.isnan(v).any()}
        if aligned is not None and aligned.get(key):
            roles["aligned"] = interval(aligned[key])
        out[key] = {
            "score_terms": {name: interval(v) for name, v in r.shares.items()},
            "roles": {**roles, "label": role_label({name: v[0] for name, v in roles.items()})},
        }
    return out
