# %% [markdown]
# # Into the ecosystem: our model as a Hugging Face `MarianMTModel`, and back
#
# ```sh
# make export CHECKPOINT=runs/<run>/averaged.pt OUT=exported/   # a transformers model folder
# make import HF=opus-mt-de-en/ OUT=opus-mt-de-en.pt            # any MarianMTModel folder
# ```
#
# `MarianMTModel` is the `transformers` class of the OPUS-MT translators and
# of every model trained with Marian NMT: an encoder-decoder Transformer with
# post-norm, sinusoidal positions and tied embeddings, which is the paper's
# model and ours. `export` writes a folder that `MarianMTModel.from_pretrained`
# and `MarianTokenizer.from_pretrained` load with no network; `import` reads
# any such folder (saved with `save_pretrained`) into one of our checkpoints,
# fused or per-head, which then works with every command of the project
# (the heads of an OPUS-MT translator: `docs/training.md#an-opus-mt-models-heads`).
# This file converts models in memory; `folders.py` holds the command.
#
# Each conversion copies, transposes and renumbers numbers and never
# computes new ones (one exception below: a Marian model without embedding
# scaling), so **the converted model is the same function**: the same logits
# for the same token ids, up to the rounding of a different order of
# floating-point operations. What has to be matched, and how:
#
# | | ours | Marian | conversion |
# | --- | --- | --- | --- |
# | weights | `x @ W` (paper) | `nn.Linear`: `x @ weight.T` | transpose (`layout.py`) |
# | sinusoids | interleaved: sin, cos, sin, cos | all sines, then all cosines | renumber the residual stream (`layout.py`, with its proof) |
# | heads | per-head or fused | fused `q_proj` ... | `convert_model` (the chapter, section 5) |
# | activation | `activation`: relu, gelu, silu | `activation_function`: relu, gelu, swish/silu | the same function |
# | embedding scale | always `sqrt(d_model)` | `scale_embedding` | divide the tables by `sqrt(d_model)` where Marian does not scale |
# | output bias | `generator.bias` | `final_logits_bias` | copy |
# | vocabularies | shared or separate, tied or not | `share_encoder_decoder_embeddings`, `tie_word_embeddings` | the same options |
# | first decoder input | `bos` (id 1) | `decoder_start_token_id` (OPUS-MT: the pad id, a zero row) | export: the decoder starts with our `bos`, a `<pad>` row appended (CTranslate2: its own layout); import: token id map (section 1) |
# | norm | post-norm (or pre-norm) | post-norm only | a pre-norm model cannot be exported |

# %%
from __future__ import annotations

import math

import torch
from torch import Tensor

from annotated.checks import check_marian_config, check_marian_exportable
from annotated.interop.layout import (
    inverse_permutation,
    marian_to_ours,
    ours_to_marian,
    permute_residual,
    sinusoid_permutation,
)
from annotated.tokens import BOS, EOS, PAD
from annotated.transformer import (
    Activation,
    AttentionForm,
    EncoderDecoder,
    TransformerConfig,
    convert_model,
    make_model,
)

TO_MARIAN_ACTIVATION = {"relu": "relu", "gelu": "gelu", "silu": "swish"}
FROM_MARIAN_ACTIVATION: dict[str, Activation] = {"relu": "relu", "gelu": "gelu", "swish": "silu", "silu": "silu"}

