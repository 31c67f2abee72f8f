"""annotated/training/train.py: the schedule, and a whole (smoke) run."""

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from annotated.plumbing.devices import cpu_has_bf16
from annotated.training import train
from annotated.transformer import rate


def test_schedule_warms_up_then_decays():
    lrs = [rate(s, 256, 1000) for s in range(1, 5001)]
    peak = max(range(len(lrs)), key=lrs.__getitem__) + 1
    assert peak == 1000
    assert math.isclose(lrs[999], 256**-0.5 * 1000**-0.5)
    assert math.isclose(lrs[3999] / lrs[999], 0.5)  # step 4000 vs 1000: 1/sqrt(4)


def test_presets_are_valid_and_bad_settings_are_named():
    for _name, cfg in train.PRESETS.items():
        train.make_optimizer(torch.nn.Linear(2, 2), cfg)
        assert cfg.model_for(100).share_embeddings and cfg.model_for(100).tie_generator
    with pytest.raises(ValueError, match="two different languages"):
        train.TrainConfig(src_lang="de", tgt_lang="de")
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        train.TrainConfig(label_smoothing=1.5)
    with pytest.raises(ValueError, match=r"cooldown is a share of max_steps in \[0, 1\) and needs max_steps"):
        train.TrainConfig(cooldown=0.3)  # epochs alone: no budget of steps to cool down at the end of
    with pytest.raises(ValueError, match=r"cooldown is a share of max_steps in \[0, 1\)"):
        train.TrainConfig(cooldown=1.0, max_steps=100)


def test_command_line_flags_override_the_preset():
    """Every model and optimisation setting can be changed from the command line, without editing a preset:
    `train_wmt.py --preset gpu --layers 3 --d-model 256 ...` trains the gpu preset with those numbers."""
    import train_wmt
    from annotated.training.config import MODEL_OPTIONS, setting

    args = train_wmt.parse_args(
        [
            "--preset",
            "gpu",
            "--layers",
            "3",
            "--d-model",
            "256",
            "--d-ff",
            "1024",
            "--heads",
            "8",
            "--dropout",
            "0.2",
            "--label-smoothing",
            "0.05",
            "--warmup",
            "900",
            "--lr-factor",
            "1.5",
            "--val-bleu-sentences",
            "400",
        ]
    )
    preset, cfg = train_wmt.config_from_args(args, cuda=False)
    want = dict(
        N=3,
        d_model=256,
        d_ff=1024,
        h=8,
        dropout=0.2,
        label_smoothing=0.05,
        warmup=900,
        lr_factor=1.5,
        val_bleu_sentences=400,
    )
    assert preset == "gpu" and {k: setting(cfg, k) for k in want} == want
    gpu = train.PRESETS["gpu"]
    model_back = {k: getattr(gpu.model, k) for k in want if k in MODEL_OPTIONS}
    run_back = {k: getattr(gpu, k) for k in want if k not in MODEL_OPTIONS}
    assert dataclasses.replace(cfg, **run_back).with_model(**model_back) == gpu
    assert train_wmt.config_from_args(train_wmt.parse_args([]), cuda=False)[1] == train.PRESETS["cpu"]
    assert train_wmt.config_from_args(train_wmt.parse_args([]), cuda=True)[1] == train.PRESETS["gpu"]
    with pytest.raises(ValueError, match="d_model=256 is not divisible by h=6"):
        train_wmt.config_from_args(train_wmt.parse_args(["--d-model", "256", "--heads", "6"]), cuda=False)
    with pytest.raises(ValueError, match="dropout must be in"):
        train_wmt.config_from_args(train_wmt.parse_args(["--dropout", "1"]), cuda=False)


# --- whole runs (smoke preset, real Multi30k files) ---------------------------

REPO = Path(__file__).resolve().parents[2]


def losses(run_dir: Path) -> list[tuple[int, str]]:
    rows = [line.split("\t") for line in (run_dir / "train_loss.tsv").read_text().splitlines()]
    return [(int(step), loss) for step, loss in rows]


