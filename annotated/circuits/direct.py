# %% [markdown]
# # Reading a circuit through the vocabulary: the direct path
#
# To say what `W_QK` *matches*, we feed it what the model puts in the
# residual stream, a token's embedding and a position's sinusoid: Elhage et
# al.'s **direct path**, the head computed from the embeddings alone.
#
# **Where it is exact.** In post-norm layers (the shipped models) the first
# layer's self-attentions read `x = E[t] sqrt(d_model) + PE[pos]` and nothing
# else, so the score the softmax sees splits exactly into a token table `T`,
# a position table `P` and two mixed terms
# (`test_the_first_layer_splits_exactly_into_four_tables`),
#
# $$T_{ab} = e_a W_{QK} e_b^{\top} + e_b u$$
#
# $$P_{ab} = p_a W_{QK} p_b^{\top} + p_b u$$
#
# $$x_a W_{QK} x_b^{\top} + x_b u = T_{ab} + P_{ab} + e_a W_{QK} p_b^{\top} + p_a W_{QK} e_b^{\top}$$
#
# which *words* the head matches whatever their places, and which *places*
# whatever the words (a position table peaking one step back is a
# previous-token head).
#
# **Where it is an approximation.** Deeper layers and every cross-attention
# read a stream that earlier sublayers wrote into, through LayerNorms, read
# here twice (`faithfulness.py` measures both): **weights only** (`through`:
# each norm's centring and `gamma`, its division and `beta` left out; no
# sentence needed, so the tables below use it) and **with the norms exact**
# (`exact_sentence_vectors`: the folded heads, each position divided by its
# own divisor from the real pass). The exact reading leaves out only what the
# sublayers *wrote*: where they write nothing it is what the softmax sees
# within 1e-12 in float64, and the weights-only reading is not
# (`test_the_exact_norms_reading_is_the_heads_input_when_the_sublayers_write_nothing`).

# %%
from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor, nn

from annotated.circuits.circuits import HeadCircuit, teacher_forced
from annotated.circuits.fold import FoldedResidual, sublayers
from annotated.sites import Site
from annotated.transformer import EncoderDecoder

CHUNK = 1024  # rows of a vocabulary table computed at once: CHUNK x V floats (20 MB at V = 5,000)
TOP = 10  # entries kept per row

# %% [markdown]
# ## 1. The LayerNorms on the way
#
# Each stack's stream passes its sublayers in order (`fold.py`'s `STREAMS`); an attention
# reads the stream just before its own sublayer (`OWN`) and writes into it
# there, and cross-attention's keys read the encoder's end. `norms_on_the_way`
# names the LayerNorms between the sublayer where a vector enters a stream
# and the one that reads it: post-norm (`LayerNorm(x + sublayer(x))`), each
# sublayer's own on the way; pre-norm (`x + sublayer(LayerNorm(x))`), only the
# reader's own (the stack's final norm at its end), since the stream itself
# never passes one. Its three uses: `norms_before` (from the embeddings to an
# attention), `layer_norms_after` (from a head's write to the generator, or
# to the memory) and `norms_between` (`composition.py`: from one head's write
# to another's read) (`test_the_norms_are_followed_on_the_way_in_and_out`,
# `test_a_pre_norm_direct_path_passes_each_sublayers_own_norm`).
# `through` is the weights-only reading of them: centring and `gamma`.


# %%
OWN = {"enc_self": ("encoder", "res_attn"), "dec_self": ("decoder", "res_self"), "cross": ("decoder", "res_cross")}


def point(model: EncoderDecoder, site: Site, side: str = "q") -> tuple[str, int]:
    """(the stack, the index of the sublayer) where `site` reads its queries (side "q", also where it writes) or
    keys ("kv"); cross-attention's keys read the encoder's end, index len(sublayers)."""
    kind, layer = site
    if kind == "cross" and side == "kv":
        return "encoder", len(sublayers(model, "encoder"))
    stack, own = OWN[kind]
    return stack, sublayers(model, stack).index(f"{stack}.layers.{layer}.{own}")


