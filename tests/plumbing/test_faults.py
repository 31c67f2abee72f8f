"""Faults and bad input: interrupted runs, damaged files and hostile model inputs lose nothing and explain themselves.

Each behaviour of the README's "What happens when" list is shown by one test,
here or in the module's own test file:

* Ctrl-C (SIGINT) during training, a second Ctrl-C, and Ctrl-C at start-up: here.
* SIGKILL in the middle of a checkpoint write, and the temporary files it leaves: here.
* resuming reproduces the uninterrupted losses: `test_train.py::test_resume_reproduces_the_uninterrupted_losses`
  (stopped by `max_steps`), and here after a real SIGINT at an arbitrary step.
* damaged or incompatible checkpoints given to `train_wmt.py --resume` and to the
  translator: here; at the library level `test_checkpoint.py`.
* data faults (sha256 mismatch, truncated gzip, missing file, unreachable URL,
  non-UTF-8 text, line counts that differ): `test_data.py`.
* translator input rules (empty, whitespace, too long, unseen characters,
  non-UTF-8 stdin, serving on): `test_translate.py`.
* NaN/inf loss and NaN/inf gradients: here.
* model inputs fuzzed with hypothesis: here.

The training tests use the smoke preset on the real Multi30k files (skipped,
saying so, when there are none), with one torch thread per process so that a
run in a subprocess and one in this process do the same arithmetic.
"""

import copy
import dataclasses
import functools
import hashlib
import io
import math
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from children import IMPORT_TIMES, said, wait_past_the_quiet_handler
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import train_wmt
from annotated import transformer
from annotated.checkpoint import CheckpointError, load_checkpoint, read_checkpoint, save_checkpoint
from annotated.decoding import translate
from annotated.decoding.search import beam_search, greedy
from annotated.plumbing.files import remove_stale_temporaries
from annotated.recording import attend_with_probabilities, record_attention
from annotated.tokens import EOS, PAD
from annotated.training import train
from annotated.training.data import DataWarning
from annotated.transformer import (
    PerHeadAttention,
    convert_model,
    fuse,
    make_model,
    padding_mask,
    subsequent_mask,
    target_mask,
)

ROOT = Path(__file__).resolve().parents[2]
GUARD = 240  # seconds: a guard against a hung child process, never a timing assertion


def quiet(data_url, cache):
    return dict(source=train.DataSource(data_url, cache), progress=False, log=lambda s: None)


SMOKE = dataclasses.replace(train.PRESETS["smoke"], test_sentences=2, val_bleu_sentences=2)


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory, data_url, cache):
    """A smoke run stopped after 3 steps: last.pt (with tokenizer and training state), no best.pt."""
    run = tmp_path_factory.mktemp("stopped") / "run"
    train.train(dataclasses.replace(SMOKE, max_steps=3), run, **quiet(data_url, cache))
    return run


def losses(run: Path) -> list[tuple[int, float]]:
    rows = [line.split("\t") for line in (run / "train_loss.tsv").read_text().splitlines()]
    return [(int(step), float(loss)) for step, loss in rows]


def steps_done(run: Path) -> int:
    """Complete lines in train_loss.tsv (while a child process may be appending to it)."""
    path = run / "train_loss.tsv"
    return path.read_text().count("\n") if path.is_file() else 0


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def temporaries(path: Path) -> list[str]:
    """The temporary files atomic_torch_save leaves for `path` when killed."""
    return sorted(p.name for p in path.parent.glob(f".{path.name}.*.tmp"))


def child_env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")


def train_cli(*args) -> list[str]:
    return [sys.executable, str(ROOT / "train_wmt.py"), "--preset", "smoke", "--no-progress", *map(str, args)]


def flip_a_parameter_byte(path: Path) -> None:
    """Change one byte inside the stored bytes of the largest parameter (as a failing disk would)."""
    state = read_checkpoint(path)
    name, tensor = max(state["model"].items(), key=lambda kv: kv[1].numel())
    raw = tensor.contiguous().numpy().tobytes()
    data = bytearray(path.read_bytes())
    at = data.find(raw)
    assert at >= 0, f"{name}'s bytes are not stored as they are"
    data[at + len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(data))


# --------------------------------------------------------------- Ctrl-C (SIGINT)


def test_sigint_saves_a_resumable_checkpoint_and_resume_finishes_the_run(tmp_path, data_url, cache):
    """SIGINT at an arbitrary step: exit 130 without a traceback, last.pt at that step; --resume finishes.

    The resumed losses equal those of one uninterrupted run (in this process) step for step,
    to 1e-6 relative: both use one thread and the same seed, batches and restored random
    states, so the arithmetic is the same; the tolerance only covers the 8 printed decimals.
    A stale temporary file, as a killed write would leave, sits beside last.pt during the
    resume: it is ignored, and the first successful save of last.pt removes it.
    """
    run = tmp_path / "run"
    common = ["--run-dir", run, "--data-url", data_url, "--cache-dir", cache]
    p = subprocess.Popen(
        train_cli("--max-steps", 1000, "--log-every", 1, *common),
        cwd=tmp_path,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + GUARD
    try:
        while steps_done(run) < 3:
            assert p.poll() is None, f"training ended before it was interrupted:\n{p.communicate()}"
            assert time.monotonic() < deadline, "no training steps in time"
            time.sleep(0.02)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=GUARD)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, err
    assert "Traceback" not in err and "interrupted: saved" in out, (out, err)
    k = len(losses(run))
    assert [s for s, _ in losses(run)] == list(range(1, k + 1))
    saved = read_checkpoint(run / "last.pt")
    assert saved["run_state"]["step"] == k  # the step in progress finished, and was saved
    assert temporaries(run / "last.pt") == []

    stale = run / ".last.pt.killed.tmp"
    stale.write_bytes((run / "last.pt").read_bytes()[:1000])
    r = subprocess.run(
        train_cli("--log-every", 1, "--resume", "--max-steps", k + 3, *common),
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=GUARD,
    )
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert (run / "results.json").is_file() and not stale.exists()
    resumed = losses(run)
    assert [s for s, _ in resumed] == list(range(1, k + 4))

    whole = tmp_path / "whole"
    train.train(
        dataclasses.replace(train.PRESETS["smoke"], max_steps=k + 3, log_every=1), whole, **quiet(data_url, cache)
    )
    for (step, a), (_, b) in zip(resumed, losses(whole), strict=True):
        assert math.isclose(a, b, rel_tol=1e-6), (step, a, b)


