"""annotated/interop/marian.py and layout.py: our model and transformers' MarianMTModel are one function, both ways.

Every model here is built with random weights from a config inside the test: nothing is downloaded. The random
weights are scaled up from transformers' initialisation (std 0.02), so that the logits spread over several units
and a conversion that is off anywhere moves them visibly.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")
from tiny import jiggle, tiny_model
from transformers import MarianConfig, MarianMTModel

from annotated.checks import check_marian_config
from annotated.decoding.search import beam_search
from annotated.interop import layout
from annotated.interop.layout import permute_residual, sinusoid_permutation
from annotated.interop.marian import from_marian, marian_vocab, to_marian
from annotated.tokens import BOS, EOS, PAD
from annotated.transformer import (
    make_model,
    padding_mask,
    sinusoidal_encoding,
    subsequent_mask,
)
from benchmarks.agreement import export_ids

# Marian shapes: OPUS-MT's id layout (pad last, the decoder starts with it), separate vocabularies, no scaling
MARIAN_SHAPES = {
    "opus-like swish": dict(
        vocab_size=40,
        d_model=16,
        encoder_layers=2,
        decoder_layers=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        activation_function="swish",
        pad_token_id=39,
        decoder_start_token_id=39,
        eos_token_id=0,
        scale_embedding=True,
    ),
    "separate gelu": dict(
        vocab_size=30,
        decoder_vocab_size=45,
        share_encoder_decoder_embeddings=False,
        d_model=24,
        encoder_layers=1,
        decoder_layers=1,
        encoder_ffn_dim=40,
        decoder_ffn_dim=40,
        encoder_attention_heads=3,
        decoder_attention_heads=3,
        activation_function="gelu",
        pad_token_id=29,
        decoder_start_token_id=29,
        eos_token_id=0,
        scale_embedding=True,
    ),
    "unscaled untied relu": dict(
        vocab_size=50,
        d_model=32,
        encoder_layers=3,
        decoder_layers=3,
        encoder_ffn_dim=48,
        decoder_ffn_dim=48,
        encoder_attention_heads=8,
        decoder_attention_heads=8,
        activation_function="relu",
        pad_token_id=3,
        decoder_start_token_id=3,
        eos_token_id=5,
        scale_embedding=False,
        tie_word_embeddings=False,
    ),
}
# our shapes: shared and tied, separate and untied, per-head without attention biases
OUR_SHAPES = {
    "shared relu": dict(
        src_vocab=30, tgt_vocab=30, N=2, d_model=16, d_ff=32, h=4, share_embeddings=True, tie_generator=True
    ),
    "separate gelu": dict(src_vocab=25, tgt_vocab=35, N=1, d_model=24, d_ff=40, h=3, activation="gelu"),
    "per-head silu": dict(
        src_vocab=30,
        tgt_vocab=30,
        N=3,
        d_model=32,
        d_ff=48,
        h=8,
        activation="silu",
        attention="per_head",
        bias=False,
        tie_generator=True,
    ),
}


def random_marian(shape: str, seed: int = 0, eos_boost: float = 0.0) -> MarianMTModel:
    """A MarianMTModel in float64 with random weights (the sinusoid tables untouched)."""
    torch.manual_seed(seed)
    hf = MarianMTModel(MarianConfig(max_position_embeddings=64, dropout=0.0, **MARIAN_SHAPES[shape]))
    hf = jiggle(hf.double().eval(), 0.3)
    with torch.no_grad():
        hf.final_logits_bias.normal_()
        hf.final_logits_bias[0, hf.config.eos_token_id] += eos_boost  # translations that end before max_len
    return hf


def random_ours(shape: str, seed: int = 0, dtype=torch.float64):
    """tiny.py's model of this shape, its weights moved by noise of 0.3 drawn in `dtype`."""
    return jiggle(tiny_model(seed=seed, **OUR_SHAPES[shape]).to(dtype), 0.3)


def marian_batch(config, seed: int = 1):
    """Source ids with padding and target prefixes starting with the decoder start, in Marian's ids."""
    g = torch.Generator().manual_seed(seed)
    ordinary = [
        i
        for i in range(min(config.vocab_size, config.decoder_vocab_size))
        if i not in (config.pad_token_id, config.eos_token_id)
    ]
    pick = lambda *shape: torch.tensor(ordinary)[torch.randint(len(ordinary), shape, generator=g)]
    src, tgt = pick(3, 9), pick(3, 6)
    src[1, 6:] = config.pad_token_id  # a shorter sentence
    src[:, -1] = config.eos_token_id
    src[1, 5] = config.eos_token_id
    tgt[:, 0] = config.decoder_start_token_id
    return src, tgt


