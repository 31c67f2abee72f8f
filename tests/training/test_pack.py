"""annotated/training/pack.py: a run's model packed for the box, and its card."""

import hashlib
import json

import pytest
import torch
from tiny_box import PAIRS, make_run

from annotated.checkpoint import atomic_torch_save, load_checkpoint, read_checkpoint, with_meta
from annotated.training.config import PRESETS, config_dict
from annotated.training.evaluate import evaluate_bleu
from annotated.training.pack import PackError, compact_state, generate_note, main, pack, training_command


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """(run folder, model file, card) of a tiny de-en run packed into its own box."""
    root = tmp_path_factory.mktemp("pack")
    run = make_run(root / "run")
    model, card = pack(run, root / "box", pairs=PAIRS["de-en"], say=lambda line: None)
    return run, model, json.loads(card.read_text())


def test_the_packed_weights_are_the_float16_rounding_of_the_run_model_and_load_as_float32(packed):
    run, model_file, _ = packed
    original = read_checkpoint(run / "best.pt")
    stored = read_checkpoint(model_file)
    assert {t.dtype for t in stored["model"].values()} == {torch.float16}
    loaded, _tok, _meta = load_checkpoint(model_file)
    for name, weight in loaded.state_dict().items():
        assert weight.dtype == torch.float32
        assert torch.equal(weight, original["model"][name].half().float()), name
    assert stored["tokenizer"] == original["tokenizer"] and stored["casing"] == original["casing"]


def test_the_packed_file_keeps_tied_weights_once_and_no_training_state_or_local_paths(packed):
    run, model_file, _ = packed
    stored = read_checkpoint(model_file)
    tied = {
        stored["model"][k].untyped_storage().data_ptr()
        for k in ("src_embed.weight", "tgt_embed.weight", "generator.weight")
    }
    assert len(tied) == 1  # one table on disk, as in the model
    assert not {"optimizer", "run_state"} & stored.keys()
    assert str(run) not in json.dumps(stored["meta"]) and stored["meta"]["averaged"] == ["epoch1.pt", "epoch2.pt"]
    assert model_file.stat().st_size < (run / "best.pt").stat().st_size


def test_the_card_names_the_file_its_sha256_how_it_was_made_and_what_it_learnt_from(packed):
    run, model_file, card = packed
    assert card["sha256"] == hashlib.sha256(model_file.read_bytes()).hexdigest()
    assert card["bytes"] == model_file.stat().st_size and card["file"] == "de-en.pt"
    made = card["made"]
    assert (
        made["command"] == "python train_wmt.py --preset smoke --src de --tgt en --seed 0 --precision fp32 --threads 1"
    )
    results = json.loads((run / "results.json").read_text())
    assert made["packages"] == results["environment"]["packages"] and made["commit"] == results["environment"]["commit"]
    assert (made["seed"], made["steps"], made["precision"], made["threads"]) == (0, 28, "fp32", 1)
    assert "Multi30k" in card["trained_on"] and "out of its domain" in card["trained_on"]
    assert card["scores"]["run_model_float32"] == {
        "bleu": 1.5,
        "bleu_lowercase": 2.5,
        "chrf": 3.5,
        "beam": 2,
        "sentences": 20,
    }


def test_the_card_of_a_run_that_averaged_gives_averaged_pts_scores(tmp_path):
    """A run with best.pt and averaged.pt, each with its own test scores in results.json (best first, as a run
    writes them): the run's model is averaged.pt, and its card names it and gives its float32 scores, not
    best.pt's."""
    run = make_run(tmp_path / "run")
    state = read_checkpoint(run / "best.pt")
    state["model"] = {k: v / 2 if v.is_floating_point() else v for k, v in state["model"].items()}
    atomic_torch_save(state, run / "averaged.pt")
    results = json.loads((run / "results.json").read_text())
    beam = {"bleu": 7.5, "bleu_lowercase": 8.5, "chrf": 9.5, "beam_size": 2, "sentences": 20}
    results["test"]["averaged"] = {"checkpoint": str(run / "averaged.pt"), "beam": beam}
    (run / "results.json").write_text(json.dumps(results))
    model_file, card_file = pack(run, tmp_path / "box", pairs=PAIRS["de-en"], say=lambda line: None)
    card = json.loads(card_file.read_text())
    assert card["made"]["model"].startswith("averaged.pt")
    assert card["scores"]["run_model_float32"] == {
        "bleu": 7.5,
        "bleu_lowercase": 8.5,
        "chrf": 9.5,
        "beam": 2,
        "sentences": 20,
    }
    weight = read_checkpoint(model_file)["model"]["src_embed.weight"]
    assert torch.equal(weight, state["model"]["src_embed.weight"].half())  # averaged.pt's weights were packed


def test_the_card_scores_are_those_of_the_packed_model_as_loaded(packed):
    _, model_file, card = packed
    model, tok, _ = load_checkpoint(model_file)
    scores, _ = evaluate_bleu(model, tok, PAIRS["de-en"], 4, 0.6)
    assert {k: card["scores"]["test"][k] for k in ("bleu", "bleu_lowercase", "chrf")} == {
        k: scores[k] for k in ("bleu", "bleu_lowercase", "chrf")
    }
    assert card["scores"]["test"]["sentences"] == len(PAIRS["de-en"]) and card["scores"]["beam"] == 4