def test_a_second_sigint_stops_at_once_without_a_traceback(tmp_path, data_url, cache):
    """Two Ctrl-C in a row: the second raises KeyboardInterrupt wherever the run is (a step, a save).

    Exit 130 with one line on stderr saying what is left, and a last.pt, if there is one,
    that loads: an interrupted save removes its temporary file and leaves the old file.
    (If the first one's orderly stop wins the race, stderr stays empty; same exit code.)
    """
    run = tmp_path / "run"
    p = subprocess.Popen(
        train_cli(
            "--max-steps", 1000, "--log-every", 1, "--run-dir", run, "--data-url", data_url, "--cache-dir", cache
        ),
        cwd=tmp_path,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + GUARD
    try:
        while steps_done(run) < 2:
            assert p.poll() is None and time.monotonic() < deadline, "no training steps in time"
            time.sleep(0.02)
        p.send_signal(signal.SIGINT)
        time.sleep(0.005)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=GUARD)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130 and "Traceback" not in err, err
    assert err == "" or (err.startswith("train: interrupted") and err.count("\n") == 1), err
    if (run / "last.pt").exists():
        assert read_checkpoint(run / "last.pt")["run_state"]["step"] <= len(losses(run))
        assert "continue with --resume" in err or "interrupted: saved" in out
    else:
        assert "nothing to resume" in err
    assert temporaries(run / "last.pt") == []


# Not commands, though they have a main guard: the chapter's demo (plumbing stays out of the story) and
# the bench's memory probe (a subprocess `make bench` starts, JSON in and out).
NOT_COMMANDS = {"annotated/transformer.py", "benchmarks/memory.py"}


def _has_main_guard(path) -> bool:
    import ast

    body = ast.parse(path.read_text(encoding="utf-8")).body
    return any(
        isinstance(n, ast.If) and isinstance(n.test, ast.Compare) and getattr(n.test.left, "id", None) == "__name__"
        for n in body
    )


# every file a user can run, found in the tree: a new command cannot be left off the list
COMMANDS = sorted(
    str(p.relative_to(ROOT))
    for folder in ("annotated", "benchmarks", "docs")
    for p in (ROOT / folder).rglob("*.py")
    if _has_main_guard(p) and str(p.relative_to(ROOT)) not in NOT_COMMANDS
) + ["train_wmt.py"]


def test_the_commands_are_found_in_the_tree():
    assert {
        "train_wmt.py",
        "benchmarks/bench.py",
        "annotated/attention/heads.py",
        "annotated/interop/folders.py",
        "annotated/training/add_case_table.py",
        "docs/build.py",
        "docs/notebook.py",
    } <= set(COMMANDS)
    assert all((ROOT / c).exists() for c in NOT_COMMANDS)  # a stale exemption is an error too


def _main_guard_calls(node) -> list:
    """(function name, arguments) of the calls in a top-level `if __name__ == "__main__":` block."""
    import ast

    is_guard = (
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Compare)
        and getattr(node.test.left, "id", None) == "__name__"
    )
    if not is_guard:
        return []
    return [
        (
            getattr(c.func, "id", getattr(c.func, "attr", None)),
            [ast.literal_eval(a) if isinstance(a, ast.Constant) else getattr(a, "id", None) for a in c.args],
        )
        for stmt in node.body
        for c in ast.walk(stmt)
        if isinstance(c, ast.Call)
    ]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_follows_the_one_ctrl_c_protocol(command):
    """annotated/plumbing/scripts.py: the file ends with `run_main(main)` under the main guard, and calls neither half of
    the protocol itself (`starting()`, from the packages' `__init__.py`, installs the quiet handler before the
    command's imports; `run_main` runs `main` under `run_command`, with the name `COMMANDS` gives the module)."""
    import ast

    from annotated.plumbing.scripts import COMMANDS as NAMED
    from annotated.plumbing.scripts import module_of

    body = ast.parse((ROOT / command).read_text(encoding="utf-8")).body
    called = {
        getattr(c.func, "id", getattr(c.func, "attr", None))
        for c in ast.walk(ast.Module(body=body, type_ignores=[]))
        if isinstance(c, ast.Call)
    }
    assert _main_guard_calls(body[-1]) == [("run_main", ["main"])], (
        "run_main(main) last, under the guard, and nothing else"
    )
    assert not called & {"quiet_ctrl_c_while_starting", "run_command"}, "the protocol's halves only through run_main"
    assert module_of(ROOT / command) in NAMED, "named in annotated/plumbing/scripts.py's COMMANDS"


def test_no_command_uses_another_ctrl_c_protocol():
    """One protocol: the module has no other entry, and no file imports it under another name."""
    from annotated.plumbing import interrupts

    public = {
        n
        for n in dir(interrupts)
        if not n.startswith("_")
        and callable(getattr(interrupts, n))
        and getattr(getattr(interrupts, n), "__module__", None) == interrupts.__name__
    }
    assert public == {
        "quiet_ctrl_c_while_starting",
        "run_command",
        "ctrl_c_requested",
        "importing",
        "can_be_caught_at",
        "StopFlag",
    }
    files = [p for p in ROOT.rglob("*.py") if ".venv" not in p.parts and "tests" not in p.parts]
    assert not [p for p in files if "import interrupts as" in p.read_text(encoding="utf-8")]