def norms_on_the_way(model: EncoderDecoder, stack: str, start: int, end: int) -> list[str]:
    """Module names of the LayerNorms between sublayer `start` of `stack`'s stream and sublayer `end`, which reads
    it (`end` = len(sublayers): the stack's output)."""
    order = sublayers(model, stack)
    if model.config.norm == "pre":
        return [f"{order[end]}.ln" if end < len(order) else f"{stack}.final_ln"]
    return [f"{order[i]}.ln" for i in range(start, end)]


def layer_norms(model: EncoderDecoder, names: list[str]) -> list[nn.LayerNorm]:
    """The modules of `names`, each a LayerNorm."""
    lns = [model.get_submodule(name) for name in names]
    assert all(isinstance(ln, nn.LayerNorm) for ln in lns), names
    return cast(list[nn.LayerNorm], lns)


def norms_before(model: EncoderDecoder, site: Site, side: str) -> list[str]:
    """Module names of the LayerNorms the embedding passes, in order, before `site`'s queries ("q") or keys ("kv")."""
    stack, end = point(model, site, side)
    return norms_on_the_way(model, stack, 0, end)


def layer_norms_before(model: EncoderDecoder, site: Site, side: str) -> list[nn.LayerNorm]:
    """The LayerNorms the embedding passes through before reaching `site`'s queries (side "q") or keys ("kv")."""
    return layer_norms(model, norms_before(model, site, side))


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
# Each side reads its own tokens (`SIDES`) through its own embedding module,
# so a model that scales its embeddings (ours, by `sqrt(d_model)`) or not
# (an imported Marian model), or has separate source and target tables, is
# read as it computes
# (`test_decoder_side_tokens_are_read_through_the_target_table`).

# %%
SIDES = {"enc_self": ("src", "src"), "dec_self": ("tgt", "tgt"), "cross": ("tgt", "src")}  # (queries', keys' tokens)


def embedding(model: EncoderDecoder, site: Site, side: str) -> nn.Module:
    """The embedding of the tokens `site` reads at its queries ("q") or keys ("kv")."""
    return model.src_embed if SIDES[site[0]][0 if side == "q" else 1] == "src" else model.tgt_embed


@torch.no_grad()
def token_vectors(model: EncoderDecoder, site: Site, side: str, ids: Tensor) -> Tensor:
    """Direct-path vectors (n, d_model) of tokens `ids` (n,) at the queries ("q") or keys ("kv") of `site`."""
    return through(layer_norms_before(model, site, side), embedding(model, site, side)(ids[None])[0])  # (n, d_model)


@torch.no_grad()
def position_vectors(model: EncoderDecoder, site: Site, side: str, n: int) -> Tensor:
    """Direct-path vectors (n, d_model) of positions 0..n-1 at the queries or keys of `site`."""
    return through(layer_norms_before(model, site, side), model.pos.pe[:n].to(model.generator.weight.dtype))


@torch.no_grad()
def sentence_vectors(model: EncoderDecoder, site: Site, side: str, ids: Tensor) -> Tensor:
    """Direct-path vectors of a tokenised sentence ids (B, T): tokens plus positions, (B, T, d_model)."""
    x = embedding(model, site, side)(ids) + model.pos.pe[: ids.size(1)].to(model.generator.weight.dtype)
    return through(layer_norms_before(model, site, side), x)  # (B, T, d_model)


# %% [markdown]
# ## 3. With the norms exact: the folded weights and each position's divisor
#
# In the folded model (`annotated/circuits/fold.py`) a LayerNorm only centres
# and divides by `sigma`, one number per position, and a post-norm skip adds
# to `z_hat * gamma + beta`. With each `sigma` known, every step from the
# embedding to a head's input is affine. `exact_sentence_vectors` carries
# `E[t] sqrt(d_model) + PE[pos]` through each skip and each LayerNorm on the
# way, dividing by the `sigma` that LayerNorm had at that position in the
# real pass (`norm_divisors`, recorded with forward hooks); the folded heads
# read the result as they read their real input, the last norm's `beta`
# being in their folded `b_Q`, `b_K`.


