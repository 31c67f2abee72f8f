"""Commands run in a child process by the Ctrl-C tests: when the child is past its interpreter's own start.

A Ctrl-C sent a fixed time after the start can arrive before the interpreter has installed any handler when
the machine is busy (the child is then killed by SIGINT, return code -2, with nothing on stderr). Run the
child with `-X importtime` (one stderr line per finished import) and wait for the first import after the
package `annotated` (whose `__init__.py` installs a command's quiet handler, annotated/plumbing/scripts.py; a console
script installs it right after): by then the handler is in place, and the heavy imports are under way. `said(err)` is stderr without those lines.
"""

from __future__ import annotations

import subprocess

IMPORT_TIMES = ["-X", "importtime"]


def wait_past_the_quiet_handler(p: subprocess.Popen, after: str = "annotated") -> str:
    """Read the child's stderr (text mode) up to the first import after module `after` (the package, whose
    `__init__.py` installs a command's handler; a console script's function installs it before its next import);
    return it. Only a module not imported before counts as the next import."""
    seen, done, err = False, set(), ""
    while True:
        line = p.stderr.readline()
        assert line, f"the child ended before its imports: {err[-800:]}"
        err += line
        if not line.startswith("import time:"):
            continue
        module = line.rsplit("|", 1)[-1].strip()
        if seen and module not in done:  # (a module is told again as each import that reaches it ends)
            return err
        seen = seen or module == after
        done.add(module)


def said(err: str) -> str:
    """stderr without the `-X importtime` lines."""
    return "".join(line for line in err.splitlines(keepends=True) if not line.startswith("import time:"))
