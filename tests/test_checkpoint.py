"""annotated/checkpoint.py: round trip, atomic writes, clear errors."""

import os
import stat

import pytest
import torch

from annotated.checkpoint import (
    CheckpointError,
    add_case_table,
    atomic_torch_save,
    load_checkpoint,
    read_case_table,
    read_checkpoint,
    save_checkpoint,
)
from annotated.transformer import make_model


def tiny_model(**kw):
    torch.manual_seed(0)
    return make_model(**dict(dict(src_vocab=11, tgt_vocab=11, N=1, d_model=8, d_ff=16, h=2), **kw))


def test_round_trip_restores_config_and_parameters(tmp_path):
    m = tiny_model(attention="per_head", norm="pre")
    save_checkpoint(tmp_path / "a.pt", m, None, {"src_lang": "de"})
    back, tok, meta = load_checkpoint(tmp_path / "a.pt")
    assert back.config == m.config and tok is None and meta == {"src_lang": "de"}
    assert not back.training
    for (n1, p1), (n2, p2) in zip(m.state_dict().items(), back.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)


def test_the_case_table_is_stored_as_one_text_and_read_back_whole(tmp_path):
    """Written as one JSON string (by save_checkpoint and add_case_table), read back as the same dict; a table
    stored as a dict (older checkpoints) still reads; a damaged text is refused with the file named."""
    table = {"hund": "Hund", "über": "über", "new york": "New York"}
    save_checkpoint(tmp_path / "a.pt", tiny_model(), None, casing=table)
    assert isinstance(torch.load(tmp_path / "a.pt", weights_only=True)["casing"], str)
    assert read_case_table(tmp_path / "a.pt") == table
    add_case_table(tmp_path / "a.pt", tmp_path / "b.pt", {"katze": "Katze"})
    assert isinstance(torch.load(tmp_path / "b.pt", weights_only=True)["casing"], str)
    assert read_case_table(tmp_path / "b.pt") == {"katze": "Katze"}
    state = torch.load(tmp_path / "a.pt", weights_only=True)
    atomic_torch_save(dict(state, casing=table), tmp_path / "old.pt")
    assert read_case_table(tmp_path / "old.pt") == table
    atomic_torch_save(dict(state, casing='{"hund": '), tmp_path / "bad.pt")
    with pytest.raises(CheckpointError, match=r"bad\.pt: its case table is not valid JSON"):
        read_case_table(tmp_path / "bad.pt")
    atomic_torch_save(dict(state, casing='["Hund"]'), tmp_path / "list.pt")
    with pytest.raises(CheckpointError, match=r"list\.pt: its case table is not a dict of words"):
        read_case_table(tmp_path / "list.pt")


def test_missing_truncated_and_foreign_files_name_the_file(tmp_path):
    with pytest.raises(CheckpointError, match=r"nope\.pt: no such file"):
        load_checkpoint(tmp_path / "nope.pt")
    save_checkpoint(tmp_path / "a.pt", tiny_model(), None)
    data = (tmp_path / "a.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"cut\.pt is corrupt"):
        load_checkpoint(tmp_path / "cut.pt")
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match=r"other\.pt is not an annotated checkpoint"):
        load_checkpoint(tmp_path / "other.pt")


def test_parameters_that_do_not_fit_the_config_are_reported(tmp_path):
    save_checkpoint(tmp_path / "a.pt", tiny_model(), None)
    state = read_checkpoint(tmp_path / "a.pt")
    state["config"]["d_ff"] = 32
    torch.save(state, tmp_path / "b.pt")
    with pytest.raises(CheckpointError, match=r"b\.pt: parameters do not match its config"):
        load_checkpoint(tmp_path / "b.pt")


