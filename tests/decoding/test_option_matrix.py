"""Every option of the translator and of `translate_ids` with every other: beam 1 and 4, the readable and the fast
loop (`fast`), float32 and `--quantize int8`, per-head and fused attention, d_model 128, 256 and 512 (tiny
random models of each shape, and one imported from a Marian model with separate source and target vocabularies).

Every cell translates; the two loops give the same translations in float32 (the claim of search.py, section 7:
their scores differ by rounding, far less than what separates the candidates they rank, in these cases on this
CPU's kernels and under `make test-arith`'s); int8 stays near float32, and each loop's int8 scores are those of
the int8 model.

The models: random weights, each matrix entry moved by noise of standard deviation 1 / sqrt(d_model) (the size of
Xavier's initialisation, so attention scores and logits spread over a few units, as a trained model's do), each
vector (biases, layer norms' gains and shifts) by noise of 0.5, so that a bias lost by a loop shows. The int8 cells
quantize every product of at least INT8_FROM = 65,536 weights (below quantize.py's MIN_WEIGHTS, which at these sizes
would leave most products float32), so that each kind of product runs in int8 at every size: with 512 target
subwords and d_ff = 4 d_model every feed-forward product and the generator, and the attention projections from
d_model 256 on, in the fused form.

Tolerances (measured with this file's models on the 2-core Xeon, model 207):

- INT8_LOGITS: int8 rounds each weight to 1/254 of its column's range and each activation to 1/254 of its call's
  range; over the layers that moves the logits of the cells' int8 translations by 2.0% to 3.8% of their size
  (relative root-mean-square, teacher-forced); 10% leaves room for other CPUs' int8 kernels, where a transposed
  weight moves them by 40% (`test_large_attention_projections_are_int8_too`).
- INT8_SCORE: a loop's score of its int8 translation, times the length penalty, against the int8 model's
  teacher-forced log P of it. The fast loop attends through float32 circuits read from the int8 weights
  (`float_attention`), and both loops quantize each step's activations over their own ranges, so the two differ
  by up to 0.052 nats per token; 0.1 per token, where a fast loop that drops the int8 value projections' biases
  is off by 0.26 or more.
"""

import functools
import io
import math

import pytest
import torch
from tiny import DE_EN, jiggle, tiny_model, tiny_translator

from annotated.checkpoint import save_checkpoint
from annotated.decoding.quantize import Int8Affine, quantize_int8
from annotated.decoding.search import beam_search, gnmt_lp, sequence_logprob, translate_ids
from annotated.decoding.translate import main as translator
from annotated.tokens import BOS, EOS, PAD
from annotated.transformer import FusedAttention, convert_model, padding_mask, subsequent_mask

SHAPES = ("d_model 128", "d_model 256", "d_model 512", "Marian d_model 512")
FORMS = ("fused", "per_head")
QUANTIZATIONS = ("float32", "int8")
BEAMS = (1, 4)
LOOPS = ("fast", "readable")
ALPHA = 0.6
MAX_EXTRA = 8
LENGTHS = (3, 5, 8, 11)  # four sources, so sentences leave the beam search at different steps
INT8_LOGITS = 0.10  # relative root-mean-square of the logits (above)
INT8_SCORE = 0.1  # nats per token (above)
INT8_FROM = 1 << 16  # the int8 cells' min_weights (above)


def _noisy(model, d_model: int):
    """Each matrix entry moved by N(0, 1 / d_model), each vector entry by N(0, 0.25) (the module's docstring);
    Marian's positional tables stay its sinusoids."""
    return jiggle(model, 1 / math.sqrt(d_model), 0.5).eval()