def to_our_ids(ids, token_map, start_is_bos: bool):
    """Marian ids -> ours (the inverse of the token map; the decoder start becomes bos)."""
    inverse = {m: o for o, m in reversed(list(enumerate(token_map)))}  # the first our id of each Marian id
    out = ids.clone().apply_(lambda i: inverse[i])
    if start_is_bos:
        out[:, 0] = BOS
    return out


def marian_logits(hf, src, tgt):
    with torch.no_grad():
        return hf(input_ids=src, attention_mask=(src != hf.config.pad_token_id).long(), decoder_input_ids=tgt).logits


def our_logits(model, src, tgt):
    with torch.no_grad():
        return model(src, tgt, padding_mask(src, PAD), subsequent_mask(tgt.size(1)))  # (B, T, V)


def test_sinusoid_tables_differ_by_the_permutation():
    from transformers.models.marian.modeling_marian import (
        MarianSinusoidalPositionalEmbedding,
    )

    for d_model in (16, 24, 512):
        marian = MarianSinusoidalPositionalEmbedding(512, d_model).create_weight()  # (512, d_model)
        assert torch.equal(marian[:, sinusoid_permutation(d_model)], sinusoidal_encoding(512, d_model))


@pytest.mark.parametrize("shape", MARIAN_SHAPES)
def test_import_gives_marian_logits(shape):
    hf = random_marian(shape)
    model, src_map, tgt_map = from_marian(hf)
    src, tgt = marian_batch(hf.config)
    theirs = marian_logits(hf, src, tgt)  # (B, T, V_marian)
    ours = our_logits(model, to_our_ids(src, src_map, False), to_our_ids(tgt, tgt_map, True))  # (B, T, V_marian + 1)
    assert theirs.abs().max() > 1.0  # logits that spread: a wrong conversion shows
    assert (ours[..., 1:] - theirs[..., tgt_map[1:]]).abs().max() <= 1e-9
    assert torch.isneginf(ours[..., PAD]).all()  # pad and bos are Marian's one pad: only bos may be predicted
    assert torch.allclose(ours.log_softmax(-1)[..., 1:], theirs.log_softmax(-1)[..., tgt_map[1:]], atol=1e-9, rtol=0)


def test_per_head_import_is_the_fused_import_split():
    hf = random_marian("opus-like swish")
    fused, src_map, tgt_map = from_marian(hf)
    per_head = from_marian(hf, attention="per_head")[0]
    assert type(per_head.encoder.layers[0].self_attn).__name__ == "PerHeadAttention"
    src, tgt = marian_batch(hf.config)
    src, tgt = to_our_ids(src, src_map, False), to_our_ids(tgt, tgt_map, True)
    assert (our_logits(fused, src, tgt) - our_logits(per_head, src, tgt)).nan_to_num(0).abs().max() <= 1e-12


def our_batch(cfg, seed: int = 2):
    """Our source ids with padding, and target prefixes starting with bos."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(3, cfg.src_vocab, (3, 9), generator=g)  # (3, 9)
    tgt = torch.randint(3, cfg.tgt_vocab, (3, 6), generator=g)  # (3, 6)
    src[1, 6:], tgt[:, 0] = PAD, BOS
    return src, tgt


# float64: the measured differences are at most 1.2e-14 (two orders of the same floating-point operations), so 1e-12
# leaves two orders of margin and still catches any slip (a wrong row moves logits by units); float32: about 1e-5
@pytest.mark.parametrize("for_ctranslate2", [False, True], ids=["transformers layout", "ctranslate2 layout"])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-12), (torch.float32, 1e-4)])
@pytest.mark.parametrize("shape", OUR_SHAPES)
def test_export_gives_our_logits(shape, dtype, tolerance, for_ctranslate2):
    """Our ids, then one row, Marian's pad, zero and never predicted. The decoder starts with our bos; in
    CTranslate2's layout, from the pad row (section 1 of marian.py)."""
    model = random_ours(shape, dtype=dtype)
    hf = to_marian(model, for_ctranslate2=for_ctranslate2)
    cfg, pad = model.config, marian_vocab(model.config) - 1
    start = pad if for_ctranslate2 else BOS
    assert hf.config.pad_token_id == pad and hf.config.decoder_start_token_id == start
    assert next(hf.parameters()).dtype == dtype
    assert not hf.model.decoder.embed_tokens.weight[pad].any()  # OPUS-MT's zero pad row, what CTranslate2 assumes
    src, tgt = our_batch(cfg)
    ours = our_logits(model, src, tgt)  # (B, T, V_tgt)
    theirs = marian_logits(hf, export_ids(src, pad), export_ids(tgt, pad, decoder_start=start))  # (B, T, pad + 1)
    assert ours.abs().max() > 1.0
    assert (ours - theirs[..., : cfg.tgt_vocab]).abs().max() <= tolerance
    assert torch.isneginf(theirs[..., cfg.tgt_vocab :]).all()  # the added rows: never predicted