# %% [markdown]
# ## 1. Token ids: `bos` and Marian's decoder start
#
# Our decoder starts every translation with `bos` (id 1) and pads with `pad`
# (id 0), which the masks hide. Marian starts its decoder with
# `decoder_start_token_id`, which in every OPUS-MT model *is* the pad id, the
# last row of the vocabulary, with a zero embedding. So:
#
# - **Export** keeps our ids 0 ... V-1 and starts Marian's decoder with our
#   `bos` (`decoder_start_token_id` = 1): its first decoder input,
#   `sqrt(d_model) E[bos] + P[0]` with `P` our sinusoids renumbered
#   (`layout.py`), is ours bit for bit, and the folder holds nothing but
#   Marian's own tensors. One row is appended, id V, named `<pad>`: Marian's
#   pad, a zero embedding with the output bias `-inf`, as in OPUS-MT. Our
#   logits are the export's, id for id, plus one logit `-inf` that changes no
#   softmax (`test_export_gives_our_logits`), also after `save_pretrained`
#   (`test_the_export_survives_save_pretrained`). The config records the
#   layout (`annotated_vocab_sizes`), so import gives our ids back.
#
#   **CTranslate2 needs another layout.** Its converter starts every Marian
#   decoder from a zero embedding plus the positional table's first row, and
#   cuts a last `<pad>` entry off the vocabulary. So for CTranslate2 our start
#   vector must be the decoder's first *positional* row, stored in the
#   folder, with a zero start row (`to_marian(..., for_ctranslate2=True)`).
#   No one folder serves both (`save_pretrained` does not write the
#   positional tables), so beside the `transformers` layout the export holds,
#   where `ctranslate2` is installed, `ctranslate2/`: the CTranslate2 layout
#   converted by CTranslate2's own converter (`folders.py`). The stock
#   converter run on the `transformers` folder would start from a zero vector
#   this model never saw
#   (`test_the_stock_converter_on_the_transformers_folder_starts_from_zero`).
#   Exports in the older layout (start row `<pad>`, the start vector in the
#   stored positional row) still import
#   (`test_an_export_in_the_older_layout_still_imports`).
# - **Import** of any other folder maps Marian's pad, decoder start, `eos` and
#   `unk` to our ids 0, 1, 2, 3 and keeps the other ids in their order after
#   them (`token_map`). When the decoder start is the pad id (OPUS-MT), it is
#   needed twice, as our `pad` and as our `bos`, so our vocabulary has one
#   entry more than Marian's; our `pad` row copies Marian's pad row and gets
#   the output bias `-inf`. Then our logits are Marian's, id for id under the
#   map, plus one logit `-inf` that changes no softmax: the probabilities are
#   exactly Marian's (`test_import_gives_marian_logits`).


# %%
def token_map(pad: int, start: int, eos: int, unk: int | None, vocab: int) -> list[int]:
    """Our id -> Marian's id: pad, decoder start, eos, unk at our 0, 1, 2, 3, then Marian's other ids in order.

    Without a known `unk` (a model folder without a vocabulary), the first id not yet taken plays it.

    >>> token_map(pad=5, start=5, eos=0, unk=1, vocab=6)  # OPUS-MT's layout: pad last, the decoder starts with it
    [5, 5, 0, 1, 2, 3, 4]
    >>> token_map(pad=0, start=1, eos=2, unk=3, vocab=6)  # ours: the identity
    [0, 1, 2, 3, 4, 5]
    """
    taken = {pad, start, eos}
    unk = unk if unk is not None else min(i for i in range(vocab) if i not in taken)
    specials = [pad, start, eos, unk]
    return specials + [i for i in range(vocab) if i not in specials]


# %% [markdown]
# ## 2. Export
#
# `to_marian` builds the `MarianMTModel` in memory: our parameters in the
# fused form, the residual stream renumbered to Marian's coordinates (the
# inverse of `sinusoid_permutation`), under Marian's names and in its
# orientation, with the `<pad>` row of section 1 appended
# (`_append_start_row`). A model without attention biases gets zero biases,
# which Marian always has. Separate vocabularies of different sizes are both
# filled up to the larger size with rows never read (zero embedding, output
# bias `-inf`): Marian has one pad id for both. The config says what ours
# says (`marian_config`): `scale_embedding` always on, as our embeddings are
# always scaled by `sqrt(d_model)`; `dropout`, `attention_dropout` and
# `activation_dropout` our residual dropout, our dropout on the attention
# weights, and the dropout our feed-forward network applies after its
# activation, which is `dropout`
# (`test_exported_config_says_what_the_model_does`).

# %%
VOCAB_SIZES_KEY = "annotated_vocab_sizes"  # config.json: [src_vocab, tgt_vocab] of the model this folder came from


def marian_vocab(cfg: TransformerConfig) -> int:
    """The vocabulary size of the export: the larger of ours, plus the appended `<pad>` row (Marian's pad)."""
    return max(cfg.src_vocab, cfg.tgt_vocab) + 1


