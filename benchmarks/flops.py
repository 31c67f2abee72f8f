# %% [markdown]
# # Model FLOPs of a training step, and MFU (`make bench`)
#
# Model FLOPs utilisation compares the arithmetic the model *needs* with what
# the chip could do: `MFU = (model FLOPs per step / seconds per step) / peak
# FLOP/s`. We count the matrix products analytically, 2 FLOPs per
# multiply-add, and the backward pass as twice the forward (the gradients
# with respect to the inputs and to the weights), so a weight matrix with
# `P` entries costs `6 P` FLOPs per token it is applied to. With
# `H_k = h d_k`, `H_v = h d_v`, `S_i` and `T_i` the real (unpadded) lengths of
# sentence `i`'s source and decoder input:
#
# - weights applied to every **source** token: per encoder layer the four
#   attention projections (`2 d_model H_k + 2 d_model H_v` entries) and the
#   feed-forward (`2 d_model d_ff`); per decoder layer the cross-attention
#   `W_K, W_V` (`d_model H_k + d_model H_v`), which read the memory;
# - weights applied to every **target** token: per decoder layer self-attention
#   (`2 d_model H_k + 2 d_model H_v`), cross-attention `W_Q, W_O`
#   (`d_model H_k + H_v d_model`) and the feed-forward; and the generator
#   (`d_model V`: tied to the embedding table, but a real product, unlike the
#   embedding lookup, which costs no FLOPs);
# - attention itself, per layer: `Q K^T` and `weights V` cost
#   `2 T_q T_k (H_k + H_v)` forward, `6 T_q T_k (H_k + H_v)` with the
#   backward, for `T_q T_k` = `S_i^2` (encoder), `T_i^2` (decoder
#   self-attention, counted in full: we do not discount the causal mask,
#   as PaLM's MFU does not) and `T_i S_i` (cross-attention).
#
# $$F = 6\Big(\sum_i S_i \cdot P_{src} + \sum_i T_i \cdot P_{tgt}\Big)
#   + 6 N (H_k + H_v) \sum_i \big(S_i^2 + T_i^2 + T_i S_i\big)$$
#
# Padding positions are computed but not counted, so MFU charges padding as
# waste. Layer norms, softmax, biases, the loss and the optimiser are left
# out (elementwise work, well under 1% of the FLOPs at these sizes).
# `test_flop_formula_matches_flop_counter` checks `F` against PyTorch's
# `FlopCounterMode` on a batch without padding, for both forms of attention.
#
# GPU peaks are the dense (no 2:4 sparsity) bf16 tensor-core figures of
# NVIDIA's data sheets, matched by the name CUDA reports; `--peak-tflops`
# overrides. A CPU's peak is measured instead (`benchmarks/arithmetic.py`).

# %%
from __future__ import annotations

import re

from annotated import transformer
from annotated.transformer import TransformerConfig


def training_flops(cfg: TransformerConfig, src_lengths: list[int], tgt_lengths: list[int]) -> int:
    """Model FLOPs of one training step (forward + backward) on sentences of these lengths."""
    d, N, V = cfg.d_model, cfg.N, cfg.tgt_vocab
    d_k, d_v = transformer._head_sizes(d, cfg.h, cfg.d_k, cfg.d_v)
    H_k, H_v = cfg.h * d_k, cfg.h * d_v
    attn_proj = 2 * d * H_k + 2 * d * H_v  # W_Q, W_K (d x H_k), W_V (d x H_v), W_O (H_v x d)
    ffn = 2 * d * cfg.d_ff  # W_1, W_2
    P_src = N * (attn_proj + ffn) + N * (d * H_k + d * H_v)  # encoder layers + decoder cross W_K, W_V
    P_tgt = N * (attn_proj + (d * H_k + H_v * d) + ffn) + d * V  # self-attn, cross W_Q, W_O, FFN; generator
    pairs = sum(s * s + t * t + t * s for s, t in zip(src_lengths, tgt_lengths))
    return 6 * (sum(src_lengths) * P_src + sum(tgt_lengths) * P_tgt) + 6 * N * (H_k + H_v) * pairs


PEAK_BF16_TFLOPS = [  # (regular expression for torch.cuda.get_device_name(), dense bf16 TFLOP/s); first match wins
    (r"H100 NVL", 835.0),  # data sheet: 1,671 with sparsity
    (r"H100 PCIe", 756.0),  # 1,513 with sparsity
    (r"H100|H800", 989.0),  # SXM5, e.g. "NVIDIA H100 80GB HBM3": 1,979 with sparsity (989.4 dense)
    (r"H200 NVL", 835.0),  # 1,671 with sparsity
    (r"H200", 989.0),  # H200 SXM and GH200: 1,979 with sparsity
    (r"A100|A800", 312.0),  # SXM and PCIe: 624 with sparsity
    (r"L40S", 362.0),  # 733 with sparsity
    (r"\bL4\b", 121.0),  # 242 with sparsity
    (r"\bA10\b", 125.0),  # A10 (not A10G, not A100): 250 with sparsity
]


def peak_tflops(device_name: str) -> float | None:
    """Dense bf16 peak TFLOP/s for a CUDA device name, or None if the table does not know it.

    >>> [peak_tflops(n) for n in ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA A10G", "AMD EPYC")]
    [989.0, 756.0, None, None]
    """
    for pattern, value in PEAK_BF16_TFLOPS:
        if re.search(pattern, device_name):
            return value
    return None