def test_presets_are_defined_by_steps_as_the_prose_says(data_url, cache):
    """The presets' budgets are optimizer steps, never minutes. cpu: 6,500 steps, about 31 epochs, at the peak
    of the paper's formula, the last 30% cooling down (1,950 steps), the length penalty chosen on validation;
    gpu: the same model with 8192-token batches, 4,200 steps (about 65 epochs), twice the paper's peak, the
    paper's length penalty and beam 5; both average the last 5 epochs."""
    from annotated.training import data

    gpu, cpu = train.PRESETS["gpu"], train.PRESETS["cpu"]
    differ = {f.name for f in dataclasses.fields(train.TrainConfig) if getattr(gpu, f.name) != getattr(cpu, f.name)}
    assert gpu.model == cpu.model
    assert differ == {"max_tokens", "max_steps", "lr_factor", "length_penalty", "beam_size", "val_bleu_sentences"}
    assert (gpu.max_tokens, cpu.max_tokens, gpu.max_steps, cpu.max_steps, gpu.beam_size, cpu.average_last) == (
        8192,
        2500,
        4200,
        6500,
        5,
        5,
    )
    assert (cpu.lr_factor, gpu.lr_factor, cpu.length_penalty, gpu.length_penalty) == (1.0, 2.0, None, 0.6)
    assert cpu.cooldown_steps == 1950 and train.learning_rate(6500, cpu) == pytest.approx(
        train.learning_rate(4550, cpu) / 1951
    )  # the rate of the last step: 1/1951 of the one cooldown starts at
    assert gpu.val_bleu_sentences is None  # every validation sentence, for choosing best.pt
    for cfg in train.PRESETS.values():
        assert cfg.max_minutes is None and cfg.epochs is None and cfg.max_steps
    tokenizer, train_pairs, _, _ = train.prepare_data(gpu, train.DataSource(data_url, cache))
    encoded = data.encode_pairs(train_pairs, tokenizer)
    encoded = [encoded[i] for i in data.split_long(encoded, gpu.max_len)[0]]
    for cfg, epochs in ((cpu, 31.1), (gpu, 65)):
        per_epoch = len(data.make_batches(encoded, cfg.max_tokens, shuffle=True, seed=cfg.seed))
        assert abs(cfg.max_steps / per_epoch - epochs) < 0.5, (cfg.max_tokens, per_epoch)


def test_smoke_run_trains_evaluates_and_writes_everything(tmp_path, monkeypatch, data_url, cache):
    from annotated.checkpoint import load_checkpoint

    monkeypatch.chdir(tmp_path)
    run = tmp_path / "runs" / "run"
    lines = []
    results = train.train(
        train.PRESETS["smoke"], run, source=train.DataSource(data_url, cache), progress=False, log=lines.append
    )
    on_disk = json.loads((run / "results.json").read_text())
    assert (on_disk["precision"], on_disk["precision_reason"]) == ("fp32", "fp32 as set (by --precision or the preset)")
    assert on_disk["threads"] == torch.get_num_threads() >= 1
    [first] = [line for line in lines if line.startswith(f"run {run}:")]
    n = torch.get_num_threads()
    threads = "1 CPU thread" if n == 1 else f"{n} CPU threads"
    assert first.endswith(f"precision fp32 (fp32 as set (by --precision or the preset)), {threads}"), first
    assert on_disk["test"]["best"]["beam"]["bleu"] == results["test"]["best"]["beam"]["bleu"]
    for kind in ("greedy", "beam"):
        r = on_disk["test"]["best"][kind]
        assert r["sentences"] == 20 and 0 <= r["bleu"] <= 100 and "13a" in r["signature"]["bleu"]
    assert [h["epoch"] for h in on_disk["history"]] == [1, 2] and on_disk["steps"] == 28
    assert abs(on_disk["train_s"] - sum(h["train_s"] for h in on_disk["history"])) <= 0.1  # (rounded to 0.1)
    for h in on_disk["history"]:  # where each epoch's time went: training vs evaluation
        assert h["train_s"] > 0 and h["eval_s"] > 0 and h["tokens_per_s"] > 0, h
    steps = losses(run)
    assert [s for s, _ in steps] == [14, 28]  # a row per read of the loss: here each epoch's end (14 steps each)
    assert float(steps[-1][1]) < float(steps[0][1])  # it learned something
    model, tok, meta = load_checkpoint(run / "best.pt")
    assert meta["src_lang"] == "de" and tok.vocab_size == model.config.src_vocab
    from annotated.checkpoint import read_case_table
    from annotated.decoding.casing import case_table
    from annotated.training.data import load_multi30k

    sources = [s for s, _ in load_multi30k("train", "de", "en", cache_dir=cache, base_url=data_url)[:300]]
    assert read_case_table(run / "best.pt") == read_case_table(run / "last.pt") == case_table(sources)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert set(train.TRAIN_TAGS.values()) | set(train.VALIDATION_TAGS.values()) <= tags, tags
    assert {"test_best/beam_bleu", "test_best/greedy_chrf"} <= tags, tags
    assert events.Scalars("test_best/beam_bleu")[0].value == pytest.approx(on_disk["test"]["best"]["beam"]["bleu"])
    assert list((run / "tb" / "hparams").iterdir())  # the settings beside the test scores (HPARAMS tab)
    assert (run.parent / "latest").resolve() == run.resolve()
    assert not [p for p in run.iterdir() if p.name.endswith(".tmp")]


