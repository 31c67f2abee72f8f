# %% [markdown]
# # Checks at the door
#
# The chapter in `annotated/transformer.py` tells the story of the model and
# assumes well-formed inputs (a one-line `assert` at most). The entry points
# (the decoders, the translator, the attention dump, the heads command, the
# equivalence report and the conversions of `annotated/proof/torch_mha.py`
# and `annotated/interop/marian.py`) check what a user hands them *once*,
# here, before any model work, and fail with one line that names what is
# wrong (what each refuses: docs/faults.md#model-inputs). Options have
# their own door, `annotated/plumbing/options.py`. Nothing here runs on the
# training hot path: a value check such as the token-id range reads the
# tensor back to the host, which would stall a GPU every step.

# %%
from __future__ import annotations

import math
from collections.abc import Collection, Sequence

import torch
from torch import Tensor, nn

from annotated.checkpoint import CheckpointError
from annotated.tokens import PAD
from annotated.transformer import EncoderDecoder


def check_eval_mode(model: nn.Module, what: str) -> None:
    """Decoding and reading attention need eval mode: in training mode dropout makes every call random."""
    if model.training:
        raise ValueError(
            f"{what} needs the model in eval mode (call model.eval()): dropout would make every step random"
        )


def check_token_ids(tokens: Tensor, vocab: int, name: str = "token ids") -> None:
    """Raise a ValueError unless `tokens` is a (B, T) integer tensor of ids in [0, vocab).

    >>> check_token_ids(torch.tensor([[3, 4, 5]]), vocab=6)
    >>> check_token_ids(torch.tensor([[3, 4, 6]]), vocab=6)
    Traceback (most recent call last):
    ...
    ValueError: token ids must lie in [0, 6) (the model's vocabulary), got min 3, max 6
    """
    if not isinstance(tokens, Tensor):
        raise ValueError(f"{name} must be a (B, T) tensor, got {type(tokens).__name__}")
    if tokens.dtype not in (torch.int64, torch.int32) or tokens.dim() != 2:
        raise ValueError(
            f"{name} must be an int64 or int32 tensor of shape (B, T), got {tokens.dtype} {tuple(tokens.shape)}"
        )
    if tokens.numel() and (tokens.min() < 0 or tokens.max() >= vocab):
        raise ValueError(
            f"{name} must lie in [0, {vocab}) (the model's vocabulary), got "
            f"min {int(tokens.min())}, max {int(tokens.max())}"
        )


def check_mask(mask: Tensor, scores_shape: tuple[int, ...], name: str = "mask") -> None:
    """Raise a ValueError unless `mask` is boolean (True = may attend) and broadcasts to the scores' shape.

    >>> check_mask(torch.ones(2, 1, 4, dtype=torch.bool), (2, 3, 4))
    >>> check_mask(torch.ones(2, 3, 5, dtype=torch.bool), (2, 3, 4))
    Traceback (most recent call last):
    ...
    ValueError: mask of shape (2, 3, 5) does not broadcast to the attention scores of shape (2, 3, 4) (B, T_q, T_k)
    """
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        got = mask.dtype if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(f"{name} must be a bool tensor (True = may attend), got {got}")
    try:
        shape = torch.broadcast_shapes(mask.shape, scores_shape)
    except RuntimeError:
        shape = None
    if shape != tuple(scores_shape):
        raise ValueError(
            f"{name} of shape {tuple(mask.shape)} does not broadcast to the attention scores of "
            f"shape {tuple(scores_shape)} (B, T_q, T_k)"
        )


def check_decoding(model: EncoderDecoder, src: Tensor, src_mask: Tensor | None, max_len: int) -> None:
    """What `greedy`, `beam_search` and `sequence_logprob` expect: eval mode, (B, S) source ids of the
    vocabulary, S <= config.max_len, a source mask (B or 1, 1 or S, S), 1 <= max_len <= config.max_len."""
    check_eval_mode(model, "decoding")
    check_token_ids(src, model.config.src_vocab, "src token ids")
    B, S = src.shape
    if src_mask is not None:
        check_mask(src_mask, (B, S, S), "src_mask")
        if src_mask.dim() != 3:
            raise ValueError(f"src_mask must have shape (B={B} or 1, 1 or S, S={S}), got {tuple(src_mask.shape)}")
    limit = model.config.max_len
    if isinstance(max_len, bool) or not isinstance(max_len, int) or not 1 <= max_len <= limit:
        raise ValueError(f"max_len must be an int in [1, {limit}] (the model's max_len), got {max_len!r}")
    if limit < S:
        raise ValueError(f"source length {S} exceeds the model's max_len={limit}")


