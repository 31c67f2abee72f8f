# %% [markdown]
# # Where Marian keeps what we keep: names, orientation, coordinates
#
# `annotated/interop/marian.py` moves weights between our model and Hugging
# Face's `MarianMTModel`. Three things differ, each handled here by a pure
# function on dicts of tensors, so that the conversion is copies, transposes
# and index selections, exact in every dtype:
#
# 1. **Names**: `name_pairs(N)`, our name and Marian's, parameter by parameter.
# 2. **Orientation**: `nn.Linear` stores `weight` as `(out, in)` and computes
#    `x @ weight.T`; the chapter's `W` is `(in, out)`, `x @ W` (the paper's).
# 3. **Coordinates of the residual stream**: both models add sinusoids to the
#    embeddings, laid out differently (below); `permute_residual` renumbers
#    the `d_model` coordinates of every parameter that reads or writes it.

# %%
from __future__ import annotations

import torch
from torch import Tensor

# %% [markdown]
# ## The two layouts of the sinusoids
#
# The chapter interleaves, as the paper writes it: coordinate `2i` holds
# `sin(pos / 10000^(2i/d_model))` and coordinate `2i+1` the cosine of the same
# angle. Marian (`MarianSinusoidalPositionalEmbedding.create_weight`) puts
# all the sines first and all the cosines after them: coordinate `i` holds
# the sine of frequency `i` and coordinate `d_model/2 + i` its cosine. So
# our coordinate `c` is Marian's coordinate `perm[c]`:
#
# $$\mathrm{perm}[2i] = i, \qquad \mathrm{perm}[2i+1] = d_{model}/2 + i$$
#
# and with both tables computed in float64 and rounded to float32 (both
# are), `ours = marian[:, perm]` holds entry for entry
# (`test_sinusoid_tables_differ_by_the_permutation`).


