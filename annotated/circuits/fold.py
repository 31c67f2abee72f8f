# %% [markdown]
# # LayerNorm folded into the weights that read it
#
# Every LayerNorm of the chapter computes, for one position's vector `z`,
#
# $$\mathrm{LN}(z) = \gamma \odot \hat z + \beta, \qquad
# \hat z = \frac{z - \bar z\, \mathbf 1}{\sigma(z)}, \qquad \sigma(z) = \sqrt{\mathrm{var}(z) + \epsilon}$$
#
# a **normalisation** (one positive divisor per position) and an **affine
# map**, the same for every position, which can move into every reader of
# the output (as TransformerLens's `fold_ln` does for pre-norm models):
#
# $$(\gamma \odot \hat z + \beta)\, W + b = \hat z\, (\mathrm{diag}(\gamma)\, W) + (\beta W + b)$$
#
# In post-norm layers (the shipped models) a LayerNorm's output is the
# stream itself, read by the next sublayer and by the next skip connection,
# which cannot pass `gamma`, `beta` on (normalising `w * gamma` is not
# normalising `w`, then scaling): the skip is folded too, with the identity
# as its weight, into `z_hat * gamma + beta`. `fold_layer_norms(model)`
# returns a copy whose LayerNorms have **no gain and no bias**, every reader
# (attention projections in either form, `W_1`, the generator, untied) with
# them folded in, each later skip a `FoldedResidual`, and an attention without
# biases given them. It is the same function, within 1e-12 in float64 on the
# shipped de -> en model, both forms
# (`test_the_folded_model_is_the_same_function`), and each LayerNorm sees the
# same input (`test_the_folded_norms_see_the_same_inputs`): one divisor per
# position is all that is left of the LayerNorms. Pre-norm, a LayerNorm's
# only reader is its own sublayer and the skips stay the identity
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
STREAMS = {"encoder": ("res_attn", "res_ffn"), "decoder": ("res_self", "res_cross", "res_ffn")}  # sublayers in order
READS = {"res_attn": ("self_attn", "QKV"), "res_self": ("self_attn", "QKV"), "res_cross": ("cross_attn", "Q")}


def sublayers(model: EncoderDecoder, stack: str) -> list[str]:
    """Module names of the residual sublayers of `stack` ("encoder" or "decoder"), in the stream's order."""
    return [f"{stack}.layers.{l}.{name}" for l in range(model.config.N) for name in STREAMS[stack]]


def _reader(sublayer: str) -> tuple[str, str]:
    """The module that reads a residual sublayer's input, and through what."""
    layer, _, name = sublayer.rpartition(".")
    module, how = READS.get(name, ("ffn", "FFN"))
    return f"{layer}.{module}", how


def norm_readers(model: EncoderDecoder) -> Readers:
    """{LayerNorm's module name: [(reader's module name, what it reads through)]}, in the model's order."""
    memory = [(f"decoder.layers.{l}.cross_attn", "KV") for l in range(model.config.N)]  # the encoder's output
    ends = {"encoder": memory, "decoder": [("generator", "generator")]}
    out: Readers = {}
    for stack in STREAMS:
        order = sublayers(model, stack)
        for i, residual in enumerate(order):
            if model.config.norm == "pre":  # each norm feeds its own sublayer only
                out[f"{residual}.ln"] = [_reader(residual)]
            else:  # the norm's output is the stream: the next sublayer and the next skip
                nxt = order[i + 1] if i + 1 < len(order) else None
                out[f"{residual}.ln"] = [_reader(nxt), (nxt, "skip")] if nxt else ends[stack]
        if model.config.norm == "pre":
            out[f"{stack}.final_ln"] = ends[stack]
    return out


# %% [markdown]
# ## 2. The skip connection that carries a gain and a bias
#
# `FoldedResidual` is the chapter's post-norm `Residual` reading the previous
# LayerNorm's `z_hat`: it adds the sublayer's output to `z_hat * gamma +
# beta`, the stream the original model added it to, then normalises.


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
# For a weight `W` read as `x W + b`: first `b <- b + beta W`, then
# `W <- diag(gamma) W`, for an attention's `W_Q`, `W_K`, `W_V` in both forms;
# `W_O` reads the heads, not the stream.


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


# %% [markdown]
# ## 4. The whole model


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
