"""The export and import commands of annotated/interop/folders.py, through folders and files, offline."""

import json
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
from annotated.interop.marian import export_ids
from annotated.tokens import BOS, PAD
from annotated.transformer import make_model, padding_mask, subsequent_mask

ROOT = Path(__file__).resolve().parents[2]


def test_export_loads_offline_and_tokenizes_like_ours(checkpoint, sentences, tmp_path):
    assert main(["export", str(checkpoint), str(tmp_path / "out")]) == 0
    model, tokenizer, _ = load_checkpoint(checkpoint)
    hf = MarianMTModel.from_pretrained(str(tmp_path / "out"), local_files_only=True).eval()
    tok = MarianTokenizer.from_pretrained(str(tmp_path / "out"), local_files_only=True)
    assert tok("Ein Hund", add_special_tokens=False)["input_ids"] == tokenizer.encode("Ein Hund")
    assert tok.decode(tokenizer.encode("Kinder spielen."), skip_special_tokens=True) == "Kinder spielen."
    start = hf.config.decoder_start_token_id
    assert tok.pad_token_id == start == tokenizer.vocab_size  # OPUS-MT's layout: <pad> last, the decoder start
    src = torch.tensor([tokenizer.encode(s) for s in sentences[:1]])
    tgt = torch.tensor([[BOS] + tokenizer.encode("A dog")])
    with torch.no_grad():
        ours = model(src, tgt, padding_mask(src, PAD), subsequent_mask(tgt.size(1)))
        theirs = hf(input_ids=src, decoder_input_ids=export_ids(tgt, start, decoder=True)).logits
    # float32, loaded from the folder: the first decoder input is ours bit for bit (the positional row stored), the
    # rest two orders of the same float32 operations (about 1e-6)
    assert (ours - theirs[..., :start]).abs().max() <= 1e-4


def test_import_of_an_export_is_the_checkpoint(checkpoint, sentences, tmp_path):
    main(["export", str(checkpoint), str(tmp_path / "out")])
    assert main(["import", str(tmp_path / "out"), str(tmp_path / "back.pt"), "--attention", "per_head"]) == 0
    model, tokenizer, _ = load_checkpoint(checkpoint)
    back, back_tokenizer, _ = load_checkpoint(tmp_path / "back.pt")
    assert back_tokenizer == tokenizer and back.config.attention == "per_head"
    src = torch.tensor([tokenizer.encode(s) for s in sentences[:2]][:1])
    tgt = torch.tensor([[BOS] + tokenizer.encode("Two men")])
    with torch.no_grad():
        a, b = (m(src, tgt, padding_mask(src, PAD), subsequent_mask(tgt.size(1))) for m in (model, back))
    assert (a - b).abs().max() <= 1e-5  # fused against per-head in float32


