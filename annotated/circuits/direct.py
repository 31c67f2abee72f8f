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
# # Reading a circuit through the vocabulary: the direct path
#
# `W_QK` is a `d_model x d_model` bilinear form; to say what it *matches*, we
# feed it the vectors the model actually puts in the residual stream: a
# token's embedding and a position's sinusoid. This is Elhage et al.'s
# **direct path**: what the head computes from the embeddings alone, leaving
# out whatever the sublayers before it added.
#
# **Where it is exact.** With the paper's post-norm layers (the shipped
# models), the first layer's self-attentions read `x = E[t] sqrt(d_model) +
# PE[pos]` and nothing else (dropout is off when reading). So for encoder and
# decoder self-attention in layer 0, the score the softmax sees splits
# exactly into four tables, one per pair of parts: the token table `T`, the
# position table `P` and two mixed terms,
#
# $$T_{ab} = e_a W_{QK} e_b^{\top} + e_b u$$
#
# $$P_{ab} = p_a W_{QK} p_b^{\top} + p_b u$$
#
# $$x_a W_{QK} x_b^{\top} + x_b u = T_{ab} + P_{ab} + e_a W_{QK} p_b^{\top} + p_a W_{QK} e_b^{\top}$$
#
# (`test_the_first_layer_splits_exactly_into_four_tables`). The token table
# says which *words* the head matches whatever their places; the position
# table says which *places* it matches whatever the words: a head whose
# position table peaks one step back is a previous-token head, read off the
# weights before it has seen a sentence.
#
# **Where it is an approximation.** Deeper layers, and every cross-attention,
# read a stream that earlier sublayers have written into, through
# LayerNorms. We follow the embedding through the LayerNorms on its way
# (`layer_norms_before`): each subtracts the mean and scales each coordinate
# by its `gamma` (and divides by a positive number, the same for every
# coordinate, which we leave out: it does not change which keys a query ranks
# highest, and rank is what the faithfulness table of
# `annotated/circuits/faithfulness.py` measures). Cross-attention's keys are
# the encoder's *last* layer, so their direct path runs through the whole
# encoder. How well these readings predict the real attention is measured,
# head by head, not assumed.
#
# Every table over the vocabulary is computed in chunks of rows and only its
# `k` best entries are kept: the full table would be `V x V` numbers.

# %%
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from annotated.circuits.circuits import HeadCircuit
from annotated.sites import Site
from annotated.transformer import EncoderDecoder

CHUNK = 1024  # rows of a vocabulary table computed at once: CHUNK x V floats (20 MB at V = 5,000)
TOP = 10  # entries kept per row

# %% [markdown]
# ## 1. The LayerNorms between the embeddings and an attention


# %%
def _norm(residual) -> nn.LayerNorm:
    """The LayerNorm of a `Residual` sublayer wrapper."""
    assert isinstance(residual.ln, nn.LayerNorm)
    return residual.ln


def _norm_of(module) -> nn.LayerNorm:
    """A stack's final norm (a LayerNorm in a pre-norm model)."""
    assert isinstance(module, nn.LayerNorm)
    return module


def layer_norms_before(model: EncoderDecoder, site: Site, side: str) -> list[nn.LayerNorm]:
    """The LayerNorms the embedding passes through before reaching `site`'s queries (side "q") or keys ("kv")."""
    kind, layer = site
    pre = model.config.norm == "pre"
    enc, dec = model.encoder.layers, model.decoder.layers
    if kind == "cross" and side == "kv":  # the encoder's output: every encoder sublayer, and its final norm
        lns = [_norm(r) for lay in enc for r in (lay.res_attn, lay.res_ffn)]
        return lns + ([_norm_of(model.encoder.final_ln)] if pre else [])
    stack = enc if kind == "enc_self" else dec
    names = ("res_attn", "res_ffn") if kind == "enc_self" else ("res_self", "res_cross", "res_ffn")
    own = {"enc_self": "res_attn", "dec_self": "res_self", "cross": "res_cross"}[kind]
    lns = [_norm(getattr(lay, n)) for lay in stack[:layer] for n in names]
    if kind == "cross":  # the decoder layer's own self-attention sublayer comes first
        lns.append(_norm(stack[layer].res_self))
    if pre:  # pre-norm: the sublayer normalises its own input
        lns.append(_norm(getattr(stack[layer], own)))
    return lns


def through(lns: list[nn.LayerNorm], v: Tensor) -> Tensor:
    """v (.., d_model) through each LayerNorm's centring and gamma (its positive division left out)."""
    for ln in lns:
        v = v - v.mean(-1, keepdim=True)  # (.., d_model)
        if ln.weight is not None:
            v = v * ln.weight.detach()
    return v  # (.., d_model)