def marian_config(cfg: TransformerConfig, for_ctranslate2: bool = False):
    """The MarianConfig of the export of a model with our config `cfg`: the decoder starts with our bos, or for
    CTranslate2 with the `<pad>` row (section 1)."""
    from transformers import MarianConfig

    pad = marian_vocab(cfg) - 1
    config = MarianConfig(
        vocab_size=marian_vocab(cfg),
        decoder_vocab_size=marian_vocab(cfg),
        max_position_embeddings=cfg.max_len,
        encoder_layers=cfg.N,
        decoder_layers=cfg.N,
        encoder_ffn_dim=cfg.d_ff,
        decoder_ffn_dim=cfg.d_ff,
        encoder_attention_heads=cfg.h,
        decoder_attention_heads=cfg.h,
        d_model=cfg.d_model,
        activation_function=TO_MARIAN_ACTIVATION[cfg.activation],
        dropout=cfg.dropout,
        attention_dropout=cfg.attention_p,
        activation_dropout=cfg.dropout,  # FeedForward: dropout(activation(x W_1 + b_1)) with p = dropout
        scale_embedding=True,
        pad_token_id=pad,
        bos_token_id=BOS,
        eos_token_id=EOS,
        decoder_start_token_id=pad if for_ctranslate2 else BOS,
        forced_eos_token_id=None,
        share_encoder_decoder_embeddings=cfg.share_embeddings,
        tie_word_embeddings=cfg.tie_generator,
    )
    setattr(config, VOCAB_SIZES_KEY, [cfg.src_vocab, cfg.tgt_vocab])  # written into config.json with the rest
    return config


def _complete_state(model: EncoderDecoder) -> dict[str, Tensor]:
    """Our fused state dict, with zero attention biases where the model has none."""
    fused = convert_model(model, "fused") if model.config.attention == "per_head" else model
    state = {k: v.detach() for k, v in fused.state_dict().items()}
    for name, att in fused.named_modules():
        if hasattr(att, "W_O") and not att.bias:
            for x in "QKVO":  # b_x as wide as W_x's output: h*d_k, h*d_k, h*d_v, d_model
                state[f"{name}.b_{x}"] = att.W_O.new_zeros(getattr(att, f"W_{x}").size(1))
    return state


TABLES = ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight", "lm_head.weight")


def _append_start_row(hf_state: dict[str, Tensor], rows: int) -> dict[str, Tensor]:
    """Marian's token tables filled up to `rows` rows with zero rows, the last being Marian's pad; the output bias of
    every added row -inf (never predicted)."""
    out = dict(hf_state)
    for name in TABLES:
        t = hf_state[name]  # (V, d_model)
        out[name] = torch.cat([t, t.new_zeros(rows - t.size(0), t.size(1))])  # (rows, d_model)
    bias = hf_state["final_logits_bias"]  # (1, V)
    out["final_logits_bias"] = torch.cat([bias, bias.new_full((1, rows - bias.size(1)), -math.inf)], dim=1)
    return out


def first_decoder_input(model: EncoderDecoder) -> Tensor:
    """Our decoder's input at position 0, sqrt(d_model) E[bos] + PE[0] (d_model,), as the model computes it."""
    was_training = model.training
    model.eval()
    bos = torch.tensor([[BOS]], device=next(model.parameters()).device)  # (1, 1)
    x0 = model.pos(model.tgt_embed(bos))[0, 0]  # (d_model,)
    model.train(was_training)
    return x0


@torch.no_grad()
def to_marian(model: EncoderDecoder, heads: dict | None = None, for_ctranslate2: bool = False):
    """A transformers MarianMTModel computing the same function as `model` (same dtype, eval mode): our ids, then
    Marian's pad; the decoder starts with our bos, or with `for_ctranslate2` from the zero pad row with our first
    decoder input as the decoder's first positional row (section 1)."""
    from transformers import MarianMTModel

    check_marian_exportable(model.config, heads)
    cfg = model.config
    to_theirs = inverse_permutation(sinusoid_permutation(cfg.d_model))
    state = permute_residual(_complete_state(model), to_theirs)
    hf_state = _append_start_row(ours_to_marian(state, cfg.N), marian_vocab(cfg))
    if cfg.share_embeddings:
        hf_state["model.shared.weight"] = hf_state["model.encoder.embed_tokens.weight"]
    dtype = next(model.parameters()).dtype
    hf = MarianMTModel(marian_config(cfg, for_ctranslate2)).to(dtype).eval()  # type: ignore[arg-type]  # nn.Module.to(dtype); transformers' stub types only .to(model)
    for name, t in hf.state_dict().items():
        if "embed_positions" not in name:  # the sinusoids: Marian computes its own table
            t.copy_(hf_state[name])
    if for_ctranslate2:
        hf.model.decoder.embed_positions.weight[0] = first_decoder_input(model)[to_theirs]
        hf._keys_to_ignore_on_save = {"model.encoder.embed_positions.weight"}  # save the decoder's table
    return hf


