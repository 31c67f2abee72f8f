# %% [markdown]
# # LayerNorm folded into the weights that read it
#
# Every LayerNorm of the chapter computes, for one position's vector `z`,
#
# $$\mathrm{LN}(z) = \gamma \odot \hat z + \beta, \qquad
# \hat z = \frac{z - \bar z\, \mathbf 1}{\sigma(z)}, \qquad \sigma(z) = \sqrt{\mathrm{var}(z) + \epsilon}$$
#
# two parts of different kinds: the **normalisation** `z -> z_hat` (centre,
# then divide by one positive number per position, `sigma`) and the
# **affine map** `z_hat -> gamma * z_hat + beta`, the same for every position.
# The affine map is linear, and so is everything that reads a LayerNorm's
# output, up to its bias. So it can be moved into the readers: a reader with
# weight `W` (`d_model x m`, a row vector `x` maps to `x W + b`) computes
#
# $$(\gamma \odot \hat z + \beta)\, W + b = \hat z\, (\mathrm{diag}(\gamma)\, W) + (\beta W + b)$$
#
# that is, a reader of `z_hat` with its rows scaled by `gamma` and its bias
# moved by `beta W`. The generator, which stores its weight as `vocab x
# d_model`, scales its columns instead and moves its bias by `W_gen beta`.
# TransformerLens does this for its pre-norm language models (`fold_ln`).
#
# ## Where each LayerNorm's output goes (post-norm)
#
# The shipped models are the paper's post-norm ones:
# `x <- LN(x + Sublayer(x))` (the chapter's `Residual`). So a LayerNorm's
# output is the residual stream itself, and it has exactly two readers:
#
# 1. **the next sublayer**: an encoder layer's self-attention's `W_Q`, `W_K`,
#    `W_V` (one input for all three), a decoder layer's cross-attention's
#    `W_Q`, or a feed-forward network's `W_1`; after the encoder's last
#    sublayer, the encoder's output (the memory) is read by *every* decoder
#    layer's cross-attention, through `W_K` and `W_V`; after the decoder's last
#    sublayer, by the generator;
# 2. **the next residual connection**, which adds the sublayer's output to
#    it: `x + Sublayer(x)` reads `x` through the identity.
#
# The first reader takes `gamma` and `beta` into its weights as above. The
# second cannot pass them on: the next LayerNorm centres and divides
# `x + Sublayer(x)`, taking the mean and the variance over its coordinates,
# and with each coordinate scaled by its own `gamma_j` those are other
# numbers: normalising `w * gamma` is not normalising `w` and then scaling.
# (Adding a multiple of `1` to every position's input changes nothing after
# the centring, but `beta` and `gamma` are no such thing.) So the skip
# connection is folded like any reader, with the identity as its weight: it
# becomes `z_hat * gamma + beta`. The first sublayer of each stack reads the
# embeddings, which no LayerNorm has touched, and its skip stays the
# identity.
#
# ## The folded model
#
# `fold_layer_norms(model)` returns a copy of a model in which
#
# * every LayerNorm has **no gain and no bias** (`elementwise_affine=False`):
#   it centres and divides, nothing else, so every sublayer, the memory and
#   the generator read the normalised `z_hat`, one centred vector of mean
#   square `var / (var + epsilon)`, just below 1, per position;
# * every reader of a LayerNorm has `gamma` and `beta` folded in: attention
#   projections (in either form: a per-head `W_Q[i]` is a column block of the
#   fused `W_Q`, and scaling rows acts on every block alike), `W_1` and `b_1`,
#   the generator (untied from the embedding table, which the first layer
#   still reads unscaled);
# * every residual connection after the first of each stack is a
#   `FoldedResidual`, whose skip is `z_hat * gamma + beta` with the
#   `gamma`, `beta` of the LayerNorm before it;
# * an attention built without biases gets them (at zero, then moved by
#   `beta W`): `beta` has nowhere else to go.
#
# It is the same function: the logits of the shipped de -> en model and of
# its folded copy agree within 1e-12 in float64 on the first 24 validation
# sentences (the largest difference is 1.6e-14, on logits up to 14.6), in
# the fused and in the per-head form (`test_the_folded_model_is_the_same_function`).
# Each LayerNorm receives exactly the input it received before, so each
# position's divisor `sigma` is the same in both models
# (`test_the_folded_norms_see_the_same_inputs`): the one thing of the
# LayerNorms that is not linear, one positive number per position, is all
# that is left of them. `annotated/circuits/direct.py` reads the heads
# through the folded weights with each position's own divisor.
#
# In a pre-norm model (`x <- x + Sublayer(LN(x))`) a LayerNorm's only reader
# is its own sublayer (or, for each stack's final norm, the memory's readers
# and the generator), and the residual stream never passes through one: the
# skip connections stay the identity, as in TransformerLens. `fold_layer_norms`
# folds both kinds, and an attention without biases
# (`test_folded_post_and_pre_norm_models_are_the_same_functions`).

# %%
from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import Tensor, nn

from annotated.transformer import EncoderDecoder, FeedForward, FusedAttention, Generator, PerHeadAttention, Residual