def ours(d_model: int, seed: int):
    shape = dict(N=2 if d_model == 128 else 1, d_model=d_model, d_ff=4 * d_model, h=max(4, d_model // 64))
    return tiny_model(400, 512, seed=seed, noise=1 / math.sqrt(d_model), vector_noise=0.5, **shape)


def imported_marian(seed: int):
    """OPUS-MT's layout (pad last, the decoder starting with it, SiLU), separate vocabularies of 400 and 512,
    d_model 512, imported by `from_marian`: its generator's bias is -inf at pad (which is also our bos)."""
    from transformers import MarianConfig, MarianMTModel

    from annotated.interop.marian import from_marian

    torch.manual_seed(seed)
    config = MarianConfig(
        vocab_size=400,
        decoder_vocab_size=512,
        share_encoder_decoder_embeddings=False,
        d_model=512,
        encoder_layers=1,
        decoder_layers=1,
        encoder_ffn_dim=1024,
        decoder_ffn_dim=1024,
        encoder_attention_heads=8,
        decoder_attention_heads=8,
        activation_function="swish",
        pad_token_id=399,
        decoder_start_token_id=399,
        eos_token_id=0,
        scale_embedding=True,
        max_position_embeddings=64,
        dropout=0.0,
    )
    hf = _noisy(MarianMTModel(config), 512)
    with torch.no_grad():
        hf.final_logits_bias.normal_()
    model, _, _ = from_marian(hf)
    assert model.config.src_vocab != model.config.tgt_vocab and not model.config.share_embeddings
    return model.float().eval()


@functools.cache
def float32_model(shape: str, form: str):
    if form == "per_head":
        return convert_model(float32_model(shape, "fused"), "per_head").eval()
    if shape.startswith("Marian"):
        return imported_marian(seed=4)
    return ours(int(shape.split()[-1]), seed=SHAPES.index(shape))


@functools.cache
def model(shape: str, form: str, quantization: str):
    m = float32_model(shape, form)
    return quantize_int8(m, min_weights=INT8_FROM) if quantization == "int8" else m


def sources(shape: str) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    V = float32_model(shape, "fused").config.src_vocab
    return [torch.randint(4, V - 1, (n,), generator=g).tolist() for n in LENGTHS]  # no special ids (Marian's pad last)


@functools.cache
def cell(shape: str, form: str, quantization: str, beam: int, loop: str) -> tuple[tuple[int, ...], ...]:
    m = model(shape, form, quantization)
    out = translate_ids(m, sources(shape), beam, ALPHA, max_extra=MAX_EXTRA, fast=loop == "fast")
    return tuple(tuple(ids) for ids in out)


CELLS = [
    pytest.param(s, f, q, b, lp, id=f"{s}-{f}-{q}-beam{b}-{lp}")
    for s in SHAPES
    for f in FORMS
    for q in QUANTIZATIONS
    for b in BEAMS
    for lp in LOOPS
]


@pytest.mark.parametrize("shape, form, quantization, beam, loop", CELLS)
def test_every_cell_translates(shape, form, quantization, beam, loop):
    out = cell(shape, form, quantization, beam, loop)
    V = float32_model(shape, form).config.tgt_vocab
    assert len(out) == len(LENGTHS)
    for ids in out:  # a batch runs to its longest source + MAX_EXTRA
        assert len(ids) <= max(LENGTHS) + MAX_EXTRA and all(0 <= t < V and t not in (PAD, EOS) for t in ids), ids
    assert any(out)  # something was translated


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("form", FORMS)
def test_int8_quantizes_every_product_that_reaches_its_min_weights(shape, form):
    """The feed-forward networks and the generator at every size; the fused attention projections from d_model 256
    (256 x 256 = 65,536 weights) on; the per-head form's h smaller products never."""
    quantized = model(shape, form, "int8")
    assert isinstance(quantized.generator, Int8Affine)
    for layer in [*quantized.encoder.layers, *quantized.decoder.layers]:
        assert isinstance(layer.ffn.W_1, Int8Affine) and isinstance(layer.ffn.W_2, Int8Affine)
        for attention in (getattr(layer, name, None) for name in ("self_attn", "cross_attn")):
            if attention is None:
                continue
            int8 = isinstance(attention, FusedAttention) and quantized.config.d_model >= 256
            assert all(isinstance(getattr(attention, f"W_{n}"), Int8Affine) == int8 for n in "QKVO")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("beam", BEAMS)
def test_the_two_loops_translate_the_same_in_float32(shape, form, beam):
    assert cell(shape, form, "float32", beam, "fast") == cell(shape, form, "float32", beam, "readable")


def teacher_forced_logits(m, src: list[int], ids: tuple[int, ...]) -> torch.Tensor:
    """The logits of `m` at every position of `ids` (bos first), the source `src`: (len(ids) + 1, V)."""
    s, y = torch.tensor([src]), torch.tensor([[BOS, *ids]])  # (1, S), (1, T)
    with torch.no_grad():
        return m.generator(m.decode(m.encode(s, None), None, y, subsequent_mask(y.size(1))))[0]  # (T, V)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("beam", BEAMS)
@pytest.mark.parametrize("loop", LOOPS)
def test_int8_logits_stay_near_float32s_on_its_translations(shape, form, beam, loop):
    float32, int8 = model(shape, form, "float32"), model(shape, form, "int8")
    gap = size = 0.0
    for src, ids in zip(sources(shape), cell(shape, form, "int8", beam, loop)):
        want, got = teacher_forced_logits(float32, src, ids), teacher_forced_logits(int8, src, ids)  # (T, V)
        finite = want.isfinite()  # the imported model's -inf at pad, in both
        assert torch.equal(finite, got.isfinite())
        gap += (got - want)[finite].pow(2).sum().item()
        size += want[finite].pow(2).sum().item()
    assert math.sqrt(gap / size) < INT8_LOGITS, math.sqrt(gap / size)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("loop", LOOPS)
def test_each_loop_scores_its_int8_translations_as_the_int8_model_does(shape, form, loop):
    int8 = model(shape, form, "int8")
    rows = sources(shape)
    src = torch.full((len(rows), max(map(len, rows))), PAD, dtype=torch.long)  # (B, S)
    for r, ids in enumerate(rows):
        src[r, : len(ids)] = torch.tensor(ids)
    mask = padding_mask(src, PAD)  # (B, 1, S)
    ids, scores = beam_search(
        int8, src, mask, src.size(1) + MAX_EXTRA, 4, ALPHA, return_scores=True, fast=loop == "fast"
    )
    logp, n = sequence_logprob(int8, src, mask, ids)  # (B,), (B,)
    lp = torch.tensor([gnmt_lp(k, ALPHA) for k in n.tolist()], dtype=torch.float64)
    per_token = ((scores * lp - logp).abs() / n).max().item()
    assert per_token < INT8_SCORE, per_token


TEXTS = ["Ein Hund rennt über die Wiese.", "Zwei Männer spielen Fußball im Park.", "A woman reads a book."]


@pytest.mark.parametrize("beam", BEAMS)
def test_the_translator_quantizes_a_d_model_512_model_with_beam_search(tmp_path, beam):
    """`--quantize int8` on the paper's d_model: the translator answers what `translate_ids` gives on the int8 model
    (its 512 x 1,024 feed-forward products reach quantize.py's MIN_WEIGHTS), at beam 1 and beam 4."""
    shape = dict(d_model=512, d_ff=1024, h=8, tied=False, noise=1 / math.sqrt(512), vector_noise=0.5)
    m, tokenizer = tiny_translator(TEXTS * 20, 320, tmp_path, seed=7, **shape)
    save_checkpoint(tmp_path / "model.pt", m, tokenizer, DE_EN)
    quantized = quantize_int8(m)
    assert all(isinstance(layer.ffn.W_1, Int8Affine) for layer in quantized.decoder.layers)
    want = translate_ids(quantized, [tokenizer.encode(TEXTS[0])], beam, ALPHA)[0]
    out, err = io.BytesIO(), io.StringIO()
    argv = ["--checkpoint", str(tmp_path / "model.pt"), "--device", "cpu", "--quantize", "int8", "--case", "as-typed"]
    assert translator([*argv, "--beam", str(beam), TEXTS[0]], stdout=out, stderr=err) == 0, err.getvalue()
    assert out.getvalue().decode("utf-8") == tokenizer.decode(want) + "\n"
