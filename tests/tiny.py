"""The tests' one builder of tiny models, tokenizers and checkpoints, parametrised by shape.

`tiny_model` is `make_model` after `torch.manual_seed(seed)`, with the small shape most tests use (one layer of
d_model 16, d_ff 32, h 2, max_len 64, dropout 0, in eval mode): one vocabulary is shared by the two sides and
tied to the generator, two separate vocabularies are not; `noise` moves every weight at random after the
initialisation (`jiggle`), so that no block of zeros or ones hides a mistake. `blank_model` is the same model with
every weight zero, for the tests that plant weights by hand. `tiny_translator` adds a real sentencepiece
tokenizer trained on a few sentences, `write_tiny_checkpoint` saves the two as a checkpoint file.

The models are untrained: what the tests check never depends on a model having learnt anything, but some depend
on its particular random weights, so a test keeps its seed and shape by passing them here.
"""

from pathlib import Path

import torch
from torch import Tensor

from annotated.checkpoint import save_checkpoint
from annotated.tokens import PAD, Tokenizer
from annotated.training.data import train_tokenizer
from annotated.transformer import EncoderDecoder, make_model

SENTENCES = [
    "Ein Hund rennt über die Wiese.",
    "Zwei Männer spielen Fußball im Park.",
    "Eine Frau liest ein Buch.",
    "A dog runs across the meadow.",
    "Two men play football in the park.",
    "A woman reads a book.",
]
DE_EN = {"src_lang": "de", "tgt_lang": "en"}


def tiny_model(
    src_vocab: int,
    tgt_vocab: int | None = None,
    *,
    seed: int = 0,
    N: int = 1,
    d_model: int = 16,
    d_ff: int = 32,
    h: int = 2,
    max_len: int = 64,
    tied: bool | None = None,
    noise: float | None = None,
    vector_noise: float | None = None,
    **fields,
) -> EncoderDecoder:
    """A model of this shape, its weights drawn after `torch.manual_seed(seed)`; `tgt_vocab` None: one
    vocabulary, shared and tied (`tied` overrides); `noise`, `vector_noise`: `jiggle`'s; other `fields` go to
    `make_model` (attention="per_head", norm="pre", activation="silu", d_k, d_v, ...)."""
    tied = tgt_vocab is None if tied is None else tied
    torch.manual_seed(seed)
    model = make_model(
        src_vocab=src_vocab,
        tgt_vocab=src_vocab if tgt_vocab is None else tgt_vocab,
        N=N,
        d_model=d_model,
        d_ff=d_ff,
        h=h,
        max_len=max_len,
        **{"dropout": 0.0, "share_embeddings": tied, "tie_generator": tied, **fields},
    )
    if noise is not None:
        jiggle(model, noise, vector_noise)
    return model.eval()


def jiggle(model: torch.nn.Module, matrices: float, vectors: float | None = None) -> torch.nn.Module:
    """Move each weight by noise drawn from the global generator: N(0, matrices^2) for every matrix entry,
    N(0, vectors^2) for every vector entry (biases, LayerNorms; `vectors` None: the matrices' size); a Hugging
    Face model's sinusoidal position tables (`embed_positions`) stay as they are."""
    vectors = matrices if vectors is None else vectors
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed_positions" not in name:
                p.add_(torch.randn_like(p) * (matrices if p.dim() > 1 else vectors))
    return model


def random_biases(model: EncoderDecoder, norms: bool = False) -> EncoderDecoder:
    """Draw every attention bias (and with `norms` every LayerNorm's gain and shift) from N(0, 1): they start at
    0 and 1, and a term they feed would otherwise be zero and go unchecked."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".b_" in name or name.endswith("b_O") or (norms and (".ln." in name or "final_ln" in name)):
                p.normal_()
    return model


def blank_model(vocab: int, **shape) -> EncoderDecoder:
    """A float64 model of this shape (untied) with every weight zero, LayerNorms of gain 1 and no positions: a
    test plants the weights it needs by hand."""
    model = tiny_model(vocab, vocab, tied=False, **shape).double()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.fill_(1.0)
        model.pos.pe.zero_()
    return model


def padded_batch(seed: int = 1, vocab: int = 19) -> tuple[Tensor, Tensor]:
    """Random token ids with padding on both sides: src (3, 6) with row 0 padded from 4, tgt (3, 5) with row 1
    padded from 3."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, vocab, (3, 6), generator=g)
    tgt = torch.randint(4, vocab, (3, 5), generator=g)
    src[0, 4:], tgt[1, 3:] = PAD, PAD
    return src, tgt


def tiny_translator(texts: list[str], vocab_size: int, cache_dir: Path, **shape) -> tuple[EncoderDecoder, Tokenizer]:
    """A joint sentencepiece tokenizer of `vocab_size` pieces trained on `texts` (cached in `cache_dir`), and a
    `tiny_model` of its vocabulary and this shape."""
    tokenizer = train_tokenizer(texts, vocab_size, cache_dir=cache_dir)
    return tiny_model(tokenizer.vocab_size, **shape), tokenizer


def write_tiny_checkpoint(
    path: Path, texts: list[str], vocab_size: int, cache_dir: Path | None = None, meta: dict = DE_EN, **shape
) -> Path:
    """`tiny_translator` saved as a checkpoint at `path` (the tokenizer cached beside it unless `cache_dir`)."""
    model, tokenizer = tiny_translator(texts, vocab_size, path.parent if cache_dir is None else cache_dir, **shape)
    save_checkpoint(path, model, tokenizer, dict(meta))
    return path