Attention = PerHeadAttention | FusedAttention

# %% [markdown]
# ## 1. Which LayerNorm each reader reads
#
# `norm_readers` names, for each LayerNorm of a model (by module name), the
# modules that read its output and through which of their weights: `QKV`
# (self-attention: one input for queries, keys and values), `Q` and `KV`
# (cross-attention's two inputs), `FFN` (`W_1`), `skip` (the next residual
# connection, post-norm only) and `generator`. Every reader is read from
# exactly one LayerNorm. For a one-layer post-norm model:
#
# >>> from annotated.transformer import make_model
# >>> for ln, readers in norm_readers(make_model(src_vocab=8, tgt_vocab=8, N=1, d_model=8, h=2, d_ff=8)).items():
# ...     print(ln, "->", ", ".join(f"{m} ({how})" for m, how in readers))
# encoder.layers.0.res_attn.ln -> encoder.layers.0.ffn (FFN), encoder.layers.0.res_ffn (skip)
# encoder.layers.0.res_ffn.ln -> decoder.layers.0.cross_attn (KV)
# decoder.layers.0.res_self.ln -> decoder.layers.0.cross_attn (Q), decoder.layers.0.res_cross (skip)
# decoder.layers.0.res_cross.ln -> decoder.layers.0.ffn (FFN), decoder.layers.0.res_ffn (skip)
# decoder.layers.0.res_ffn.ln -> generator (generator)

# %%
Readers = dict[str, list[tuple[str, str]]]


def norm_readers(model: EncoderDecoder) -> Readers:
    """{LayerNorm's module name: [(reader's module name, what it reads through)]}, in the model's order."""
    N = model.config.N
    enc = lambda l, name: f"encoder.layers.{l}.{name}"
    dec = lambda l, name: f"decoder.layers.{l}.{name}"
    memory = [(dec(l, "cross_attn"), "KV") for l in range(N)]  # the encoder's output: every cross-attention
    out: Readers = {}
    if model.config.norm == "post":  # the norm's output is the stream: the next sublayer and the next skip
        for l in range(N):
            last = l == N - 1
            out[enc(l, "res_attn.ln")] = [(enc(l, "ffn"), "FFN"), (enc(l, "res_ffn"), "skip")]
            out[enc(l, "res_ffn.ln")] = (
                memory if last else [(enc(l + 1, "self_attn"), "QKV"), (enc(l + 1, "res_attn"), "skip")]
            )
        for l in range(N):
            last = l == N - 1
            out[dec(l, "res_self.ln")] = [(dec(l, "cross_attn"), "Q"), (dec(l, "res_cross"), "skip")]
            out[dec(l, "res_cross.ln")] = [(dec(l, "ffn"), "FFN"), (dec(l, "res_ffn"), "skip")]
            out[dec(l, "res_ffn.ln")] = (
                [("generator", "generator")]
                if last
                else [(dec(l + 1, "self_attn"), "QKV"), (dec(l + 1, "res_self"), "skip")]
            )
        return out
    for l in range(N):  # pre-norm: each norm feeds its own sublayer only
        out[enc(l, "res_attn.ln")] = [(enc(l, "self_attn"), "QKV")]
        out[enc(l, "res_ffn.ln")] = [(enc(l, "ffn"), "FFN")]
    out["encoder.final_ln"] = memory
    for l in range(N):
        out[dec(l, "res_self.ln")] = [(dec(l, "self_attn"), "QKV")]
        out[dec(l, "res_cross.ln")] = [(dec(l, "cross_attn"), "Q")]
        out[dec(l, "res_ffn.ln")] = [(dec(l, "ffn"), "FFN")]
    out["decoder.final_ln"] = [("generator", "generator")]
    return out


# %% [markdown]
# ## 2. The skip connection that carries a gain and a bias
#
# `FoldedResidual` is the chapter's post-norm `Residual` whose input is the
# previous LayerNorm's `z_hat`: it adds the sublayer's output to
# `z_hat * gamma + beta`, which is the stream the original model added it
# to, then normalises. With `gain` and `bias` left `None` it is the
# chapter's `Residual` (the first sublayer of a stack).


# %%
class FoldedResidual(Residual):
    """Post-norm: LN(x * gain + bias + Dropout(Sublayer(x))), gain and bias those of the norm that wrote x."""

    gain: Tensor | None
    bias: Tensor | None

    def __init__(self, residual: Residual, gain: Tensor | None = None, bias: Tensor | None = None):
        nn.Module.__init__(self)
        self.ln, self.dropout, self.pre = residual.ln, residual.dropout, residual.pre
        assert not self.pre, "a pre-norm residual's skip reads no LayerNorm"
        self.register_buffer("gain", gain)
        self.register_buffer("bias", bias)

    def skip(self, x: Tensor) -> Tensor:
        """What the residual adds the sublayer's output to: x * gain + bias, (.., d_model)."""
        if self.gain is None or self.bias is None:
            return x
        return x * self.gain + self.bias  # (.., d_model)

    def forward(self, x: Tensor, sublayer: Callable[[Tensor], Tensor]) -> Tensor:
        # LayerNorm(x gamma + beta + Dropout(Sublayer(x))), the LayerNorm without its own gain and bias
        return self.ln(self.skip(x) + self.dropout(sublayer(x)))  # (B, T, d_model)