def test_failed_write_keeps_the_previous_file(tmp_path):
    path = tmp_path / "a.pt"
    save_checkpoint(path, tiny_model(), None, {"version": 1})

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("boom in the middle of the write")

    with pytest.raises(RuntimeError, match="boom"):
        atomic_torch_save({"format": "x", "big": torch.zeros(1000), "bad": Unpicklable()}, path)
    assert load_checkpoint(path)[2] == {"version": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pt"]  # no temporary file left


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_checkpoints_get_the_mode_a_plain_open_would_give(tmp_path, umask):
    """Written through a private temporary file, but renamed into place with 0o666 less the umask."""
    old = os.umask(umask)
    try:
        save_checkpoint(tmp_path / "a.pt", tiny_model(), None)
        with open(tmp_path / "plain", "w"):
            pass
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.pt").stat().st_mode) == stat.S_IMODE((tmp_path / "plain").stat().st_mode)
    assert stat.S_IMODE((tmp_path / "a.pt").stat().st_mode) == 0o666 & ~umask


CRAFTED = {  # config change -> what the one-line error says
    "huge vocabulary": (
        {"src_vocab": 10_000_000, "tgt_vocab": 10_000_000, "d_model": 4096},
        "parameters do not match its config",
    ),
    "forty layers": ({"N": 40}, "the config needs decoder.layers.1."),
    "a layer per tensor and more": ({"N": 10_000}, "N=10000 is more than"),
    "max_len NaN": ({"max_len": float("nan")}, "max_len must be a whole number >= 1, got nan"),
    "max_len huge": ({"max_len": 10**9}, "max_len=1000000000 is more than 65536"),
    "dropout 2": ({"dropout": 2.0}, "dropout must be a number in [0, 1)"),
    "d_model a string": ({"d_model": "8"}, "d_model must be a whole number >= 1, got '8'"),
    "layers as a bool": ({"N": True}, "N must be a whole number >= 1, got True"),
    "negative d_ff": ({"d_ff": -16}, "d_ff must be a whole number >= 1"),
    "unknown field": ({"flux": 1}, "unknown fields ['flux']"),
    "no vocabulary": ({"src_vocab": None}, "src_vocab must be a whole number >= 1, got None"),
    "wider feed-forward": ({"d_ff": 32}, "parameters do not match its config: decoder.layers.0"),
}
EXTRA_TENSOR = "an extra entry with a number for a name"


@pytest.mark.parametrize("case", [*CRAFTED, EXTRA_TENSOR])
def test_a_crafted_config_is_refused_before_anything_is_built(case, tmp_path, monkeypatch):
    """A config that passes weights_only loading but asks for a model its tensors are not: one clear error,
    and no model is built (only shapes are worked out, on the meta device)."""
    from annotated import checkpoint

    save_checkpoint(tmp_path / "a.pt", tiny_model(), None)
    state = read_checkpoint(tmp_path / "a.pt")
    if case == EXTRA_TENSOR:
        change, message = {}, "the file holds 7, which the config does not make"
        state["model"][7] = torch.zeros(1)
    else:
        change, message = CRAFTED[case]
    state["config"].update(change)
    torch.save(state, tmp_path / "crafted.pt")
    real_builds = []

    def spy(*args, **kwargs):
        if torch.empty(0).device.type != "meta":
            real_builds.append(case)
            raise AssertionError("a model was built before its config was checked")
        return make_model(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "make_model", spy)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path / "crafted.pt")
    assert message in str(e.value) and "crafted.pt" in str(e.value) and "\n" not in str(e.value)
    assert real_builds == []


class Anything:
    """Any class: weights_only loading refuses to rebuild it."""


def test_a_folder_or_a_file_with_code_is_refused_without_the_unsafe_hint(tmp_path, capsys):
    from annotated.decoding import translate

    torch.save({"format": "annotated-checkpoint-v1", "config": {}, "model": {}, "x": Anything()}, tmp_path / "code.pt")
    for path, message in ((tmp_path, "is a directory"), (tmp_path / "code.pt", "holds Python objects")):
        assert translate.main(["--checkpoint", str(path), "Hallo"]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
        assert "weights_only" not in err and "can still be loaded" not in err


@pytest.mark.parametrize("command", ["add_case_table", "choose_length_penalty"])
@pytest.mark.parametrize("meta", [{}, {"src_lang": "de"}, {"src_lang": "", "tgt_lang": "en"}])
def test_a_command_refuses_a_model_without_a_language_pair_in_one_line(command, meta, tmp_path, capsys):
    """`languages_of` is the one check of a checkpoint's pair: a command that reads Multi30k in it refuses a model
    that names none in one line with the fix, and writes nothing."""
    import importlib

    main = importlib.import_module(f"annotated.training.{command}").main
    save_checkpoint(tmp_path / "m.pt", make_model(src_vocab=8, tgt_vocab=8, N=1, d_model=8, d_ff=8, h=2), None, meta)
    with pytest.raises(SystemExit) as stop:
        main(["--checkpoint", str(tmp_path / "m.pt"), "--out", str(tmp_path / "new.pt")])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert "names no language pair" in err and "ARGS='--src de --tgt en'" in err
    assert not (tmp_path / "new.pt").exists()