def test_resume_reproduces_the_uninterrupted_losses(tmp_path, data_url, cache):
    """Stop after 7 steps (mid-epoch), resume, and compare every step's loss with one uninterrupted run.

    Same seed, same batches, restored optimizer and random-number states: on the CPU the
    arithmetic is the same, so the losses agree to every printed digit. Dropout 0.1, so the
    dropout masks after the resume are right only if the random state was restored.
    """
    cfg = dataclasses.replace(
        train.PRESETS["smoke"].with_model(dropout=0.1), test_sentences=2, val_bleu_sentences=2, log_every=1
    )
    quiet = dict(source=train.DataSource(data_url, cache), progress=False, log=lambda s: None)
    train.train(cfg, tmp_path / "whole", **quiet)
    train.train(dataclasses.replace(cfg, max_steps=7), tmp_path / "parts", **quiet)
    assert len(losses(tmp_path / "parts")) == 7
    with pytest.raises(train.TrainingError, match="already holds a run"):
        train.train(cfg, tmp_path / "parts", **quiet)
    train.train(cfg, tmp_path / "parts", resume=True, **quiet)
    assert losses(tmp_path / "parts") == losses(tmp_path / "whole")


def test_resume_with_other_model_settings_is_refused(tmp_path, data_url, cache):
    cfg = dataclasses.replace(train.PRESETS["smoke"], max_steps=2, test_sentences=2)
    quiet = dict(source=train.DataSource(data_url, cache), progress=False, log=lambda s: None)
    train.train(cfg, tmp_path / "r", **quiet)
    with pytest.raises(train.CheckpointError, match="d_model: checkpoint 32 vs now 64"):
        train.train(cfg.with_model(d_model=64), tmp_path / "r", resume=True, **quiet)


def test_training_modules_import_no_attention_pictures_and_form_no_circle():
    """annotated/training/ imports nothing from annotated/attention/ (matplotlib's pictures come in as a function,
    train(alignment_image=...)), and its modules import each other without a circle: config <- runs <- results
    <- train, scoring (evaluate) below them all."""
    import ast

    folder = REPO / "annotated" / "training"
    imports = {}
    for path in folder.glob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
                names.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
        imports[path.stem] = names
    assert not [(m, n) for m, ns in imports.items() for n in ns if n.startswith("annotated.attention")]
    graph = {
        m: {n.split(".")[2] for n in ns if n.startswith("annotated.training.") and n.split(".")[2] in imports}
        for m, ns in imports.items()
    }
    done, active = set(), []

    def visit(m):
        assert m not in active, f"import circle: {' -> '.join(active + [m])}"
        if m not in done:
            active.append(m)
            for n in graph[m]:
                visit(n)
            active.pop()
            done.add(m)

    for m in graph:
        visit(m)
    assert "train" not in graph["evaluate"] | graph["runs"] | graph["config"] | graph["results"]


TIMINGS = {"train_s", "tokens_per_s", "eval_s"}  # wall-clock figures: the only ones allowed to differ


