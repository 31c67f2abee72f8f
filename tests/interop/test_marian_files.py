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
from annotated.tokens import BOS, PAD
from annotated.transformer import make_model, padding_mask, subsequent_mask
from benchmarks.agreement import export_ids

ROOT = Path(__file__).resolve().parents[2]


def test_export_loads_offline_and_tokenizes_like_ours(checkpoint, sentences, tmp_path):
    assert main(["export", str(checkpoint), str(tmp_path / "out")]) == 0
    model, tokenizer, _ = load_checkpoint(checkpoint)
    hf = MarianMTModel.from_pretrained(str(tmp_path / "out"), local_files_only=True).eval()
    tok = MarianTokenizer.from_pretrained(str(tmp_path / "out"), local_files_only=True)
    assert tok("Ein Hund", add_special_tokens=False)["input_ids"] == tokenizer.encode("Ein Hund")
    assert tok.decode(tokenizer.encode("Kinder spielen."), skip_special_tokens=True) == "Kinder spielen."
    pad = hf.config.pad_token_id
    assert tok.pad_token_id == pad == tokenizer.vocab_size  # OPUS-MT's layout: <pad> last
    src = torch.tensor([tokenizer.encode(s) for s in sentences[:1]])
    tgt = torch.tensor([[BOS] + tokenizer.encode("A dog")])  # the export's decoder starts with our bos, as ours
    with torch.no_grad():
        ours = model(src, tgt, padding_mask(src, PAD), subsequent_mask(tgt.size(1)))
        theirs = hf(input_ids=src, decoder_input_ids=export_ids(tgt, pad)).logits
    # float32, loaded from the folder: the first decoder input is ours bit for bit (our bos row plus Marian's own
    # sinusoid), the rest two orders of the same float32 operations (about 1e-6)
    assert (ours - theirs[..., :pad]).abs().max() <= 1e-4


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


def test_the_library_calls_overwrite_nothing_without_the_flag(checkpoint, tmp_path):
    """`export_marian` and `import_marian` called from Python keep an existing output as the command does."""
    from annotated.interop.folders import export_marian, import_marian

    model = export_marian(checkpoint, tmp_path / "model")
    before = (model / "config.json").read_bytes()
    (model / "config.json").write_text("mine")
    with pytest.raises(FileExistsError, match="overwrite"):
        export_marian(checkpoint, model)
    assert (model / "config.json").read_text() == "mine"
    (model / "config.json").write_bytes(before)
    (tmp_path / "taken.pt").write_text("mine")
    with pytest.raises(FileExistsError, match="overwrite"):
        import_marian(model, tmp_path / "taken.pt")
    assert (tmp_path / "taken.pt").read_text() == "mine"
    assert import_marian(model, tmp_path / "taken.pt", overwrite=True)[0].stat().st_size > 4


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
    assert main(["import", str(folder), str(tmp_path / "opus.pt"), "--src", "de", "--tgt", "en"]) == 0
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


def test_the_export_card_of_a_runs_checkpoint_gives_that_checkpoints_scores(checkpoint, tmp_path):
    """A run folder with best.pt and averaged.pt, each with its own test scores in results.json (best first, as
    a run writes them): each one's export carries its own scores, not the other's."""
    run = tmp_path / "run"
    run.mkdir()
    test = {}
    for name, bleu in (("best", 1.5), ("averaged", 7.5)):
        shutil.copy(checkpoint, run / f"{name}.pt")
        beam = {"bleu": bleu, "bleu_lowercase": bleu + 1, "chrf": bleu + 2, "length_penalty": 0.6}
        test[name] = {"checkpoint": str(run / f"{name}.pt"), "beam": beam}
    (run / "results.json").write_text(json.dumps({"test_set": "test_2016_flickr", "test": test}))
    for name, bleu in (("best", 1.5), ("averaged", 7.5)):
        assert main(["export", str(run / f"{name}.pt"), str(tmp_path / name)]) == 0
        card = (tmp_path / name / "README.md").read_text(encoding="utf-8")
        assert f"| bleu | {bleu} |" in card and f"| chrf | {bleu + 2} |" in card, name


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


