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