# %%
def sinusoid_permutation(d_model: int) -> Tensor:
    """perm with our coordinate c = Marian's coordinate perm[c] (d_model even).

    >>> sinusoid_permutation(6).tolist()  # sin 0, cos 0, sin 1, cos 1, sin 2, cos 2
    [0, 3, 1, 4, 2, 5]
    """
    assert d_model % 2 == 0, "the sinusoids come in sine-cosine pairs"
    half = torch.arange(d_model // 2)  # (d_model/2,)
    # perm[2i] = i, perm[2i+1] = d_model/2 + i
    return torch.stack([half, half + d_model // 2], dim=1).reshape(-1)  # (d_model,)


def inverse_permutation(perm: Tensor) -> Tensor:
    """inv with inv[perm[c]] = c.

    >>> inverse_permutation(torch.tensor([0, 3, 1, 4, 2, 5])).tolist()
    [0, 2, 4, 1, 3, 5]
    """
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel())
    return inv


# %% [markdown]
# ## Renumbering the residual stream is a symmetry
#
# **Theorem.** Let `P` be the permutation matrix with `x P = x[perm]` for a
# row vector `x` (so `P^T` undoes it). Take a post-norm or pre-norm
# encoder-decoder and replace each parameter as follows: every matrix that
# *reads* the residual stream (`W_Q`, `W_K`, `W_V`, `W_1`, shape `d_model x .`)
# by `P^T W` (its rows renumbered), every matrix that *writes* to it (`W_O`,
# `W_2`) by `W P` (its columns renumbered), every vector living in it (`b_O`,
# `b_2`, the layer norms' gain and bias) by `b P`, and every table of
# vectors in it (the embeddings, the generator's weight, and the positional
# table) by renumbering its columns. Then the new network computes the same
# logits, and its residual stream at every point is the old one renumbered.
#
# *Proof.* By induction along the network, the invariant being "the residual
# stream is the old one times `P`". The embedding plus positions: a row of
# the renumbered tables is the old row times `P`, and so is their sum (the
# scale `sqrt(d_model)` is a number). A sublayer reads `x P` through `P^T W`:
# `x P P^T W = x W`, the same queries, keys, values or hidden units as before,
# so everything inside the sublayer (the heads, the softmax, the activation)
# is unchanged. It writes `h W P + b P = (h W + b) P`: the old output times
# `P`. The residual sum of two renumbered vectors is the renumbered sum.
# Layer norm takes the mean and variance over the coordinates, which a
# renumbering does not change, and then gain and bias act coordinate by
# coordinate, so with renumbered gain and bias its output is the old one
# times `P`. At the top the generator computes `y P (W_gen P)^T + b =
# y P P^T W_gen^T + b = y W_gen^T + b`, the old logits. QED.
#
# Import applies `perm` to Marian's weights, export its inverse to ours, so
# both directions are instances of the theorem. The tests check it on random
# models, with a random permutation too (`test_permuting_the_residual_stream_is_a_symmetry`), and
# check that a wrong one (no permutation at all, or two coordinates swapped)
# moves the logits by far more than rounding (`test_a_wrong_permutation_is_caught`).

# %%
# the d_model axis of each kind of parameter (fused form): rows (0) of what reads the residual stream (P^T W) and of
# the vectors in it (b P), columns (1) of what writes to it (W P) and of the tables; the others (b_Q, b_K, b_V, b_1,
# generator.bias) live in head or hidden space or over the vocabulary and are not renumbered
READ_OR_IN = ("W_Q", "W_K", "W_V", "W_1", "b_O", "b_2", "ln.weight", "ln.bias", "final_ln.weight", "final_ln.bias")
WRITE_OR_TABLE = ("W_O", "W_2", "src_embed.weight", "tgt_embed.weight", "generator.weight")
RESIDUAL_AXIS = dict.fromkeys(READ_OR_IN, 0) | dict.fromkeys(WRITE_OR_TABLE, 1)


def residual_axis(name: str) -> int | None:
    """The axis of parameter `name` (our fused model's state-dict name) that runs over d_model, or None.

    >>> residual_axis("decoder.layers.0.cross_attn.W_O"), residual_axis("encoder.layers.1.res_ffn.ln.bias")
    (1, 0)
    >>> residual_axis("encoder.layers.0.ffn.b_1") is None
    True
    """
    parts = name.split(".")
    for key in (parts[-1], ".".join(parts[-2:])):
        if key in RESIDUAL_AXIS:
            return RESIDUAL_AXIS[key]
    return None


def permute_residual(state: dict[str, Tensor], perm: Tensor) -> dict[str, Tensor]:
    """A copy of our fused state dict with each parameter's d_model axis indexed by `perm` (the theorem's P)."""
    out = {}
    for name, t in state.items():
        axis = residual_axis(name)
        out[name] = t if axis is None else t.index_select(axis, perm.to(t.device))
    return out


# %% [markdown]
# ## Names and orientation
#
# Each entry of `name_pairs` is `(our name, Marian's name, transposed)`. The
# Marian names are those of `MarianMTModel.state_dict()`; the output bias,
# `final_logits_bias` of shape `(1, V)`, is handled beside them.


# %%
def _linear(ours: str, x: str, hf: str) -> list[tuple[str, str, bool]]:
    """Our W_x (transposed in Marian) and b_x, and Marian's `hf` nn.Linear."""
    return [(f"{ours}.W_{x}", f"{hf}.weight", True), (f"{ours}.b_{x}", f"{hf}.bias", False)]


def _norm(ours: str, hf: str) -> list[tuple[str, str, bool]]:
    return [(f"{ours}.ln.weight", f"{hf}.weight", False), (f"{ours}.ln.bias", f"{hf}.bias", False)]


def name_pairs(N: int) -> list[tuple[str, str, bool]]:
    """(our name, MarianMTModel's name, whether one is the other transposed) for every weight of N layers."""
    pairs = [
        ("src_embed.weight", "model.encoder.embed_tokens.weight", False),
        ("tgt_embed.weight", "model.decoder.embed_tokens.weight", False),
        ("generator.weight", "lm_head.weight", False),
    ]
    attentions = {  # side: (our attention, our residual sublayer, Marian's attention), in the layer's order
        "encoder": [("self_attn", "res_attn", "self_attn")],
        "decoder": [("self_attn", "res_self", "self_attn"), ("cross_attn", "res_cross", "encoder_attn")],
    }
    for i in range(N):
        for side, sublayers in attentions.items():
            ours, hf = f"{side}.layers.{i}", f"model.{side}.layers.{i}"
            for attn, res, theirs in sublayers:
                for x, proj in zip("QKVO", ("q", "k", "v", "out")):  # the attention's four projections
                    pairs += _linear(f"{ours}.{attn}", x, f"{hf}.{theirs}.{proj}_proj")
                pairs += _norm(f"{ours}.{res}", f"{hf}.{theirs}_layer_norm")
            pairs += _linear(f"{ours}.ffn", "1", f"{hf}.fc1") + _linear(f"{ours}.ffn", "2", f"{hf}.fc2")
            pairs += _norm(f"{ours}.res_ffn", f"{hf}.final_layer_norm")
    return pairs


def marian_to_ours(hf_state: dict[str, Tensor], N: int) -> dict[str, Tensor]:
    """Marian's tensors under our names and in our orientation (still in Marian's coordinates and token ids)."""
    out = {ours: hf_state[hf].T if transposed else hf_state[hf] for ours, hf, transposed in name_pairs(N)}
    out["generator.bias"] = hf_state["final_logits_bias"][0]
    return out


def ours_to_marian(state: dict[str, Tensor], N: int) -> dict[str, Tensor]:
    """Our tensors (fused form) under Marian's names and in its orientation."""
    out = {hf: state[ours].T.contiguous() if transposed else state[ours] for ours, hf, transposed in name_pairs(N)}
    out["final_logits_bias"] = state["generator.bias"][None]  # (1, V)
    return out
