"""What every command does on Ctrl-C: one protocol, two calls.

`quiet_ctrl_c_while_starting(name)` before the heavy imports, `run_command(main, name)` for the work. No command
calls them itself: `annotated/plumbing/scripts.py` does, for every command (the `python -m` modules, `train_wmt.py`,
the console scripts), with the name it gives each command there
(`test_every_command_follows_the_one_ctrl_c_protocol`; what each command does: `docs/faults.md`).

A Ctrl-C prints one line on stderr, `<name>: interrupted`, and exits with code 130, without a traceback: at
once while a module is imported (`importing`: interrupting an extension's start-up can abort the process), else
as a KeyboardInterrupt raised only at a line of the project's own code from where it reaches `main()`'s caller in
order (`can_be_caught_at`), so that `finally` blocks and atomic writes clean up; elsewhere it is raised at the next
such line. Why, and where not: `docs/faults.md#the-other-commands`. A Ctrl-C that PyTorch's
C++ code turns into another error still counts as one (`ctrl_c_requested()`). A `main()` that reports the
interruption itself returns 130, and `run_command` adds no second line.

Training is the one command that stops in order: the first Ctrl-C (or SIGTERM) asks it to stop after the
current step and save (`StopFlag`), a second one stops at once.
"""

import functools
import gc
import os
import signal
import sys
from collections.abc import Callable

INTERRUPTED = 130
_requested = False


def ctrl_c_requested() -> bool:
    """Whether a Ctrl-C arrived while `run_command` ran."""
    return _requested


def _exit_at_once(name: str) -> None:
    print(f"{name}: interrupted", file=sys.stderr, flush=True)
    os._exit(INTERRUPTED)


def importing(frame) -> bool:
    """Whether `frame` runs inside an import (importlib's frames are on its stack).

    >>> import sys
    >>> importing(sys._getframe())
    False
    """
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # annotated/
_own_files = {_PACKAGE}  # and the running command's own file (run_command adds it)


def _own(code) -> bool:
    """Whether `code` is the project's own (the package, or the command's file), not a library's."""
    return code.co_filename.startswith(_PACKAGE + os.sep) or code.co_filename in _own_files


def can_be_caught_at(frame) -> bool:
    """Whether a KeyboardInterrupt raised now at `frame` reaches `run_command`'s caller in order: `frame` is the
    project's own code (whose `finally` blocks are written for it), and no frame between it and `run_command`
    is code that cannot pass an exception on (a garbage-collector callback, a `__del__`, code run by `exec` or
    `eval` of a string).

    >>> import sys
    >>> can_be_caught_at(sys._getframe(0))  # a doctest's frame: not the project's own code
    False
    >>> def own(): return can_be_caught_at(sys._getframe())
    >>> own.__code__ = own.__code__.replace(co_filename=__file__)
    >>> own(), eval("own()")
    (True, False)
    """
    return _own(frame.f_code) and _passes_on(frame)


def _passes_on(frame) -> bool:
    """No frame between `frame` and `run_command` is code that cannot pass an exception on."""
    callbacks = {getattr(cb, "__code__", None) for cb in gc.callbacks}
    while frame is not None and (code := frame.f_code) is not run_command.__code__:
        if (
            code in callbacks
            or code.co_name == "__del__"
            or (code.co_filename, code.co_name) == ("<string>", "<module>")
        ):
            return False  # a garbage-collector callback, a `__del__`, the top of `exec` of a string
        frame = frame.f_back
    return True


def _raise_at_the_next_line_that_can_pass_it_on(frame) -> None:
    """Raise KeyboardInterrupt at the next line that the project's own code runs where it can pass it on: in
    `frame`'s stack once the library code running now returns to it, or in own code that the library calls.
    Until then tracing is on (this thread only): own frames get a trace function, library calls none."""

    def at_next_line(f, event, arg):
        if event == "line" and can_be_caught_at(f):
            sys.settrace(None)
            f.f_trace = None
            raise KeyboardInterrupt
        return at_next_line

    def on_call(f, event, arg):
        return at_next_line if _own(f.f_code) else None

    while frame is not None and frame.f_code is not run_command.__code__:
        if _own(frame.f_code):
            frame.f_trace = at_next_line
        frame = frame.f_back
    sys.settrace(on_call)


def _raise_where_it_can_be_caught(frame) -> None:
    """Raise KeyboardInterrupt here if it can pass on from here, else at the next line where it can."""
    if can_be_caught_at(frame):
        raise KeyboardInterrupt
    _raise_at_the_next_line_that_can_pass_it_on(frame)


def _raise_where_the_dropped_one_would_have_gone(previous, unraisable) -> None:
    """`sys.unraisablehook` while `run_command` runs: a KeyboardInterrupt dropped where the stack did not show it
    (should a library catch it and report it as unraisable) is raised again at the next line where it can pass
    on, and nothing is printed. Any other unraisable exception is printed as ever."""
    if issubclass(unraisable.exc_type, KeyboardInterrupt):
        _raise_at_the_next_line_that_can_pass_it_on(sys._getframe(1))
        return
    previous(unraisable)


def _while_running(name: str, signum, frame) -> None:
    global _requested
    again, _requested = _requested, True
    if importing(frame):
        _exit_at_once(name)
    if again and _passes_on(frame):  # a second Ctrl-C: at once, even inside a library that runs long
        sys.settrace(None)
        raise KeyboardInterrupt
    _raise_where_it_can_be_caught(frame)


def quiet_ctrl_c_while_starting(name: str) -> None:
    """Call first, before the heavy imports: a Ctrl-C while torch loads prints "<name>: interrupted" and exits
    130 at once. `run_command` replaces this handler when the command's own work begins."""
    signal.signal(signal.SIGINT, lambda signum, frame: _exit_at_once(name))


def run_command(main: Callable[[], object], name: str) -> None:
    """Run a command's `main()` and exit with its code (0 when it returns no int); Ctrl-C: one line, 130.

    A Ctrl-C anywhere counts, even one an extension swallowed: what `main()` did after it is not trusted."""
    _own_files.add(main.__code__.co_filename)
    signal.signal(signal.SIGINT, functools.partial(_while_running, name))
    sys.unraisablehook = functools.partial(_raise_where_the_dropped_one_would_have_gone, sys.unraisablehook)
    code = None
    try:
        code = main()
    except Exception:  # possibly a KeyboardInterrupt changed into another error inside an extension
        if not _requested:
            raise
    except KeyboardInterrupt:
        pass
    if _requested:
        if code != INTERRUPTED:  # main() did not say so itself
            print(f"\n{name}: interrupted", file=sys.stderr)  # (a new line: a progress bar may be open)
        sys.exit(INTERRUPTED)
    sys.exit(code if isinstance(code, int) else 0)


class StopFlag:
    """Within the block, the first Ctrl-C (SIGINT) or SIGTERM only sets `requested` (stop after the current
    step); a second one raises KeyboardInterrupt at once. The previous handlers come back at the block's end."""

    def __init__(self):
        self.requested = False
        self._old = {}

    def _handler(self, signum, frame):
        if self.requested:  # a second Ctrl-C: stop now
            _raise_where_it_can_be_caught(frame)
            return
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