# %% [markdown]
# ## 3. Folding one LayerNorm into its readers
#
# For a weight `W` read as `x W + b`: first `b <- b + beta W` (with the
# unscaled `W`), then `W <- diag(gamma) W`. An attention's `W_Q`, `W_K`,
# `W_V` are such weights in both forms (a `ParameterList` of per-head blocks,
# or one fused matrix); `W_O` reads the heads, not the stream, and is left
# alone.


# %%
def _blocks(p: nn.Parameter | nn.ParameterList) -> list[nn.Parameter]:
    """The matrices (or vectors) of a parameter: one for the fused form, one per head for the per-head form."""
    return list(p) if isinstance(p, nn.ParameterList) else [p]


@torch.no_grad()
def _fold_into(
    W: nn.Parameter | nn.ParameterList, b: nn.Parameter | nn.ParameterList, gamma: Tensor, beta: Tensor
) -> None:
    """x W + b read from gamma * x_hat + beta becomes x_hat (diag(gamma) W) + (beta W + b), in place."""
    for W_i, b_i in zip(_blocks(W), _blocks(b), strict=True):
        b_i.add_(beta @ W_i)  # (m,) beta W, with W as it was
        W_i.mul_(gamma.unsqueeze(-1))  # (d_model, m) diag(gamma) W


def _with_biases(att: Attention) -> Attention:
    """`att` itself if it has biases, else the same attention with biases at zero (somewhere for beta to go)."""
    if att.bias:
        return att
    new = type(att)(att.d_model, att.h, att.d_k, att.d_v, True, att.dropout)
    p = next(att.parameters())
    new = new.to(device=p.device, dtype=p.dtype).train(att.training)
    new.load_state_dict(att.state_dict(), strict=False)  # the weights; the new biases stay
    with torch.no_grad():
        for name in ("b_Q", "b_K", "b_V", "b_O"):
            for block in _blocks(getattr(new, name)):
                block.zero_()
    return new


@torch.no_grad()
def _fold_reader(model: EncoderDecoder, name: str, how: str, gamma: Tensor, beta: Tensor) -> None:
    parent, _, child = name.rpartition(".")
    module = model.get_submodule(name)
    if how in ("QKV", "Q", "KV"):
        assert isinstance(module, (PerHeadAttention, FusedAttention))
        att = _with_biases(module)
        setattr(model.get_submodule(parent), child, att)
        for x in how:  # Q, K and V: the projections that read this norm
            _fold_into(getattr(att, f"W_{x}"), getattr(att, f"b_{x}"), gamma, beta)
    elif how == "FFN":
        assert isinstance(module, FeedForward)
        _fold_into(module.W_1, module.b_1, gamma, beta)
    elif how == "generator":  # logits = x W_gen^T + b: W_gen^T is the reader's W
        assert isinstance(module, Generator)
        weight = module.weight.detach()  # (vocab, d_model), perhaps the embedding table: untie
        module.bias.add_(weight @ beta)  # (vocab,)
        module.weight = nn.Parameter(weight * gamma)  # (vocab, d_model) W_gen diag(gamma)
    elif how == "skip":
        assert isinstance(module, Residual)
        setattr(model.get_submodule(parent), child, FoldedResidual(module, gamma.clone(), beta.clone()))
    else:
        raise ValueError(f"unknown reader kind {how!r}")


# %% [markdown]
# ## 4. The whole model
#
# Gains and biases are read from the copy before any is replaced; each
# LayerNorm is then swapped for one with no gain and no bias and the same
# `epsilon`.


# %%
@torch.no_grad()
def fold_layer_norms(model: EncoderDecoder) -> EncoderDecoder:
    """A copy of `model` computing the same function, whose LayerNorms have no gain and no bias (section 4)."""
    folded = copy.deepcopy(model)
    readers = norm_readers(folded)
    for ln_name, reading in readers.items():
        ln = folded.get_submodule(ln_name)
        if not isinstance(ln, nn.LayerNorm):
            raise TypeError(f"{ln_name} is not a LayerNorm but {type(ln).__name__}: there is nothing to fold")
        d = ln.normalized_shape[0]
        p = next(folded.parameters())
        ones, zeros = torch.ones(d, dtype=p.dtype, device=p.device), torch.zeros(d, dtype=p.dtype, device=p.device)
        gamma = ln.weight.detach().clone() if ln.weight is not None else ones
        beta = ln.bias.detach().clone() if ln.bias is not None else zeros
        for name, how in reading:
            _fold_reader(folded, name, how, gamma, beta)
    for ln_name in readers:  # after every reader has read gamma and beta
        parent, _, child = ln_name.rpartition(".")
        old = folded.get_submodule(ln_name)
        assert isinstance(old, nn.LayerNorm)
        bare = nn.LayerNorm(old.normalized_shape, eps=old.eps, elementwise_affine=False)
        setattr(folded.get_submodule(parent), child, bare)
    return folded.train(model.training)
