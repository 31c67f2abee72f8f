# %% [markdown]
# # Recording the attention probabilities
#
# The chapter's attentions return their output only: the fast path (SDPA)
# never forms the probabilities. To look at them, `record_attention` hooks
# every attention of a model for the length of a `with` block and recomputes,
# after each call, `softmax(Q K^T / sqrt(d_k))` with `attention_explicit`
# from the module's own projections (`queries`, `keys_values`, or the
# decoder cache's keys and values) and the call's mask:
#
#     with record_attention(model) as probs:
#         memory = model.encode(src, src_mask)
#         model.decode(memory, src_mask, tgt, tgt_mask)
#     probs["cross", 0][0]   # the first call's cross-attention of layer 0, (B, h, T_q, T_k)
#
# `probs` maps each site `(kind, layer)` of `annotated/sites.py` to the list
# of its calls' probabilities, in call order (one per `decode` step with the
# decoder cache). A pruned attention gives its own, smaller `h`. Recording
# changes no output, bit for bit: the hooks only read (`tests/test_recording.py`
# checks this and the rest of what this page says).
#
# **Training mode.** With dropout on, a module thins its probabilities at
# random before multiplying the values. The recorder gives the probabilities
# *before* dropout (each row sums to 1; their expectation is what the module
# used) and draws no random numbers, so the model's own dropout masks, and
# hence its outputs, stay what they would be without it.
#
# `attend_with_probabilities` does the same for one call of one module, for
# the proofs and tests.

# %%
from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import torch
from torch import Tensor

from annotated.sites import Site, attention_at, sites
from annotated.transformer import EncoderDecoder, attention_explicit, head_mask


def _probabilities(
    att, x_q: Tensor, x_kv: Tensor | None = None, mask: Tensor | None = None, *, kv: tuple[Tensor, Tensor] | None = None
) -> Tensor:
    """The probabilities (B, h, T_q, T_k) that `att(x_q, x_kv, mask, kv=kv)` attends with (before dropout)."""
    if (x_kv is None) == (kv is None):
        raise ValueError("give exactly one of x_kv and precomputed kv")
    K, V = att.keys_values(x_kv) if kv is None else kv  # (B, h, T_k, d_k), (B, h, T_k, d_v)
    B, T_q, _ = x_q.shape
    mask = head_mask(mask, B, T_q, K.size(-2))  # (B, 1, T_q, T_k) the same mask for every head
    return attention_explicit(att.queries(x_q), K, V, mask)[1]  # (B, h, T_q, T_k)


def attend_with_probabilities(
    att, x_q: Tensor, x_kv: Tensor | None = None, mask: Tensor | None = None, *, kv: tuple[Tensor, Tensor] | None = None
) -> tuple[Tensor, Tensor]:
    """(the module's own output (B, T_q, d_model), its probabilities (B, h, T_q, T_k)) for one call.

    >>> from annotated.transformer import FusedAttention
    >>> att = FusedAttention(8, 2).eval()
    >>> out, p = attend_with_probabilities(att, torch.randn(1, 3, 8), torch.randn(1, 5, 8))
    >>> tuple(out.shape), tuple(p.shape), bool(torch.allclose(p.sum(-1), torch.ones(1, 2, 3)))
    ((1, 3, 8), (1, 2, 3, 5), True)
    """
    p = _probabilities(att, x_q, x_kv, mask, kv=kv)  # (B, h, T_q, T_k)
    return att(x_q, x_kv, mask, kv=kv), p


def _recorder(store: list[Tensor]):
    def hook(att, args, kwargs, output) -> None:
        call = inspect.signature(att.forward).bind(*args, **kwargs).arguments
        with torch.no_grad():
            store.append(_probabilities(att, call["x_q"], call.get("x_kv"), call.get("mask"), kv=call.get("kv")))

    return hook


@contextlib.contextmanager
def record_attention(model: EncoderDecoder) -> Iterator[dict[Site, list[Tensor]]]:
    """Inside the block, every attention call of `model` appends its probabilities to `probs[(kind, layer)]`.

    >>> from annotated.transformer import make_model, padding_mask
    >>> m = make_model(src_vocab=9, tgt_vocab=9, N=2, d_model=8, d_ff=16, h=2).eval()
    >>> src = torch.tensor([[4, 5, 6]])
    >>> with record_attention(m) as probs:
    ...     _ = m.encode(src, padding_mask(src, 0))
    >>> [(site, [tuple(p.shape) for p in calls]) for site, calls in probs.items() if calls]
    [(('enc_self', 0), [(1, 2, 3, 3)]), (('enc_self', 1), [(1, 2, 3, 3)])]
    """
    if not isinstance(model, EncoderDecoder):
        raise TypeError(f"record_attention expects an EncoderDecoder (make_model), got {type(model).__name__}")
    probs: dict[Site, list[Tensor]] = {site: [] for site in sites(model)}
    handles = []
    try:
        for site in probs:
            hook = _recorder(probs[site])
            handles.append(attention_at(model, *site).register_forward_hook(hook, with_kwargs=True))
        yield probs
    finally:
        for handle in handles:
            handle.remove()
