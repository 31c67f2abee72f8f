"""An export converts with CTranslate2's stock `ct2-transformers-converter` and computes our model's function.

No patched loader: the command line a user would type, on a small export of a random model with a real
sentencepiece tokenizer (tests/interop/conftest.py). Skipped only where ctranslate2 is not installed.
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
def converted(checkpoint, tmp_path_factory):
    folder = tmp_path_factory.mktemp("ct2")
    assert main(["export", str(checkpoint), str(folder / "hf")]) == 0
    return stock_convert(folder / "hf", folder / "ct2")


def our_log_probs(model, src: list[int], tgt: list[int]) -> list[float]:
    """log p(each token of tgt, then eos | src) under our model, teacher-forced."""
    s, t = torch.tensor([src]), torch.tensor([[BOS] + tgt])
    with torch.no_grad():
        logp = model(s, t, padding_mask(s, PAD), subsequent_mask(t.size(1))).log_softmax(-1)[0]  # (T, V)
    return logp.gather(1, torch.tensor([tgt + [EOS]]).T)[:, 0].tolist()


def test_the_stock_converter_gives_our_log_probabilities(checkpoint, converted, sentences):
    """CTranslate2 drops the export's start row and starts the decoder from a zero embedding plus the stored first
    positional row: our model's function, so its teacher-forced log-probabilities are ours."""
    model, tokenizer, _ = load_checkpoint(checkpoint)
    translator = ctranslate2.Translator(str(converted), device="cpu", intra_threads=1)
    sources, targets = [tokenizer.encode(s) for s in sentences[:4]], [tokenizer.encode(s) for s in sentences[4:]]
    results = translator.score_batch([tokenizer.pieces(s) for s in sources], [tokenizer.pieces(t) for t in targets])
    worst = 0.0
    for src, tgt, r in zip(sources, targets, results):
        ours = our_log_probs(model, src, tgt)
        assert len(r.log_probs) == len(ours)
        worst = max(worst, max(abs(a - b) for a, b in zip(ours, r.log_probs)))
    # float32 in both, different kernels: measured about 1e-6; the log-probabilities themselves are units (a zero
    # start instead of ours, what the converter does without the stored row, moves them by more than 0.1)
    assert worst <= 1e-4, worst


def test_the_stock_converter_translates_as_we_do(checkpoint, converted, sentences):
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
