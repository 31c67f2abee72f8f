"""Commands run in a child process by the Ctrl-C tests: when the child is past its interpreter's own start.

A Ctrl-C sent a fixed time after the start can arrive before the interpreter has installed any handler when
the machine is busy (the child is then killed by SIGINT, return code -2, with nothing on stderr). Run the
child with `-X importtime` (one stderr line per finished import) and wait for the first import after
`annotated.plumbing.interrupts`: by then the command's quiet handler is in place, and the heavy imports are
under way. `said(err)` is stderr without those lines.
"""

from __future__ import annotations

import subprocess

IMPORT_TIMES = ["-X", "importtime"]


def wait_past_the_quiet_handler(p: subprocess.Popen, after: str = "annotated.plumbing.interrupts") -> str:
    """Read the child's stderr (text mode) up to the first import after module `after` (the protocol's module,
    whose handler a command installs next; for a console script, the scripts module, whose function installs it);
    return it."""
    seen, err = False, ""
    while True:
        line = p.stderr.readline()
        assert line, f"the child ended before its imports: {err[-800:]}"
        err += line
        if line.startswith("import time:") and seen:
            return err
        seen = seen or line.rstrip().endswith(f" {after}")


def said(err: str) -> str:
    """stderr without the `-X importtime` lines."""
    return "".join(line for line in err.splitlines(keepends=True) if not line.startswith("import time:"))
