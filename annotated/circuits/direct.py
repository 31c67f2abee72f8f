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
# LayerNorms (each `gamma * (z - mean) / sigma + beta`,
# `annotated/circuits/fold.py`). There are two readings of the embedding's
# way through them, and the faithfulness table of
# `annotated/circuits/faithfulness.py` measures both:
#
# * **weights only** (`through`, section 1): each LayerNorm's centring and
#   `gamma`; its division and its `beta` left out. This needs no sentence,
#   so the tables over the vocabulary and the positions below use it. Both
#   left-out parts change what the head ranks highest. Each *key* position
#   has its own divisor `sigma_b` (the size of its stream, sublayers' writes
#   included), and dividing key `b`'s score by `sigma_b` reorders keys of
#   different sizes. And `beta`, on the query side, adds `beta W_QK x_b^T`
#   to the score of key `b`: a term that changes from key to key, so it
#   does not cancel in the softmax as a term constant along the keys would.
# * **with the norms exact** (`exact_sentence_vectors`, section 3): the
#   heads of the folded model (`fold_layer_norms`: no LayerNorm has a gain
#   or a bias, each reader has them in its weights), reading the embeddings
#   carried through each LayerNorm on their way with that position's own
#   divisor, taken from the real forward pass (`norm_divisors`), and through
#   each skip connection's `gamma` and `beta`. Only one thing is still left
#   out: whatever the earlier sublayers *wrote* (their attention and
#   feed-forward outputs, biases included), which the direct path leaves out
#   by definition. The divisors are the real ones, so this reading is no
#   longer from the weights alone: it borrows one number per position and
#   per LayerNorm from the sentence. Where the sublayers write nothing it
#   gives what the head's softmax sees (its real scores up to one constant
#   per query) within 1e-12 in float64, at every head of the shipped
#   de -> en model, and the weights-only reading does not past the first
#   layer
#   (`test_the_exact_norms_reading_is_the_heads_input_when_the_sublayers_write_nothing`).
#
# Cross-attention's keys are the encoder's *last* layer, so their direct
# path runs through the whole encoder. How well each reading predicts the
# real attention is measured, head by head, not assumed.
#
# Every table over the vocabulary is computed in chunks of rows and only its
# `k` best entries are kept: the full table would be `V x V` numbers.

# %%
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from annotated.circuits.circuits import HeadCircuit
from annotated.circuits.fold import FoldedResidual
from annotated.sites import Site
from annotated.transformer import EncoderDecoder

CHUNK = 1024  # rows of a vocabulary table computed at once: CHUNK x V floats (20 MB at V = 5,000)
TOP = 10  # entries kept per row

# %% [markdown]
# ## 1. The LayerNorms between the embeddings and an attention
#
# `norms_before` names them in order: in a post-norm model every sublayer's
# norm on the way (the whole encoder, for the cross-attention's keys); in a
# pre-norm one only the site's own, since there the stream itself never
# passes through a norm (`test_the_norms_are_followed_on_the_way_in_and_out`,
# `test_a_pre_norm_direct_path_passes_each_sublayers_own_norm`).
# `through` is the weights-only reading of them: centring and `gamma`.


# %%
def _norm(residual) -> nn.LayerNorm:
    """The LayerNorm of a `Residual` sublayer wrapper."""
    assert isinstance(residual.ln, nn.LayerNorm)
    return residual.ln


def _norm_of(module) -> nn.LayerNorm:
    """A module that must be a LayerNorm (a residual's, or a stack's final norm in a pre-norm model)."""
    assert isinstance(module, nn.LayerNorm)
    return module


def norms_before(model: EncoderDecoder, site: Site, side: str) -> list[str]:
    """Module names of the LayerNorms the embedding passes through, in order, before reaching `site`'s queries
    (side "q") or keys ("kv"). Post-norm: every sublayer's norm on the way; pre-norm: the site's own norm only
    (the encoder's final norm for cross-attention's keys), the stream itself never passing through one."""
    kind, layer = site
    N = model.config.N
    enc_names, dec_names = ("res_attn", "res_ffn"), ("res_self", "res_cross", "res_ffn")
    if model.config.norm == "pre":
        if kind == "cross" and side == "kv":
            return ["encoder.final_ln"]
        own = {"enc_self": "res_attn", "dec_self": "res_self", "cross": "res_cross"}[kind]
        return [f"{'encoder' if kind == 'enc_self' else 'decoder'}.layers.{layer}.{own}.ln"]
    if kind == "cross" and side == "kv":  # the encoder's output: every encoder sublayer
        return [f"encoder.layers.{l}.{n}.ln" for l in range(N) for n in enc_names]
    stack, names = ("encoder", enc_names) if kind == "enc_self" else ("decoder", dec_names)
    out = [f"{stack}.layers.{l}.{n}.ln" for l in range(layer) for n in names]
    if kind == "cross":  # the decoder layer's own self-attention sublayer comes first
        out.append(f"decoder.layers.{layer}.res_self.ln")
    return out


