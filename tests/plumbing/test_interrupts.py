"""annotated/plumbing/interrupts.py: a Ctrl-C raises KeyboardInterrupt only where it can reach `run_command`.

A signal handler runs at whatever bytecode comes next. Raised inside a garbage-collector callback, a `__del__`
or a weakref callback, the KeyboardInterrupt is printed as "Exception ignored in" and dropped, and the command
goes on; raised inside code run by `exec` of a string, it marks the interpreter, and `python -m` then ends
killed by SIGINT (return code -2) whatever `sys.exit` says. The child below spends nearly all its time in one
such place and the rest in plain code; a Ctrl-C at any moment must give exit code 130 and the one line.
The console scripts go through the same protocol (annotated/plumbing/scripts.py).
"""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import tomllib
from children import IMPORT_TIMES, said, wait_past_the_quiet_handler

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]
GUARD = 120  # seconds: a guard against a hung child (a swallowed Ctrl-C), never a timing assertion

WORK = textwrap.dedent('''
    """Work that is mostly in places where an exception cannot pass: PLACE."""
    import gc, sys, time, weakref
    from annotated.plumbing.interrupts import run_command

    def busy(*_):
        deadline = time.monotonic() + 0.002
        while time.monotonic() < deadline:
            pass

    def in_a_weakref_callback(_):
        busy()

    class Finalised:
        def __del__(self):
            busy()

    class Target:
        pass

    def main():
        if "PLACE" == "gc callback":
            gc.callbacks.append(busy)
        print("working", file=sys.stderr, flush=True)
        keep = []
        while True:
            if "PLACE" == "exec":
                exec("busy()")
            elif "PLACE" == "__del__":
                Finalised()
            elif "PLACE" == "weakref callback":
                keep.append(weakref.ref(Target(), in_a_weakref_callback))
                keep.clear()
            else:
                [[] for _ in range(1000)]  # allocations: the collector runs, and its callbacks

    if __name__ == "__main__":
        run_command(main, "work")
''')


def env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT))


@pytest.mark.parametrize("place", ["gc callback", "__del__", "weakref callback", "exec"])
def test_ctrl_c_in_code_that_cannot_pass_an_exception_on_still_exits_130(place, tmp_path):
    """Three Ctrl-C at staggered moments, each in a fresh `python -m` process: 130, one line, no traceback."""
    (tmp_path / "work.py").write_text(WORK.replace("PLACE", place))
    for delay in (0.02, 0.1, 0.3):
        p = subprocess.Popen(
            [sys.executable, "-m", "work"],
            cwd=tmp_path,
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert p.stderr.readline() == "working\n"
            time.sleep(delay)
            p.send_signal(signal.SIGINT)
            _out, err = p.communicate(timeout=GUARD)
        finally:
            if p.poll() is None:
                p.kill()
        assert (p.returncode, err) == (130, "\nwork: interrupted\n"), (delay, p.returncode, err[-1500:])


def script(name: str, folder: Path) -> list[str]:
    """The console script `name` as `pip install` writes it (a file named `name` that calls the entry point and
    exits with its value), in `folder`."""
    module, function = SCRIPTS[name].split(":")
    wrapper = folder / name
    wrapper.write_text(f"import sys\nfrom {module} import {function}\nsys.exit({function}())\n")
    return [sys.executable, *IMPORT_TIMES, str(wrapper)]


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_console_scripts_exit_130_on_ctrl_c_while_torch_loads(name, tmp_path, tmp_path_factory):
    p = subprocess.Popen(
        script(name, tmp_path_factory.mktemp("bin")),
        cwd=tmp_path,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_past_the_quiet_handler(p)  # inside the command's imports (torch: > 1 s)
        p.send_signal(signal.SIGINT)
        _out, err = p.communicate(timeout=GUARD)
    finally:
        if p.poll() is None:
            p.kill()
    command = name.removeprefix("annotated-")  # its name, as the python -m command has it
    assert (p.returncode, said(err)) == (130, f"{command}: interrupted\n"), (p.returncode, said(err)[-800:])
    assert not list(tmp_path.iterdir())


def test_a_console_script_stopped_while_it_works_exits_130_without_a_traceback(tmp_path, tmp_path_factory):
    """`annotated-equivalence` past its imports (its progress bar is up): one line, 130."""
    p = subprocess.Popen(
        [*script("annotated-equivalence", tmp_path_factory.mktemp("bin")), "--examples", "100000"],
        cwd=tmp_path,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        err = b""
        while b"per-head = fused" not in err:
            chunk = p.stderr.read1(4096)
            assert chunk, err.decode(errors="replace")
            err += chunk
        p.send_signal(signal.SIGINT)
        _out, rest = p.communicate(timeout=GUARD)
    finally:
        if p.poll() is None:
            p.kill()
    err = said((err + rest).decode(errors="replace"))
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip()]
    assert p.returncode == 130 and "Traceback" not in err and lines[-1] == "equivalence: interrupted", err[-800:]
