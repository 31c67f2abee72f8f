"""The export and import commands of annotated/interop/folders.py, through folders and files, offline."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import MarianMTModel, MarianTokenizer

from annotated.checkpoint import load_checkpoint, save_checkpoint
from annotated.interop.folders import main
from annotated.tokens import BOS, PAD
from annotated.training.data import train_tokenizer
from annotated.transformer import make_model, padding_mask, subsequent_mask

ROOT = Path(__file__).resolve().parents[2]
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


def test_export_loads_offline_and_tokenizes_like_ours(checkpoint, tmp_path):
    assert main(["export", str(checkpoint), str(tmp_path / "out")]) == 0
    model, tokenizer, _ = load_checkpoint(checkpoint)
    hf = MarianMTModel.from_pretrained(str(tmp_path / "out"), local_files_only=True).eval()
    tok = MarianTokenizer.from_pretrained(str(tmp_path / "out"), local_files_only=True)
    assert tok("Ein Hund", add_special_tokens=False)["input_ids"] == tokenizer.encode("Ein Hund")
    assert tok.decode(tokenizer.encode("Kinder spielen."), skip_special_tokens=True) == "Kinder spielen."
    src = torch.tensor([tokenizer.encode(s) for s in SENTENCES[:1]])
    tgt = torch.tensor([[BOS] + tokenizer.encode("A dog")])
    with torch.no_grad():
        ours = model(src, tgt, padding_mask(src, PAD), subsequent_mask(tgt.size(1)))
        theirs = hf(input_ids=src, decoder_input_ids=tgt).logits
    assert (ours - theirs).abs().max() <= 1e-4  # float32


def test_import_of_an_export_is_the_checkpoint(checkpoint, tmp_path):
    main(["export", str(checkpoint), str(tmp_path / "out")])
    assert main(["import", str(tmp_path / "out"), str(tmp_path / "back.pt"), "--attention", "per_head"]) == 0
    model, tokenizer, _ = load_checkpoint(checkpoint)
    back, back_tokenizer, _ = load_checkpoint(tmp_path / "back.pt")
    assert back_tokenizer == tokenizer and back.config.attention == "per_head"
    src = torch.tensor([tokenizer.encode(s) for s in SENTENCES[:2]][:1])
    tgt = torch.tensor([[BOS] + tokenizer.encode("Two men")])
    with torch.no_grad():
        a, b = (m(src, tgt, padding_mask(src, PAD), subsequent_mask(tgt.size(1))) for m in (model, back))
    assert (a - b).abs().max() <= 1e-5  # fused against per-head in float32


def test_nothing_is_overwritten_without_the_flag(checkpoint, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep")
    with pytest.raises(SystemExit) as stop:
        main(["export", str(checkpoint), str(tmp_path / "out")])
    assert stop.value.code == 2 and "pass --overwrite" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # not a model folder: not replaced even with the flag
        main(["export", str(checkpoint), str(tmp_path / "out"), "--overwrite"])
    assert "not a model folder" in capsys.readouterr().err and (tmp_path / "out" / "mine.txt").read_text() == "keep"
    main(["export", str(checkpoint), str(tmp_path / "model")])
    assert main(["export", str(checkpoint), str(tmp_path / "model"), "--overwrite"]) == 0
    (tmp_path / "taken.pt").write_text("mine")
    with pytest.raises(SystemExit):
        main(["import", str(tmp_path / "model"), str(tmp_path / "taken.pt")])
    assert "pass --overwrite" in capsys.readouterr().err and (tmp_path / "taken.pt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "out", "taken.pt"]  # no staging left behind


def test_refusals_are_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["import", str(tmp_path), str(tmp_path / "x.pt")])
    assert stop.value.code == 2 and "holds no config.json" in capsys.readouterr().err
    model = make_model(src_vocab=9, tgt_vocab=9, N=1, d_model=8, d_ff=8, h=2, norm="pre")
    save_checkpoint(tmp_path / "pre.pt", model, None)
    with pytest.raises(SystemExit):
        main(["export", str(tmp_path / "pre.pt"), str(tmp_path / "out")])
    assert "export a model trained with norm='post'" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("make") is None, reason="no `make` on PATH")
def test_make_targets_pass_paths_as_typed(tmp_path):
    echo = tmp_path / "python"
    echo.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    echo.chmod(0o755)
    hostile = "my runs/$USER;touch pwned/it's.pt"
    for target, var, command in (("export", "CHECKPOINT", "export"), ("import", "HF", "import")):
        r = subprocess.run(
            ["make", "-s", "-f", str(ROOT / "Makefile"), target, f"PYTHON={echo}", f"{var}={hostile}", "OUT=o ut"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == f'["-m", "annotated.interop.folders", "{command}", "{hostile}", "o ut"]'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["python"]


def opus_like_folder(tokenizer, folder: Path) -> Path:
    """A Marian folder in OPUS-MT's layout: vocab.json puts </s> at 0, <unk> at 1, the other pieces in a shuffled
    order and <pad> last, so its ids are not the sentencepiece model's; the decoder starts with the pad."""
    import json
    import random

    from transformers import MarianConfig

    rest = [p for p in tokenizer.pieces(range(tokenizer.vocab_size)) if p not in ("<pad>", "<s>", "</s>", "<unk>")]
    random.Random(0).shuffle(rest)
    vocab = {"</s>": 0, "<unk>": 1, **{p: i + 2 for i, p in enumerate(rest)}, "<pad>": len(rest) + 2}
    folder.mkdir()
    for name in ("source.spm", "target.spm"):
        (folder / name).write_bytes(tokenizer.to_bytes())
    (folder / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    torch.manual_seed(1)
    hf = MarianMTModel(
        MarianConfig(
            vocab_size=len(vocab),
            d_model=16,
            encoder_layers=1,
            decoder_layers=1,
            encoder_ffn_dim=32,
            decoder_ffn_dim=32,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            activation_function="swish",
            scale_embedding=True,
            max_position_embeddings=64,
            pad_token_id=len(vocab) - 1,
            decoder_start_token_id=len(vocab) - 1,
            eos_token_id=0,
        )
    )
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "embed_positions" not in name:
                p.add_(torch.randn_like(p) * 0.3)
    hf.save_pretrained(str(folder))
    return folder


def test_an_opus_like_folder_imports_with_its_tokenizer(checkpoint, tmp_path):
    folder = opus_like_folder(load_checkpoint(checkpoint)[1], tmp_path / "opus")
    assert main(["import", str(folder), str(tmp_path / "opus.pt")]) == 0
    model, tokenizer, meta = load_checkpoint(tmp_path / "opus.pt")
    assert tokenizer is not None and tokenizer.vocab_size == model.config.src_vocab
    marian_ids, hf = meta["marian_source_ids"], MarianMTModel.from_pretrained(str(folder), local_files_only=True)
    marian_tokenizer = MarianTokenizer.from_pretrained(str(folder), local_files_only=True)
    for sentence in SENTENCES + ["Übermütige Kängurus!"]:  # the last one spelled with pieces of bytes
        ours = tokenizer.encode(sentence)
        assert [marian_ids[i] for i in ours] == marian_tokenizer(sentence, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ours) == sentence
    src = torch.tensor([tokenizer.encode(SENTENCES[0])])
    tgt = torch.tensor([[BOS] + tokenizer.encode(SENTENCES[3])])
    with torch.no_grad():
        ours = model(src, tgt, padding_mask(src, PAD), subsequent_mask(tgt.size(1)))
        theirs = hf(
            input_ids=src.clone().apply_(marian_ids.__getitem__),
            decoder_input_ids=tgt.clone().apply_(marian_ids.__getitem__),
        ).logits
    assert (ours[..., 1:] - theirs[..., marian_ids[1:]]).abs().max() <= 1e-4  # float32


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_an_exported_folder_gets_the_mode_of_the_umask(checkpoint, tmp_path, umask):
    """The export is published by plumbing/files.py's `staged_directory`: the folder is 0o777 less the umask,
    as `mkdir` would make it, not the 0o700 of the private staging folder; its files are readable alike."""
    import os
    import stat

    old = os.umask(umask)
    try:
        assert main(["export", str(checkpoint), str(tmp_path / "out")]) == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o777 & ~umask
    modes = {f.name: oct(stat.S_IMODE(f.stat().st_mode)) for f in (tmp_path / "out").iterdir()}
    assert set(modes.values()) == {oct(0o666 & ~umask)}, modes