def check_decoder_output(model: EncoderDecoder, src: Tensor, ys: Tensor) -> None:
    """What `sequence_logprob` scores: (B, L) ids as the decoders return them, 1 <= L <= config.max_len."""
    limit = model.config.max_len
    if not isinstance(ys, Tensor) or ys.dim() != 2 or ys.size(0) != src.size(0) or not 1 <= ys.size(1) <= limit:
        got = tuple(ys.shape) if isinstance(ys, Tensor) else type(ys).__name__
        raise ValueError(f"ys must have shape (B={src.size(0)}, L) with 1 <= L <= max_len={limit}, got {got}")
    check_token_ids(ys, model.config.tgt_vocab, "ys")


def check_beam(beam_size: int, length_penalty: float) -> None:
    """A beam of at least one hypothesis, and a finite GNMT alpha >= 0."""
    if isinstance(beam_size, bool) or not isinstance(beam_size, int) or beam_size < 1:
        raise ValueError(f"beam_size must be an int >= 1, got {beam_size!r}")
    if not (isinstance(length_penalty, (int, float)) and math.isfinite(length_penalty) and length_penalty >= 0):
        raise ValueError(f"length_penalty (alpha) must be a finite number >= 0, got {length_penalty!r}")


def check_sources(model: EncoderDecoder, sources: Sequence[Sequence[int]], batch_size: int, max_extra: int) -> None:
    """What `translate_ids` expects: eval mode, lists of source ids of the vocabulary, a batch size >= 1, and
    max_extra >= 0. (A source longer than max_len is allowed: `translate_ids` cuts it and says so.)"""
    check_eval_mode(model, "translating")
    vocab = model.config.src_vocab
    for i, ids in enumerate(sources):
        if isinstance(ids, (str, bytes)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"source {i} must be a list of int token ids, got {ids!r:.60}")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"source {i} holds ids outside [0, {vocab}) (the model's vocabulary): {bad[:5]}")
    for name, value, low in (("batch_size", batch_size, 1), ("max_extra", max_extra, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def check_id_list(name: str, ids: Sequence[int], vocab: int, max_len: int, allow_pad: bool) -> list[int]:
    """One sentence of ids for a teacher-forced pass: not empty, at most max_len, in the vocabulary,
    and (unless `allow_pad`) no pad id, which the padding mask would hide. Returns them as ints.

    >>> check_id_list("source", [5, 0], vocab=9, max_len=4, allow_pad=False)
    Traceback (most recent call last):
    ...
    ValueError: source holds ids outside [0, 9) or the pad id 0 (it would be masked): [0]
    """
    ids = [int(i) for i in ids]
    if not ids:
        raise ValueError(f"{name} is empty: need at least one token")
    if len(ids) > max_len:
        raise ValueError(f"{name} has {len(ids)} tokens, more than the model's max_len={max_len}")
    bad = [i for i in ids if not 0 <= i < vocab or (i == PAD and not allow_pad)]
    if bad:
        raise ValueError(
            f"{name} holds ids outside [0, {vocab})"
            f"{'' if allow_pad else f' or the pad id {PAD} (it would be masked)'}: {bad[:5]}"
        )
    return ids


def check_source_and_target(model: EncoderDecoder, src: Tensor, tgt: Tensor) -> None:
    """A batch of sources and targets for one teacher-forced pass: ids of the vocabularies, equal batch
    sizes, lengths within config.max_len."""
    cfg = model.config
    check_token_ids(src, cfg.src_vocab, "source ids")
    check_token_ids(tgt, cfg.tgt_vocab, "target ids")
    if src.size(0) != tgt.size(0):
        raise ValueError(f"batch sizes differ: {src.size(0)} source sentences, {tgt.size(0)} target sentences")
    for name, ids in (("source", src), ("target", tgt)):
        if ids.size(1) > cfg.max_len:
            raise ValueError(f"{name} length {ids.size(1)} exceeds the model's max_len={cfg.max_len}")


def check_tokenizer(tokenizer, path, purpose: str) -> None:
    """A checkpoint used on text must carry the tokenizer its training data was cut with."""
    if tokenizer is None:
        raise CheckpointError(f"checkpoint {path} holds no tokenizer, so it cannot {purpose}")


def check_torch_mha(mha) -> None:
    """An nn.MultiheadAttention our attentions can hold: keys and values of width embed_dim, no extra keys.

    >>> check_torch_mha(nn.MultiheadAttention(8, 2, add_zero_attn=True))
    Traceback (most recent call last):
    ...
    ValueError: nn.MultiheadAttention with add_bias_kv=True or add_zero_attn=True adds keys and values that our attentions do not have
    """
    if not isinstance(mha, nn.MultiheadAttention):
        raise ValueError(f"expected a torch.nn.MultiheadAttention, got {type(mha).__name__}")
    if not mha._qkv_same_embed_dim:
        raise ValueError(
            f"nn.MultiheadAttention with kdim={mha.kdim}, vdim={mha.vdim} != embed_dim={mha.embed_dim} "
            f"has separate input projections for keys and values of other widths; our attentions "
            f"read keys and values of width d_model"
        )
    if mha.bias_k is not None or mha.add_zero_attn:
        raise ValueError(
            "nn.MultiheadAttention with add_bias_kv=True or add_zero_attn=True adds keys and values "
            "that our attentions do not have"
        )


def check_marian_exportable(config, heads=None) -> None:
    """A model that a MarianMTModel can hold: post-norm, heads d_model / h wide, the same h everywhere,
    d_model even (the sinusoids come in pairs)."""
    if config.norm != "post":
        raise ValueError(
            f"this model is {config.norm}-norm; MarianMTModel is post-norm only, so no Marian model "
            f"computes it (export a model trained with norm='post')"
        )
    if heads is not None:
        raise ValueError(
            "this checkpoint is pruned (its attentions have different numbers of heads); MarianMTModel "
            "needs the same h in every attention: export the checkpoint it was pruned from"
        )
    d_k, d_v = config.d_k or config.d_model // config.h, config.d_v or config.d_model // config.h
    if not d_k == d_v == config.d_model // config.h or config.d_model % config.h:
        raise ValueError(
            f"MarianMTModel needs d_k = d_v = d_model / h, got d_model={config.d_model}, h={config.h}, "
            f"d_k={d_k}, d_v={d_v}"
        )
    if config.d_model % 2:
        raise ValueError(f"d_model={config.d_model} is odd; the sinusoids of both models need it even")


def check_marian_config(config, activations: Collection[str]) -> None:
    """A MarianConfig our one TransformerConfig can express, its activation one of `activations` (the names the
    conversion maps); ValueError naming the field otherwise."""
    if getattr(config, "model_type", None) != "marian":
        raise ValueError(f"expected a Marian model (model_type 'marian'), got {getattr(config, 'model_type', None)!r}")
    for enc, dec in (
        ("encoder_layers", "decoder_layers"),
        ("encoder_ffn_dim", "decoder_ffn_dim"),
        ("encoder_attention_heads", "decoder_attention_heads"),
    ):
        if getattr(config, enc) != getattr(config, dec):
            raise ValueError(
                f"{enc}={getattr(config, enc)} differs from {dec}={getattr(config, dec)}; our model has "
                f"one size for both stacks, so this Marian model cannot be imported"
            )
    if config.activation_function not in activations:
        raise ValueError(
            f"activation_function {config.activation_function!r} is not one of "
            f"{sorted(activations)}, the ones our feed-forward network has"
        )
    if config.d_model % config.encoder_attention_heads or config.d_model % 2:
        raise ValueError(
            f"d_model={config.d_model} must be even and divisible by the {config.encoder_attention_heads} heads"
        )
    vocab = min(config.vocab_size, config.decoder_vocab_size)
    for name in ("pad_token_id", "eos_token_id", "decoder_start_token_id"):
        i = getattr(config, name)
        if not isinstance(i, int) or not 0 <= i < vocab:
            raise ValueError(f"{name}={i!r} is not a token id of the vocabulary [0, {vocab})")
    if config.eos_token_id in (config.pad_token_id, config.decoder_start_token_id):
        raise ValueError(
            f"eos_token_id={config.eos_token_id} is also the pad or decoder start id; our model "
            f"needs eos apart from both"
        )
