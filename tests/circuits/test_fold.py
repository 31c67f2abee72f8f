"""LayerNorm folded into its readers (annotated/circuits/fold.py): the same function, norms without gain or bias."""

import pytest
import torch
from torch import nn

from annotated.circuits.fold import FoldedResidual, fold_layer_norms, norm_readers
from annotated.tokens import BOS, EOS, PAD
from annotated.transformer import convert_model, make_model, padding_mask, target_mask

# float64: the folded model multiplies by gamma and adds beta inside other products than the original does, so
# the two differ by rounding only, ~1e-16 relative per operation; logits of size ~10 after ~30 such steps stay
# far below 1e-12, while a gain or a bias left out moves them by 1e-2 or more.
TOL = 1e-12


def _val_batch(data_url, cache, n: int = 24):
    """The first n validation pairs of Multi30k de-en, tokenised for the shipped model: (model, src, tgt)."""
    from annotated.shipped import load_shipped
    from annotated.training.data import load_multi30k

    model, tok, _ = load_shipped("de-en")
    pairs = load_multi30k("val", "de", "en", cache_dir=cache, base_url=data_url)[:n]
    pad = lambda seqs: nn.utils.rnn.pad_sequence([torch.tensor(s) for s in seqs], batch_first=True, padding_value=PAD)
    src = pad([tok.encode(s) + [EOS] for s, _ in pairs])
    tgt = pad([[BOS] + tok.encode(t) for _, t in pairs])
    return model.double().eval(), src, tgt


def _logits(model, src, tgt):
    with torch.no_grad():
        return model(src, tgt, padding_mask(src, PAD), target_mask(tgt, PAD))  # (B, T, vocab)


def _random_model(norm: str, bias: bool = True, form: str = "fused", seed: int = 0):
    """A small model whose norms have random gains and biases (a fresh one's are 1 and 0: nothing to fold)."""
    torch.manual_seed(seed)
    model = make_model(src_vocab=23, tgt_vocab=23, N=2, d_model=16, d_ff=24, h=4, norm=norm, bias=bias, attention=form)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.uniform_(0.3, 2.0), m.bias.normal_()
    return model.double().eval()


def _random_batch():
    g = torch.Generator().manual_seed(1)
    src, tgt = torch.randint(4, 23, (3, 7), generator=g), torch.randint(4, 23, (3, 6), generator=g)
    src[0, 5:], tgt[1, 4:] = PAD, PAD
    return src, tgt


def _check_folded(label, m, s, t):
    folded = fold_layer_norms(m)
    before, after = _logits(m, s, t), _logits(folded, s, t)
    assert before.abs().max() > 1.0, label  # logits of real size: the tolerance means something
    assert (after - before).abs().max() < TOL, f"{label}: {(after - before).abs().max().item()}"
    norms = [mod for mod in folded.modules() if isinstance(mod, nn.LayerNorm)]
    assert norms and all(not n.elementwise_affine for n in norms), label  # no gain and no bias left
    assert sum(isinstance(mod, nn.LayerNorm) for mod in m.modules()) == len(norms), label
    assert (_logits(m, s, t) - before).abs().max() == 0, label  # the original is left as it was


def test_the_folded_model_is_the_same_function(data_url, cache):
    """Float64 logits of the folded shipped de->en model within 1e-12 of the original's on validation sentences,
    in the fused and the per-head form."""
    model, src, tgt = _val_batch(data_url, cache)
    _check_folded("shipped fused", model, src, tgt)
    _check_folded("shipped per_head", convert_model(model, "per_head"), src, tgt)


def test_folded_post_and_pre_norm_models_are_the_same_functions():
    """The same for random post- and pre-norm models, one without attention biases (folding gives it some)."""
    for norm, bias, form in (("post", True, "per_head"), ("pre", True, "fused"), ("post", False, "fused")):
        _check_folded(f"random {norm} {form} bias={bias}", _random_model(norm, bias, form), *_random_batch())


def test_the_folded_norms_see_the_same_inputs(data_url, cache):
    """Every LayerNorm of the folded model receives what the original's received: the same divisor per position."""
    model, src, tgt = _val_batch(data_url, cache, n=8)
    folded = fold_layer_norms(model)
    seen: dict[str, list[torch.Tensor]] = {}

    def record(name):
        return lambda module, args: seen.setdefault(name, []).append(args[0])

    for m in (model, folded):
        hooks = [
            mod.register_forward_pre_hook(record(n)) for n, mod in m.named_modules() if isinstance(mod, nn.LayerNorm)
        ]
        _logits(m, src, tgt)
        for hk in hooks:
            hk.remove()
    assert len(seen) == 5 * model.config.N  # two norms per encoder layer, three per decoder layer
    for name, (a, b) in seen.items():
        assert (a - b).abs().max() < TOL, name


def test_every_reader_reads_one_norm():
    """Each weight that reads the stream after a norm is folded once; the first sublayers read the embeddings."""
    for norm in ("post", "pre"):
        model = _random_model(norm)
        readers = [r for reading in norm_readers(model).values() for r in reading]
        assert len(readers) == len(set(readers)), norm
        named = dict(model.named_modules())
        assert all(name in named for name, _ in readers), norm
        folded = fold_layer_norms(model)
        skips = [m for m in folded.modules() if isinstance(m, FoldedResidual)]
        # post-norm: every residual but the first of each stack (2N + 3N - 2 of them) carries gamma and beta
        assert len(skips) == (5 * model.config.N - 2 if norm == "post" else 0), norm
        assert folded.generator.weight is not folded.tgt_embed.weight  # untied: the embeddings stay as they were
        assert torch.equal(folded.tgt_embed.weight, model.tgt_embed.weight)


def test_a_model_with_an_identity_in_place_of_a_norm_is_refused():
    model = _random_model("post")
    model.encoder.layers[0].res_attn.ln = nn.Identity()
    with pytest.raises(TypeError, match=r"encoder\.layers\.0\.res_attn\.ln is not a LayerNorm but Identity"):
        fold_layer_norms(model)
