"""annotated/decoding/translate.py: the command line, its input rules, and finding the checkpoint.

The checkpoint is a tiny untrained model with a real sentencepiece tokenizer
(trained on a few sentences), written by `save_checkpoint`. Its translations
are nonsense, so the tests compare the command line's output with the same
search run in this process: the same checkpoint, tokenizer and decoder must
give the same text.
"""

import functools
import io
import json
import operator
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from tiny import tiny_model, tiny_translator, write_tiny_checkpoint

from annotated.checkpoint import (
    CheckpointError,
    add_case_table,
    load_checkpoint,
    read_case_table,
    save_checkpoint,
)
from annotated.decoding import casing
from annotated.decoding.search import gnmt_lp, sequence_logprob, translate_ids
from annotated.decoding.translate import main, set_aside_unseen, translate
from annotated.run_folder import latest_checkpoint
from annotated.tokens import EOS
from annotated.transformer import make_model

ROOT = Path(__file__).resolve().parents[2]
MAX_LEN = 24
TEXTS = [
    "Ein Hund rennt über die Wiese.",
    "Zwei Männer spielen Fußball im Park.",
    "A dog runs across the meadow.",
    "Two men play football in the park.",
    "Eine Frau liest ein Buch.",
    "A woman reads a book.",
] * 4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """Path of a tiny checkpoint (model + tokenizer)."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "best.pt", TEXTS, 320, max_len=MAX_LEN)


@pytest.fixture(scope="module")
def loaded(ckpt):
    return load_checkpoint(ckpt)[:2]


def expected(loaded, text, beam=4):
    model, tok = loaded
    return translate(model, tok, text, beam_size=beam)[0]


def run_cli(*args, stdin=b""):
    args = [a if isinstance(a, bytes) else str(a) for a in args]
    return subprocess.run(
        [sys.executable, "-m", "annotated.decoding.translate", *args],
        input=stdin,
        capture_output=True,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        timeout=120,
    )


# --- the command line, in a real process --------------------------------------


def test_sentences_as_arguments(ckpt, loaded):
    unseen = "Ein Hund 🐕 läuft 東京"  # an emoji and characters the tokenizer never saw
    latin1 = b"Stra\xdfe"  # an argument that is not UTF-8
    r = run_cli("--checkpoint", ckpt, "Ein Hund rennt über die Wiese.", unseen, latin1, "--beam", "2")
    assert r.returncode == 0, r.stderr.decode()
    lines = r.stdout.decode("utf-8").split("\n")
    assert lines == [
        expected(loaded, "Ein Hund rennt über die Wiese.", 2),
        expected(loaded, unseen, 2),
        expected(loaded, "Stra\ufffde", 2),
        "",
    ]
    assert r.stderr.decode() == "argument 3: not valid UTF-8, undecodable bytes replaced by U+FFFD\n"


def test_stdin_serves_line_by_line_and_survives_bad_lines(ckpt, loaded):
    """Each answer is flushed before the next line is sent, so a waiting reader gets it."""
    long_line = " ".join(["Hund"] * 40)
    n_long = len(loaded[1].encode(long_line))
    assert n_long > MAX_LEN
    lines = [b"Ein Hund rennt.", b"", b"   \t", long_line.encode(), b"Stra\xdfe und \xff Hund", b"Eine Frau."]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.Popen(
        [sys.executable, "-m", "annotated.decoding.translate", "--checkpoint", str(ckpt)],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    killer = threading.Timer(120, p.kill)  # a guard against a hang, not a timing assertion
    killer.start()
    try:
        answers = []
        for line in lines:
            p.stdin.write(line + b"\n")
            p.stdin.flush()
            answers.append(p.stdout.readline())  # would block forever without the flush
        p.stdin.close()
        rest, err = p.stdout.read(), p.stderr.read().decode()
        assert p.wait() == 0, err
    finally:
        killer.cancel()
    answers = [a.decode("utf-8") for a in answers]
    assert all(a.endswith("\n") for a in answers) and rest == b""
    assert answers[0][:-1] == expected(loaded, "Ein Hund rennt.")
    assert answers[1] == answers[2] == "\n"
    per_part = MAX_LEN // len(loaded[1].encode("Hund"))  # no sentence or clause ends: split between words
    parts = [" ".join(["Hund"] * min(per_part, 40 - i)) for i in range(0, 40, per_part)]
    assert answers[3][:-1] == " ".join(expected(loaded, part) for part in parts)
    assert answers[4][:-1] == expected(loaded, "Stra\ufffde und \ufffd Hund")
    assert answers[5][:-1] == expected(loaded, "Eine Frau.")  # still serving after all that
    assert "line 2: empty input, printed an empty line" in err
    assert "line 3: empty input, printed an empty line" in err
    assert (
        f"line 4: {n_long} subwords, more than the model's max_len={MAX_LEN}; translated in {len(parts)} parts" in err
    )
    assert "line 5: not valid UTF-8, undecodable bytes replaced by U+FFFD" in err
    assert "line 1" not in err and "line 6" not in err and "Traceback" not in err


@pytest.mark.parametrize("when", ["while torch loads", "while waiting for a line"])
def test_ctrl_c_exits_130_without_a_traceback(ckpt, when):
    """Ctrl-C is how people stop a translator reading stdin: exit code 130 and one line, at any moment.

    Python would raise KeyboardInterrupt inside `import torch` (a traceback; on torch 2.11 once an
    abort); the command exits at once while modules load, and says so like every command
    (annotated/plumbing/interrupts.py)."""
    from children import IMPORT_TIMES, said, wait_past_the_quiet_handler

    loading = when == "while torch loads"
    p = subprocess.Popen(
        [
            sys.executable,
            *(IMPORT_TIMES if loading else []),
            "-m",
            "annotated.decoding.translate",
            "--checkpoint",
            str(ckpt),
        ],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    killer = threading.Timer(120, p.kill)  # a guard against a hang, not a timing assertion
    killer.start()
    try:
        if loading:  # past the quiet handler, inside the heavy imports: the outcome is the same at any moment
            before = wait_past_the_quiet_handler(p)
        else:
            before = ""
            p.stdin.write("Ein Hund.\n")
            p.stdin.flush()
            assert p.stdout.readline().endswith("\n")  # answered: loaded and waiting for the next line
        p.send_signal(signal.SIGINT)
        if loading:  # drain the import lines while it ends (a full pipe would block it)
            rest = p.communicate()[1]
        else:  # stdin stays open: only the Ctrl-C can end it
            rest = p.stderr.read()
        rc = p.wait()
        err = said(before + rest)
    finally:
        killer.cancel()
        p.kill()
    assert rc == 130 and err.lstrip("\n") == "translate: interrupted\n", (rc, err)  # (a line break first
    # where it was working: a progress bar may be open)


def test_a_reader_that_goes_away_ends_it_quietly(ckpt):
    """`... | head -1`: once the reader has closed the pipe, the next answer cannot be written; exit 0, no noise."""
    p = subprocess.Popen(
        [sys.executable, "-m", "annotated.decoding.translate", "--checkpoint", str(ckpt)],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    killer = threading.Timer(120, p.kill)  # a guard against a hang, not a timing assertion
    killer.start()
    try:
        p.stdin.write(b"Ein Hund.\n")
        p.stdin.flush()
        assert p.stdout.readline().endswith(b"\n")
        p.stdout.close()  # the reader goes away
        p.stdin.write(b"Eine Frau.\n")  # its answer meets a closed pipe
        p.stdin.flush()
        rc = p.wait()  # stdin is still open: only the broken pipe can end it
        err = p.stderr.read().decode()
    finally:
        killer.cancel()
        p.kill()
    assert rc == 0 and err == "", (rc, err)


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_bad_checkpoint_is_one_line_and_exit_2(ckpt, tmp_path, damage):
    path = tmp_path / "broken.pt"
    if damage == "truncated":
        data = ckpt.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    r = run_cli("--checkpoint", path, "Ein Hund.")
    err = r.stderr.decode()
    assert r.returncode == 2 and r.stdout == b""
    assert str(path) in err and "Traceback" not in err and err.count("\n") == 1, err


class Generated(io.RawIOBase):
    """`size` bytes of b"a" then `tail`, made as they are read (the line never exists as a whole)."""

    def __init__(self, size: int, tail: bytes):
        self.left, self.tail = size, tail

    def readable(self):
        return True

    def readinto(self, buffer):
        n = min(len(buffer), self.left) if self.left else min(len(buffer), len(self.tail))
        if self.left:
            buffer[:n] = b"a" * n
            self.left -= n
        else:
            buffer[:n], self.tail = self.tail[:n], self.tail[n:]
        return n


class Watched(io.BufferedReader):
    """Records the longest piece the translator takes from standard input at once."""

    largest = 0

    def _seen(self, piece):
        Watched.largest = max(Watched.largest, len(piece))
        return piece

    def readline(self, size=-1):
        return self._seen(super().readline(size))

    def read(self, size=-1):
        return self._seen(super().read(size))

    def __next__(self):
        return self._seen(super().__next__())


def test_a_huge_line_is_never_held_in_memory(ckpt, loaded):
    """A 5 MB line is answered with an empty line and a message; the translator never holds more than
    MAX_LINE_BYTES + 2 bytes of it, so memory stays flat whatever the line's length, and the next line is served."""
    from annotated.decoding.translate import MAX_LINE_BYTES

    Watched.largest = 0
    stdin = Watched(Generated(5_000_000, b"\nEin Hund.\n"), buffer_size=1 << 16)
    out, err = io.BytesIO(), io.StringIO()
    assert main(["--checkpoint", str(ckpt)], stdin=stdin, stdout=out, stderr=err) == 0
    assert out.getvalue().decode().split("\n") == ["", expected(loaded, "Ein Hund."), ""]
    assert err.getvalue() == f"line 1: longer than {MAX_LINE_BYTES} bytes, printed an empty line\n"
    assert 0 < Watched.largest <= MAX_LINE_BYTES + 2
    code, out, err = run_main("--checkpoint", ckpt, "a" * (MAX_LINE_BYTES + 1), "Ein Hund.")  # arguments too
    assert code == 0 and out.split("\n") == ["", expected(loaded, "Ein Hund."), ""]
    assert err == f"argument 1: longer than {MAX_LINE_BYTES} bytes, printed an empty line\n"


