# %% [markdown]
# # The reference: `torch.nn.Transformer` doing the same work (`make bench`)
#
# `torch.nn.Transformer` is only the two stacks. Around it we put what our
# `EncoderDecoder` has, in plain PyTorch: one `nn.Embedding` table shared by
# source and target and scaled by `sqrt(d_model)`, the same sinusoidal
# positions and dropout, and an `nn.Linear` generator whose weight *is* the
# embedding table (our presets tie all three). Then the work is the same:
#
# - `batch_first=True`, the same `d_model`, `h` (nhead), `N` layers in each
#   stack, `d_ff`, dropout (in the same four places: positions, attention
#   weights, sublayer outputs, the feed-forward hidden layer) and ReLU;
# - **post-norm** (`norm_first=False`), as our default. `nn.Transformer`
#   always adds a final LayerNorm after each stack, which a post-norm model
#   does not have (ours adds one only for pre-norm), so we remove those two;
# - the masks express the same rules in torch's convention (`True` = *blocked*):
#   source padding for the encoder and for cross-attention, and the causal
#   mask plus target padding for the decoder's self-attention.
#
# The loss is the same label-smoothed loss as training's `batch_loss`. The
# bench's "fused >= 1.0x torch.nn.Transformer" target compares our fused
# step with this one at every size: a change that slows our step down shows
# there as a ratio under 1.

# %%
from __future__ import annotations

import math
import warnings

import torch
from torch import Tensor, nn

from annotated import transformer
from annotated.tokens import PAD
from annotated.training.loss import label_smoothed_loss
from annotated.transformer import TransformerConfig


class TorchTransformerReference(nn.Module):
    """torch.nn.Transformer inside embeddings, positional encoding and a generator like ours."""

    pe: Tensor  # (max_len, d_model), a buffer

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        if not cfg.bias or cfg.d_k not in (None, cfg.d_model // cfg.h) or cfg.d_v not in (None, cfg.d_model // cfg.h):
            raise ValueError(f"torch.nn.Transformer needs attention biases and d_k = d_v = d_model / h; got {cfg}")
        self.config, d = cfg, cfg.d_model
        self.src_embed = nn.Embedding(cfg.src_vocab, d)
        self.tgt_embed = self.src_embed if cfg.share_embeddings else nn.Embedding(cfg.tgt_vocab, d)
        self.register_buffer("pe", transformer.sinusoidal_encoding(cfg.max_len, d), persistent=False)
        self.dropout = nn.Dropout(cfg.dropout)
        with warnings.catch_warnings():  # a note about nested tensors, which only inference uses
            warnings.simplefilter("ignore")
            self.transformer = nn.Transformer(
                d, cfg.h, cfg.N, cfg.N, cfg.d_ff, cfg.dropout, batch_first=True, norm_first=cfg.norm == "pre"
            )
        if cfg.norm == "post":  # no final LayerNorm after a post-norm stack
            self.transformer.encoder.norm = None
            self.transformer.decoder.norm = None
        self.generator = nn.Linear(d, cfg.tgt_vocab)
        if cfg.tie_generator:
            self.generator.weight = self.tgt_embed.weight  # (V, d_model), the same Parameter

    def _embed(self, table: nn.Embedding, tokens: Tensor) -> Tensor:
        x = table(tokens) * math.sqrt(self.config.d_model)  # (B, T, d_model)
        return self.dropout(x + self.pe[: tokens.size(1)])  # (B, T, d_model)

    def forward(self, src: Tensor, tgt: Tensor, positions: Tensor | None = None) -> Tensor:
        """src (B, S), tgt (B, T) ids -> logits (B, T, V), or (n, V) for the flat `positions` (n,) given."""
        src_pad, tgt_pad = src == PAD, tgt == PAD  # (B, S), (B, T) True = ignore this key
        T = tgt.size(1)
        causal = torch.ones(T, T, dtype=torch.bool, device=tgt.device).triu(1)  # (T, T) True = future, blocked
        y = self.transformer(
            self._embed(self.src_embed, src),
            self._embed(self.tgt_embed, tgt),
            tgt_mask=causal,
            src_key_padding_mask=src_pad,
            tgt_key_padding_mask=tgt_pad,
            memory_key_padding_mask=src_pad,
            tgt_is_causal=True,
        )  # (B, T, d_model)
        if positions is not None:
            y = y.flatten(0, 1).index_select(0, positions)  # (n, d_model)
        return self.generator(y)  # (B, T, V) or (n, V)


def reference_batch_loss(
    model: TorchTransformerReference, src: Tensor, tgt: Tensor, eps: float, real: Tensor | None = None
) -> tuple[Tensor, int]:
    """The reference's version of `train.batch_loss`: (summed loss, predicted tokens); with `real` (the flat
    indices of tgt[:, 1:]'s non-pad entries) only those positions are projected onto the vocabulary."""
    tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]  # (B, T-1), (B, T-1)
    if real is None:
        return label_smoothed_loss(model(src, tgt_in), tgt_out, eps), int((tgt_out != PAD).sum())
    logits = model(src, tgt_in, positions=real)  # (n, V)
    return label_smoothed_loss(logits, tgt_out.flatten().index_select(0, real), eps), int((tgt_out != PAD).sum())