def exact(model: EncoderDecoder, site: Site) -> bool:
    """Whether the direct path is the whole input of `site`: layer 0 self-attention of a post-norm model."""
    return site[1] == 0 and site[0] != "cross" and model.config.norm == "post"


# %% [markdown]
# ## 2. The direct-path inputs: tokens and positions
#
# Queries of encoder self-attention come from source tokens; those of
# decoder self- and cross-attention from target tokens; keys from the source
# for the encoder and the cross-attention, from the target for the decoder.
# Each goes through its own embedding module, so a model that scales its
# embeddings (ours, by `sqrt(d_model)`) or not (an imported Marian model)
# is read as it computes.

# %%
SIDES = {"enc_self": ("src", "src"), "dec_self": ("tgt", "tgt"), "cross": ("tgt", "src")}  # (queries', keys' tokens)


@torch.no_grad()
def token_vectors(model: EncoderDecoder, site: Site, side: str, ids: Tensor) -> Tensor:
    """Direct-path vectors (n, d_model) of tokens `ids` (n,) at the queries ("q") or keys ("kv") of `site`."""
    language = SIDES[site[0]][0 if side == "q" else 1]
    embed = model.src_embed if language == "src" else model.tgt_embed
    return through(layer_norms_before(model, site, side), embed(ids.unsqueeze(0))[0])  # (n, d_model)


@torch.no_grad()
def position_vectors(model: EncoderDecoder, site: Site, side: str, n: int) -> Tensor:
    """Direct-path vectors (n, d_model) of positions 0..n-1 at the queries or keys of `site`."""
    return through(layer_norms_before(model, site, side), model.pos.pe[:n].to(model.generator.weight.dtype))


@torch.no_grad()
def sentence_vectors(model: EncoderDecoder, site: Site, side: str, ids: Tensor) -> Tensor:
    """Direct-path vectors of a tokenised sentence ids (B, T): tokens plus positions, (B, T, d_model)."""
    language = SIDES[site[0]][0 if side == "q" else 1]
    embed = model.src_embed if language == "src" else model.tgt_embed
    x = embed(ids) + model.pos.pe[: ids.size(1)].to(model.generator.weight.dtype)  # (B, T, d_model)
    return through(layer_norms_before(model, site, side), x)


# %% [markdown]
# ## 3. Tables, best entries only
#
# The softmax runs over the keys of one query, so a number added to a whole
# row changes nothing: every table is **centred per row** (its mean over the
# keys subtracted) before its best entries are taken. `top_table` returns,
# for each query row, the `k` best keys and their centred scores.
#
# The position table of a head is the same reading with positions in
# place of tokens (`positional_table`, and `preferred_offsets` for each
# query's best key).
#
# <!-- figure: circuit_positions -->


# %%
@dataclass(frozen=True)
class Top:
    """The k best columns of each row of a table: ids (rows, k), values (rows, k), best first."""

    ids: Tensor
    values: Tensor


@torch.no_grad()
def top_table(c: HeadCircuit, x_q: Tensor, x_kv: Tensor, k: int = TOP, chunk: int = CHUNK) -> Top:
    """The k best keys of each query for the matching scores of `c` between x_q (n, d) and x_kv (m, d)."""
    ids, values = [], []
    for start in range(0, x_q.size(0), chunk):
        s = c.matching(x_q[start : start + chunk], x_kv)  # (chunk, m)
        s = s - s.mean(-1, keepdim=True)  # centred per query: what the softmax sees
        v, i = s.topk(min(k, s.size(-1)), dim=-1)  # (chunk, k)
        ids.append(i)
        values.append(v)
    return Top(torch.cat(ids), torch.cat(values))


