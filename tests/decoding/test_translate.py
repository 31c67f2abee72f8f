"""annotated/decoding/translate.py: the command line, its input rules, and finding the checkpoint.

The checkpoint is a tiny untrained model with a real sentencepiece tokenizer
(trained on a few sentences), written by `save_checkpoint`. Its translations
are nonsense, so the tests compare the command line's output with the same
search run in this process: the same checkpoint, tokenizer and decoder must
give the same text.
"""
import io
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from annotated.plumbing.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from annotated.training.data import train_tokenizer
from annotated.decoding.translate import main, translate
from annotated.transformer import make_model

ROOT = Path(__file__).resolve().parents[2]
MAX_LEN = 24
TEXTS = ["Ein Hund rennt über die Wiese.", "Zwei Männer spielen Fußball im Park.",
         "A dog runs across the meadow.", "Two men play football in the park.",
         "Eine Frau liest ein Buch.", "A woman reads a book."] * 4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """Path of a tiny checkpoint (model + tokenizer)."""
    d = tmp_path_factory.mktemp("ckpt")
    tok = train_tokenizer(TEXTS, 320, cache_dir=d)
    torch.manual_seed(0)
    model = make_model(src_vocab=tok.vocab_size, tgt_vocab=tok.vocab_size, N=1, d_model=16, d_ff=32, h=2,
                       dropout=0.0, max_len=MAX_LEN, share_embeddings=True, tie_generator=True)
    path = d / "best.pt"
    save_checkpoint(path, model, tok, {"src_lang": "de", "tgt_lang": "en"})
    return path


@pytest.fixture(scope="module")
def loaded(ckpt):
    return load_checkpoint(ckpt)[:2]


def expected(loaded, text, beam=4):
    model, tok = loaded
    return translate(model, tok, text, beam_size=beam)[0]


def run_cli(*args, stdin=b""):
    args = [a if isinstance(a, bytes) else str(a) for a in args]
    return subprocess.run([sys.executable, "-m", "annotated.decoding.translate", *args], input=stdin, capture_output=True,
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)


# --- the command line, in a real process --------------------------------------

def test_sentences_as_arguments(ckpt, loaded):
    unseen = "Ein Hund 🐕 läuft 東京"  # an emoji and characters the tokenizer never saw
    latin1 = b"Stra\xdfe"  # an argument that is not UTF-8
    r = run_cli("--checkpoint", ckpt, "Ein Hund rennt über die Wiese.", unseen, latin1, "--beam", "2")
    assert r.returncode == 0, r.stderr.decode()
    lines = r.stdout.decode("utf-8").split("\n")
    assert lines == [expected(loaded, "Ein Hund rennt über die Wiese.", 2), expected(loaded, unseen, 2),
                     expected(loaded, "Stra\ufffde", 2), ""]
    assert r.stderr.decode() == "argument 3: not valid UTF-8, undecodable bytes replaced by U+FFFD\n"


