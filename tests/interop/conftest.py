"""The shared fixture of tests/interop: a small random model with a real sentencepiece tokenizer, as a checkpoint."""

from pathlib import Path

import pytest
import tiny

SENTENCES = [*tiny.SENTENCES, "Kinder spielen am Strand.", "Children play on the beach."]


@pytest.fixture(scope="session")
def sentences() -> list[str]:
    return list(SENTENCES)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A random model with a real sentencepiece tokenizer of the project's ids, as a checkpoint file."""
    path = tmp_path_factory.mktemp("marian") / "model.pt"
    return tiny.write_tiny_checkpoint(path, SENTENCES * 20, 300, N=2, h=4, activation="silu", noise=0.3)