def best_pairs(top: Top, n: int = 20) -> list[tuple[int, int, float]]:
    """The n highest (row, column, score) triples of a top table, best first."""
    flat = top.values.flatten()
    order = flat.topk(min(n, flat.numel())).indices
    k = top.values.size(1)
    return [(int(o // k), int(top.ids.flatten()[o]), float(flat[o])) for o in order]


@torch.no_grad()
def positional_table(model: EncoderDecoder, c: HeadCircuit, n: int = 32) -> Tensor:
    """(n, n) matching scores between positions 0..n-1, centred per query; the decoder's future is -inf.
    n is at most the model's positions."""
    n = min(n, model.pos.pe.size(0))
    p_q, p_kv = position_vectors(model, c.site, "q", n), position_vectors(model, c.site, "kv", n)
    s = c.matching(p_q, p_kv)  # (n, n)
    if c.site[0] == "dec_self":  # a decoder query sees only itself and the past
        future = torch.ones(n, n, dtype=torch.bool).triu(1)
        s = s.masked_fill(future, float("nan"))
        s = s - s.nanmean(-1, keepdim=True)
        return s.nan_to_num(nan=float("-inf"))
    return s - s.mean(-1, keepdim=True)  # (n, n)


def preferred_offsets(table: Tensor) -> Tensor:
    """For each query position a, the offset b - a of its best key b: (n,), e.g. -1 for the previous position."""
    return table.argmax(-1) - torch.arange(table.size(0))


# %% [markdown]
# ## 4. The OV circuit through the generator: what a head writes, in words
#
# When head `i` attends to a key token `t`, it adds `x_t W_OV` (scaled by the
# weight) to the stream. Read by the generator, whose rows are the target
# vocabulary's output vectors, that write raises the logit of token `w` by
# `x_t W_OV W_gen[w]^T`: the head's **OV table** says which output tokens it
# promotes for each token it reads. Between the write and the generator lie
# the LayerNorms of the rest of the decoder (`layer_norms_after`, centring and
# gamma as above); for encoder heads, the write reaches the decoder only
# through the cross-attention, so their OV table is the most distant
# reading of all, given for completeness.
#
# Elhage et al.'s **copying score** summarises a whole OV table in one
# number: with `M = E W_OV W_gen^T` (vocabulary x vocabulary), a head that
# copies (reading token `t` raises the logit of `t`) has eigenvalues of `M`
# with positive real parts, so `sum(lambda) / sum(|lambda|)` is near `+1`; one
# that suppresses what it reads is near `-1`. `M`'s non-zero eigenvalues are
# those of the `d_v x d_v` matrix `W_O W_gen^T E W_V` (for any `A (m x r)`
# and `B (r x m)`, `AB` and `BA` share their non-zero eigenvalues), which is
# how we compute them (`test_copying_score_from_the_small_matrix_is_the_vocabularys`).
# Copying across a vocabulary shared by two languages means the head moves a
# piece unchanged, as names and numbers are.
#
# <!-- figure: circuit_writes -->


# %%
def layer_norms_after(model: EncoderDecoder, site: Site) -> list[nn.LayerNorm]:
    """The LayerNorms between `site`'s output and the generator, on the decoder's own stream."""
    kind, layer = site
    dec = model.decoder.layers
    if kind == "enc_self":  # reaches the decoder only through cross-attention: its own stack's norms, then none
        return [_norm(r) for lay in model.encoder.layers[layer:] for r in (lay.res_attn, lay.res_ffn)]
    pre = model.config.norm == "pre"
    names = ("res_self", "res_cross", "res_ffn")
    start = names.index("res_self" if kind == "dec_self" else "res_cross") + (1 if pre else 0)
    lns = [_norm(getattr(dec[layer], n)) for n in names[start:]]
    lns += [_norm(getattr(lay, n)) for lay in dec[layer + 1 :] for n in names] if not pre else []
    return lns + ([_norm_of(model.decoder.final_ln)] if pre else [])


@torch.no_grad()
def ov_table(model: EncoderDecoder, c: HeadCircuit, x_kv: Tensor, out_ids: Tensor, k: int = TOP) -> Top:
    """For key vectors x_kv (n, d_model): the k output tokens (among out_ids) whose logits the head raises most."""
    W_gen = model.generator.weight.detach()[out_ids]  # (m, d_model)
    lns = layer_norms_after(model, c.site)
    ids, values = [], []
    for start in range(0, x_kv.size(0), CHUNK):
        written = through(lns, c.OV.apply(x_kv[start : start + CHUNK]))  # (chunk, d_model)
        logits = written @ W_gen.T  # (chunk, m)
        v, i = (logits - logits.mean(-1, keepdim=True)).topk(min(k, logits.size(-1)), dim=-1)
        ids.append(out_ids[i])
        values.append(v)
    return Top(torch.cat(ids), torch.cat(values))


@torch.no_grad()
def copying_score(model: EncoderDecoder, c: HeadCircuit, x_kv: Tensor, out_ids: Tensor) -> float:
    """Elhage's copying score of `c`: sum(lambda) / sum(|lambda|) over the eigenvalues of E W_OV L W_gen^T.

    L: the norms after the head, as a matrix; E: the direct-path rows x_kv of the tokens out_ids, the same
    tokens as the generator's rows, so the table is square."""
    W_gen = model.generator.weight.detach()[out_ids]  # (m, d_model)
    d = W_gen.size(1)
    L = through(layer_norms_after(model, c.site), torch.eye(d, dtype=W_gen.dtype))  # the norms as a matrix
    small = c.OV.right @ L @ W_gen.T @ x_kv @ c.OV.left  # W_O L W_gen^T E W_V: (d_v, d_v)
    lam = torch.linalg.eigvals(small.double())
    return float(lam.real.sum() / lam.abs().sum())