def figures(run: Path) -> dict:
    """results.json's figures (the history of every epoch and the test scores), without wall-clock times and
    the checkpoint paths; plus the per-step loss log and the final parameters' bytes."""
    results = json.loads((run / "results.json").read_text())
    history = [{k: v for k, v in epoch.items() if k not in TIMINGS} for epoch in results["history"]]
    test = {name: {k: v for k, v in scores.items() if k != "checkpoint"} for name, scores in results["test"].items()}
    from annotated.checkpoint import read_checkpoint

    last = read_checkpoint(run / "last.pt")
    moments = {f"{i}.{k}": t for i, state in last["optimizer"]["state"].items() for k, t in state.items()}
    return {
        "history": history,
        "test": test,
        "steps": results["steps"],
        "losses": (run / "train_loss.tsv").read_text(),
        "parameters": {k: t.contiguous().numpy().tobytes() for k, t in last["model"].items()},
        "adam": {k: t.contiguous().numpy().tobytes() for k, t in moments.items()},  # exp_avg, exp_avg_sq, step
    }


def test_two_runs_on_one_install_give_bit_identical_figures(tmp_path, data_url, cache):
    """The same preset and seed twice in one process (one install, one machine): every figure of results.json
    (losses, validation and test BLEU and chrF, to the last digit), the loss log and the final parameters are
    identical, bit for bit. (Across machines a different CPU's kernels may round differently: docs/training.md.)"""
    cfg = dataclasses.replace(train.PRESETS["smoke"], max_steps=16, test_sentences=4, val_bleu_sentences=4)
    runs = [tmp_path / "a" / "run", tmp_path / "b" / "run"]
    for run in runs:
        train.train(cfg, run, source=train.DataSource(data_url, cache), progress=False, log=lambda s: None)
    first, second = (figures(run) for run in runs)
    assert first["history"] and first["test"] and first["steps"] == 16
    assert first == second


@pytest.mark.parametrize("penalty", [-0.5, float("nan"), float("inf")])
def test_a_negative_or_non_finite_length_penalty_is_refused_at_the_door(penalty):
    """Refused when the settings are made, naming the setting and what it takes, before any data or model."""
    with pytest.raises(ValueError, match="length_penalty must be a finite number >= 0"):
        dataclasses.replace(train.PRESETS["smoke"], length_penalty=penalty)


def test_the_case_table_is_built_from_the_training_sources_only(tmp_path):
    """Fast, on the user's-files path: recasing repairs the *input*, so the table is the sources' casing. The
    sources write Hund and Wiese, the targets hund, WIESE and Dog; a table of the targets, or of both sides,
    differs from the one the run keeps."""
    sources = ["Ein Hund rennt über die Wiese.", "Der Hund schläft auf der Wiese.", "Zwei Hund und eine Katze."] * 4
    targets = ["a hund runs across the WIESE.", "the hund sleeps on the WIESE.", "two Dog and a cat."] * 4
    files = {}
    for side, lines in (("src", sources), ("tgt", targets)):
        files[side] = tmp_path / f"train.{side}"
        files[side].write_text("\n".join(lines) + "\n")
    pair = (str(files["src"]), str(files["tgt"]))
    cfg = dataclasses.replace(train.PRESETS["smoke"].with_model(vocab_size=300), case_augment=0.0)
    source = train.DataSource(cache_dir=tmp_path / "cache", train_files=pair, val_files=pair, test_files=pair)
    run_data = train.load_run_data(cfg, source, train.Placement(0, 1, torch.device("cpu")), lambda s: None)
    from annotated.decoding.casing import case_table

    assert run_data.case_table == case_table(sources)
    assert run_data.case_table["hund"] == "Hund" and run_data.case_table["wiese"] == "Wiese"
    assert case_table(targets) != run_data.case_table != case_table(sources + targets)