def layer_norms_before(model: EncoderDecoder, site: Site, side: str) -> list[nn.LayerNorm]:
    """The LayerNorms the embedding passes through before reaching `site`'s queries (side "q") or keys ("kv")."""
    return [_norm_of(model.get_submodule(name)) for name in norms_before(model, site, side)]


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
# is read as it computes, and a model with separate source and target
# tables reads each side from its own
# (`test_decoder_side_tokens_are_read_through_the_target_table`).

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
# ## 3. With the norms exact: the folded weights and each position's divisor
#
# In the folded model every LayerNorm is `z_hat = (z - mean(z) 1) / sigma(z)`,
# with `sigma` one positive number per position, and every post-norm skip
# connection adds to `z_hat * gamma + beta` (`annotated/circuits/fold.py`).
# With each `sigma` known, every step from the embedding to a head's input
# is affine, and the stream a head reads is the sum of what the embedding,
# the skips' `beta` and each earlier sublayer contributed, each carried
# through the same steps. `exact_sentence_vectors` keeps the first two and
# leaves out the sublayers' writes: starting from `E[t] sqrt(d_model) + PE[pos]`,
# at each LayerNorm on the way it applies the skip before it (`gamma`,
# `beta` of the norm before that) and then the centring and division by the
# `sigma` that LayerNorm had at that position in the real pass
# (`norm_divisors`, recorded with forward hooks, one `(B, T)` tensor per
# LayerNorm). The folded heads then read the result as they read their real
# input, biases and all: `beta` of the norm just before the head sits in the
# folded `b_Q`, `b_K`, so the key bias `W_K b_Q^T` carries it.


# %%
@torch.no_grad()
def norm_divisors(model: EncoderDecoder, src: Tensor, tgt: Tensor, pad: int) -> dict[str, Tensor]:
    """{LayerNorm's module name: sigma (B, T) of each position}: sqrt(var + eps) of its input in one teacher-forced
    pass over src (B, S) and tgt (B, T). A folded model's are the original's (its norms see the same inputs)."""
    from annotated.transformer import padding_mask, target_mask

    seen: dict[str, Tensor] = {}

    def recorder(name: str, ln: nn.LayerNorm):
        def hook(module, args) -> None:
            z = args[0]  # (B, T, d_model)
            seen[name] = (z.var(-1, unbiased=False) + ln.eps).sqrt()  # (B, T)

        return hook

    norms = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.LayerNorm)]
    handles = [m.register_forward_pre_hook(recorder(n, m)) for n, m in norms]
    try:
        src_mask = padding_mask(src, pad)
        model.decode(model.encode(src, src_mask), src_mask, tgt, target_mask(tgt, pad))
    finally:
        for handle in handles:
            handle.remove()
    return seen


@torch.no_grad()
def exact_sentence_vectors(
    folded: EncoderDecoder, site: Site, side: str, ids: Tensor, divisors: dict[str, Tensor]
) -> Tensor:
    """The direct path of sentences ids (B, T) at `site`'s queries or keys in the folded model, (B, T, d_model):
    the embeddings and positions through each skip and each LayerNorm on the way, with the real `divisors`."""
    language = SIDES[site[0]][0 if side == "q" else 1]
    embed = folded.src_embed if language == "src" else folded.tgt_embed
    x = embed(ids) + folded.pos.pe[: ids.size(1)].to(folded.generator.weight.dtype)  # (B, T, d_model)
    for name in norms_before(folded, site, side):
        owner = folded.get_submodule(name.rpartition(".")[0])
        if isinstance(owner, FoldedResidual):  # post-norm: the skip reads the norm before with its gamma, beta
            x = owner.skip(x)  # (B, T, d_model)
        x = (x - x.mean(-1, keepdim=True)) / divisors[name].unsqueeze(-1)  # this norm, this position's sigma
    return x  # (B, T, d_model)


# %% [markdown]
# ## 4. Tables, best entries only
#
# The softmax runs over the keys of one query, so a number added to a whole
# row changes nothing: every table is **centred per row** (its mean over the
# keys subtracted) before its best entries are taken. `top_table` returns,
# for each query row, the `k` best keys and their centred scores, and the
# token pairs of a head are ranked on those
# (`test_token_pairs_are_ranked_on_scores_centred_per_query`).
#
# The position table of a head is the same reading with positions in
# place of tokens (`positional_table`, and `preferred_offsets` for each
# query's best key). A decoder query sees only itself and the past: its
# table gives every later key `-inf` and is centred over the keys it may
# see, so no preferred offset points forward
# (`test_the_decoder_position_table_hides_the_future`).
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
# ## 5. The OV circuit through the generator: what a head writes, in words
#
# When head `i` attends to a key token `t`, it adds `x_t W_OV` (scaled by the
# weight) to the stream. Read by the generator, whose rows are the target
# vocabulary's output vectors, that write raises the logit of token `w` by
# `x_t W_OV W_gen[w]^T`: the head's **OV table** says which output tokens it
# promotes for each token it reads. Between the write and the generator lie
# the LayerNorms of the rest of the decoder, the head's own sublayer's first
# (`layer_norms_after`, centring and gamma as above;
# `test_a_decoder_self_attention_heads_writes_pass_its_own_norm_first`); for encoder heads, the write reaches the decoder only
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
    """The LayerNorms between `site`'s output and the generator, on the decoder's own stream (for an encoder head:
    its own stack's, as far as the memory). Pre-norm: the stack's final norm only."""
    kind, layer = site
    if model.config.norm == "pre":  # the stream meets no other norm
        return [_norm_of(model.encoder.final_ln if kind == "enc_self" else model.decoder.final_ln)]
    if kind == "enc_self":  # reaches the decoder only through cross-attention: its own stack's norms, then none
        return [_norm(r) for lay in model.encoder.layers[layer:] for r in (lay.res_attn, lay.res_ffn)]
    dec = model.decoder.layers
    names = ("res_self", "res_cross", "res_ffn")
    start = names.index("res_self" if kind == "dec_self" else "res_cross")
    lns = [_norm(getattr(dec[layer], n)) for n in names[start:]]
    return lns + [_norm(getattr(lay, n)) for lay in dec[layer + 1 :] for n in names]


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