# --- in-process: options, help, checkpoints without a tokenizer ---------------


def run_main(*args, stdin=b""):
    out, err = io.BytesIO(), io.StringIO()
    code = main([str(a) for a in args], stdin=io.BytesIO(stdin), stdout=out, stderr=err)
    return code, out.getvalue().decode("utf-8"), err.getvalue()


def test_in_process_run_matches_and_counts_arguments(ckpt, loaded):
    code, out, err = run_main("--checkpoint", ckpt, "--beam", "1", "Ein Hund.", " ", "Eine Frau.")
    assert code == 0
    assert out.split("\n") == [expected(loaded, "Ein Hund.", 1), "", expected(loaded, "Eine Frau.", 1), ""]
    assert err == "argument 2: empty input, printed an empty line\n"


def test_help_states_the_rules(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    for phrase in (
        "empty or whitespace-only line",
        "more subwords than max_len",
        "non-UTF-8 bytes",
        "characters unseen in training",
        "put back at the end of the translation",
        "a line of nothing else is printed as typed",
        "exit code 2",
        "--max-extra",
        "split at sentence ends",
        "typed on a terminal, line by line",
        "exit code 130",
    ):
        assert phrase in text


@pytest.mark.parametrize(
    "option, message",
    [
        (["--beam", "0"], "argument --beam: must be a whole number >= 1, got '0'"),
        (["--beam", "-2"], "argument --beam: must be a whole number >= 1, got '-2'"),
        (["--length-penalty", "-1"], "argument --length-penalty: must be a finite number >= 0, got '-1'"),
        (["--length-penalty", "nan"], "argument --length-penalty: must be a finite number >= 0, got 'nan'"),
        (["--max-extra", "-3"], "argument --max-extra: must be a whole number >= 0, got '-3'"),
        (["--device", "nonsense"], "argument --device: must be cpu, cuda or cuda:N"),
        (["--device", "tpu"], "argument --device: must be cpu, cuda or cuda:N"),
        (["--device", "meta"], "argument --device: must be cpu, cuda or cuda:N"),
        (["--device", "cuda:99"], "argument --device: 'cuda:99' asked for, but"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_bad_options_exit_2_with_one_line_before_loading(option, message, tmp_path, capsys):
    """Checked before the checkpoint is even looked at (it does not exist here)."""
    code, out, err = run_main("--checkpoint", tmp_path / "none.pt", *option, "Ein Hund.")
    err += capsys.readouterr().err
    assert code == 2 and out == "" and err.startswith(f"translate: error: {message}")
    assert len(err.splitlines()) == 1 and "none.pt" not in err


def test_checkpoint_without_tokenizer_or_not_a_checkpoint_is_refused(tmp_path):
    path = tmp_path / "no_tok.pt"
    save_checkpoint(path, make_model(src_vocab=11, tgt_vocab=11, N=1, d_model=8, d_ff=16, h=2), None)
    code, out, err = run_main("--checkpoint", path, "Ein Hund.")
    assert code == 2 and out == ""
    assert err == f"translate: error: checkpoint {path} holds no tokenizer, so it cannot translate text\n"
    (tmp_path / "text.pt").write_text("hello")
    code, out, err = run_main("--checkpoint", tmp_path / "text.pt", "Ein Hund.")
    assert code == 2 and out == "" and str(tmp_path / "text.pt") in err and err.count("\n") == 1


def test_a_translation_is_always_one_line(loaded):
    """Byte pieces can spell a line break; the output line must not break."""
    model, tok = loaded

    class Spells:  # the real tokenizer, except that decoding yields line breaks
        encode, unseen_characters = staticmethod(tok.encode), staticmethod(tok.unseen_characters)

        def decode(self, ids):
            return "a\nb\r\nc\u2028d"

    assert translate(model, Spells(), "Ein Hund.") == ("a b c d", None)


# --- which checkpoint without --checkpoint ------------------------------------


def make_run(runs, name, mtime):
    (runs / name).mkdir(parents=True)
    best = runs / name / "best.pt"
    best.write_bytes(b"x")
    (runs / name / "last.pt").write_bytes(b"x")
    os.utime(best, (mtime, mtime))
    return best


def test_latest_checkpoint_follows_runs_latest_then_the_newest(tmp_path):
    runs = tmp_path / "runs"
    with pytest.raises(CheckpointError, match=r"no checkpoint found.*--checkpoint PATH"):
        latest_checkpoint(runs)
    old = make_run(runs, "a", 1_000)
    new = make_run(runs, "b", 2_000)
    assert latest_checkpoint(runs) == new  # no runs/latest: the newest best.pt
    (runs / "latest").symlink_to("a")
    assert latest_checkpoint(runs).resolve() == old.resolve()  # runs/latest wins over the newest
    (runs / "latest").unlink()
    (runs / "latest").write_text("a\n")  # a text file naming the run
    assert latest_checkpoint(runs) == old
    (runs / "latest").write_text(str(runs / "a"))  # or giving its path
    assert latest_checkpoint(runs) == old
    (runs / "latest").write_text("gone")  # naming a run without best.pt: the newest instead
    assert latest_checkpoint(runs) == new
    (runs / "b" / "averaged.pt").write_bytes(b"x")  # a run that averaged its last epochs: that is its model
    assert latest_checkpoint(runs) == runs / "b" / "averaged.pt"
    (runs / "latest").write_text("a")
    assert latest_checkpoint(runs) == old  # a run without averaged.pt: best.pt


def test_without_checkpoint_option_uses_the_latest_run(ckpt, loaded, tmp_path):
    (tmp_path / "runs" / "r1").mkdir(parents=True)
    (tmp_path / "runs" / "r1" / "best.pt").symlink_to(ckpt)
    (tmp_path / "runs" / "latest").symlink_to("r1")
    code, out, err = run_main("--runs-dir", tmp_path / "runs", stdin=b"Ein Hund.\n")
    assert code == 0 and out == expected(loaded, "Ein Hund.") + "\n"
    assert err == f"translate: using {tmp_path / 'runs' / 'latest' / 'best.pt'}\n"


# --- real input: unseen characters, long lines, many lines --------------------


def test_unseen_characters_are_set_aside_and_put_back_at_the_end(loaded):
    """An emoji (or a symbol, or another script) does not change the translation; it is kept, at the end."""
    model, tok = loaded
    plain = "Ein Hund rennt über die Wiese."
    assert translate(model, tok, "Ein Hund 🐕 rennt über die Wiese.") == (expected(loaded, plain) + " 🐕", None)
    both = translate(model, tok, "🐕 Ein Hund rennt über die Wiese. 👍🏽 東京")[0]
    assert both == expected(loaded, plain) + " 🐕 👍🏽 東京"  # in their order; a run of them stays together
    assert translate(model, tok, "🐕🐕") == (  # nothing else to translate: as typed, and stderr says why
        "🐕🐕",
        "only characters never seen in training ('🐕🐕'): nothing translated, printed as typed",
    )


def test_a_line_of_only_unseen_characters_comes_back_as_typed_with_a_note(ckpt):
    code, out, err = run_main("--checkpoint", ckpt, "👍🏽", stdin=b"")
    assert (code, out) == (0, "👍🏽\n")
    assert err == "argument 1: only characters never seen in training ('👍🏽'): nothing translated, printed as typed\n"


def test_capitals_lower_case_and_caps_lock_are_recased_then_answered_in_their_style(ckpt, loaded, spy):
    """A line in capitals is translated as its recased form and answered in capitals; lower case likewise in
    lower case; caps lock as the sentence it meant. `--case as-typed` translates the line as it stands."""
    model, tok = loaded
    plain = "Zwei Männer spielen Fußball im Park."
    answer_in = {"upper": str.upper, "lower": str.lower, "inverted": lambda s: s}
    for typed, style in ((plain.upper(), "upper"), (plain.lower(), "lower"), (casing.swap_case(plain), "inverted")):
        recased = casing.normalise(typed, tok)
        assert recased[1] == style
        assert translate(model, tok, typed)[0] == answer_in[style](expected(loaded, recased[0]))
    assert casing.normalise(casing.swap_case(plain), tok)[0] == plain
    spy.calls.clear()
    table_path = ckpt.parent / "with-table.pt"
    add_case_table(ckpt, table_path, {"männer": "MäNNer"})  # a checkpoint's case table decides
    code, out, err = run_main("--checkpoint", table_path, "ZWEI MÄNNER.")
    assert err == "argument 1: in capitals: translated as 'Zwei MäNNer.'\n" and code == 0
    assert read_case_table(ckpt) is None and read_case_table(table_path) == {"männer": "MäNNer"}
    spy.calls.clear()
    assert translate(model, tok, "ZWEI MÄNNER", case="as-typed")[1] is None
    assert spy.calls == [[tok.encode(set_aside_unseen("ZWEI MÄNNER", tok)[0])]]  # only the other input rules
    code, out, err = run_main("--checkpoint", ckpt, "ZWEI MÄNNER.", "--case", "auto")
    recased = casing.normalise("ZWEI MÄNNER.", tok)[0]
    assert (code, out, err) == (
        0,
        expected(loaded, recased).upper() + "\n",
        f"argument 1: in capitals: translated as {recased!r}\n",
    )


class Spy:
    """translate_ids, recording the sources of each call."""

    def __init__(self, real):
        self.real, self.calls = real, []

    def __call__(self, model, sources, *args, **kwargs):
        self.calls.append([list(s) for s in sources])
        return self.real(model, sources, *args, **kwargs)


@pytest.fixture
def spy(monkeypatch):
    from annotated.decoding import translate as module

    recorder = Spy(module.translate_ids)
    monkeypatch.setattr(module, "translate_ids", recorder)
    return recorder


def test_a_line_longer_than_max_len_is_split_at_sentence_ends(loaded, spy):
    model, tok = loaded
    sentences = ["Ein Hund rennt.", "Eine Frau liest.", "Ein Hund."]
    text = " ".join(sentences)
    assert all(len(tok.encode(s)) <= MAX_LEN for s in sentences) and len(tok.encode(text)) > MAX_LEN
    want = " ".join(expected(loaded, s) for s in sentences)
    spy.calls.clear()
    assert translate(model, tok, text) == (
        want,
        f"{len(tok.encode(text))} subwords, more than the model's max_len={MAX_LEN}; translated in 3 parts",
    )
    assert spy.calls[0] == [tok.encode(s) for s in sentences]  # one part per sentence, in order


@pytest.fixture(scope="module")
def knows_clauses(tmp_path_factory):
    """A tiny model whose tokenizer has seen ',', ';' and ':' (the fixture's texts have none)."""
    texts = TEXTS + ["Ein Hund rennt, eine Frau liest; ein Hund: eine Frau."] * 4
    return tiny_translator(texts, 320, tmp_path_factory.mktemp("clauses"), max_len=MAX_LEN, tied=False)


def test_a_sentence_longer_than_max_len_is_split_at_clause_ends(knows_clauses, spy):
    model, tok = knows_clauses
    clauses = ["Ein Hund rennt,", "eine Frau liest;", "ein Hund rennt:", "eine Frau"]
    text = " ".join(clauses)
    assert len(tok.encode(text)) > MAX_LEN
    translation, note = translate(model, tok, text)
    parts = spy.calls[-1]
    assert len(parts) > 1 and all(len(p) <= MAX_LEN for p in parts) and note.endswith(f"in {len(parts)} parts")
    assert [t for part in parts for t in part] == tok.encode(text)  # nothing lost, nothing added, in order
    assert all(tok.decode(p)[-1] in ",;:" for p in parts[:-1])  # each cut at a clause end
    alone = " ".join(tok.decode(translate_ids(model, [p], 4, 0.6)[0]) for p in parts)
    assert translation == " ".join(alone.splitlines())  # (the output stays one line)


class FlushLog(io.BytesIO):
    """A binary stdout that remembers what it held at each flush."""

    def __init__(self):
        super().__init__()
        self.flushed = []

    def flush(self):
        super().flush()
        self.flushed.append(self.getvalue())


SENTENCES = [
    "Ein Hund rennt.",
    "Zwei Männer spielen.",
    "Eine Frau liest ein Buch.",
    "Ein Hund rennt über die Wiese.",
    "Eine Frau.",
    "Ein Hund.",
] * 2  # each within MAX_LEN subwords


def test_stdin_from_a_file_is_batched_answered_in_order_and_flushed_per_window(ckpt, loaded, spy, monkeypatch):
    from annotated.decoding import translate as module

    assert all(len(loaded[1].encode(s)) <= MAX_LEN for s in SENTENCES)  # one source per line
    monkeypatch.setattr(module, "WINDOW", 5)
    want = [expected(loaded, s, 2) for s in SENTENCES]
    spy.calls.clear()
    stdin = io.BytesIO("".join(s + "\n" for s in SENTENCES).encode())
    out, err = FlushLog(), io.StringIO()
    assert main(["--checkpoint", str(ckpt), "--beam", "2"], stdin=stdin, stdout=out, stderr=err) == 0
    assert [len(call) for call in spy.calls] == [5, 5, 2]
    assert out.getvalue().decode().split("\n") == want + [""]  # several sentences per call of the model
    lines_at_flush = [f.decode().count("\n") for f in out.flushed]
    assert lines_at_flush[:3] == [5, 10, 12] and err.getvalue() == ""


class Terminal(io.BytesIO):
    def isatty(self):
        return True


def test_a_terminal_on_stdin_is_served_line_by_line_after_saying_so(ckpt, loaded, spy):
    from annotated.decoding.translate import WAITING

    want = [expected(loaded, s, 2) for s in SENTENCES[:3]]
    spy.calls.clear()
    out, err = io.BytesIO(), io.StringIO()
    stdin = Terminal("".join(s + "\n" for s in SENTENCES[:3]).encode())
    assert main(["--checkpoint", str(ckpt), "--beam", "2"], stdin=stdin, stdout=out, stderr=err) == 0
    assert err.getvalue() == WAITING + "\n"
    assert WAITING == "translate: waiting for sentences, one per line (Ctrl-D to end)"
    assert [len(call) for call in spy.calls] == [1, 1, 1]
    assert out.getvalue().decode().split("\n") == want + [""]


def test_make_bench_compares_the_cli_from_stdin_with_batched_translate_ids():
    """benchmarks/bench.py's row: both sides run the same sentences with the same beam (no speed asserted)."""
    from benchmarks import bench

    row = bench.bench_translator_cli(bench.Settings(reps=1, window=0.01), lambda line: None, sentences=6)
    assert row["sentences"] == 6 and row["beam"] == 2 and "error" not in row
    assert row["ratio"] == row["cli_s"] / row["translate_ids_s"] > 0
    assert "translator from stdin / batched translate_ids" in bench.markdown(
        {
            "meta": {
                "device_name": "cpu",
                "torch": "",
                "date": "",
                "dtype": "fp32",
                "clock": "wall",
                "load_average_start": [0],
                "load_average_end": [0],
                "device_type": "cpu",
            },
            "train": [],
            "decode": [],
            "targets": [],
            "translator_cli": row,
        }
    )


class TerminalText(io.StringIO):
    def isatty(self):
        return True


def test_a_file_on_stdin_shows_a_progress_bar_on_a_terminals_stderr(ckpt, loaded):
    out, err = io.BytesIO(), TerminalText()
    stdin = io.BytesIO("".join(s + "\n" for s in SENTENCES).encode())
    assert main(["--checkpoint", str(ckpt), "--beam", "1"], stdin=stdin, stdout=out, stderr=err) == 0
    assert "translate: 0 sentences" in err.getvalue() and err.getvalue().endswith("\r")  # drawn, then cleared
    assert out.getvalue().decode().split("\n") == [expected(loaded, s, 1) for s in SENTENCES] + [""]


def test_a_sentence_much_longer_than_the_training_sentences_is_translated_in_clauses(knows_clauses, spy):
    """Test sentences joined by commas into one sentence of more than LONG_SENTENCE characters, for a model whose
    max_len would take it whole: split at clause ends into runs within LONG_SENTENCE, each translated, the
    answers joined in order, and a note naming the length. The answer is the parts' translations, each whole."""
    from annotated.decoding.translate import LONG_SENTENCE

    _, tok = knows_clauses
    model = tiny_model(tok.vocab_size, max_len=512, tied=False)
    clauses = [t.rstrip(".") for t in TEXTS[:6] if not t.startswith(("A ", "Two"))] * 5
    text = ", ".join(clauses) + "."
    assert len(text) > LONG_SENTENCE and len(tok.encode(text)) <= 512
    translation, note = translate(model, tok, text)
    parts = spy.calls[-1]
    assert len(parts) > 1 and note == (
        f"{len(text)} characters, longer than the sentences the model learned from "
        f"({LONG_SENTENCE}); translated in {len(parts)} parts"
    )
    assert functools.reduce(operator.iadd, parts, []) == tok.encode(text)  # nothing lost, nothing added, in order
    assert all(len(tok.decode(p)) <= LONG_SENTENCE and tok.decode(p)[-1] == "," for p in parts[:-1])
    alone = " ".join(tok.decode(translate_ids(model, [p], 4, 0.6)[0]) for p in parts)
    assert translation == " ".join(alone.splitlines())


@pytest.mark.parametrize("n, size", [(1, 256), (5, 256), (7, 3), (6, 3)])
def test_every_line_that_arrives_with_the_end_of_input_is_answered(n, size):
    """A pipe's lines written at once and closed: the last window holds lines and the end of input together,
    and is still answered (lines piped one at a time never show it)."""
    from annotated.decoding.translate import arrived_windows

    lines = [f"line {i}" for i in range(n)]
    got = list(arrived_windows(iter(lines), size))
    assert functools.reduce(operator.iadd, got, []) == lines and all(1 <= len(w) <= size for w in got)


def test_the_translator_decodes_at_the_models_length_penalty_unless_told(ckpt, tmp_path, monkeypatch):
    """Default: the alpha in the checkpoint's meta (its run's choice on validation), else the paper's 0.6;
    `--length-penalty` wins over both."""
    from annotated.checkpoint import with_meta
    from annotated.decoding import translate as module

    alphas = []

    def recording(model, sources, beam_size, length_penalty, **kwargs):
        alphas.append(length_penalty)
        return translate_ids(model, sources, beam_size, length_penalty, **kwargs)

    monkeypatch.setattr(module, "translate_ids", recording)
    chosen = tmp_path / "chosen.pt"
    with_meta(ckpt, chosen, length_penalty=3.0)
    for path, flag, want in (
        (chosen, [], 3.0),
        (ckpt, [], 0.6),
        (chosen, ["--length-penalty", "0.25"], 0.25),
        (ckpt, ["--length-penalty", "1.5"], 1.5),
        (chosen, ["--length-penalty", "0"], 0.0),
    ):
        alphas.clear()
        code, _, err = run_main("--checkpoint", path, *flag, "Ein Hund rennt.")
        assert code == 0 and alphas == [want], (path.name, flag, alphas, err)


# --- the options people script against: n-best, scores, files, JSON lines, batches, threads -------


FEW = ["Ein Hund rennt.", "Zwei Männer spielen.", "Eine Frau liest."]  # each within MAX_LEN subwords


def hypotheses_of(out: str) -> list[list[tuple[str, float, float]]]:
    """jsonl output -> per line [(translation, log_prob, score)], checking each object names its line."""
    objects = [json.loads(line) for line in out.splitlines()]
    assert [o["line"] for o in objects] == list(range(len(objects)))
    return [[(h["translation"], h["log_prob"], h["score"]) for h in o["hypotheses"]] for o in objects]


@pytest.mark.parametrize("beam", [1, 4])
@pytest.mark.parametrize("quantize", [[], ["--quantize", "int8"]], ids=["float32", "int8"])
def test_the_first_of_the_nbest_is_the_translation_and_scores_are_the_searchs(ckpt, loaded, beam, quantize):
    """At beam 1 and 4, float32 and int8: with --nbest (the beam's width) in JSON lines, each line's first
    hypothesis is the plain output's translation, the hypotheses come best score first, each score is its
    log P over GNMT's lp of its length, and (float32) each log P is the model's own log-probability of the
    hypothesis by teacher forcing (`sequence_logprob`), within 1e-4: float32 sums of a few dozen terms, the
    two computed in a different order (the search's cache and circuits against one pass); the command's
    figures are those of `translate_ids` in this process within 1e-5 (float32 rounding: there the sentence
    is searched alone, in the command with the others of its batch)."""
    model, tok = loaded
    plain = run_main("--checkpoint", ckpt, "--beam", beam, *quantize, *FEW)
    assert plain[0] == 0
    code, out, err = run_main(
        "--checkpoint", ckpt, "--beam", beam, "--nbest", beam, "--format", "jsonl", *quantize, *FEW
    )
    assert code == 0, err
    lines = hypotheses_of(out)
    assert [hyps[0][0] for hyps in lines] == plain[1].splitlines()
    for sentence, hyps in zip(FEW, lines):
        assert len(hyps) == beam
        assert [s for _, _, s in hyps] == sorted((s for _, _, s in hyps), reverse=True)
        found = translate_ids(model, [tok.encode(sentence)], beam, 0.6, nbest=beam)[0] if not quantize else None
        for i, (_text, log_prob, score) in enumerate(hyps):
            if found is None:
                continue
            ids = found[i].ids  # the same search in this process, the sentence alone in its batch
            assert (log_prob, score) == pytest.approx((found[i].log_prob, found[i].score), abs=1e-5)
            ended = len(ids) < MAX_LEN  # an output of MAX_LEN ids was cut at the limit, without eos
            assert score == pytest.approx(log_prob / gnmt_lp(len(ids) + ended, 0.6), abs=1e-9)
            src = torch.tensor([tok.encode(sentence)])
            ys = torch.tensor([ids + [EOS] * ended])
            assert log_prob == pytest.approx(sequence_logprob(model, src, None, ys)[0].item(), abs=1e-4)


def test_nbest_and_scores_in_text_are_numbered_lines(ckpt):
    """Text with --nbest/--scores: `LINE ||| translation ||| log P ||| score`, LINE from 0, n lines per
    input line; the same hypotheses and scores as JSON lines (printed to 6 decimals). An empty line gets one
    hypothesis, empty, without scores."""
    args = ("--checkpoint", ckpt, "--beam", "3", "--nbest", "2")
    code, text, err = run_main(*args, "--scores", FEW[0], " ", FEW[1])
    assert code == 0, err
    _, jsonl, _ = run_main(*args, "--format", "jsonl", FEW[0], " ", FEW[1])
    want = [
        f"{i} ||| {t} ||| {'-' if p is None else f'{p:.6f}'} ||| {'-' if s is None else f'{s:.6f}'}"
        for i, hyps in enumerate(hypotheses_of(jsonl))
        for t, p, s in hyps
    ]
    assert text.splitlines() == want
    assert [line.split(" ||| ")[0] for line in want] == ["0", "0", "1", "2", "2"]
    assert want[2] == "1 |||  ||| - ||| -"
    assert json.loads(jsonl.splitlines()[1])["source"] == " "
    code, text, _ = run_main(*args, FEW[0])  # n-best without scores
    assert code == 0 and [line.count(" ||| ") for line in text.splitlines()] == [1, 1]


def test_a_line_in_parts_joins_its_parts_hypotheses_and_sums_their_scores(loaded):
    """Hypothesis i of a line split into parts joins the parts' i-th hypotheses; log P and score add up."""
    from annotated.decoding.translate import prepare, translate_prepared

    model, tok = loaded
    two = f"{FEW[0]} {FEW[2]}"
    max_len = max(len(tok.encode(FEW[0])), len(tok.encode(FEW[2])))
    line = prepare("text", two, None, tok, max_len, "as-typed")  # one part per sentence
    assert len(line.sources) == 2
    parts = translate_ids(model, line.sources, 2, 0.6, nbest=2)
    answers = translate_prepared(model, tok, [line], 2, 0.6, nbest=2)[0]
    assert len(answers) == 2
    for i, answer in enumerate(answers):
        assert answer.text == f"{tok.decode(parts[0][i].ids)} {tok.decode(parts[1][i].ids)}".strip()
        assert answer.log_prob == pytest.approx(parts[0][i].log_prob + parts[1][i].log_prob, abs=1e-12)
        assert answer.score == pytest.approx(parts[0][i].score + parts[1][i].score, abs=1e-12)


def test_input_and_output_files_and_no_output_overwritten_without_force(ckpt, tmp_path):
    source, target = tmp_path / "in.de", tmp_path / "out.en"
    source.write_text("\n".join(FEW) + "\n", encoding="utf-8")
    _, want, _ = run_main("--checkpoint", ckpt, stdin=source.read_bytes())
    assert run_main("--checkpoint", ckpt, "--input", source, "--output", target) == (0, "", "")
    assert target.read_text(encoding="utf-8") == want and len(want.splitlines()) == 3
    target.write_text("mine\n")
    code, out, err = run_main("--checkpoint", ckpt, "--input", source, "--output", target)
    assert code == 2 and out == "" and target.read_text() == "mine\n"
    assert (
        err == f"translate: error: {target} exists; add --force to replace it, or add --output NEW to write elsewhere\n"
    )
    assert run_main("--checkpoint", ckpt, "--input", source, "--output", target, "--force")[0] == 0
    assert target.read_text(encoding="utf-8") == want


@pytest.mark.parametrize(
    "option, message",
    [
        (["--nbest", "5", "--beam", "4"], "--nbest 5 is more than --beam 4: the n best come from the beam's"),
        (["--nbest", "2", "--beam", "1"], "--nbest 2 is more than --beam 1"),
        (["--nbest", "0"], "argument --nbest: must be a whole number >= 1, got '0'"),
        (["--input", "absent.de"], "--input absent.de: no such file; name a file of sentences"),
        (["--format", "xml"], "argument --format: invalid choice: 'xml'"),
        (["--batch-size", "0"], "argument --batch-size: must be a whole number >= 1, got '0'"),
        (["--threads", "0"], "argument --threads: must be a whole number >= 1, got '0'"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_bad_new_options_exit_2_with_one_line_before_loading(option, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main("--checkpoint", tmp_path / "none.pt", *option)
    err += capsys.readouterr().err
    assert code == 2 and out == "" and err.startswith(f"translate: error: {message}"), err
    assert len(err.splitlines()) == 1 and "none.pt" not in err


def test_input_with_sentences_or_onto_itself_is_refused(ckpt, tmp_path):
    source = tmp_path / "in.de"
    source.write_text(FEW[0] + "\n")
    code, _, err = run_main("--checkpoint", ckpt, "--input", source, "Ein Hund.")
    assert code == 2 and err == "translate: error: sentences given both as arguments and by --input: drop one of them\n"
    code, _, err = run_main("--checkpoint", ckpt, "--input", source, "--output", source, "--force")
    assert code == 2 and "is the --input file" in err and source.read_text() == FEW[0] + "\n"


def test_batch_size_and_threads_reach_the_search_and_threads_are_restored(ckpt, monkeypatch):
    from annotated.decoding import translate as module

    seen = []

    def recording(model, sources, beam_size, length_penalty, **kwargs):
        seen.append((kwargs["batch_size"], torch.get_num_threads()))
        return translate_ids(model, sources, beam_size, length_penalty, **kwargs)

    monkeypatch.setattr(module, "translate_ids", recording)
    before = torch.get_num_threads()
    _, want, _ = run_main("--checkpoint", ckpt, *FEW)
    code, out, _ = run_main("--checkpoint", ckpt, "--batch-size", "1", "--threads", "3", *FEW)
    assert code == 0 and out == want  # each sentence's search is independent of its batch (float32)
    assert seen == [(64, before), (1, 3)] and torch.get_num_threads() == before


# --- word alignments ----------------------------------------------------------


def test_alignment_reads_the_head_given_or_the_checkpoints_and_is_refused_without_one(ckpt, loaded, tmp_path):
    """--alignment-head 0,1, or the checkpoint's meta `alignment_head`: each hypothesis' pairs are those
    `alignment` reads from that head for its ids (`annotated/decoding/alignment.py`). A checkpoint that names
    no head (and has no circuits.json beside it) is refused in one line naming both fixes."""
    from annotated.checkpoint import with_meta
    from annotated.decoding.alignment import alignment, pharaoh

    model, tok = loaded
    named = tmp_path / "named.pt"
    with_meta(ckpt, named, alignment_head=[0, 1])
    runs = [
        run_main(
            "--checkpoint",
            ckpt,
            "--beam",
            "2",
            "--nbest",
            "2",
            "--alignment",
            "--alignment-head",
            "0,1",
            "--format",
            "jsonl",
            *FEW,
        ),
        run_main("--checkpoint", named, "--beam", "2", "--nbest", "2", "--alignment", "--format", "jsonl", *FEW),
    ]
    assert runs[0] == runs[1] and runs[0][0] == 0
    for sentence, line in zip(FEW, runs[0][1].splitlines()):
        hyps = json.loads(line)["hypotheses"]
        found = translate_ids(model, [tok.encode(sentence)], 2, 0.6, nbest=2)[0]
        assert [h["alignment"] for h in hyps] == [
            pharaoh(alignment(model, tok, tok.encode(sentence), f.ids, (0, 1))) for f in found
        ]
        assert all(h["alignment"] for h in hyps)
    code, out, err = run_main("--checkpoint", ckpt, "--alignment", *FEW)
    assert code == 2 and out == "" and len(err.splitlines()) == 1
    assert err == (
        f"translate: error: checkpoint {ckpt} names no cross-attention head to align with: run make circuits "
        f"CHECKPOINT={ckpt} (it names the head that aligns best, beside the checkpoint), or add --alignment-head "
        "LAYER,HEAD\n"
    )


def test_alignment_reads_the_head_make_circuits_wrote_beside_the_checkpoint(ckpt, tmp_path):
    """The `best_cross_head` of the circuits.json beside the checkpoint, when that report names this checkpoint
    and was written after it; a report of another checkpoint, an older one, or one without the aligner's head is
    not read, and the translator refuses as without a report."""
    import shutil

    model = tmp_path / "imported.pt"
    shutil.copy(ckpt, model)
    want = run_main("--checkpoint", model, "--alignment", "--alignment-head", "0,1", "--format", "jsonl", *FEW)
    assert want[0] == 0
    report = tmp_path / "circuits.json"

    def aligned(**entries):
        report.write_text(json.dumps({"checkpoint": "imported.pt", "best_cross_head": ["cross", 0, 1], **entries}))
        return run_main("--checkpoint", model, "--alignment", "--format", "jsonl", *FEW)

    assert aligned() == want
    assert aligned(checkpoint="elsewhere/best.pt")[0] == 2
    assert aligned(best_cross_head=None)[0] == 2  # make circuits --no-aligner ranks no head
    assert aligned() == want
    os.utime(report, (0, 0))  # a report older than the checkpoint was not written for it
    assert run_main("--checkpoint", model, "--alignment", *FEW)[0] == 2


@pytest.mark.parametrize("beam", [1, 4])
@pytest.mark.parametrize("quantize", [[], ["--quantize", "int8"]], ids=["float32", "int8"])
def test_alignment_in_text_with_every_option(ckpt, beam, quantize):
    """Text: `LINE ||| translation ||| log P ||| score ||| pairs`; the translation that of the plain output;
    each pair within the line's source and target words."""
    _, plain, _ = run_main("--checkpoint", ckpt, "--beam", beam, *quantize, *FEW)
    code, out, err = run_main(
        "--checkpoint", ckpt, "--beam", beam, "--scores", "--alignment", "--alignment-head", "0,0", *quantize, *FEW
    )
    assert code == 0, err
    rows = [line.split(" ||| ") for line in out.splitlines()]
    assert [r[1] for r in rows] == plain.splitlines() and all(len(r) == 5 for r in rows)
    for (_, text, _, _, pairs), source in zip(rows, FEW):
        links = [tuple(map(int, pair.split("-"))) for pair in pairs.split()]
        assert links and all(i < len(source.split()) and j < len(text.split()) for i, j in links)


@pytest.mark.parametrize(
    "option, message",
    [
        (["--alignment-head", "1"], "argument --alignment-head: write LAYER,HEAD, two whole numbers >= 0, e.g. 1,2"),
        (["--alignment-head", "0,5"], "--alignment-head 0,5: checkpoint"),
    ],
)
def test_a_bad_alignment_head_is_one_line(ckpt, option, message, capsys):
    code, out, err = run_main("--checkpoint", ckpt, "--alignment", *option, "Ein Hund.")
    err += capsys.readouterr().err
    assert code == 2 and out == "" and err.startswith(f"translate: error: {message}") and len(err.splitlines()) == 1


def test_the_help_links_part_v_of_the_book_for_alignment(capsys):
    """--alignment's help names the book's Part V by its anchor, which is Part V's."""
    from docs.build import PARTS

    assert main(["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert text.count("the book's Part V: make docs, docs/_build/index.html#part-5; docs/circuits.md") == 1
    _, title, chapters = next(part for part in PARTS if part[0] == "part-5")
    assert title.startswith("Part V.") and chapters and all(c.startswith("circuits/") for c in chapters)


@pytest.fixture(scope="module")
def imported(ckpt, loaded, tmp_path_factory):
    """A Marian model in OPUS-MT's layout with the tiny checkpoint's tokenizer, brought in by `make import`."""
    pytest.importorskip("transformers")
    from interop.test_marian_files import opus_like_folder

    from annotated.interop.folders import main as folders

    folder = tmp_path_factory.mktemp("opus")
    hf = opus_like_folder(loaded[1], folder / "hf")
    assert folders(["import", str(hf), str(folder / "opus.pt"), "--src", "de", "--tgt", "en"]) == 0
    return folder / "opus.pt"


@pytest.mark.parametrize("beam, nbest", [(4, 3), (1, 1)], ids=["beam 4", "beam 1"])
@pytest.mark.parametrize("quantize", [[], ["--quantize", "int8"]], ids=["float32", "int8"])
@pytest.mark.parametrize("model", ["shipped:de-en", "shipped:en-de", "imported"])
def test_files_nbest_scores_alignment_jsonl_together(model, quantize, beam, nbest, imported, tmp_path):
    """`--input f --output g --nbest 3 --scores --alignment --format jsonl` (beam 4; --nbest 1 at beam 1) on both
    shipped models, with the head they carry, and on an imported Marian model, with a head given: one object a
    line, the best hypothesis the plain output's translation, scores best first, each pair within its words."""
    checkpoint = [imported, "--alignment-head", "0,3"] if model == "imported" else [model]
    sentences = ["Ein Hund rennt über die Wiese.", "Zwei Männer spielen Fußball."]
    if model == "shipped:en-de":
        sentences = ["A dog runs across the meadow.", "Two men play football."]
    source, target = tmp_path / "f", tmp_path / "g"
    source.write_text("".join(f"{s}\n" for s in sentences), encoding="utf-8")
    options = ["--device", "cpu", "--beam", beam, *quantize, "--checkpoint", *checkpoint]
    code, plain, err = run_main(*options, *sentences)
    assert code == 0, err
    asked = ["--input", source, "--output", target, "--nbest", nbest, "--scores", "--alignment", "--format", "jsonl"]
    code, out, err = run_main(*options, *asked)
    assert code == 0 and out == "", err
    objects = [json.loads(line) for line in target.read_text(encoding="utf-8").splitlines()]
    assert [(o["line"], o["source"]) for o in objects] == list(enumerate(sentences))
    assert [o["hypotheses"][0]["translation"] for o in objects] == plain.splitlines()
    for o in objects:
        hyps = o["hypotheses"]
        assert len(hyps) == nbest and [h["score"] for h in hyps] == sorted((h["score"] for h in hyps), reverse=True)
        for h in hyps:
            assert h["log_prob"] <= 0 and set(h) == {"translation", "log_prob", "score", "alignment"}
            links = [tuple(map(int, pair.split("-"))) for pair in h["alignment"].split()]
            assert all(i < len(o["source"].split()) and j < len(h["translation"].split()) for i, j in links)
            assert links or model == "imported"  # a random model may put every row on </s>: no pair
