"""int8 on the CPU: the model's matrix products with int8 weights and int8 activations, for translating.

`quantize_int8(model)` returns a copy whose encoder and decoder products x W + b (the attention projections
and the feed-forward network) run as PyTorch's dynamic quantized linear layer
(`torch.ao.nn.quantized.dynamic.Linear`): W stored in int8 with one scale per output column, x quantized
to int8 at each call from its own range, the product accumulated in int32 and scaled back to float32.
Embeddings, layer norms, softmax, the generator and the beam search stay in float32. The generator (the
product onto the 5,000 subwords whose log-probabilities the beam search ranks) stays in float32 because in
int8 it cost BLEU and no time: with it in int8 too, the shipped en -> de model lost 0.32 BLEU on
test_2016_flickr (37.19 -> 36.87), and the whole search ran no faster (benchmarks/README.md). The weights are packed for oneDNN,
which runs these products on the CPU's int8 instructions (AVX-512 VNNI, AMX); benchmarks/README.md has the
speed and the BLEU beside float32's.

Why this API: PyTorch 2.13 marks `torch.ao.quantization`'s eager mode as deprecated in favour of torchao's
`quantize_`, but torchao's int8 dynamic-activation layer ran the generator's product 3.7 times slower than
float32 on the 2-core Xeon (model 207) in eager mode, where oneDNN's dynamic linear ran it faster than
float32; torchao's CPU speed comes from `torch.compile`, which a translator started per command would pay
for at every start. So this uses the dynamic linear layer that ships in torch itself (no dependency), and
silences its deprecation warnings only around the calls that build it.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from annotated.transformer import EncoderDecoder, FeedForward, FusedAttention

QUANTIZATIONS = ("int8",)
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

    def __rmatmul__(self, x: Tensor) -> Tensor:
        """`x @ layer`: the chapter's `affine(x, W, None)` with this layer as W (it holds b too)."""
        return self.linear(x)  # (..., m)


def _swap(module: nn.Module, weight: str, bias: str) -> None:
    """Replace the parameters `weight` (n, m) and `bias` of `module` by one Int8Affine under the weight's name,
    and the bias by None: the chapter's `affine(x, W, None)` is then `x @ W`, which the layer computes."""
    W, b = getattr(module, weight), getattr(module, bias)
    delattr(module, weight)
    setattr(module, bias, None)
    setattr(module, weight, Int8Affine(W.detach(), None if b is None else b.detach()))


def quantize_int8(model: EncoderDecoder) -> EncoderDecoder:
    """A copy of `model` (fused attention, eval mode) whose encoder and decoder products run in int8."""
    if model.config.attention != "fused":
        raise ValueError(
            f"int8 quantization needs the fused attention form, got {model.config.attention!r}: "
            f"convert the model with annotated.transformer.convert_model(model, 'fused') first"
        )
    quantized = copy.deepcopy(model).eval()
    with _packing_for(ENGINE):
        for module in quantized.modules():
            if isinstance(module, FusedAttention):
                for name in "QKVO":
                    _swap(module, f"W_{name}", f"b_{name}")
            elif isinstance(module, FeedForward):
                _swap(module, "W_1", "b_1")
                _swap(module, "W_2", "b_2")
    return quantized
