"""What the commands (`make equivalence`, `make bench`, `make attention`, `make docs`, and the
translator while it starts) do on Ctrl-C.

One line on stderr, exit code 130 (the shell's code for "stopped by Ctrl-C"),
no traceback. A Ctrl-C that lands while PyTorch's C++ code is calling back
into Python can reach the caller as another error (the KeyboardInterrupt is
turned into a RuntimeError on the way out); `ctrl_c_requested()` tells such an
error from a real one, so that it is not reported as a failed check.

Training is the one command that stops in order: the first Ctrl-C (or
SIGTERM) asks it to stop after the current step and save (`StopFlag`), a
second one stops at once.

Options that make no sense are refused the same way everywhere: one line on
stderr naming the option and what it takes, exit code 2, before any data or
model work (`ArgumentParser` and the `positive_int`-style types below).
"""
import argparse
import contextlib
import functools
import math
import os
import signal
import sys
from pathlib import Path
from typing import Callable, Optional

_requested = False


def ctrl_c_requested() -> bool:
    """Whether a Ctrl-C arrived while `run_command` ran."""
    return _requested


def _on_sigint(signum, frame):
    global _requested
    _requested = True
    raise KeyboardInterrupt


def _exit_while_starting(name: Optional[str], signum, frame):
    if name:
        print(f"{name}: interrupted", file=sys.stderr, flush=True)
    os._exit(130)


def quiet_ctrl_c_while_starting(name: Optional[str]) -> None:
    """Call before the heavy imports: a Ctrl-C while torch loads exits 130 at once, after the line
    "<name>: interrupted" (no line when `name` is None).

    Nothing has been computed or written yet, and a KeyboardInterrupt raised inside `import torch` would
    otherwise end in a traceback. `run_command` replaces this handler once the command's own work begins;
    a command without it checks `still_starting()` and hands Ctrl-C back itself."""
    signal.signal(signal.SIGINT, functools.partial(_exit_while_starting, name))


def still_starting() -> bool:
    """True while the handler of `quiet_ctrl_c_while_starting` is the one in place."""
    handler = signal.getsignal(signal.SIGINT)
    return isinstance(handler, functools.partial) and handler.func is _exit_while_starting


def run_command(main: Callable[[], object], name: str) -> None:
    """Run a command's `main()` and exit with its code (0 when it returns no int); Ctrl-C: one line, 130.

    A Ctrl-C anywhere counts, even one an extension swallowed: what `main()` did after it is not trusted."""
    signal.signal(signal.SIGINT, _on_sigint)
    code = None
    try:
        code = main()
    except Exception:  # possibly a KeyboardInterrupt changed into another error inside an extension
        if not _requested:
            raise
    except KeyboardInterrupt:
        pass
    if _requested:
        print(f"\n{name}: interrupted", file=sys.stderr)  # (a new line: a progress bar may be open)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


@contextlib.contextmanager
def starting(name: Optional[str]):
    """`quiet_ctrl_c_while_starting(name)` for the block (the heavy imports), then the previous handler again."""
    previous = signal.getsignal(signal.SIGINT)
    quiet_ctrl_c_while_starting(name)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class StopFlag:
    """Within the block, the first Ctrl-C (SIGINT) or SIGTERM only sets `requested` (stop after the current
    step); a second one raises KeyboardInterrupt at once. The previous handlers come back at the block's end."""

    def __init__(self):
        self.requested = False
        self._old = {}

    def _handler(self, signum, frame):
        if self.requested:  # a second Ctrl-C: stop now
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> "StopFlag":
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._handler)
            except ValueError:  # not the main thread: no signals here
                pass
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


# Command-line misuse: one line, exit 2.

class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors: "<prog>: error: <what>; see <prog> --help" on stderr, exit code 2."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message}; see {self.prog} --help", file=sys.stderr)
        sys.exit(2)


def positive_int(text: str) -> int:
    """An int >= 1 (an argparse type).

    >>> positive_int("3")
    3
    >>> positive_int("0")
    Traceback (most recent call last):
    argparse.ArgumentTypeError: 0 is not a positive whole number (>= 1)
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive whole number (>= 1)")
    return value


def non_negative_int(text: str) -> int:
    """An int >= 0 (an argparse type)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is negative; give 0 or more")
    return value


def positive_float(text: str) -> float:
    """A finite float > 0 (an argparse type).

    >>> positive_float("nan")
    Traceback (most recent call last):
    argparse.ArgumentTypeError: nan is not a positive finite number
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text} is not a positive finite number")
    return value


def writable_dir(text: str) -> Path:
    """A folder that exists and is writable, or can be created (its nearest existing parent is a writable
    folder); nothing is created here (an argparse type)."""
    path = Path(text).expanduser()
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: {probe} is a file, not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text}: {probe} is not writable; choose a folder you can write to")
    return path


def check_device(name: Optional[str]):
    """The torch.device for a --device value (None: cuda when available, else cpu), or ValueError saying why
    it cannot be used: not a device name, not one that trains (meta), or absent on this machine."""
    import torch

    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name}: not a device name; use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"--device {name}: CUDA is not available on this machine (torch "
                             f"{torch.__version__}); use --device cpu")
        if device.index is not None and device.index >= count:
            raise ValueError(f"--device {name}: this machine has {count} GPU(s), cuda:0 to cuda:{count - 1}")
    elif device.type != "cpu":
        raise ValueError(f"--device {name}: training runs on cpu or cuda, not {device.type}")
    return device
