"""The shared fixture of tests/interop: a small random model with a real sentencepiece tokenizer, as a checkpoint."""

from pathlib import Path

import pytest
import torch

from annotated.checkpoint import save_checkpoint
from annotated.training.data import train_tokenizer
from annotated.transformer import make_model

SENTENCES = [
    "Ein Hund rennt über die Wiese.",
    "Zwei Männer spielen Fußball im Park.",
    "Eine Frau liest ein Buch.",
    "A dog runs across the meadow.",
    "Two men play football in the park.",
    "A woman reads a book.",
    "Kinder spielen am Strand.",
    "Children play on the beach.",
]


@pytest.fixture(scope="session")
def sentences() -> list[str]:
    return list(SENTENCES)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A random model with a real sentencepiece tokenizer of the project's ids, as a checkpoint file."""
    folder = tmp_path_factory.mktemp("marian")
    tokenizer = train_tokenizer(SENTENCES * 20, 300, cache_dir=folder)
    torch.manual_seed(0)
    model = make_model(
        src_vocab=tokenizer.vocab_size,
        tgt_vocab=tokenizer.vocab_size,
        N=2,
        d_model=16,
        d_ff=32,
        h=4,
        dropout=0.0,
        max_len=64,
        share_embeddings=True,
        tie_generator=True,
        activation="silu",
    )
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    save_checkpoint(folder / "model.pt", model, tokenizer, {"src_lang": "de", "tgt_lang": "en"})
    return folder / "model.pt"