def test_the_card_records_the_runs_length_penalty_as_its_results_do(packed, tmp_path):
    """A run that chose its alpha on validation: the packed model carries it, is scored at it, and the card's
    `length_penalty` is the run's record with what transformers' generate can do of it. A run with none: 0.6,
    from the checkpoint's meta."""
    _, _, card = packed
    assert card["scores"]["length_penalty"] == 0.6 and card["length_penalty"]["chosen"] == 0.6
    assert card["length_penalty"]["chosen_on"] == "the checkpoint's meta"
    run = make_run(tmp_path / "run")
    record = {"chosen": 3.0, "chosen_on": "validation (20 sentences)", "validation_bleu": {"0.6": 1.0, "3": 2.0}}
    results = json.loads((run / "results.json").read_text())
    (run / "results.json").write_text(json.dumps(dict(results, length_penalty=record)))
    with_meta(run / "best.pt", run / "best.pt", length_penalty=3.0)
    model_file, card_file = pack(run, tmp_path / "box", pairs=PAIRS["de-en"], say=lambda line: None)
    card = json.loads(card_file.read_text())
    assert read_checkpoint(model_file)["meta"]["length_penalty"] == 3.0 == card["scores"]["length_penalty"]
    assert card["length_penalty"] == dict(record, transformers=generate_note(3.0))
    assert "alpha 3 does" in card["length_penalty"]["transformers"]
    model, tok, _ = load_checkpoint(model_file)
    assert card["scores"]["test"]["bleu"] == evaluate_bleu(model, tok, PAIRS["de-en"], 4, 3.0)[0]["bleu"]


def test_packing_again_replaces_nothing_without_force(packed, capsys):
    run, model_file, _ = packed
    before = model_file.read_bytes()
    assert main([str(run), "--out", str(model_file.parent)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pack: error: ") and "--force" in err and len(err.splitlines()) == 1
    assert model_file.read_bytes() == before


def test_an_unfinished_run_is_refused(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    assert main([str(tmp_path / "run"), "--out", str(tmp_path / "box")]) == 2
    assert "results.json is missing" in capsys.readouterr().err and not (tmp_path / "box").exists()


def test_the_training_command_is_the_preset_and_what_the_run_resolved():
    results = {
        "train_config": config_dict(
            PRESETS["cpu"].__class__(**{**PRESETS["cpu"].__dict__, "src_lang": "en", "tgt_lang": "de"})
        ),
        "precision": "fp32",
        "threads": 1,
    }
    assert (
        training_command(results)
        == "python train_wmt.py --preset cpu --src en --tgt de --seed 0 --precision fp32 --threads 1"
    )
    results["train_config"]["max_steps"] = 8400  # no preset's budget: the preset, and the option that changes it
    assert training_command(results) == (
        "python train_wmt.py --preset cpu --src en --tgt de --max-steps 8400 --seed 0 --precision fp32 --threads 1"
    )
    results["train_config"]["test_sentences"] = 20  # no option sets it: the packer cannot write the command
    with pytest.raises(PackError, match="--command"):
        training_command(results)


@pytest.mark.parametrize(
    "changes",
    [
        {"max_steps": 4200, "lr_factor": 2.0, "length_penalty": 0.6},  # the shipped models' recipe
        {"length_penalty": None, "attention_dropout": None, "dropout": 0.3, "d_model": 256, "vocab_size": 8000},
        {"compile": True, "label_smoothing": 0.05, "warmup": 900, "cooldown": 0.0, "average_last": 0},
    ],
)
@pytest.mark.parametrize("preset", ["cpu", "gpu"])
def test_the_training_command_trains_the_same_settings_again(preset, changes):
    """`train_wmt.py`, given the packed command's options, builds exactly the run's settings."""
    import shlex

    import train_wmt
    from annotated.training.config import with_settings

    cfg = with_settings(PRESETS[preset], {**changes, "src_lang": "en", "tgt_lang": "de", "seed": 3})
    command = training_command({"train_config": config_dict(cfg), "precision": "bf16", "threads": 2})
    argv = shlex.split(command)[2:]
    assert argv[argv.index("--precision") + 1] == "bf16"
    argv[argv.index("--precision") + 1] = "auto"  # the run asked for auto; the command names what it resolved to
    assert train_wmt.config_from_args(train_wmt.parse_args(argv), cuda=False)[1] == cfg, command


def test_the_box_keeps_the_length_penalty_its_run_chose():
    """The packed meta keeps `length_penalty`, so the translator decodes a shipped model at its run's alpha."""
    from annotated.decoding.settings import model_length_penalty

    state = {
        "config": {},
        "model": {"w": torch.tensor([1.0])},
        "meta": {"src_lang": "de", "length_penalty": 4.0, "optimizer_path": "/home/x/run"},
    }
    meta = compact_state(state)["meta"]
    assert meta == {"src_lang": "de", "length_penalty": 4.0, "weights": "float16 on disk, float32 when loaded"}
    assert model_length_penalty(meta) == 4.0


def test_a_weight_beyond_float16_is_refused():
    state = {"config": {}, "model": {"w": torch.tensor([1.0, 1e6])}, "meta": {}}
    with pytest.raises(PackError, match="float16"):
        compact_state(state)
