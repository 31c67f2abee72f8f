"""train_wmt.py's command line and run folder: bad options refused before any work, the user's files untouched."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train_wmt
from annotated.training import train
from annotated.training.config import flag as option_flag
from annotated.training.config import setting

ROOT = Path(__file__).resolve().parents[2]
SMOKE = dataclasses.replace(train.PRESETS["smoke"], test_sentences=2, val_bleu_sentences=2, max_steps=2)


def quiet(data_url, cache):
    return dict(source=train.DataSource(data_url, cache), progress=False, log=lambda s: None)


BAD_OPTIONS = [
    (["--beam-size", "0"], "argument --beam-size: must be a whole number >= 1, got '0'"),
    (["--beam-size", "-2"], "argument --beam-size: must be a whole number >= 1, got '-2'"),
    (["--beam-size", "two"], "argument --beam-size: must be a whole number >= 1, got 'two'"),
    (["--val-bleu-sentences", "0"], "argument --val-bleu-sentences: must be a whole number >= 1"),
    (["--val-bleu-sentences", "-5"], "argument --val-bleu-sentences: must be a whole number >= 1"),
    (["--max-steps", "0"], "argument --max-steps: must be a whole number >= 1"),
    (["--max-steps", "-3"], "argument --max-steps: must be a whole number >= 1"),
    (["--max-minutes", "-1"], "argument --max-minutes: must be a finite number > 0, got '-1'"),
    (["--max-minutes", "0"], "argument --max-minutes: must be a finite number > 0, got '0'"),
    (["--max-minutes", "nan"], "argument --max-minutes: must be a finite number > 0, got 'nan'"),
    (["--threads", "-1"], "argument --threads: must be a whole number >= 1"),
    (["--dump-attention", "-1"], "argument --dump-attention: must be a whole number >= 0, got '-1'"),
    (["--log-every", "0"], "argument --log-every: must be a whole number >= 1"),
    (["--device", "tpu"], "argument --device: must be cpu, cuda or cuda:N"),
    (
        ["--device", "meta"],
        "argument --device: must be cpu, cuda or cuda:N (cuda only where CUDA is available), got 'meta'",
    ),
    (["--resume"], "--resume needs --run-dir"),
]


@pytest.mark.parametrize("option, message", BAD_OPTIONS, ids=[" ".join(o) for o, _ in BAD_OPTIONS])
def test_bad_options_one_line_exit_2_before_any_work(option, message, tmp_path, capsys, monkeypatch):
    """Each is refused with one stderr line and exit 2, before data or model work (no data URL could be read: the
    data URL points nowhere, and the run folder is never made)."""
    monkeypatch.chdir(tmp_path)
    run_dir = [] if option == ["--resume"] else ["--run-dir", str(tmp_path / "run")]
    args = ["--preset", "smoke", "--data-url", "file:///nonexistent/", *run_dir, *option]
    try:
        code = train_wmt.main(args)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("train: error: ") and err.count("\n") == 1, err
    assert message in err, err
    assert not (tmp_path / "run").exists() and list(tmp_path.iterdir()) == []


def test_cuda_without_cuda_and_an_unwritable_cache_are_refused(tmp_path, capsys):
    """Checked while the options are read: one line naming the option, exit 2, no run folder."""
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    cases = []
    if not os.access(locked, os.W_OK):  # (root can write anywhere)
        cases.append(
            (
                ["--cache-dir", str(locked / "cache")],
                f"argument --cache-dir: '{locked / 'cache'}': {locked} is not writable",
            )
        )
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], "argument --device: 'cuda' asked for, but CUDA is not available here"))
    for option, message in cases:
        with pytest.raises(SystemExit) as stop:
            train_wmt.main(["--preset", "smoke", "--run-dir", str(tmp_path / "run"), *option])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and err.startswith("train: error: "), err
        assert message in err and err.count("\n") == 1 and not (tmp_path / "run").exists(), err


def test_a_bad_option_in_a_real_process_has_no_traceback(tmp_path):
    r = subprocess.run(
        [sys.executable, str(ROOT / "train_wmt.py"), "--max-minutes", "nan"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


# --- the run folder --------------------------------------------------------------------------------------


def test_a_users_latest_file_or_folder_is_left_alone(tmp_path, monkeypatch, data_url, cache):
    """runs/latest is replaced only when it is our link; a file or folder of that name stays as it was, and no
    stray `.latest.*` is left in runs/."""
    for where in ("a", "b", "c"):
        (tmp_path / where / "runs").mkdir(parents=True)
    (tmp_path / "a" / "runs" / "latest").write_text("my notes")
    (tmp_path / "b" / "runs" / "latest").mkdir()
    (tmp_path / "b" / "runs" / "latest" / "keep.txt").write_text("mine")
    for where in ("a", "b"):
        monkeypatch.chdir(tmp_path / where)
        train.train(SMOKE, Path("runs") / "run", **quiet(data_url, cache))
        assert sorted(p.name for p in (tmp_path / where / "runs").iterdir()) == ["latest", "run"]
    assert (tmp_path / "a" / "runs" / "latest").read_text() == "my notes"
    assert (tmp_path / "b" / "runs" / "latest" / "keep.txt").read_text() == "mine"
    monkeypatch.chdir(tmp_path / "c")
    train.train(SMOKE, Path("runs") / "run1", **quiet(data_url, cache))
    train.train(SMOKE, tmp_path / "c" / "runs" / "run2", **quiet(data_url, cache))  # the same folder, absolute
    assert os.readlink(tmp_path / "c" / "runs" / "latest") == "run2"  # our link moves on


def test_latest_is_written_only_in_the_default_runs_folder(tmp_path, monkeypatch, data_url, cache):
    """--run-dir /some/folder/run1 writes nothing into /some/folder: that folder is the user's, for their own
    purposes; `latest` lives in runs/ (of the current directory) only."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "some" / "folder").mkdir(parents=True)
    train.train(SMOKE, tmp_path / "some" / "folder" / "run1", **quiet(data_url, cache))
    assert sorted(p.name for p in (tmp_path / "some" / "folder").iterdir()) == ["run1"]
    assert not (tmp_path / "runs").exists()