# %% [markdown]
# ## 3. Import
#
# `from_marian` runs the export backwards: Marian's tensors under our names,
# renumbered by `sinusoid_permutation`, their token rows picked by
# `token_map`. Where Marian and we differ:
#
# - **`scale_embedding=False`.** Our embeddings always multiply by
#   `sqrt(d_model)`, so the imported tables are Marian's divided by it (one
#   rounding, the one place a conversion computes), and the generator keeps
#   Marian's undivided table (`tie_generator=False`).
# - **Which tables are one.** In `transformers` 5 `tie_word_embeddings=False`
#   unties the encoder's and decoder's tables too, so the import looks at
#   the numbers: `share_embeddings` where the two tables are equal,
#   `tie_generator` where the decoder's equals the output projection's.
# - **What our one config cannot hold is refused** (`check_marian_config`,
#   `_check_positions`): different encoder and decoder sizes, activations we
#   do not have (`FROM_MARIAN_ACTIVATION` lists the spellings read),
#   positional tables that are not sinusoids (but for the first decoder row
#   of an export of ours in CTranslate2's layout). Marian has no pre-norm, so
#   every imported model is post-norm.
# - **An export of ours** (`annotated_vocab_sizes` in its config) comes back
#   with our ids, the `<pad>` row dropped; its first decoder input must be
#   ours exactly, which a CTranslate2-layout folder saved again by
#   `save_pretrained` is not: it is refused with the reason.


# %%
def our_config(config, src_vocab: int, tgt_vocab: int, share: bool, tie: bool) -> TransformerConfig:
    """Our TransformerConfig for a (checked) MarianConfig; `share` and `tie` say which of its tables are one."""
    return TransformerConfig(
        src_vocab=src_vocab,
        tgt_vocab=tgt_vocab,
        N=config.encoder_layers,
        d_model=config.d_model,
        d_ff=config.encoder_ffn_dim,
        h=config.encoder_attention_heads,
        dropout=float(config.dropout),
        max_len=config.max_position_embeddings,
        norm="post",
        bias=True,
        share_embeddings=share,
        tie_generator=tie and config.scale_embedding,
        activation=FROM_MARIAN_ACTIVATION[config.activation_function],
        attention_dropout=None if config.attention_dropout == config.dropout else float(config.attention_dropout),
    )


def _check_positions(hf, ours_exported: bool) -> None:
    """Marian's positional tables are its sinusoids, but for the first decoder row of an export of ours."""
    from transformers.models.marian.modeling_marian import MarianSinusoidalPositionalEmbedding

    for side in ("encoder", "decoder"):
        table = getattr(hf.model, side).embed_positions.weight  # (max_len, d_model)
        sines = MarianSinusoidalPositionalEmbedding(*table.shape).create_weight().to(table.dtype)  # (max_len, d_model)
        first = 1 if side == "decoder" and ours_exported else 0
        if not torch.equal(table[first:], sines[first:]):
            raise ValueError(
                f"the {side}'s positional table is not Marian's sinusoids; our model has sinusoidal positions "
                f"only, so this model cannot be imported"
            )


def _check_start_row(hf, model: EncoderDecoder) -> None:
    """An export of ours: the decoder's first input in Marian (its start token's row, scaled, plus the first
    positional row) is ours, bit for bit."""
    dec = hf.model.decoder
    start = hf.config.decoder_start_token_id
    theirs = dec.embed_tokens.weight[start] * dec.embed_scale + dec.embed_positions.weight[0]  # (d_model,)
    ours = first_decoder_input(model)[inverse_permutation(sinusoid_permutation(hf.config.d_model))]  # (d_model,)
    if not torch.equal(theirs, ours):
        raise ValueError(
            "this folder is an export of ours, but its first decoder positional row no longer holds the start "
            "vector (a folder in CTranslate2's layout, as older exports were, saved again by transformers' "
            "save_pretrained loses it, see section 1 of annotated/interop/marian.py): export the checkpoint again"
        )