@pytest.mark.parametrize("shape", OUR_SHAPES)
def test_the_export_survives_save_pretrained(shape, tmp_path):
    """from_pretrained -> save_pretrained -> from_pretrained, as a user who fine-tunes the export does: the same
    tensors and our logits, in float64, for shared and tied, separate and untied, per-head tables. (The export in
    CTranslate2's layout does not survive it: its start vector lives in a positional row save_pretrained drops.)"""
    model = random_ours(shape)  # float64
    to_marian(model).save_pretrained(str(tmp_path / "export"))
    loaded = MarianMTModel.from_pretrained(str(tmp_path / "export"), dtype=torch.float64).eval()
    loaded.save_pretrained(str(tmp_path / "again"))
    again = MarianMTModel.from_pretrained(str(tmp_path / "again"), dtype=torch.float64).eval()
    first, second = loaded.state_dict(), again.state_dict()
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    cfg, pad = model.config, marian_vocab(model.config) - 1
    src, tgt = our_batch(cfg)
    ours = our_logits(model, src, tgt)  # (B, T, V_tgt)
    theirs = marian_logits(
        again, export_ids(src, pad), export_ids(tgt, pad, again.generation_config.decoder_start_token_id)
    )
    # float64, the same function in two orders of operations (measured at most about 1e-14), as in
    # test_export_gives_our_logits; the start vector lost, the logits move by units
    assert (ours - theirs[..., : cfg.tgt_vocab]).abs().max() <= 1e-12
    assert torch.isneginf(theirs[..., cfg.tgt_vocab :]).all()  # the pad row is still never predicted


@pytest.mark.parametrize("shape", OUR_SHAPES)
def test_round_trip_is_exact(shape):
    model = random_ours(shape)
    back, src_map, tgt_map = from_marian(to_marian(model), attention=model.config.attention)
    assert src_map == list(range(model.config.src_vocab)) and tgt_map == list(range(model.config.tgt_vocab))
    assert back.config == model.config or not model.config.bias  # a model without biases comes back with zero ones
    mine = model.state_dict()
    for name, t in back.state_dict().items():
        assert torch.equal(t, mine[name]) if name in mine else not t.any(), name


def test_permuting_the_residual_stream_is_a_symmetry():
    model = random_ours("separate gelu")
    cfg, perm = model.config, torch.randperm(24, generator=torch.Generator().manual_seed(3))
    state = permute_residual(model.state_dict(), perm)
    renumbered = make_model(cfg).double().eval()
    renumbered.load_state_dict(state)
    renumbered.pos.pe = model.pos.pe[:, perm]  # the positional table is renumbered too
    src, tgt = torch.randint(3, 25, (2, 7)), torch.randint(3, 35, (2, 5))
    tgt[:, 0] = BOS
    assert not torch.equal(perm, torch.arange(24))
    assert (our_logits(model, src, tgt) - our_logits(renumbered, src, tgt)).abs().max() <= 1e-12


@pytest.mark.parametrize("wrong", ["identity", "two swapped"])
def test_a_wrong_permutation_is_caught(wrong, monkeypatch):
    hf = random_marian("opus-like swish")
    right = sinusoid_permutation(16)
    bad = torch.arange(16) if wrong == "identity" else right[torch.tensor([1, 0] + list(range(2, 16)))]
    monkeypatch.setattr("annotated.interop.marian.sinusoid_permutation", lambda d: bad)
    model, src_map, tgt_map = from_marian(hf)
    src, tgt = marian_batch(hf.config)
    ours = our_logits(model, to_our_ids(src, src_map, False), to_our_ids(tgt, tgt_map, True))
    assert (ours[..., 1:] - marian_logits(hf, src, tgt)[..., tgt_map[1:]]).abs().max() > 1e-2


