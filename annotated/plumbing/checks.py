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
# # Checks at the door
#
# The chapter in `annotated/transformer.py` tells the story of the model and
# assumes well-formed inputs. The entry points (the decoders, the translator,
# the equivalence report) check what a user hands them *once*, here, before
# any model work, and fail with one line that names what is wrong. Nothing in
# this file runs on the training hot path: a value check such as the token-id
# range reads the tensor back to the host, which would stall a GPU every step.

# %%
from __future__ import annotations

import torch
from torch import Tensor


def check_token_ids(tokens: Tensor, vocab: int) -> None:
    """Raise a ValueError unless `tokens` is a (B, T) integer tensor of ids in [0, vocab).

    >>> check_token_ids(torch.tensor([[3, 4, 5]]), vocab=6)
    >>> check_token_ids(torch.tensor([[3, 4, 6]]), vocab=6)
    Traceback (most recent call last):
    ...
    ValueError: token ids must lie in [0, 6) (the model's vocabulary), got min 3, max 6
    """
    if not isinstance(tokens, Tensor):
        raise ValueError(f"token ids must be a (B, T) tensor, got {type(tokens).__name__}")
    if tokens.dtype not in (torch.int64, torch.int32) or tokens.dim() != 2:
        raise ValueError(f"token ids must be an int64 or int32 tensor of shape (B, T), got {tokens.dtype} "
                         f"{tuple(tokens.shape)}")
    if tokens.numel() and (tokens.min() < 0 or tokens.max() >= vocab):
        raise ValueError(f"token ids must lie in [0, {vocab}) (the model's vocabulary), got "
                         f"min {int(tokens.min())}, max {int(tokens.max())}")


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
        raise ValueError(f"{name} of shape {tuple(mask.shape)} does not broadcast to the attention scores of "
                         f"shape {tuple(scores_shape)} (B, T_q, T_k)")


def check_attention_inputs(att, x_q: Tensor, x_kv: Tensor | None, mask: Tensor | None = None) -> None:
    """What `PerHeadAttention`/`FusedAttention` expect: (B, T, d_model) inputs of the weights' dtype
    (any floating dtype under autocast), equal batch sizes, and a mask for (B, T_q, T_k).

    >>> from annotated.transformer import FusedAttention
    >>> check_attention_inputs(FusedAttention(8, 2), torch.randn(2, 3, 7), torch.randn(2, 3, 8))
    Traceback (most recent call last):
    ...
    ValueError: query input must have shape (B, T, d_model=8), got (2, 3, 7)
    """
    if x_kv is None:
        raise ValueError("give the key/value input x_kv (for self-attention, the query input again)")
    dtype = next(att.parameters()).dtype
    for name, x in (("query input", x_q), ("key/value input", x_kv)):
        if not isinstance(x, Tensor) or x.dim() != 3 or x.size(-1) != att.d_model:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"{name} must have shape (B, T, d_model={att.d_model}), got {got}")
        autocast = x.is_floating_point() and torch.is_autocast_enabled(x.device.type)
        if x.dtype != dtype and not autocast:
            raise ValueError(f"{name} has dtype {x.dtype} but the weights have {dtype}; convert one to the other")
    if x_kv.size(0) != x_q.size(0):
        raise ValueError(f"batch sizes differ: query input {tuple(x_q.shape)}, key/value input {tuple(x_kv.shape)}")
    if mask is not None:
        check_mask(mask, (x_q.size(0), x_q.size(1), x_kv.size(1)))


def check_model_inputs(model, src: Tensor | None = None, src_mask: Tensor | None = None,
                       tgt: Tensor | None = None, tgt_mask: Tensor | None = None,
                       memory: Tensor | None = None, start: int = 0) -> None:
    """What `model.encode` (src), `model.decode` (memory, tgt) and `model(...)` (src, tgt) expect.

    Token ids in range, lengths within `config.max_len`, masks that broadcast,
    memory of shape (B, S, d_model) in the model's dtype, equal batch sizes.
    """
    cfg = model.config
    B = S = None
    if src is not None:
        check_token_ids(src, cfg.src_vocab)
        B, S = src.shape
        if S > cfg.max_len:
            raise ValueError(f"source length {S} exceeds the model's max_len={cfg.max_len}")
        if src_mask is not None:
            check_mask(src_mask, (B, S, S), "src_mask")
    if memory is not None:
        dtype = next(model.parameters()).dtype
        if not isinstance(memory, Tensor) or memory.dim() != 3 or memory.size(-1) != cfg.d_model:
            raise ValueError(f"memory must have shape (B, S, d_model={cfg.d_model}), got "
                             f"{tuple(memory.shape) if isinstance(memory, Tensor) else type(memory).__name__}")
        if memory.dtype != dtype and not torch.is_autocast_enabled(memory.device.type):
            raise ValueError(f"memory has dtype {memory.dtype} but the model has {dtype}; convert one to the other")
        B, S = memory.shape[:2]
    if tgt is not None:
        check_token_ids(tgt, cfg.tgt_vocab)
        T = tgt.size(1)
        if B is not None and tgt.size(0) != B:
            raise ValueError(f"batch sizes differ: {B} source sentences, {tgt.size(0)} target sentences")
        if not isinstance(start, int) or start < 0 or start + T > cfg.max_len:
            raise ValueError(f"target positions {start} to {start + T - 1} must lie in [0, max_len={cfg.max_len})")
        if tgt_mask is not None:
            check_mask(tgt_mask, (tgt.size(0), T, T), "tgt_mask")
        if src_mask is not None and S is not None:
            check_mask(src_mask, (tgt.size(0), T, S), "src_mask")