@torch.no_grad()
def from_marian(
    hf, attention: AttentionForm = "fused", unk: int | None = None
) -> tuple[EncoderDecoder, list[int], list[int]]:
    """Our model computing the same function as MarianMTModel `hf`, and the source and target token maps
    (our id -> Marian's id). `unk` is the vocabulary's unk id, where known."""
    config = hf.config
    check_marian_config(config, FROM_MARIAN_ACTIVATION)
    sizes = getattr(config, VOCAB_SIZES_KEY, None)  # an export of ours: our ids, then the `<pad>` row
    _check_positions(hf, sizes is not None)
    state = {k: v.detach() for k, v in hf.state_dict().items()}
    state = permute_residual(marian_to_ours(state, config.encoder_layers), sinusoid_permutation(config.d_model))
    src, tgt, head = state["src_embed.weight"], state["tgt_embed.weight"], state["generator.weight"]
    share = src.shape == tgt.shape and torch.equal(src, tgt)  # one table, whatever the config's flags say
    tie = tgt.shape == head.shape and torch.equal(tgt, head)
    if sizes is not None:
        src_map, tgt_map = list(range(sizes[0])), list(range(sizes[1]))
        share = share and sizes[0] == sizes[1]
    else:
        ids = (config.pad_token_id, config.decoder_start_token_id, config.eos_token_id, unk)
        src_map, tgt_map = token_map(*ids, vocab=src.size(0)), token_map(*ids, vocab=tgt.size(0))
    scale = 1.0 if config.scale_embedding else math.sqrt(config.d_model)
    state["src_embed.weight"] = src[src_map] / scale  # (V_src, d_model)
    state["tgt_embed.weight"] = tgt[tgt_map] / scale  # (V_tgt, d_model)
    state["generator.weight"] = head[tgt_map]  # (V_tgt, d_model)
    state["generator.bias"] = state["generator.bias"][tgt_map].clone()  # (V_tgt,)
    if tgt_map[PAD] == tgt_map[BOS]:  # Marian's pad is our pad and our bos: only one of them may be predicted
        state["generator.bias"][PAD] = -math.inf
    dtype = next(hf.parameters()).dtype
    model = make_model(our_config(config, len(src_map), len(tgt_map), share, tie)).to(dtype).eval()
    model.load_state_dict(state, strict=True)
    if sizes is not None:
        _check_start_row(hf, model)
    return (convert_model(model, attention) if attention == "per_head" else model), src_map, tgt_map


# %% [markdown]
# ## 4. Folders and files
#
# `folders.py` writes and reads them: `export_marian`, `import_marian`.

# %% [markdown]
# ## 5. What the tests establish
#
# The tests cited above build every model from a config with random weights
# (scaled up, so that logits spread over several units and any slip shows),
# nothing downloaded: our logits are Marian's within 1e-9 in float64 after
# import, within 1e-12 for every activation spelling and table option
# (`test_every_activation_spelling_and_table_option_imports_as_the_same_function`;
# the others are refused, `test_an_activation_we_do_not_have_is_refused`),
# within 1e-12 in float64 and 1e-4 in float32 after export; export then
# import gives back every parameter bit for bit (`test_round_trip_is_exact`),
# and the export's `ctranslate2/` model our log-probabilities and
# translations (`test_the_exported_ctranslate2_model_gives_our_log_probabilities`,
# `test_the_exported_ctranslate2_model_translates_as_we_do`).
#
# Our `beam_search` and `generate` with `num_beams=4`, `early_stopping=True`
# and no length penalty give the same token ids
# (`test_beam_search_equals_generate`) but in one case. **At the length
# limit**, `generate` ranks the `k` best candidates of the last step,
# finished or not, with the translations finished before; our search ranks
# the live prefixes only when fewer than `k` translations have finished
# (`annotated/decoding/search.py`, section 6). So when the last step itself
# brings the `k`-th finished translation, a live prefix cut at the limit that
# scores higher than every finished translation is kept by `generate` and
# dropped by ours. Every difference is of that kind
# (`test_at_the_length_limit_generate_differs_only_as_stated`; how often:
# `docs/training.md#exported-and-imported-the-shipped-models`).

# %% [markdown]
# ## 6. A trained model and its export, on real sentences
#
# The length penalties are the one setting that cannot be matched: GNMT's
# `((5 + |Y|) / 6)^alpha` against `|Y|^length_penalty`. They rank two
# finished translations of lengths `m < n` the same way except when the
# ratio of their log-probabilities falls between the two penalties' ratios.
# `python -m benchmarks.agreement` compares a checkpoint and its export on
# test_2016_flickr, logits and translations with and without length
# penalties; what it measured on the shipped models, with CTranslate2 and
# with export then import
# (`test_export_then_import_translates_as_the_checkpoint`), is in
# `docs/training.md#exported-and-imported-the-shipped-models`.