def test_residual_axis_covers_every_d_model_axis():
    """Every parameter with a d_model-sized axis is renumbered, except those whose d_model axis is not the
    residual stream's (none in these sizes, where h*d_k, d_ff and the vocabularies all differ from d_model)."""
    model = make_model(src_vocab=11, tgt_vocab=13, N=1, d_model=10, d_ff=14, h=2, d_k=3, d_v=4)
    for name, t in model.state_dict().items():
        axes = [a for a, size in enumerate(t.shape) if size == 10]
        assert axes == ([] if layout.residual_axis(name) is None else [layout.residual_axis(name)]), name


def _ids_until_eos(rows, eos: int) -> list[list[int]]:
    out = []
    for row in rows.tolist():
        out.append(row[: row.index(eos) + 1] if eos in row else row)
    return out


@pytest.mark.parametrize(
    "shape, eos_boost", [("opus-like swish", 2.0), ("separate gelu", 0.0), ("unscaled untied relu", 6.0)]
)
def test_beam_search_equals_generate(shape, eos_boost):
    """Beam 4, no length penalty (alpha = 0: the two formulas agree only there), stop at 4 finished.

    Random models either stop at once or run to max_len; `eos_boost` (added to eos's output bias) is chosen
    per shape so that both happen in the batch, which takes both ways out of the search."""
    hf = random_marian(shape, eos_boost=eos_boost)
    model, src_map, tgt_map = from_marian(hf)
    src, _ = marian_batch(hf.config)
    max_len = 12
    with torch.no_grad():
        theirs = hf.generate(
            input_ids=src,
            attention_mask=(src != hf.config.pad_token_id).long(),
            num_beams=4,
            length_penalty=0.0,
            early_stopping=True,
            max_new_tokens=max_len,
            do_sample=False,
            forced_eos_token_id=None,
            bad_words_ids=None,
        )[:, 1:]  # without the decoder start
    our_src = to_our_ids(src, src_map, False)
    ours = beam_search(model, our_src, padding_mask(our_src, PAD), max_len, beam_size=4, length_penalty=0.0)
    ours_as_marian = [[tgt_map[i] for i in row] for row in _ids_until_eos(ours, EOS)]
    assert ours_as_marian == _ids_until_eos(theirs, hf.config.eos_token_id)
    assert {len(row) < max_len for row in ours_as_marian} == {True, False}  # some end on their own, some do not


def test_refusals_name_the_fix():
    with pytest.raises(ValueError, match="post-norm only"):
        to_marian(make_model(src_vocab=9, tgt_vocab=9, N=1, d_model=8, d_ff=8, h=2, norm="pre"))
    with pytest.raises(ValueError, match="one size for both stacks"):
        from_marian(
            MarianMTModel(
                MarianConfig(
                    vocab_size=9,
                    d_model=8,
                    encoder_layers=1,
                    decoder_layers=2,
                    encoder_ffn_dim=8,
                    decoder_ffn_dim=8,
                    encoder_attention_heads=2,
                    decoder_attention_heads=2,
                    pad_token_id=8,
                    decoder_start_token_id=8,
                )
            )
        )
    with pytest.raises(ValueError, match="activation_function 'gelu_new'"):
        from_marian(
            MarianMTModel(
                MarianConfig(
                    vocab_size=9,
                    d_model=8,
                    encoder_layers=1,
                    decoder_layers=1,
                    encoder_ffn_dim=8,
                    decoder_ffn_dim=8,
                    encoder_attention_heads=2,
                    decoder_attention_heads=2,
                    pad_token_id=8,
                    decoder_start_token_id=8,
                    activation_function="gelu_new",
                )
            )
        )