def test_the_language_pair_survives_export_and_import(checkpoint, tmp_path, capsys):
    """The folder's pair comes back; a folder that names none is refused unless --src and --tgt name it."""
    from annotated.checkpoint import languages_of

    main(["export", str(checkpoint), str(tmp_path / "out")])
    assert main(["import", str(tmp_path / "out"), str(tmp_path / "back.pt")]) == 0
    assert languages_of(load_checkpoint(tmp_path / "back.pt")[2]) == ("de", "en")
    config = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    del config["source_lang"], config["target_lang"]  # a folder that names no pair
    (tmp_path / "out" / "tokenizer_config.json").write_text(json.dumps(config))
    capsys.readouterr()  # what the export printed
    for named in ([], ["--src", "en"]):
        with pytest.raises(SystemExit) as stop:
            main(["import", str(tmp_path / "out"), str(tmp_path / "none.pt"), *named])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and len(err.strip().splitlines()) == 1 and "names no language pair" in err
        assert ("--src and --tgt" if not named else "with --tgt (") in err
    assert not (tmp_path / "none.pt").exists()
    main(["import", str(tmp_path / "out"), str(tmp_path / "named.pt"), "--src", "en", "--tgt", "de"])
    assert languages_of(load_checkpoint(tmp_path / "named.pt")[2]) == ("en", "de")


def test_import_src_tgt_name_the_pair_even_where_the_folder_names_one(checkpoint, tmp_path):
    """The folder says de -> en; --src/--tgt say otherwise, and they win (one of them alone replaces its side)."""
    from annotated.checkpoint import languages_of

    main(["export", str(checkpoint), str(tmp_path / "out")])
    assert main(["import", str(tmp_path / "out"), str(tmp_path / "both.pt"), "--src", "en", "--tgt", "de"]) == 0
    assert languages_of(load_checkpoint(tmp_path / "both.pt")[2]) == ("en", "de")
    assert main(["import", str(tmp_path / "out"), str(tmp_path / "one.pt"), "--tgt", "fr"]) == 0
    assert languages_of(load_checkpoint(tmp_path / "one.pt")[2]) == ("de", "fr")


def test_the_generation_config_starts_the_decoder_with_our_first_input(checkpoint, tmp_path):
    """generation_config.json and config.json name the same special ids; the decoder start `generate` uses is the
    row whose input to Marian's decoder (its embedding, scaled, plus the first position) is our first decoder input,
    bit for bit; `<pad>` pads and is never predicted."""
    from annotated.interop.layout import inverse_permutation, sinusoid_permutation
    from annotated.interop.marian import first_decoder_input

    main(["export", str(checkpoint), str(tmp_path / "out")])
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    ids = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
    assert {k: config[k] for k in ids} == {k: generation[k] for k in ids}
    hf = MarianMTModel.from_pretrained(str(tmp_path / "out"), local_files_only=True).eval()
    model, tokenizer, _ = load_checkpoint(checkpoint)
    dec, start = hf.model.decoder, hf.generation_config.decoder_start_token_id
    theirs = dec.embed_tokens.weight[start] * dec.embed_scale + dec.embed_positions.weight[0]  # (d_model,)
    ours = first_decoder_input(model)[inverse_permutation(sinusoid_permutation(model.config.d_model))]
    assert torch.equal(theirs, ours)
    vocab = json.loads((tmp_path / "out" / "vocab.json").read_text())
    assert generation["pad_token_id"] == vocab["<pad>"] == tokenizer.vocab_size and start == BOS
    assert hf.final_logits_bias[0, vocab["<pad>"]] == -float("inf")


def older_layout(checkpoint, folder: Path) -> Path:
    """An export as it was written before: CTranslate2's layout (the decoder starts from the zero `<pad>` row, the
    start vector in the stored first decoder positional row)."""
    from annotated.interop.folders import generation_config
    from annotated.interop.marian import to_marian

    main(["export", str(checkpoint), str(folder)])
    hf = to_marian(load_checkpoint(checkpoint)[0], for_ctranslate2=True)
    hf.generation_config = generation_config(hf.config)
    for name in ("model.safetensors", "annotated.json"):
        (folder / name).unlink()
    hf.save_pretrained(str(folder))
    return folder