def test_latest_moves_only_once_the_run_has_a_checkpoint(tmp_path, monkeypatch, data_url, cache):
    monkeypatch.chdir(tmp_path)
    train.train(SMOKE, Path("runs") / "good", **quiet(data_url, cache))
    with pytest.raises(ValueError):  # a data error before any checkpoint
        train.train(
            SMOKE,
            Path("runs") / "bad",
            source=train.DataSource(None, cache, *[(tmp_path / "no.src", tmp_path / "no.tgt")] * 3),
            progress=False,
            log=lambda s: None,
        )
    assert os.readlink(tmp_path / "runs" / "latest") == "good"


@pytest.mark.parametrize("where", [".", "foreign", "file"])
def test_run_dir_that_is_not_a_new_folder_is_refused(where, tmp_path, capsys, monkeypatch, data_url, cache):
    """`--run-dir .`, a non-empty folder that holds no run (without --resume), a file: one line, exit 2, nothing
    written (a foreign config.json is not overwritten)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text('{"mine": 1}')
    (tmp_path / "afile").write_text("x")
    run_dir = {".": ".", "foreign": str(tmp_path / "other"), "file": str(tmp_path / "afile")}[where]
    code = train_wmt.main(
        ["--preset", "smoke", "--run-dir", run_dir, "--data-url", data_url, "--cache-dir", str(cache), "--no-progress"]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    want = {
        ".": "the run needs a folder of its own",
        "foreign": "is not empty and holds no run",
        "file": "is a file, not a folder",
    }[where]
    assert want in err, err
    assert json.loads((tmp_path / "other" / "config.json").read_text()) == {"mine": 1}
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["afile", "config.json", "other"]


def test_a_users_test_set_is_named_by_its_files(tmp_path, data_url, cache):
    from annotated.training.data import load_multi30k

    pairs = load_multi30k("val", "de", "en", cache_dir=cache, base_url=data_url)[:300]
    src, tgt = tmp_path / "mine.de", tmp_path / "mine.en"
    src.write_text("".join(s + "\n" for s, _ in pairs), encoding="utf-8")
    tgt.write_text("".join(t + "\n" for _, t in pairs), encoding="utf-8")
    lines = []
    results = train.train(
        SMOKE,
        tmp_path / "run",
        source=train.DataSource(data_url, cache, (src, tgt), (src, tgt), (src, tgt)),
        progress=False,
        log=lines.append,
    )
    on_disk = json.loads((tmp_path / "run" / "results.json").read_text())
    assert on_disk["test_set"] == results["test_set"] == f"{src} + {tgt}"
    assert on_disk["test_files"] == [str(src), str(tgt)]
    assert "test_2016_flickr" not in "\n".join(lines) and any(
        line.startswith(f"{src} + {tgt} de->en") for line in lines
    )


# --- the command as people expect it ---------------------------------------------------------------------


def test_every_option_has_help_and_names_each_presets_value():
    """No option without help; each preset setting's help names its value in gpu, cpu and smoke, or with
    --preset only that preset's."""
    parser = train_wmt.build_parser()
    for action in parser._actions:
        assert action.help and action.help.strip(), action.option_strings
    helps = {a.dest: a.help for a in parser._actions}
    for dest in ("d_model", "dropout", "label_smoothing", "vocab_size", "beam_size", "seed", "precision"):
        want = ", ".join(f"{name}: {setting(cfg, dest)}" for name, cfg in train.PRESETS.items())
        assert helps[dest].endswith(f"({want})"), helps[dest]
    smoke = {a.dest: a.help for a in train_wmt.build_parser("smoke")._actions}
    assert smoke["d_model"].endswith("(default under --preset smoke: 32)")
    assert smoke["max_minutes"].endswith("(default under --preset smoke: none)")