@pytest.mark.parametrize(
    "fields, refusal",
    [
        ({"d_model": 10, "encoder_attention_heads": 4, "decoder_attention_heads": 4}, "divisible by the 4 heads"),
        ({"d_model": 9, "encoder_attention_heads": 3, "decoder_attention_heads": 3}, "d_model=9 must be even"),
        ({"pad_token_id": 9}, "pad_token_id=9 is not a token id of the vocabulary \\[0, 9\\)"),
        (
            {"decoder_vocab_size": 8, "pad_token_id": 7},
            "decoder_start_token_id=8 is not a token id of the vocabulary \\[0, 8\\)",
        ),
        ({"eos_token_id": -1}, "eos_token_id=-1 is not a token id"),
        ({"eos_token_id": 8}, "eos_token_id=8 is also the pad or decoder start id"),
    ],
    ids=["heads", "odd", "pad", "start", "eos-negative", "eos-is-pad"],
)
def test_a_config_our_model_cannot_hold_is_refused_by_name(fields, refusal):
    """Each refusal of `check_marian_config` past the stack sizes and the activation: the field is named."""
    base = {
        "vocab_size": 9,
        "d_model": 8,
        "encoder_attention_heads": 2,
        "decoder_attention_heads": 2,
        "activation_function": "relu",
    }
    config = MarianConfig(**{**base, "pad_token_id": 8, "decoder_start_token_id": 8, "eos_token_id": 0, **fields})
    check_marian_config(MarianConfig(**base, pad_token_id=8, decoder_start_token_id=8, eos_token_id=0), ("relu",))
    with pytest.raises(ValueError, match=refusal):
        check_marian_config(config, ("relu",))


def small_marian(activation: str, scale: bool, tie: bool, seed: int = 4) -> MarianMTModel:
    """OPUS-MT's id layout, with the given activation spelling, embedding scaling and tying, in float64."""
    torch.manual_seed(seed)
    config = MarianConfig(
        vocab_size=30,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_ffn_dim=24,
        decoder_ffn_dim=24,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        activation_function=activation,
        pad_token_id=29,
        decoder_start_token_id=29,
        eos_token_id=0,
        scale_embedding=scale,
        tie_word_embeddings=tie,
        max_position_embeddings=32,
        dropout=0.0,
    )
    hf = MarianMTModel(config).double().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "embed_positions" not in name:
                p.add_(torch.randn_like(p) * 0.3)
        hf.final_logits_bias.normal_()
    return hf


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("scale", [True, False], ids=["scaled", "unscaled"])
@pytest.mark.parametrize("activation", ["relu", "gelu", "silu", "swish"])
def test_every_activation_spelling_and_table_option_imports_as_the_same_function(activation, scale, tie):
    """Each spelling MarianConfig takes for the three functions we have, with and without embedding scaling and
    tied output tables: float64 logits equal Marian's. An unscaled tied model is the case where our tables (divided
    by sqrt(d_model)) and the generator (Marian's table as the model uses it) stop being one table."""
    hf = small_marian(activation, scale, tie)
    assert (hf.lm_head.weight is hf.model.decoder.embed_tokens.weight) == tie
    model, src_map, tgt_map = from_marian(hf)
    expected = {"relu": "relu", "gelu": "gelu", "silu": "silu", "swish": "silu"}[activation]
    assert model.config.activation == expected and model.config.tie_generator == (tie and scale)
    src, tgt = marian_batch(hf.config)
    theirs = marian_logits(hf, src, tgt)  # (B, T, V_marian)
    ours = our_logits(model, to_our_ids(src, src_map, False), to_our_ids(tgt, tgt_map, True))  # (B, T, V_marian + 1)
    # measured at most 2.4e-15: the same operations in another order; a wrong activation or table moves them by units
    assert (ours[..., 1:] - theirs[..., tgt_map[1:]]).abs().max() <= 1e-12


@pytest.mark.parametrize("activation", ["gelu_new", "gelu_fast", "quick_gelu", "tanh", "sigmoid", "mish"])
def test_an_activation_we_do_not_have_is_refused(activation):
    with pytest.raises(ValueError, match=f"activation_function {activation!r} is not one of"):
        from_marian(small_marian(activation, True, True))


def test_exported_config_says_what_the_model_does():
    """dropout is the residual dropout, attention_dropout the one on attention weights, activation_dropout the one
    after the feed-forward activation (ours: dropout); all three differ from transformers' defaults here."""
    model = make_model(src_vocab=20, tgt_vocab=20, N=1, d_model=8, d_ff=16, h=2, dropout=0.15, attention_dropout=0.05)
    config = to_marian(model).config
    assert (config.dropout, config.attention_dropout, config.activation_dropout) == (0.15, 0.05, 0.15)
    back = from_marian(to_marian(model))[0].config
    assert (back.dropout, back.attention_p) == (0.15, 0.05)
