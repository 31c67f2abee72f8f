"""An export's `ctranslate2/` model, made by CTranslate2's own converter, computes our model's function.

No patched loader: the converter's code as `ct2-transformers-converter` runs it, on a small export of a random model
with a real sentencepiece tokenizer (tests/interop/conftest.py). Skipped only where ctranslate2 is not installed.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
ctranslate2 = pytest.importorskip("ctranslate2")

from annotated.checkpoint import load_checkpoint
from annotated.decoding.search import beam_search, greedy
from annotated.interop.folders import main
from annotated.tokens import BOS, EOS, PAD
from annotated.transformer import padding_mask, subsequent_mask


def stock_convert(folder: Path, out: Path) -> Path:
    """`ct2-transformers-converter --model folder --output_dir out`, the console script of the installed package."""
    script = Path(sys.executable).with_name("ct2-transformers-converter")
    command = [str(script)] if script.is_file() else [sys.executable, "-m", "ctranslate2.converters.transformers"]
    r = subprocess.run(
        [*command, "--model", str(folder), "--output_dir", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return out


@pytest.fixture(scope="module")
def exported(checkpoint, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("ct2")
    assert main(["export", str(checkpoint), str(folder / "hf")]) == 0
    return folder / "hf"


@pytest.fixture(scope="module")
def converted(exported) -> Path:
    """The export's own CTranslate2 model."""
    assert (exported / "ctranslate2" / "model.bin").is_file()
    return exported / "ctranslate2"


def ct2_log_probs(folder: Path, tokenizer, sentences: list[str]) -> list[tuple[list[float], list[float]]]:
    """(CTranslate2's teacher-forced log-probabilities, ours) of the model in `folder`, for the sentence pairs."""
    translator = ctranslate2.Translator(str(folder), device="cpu", intra_threads=1)
    sources, targets = [tokenizer.encode(s) for s in sentences[:4]], [tokenizer.encode(s) for s in sentences[4:]]
    results = translator.score_batch([tokenizer.pieces(s) for s in sources], [tokenizer.pieces(t) for t in targets])
    return [(r.log_probs, (src, tgt)) for src, tgt, r in zip(sources, targets, results)]


def our_log_probs(model, src: list[int], tgt: list[int]) -> list[float]:
    """log p(each token of tgt, then eos | src) under our model, teacher-forced."""
    s, t = torch.tensor([src]), torch.tensor([[BOS] + tgt])
    with torch.no_grad():
        logp = model(s, t, padding_mask(s, PAD), subsequent_mask(t.size(1))).log_softmax(-1)[0]  # (T, V)
    return logp.gather(1, torch.tensor([tgt + [EOS]]).T)[:, 0].tolist()


def worst_difference(model, scored) -> float:
    worst = 0.0
    for theirs, (src, tgt) in scored:
        ours = our_log_probs(model, src, tgt)
        assert len(theirs) == len(ours)
        worst = max(worst, max(abs(a - b) for a, b in zip(ours, theirs)))
    return worst


def test_the_exported_ctranslate2_model_gives_our_log_probabilities(checkpoint, converted, sentences):
    """CTranslate2 drops the `<pad>` row and starts the decoder from a zero embedding plus the first positional row,
    which in the layout the export converts is our first decoder input: our model's function, so its teacher-forced
    log-probabilities are ours."""
    model, tokenizer, _ = load_checkpoint(checkpoint)
    # float32 in both, different kernels: measured about 1e-6; the log-probabilities themselves are units (a zero
    # start instead of ours moves them by more than 0.1: the next test)
    assert worst_difference(model, ct2_log_probs(converted, tokenizer, sentences)) <= 1e-4


def test_the_stock_converter_on_the_transformers_folder_starts_from_zero(checkpoint, exported, sentences, tmp_path):
    """Why the export carries ctranslate2/: `ct2-transformers-converter` run on the folder itself starts the decoder
    from a zero vector plus Marian's sinusoid, not from our bos, which moves the log-probabilities by far more than
    rounding, as the card says."""
    model, tokenizer, _ = load_checkpoint(checkpoint)
    stock = stock_convert(exported, tmp_path / "stock")
    assert worst_difference(model, ct2_log_probs(stock, tokenizer, sentences)) > 0.1


def test_the_exported_ctranslate2_model_translates_as_we_do(checkpoint, converted, sentences):
    """Greedy and beam 4 with the length penalty off on both sides: the same subwords."""
    model, tokenizer, _ = load_checkpoint(checkpoint)
    translator = ctranslate2.Translator(str(converted), device="cpu", intra_threads=1)
    pieces = [tokenizer.pieces(tokenizer.encode(s)) for s in sentences]
    piece_id = {p: i for i, p in enumerate(tokenizer.pieces(range(tokenizer.vocab_size)))}
    max_len = 12
    for beam in (1, 4):
        theirs = translator.translate_batch(
            pieces, beam_size=beam, length_penalty=0.0, max_decoding_length=max_len, return_end_token=True
        )
        for sentence, r in zip(sentences, theirs):
            src = torch.tensor([tokenizer.encode(sentence)])
            if beam == 1:
                ours = greedy(model, src, padding_mask(src, PAD), max_len)[0].tolist()
            else:
                ours = beam_search(model, src, padding_mask(src, PAD), max_len, beam_size=4, length_penalty=0.0)
                ours = ours[0].tolist()
            ours = ours[: ours.index(EOS) + 1] if EOS in ours else ours
            assert [piece_id[p] for p in r.hypotheses[0]] == ours, (beam, sentence)