def test_help_with_a_preset_shows_that_presets_defaults(capsys):
    with pytest.raises(SystemExit) as done:
        train_wmt.main(["--preset", "smoke", "--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and "(default under --preset smoke: 32)" in " ".join(out.split())


def test_print_config_prints_the_resolved_settings_and_trains_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = train_wmt.main(
        [
            "--preset",
            "smoke",
            "--d-model",
            "64",
            "--dropout",
            "0.2",
            "--precision",
            "fp32",
            "--run-dir",
            str(tmp_path / "run"),
            "--print-config",
        ]
    )
    shown = json.loads(capsys.readouterr().out)
    assert code == 0 and list(tmp_path.iterdir()) == []
    from annotated.training.config import config_from_dict

    assert config_from_dict(shown["train_config"]) == train.PRESETS["smoke"].with_model(d_model=64, dropout=0.2)
    assert (shown["preset"], shown["precision"], shown["run_dir"]) == ("smoke", "fp32", str(tmp_path / "run"))


def test_log_lines_go_through_tqdms_writer_and_into_train_log(tmp_path, monkeypatch):
    """A line printed while the progress bar is drawn must not run into it: tqdm.write clears the bar, prints the
    line and redraws the bar below it."""
    import tqdm

    from annotated.training.runs import log_line

    written = []
    monkeypatch.setattr(tqdm.tqdm, "write", classmethod(lambda cls, s, *a, **k: written.append(s)))
    log_line(tmp_path, "epoch   1 step     14  train loss 6.1")
    assert written == ["epoch   1 step     14  train loss 6.1"]
    assert (tmp_path / "train.log").read_text() == "epoch   1 step     14  train loss 6.1\n"


def test_every_option_sets_a_setting_and_every_choice_is_the_configs():
    """The options come from `OPTIONS` (annotated/training/config.py): each sets the setting it names (the cpu
    preset's own value, given on the command line, gives back the cpu preset), a whole-number option refuses the
    number below its bound, and the choices are the config's: PRESETS, PRECISIONS, the chapter's forms and norms."""
    from typing import get_args

    from annotated import transformer
    from annotated.training.config import MODEL_OPTIONS, OPTIONS, PRECISIONS, PRESETS, RUN_FIELDS

    assert set(OPTIONS) <= set(RUN_FIELDS) | set(MODEL_OPTIONS)
    choices = {a.dest: a.choices for a in train_wmt.build_parser()._actions}
    assert choices["preset"] == tuple(PRESETS) and choices["precision"] == PRECISIONS
    assert choices["attention"] == get_args(transformer.AttentionForm) and choices["norm"] == get_args(transformer.Norm)
    cpu = PRESETS["cpu"]
    for name, option in OPTIONS.items():
        flag, value = option_flag(name), setting(cpu, name)
        if value is None or option.switch:
            continue
        args = train_wmt.parse_args(["--preset", "cpu", flag, str(value)])
        assert train_wmt.config_from_args(args, cuda=False)[1] == cpu, name
        if option.whole_from is not None:
            with pytest.raises(SystemExit):
                train_wmt.parse_args([flag, str(option.whole_from - 1)])


def test_a_run_to_resume_is_typed_at_a_shell_and_under_make(tmp_path, monkeypatch):
    """A --run-dir that holds a run: `add --resume` at a shell; under make, the make line with --resume in ARGS."""
    from annotated.door import MAKE_TARGET
    from annotated.run_folder import LAST
    from annotated.training.runs import check_run_dir

    (tmp_path / LAST).write_bytes(b"")
    for name in (MAKE_TARGET, "ARGS", "CHECKPOINT", "OUT", "HF", "TEXT"):
        monkeypatch.delenv(name, raising=False)
    fixes = []
    for env in ({}, {MAKE_TARGET: "train", "ARGS": "--preset cpu"}):
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(train.TrainingError) as e:
            check_run_dir(tmp_path, resume=False)
        fixes.append(str(e.value).split("; ", 1)[1])
    assert fixes == [
        "add --resume to continue it or choose another --run-dir",
        "run make train ARGS='--preset cpu --resume' to continue it or choose another --run-dir",
    ]
