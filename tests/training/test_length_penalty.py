"""The beam search's length penalty chosen on validation data: the choice (annotated/training/evaluate.py), a run
that makes it (annotated/training/results.py), the setting's option (train_wmt.py) and the command for an older
checkpoint (annotated/training/choose_length_penalty.py)."""

import dataclasses
import json

import pytest
import torch

import train_wmt
from annotated.checkpoint import load_checkpoint, read_checkpoint, save_checkpoint
from annotated.decoding.settings import PAPER_LENGTH_PENALTY, model_length_penalty
from annotated.training import choose_length_penalty as command
from annotated.training import evaluate, results, train


def fake_scores(monkeypatch, bleu_at: dict) -> list:
    """evaluate_bleu replaced by a table: {alpha: BLEU}; returns the list of (pairs, beam, alpha) it was asked."""
    asked = []

    def fake(model, tokenizer, pairs, beam_size, length_penalty, device=None, progress=False):
        asked.append((len(pairs), beam_size, length_penalty))
        return {"bleu": bleu_at[length_penalty]}, []

    monkeypatch.setattr(evaluate, "evaluate_bleu", fake)
    return asked


@pytest.mark.parametrize(
    "bleu_at, want",
    [
        ({0.6: 10.0, 1.0: 12.5, 2.0: 13.0, 3.0: 12.0, 4.0: 11.0}, 2.0),  # the highest
        ({0.6: 10.0, 1.0: 13.0, 2.0: 12.0, 3.0: 13.0, 4.0: 13.0}, 1.0),  # a tie: the smallest of the tied
        ({0.6: 20.0, 1.0: 13.0, 2.0: 12.0, 3.0: 13.0, 4.0: 19.99}, 0.6),  # the first candidate
        ({0.6: 1.0, 1.0: 2.0, 2.0: 3.0, 3.0: 4.0, 4.0: 4.01}, 4.0),  # the last
    ],
)
def test_the_choice_is_the_highest_validation_bleu_and_a_tie_goes_to_the_smaller_alpha(monkeypatch, bleu_at, want):
    asked = fake_scores(monkeypatch, bleu_at)
    pairs = [("ein hund", "a dog")] * 3
    alpha, table = evaluate.choose_length_penalty(None, None, pairs, beam_size=4)
    assert alpha == want and table == bleu_at
    assert asked == [(3, 4, a) for a in evaluate.LENGTH_PENALTIES]  # every candidate, on every pair given
    assert evaluate.LENGTH_PENALTIES[0] == PAPER_LENGTH_PENALTY == 0.6  # the paper's is a candidate


def test_choosing_without_validation_pairs_is_refused():
    with pytest.raises(ValueError, match="needs validation pairs"):
        evaluate.choose_length_penalty(None, None, [], beam_size=4)


def test_a_checkpoints_length_penalty_is_its_meta_else_the_papers():
    assert model_length_penalty({"length_penalty": 3.0}) == 3.0 and model_length_penalty({"length_penalty": 2}) == 2.0
    assert model_length_penalty({}) == model_length_penalty({"length_penalty": None}) == 0.6
    for bad in (-1.0, float("inf"), float("nan"), "4", True):
        with pytest.raises(ValueError, match="length_penalty must be a finite number >= 0"):
            model_length_penalty({"length_penalty": bad})


FORCED = 3.0  # the alpha the run is told it chose: not the settings' or the paper's, so a test BLEU at it is telling


def test_a_run_chooses_its_length_penalty_on_validation_and_scores_the_test_set_with_it(
    tmp_path, monkeypatch, data_url, cache
):
    """A smoke run with `length_penalty=None`: the choice is made once, on the whole validation split, with the
    run's model; results.json records it and its table; the tested checkpoint's meta names it; the beam test
    BLEU is the test set translated at it. The real choice runs (on the first 100 of the pairs it is given, over
    two alphas, to keep the test short); its winner is replaced by FORCED, an alpha no default would give, so that
    the test BLEU tells which alpha was used."""
    from annotated.training.data import load_multi30k

    calls = []

    def choose(model, tokenizer, val_pairs, beam_size, **kwargs):
        alpha, table = evaluate.choose_length_penalty(
            model, tokenizer, val_pairs[:100], beam_size, candidates=(0.6, FORCED), **kwargs
        )
        calls.append((model.state_dict(), len(val_pairs), beam_size, alpha, table))
        return FORCED, table

    monkeypatch.setattr(results, "choose_length_penalty", choose)
    cfg = dataclasses.replace(train.PRESETS["smoke"], length_penalty=None)
    run, lines = tmp_path / "run", []
    train.train(cfg, run, source=train.DataSource(data_url, cache), progress=False, log=lines.append)

    val = load_multi30k("val", "de", "en", cache_dir=cache, base_url=data_url)
    [(weights, n_val, beam, _, table)] = calls
    best, tok, meta = load_checkpoint(run / "best.pt")
    assert n_val == len(val) == 1014 and beam == cfg.beam_size
    assert all(torch.equal(weights[k], v) for k, v in best.state_dict().items())  # the run's model (no averaging)
    on_disk = json.loads((run / "results.json").read_text())
    assert on_disk["length_penalty"] == {
        "chosen": FORCED,
        "chosen_on": "validation (1014 sentences)",
        "validation_bleu": {f"{a:g}": b for a, b in table.items()},
    }
    assert meta["length_penalty"] == FORCED and model_length_penalty(meta) == FORCED
    assert read_checkpoint(run / "last.pt")["meta"].get("length_penalty") is None  # only the tested checkpoints
    test = load_multi30k("test_2016_flickr", "de", "en", cache_dir=cache, base_url=data_url)[: cfg.test_sentences]
    at_forced, hyps = evaluate.evaluate_bleu(best, tok, test, cfg.beam_size, FORCED)
    _, paper_hyps = evaluate.evaluate_bleu(best, tok, test, cfg.beam_size, PAPER_LENGTH_PENALTY)
    assert hyps != paper_hyps  # the two alphas translate differently, so the scores below tell them apart
    beam = on_disk["test"]["best"]["beam"]
    assert beam["length_penalty"] == FORCED and beam["bleu"] == at_forced["bleu"]
    assert beam["chrf"] == at_forced["chrf"]
    assert [s["beam"] for s in on_disk["samples"]] == hyps[:5]
    [said] = [line for line in lines if line.startswith("length penalty:")]
    assert said.startswith(f"length penalty: alpha {FORCED:g}, ") and "1014 validation sentences" in said