def test_stdin_serves_line_by_line_and_survives_bad_lines(ckpt, loaded):
    """Each answer is flushed before the next line is sent, so a waiting reader gets it."""
    long_line = " ".join(["Hund"] * 40)
    n_long = len(loaded[1].encode(long_line))
    assert n_long > MAX_LEN
    lines = [b"Ein Hund rennt.", b"", b"   \t", long_line.encode(), b"Stra\xdfe und \xff Hund", b"Eine Frau."]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.Popen([sys.executable, "-m", "annotated.decoding.translate", "--checkpoint", str(ckpt)], cwd=ROOT,
                         env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
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
    cut = loaded[1].decode(loaded[1].encode(long_line)[:MAX_LEN])
    assert answers[3][:-1] == expected(loaded, cut)
    assert answers[4][:-1] == expected(loaded, "Stra\ufffde und \ufffd Hund")
    assert answers[5][:-1] == expected(loaded, "Eine Frau.")  # still serving after all that
    assert "line 2: empty input, printed an empty line" in err
    assert "line 3: empty input, printed an empty line" in err
    assert f"line 4: {n_long} subwords, more than the model's max_len={MAX_LEN}; translated the first {MAX_LEN}" in err
    assert "line 5: not valid UTF-8, undecodable bytes replaced by U+FFFD" in err
    assert "line 1" not in err and "line 6" not in err and "Traceback" not in err


@pytest.mark.parametrize("when", ["while torch loads", "while waiting for a line"])
def test_ctrl_c_exits_130_without_a_traceback(ckpt, when):
    """Ctrl-C is how people stop a translator reading stdin: exit code 130, nothing on stderr, at any moment.

    Python would raise KeyboardInterrupt inside `import torch` (a traceback; on torch 2.11 once an
    abort); the command exits quietly until the model is loaded, then the loop catches it."""
    p = subprocess.Popen([sys.executable, "-m", "annotated.decoding.translate", "--checkpoint", str(ckpt)], cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    killer = threading.Timer(120, p.kill)  # a guard against a hang, not a timing assertion
    killer.start()
    try:
        if when == "while torch loads":
            time.sleep(0.3)  # importing torch takes a second or more here; the outcome is the same at any moment
        else:
            p.stdin.write(b"Ein Hund.\n")
            p.stdin.flush()
            assert p.stdout.readline().endswith(b"\n")  # answered: loaded and waiting for the next line
        p.send_signal(signal.SIGINT)
        rc = p.wait()  # stdin stays open: only the Ctrl-C can end it
        err = p.stderr.read().decode()
    finally:
        killer.cancel()
        p.kill()
    assert rc == 130 and err == "", (rc, err)


def test_a_reader_that_goes_away_ends_it_quietly(ckpt):
    """`... | head -1`: once the reader has closed the pipe, the next answer cannot be written; exit 0, no noise."""
    p = subprocess.Popen([sys.executable, "-m", "annotated.decoding.translate", "--checkpoint", str(ckpt)], cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
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
    stdin = Watched(Generated(5_000_000, "\nEin Hund.\n".encode()), buffer_size=1 << 16)
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
    for phrase in ("empty or whitespace-only line", "more subwords than max_len", "non-UTF-8 bytes",
                   "characters unseen in training", "exit code 2", "--max-extra"):
        assert phrase in text


@pytest.mark.parametrize("option, message", [
    (["--beam", "0"], "argument --beam: must be a whole number >= 1, got '0'"),
    (["--beam", "-2"], "argument --beam: must be a whole number >= 1, got '-2'"),
    (["--length-penalty", "-1"], "argument --length-penalty: must be a finite number >= 0, got '-1'"),
    (["--length-penalty", "nan"], "argument --length-penalty: must be a finite number >= 0, got 'nan'"),
    (["--max-extra", "-3"], "argument --max-extra: must be a whole number >= 0, got '-3'"),
    (["--device", "nonsense"], "argument --device: must be cpu, cuda or cuda:N"),
    (["--device", "tpu"], "argument --device: must be cpu, cuda or cuda:N"),
    (["--device", "meta"], "argument --device: must be cpu, cuda or cuda:N"),
    (["--device", "cuda:99"], "argument --device: 'cuda:99' asked for, but"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
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
        encode = staticmethod(tok.encode)

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
    with pytest.raises(CheckpointError, match="no checkpoint found.*--checkpoint PATH"):
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


def test_without_checkpoint_option_uses_the_latest_run(ckpt, loaded, tmp_path):
    (tmp_path / "runs" / "r1").mkdir(parents=True)
    (tmp_path / "runs" / "r1" / "best.pt").symlink_to(ckpt)
    (tmp_path / "runs" / "latest").symlink_to("r1")
    code, out, err = run_main("--runs-dir", tmp_path / "runs", stdin="Ein Hund.\n".encode())
    assert code == 0 and out == expected(loaded, "Ein Hund.") + "\n"
    assert err == f"translate: using {tmp_path / 'runs' / 'latest' / 'best.pt'}\n"