@pytest.mark.parametrize(
    "threads, precision, wider",
    [
        pytest.param(1, "fp32", [], id="one-thread"),
        pytest.param(2, "fp32", ["--d-model", "128"], id="two-threads-fp32"),
        pytest.param(
            2,
            "bf16",
            ["--d-model", "128"],
            id="two-threads-bf16",
            marks=pytest.mark.skipif(not cpu_has_bf16(), reason="this CPU has no bf16 instructions"),
        ),
    ],
)
def test_two_processes_train_bit_identical_weights(tmp_path, data_url, threads, precision, wider):
    """`train_wmt.py` twice, each in a process of its own (one machine, one install, seed 0), on one thread and,
    as `make train` runs on a 2-core machine, on two, in fp32 and (where the CPU has it) bf16: the saved weights
    are the same bytes, and so is every figure of results.json but the clock's. Nothing of the process (hash
    seeds, thread pools and their timing, allocation addresses) reaches the numbers; what moves a seed's BLEU
    between two machines is their CPUs' kernels, not the run (docs/training.md, "How far one seed moves").
    On two threads the model is the `cpu` preset's width, d_model 128: the smoke width's embedding gradients
    (under 32,768 numbers a batch) are too small for PyTorch to split them between threads at all, so
    only the wider runs could show a race between the threads (`test_a_training_step_adds_no_gradient_with_atomics`)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(threads)}
    for name in ("a", "b"):
        env["PYTHONHASHSEED"] = {"a": "1", "b": "2"}[name]  # the processes differ in what they may
        subprocess.run(
            [
                sys.executable,
                str(REPO / "train_wmt.py"),
                "--preset",
                "smoke",
                "--max-steps",
                "10",
                "--val-bleu-sentences",
                "4",
                "--seed",
                "0",
                "--threads",
                str(threads),
                "--precision",
                precision,
                *wider,
                "--no-progress",
                "--data-url",
                data_url,
                "--cache-dir",
                str(tmp_path / name / "cache"),  # its own tokenizer, trained in the process, as a fresh clone
                "--run-dir",
                str(tmp_path / name / "run"),
            ],
            cwd=tmp_path,
            env=env,
            check=True,
            capture_output=True,
            timeout=300,
        )
    first, second = (figures(tmp_path / name / "run") for name in ("a", "b"))
    assert first["steps"] == 10 and first["parameters"]
    assert first["parameters"] == second["parameters"]  # every weight, bit for bit
    assert first["adam"] == second["adam"] and first["adam"]  # and every moment of Adam's
    assert first == second


def test_a_run_keeps_and_averages_exactly_its_last_average_last_epochs(tmp_path):
    """Five epochs of one step each on a few pairs of the user's files, average_last = 3: the run keeps
    epoch3.pt, epoch4.pt and epoch5.pt, no more and no fewer, and averaged.pt is their element-wise mean, the
    model the run reports. (One epoch file deleted too many, and the mean would be over two.)"""
    from annotated.checkpoint import read_checkpoint

    sources = ["Ein Hund rennt über die Wiese.", "Zwei Männer spielen Fußball.", "Eine Frau liest ein Buch."] * 4
    targets = ["A dog runs across the meadow.", "Two men play football.", "A woman reads a book."] * 4
    files = {}
    for side, lines in (("src", sources), ("tgt", targets)):
        files[side] = tmp_path / f"pairs.{side}"
        files[side].write_text("\n".join(lines) + "\n")
    pair = (files["src"], files["tgt"])
    cfg = dataclasses.replace(
        train.PRESETS["smoke"].with_model(vocab_size=300),
        max_steps=None,
        epochs=5,
        max_tokens=4000,  # every pair in one batch: an epoch is one step
        average_last=3,
        beam_size=1,
    )
    run = tmp_path / "run"
    results = train.train(
        cfg, run, source=train.DataSource(None, None, pair, pair, pair), progress=False, log=lambda s: None
    )
    assert [h["epoch"] for h in results["history"]] == [1, 2, 3, 4, 5] and results["steps"] == 5
    kept = [run / f"epoch{e}.pt" for e in (3, 4, 5)]
    assert sorted(run.glob("epoch*.pt")) == kept
    averaged = read_checkpoint(run / "averaged.pt")
    assert averaged["meta"]["averaged"] == [str(p) for p in kept]
    epochs = [read_checkpoint(p)["model"] for p in kept]
    for name, value in averaged["model"].items():
        assert torch.equal(value, (sum(e[name].double() for e in epochs) / 3).to(value.dtype)), name
    assert results["test"]["averaged"]["checkpoint"] == str(run / "averaged.pt")
