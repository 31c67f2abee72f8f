"""int8 on the CPU: the model's larger matrix products with int8 weights and int8 activations, for translating.

`quantize_int8(model)` returns a copy whose larger products x W + b run as PyTorch's dynamic quantized linear
layer (`torch.ao.nn.quantized.dynamic.Linear`): W stored in int8 with one scale per output column, x quantized
to int8 at each call from its own range, the product accumulated in int32 and scaled back to float32. The
weights are packed for oneDNN, which runs these products on the CPU's int8 instructions (AVX-512 VNNI, AMX).

Which products: those whose weight has at least `MIN_WEIGHTS` = 524,288 (2^19) entries, the fewest from which int8
ran faster than float32 at every row count a beam step runs, 4 to 256 rows, when each product was timed alone on the
Xeon benchmarks/README.md names (`python -m benchmarks.int8_products`,
benchmarks/README.md#which-products-int8-pays-for): quantizing x costs a pass over it at every call, which a product
of 2^18 weights earned back from 32 rows on and a product of 2^16 only at 256. For the shipped models (d_model =
128, d_ff = 512) that is the generator alone (128 x 5,000); with d_ff = 4 d_model the feed-forward networks reach it
from d_model = 512 on (512 x 2,048), the fused attention projections from d_model = 1,024. 2^19 float32 weights fill
2 MiB, that Xeon's L2 cache per core; whether the cache sets the threshold was not tested. On another CPU, run the
benchmark and pass what it shows as `quantize_int8(model, min_weights=...)`. Embeddings, layer norms, softmax and
the beam search stay float32. The fast beam loop (`search.py`, section 7) reads an int8 attention's circuits from
`float_attention`.

Why this API: torchao's `quantize_`, which replaces `torch.ao.quantization`'s deprecated eager mode, gets its CPU
speed from `torch.compile`, which a translator started per command would pay for at every start
(benchmarks/README.md#levers-the-first-fast-loop-and-int8), and which on the idle Xeon made the fast loop's float32
step slower, not faster (benchmarks/README.md#one-thread-on-the-idle-xeon-both-directions); the dynamic linear layer
ships in torch itself, and its deprecation warnings are silenced only around the calls that build it.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from annotated.transformer import EncoderDecoder, FeedForward, FusedAttention, _Attention

QUANTIZATIONS = ("int8",)
MIN_WEIGHTS = 1 << 19  # a product with fewer weights stays float32 (above)
ENGINE = "onednn"  # packs the weights for oneDNN's int8 kernels (faster here than fbgemm's, the "x86" default)


@contextlib.contextmanager
def _packing_for(engine: str) -> Iterator[None]:
    """torch's quantized engine set to `engine` while weights are packed, restored after; its deprecation
    warnings (above) kept quiet there."""
    before = torch.backends.quantized.engine
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.backends.quantized.engine = engine
        try:
            yield
        finally:
            torch.backends.quantized.engine = before


class Int8Affine(nn.Module):
    """x W + b with W (n, m) in int8, one scale per output column, x quantized at each call."""

    def __init__(self, W: Tensor, b: Tensor | None):
        super().__init__()
        n, m = W.shape
        linear = nn.Linear(n, m, bias=b is not None)
        with torch.no_grad():
            linear.weight.copy_(W.t())  # nn.Linear stores W transposed: (m, n)
            if b is not None:
                linear.bias.copy_(b)
        linear.qconfig = torch.ao.quantization.per_channel_dynamic_qconfig  # type: ignore[assignment]
        self.linear = torch.ao.nn.quantized.dynamic.Linear.from_float(linear)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x)  # (..., m)

    __rmatmul__ = forward  # `x @ layer`: the chapter's `affine(x, W, None)` with this layer as W (it holds b too)

    def dequantized(self) -> tuple[Tensor, Tensor | None]:
        """(W (n, m), b (m,) or None) in float32: each int8 weight times its column's scale, and the bias."""
        return self.linear.weight().dequantize().t(), self.linear.bias()  # (n, m), (m,)


@torch.no_grad()
def float_attention(attn: _Attention) -> _Attention:
    """`attn` itself when none of its projections is int8; else a FusedAttention (eval mode) with each int8
    projection's `dequantized` weight and bias in place of its W and b: what the fast beam loop reads the
    heads' circuits from (`head_blocks`), the weights int8 multiplies by without the rounding of the
    activations."""
    names = [n for n in "QKVO" if isinstance(getattr(attn, f"W_{n}"), Int8Affine)]
    if not names:
        return attn
    view = FusedAttention(attn.d_model, attn.h, attn.d_k, attn.d_v, attn.bias).eval()
    for n in "QKVO":
        W, b = getattr(attn, f"W_{n}"), getattr(attn, f"b_{n}")
        if n in names:
            W, b = W.dequantized()
        getattr(view, f"W_{n}").copy_(W)  # (d_model, h*d_k), ..., (h*d_v, d_model)
        if b is not None:
            getattr(view, f"b_{n}").copy_(b)
    return view


def quantize_int8(model: EncoderDecoder, min_weights: int = MIN_WEIGHTS) -> EncoderDecoder:
    """A copy of `model` (eval mode) whose products with at least `min_weights` weights run in int8, among the
    fused attention projections, the feed-forward networks and the generator (the per-head form's h products
    per projection, each h times smaller, stay float32)."""
    if min_weights < 1:
        raise ValueError(f"min_weights must be at least 1, got {min_weights}")
    quantized = copy.deepcopy(model).eval()
    with _packing_for(ENGINE):
        for module in list(quantized.modules()):
            products = "QKVO" if isinstance(module, FusedAttention) else "12" if isinstance(module, FeedForward) else ""
            for name in products:  # W and b as one Int8Affine in W's place, b None: the chapter's affine(x, W, b)
                W, b = getattr(module, f"W_{name}"), getattr(module, f"b_{name}")  # is then x @ W, the layer's call
                if W.numel() >= min_weights:
                    delattr(module, f"W_{name}")
                    setattr(module, f"b_{name}", None)
                    setattr(module, f"W_{name}", Int8Affine(W, b))
        W_gen, b_gen = quantized.generator.weight, quantized.generator.bias  # (vocab, d_model), (vocab,)
        if W_gen.numel() >= min_weights:  # logits = y W_gen^T + b: an Int8Affine of W = W_gen^T (d_model, vocab)
            setattr(quantized, "generator", Int8Affine(W_gen.t(), b_gen))  # noqa: B010 the attribute is typed Generator
    return quantized