# %%
@torch.no_grad()
def norm_divisors(model: EncoderDecoder, src: Tensor, tgt: Tensor, pad: int) -> dict[str, Tensor]:
    """{LayerNorm's module name: sigma (B, T) of each position}: sqrt(var + eps) of its input in one teacher-forced
    pass over src (B, S) and tgt (B, T). A folded model's are the original's (its norms see the same inputs)."""
    seen: dict[str, Tensor] = {}

    def recorder(name: str, ln: nn.LayerNorm):
        def hook(module, args) -> None:
            z = args[0]  # (B, T, d_model)
            seen[name] = (z.var(-1, unbiased=False) + ln.eps).sqrt()  # (B, T)

        return hook

    norms = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.LayerNorm)]
    teacher_forced(model, src, tgt, pad, [m.register_forward_pre_hook(recorder(n, m)) for n, m in norms])
    return seen


@torch.no_grad()
def exact_sentence_vectors(
    folded: EncoderDecoder, site: Site, side: str, ids: Tensor, divisors: dict[str, Tensor]
) -> Tensor:
    """The direct path of sentences ids (B, T) at `site`'s queries or keys in the folded model, (B, T, d_model):
    the embeddings and positions through each skip and each LayerNorm on the way, with the real `divisors`."""
    x = embedding(folded, site, side)(ids) + folded.pos.pe[: ids.size(1)].to(folded.generator.weight.dtype)
    for name in norms_before(folded, site, side):
        owner = folded.get_submodule(name.rpartition(".")[0])
        if isinstance(owner, FoldedResidual):  # post-norm: the skip reads the norm before with its gamma, beta
            x = owner.skip(x)  # (B, T, d_model)
        x = (x - x.mean(-1, keepdim=True)) / divisors[name].unsqueeze(-1)  # this norm, this position's sigma
    return x  # (B, T, d_model)


# %% [markdown]
# ## 4. Tables, best entries only
#
# A number added to a whole row changes nothing in the softmax, so every
# table is **centred per row** before its best entries are taken
# (`top_table`; `test_token_pairs_are_ranked_on_scores_centred_per_query`).
# The position table is the same reading with positions in place of tokens
# (`positional_table`, `preferred_offsets`); a decoder query's table gives
# every later key `-inf` and is centred over the keys it may see
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
# A head attending to key token `t` adds `x_t W_OV` to the stream; read by
# the generator, that raises the logit of token `w` by `x_t W_OV W_gen[w]^T`,
# through the LayerNorms after the head (`layer_norms_after`;
# `test_a_decoder_self_attention_heads_writes_pass_its_own_norm_first`). The
# **OV table** lists the output tokens each read token promotes; an encoder
# head's write reaches the decoder only through the cross-attention, so its
# table is the most distant reading, given for completeness.
#
# Elhage et al.'s **copying score** sums a whole OV table up: with
# `M = E W_OV W_gen^T`, `sum(lambda) / sum(|lambda|)` over `M`'s eigenvalues
# is near `+1` for a head that raises what it reads, near `-1` for one that
# suppresses it. `M`'s non-zero eigenvalues are those of the `d_v x d_v`
# matrix `W_O W_gen^T E W_V` (`AB` and `BA` share theirs), which is how we
# compute them (`test_copying_score_from_the_small_matrix_is_the_vocabularys`).
#
# <!-- figure: circuit_writes -->


# %%
def layer_norms_after(model: EncoderDecoder, site: Site) -> list[nn.LayerNorm]:
    """The LayerNorms between `site`'s output and the generator (for an encoder head: the memory)."""
    stack, start = point(model, site)
    return layer_norms(model, norms_on_the_way(model, stack, start, len(sublayers(model, stack))))


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