def test_a_fixed_length_penalty_is_used_as_it_is_and_no_checkpoint_is_rewritten(monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("a fixed length penalty is not chosen on validation")

    monkeypatch.setattr(results, "choose_length_penalty", never)
    cfg = train.PRESETS["smoke"]
    assert cfg.length_penalty == 0.6
    assert results.length_penalty_of_run(cfg, {}, None, None, None, print, False) == {
        "chosen": 0.6,
        "chosen_on": "the settings",
    }
    assert train.PRESETS["gpu"].length_penalty == 0.6  # the default; the cpu preset chooses it on validation
    assert train.PRESETS["cpu"].length_penalty is None


@pytest.mark.parametrize("given, want", [("validation", None), ("0.6", 0.6), ("4", 4.0), ("0", 0.0)])
def test_the_length_penalty_option_takes_a_number_or_validation(given, want):
    args = train_wmt.parse_args(["--preset", "smoke", "--length-penalty", given])
    assert train_wmt.config_from_args(args, cuda=False)[1].length_penalty == want
    assert train_wmt.config_from_args(train_wmt.parse_args(["--preset", "gpu"]), cuda=False)[1].length_penalty == 0.6


@pytest.mark.parametrize("given", ["bad", "-1", "inf", "nan", "Validation"])
def test_a_bad_length_penalty_option_is_one_line_naming_both_forms(given, capsys):
    with pytest.raises(SystemExit) as stop:
        train_wmt.parse_args(["--length-penalty", given])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1, err
    assert f"argument --length-penalty: must be a finite number >= 0 or 'validation', got {given!r}" in err, err


def test_the_command_writes_a_copy_with_the_validation_choice_and_never_overwrites(
    tmp_path, monkeypatch, data_url, capsys
):
    """`python -m annotated.training.choose_length_penalty`: the choice on Multi30k val (faked scores: the pairs
    asked for are the whole split), a new file with it in the meta, the old one unchanged; an existing --out is
    refused without --force and replaced with it."""
    from annotated.transformer import make_model

    monkeypatch.setenv("MULTI30K_URL", data_url)
    asked = fake_scores(monkeypatch, {0.6: 30.0, 1.0: 31.0, 2.0: 33.0, 3.0: 32.0, 4.0: 31.5})
    old, new = tmp_path / "old.pt", tmp_path / "new.pt"
    save_checkpoint(
        old,
        make_model(src_vocab=8, tgt_vocab=8, N=1, d_model=8, d_ff=8, h=2),
        None,
        {"src_lang": "de", "tgt_lang": "en", "epoch": 7},
    )
    before = old.read_bytes()
    assert command.main(["--checkpoint", str(old), "--out", str(new)]) == 0
    assert old.read_bytes() == before
    assert read_checkpoint(new)["meta"] == {"src_lang": "de", "tgt_lang": "en", "epoch": 7, "length_penalty": 2.0}
    assert {n for n, _, _ in asked} == {1014} and "with length penalty 2, " in capsys.readouterr().out
    new_bytes = new.read_bytes()
    with pytest.raises(SystemExit) as stop:
        command.main(["--checkpoint", str(old), "--out", str(new)])
    assert stop.value.code == 2 and "exists; add --force to replace it, or name a new file" in capsys.readouterr().err
    assert new.read_bytes() == new_bytes
    with pytest.raises(SystemExit):
        command.main(["--checkpoint", str(old), "--out", str(old)])
    assert old.read_bytes() == before
    assert command.main(["--checkpoint", str(old), "--out", str(old), "--force"]) == 0
    assert read_checkpoint(old)["meta"]["length_penalty"] == 2.0


def test_a_run_that_averages_chooses_its_length_penalty_with_averaged_pt_not_best_pt(tmp_path, monkeypatch):
    """A run with average_last=2 and length_penalty None: its model is averaged.pt (the mean of epoch1.pt and
    epoch2.pt, written by `score_test_set`), and best.pt is another model on which another alpha wins. The scores
    are a table per model (told apart by their weights, each checkpoint's parameters all one number), so the alpha
    the run records is the one averaged.pt's validation scores give, and only averaged.pt is scored on them."""
    from annotated.transformer import make_model

    def checkpoint(path, weight, **state):
        model = make_model(src_vocab=8, tgt_vocab=8, N=1, d_model=8, d_ff=8, h=2)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(weight)
        save_checkpoint(path, model, None, {"src_lang": "de", "tgt_lang": "en"}, **state)

    run = tmp_path / "run"
    run.mkdir()
    checkpoint(run / "epoch1.pt", 1.0)
    checkpoint(run / "epoch2.pt", 3.0)  # averaged.pt: every parameter 2.0 (exact in float32)
    checkpoint(run / "best.pt", 3.0)
    checkpoint(run / "last.pt", 3.0, run_state={"step": 28, "history": []})
    validation = {  # {model's weight: {alpha: validation BLEU}}: each model's own winner
        2.0: {0.6: 10.0, 1.0: 11.0, 2.0: 14.0, 3.0: 12.0, 4.0: 9.0},
        3.0: {0.6: 10.0, 1.0: 15.0, 2.0: 12.0, 3.0: 11.0, 4.0: 9.0},
    }
    val_pairs, test_pairs = [("ein hund", "a dog")] * 5, [("eine katze", "a cat")] * 3
    scored_on_validation = []

    def fake(model, tokenizer, pairs, beam_size, length_penalty, device=None, progress=False):
        weight = next(model.parameters()).detach().flatten()[0].item()
        if pairs is val_pairs:
            scored_on_validation.append(weight)
            return {"bleu": validation[weight][length_penalty]}, []
        return {"bleu": 1.0, "bleu_lowercase": 1.0, "chrf": 1.0}, ["a"] * len(pairs)

    monkeypatch.setattr(evaluate, "evaluate_bleu", fake)
    monkeypatch.setattr(results, "evaluate_bleu", fake)
    cfg = dataclasses.replace(train.PRESETS["smoke"], length_penalty=None, average_last=2)
    arithmetic = results.Arithmetic("fp32", "fp32 asked for", 1)
    done = results.score_test_set(
        cfg,
        run,
        None,
        test_pairs,
        torch.device("cpu"),
        lambda line: None,
        arithmetic,
        progress=False,
        val_pairs=val_pairs,
        started_in={"python": "3"},
    )
    assert set(done["test"]) == {"best", "averaged"}
    assert scored_on_validation == [2.0] * len(evaluate.LENGTH_PENALTIES)  # averaged.pt, at each alpha
    assert done["length_penalty"]["chosen"] == 2.0  # averaged.pt's winner (best.pt's is 1.0)
    assert done["length_penalty"]["validation_bleu"] == {f"{a:g}": b for a, b in validation[2.0].items()}
    assert read_checkpoint(run / "averaged.pt")["meta"]["length_penalty"] == 2.0
    assert read_checkpoint(run / "best.pt")["meta"]["length_penalty"] == 2.0  # the run's choice, for both


def test_the_commands_beam_is_the_beam_the_search_translates_with(tmp_path, monkeypatch, data_url, cache, capsys):
    """`--beam N` reaches the beam search itself (`translate_ids`, recorded here instead of translating) at every
    alpha, on the whole validation split, and the printed line names it: not the default 4."""
    from annotated.decoding import search
    from annotated.training.data import train_tokenizer
    from annotated.transformer import make_model

    beam, asked = 3, []

    def record(model, sources, beam_size=1, length_penalty=0.6, **kwargs):
        asked.append((len(sources), beam_size, length_penalty))
        return [[] for _ in sources]

    monkeypatch.setattr(search, "translate_ids", record)
    monkeypatch.setenv("MULTI30K_URL", data_url)
    tok = train_tokenizer(["Ein Hund rennt.", "A dog runs.", "Zwei Männer.", "Two men."] * 4, 290, cache_dir=cache)
    old, new = tmp_path / "old.pt", tmp_path / "new.pt"
    model = make_model(src_vocab=tok.vocab_size, tgt_vocab=tok.vocab_size, N=1, d_model=8, d_ff=8, h=2)
    save_checkpoint(old, model, tok, {"src_lang": "de", "tgt_lang": "en"})
    assert command.main(["--checkpoint", str(old), "--out", str(new), "--beam", str(beam)]) == 0
    assert asked == [(1014, beam, alpha) for alpha in evaluate.LENGTH_PENALTIES]
    assert f", the best beam {beam} BLEU on the 1014 Multi30k validation sentences" in capsys.readouterr().out