def test_sigint_at_start_up_exits_130_without_a_traceback(tmp_path, data_url, cache):
    """Ctrl-C before training starts (importing torch, reading data): exit 130, one line, nothing to resume."""
    command = train_cli("--run-dir", tmp_path / "run", "--data-url", data_url, "--cache-dir", cache)
    p = subprocess.Popen(
        [command[0], *IMPORT_TIMES, *command[1:]],
        cwd=tmp_path,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_past_the_quiet_handler(p)  # any moment after that gives the same outcome
        p.send_signal(signal.SIGINT)
        _out, err = p.communicate(timeout=GUARD)
    finally:
        if p.poll() is None:
            p.kill()
    err = said(err)
    assert p.returncode == 130, err
    assert "Traceback" not in err and err.startswith("train: interrupted") and err.count("\n") == 1, err
    assert not (tmp_path / "run" / "last.pt").exists()


@pytest.mark.parametrize(
    "command, started",
    [
        (["-m", "annotated.proof.equivalence", "--examples", "100000"], "per-head = fused"),
        (["-m", "benchmarks.bench", "--quick", "--sizes", "cpu", "--device", "cpu"], "bench:"),
    ],
    ids=["equivalence", "bench"],
)
def test_other_commands_exit_130_on_ctrl_c_without_a_traceback(tmp_path, command, started):
    """`make equivalence` and `make bench` stopped by Ctrl-C while they work: one line, exit 130.
    (Each writes its results only at the end, atomically: nothing is left half-written.)"""
    out_file = tmp_path / "bench.json"
    p = subprocess.Popen(
        [sys.executable, *command, *(["--out", str(out_file)] if started == "bench:" else [])],
        cwd=ROOT,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        err = b""
        while started.encode() not in err:  # its progress bar: past the imports, working
            chunk = p.stderr.read1(4096)
            assert chunk, f"{command} ended before it started working: {err.decode(errors='replace')}"
            err += chunk
        p.send_signal(signal.SIGINT)
        _out, rest = p.communicate(timeout=GUARD)
    finally:
        if p.poll() is None:
            p.kill()
    err = (err + rest).decode(errors="replace")
    name = {"annotated.proof.equivalence": "equivalence", "benchmarks.bench": "bench"}[command[1]]
    assert p.returncode == 130, err
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip()]  # (progress bars use \r)
    assert "Traceback" not in err and lines[-1] == f"{name}: interrupted", err[-500:]
    assert not out_file.exists() and not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "command, name",
    [
        (["-m", "annotated.proof.equivalence"], "equivalence"),
        (["-m", "annotated.attention.dump", "--checkpoint", "none.pt"], "attention"),
        (["-m", "benchmarks.bench"], "bench"),
        (["-m", "docs.build", "--out", "{tmp}/site"], "docs"),
    ],
    ids=["equivalence", "attention", "bench", "docs"],
)
def test_other_commands_exit_130_on_ctrl_c_while_torch_loads(tmp_path, command, name):
    """A Ctrl-C in the first second (the interpreter is importing torch): one line, exit 130, nothing written."""
    p = subprocess.Popen(
        [sys.executable, *IMPORT_TIMES, *(c.format(tmp=tmp_path) for c in command)],
        cwd=tmp_path,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_past_the_quiet_handler(p)  # inside the heavy imports (torch: over 1 s here)
        p.send_signal(signal.SIGINT)
        _out, err = p.communicate(timeout=GUARD)
    finally:
        if p.poll() is None:
            p.kill()
    err = said(err)
    assert p.returncode == 130 and err == f"{name}: interrupted\n", (p.returncode, err[-800:])
    assert not list(tmp_path.iterdir())


# --------------------------------------------------------------- SIGKILL during a checkpoint write


def _write_forever(path, first_version, conn, model):
    """The child: save checkpoints of `model` in a loop, reporting each finished version."""
    version = first_version
    while True:
        save_checkpoint(path, model, None, {"version": version})
        conn.send(version)
        version += 1


def test_sigkill_during_checkpoint_writes_keeps_the_previous_one(tmp_path):
    """kill -9 at random moments of a loop of 20 MB checkpoint writes.

    After each kill the checkpoint loads and holds exactly the model, at the last reported
    version or the one being written (if its rename had happened). A kill in the middle of a
    write leaves its temporary `.ckpt.pt.<random>.tmp`: nothing reads it, and the next writer's
    first successful save removes it. The writer is a fork of this process (no second torch
    import); each save takes about 50-100 ms, so almost every kill lands inside one.
    """
    torch.manual_seed(0)
    model = make_model(src_vocab=2000, tgt_vocab=2000, N=2, d_model=256, d_ff=1024, h=4)  # 5.2M parameters
    want = model.state_dict()
    path = tmp_path / "ckpt.pt"
    ctx = multiprocessing.get_context("fork")
    rng = random.Random(0)
    version, left_before, rounds_with_leftover = 0, [], 0
    for _ in range(6):
        receive, send = ctx.Pipe(duplex=False)
        writer = ctx.Process(target=_write_forever, args=(path, version + 1, send, model), daemon=True)
        writer.start()
        send.close()
        try:
            assert receive.poll(GUARD), "the writer finished no checkpoint"
            done = [receive.recv()]
            # its first save removed what the killed writer before it had left
            assert not set(left_before) & set(temporaries(path))
            time.sleep(rng.uniform(0.0, 0.3))
        finally:
            os.kill(writer.pid, signal.SIGKILL)
            writer.join()
        while receive.poll():
            try:
                done.append(receive.recv())
            except EOFError:
                break
        state = read_checkpoint(path)
        assert done[-1] <= state["meta"]["version"] <= done[-1] + 1
        assert state["model"].keys() == want.keys()
        assert all(torch.equal(state["model"][k], v) for k, v in want.items())
        left_before = temporaries(path)
        assert len(left_before) <= 1
        rounds_with_leftover += bool(left_before)
        version = state["meta"]["version"]
    assert rounds_with_leftover >= 1  # at least one kill did land inside a write
    back, _, meta = load_checkpoint(path)  # the stale temporary does not disturb loading
    assert meta["version"] == version and back.config == model.config
    save_checkpoint(path, model, None, {"version": version + 1})
    assert temporaries(path) == []


def test_a_temporary_file_being_written_is_not_removed(tmp_path):
    """Cleaning removes only what no writer holds: a live writer's locked temporary file stays."""
    import fcntl

    path = tmp_path / "a.pt"
    live, dead = tmp_path / ".a.pt.live.tmp", tmp_path / ".a.pt.dead.tmp"
    other = tmp_path / ".b.pt.dead.tmp"  # another target's: not ours to remove
    for p in (live, dead, other):
        p.write_bytes(b"partial")
    with open(live, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert remove_stale_temporaries(path) == [dead]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".a.pt.live.tmp", ".b.pt.dead.tmp"]


# --------------------------------------------------------------- damaged or incompatible checkpoints


def damage(kind: str, ckpt: Path, out: Path) -> str:
    """Write a damaged copy of `ckpt` to `out`; returns the part of the message that names the damage."""
    if kind == "missing":
        return f"{out}: no such file"
    if kind == "truncated":
        out.write_bytes(ckpt.read_bytes()[: len(ckpt.read_bytes()) * 2 // 3])
        return f"checkpoint {out} is corrupt"
    if kind == "flipped byte":
        out.write_bytes(ckpt.read_bytes())
        flip_a_parameter_byte(out)
        return f"checkpoint {out} is corrupt: member archive/data/"
    if kind == "not a checkpoint":
        out.write_text("epoch 3, loss 2.1\n")
        return f"{out} is not a checkpoint: it is text (it begins 'epoch 3, loss 2.1')"
    if kind == "a folder":
        out.mkdir()
        return f"checkpoint {out} is a directory"
    state = read_checkpoint(ckpt)
    if kind == "no config":
        del state["config"]
        message = f"checkpoint {out} is incomplete: it has no 'config' dict"
    elif kind == "config does not fit the parameters":
        state["config"]["d_ff"] *= 2
        message = f"checkpoint {out}: parameters do not match its config: "
    elif kind == "hostile config":  # passes weights_only loading; would ask for gigabytes if built as stored
        state["config"].update(src_vocab=10_000_000, tgt_vocab=10_000_000, d_model=4096, N=40, max_len=float("nan"))
        message = f"checkpoint {out}: its config is invalid: max_len must be a whole number >= 1, got nan"
    elif kind == "unknown config field":
        state["config"]["d_mdoel"] = state["config"].pop("d_model")
        message = f"checkpoint {out}: its config is invalid: "
    elif kind == "tokenizer of another model":
        state["config"]["src_vocab"] = state["config"]["tgt_vocab"] = 400
        state["model"] = make_model(**state["config"]).state_dict()
        message = (
            f"checkpoint {out}: its tokenizer has 500 subwords but the model's vocabularies have "
            f"400 (source) and 400 (target)"
        )
    elif kind == "no training state":
        del state["run_state"]
        message = f"checkpoint {out} has no training state; it cannot be resumed"
    else:
        raise AssertionError(kind)
    torch.save(state, out)
    return message


def test_a_flipped_byte_would_load_silently_without_the_crc_check(stopped_run, tmp_path):
    """Why read_checkpoint verifies the zip CRCs: torch.load alone returns the changed numbers."""
    bad = tmp_path / "bad.pt"
    bad.write_bytes((stopped_run / "last.pt").read_bytes())
    flip_a_parameter_byte(bad)
    good, loaded = read_checkpoint(stopped_run / "last.pt"), torch.load(bad, weights_only=True)
    assert any(not torch.equal(good["model"][k], loaded["model"][k]) for k in good["model"])
    with pytest.raises(CheckpointError, match=r"bad\.pt is corrupt: member .* fails its CRC-32 check"):
        read_checkpoint(bad)


RESUME_DAMAGE = [
    "missing",
    "truncated",
    "flipped byte",
    "not a checkpoint",
    "no config",
    "no training state",
    "config does not fit the parameters",
]


@pytest.mark.parametrize("kind", RESUME_DAMAGE)
def test_resume_from_a_damaged_checkpoint_exits_2_naming_it(kind, stopped_run, tmp_path, data_url, cache, capsys):
    """`train_wmt.py --resume` on a damaged last.pt: exit 2, one line naming the file and the damage; the file stays."""
    run = tmp_path / "run"
    run.mkdir()
    message = damage(kind, stopped_run / "last.pt", run / "last.pt")
    before = (run / "last.pt").read_bytes() if kind != "missing" else None
    code = train_wmt.main(
        [
            "--preset",
            "smoke",
            "--resume",
            "--run-dir",
            str(run),
            "--data-url",
            data_url,
            "--cache-dir",
            str(cache),
            "--no-progress",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("train: error: ") and message in err and err.count("\n") == 1, err
    assert (run / "last.pt").read_bytes() == before if before is not None else not (run / "last.pt").exists()
    assert temporaries(run / "last.pt") == [] and not (run / "best.pt").exists()


@pytest.mark.parametrize(
    "option, differs",
    [
        (["--norm", "pre"], "norm: checkpoint 'post' vs now 'pre'"),
        (["--vocab-size", "600"], "vocab_size: checkpoint 500 vs now 600"),
        (["--attention", "per_head"], "attention: checkpoint 'fused' vs now 'per_head'"),
    ],
)
def test_resume_with_incompatible_settings_exits_2_naming_both(
    option, differs, stopped_run, tmp_path, data_url, cache, capsys
):
    run = tmp_path / "run"
    run.mkdir()
    (run / "last.pt").write_bytes((stopped_run / "last.pt").read_bytes())
    code = train_wmt.main(
        [
            "--preset",
            "smoke",
            "--resume",
            "--run-dir",
            str(run),
            "--data-url",
            data_url,
            "--cache-dir",
            str(cache),
            "--no-progress",
            *option,
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and f"checkpoint {run / 'last.pt'} was trained with different settings" in err, err
    assert differs in err and err.count("\n") == 1


def test_resume_with_other_training_data_is_refused(stopped_run, tmp_path, data_url, cache, capsys):
    """Other data, same settings: another subword vocabulary of the same size, which would train silently wrong."""
    from annotated.training.data import load_multi30k

    pairs = load_multi30k("val", "de", "en", cache_dir=cache, base_url=data_url)
    (tmp_path / "src.txt").write_text("".join(s + "\n" for s, _ in pairs), encoding="utf-8")
    (tmp_path / "tgt.txt").write_text("".join(t + "\n" for _, t in pairs), encoding="utf-8")
    run = tmp_path / "run"
    run.mkdir()
    (run / "last.pt").write_bytes((stopped_run / "last.pt").read_bytes())
    files = [str(tmp_path / "src.txt"), str(tmp_path / "tgt.txt")]
    code = train_wmt.main(
        [
            "--preset",
            "smoke",
            "--resume",
            "--run-dir",
            str(run),
            "--cache-dir",
            str(cache),
            "--no-progress",
            "--train-files",
            *files,
            "--val-files",
            *files,
            "--test-files",
            *files,
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and f"checkpoint {run / 'last.pt'} was trained with another tokenizer" in err, err


@pytest.mark.parametrize("rule", ["error", "skip"])
def test_empty_lines_in_user_files_follow_the_flag(rule, tmp_path, data_url, cache, capsys):
    """An empty target line in the user's training files: exit 2 naming the line (default), or skipped
    with a warning under --empty-lines skip, and the run trains on the other pairs."""
    from annotated.training.data import load_multi30k

    pairs = load_multi30k("val", "de", "en", cache_dir=cache, base_url=data_url)[:300]
    (tmp_path / "src.txt").write_text("".join(s + "\n" for s, _ in pairs), encoding="utf-8")
    (tmp_path / "tgt.txt").write_text(
        "".join(("" if i == 6 else t) + "\n" for i, (_, t) in enumerate(pairs)), encoding="utf-8"
    )
    good = [str(tmp_path / "src.txt"), str(tmp_path / "src.txt")]  # val/test: any aligned pair of files
    run = tmp_path / "run"
    args = [
        "--preset",
        "smoke",
        "--run-dir",
        str(run),
        "--cache-dir",
        str(cache),
        "--no-progress",
        "--epochs",
        "1",
        "--train-files",
        str(tmp_path / "src.txt"),
        str(tmp_path / "tgt.txt"),
        "--val-files",
        *good,
        "--test-files",
        *good,
    ]
    if rule == "error":
        code = train_wmt.main(args)
        err = capsys.readouterr().err
        assert code == 2 and f"{tmp_path / 'tgt.txt'}: line 7 is empty (1 pair(s)" in err and "--empty-lines" in err
        assert not (run / "last.pt").exists()
    else:
        with pytest.warns(DataWarning, match=r"skipped 1 pair\(s\) with an empty side \(lines 7\)"):
            code = train_wmt.main([*args, "--empty-lines", "skip"])
        assert code == 0 and (run / "results.json").exists()


def test_resume_from_a_damaged_checkpoint_in_a_real_process(stopped_run, tmp_path, data_url, cache):
    run = tmp_path / "run"
    run.mkdir()
    message = damage("flipped byte", stopped_run / "last.pt", run / "last.pt")
    r = subprocess.run(
        train_cli("--resume", "--run-dir", run, "--data-url", data_url, "--cache-dir", cache),
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=GUARD,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr and message in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1


TRANSLATE_DAMAGE = [
    "truncated",
    "flipped byte",
    "not a checkpoint",
    "no config",
    "config does not fit the parameters",
    "unknown config field",
    "tokenizer of another model",
    "hostile config",
    "a folder",
]


@pytest.mark.parametrize("kind", TRANSLATE_DAMAGE)
def test_translator_refuses_a_damaged_checkpoint_with_exit_2(kind, stopped_run, tmp_path):
    """The translator: exit 2, nothing on stdout, one stderr line naming the file and what is wrong."""
    path = tmp_path / "model.pt"
    message = damage(kind, stopped_run / "last.pt", path)
    out, err = io.BytesIO(), io.StringIO()
    code = translate.main(["--checkpoint", str(path)], stdin=io.BytesIO(b"Ein Hund.\n"), stdout=out, stderr=err)
    assert code == 2 and out.getvalue() == b""
    assert err.getvalue().startswith("translate: error: ") and message in err.getvalue(), err.getvalue()
    assert err.getvalue().count("\n") == 1


@pytest.mark.parametrize("kind", ["flipped byte", "hostile config"])
def test_translator_refuses_a_damaged_checkpoint_in_a_real_process(kind, stopped_run, tmp_path):
    path = tmp_path / "model.pt"
    message = damage(kind, stopped_run / "last.pt", path)
    r = subprocess.run(
        [sys.executable, "-m", "annotated.decoding.translate", "--checkpoint", str(path), "Ein Hund."],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=GUARD,
    )
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr, r.stderr
    assert message in r.stderr and r.stderr.count("\n") == 1


# --------------------------------------------------------------- training numerics


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_loss_stops_the_run_and_keeps_the_last_checkpoint(
    bad, tmp_path, data_url, cache, monkeypatch, capsys
):
    """The loss turns NaN (or inf) at the 3rd step after the first epoch: exit 2, last.pt untouched."""
    run = tmp_path / "run"
    batch_loss, seen, last_at_fault = train.batch_loss, [], {}

    def faulty(model, src, tgt, eps, real=None):
        loss, n = batch_loss(model, src, tgt, eps, real)
        if model.training and (run / "last.pt").exists():  # training batches once epoch 1 was saved
            seen.append(1)
            if len(seen) == 3:
                last_at_fault["sha"] = sha(run / "last.pt")
                return loss * bad, n
        return loss, n

    monkeypatch.setattr(train, "batch_loss", faulty)
    code = train_wmt.main(
        ["--preset", "smoke", "--run-dir", str(run), "--data-url", data_url, "--cache-dir", str(cache), "--no-progress"]
    )
    err = capsys.readouterr().err
    saved = read_checkpoint(run / "last.pt")
    E = saved["run_state"]["step"]  # steps in epoch 1
    assert saved["run_state"]["epoch"] == 1 and sha(run / "last.pt") == last_at_fault["sha"]
    assert code == 2 and err.count("\n") == 1, err
    assert (
        f"train: error: the loss became {bad} at step {E + 3} (epoch 2); 1 step(s) with a non-finite "
        f"loss or gradient were skipped; stopped at step {2 * E}, the last good checkpoint {run / 'last.pt'} "
        f"is kept"
    ) in err  # (the read at epoch 2's end: log_every 50 > the 2 x 14 steps)
    assert [s for s, _ in losses(run)] == [E] and not (run / "results.json").exists()
    model, _, _ = load_checkpoint(run / "last.pt")
    assert all(torch.isfinite(p).all() for p in model.parameters())


class PoisonGradient(torch.autograd.Function):
    """The identity on the loss, whose backward pass returns an infinite gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


def test_non_finite_gradient_at_an_epoch_end_does_not_reach_the_checkpoint(tmp_path, data_url, cache, monkeypatch):
    """A finite loss with an inf gradient on the last batch of epoch 2 (where last.pt is written next).

    Without a check the Adam step would turn every parameter into NaN and the epoch's end
    would save them as last.pt. The run must stop before the update, keeping epoch 1's
    last.pt and best.pt as they were.
    """
    run = tmp_path / "run"
    train.train(dataclasses.replace(SMOKE, epochs=1), run, **quiet(data_url, cache))
    E = read_checkpoint(run / "last.pt")["run_state"]["step"]  # steps of epoch 1
    kept = {name: sha(run / name) for name in ("last.pt", "best.pt")}
    batch_loss, seen = train.batch_loss, []

    def poisoned(model, src, tgt, eps, real=None):
        loss, n = batch_loss(model, src, tgt, eps, real)
        if model.training:
            seen.append(1)
            if len(seen) == E:  # the last batch of epoch 2
                return PoisonGradient.apply(loss), n
        return loss, n

    monkeypatch.setattr(train, "batch_loss", poisoned)
    with pytest.raises(
        train.TrainingError,
        match=rf"the gradient norm became (nan|inf) at step {2 * E} \(epoch 2\); "
        rf"1 step\(s\) with a non-finite loss or gradient were skipped; "
        rf"stopped at step {2 * E}, the last good checkpoint .*last\.pt is "
        rf"kept",
    ):
        train.train(dataclasses.replace(SMOKE, epochs=2), run, resume=True, **quiet(data_url, cache))
    assert {name: sha(run / name) for name in kept} == kept
    model, _, _ = load_checkpoint(run / "last.pt")
    assert all(torch.isfinite(p).all() for p in model.parameters())


# --------------------------------------------------------------- model inputs, fuzzed
#
# The model and its attentions assume valid inputs; the entry points (the decoders, the
# translator, the attention dump, the equivalence report) check them at the door,
# annotated/checks.py. So the fuzzing is in two parts. Valid inputs to the attentions
# and the model: the result must have the documented shape and dtype, be finite, and agree
# with a float64 per-head reference (the paper's formula, explicit softmax). Inputs to the
# decoders, valid or with one fault: a valid one gives a well-formed translation, an invalid
# one a ValueError; any other exception, or a result for an invalid input, fails. Tolerances against the float64 reference, relative to
# max(1, |reference|): float64 1e-9, float32 1e-4, float16 1e-2, bfloat16 1e-1. A result is
# rounded at every product, softmax and LayerNorm (unit roundoff: float32 6e-8, float16 5e-4,
# bfloat16 4e-3), and the rounding error of a score grows with the square of the input scale:
# attention inputs go up to 30 in float32/float64 but up to 3 in float16/bfloat16, the scale
# LayerNorm and the scaled embeddings give them in the model (at 10, bfloat16 is off by 0.4).
# The largest errors measured (these examples, and a sweep of 240 inputs per dtype at scale 3)
# were 6e-16, 5e-7, 4.4e-3 and 3.5e-2; the headroom, at least 2.3x, covers other kernels'
# summation orders.
#
# The fuzzing first found inputs that escaped with another exception or a wrong result (the
# "once escaped" tests at the end of this file); the door refuses the invalid ones,
# annotated/transformer.py handles the valid ones, and the strategies cover them.

FUZZ = settings(
    max_examples=200, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)
TOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-1}
SCALE = {torch.float64: 30.0, torch.float32: 30.0, torch.float16: 3.0, torch.bfloat16: 3.0}  # largest input
DTYPES = list(TOL)


def outcome(call, valid: bool):
    """The result of `call`, or None after the ValueError an invalid input must raise."""
    try:
        result = call()
    except ValueError:
        assert not valid, "a valid input was refused"
        return None
    except Exception as e:
        raise AssertionError(f"{type(e).__name__} escaped instead of a ValueError: {e}") from e
    assert valid, "an invalid input gave a result instead of a ValueError"
    return result


def close_to(result, reference, dtype):
    assert result.dtype == dtype and result.shape == reference.shape
    assert torch.isfinite(result).all()
    err = (result.double() - reference).abs().max().item() if result.numel() else 0.0
    assert err <= TOL[dtype] * max(1.0, reference.abs().max().item() if reference.numel() else 0.0), err


@functools.cache
def attention_modules(d_model: int, h: int, bias: bool, dtype: torch.dtype):
    """(per-head, fused) in `dtype`, the same function, and the float64 per-head reference."""
    torch.manual_seed(d_model * 10 + h)
    per_head = PerHeadAttention(d_model, h, bias=bias).eval()
    if bias:
        with torch.no_grad():
            for p in per_head.parameters():
                if p.dim() == 1:
                    p.normal_()  # biases start at zero; make them count
    reference = copy.deepcopy(per_head).double()
    low = copy.deepcopy(per_head).to(dtype)
    return low, fuse(low), reference


def is_broadcast(shape, target) -> bool:
    try:
        return torch.broadcast_shapes(tuple(shape), tuple(target)) == tuple(target)
    except RuntimeError:
        return False


@st.composite
def masks(draw, B, T_q, T_k):
    """None or a bool mask broadcasting to (B, T_q, T_k), True with probability 0, 0.5, 0.9 or 1."""
    if draw(st.integers(0, 3)) == 0:
        return None
    shape = [draw(st.sampled_from([n, 1])) for n in (B, T_q, T_k)]
    shape = shape[draw(st.integers(0, 3)) :]  # leading dims may be left out
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    return torch.rand(shape, generator=gen) < draw(st.sampled_from([0.0, 0.5, 0.9, 1.0]))


@st.composite
def attention_cases(draw):
    """Valid inputs for one attention call (an attention has no door of its own: the entry points check)."""
    d_model, h = draw(st.sampled_from([(4, 1), (4, 2), (6, 3), (8, 2)]))
    bias, dtype = draw(st.booleans()), draw(st.sampled_from(DTYPES))
    form = draw(st.sampled_from(["per_head", "fused"]))
    B = draw(st.integers(0, 3))
    T_q, T_k = draw(st.integers(0, 5)), draw(st.integers(0, 5))
    self_attention = draw(st.booleans())
    x_shape, kv_shape = (B, T_q, d_model), (B, T_q if self_attention else T_k, d_model)
    mask = draw(masks(B, T_q, kv_shape[-2]))
    return dict(
        d_model=d_model,
        h=h,
        bias=bias,
        dtype=dtype,
        form=form,
        x_shape=x_shape,
        kv_shape=kv_shape,
        self_attention=self_attention,
        mask=mask,
        seed=draw(st.integers(0, 2**16)),
        scale=draw(st.sampled_from([1e-3, 1.0, SCALE[dtype]])),
        probabilities=draw(st.booleans()),
        fast=draw(st.booleans()),
    )


@FUZZ
@given(case=attention_cases())
def test_attention_matches_the_float64_reference(case):
    low_ph, low_fu, reference = attention_modules(case["d_model"], case["h"], case["bias"], case["dtype"])
    module = low_ph if case["form"] == "per_head" else low_fu
    gen = torch.Generator().manual_seed(case["seed"])
    x = torch.randn(case["x_shape"], generator=gen, dtype=torch.float64) * case["scale"]
    x_kv = (
        x
        if case["self_attention"]
        else (torch.randn(case["kv_shape"], generator=gen, dtype=torch.float64) * case["scale"])
    )
    mask, d_model = case["mask"], case["d_model"]
    assert mask is None or is_broadcast(mask.shape, (x.size(0), x.size(1), x_kv.size(1)))  # the strategy's promise
    x_low, kv_low = x.to(case["dtype"]), x_kv.to(case["dtype"])
    with transformer.fast_path(case["fast"]):
        call = attend_with_probabilities if case["probabilities"] else lambda m, *args: (m(*args), None)
        out, probs = call(module, x_low, kv_low, mask)
    with transformer.fast_path(False):  # the reference sees the inputs after rounding to the tested dtype
        ref_out, ref_probs = attend_with_probabilities(reference, x_low.double(), kv_low.double(), mask)
    B, T_q, T_k = x.size(0), x.size(1), x_kv.size(1)
    assert out.shape == (B, T_q, d_model)
    close_to(out, ref_out, case["dtype"])
    if not case["probabilities"]:
        assert probs is None
        return
    assert probs.shape == (B, case["h"], T_q, T_k)
    close_to(probs, ref_probs, case["dtype"])
    allowed = torch.ones(B, T_q, T_k, dtype=torch.bool) if mask is None else mask.expand(B, T_q, T_k)
    allowed = allowed.unsqueeze(1).expand_as(probs)
    assert (probs[~allowed] == 0).all()  # blocked keys get exactly zero weight
    sums = probs.double().sum(-1)
    expect = allowed.any(-1).double()  # 1 over the allowed keys; 0 for a query with none
    assert torch.allclose(sums, expect, atol=TOL[case["dtype"]])


VOCAB_SRC, VOCAB_TGT, MAX_LEN, D_MODEL = 11, 13, 8, 8


@functools.cache
def models(attention: str, norm: str, dtype: torch.dtype):
    """A small model in `dtype` and its float64 per-head reference (the same function)."""
    torch.manual_seed(1)
    base = make_model(
        src_vocab=VOCAB_SRC,
        tgt_vocab=VOCAB_TGT,
        N=2,
        d_model=D_MODEL,
        d_ff=16,
        h=2,
        dropout=0.0,
        max_len=MAX_LEN,
        attention=attention,
        norm=norm,
    ).eval()
    return copy.deepcopy(base).to(dtype), convert_model(base, "per_head").double()


SRC_FAULTS = [
    "src id",
    "src too long",
    "src dtype",
    "src rank",
    "src mask size",
    "src mask dtype",
    "src mask rank",
    "max_len",
    "beam",
    "training",
]  # what a user can hand the decoders wrongly; half the cases have none


def token_ids(B, T, vocab, gen, bad: bool, dtype):
    """(B, T) ids, pad (0) included; with `bad`, one id outside [0, vocab)."""
    ids = torch.randint(0, vocab, (B, T), generator=gen)
    if bad and ids.numel():
        ids.view(-1)[int(torch.randint(ids.numel(), (1,), generator=gen))] = [-1, vocab, vocab + 7][
            int(torch.randint(3, (1,), generator=gen))
        ]
    return ids.to(dtype)


@st.composite
def model_cases(draw):
    """Valid inputs for encode, decode or forward (the model has no door of its own: the entry points check)."""
    op, dtype = draw(st.sampled_from(["encode", "decode", "forward"])), draw(st.sampled_from(DTYPES))
    attention, norm = draw(st.sampled_from(["fused", "per_head"])), draw(st.sampled_from(["post", "pre"]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    B = draw(st.integers(0, 3))
    start = draw(st.integers(0, MAX_LEN)) if op == "decode" else 0
    S, T = draw(st.integers(0, MAX_LEN)), draw(st.integers(0, MAX_LEN - start))
    ids = lambda B_, T_, vocab: token_ids(B_, T_, vocab, gen, False, draw(st.sampled_from([torch.int64, torch.int32])))
    src, tgt = ids(B, S, VOCAB_SRC), ids(B, T, VOCAB_TGT)
    src_mask = draw(st.sampled_from(["padding", "padding", "none", "one row"]))
    tgt_mask = draw(st.sampled_from(["target", "target", "subsequent", "none"]))
    return dict(
        op=op,
        dtype=dtype,
        attention=attention,
        norm=norm,
        src=src,
        tgt=tgt,
        src_mask=src_mask,
        tgt_mask=tgt_mask,
        start=start,
        probabilities=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


def recorded(model, call, kinds):
    """call(); with `kinds`, (its result, then per kind the probabilities of each layer)."""
    if not kinds:
        return call()
    with record_attention(model) as probs:
        out = call()
    return (out, *[[probs[kind, l][0] for l in range(model.config.N)] for kind in kinds])


def make_src_mask(kind, src):
    S = src.size(1)
    return {
        "padding": lambda: padding_mask(src, 0),
        "none": lambda: None,
        "one row": lambda: torch.ones(1, 1, S, dtype=torch.bool),
        "wrong length": lambda: torch.ones(src.size(0), 1, S + 1, dtype=torch.bool),
        "int": lambda: padding_mask(src, 0).int(),
        "rank 4": lambda: padding_mask(src, 0).unsqueeze(0),
    }[kind]()


def make_tgt_mask(kind, tgt):
    T = tgt.size(1)
    return {"target": lambda: target_mask(tgt, 0), "subsequent": lambda: subsequent_mask(T), "none": lambda: None}[
        kind
    ]()


@FUZZ
@given(case=model_cases())
def test_model_matches_the_float64_reference(case):
    model, reference = models(case["attention"], case["norm"], case["dtype"])
    src, tgt, op, dtype = case["src"], case["tgt"], case["op"], case["dtype"]
    src_mask, tgt_mask = make_src_mask(case["src_mask"], src), make_tgt_mask(case["tgt_mask"], tgt)
    B, S = src.shape
    T_len = tgt.size(1)
    start = case["start"] if op == "decode" else 0
    gen = torch.Generator().manual_seed(case["seed"])
    memory = torch.randn(B, S, D_MODEL, generator=gen, dtype=torch.float64)
    ra = case["probabilities"]
    if op == "encode":
        result = recorded(model, lambda: model.encode(src, src_mask), ra and ["enc_self"])
        want = lambda: recorded(reference, lambda: reference.encode(src, src_mask), ["enc_self"])
        shape, n_maps = (B, S, D_MODEL), [(B, 2, S, S)]
    elif op == "decode":
        decode = lambda m, mem: lambda: m.decode(mem, src_mask, tgt, tgt_mask, start=start)
        result = recorded(model, decode(model, memory.to(dtype)), ra and ["dec_self", "cross"])
        want = lambda: recorded(reference, decode(reference, memory.to(dtype).double()), ["dec_self", "cross"])
        shape, n_maps = (B, T_len, D_MODEL), [(B, 2, T_len, T_len), (B, 2, T_len, S)]
    else:
        result = model(src, tgt, src_mask, tgt_mask)
        want = lambda: (reference(src, tgt, src_mask, tgt_mask),)
        shape, n_maps, ra = (B, T_len, VOCAB_TGT), [], False
    with transformer.fast_path(False):
        ref = want()
    out = result[0] if ra else result
    assert out.shape == shape
    close_to(out, ref[0], dtype)
    if ra:  # per layer: encoder self-attention; or decoder self- and cross-attention
        for maps, ref_maps, map_shape in zip(result[1:], ref[1:], n_maps, strict=True):
            assert len(maps) == 2
            for p, p_ref in zip(maps, ref_maps):
                assert p.shape == map_shape
                close_to(p, p_ref, dtype)


@st.composite
def decoder_cases(draw):
    """Arguments for greedy or beam_search: valid, or with one fault drawn from SRC_FAULTS."""
    fault = draw(st.sampled_from(["none"] * len(SRC_FAULTS) + SRC_FAULTS))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    B = draw(st.integers(1 if fault == "src id" else 0, 3))
    S = draw(st.integers(MAX_LEN + 1, MAX_LEN + 3) if fault == "src too long" else st.integers(1, MAX_LEN))
    dtype = draw(
        st.sampled_from(
            [torch.float32, torch.int16, torch.uint8, torch.bool]
            if fault == "src dtype"
            else [torch.int64, torch.int32]
        )
    )
    src = token_ids(B, S, VOCAB_SRC, gen, fault == "src id", dtype)
    if fault == "src rank":
        src = src.reshape(-1) if draw(st.booleans()) else src.unsqueeze(0)
    src_mask = {"src mask size": "wrong length", "src mask dtype": "int", "src mask rank": "rank 4"}.get(fault) or draw(
        st.sampled_from(["padding", "padding", "none", "one row"])
    )
    max_len = draw(st.sampled_from([0, MAX_LEN + 1]) if fault == "max_len" else st.integers(1, MAX_LEN))
    beam = draw(st.sampled_from([0, -1]) if fault == "beam" else st.integers(1, 3))
    return dict(
        fault=fault,
        src=src,
        src_mask=src_mask,
        max_len=max_len,
        beam=beam,
        search=draw(st.sampled_from(["greedy", "beam"])) if fault != "beam" else "beam",
        attention=draw(st.sampled_from(["fused", "per_head"])),
        dtype=draw(st.sampled_from(DTYPES)),
    )


@FUZZ
@given(case=decoder_cases())
def test_decoders_give_a_translation_or_a_value_error(case):
    model, _ = models(case["attention"], "post", case["dtype"])
    src, max_len = case["src"], case["max_len"]
    src_mask = make_src_mask(case["src_mask"], src) if src.dim() == 2 else None
    # valid, read off the arguments themselves
    valid = (
        src.dtype in (torch.int64, torch.int32)
        and src.dim() == 2
        and src.size(1) <= MAX_LEN
        and (src.numel() == 0 or (int(src.min()) >= 0 and int(src.max()) < VOCAB_SRC))
        and (
            src_mask is None
            or (
                src_mask.dtype == torch.bool
                and src_mask.dim() == 3
                and is_broadcast(src_mask.shape, (src.size(0),) + (src.size(1),) * 2)
            )
        )
        and 1 <= max_len <= MAX_LEN
        and case["beam"] >= 1
        and case["fault"] != "training"
    )
    assert valid or case["fault"] != "none"
    search = (
        (lambda: greedy(model, src, src_mask, max_len))
        if case["search"] == "greedy"
        else (lambda: beam_search(model, src, src_mask, max_len, beam_size=case["beam"]))
    )
    model.train(case["fault"] == "training")
    try:
        out = outcome(search, valid)
    finally:
        model.eval()
    if out is None:
        return
    B = src.size(0)
    assert out.dtype == torch.long and out.size(0) == B and out.size(1) <= max_len
    assert out.numel() == 0 or (int(out.min()) >= 0 and int(out.max()) < VOCAB_TGT)
    after_eos = (out == EOS).long().cumsum(dim=1) - (out == EOS).long() > 0  # (B, L) strictly after the first eos
    assert (out[after_eos] == PAD).all()


# --------------------------------------------------------------- inputs that once escaped
#
# Found by the fuzzing above; each case is the smallest input that showed it, kept as a
# regression test. The docstring-like reason says what used to happen.


def escape(reason):
    """Label a regression test with what used to go wrong (its docstring)."""

    def label(test):
        test.__doc__ = f"Used to escape: {reason}."
        return test

    return label


@escape("FusedAttention returns the probabilities beside its output when FAST_PATH is off")
def test_once_escaped_fused_attention_returns_unasked_probabilities(monkeypatch):
    monkeypatch.setattr(transformer, "FAST_PATH", False)
    _, fused, _ = attention_modules(8, 2, True, torch.float32)
    x = torch.randn(2, 3, 8)
    assert isinstance(fused(x, x), torch.Tensor) and fused(x, x).shape == (2, 3, 8)  # the output alone


@pytest.mark.parametrize("shape", [(), (4,), (1,)])
@escape("FusedAttention: a 0-d or 1-d mask (valid: it broadcasts) fails in mask.unsqueeze(-3) with IndexError")
def test_once_escaped_fused_attention_low_rank_mask(shape):
    _, fused, _reference = attention_modules(8, 2, True, torch.float32)
    x = torch.randn(2, 3, 8)
    result = outcome(lambda: fused(x, torch.randn(2, 4, 8), torch.ones(shape, dtype=torch.bool)), valid=True)
    assert result.shape == (2, 3, 8)


@escape("an empty batch (B = 0) with a mask: FusedAttention.forward reads kv[0][0], IndexError")
def test_once_escaped_empty_batch_with_a_mask():
    model, _ = models("fused", "post", torch.float32)
    src = torch.zeros(0, 4, dtype=torch.long)
    result = outcome(lambda: model.encode(src, padding_mask(src, 0)), valid=True)
    assert result.shape == (0, 4, D_MODEL)


@pytest.mark.filterwarnings("ignore:indexing with dtype torch.uint8 is now deprecated")
@pytest.mark.parametrize("dtype", [torch.float32, torch.int16, torch.uint8, torch.bool])
@escape("token ids that are not int64/int32: IndexError (uint8 and bool index as masks)")
def test_once_escaped_token_ids_of_another_dtype(dtype):
    model, _ = models("fused", "post", torch.float32)
    src = torch.tensor([[4, 5, 1]]).to(dtype)
    outcome(lambda: greedy(model, src, None, 4), valid=False)


@pytest.mark.parametrize("shape", [(3,), (2, 4, 3)])
@escape("token ids that are not (B, T): RuntimeError when the positional encoding is added")
def test_once_escaped_token_ids_not_two_dimensional(shape):
    model, _ = models("fused", "post", torch.float32)
    src = torch.full(shape, 4)
    outcome(lambda: beam_search(model, src, None, 4), valid=False)


@pytest.mark.parametrize("start, T_len", [(-1, 1), (-3, 2)])
@escape("decode(start < 0): pe[start:start + T_len] is silently empty or taken from the end of the table")
def test_once_escaped_negative_decode_start(start, T_len):
    model, _ = models("fused", "post", torch.float32)
    memory = torch.zeros(1, 3, D_MODEL)
    outcome(lambda: model.decode(memory, None, torch.full((1, T_len), 4), None, start=start), valid=False)