def test_nothing_is_overwritten_without_the_flag(checkpoint, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep")
    with pytest.raises(SystemExit) as stop:
        main(["export", str(checkpoint), str(tmp_path / "out")])
    assert stop.value.code == 2 and "add --overwrite" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # not a model folder: not replaced even with the flag
        main(["export", str(checkpoint), str(tmp_path / "out"), "--overwrite"])
    assert "not a model folder" in capsys.readouterr().err and (tmp_path / "out" / "mine.txt").read_text() == "keep"
    main(["export", str(checkpoint), str(tmp_path / "model")])
    assert main(["export", str(checkpoint), str(tmp_path / "model"), "--overwrite"]) == 0
    (tmp_path / "taken.pt").write_text("mine")
    with pytest.raises(SystemExit):
        main(["import", str(tmp_path / "model"), str(tmp_path / "taken.pt")])
    assert "add --overwrite" in capsys.readouterr().err and (tmp_path / "taken.pt").read_text() == "mine"
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


def test_an_opus_like_folder_imports_with_its_tokenizer(checkpoint, sentences, tmp_path):
    folder = opus_like_folder(load_checkpoint(checkpoint)[1], tmp_path / "opus")
    assert main(["import", str(folder), str(tmp_path / "opus.pt")]) == 0
    model, tokenizer, meta = load_checkpoint(tmp_path / "opus.pt")
    assert tokenizer is not None and tokenizer.vocab_size == model.config.src_vocab
    marian_ids, hf = meta["marian_source_ids"], MarianMTModel.from_pretrained(str(folder), local_files_only=True)
    marian_tokenizer = MarianTokenizer.from_pretrained(str(folder), local_files_only=True)
    for sentence in sentences + ["Übermütige Kängurus!"]:  # the last one spelled with pieces of bytes
        ours = tokenizer.encode(sentence)
        assert [marian_ids[i] for i in ours] == marian_tokenizer(sentence, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ours) == sentence
    src = torch.tensor([tokenizer.encode(sentences[0])])
    tgt = torch.tensor([[BOS] + tokenizer.encode(sentences[3])])
    with torch.no_grad():
        ours = model(src, tgt, padding_mask(src, PAD), subsequent_mask(tgt.size(1)))
        theirs = hf(
            input_ids=src.clone().apply_(marian_ids.__getitem__),
            decoder_input_ids=tgt.clone().apply_(marian_ids.__getitem__),
        ).logits
    assert (ours[..., 1:] - theirs[..., marian_ids[1:]]).abs().max() <= 1e-4  # float32


def test_export_takes_shipped_names_and_says_what_is_missing(tmp_path, monkeypatch, capsys):
    """`shipped:NAME`, and with no checkpoint the commands' rule (here, no runs/: the shipped de -> en model); with
    no folder to write, one line saying what to pass."""
    monkeypatch.chdir(tmp_path)  # no runs/ here
    for argv in (["export"], ["export", "", ""], ["export", "shipped:de-en"]):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        err = capsys.readouterr().err
        assert stop.value.code == 2 and len(err.strip().splitlines()) == 1, err
        assert "name the folder to write: make export CHECKPOINT=shipped:de-en OUT=" in err
    assert main(["export", "shipped:en-de", "en-de"]) == 0
    assert main(["export", "", "fallback"]) == 0
    assert "using the shipped model" in capsys.readouterr().err
    configs = [json.loads((tmp_path / d / "tokenizer_config.json").read_text()) for d in ("en-de", "fallback")]
    assert [(c["source_lang"], c["target_lang"]) for c in configs] == [("en", "de"), ("de", "en")]


def test_the_export_carries_its_model_card(tmp_path):
    """README.md: data and domain warning, recipe, scores with their signatures (the shipped card's), how it was
    exported; the tokenizer's limit is the model's positions; generate's beam is the translator's."""
    from annotated.decoding.translate import build_parser
    from annotated.shipped import read_card

    assert main(["export", "shipped:de-en", str(tmp_path / "x")]) == 0
    card, shipped = (tmp_path / "x" / "README.md").read_text(encoding="utf-8"), read_card("de-en")
    assert shipped["trained_on"] in card and "out of its domain" in card
    assert shipped["made"]["command"] in card and "make export CHECKPOINT=shipped:de-en" in card
    for name in ("bleu", "bleu_lowercase", "chrf"):
        assert f"| {name} | {shipped['scores']['test'][name]} | `{shipped['scores']['signatures'][name]}` |" in card
    assert "ct2-transformers-converter" in card and str(Path.cwd()) not in card
    tokenizer_config = json.loads((tmp_path / "x" / "tokenizer_config.json").read_text())
    assert tokenizer_config["model_max_length"] == shipped["model"]["max_len"] == 256
    generation = json.loads((tmp_path / "x" / "generation_config.json").read_text())
    assert generation["num_beams"] == build_parser().get_default("beam") == 4
    # the model's alpha, chosen on validation, which generate's |Y|^length_penalty cannot express: named
    assert f"this model's translator decodes at alpha {shipped['scores']['length_penalty']:g}" in card
    assert generation["length_penalty"] == 1.0 and "`generation_config.json` keeps `transformers`' default" in card


def test_a_long_source_goes_through_generate(checkpoint, tmp_path):
    """A source of 600 subwords, cut by the tokenizer (truncation=True) to the model's 64 positions, translates
    within the positions the generation config allows."""
    main(["export", str(checkpoint), str(tmp_path / "out")])
    hf = MarianMTModel.from_pretrained(str(tmp_path / "out"), local_files_only=True).eval()
    tok = MarianTokenizer.from_pretrained(str(tmp_path / "out"), local_files_only=True)
    text = " ".join(["Zwei Männer spielen Fußball im Park."] * 100)
    assert len(tok(text, add_special_tokens=False)["input_ids"]) >= 600
    batch = tok([text], add_special_tokens=False, truncation=True, return_tensors="pt")
    assert batch["input_ids"].shape[1] == hf.config.max_position_embeddings == 64
    with torch.no_grad():
        out = hf.generate(**batch, num_beams=2)  # the export's max_length: the model's positions
    assert out.shape[1] <= 64


def test_the_language_pair_survives_export_and_import(checkpoint, tmp_path):
    from annotated.attention.heads import languages_of

    main(["export", str(checkpoint), str(tmp_path / "out")])
    assert main(["import", str(tmp_path / "out"), str(tmp_path / "back.pt")]) == 0
    assert languages_of(load_checkpoint(tmp_path / "back.pt")[2]) == ("de", "en")
    config = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    del config["source_lang"], config["target_lang"]  # a folder that names no pair: --src/--tgt name it
    (tmp_path / "out" / "tokenizer_config.json").write_text(json.dumps(config))
    main(["import", str(tmp_path / "out"), str(tmp_path / "none.pt")])
    assert "src_lang" not in load_checkpoint(tmp_path / "none.pt")[2]
    main(["import", str(tmp_path / "out"), str(tmp_path / "named.pt"), "--src", "en", "--tgt", "de"])
    assert languages_of(load_checkpoint(tmp_path / "named.pt")[2]) == ("en", "de")


def test_an_export_saved_again_by_transformers_is_refused_with_the_reason(checkpoint, tmp_path, capsys):
    """save_pretrained leaves Marian's positional tables out, and with them the start vector: such a folder
    computes another function, so import says why instead of reading it; with the export's own setting it keeps it."""
    main(["export", str(checkpoint), str(tmp_path / "out")])
    hf = MarianMTModel.from_pretrained(str(tmp_path / "out"), local_files_only=True)
    hf.save_pretrained(str(tmp_path / "again"))
    with pytest.raises(SystemExit) as stop:
        main(["import", str(tmp_path / "again"), str(tmp_path / "x.pt")])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "no longer holds the start vector" in err and "export the checkpoint again" in err
    hf._keys_to_ignore_on_save = {"model.encoder.embed_positions.weight"}  # what the card says to do
    hf.save_pretrained(str(tmp_path / "kept"))
    assert main(["import", str(tmp_path / "kept"), str(tmp_path / "kept.pt")]) == 0


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


def test_export_and_import_print_only_their_own_lines(checkpoint, tmp_path, capfd):
    """No third-party output: transformers' progress bars (shards written, weights loaded) and MarianTokenizer's
    sacremoses hint stay off the terminal; each command prints its one line, on stdout."""
    assert main(["export", str(checkpoint), str(tmp_path / "out")]) == 0
    assert main(["import", str(tmp_path / "out"), str(tmp_path / "back.pt")]) == 0
    out, err = capfd.readouterr()
    assert err == "" and out.splitlines() == [
        f"wrote {tmp_path / 'out'}: MarianMTModel.from_pretrained({str(tmp_path / 'out')!r}) loads it",
        f"wrote {tmp_path / 'back.pt'}",
    ]
