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

Options that make no sense are refused by `annotated/plumbing/options.py` (one line on
stderr naming the option and what it takes, exit code 2, before any work).
"""
import contextlib
import functools
import os
import signal
import sys
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