def test_an_export_in_the_older_layout_still_imports(checkpoint, tmp_path, capsys):
    """A folder in the older layout imports as the checkpoint; saved again by save_pretrained, it has lost its
    start vector (the stored positional row), and import refuses it with the reason and the fix."""
    folder = older_layout(checkpoint, tmp_path / "old")
    assert json.loads((folder / "config.json").read_text())["decoder_start_token_id"] != BOS
    assert main(["import", str(folder), str(tmp_path / "old.pt")]) == 0
    model, back = load_checkpoint(checkpoint)[0], load_checkpoint(tmp_path / "old.pt")[0]
    mine = model.state_dict()
    assert all(torch.equal(t, mine[k]) for k, t in back.state_dict().items())
    MarianMTModel.from_pretrained(str(folder), local_files_only=True).save_pretrained(str(tmp_path / "again"))
    with pytest.raises(SystemExit) as stop:
        main(["import", str(tmp_path / "again"), str(tmp_path / "x.pt"), "--src", "de", "--tgt", "en"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "no longer holds the start vector" in err and "export the checkpoint again" in err


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
    everything = list((tmp_path / "out").rglob("*"))  # ctranslate2/ and its files too
    modes = {str(f): (f.is_dir(), oct(stat.S_IMODE(f.stat().st_mode))) for f in everything}
    assert set(modes.values()) <= {(False, oct(0o666 & ~umask)), (True, oct(0o777 & ~umask))}, modes


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


def translated(checkpoint: Path, lines: list[str]) -> bytes:
    """What `make translate` prints for `lines` on stdin, with `checkpoint`'s own settings."""
    import io

    from annotated.decoding.translate import main as translator

    out, stdin = io.BytesIO(), io.BytesIO(("\n".join(lines) + "\n").encode("utf-8"))
    assert translator(["--checkpoint", str(checkpoint), "--device", "cpu"], stdin, out, io.StringIO()) == 0
    return out.getvalue()


def test_export_then_import_translates_as_the_checkpoint(checkpoint, tmp_path, data_url):
    """annotated.json carries the length penalty the checkpoint chose and its recasing table, so the shipped model
    exported and imported back translates test sentences byte for byte as the shipped model, lines in capitals
    (recased by the table) included; a chosen penalty other than the paper's comes back too."""
    from annotated.checkpoint import read_case_table, with_meta
    from annotated.decoding.settings import model_length_penalty
    from annotated.shipped import choose_checkpoint
    from annotated.training.data import load_multi30k

    shipped = choose_checkpoint("shipped:de-en")
    assert main(["export", "shipped:de-en", str(tmp_path / "out")]) == 0
    assert main(["import", str(tmp_path / "out"), str(tmp_path / "back.pt")]) == 0
    table = read_case_table(shipped)
    assert table and read_case_table(tmp_path / "back.pt") == table
    pairs = load_multi30k("test_2016_flickr", "de", "en", base_url=data_url)[:20]
    lines = [s for s, _ in pairs] + [s.upper() for s, _ in pairs] + ["ZWEI MÄNNER SPIELEN FUSSBALL IM PARK."]
    assert translated(tmp_path / "back.pt", lines) == translated(shipped, lines)
    with_meta(checkpoint, tmp_path / "alpha.pt", length_penalty=1.7)  # not the paper's 0.6, which is the default
    main(["export", str(tmp_path / "alpha.pt"), str(tmp_path / "alpha")])
    main(["import", str(tmp_path / "alpha"), str(tmp_path / "alpha-back.pt")])
    assert model_length_penalty(load_checkpoint(tmp_path / "alpha-back.pt")[2]) == 1.7
    assert read_case_table(tmp_path / "alpha-back.pt") is None  # the fixture has no table: none comes back


def test_no_card_holds_an_absolute_path(checkpoint, tmp_path, monkeypatch):
    """The card travels: no path of this machine in it, whether the checkpoint was chosen by the commands' rule (no
    CHECKPOINT: here the shipped model), typed as an absolute path, or imported from an absolute folder."""
    import re

    monkeypatch.chdir(tmp_path)  # no runs/ here; the fixture's checkpoint lies outside this folder
    absolute = re.compile(r"(^|[\s`'\"=(])/[^\s/]")
    assert main(["export", "", "fallback"]) == 0
    card = (tmp_path / "fallback" / "README.md").read_text(encoding="utf-8")
    assert "make export CHECKPOINT=shipped:de-en" in card and not absolute.search(card), card
    assert main(["export", str(checkpoint.resolve()), "typed"]) == 0
    card = (tmp_path / "typed" / "README.md").read_text(encoding="utf-8")
    assert f"CHECKPOINT={checkpoint.parent.name}/{checkpoint.name}`" in card and not absolute.search(card), card
    assert main(["import", str((tmp_path / "typed").resolve()), "back.pt"]) == 0
    assert main(["export", "back.pt", "again"]) == 0
    card = (tmp_path / "again" / "README.md").read_text(encoding="utf-8")
    assert "imported from typed)" in card and not absolute.search(card), card


def test_a_damaged_side_file_is_refused_in_one_line(checkpoint, tmp_path, capsys):
    """annotated.json that is not JSON, or not the export's, is refused naming the file and the fix."""
    main(["export", str(checkpoint), str(tmp_path / "out")])
    for text in ("{", json.dumps({"format": "annotated-export-v1", "length_penalty": "0.6", "casing": None})):
        (tmp_path / "out" / "annotated.json").write_text(text)
        capsys.readouterr()
        with pytest.raises(SystemExit) as stop:
            main(["import", str(tmp_path / "out"), str(tmp_path / "x.pt")])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and len(err.strip().splitlines()) == 1 and "annotated.json" in err
        assert "export the checkpoint again, or delete it" in err
