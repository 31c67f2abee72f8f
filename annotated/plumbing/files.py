"""Files written whole or not at all: the project's one atomic write (`atomic_write`; a folder:
`staged_directory`), its one permission policy, and what every command shares: `save_figure`, `json_safe`.

Every file the project writes for the user (checkpoints, cached data and tokenizers, results, attention
dumps, pages, benchmark results) goes through `atomic_write`: the bytes go to a temporary file in the same
directory, are flushed to disk, and `os.replace` renames it over the target. On POSIX that rename is
atomic, so a reader sees the old file or the new one, never half of one, and a crash or Ctrl-C in the
middle leaves the old file as it was.

Files and folders get the modes a plain `open` or `mkdir` would give them, the umask's, not `tempfile`'s private
ones (`new_file_mode`; `test_a_published_folder_gets_the_mode_of_the_umask`).

**Leftovers of a killed write.** A process killed outright (`kill -9`, the out-of-memory killer) leaves
`.<name>.<random>.tmp` beside the target, which nothing reads. Each writer holds an exclusive `flock` on its
temporary file until the rename, so the next successful write of the same target deletes exactly the leftovers
that no living writer holds (`remove_stale_temporaries`).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

try:
    import fcntl  # POSIX; without it (Windows) stale temporary files are left alone
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]  # the module or None: the checks below ask which

Content = bytes | str | Callable[[BinaryIO], None]


def new_file_mode(base: int = 0o666) -> int:
    """The permissions a plain `open(path, "w")` would give a new file: `base` less the umask.

    With `base=0o777` it is the mode `mkdir` gives a directory.

    >>> old = os.umask(0o027); mode = new_file_mode(); _ = os.umask(old); oct(mode)
    '0o640'
    """
    mask = os.umask(0)  # reading the umask means setting it; put it straight back
    os.umask(mask)
    return base & ~mask


def atomic_write(path: os.PathLike | str, content: Content) -> Path:
    """Write `content` (bytes, text as UTF-8, or a function that writes to a binary file) to `path`
    via a locked temporary file in the same directory and an atomic rename. Returns the path.

    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "a.txt"
    >>> atomic_write(p, "hello").read_text(), atomic_write(p, b"bye").read_text()
    ('hello', 'bye')
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            if fcntl is not None:  # "being written": held until this file is closed
                with contextlib.suppress(OSError):  # a file system without locks: only cleaning relies on it
                    fcntl.flock(f, fcntl.LOCK_EX)
            if callable(content):
                content(f)
            else:
                f.write(content.encode("utf-8") if isinstance(content, str) else content)
            f.flush()
            os.fsync(f.fileno())
            os.chmod(tmp, new_file_mode())
            os.replace(tmp, path)  # still locked, so no cleaner can take it for a leftover
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    remove_stale_temporaries(path)
    return path


def remove_stale_temporaries(path: os.PathLike | str) -> list[Path]:
    """Delete the `.<name>.*.tmp` files of `path` that no living writer holds; returns them."""
    path = Path(path)
    removed: list[Path] = []
    if fcntl is None:
        return removed
    for tmp in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        try:
            with open(tmp, "rb") as f:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # fails while a writer holds it
                os.unlink(tmp)
        except OSError:  # in use (BlockingIOError), renamed or removed meanwhile, or no locks here
            continue
        removed.append(tmp)
    return removed


@contextlib.contextmanager
def staged_directory(out: os.PathLike | str, check: Callable[[Path], None] = lambda out: None) -> Iterator[Path]:
    """Yield a new temporary folder beside `out` that becomes `out` only if the block succeeds, with the mode of
    the umask. `check(out)` runs before the work and again just before the rename (it raises to refuse an `out`
    that is not the caller's to replace); an old `out` is replaced whole. On any error the folder is removed."""
    out = Path(out)
    check(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        yield staging
        _modes_of_the_umask(staging)
        check(out)  # still the caller's to replace after the work
        old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old-")) if out.exists() else None
        if old is not None:
            os.replace(out, old / out.name)
        os.replace(staging, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _modes_of_the_umask(folder: Path) -> None:
    """Give `folder` and all in it the modes that mkdir and open would: mkdtemp's folder is 0o700, and some
    writers (safetensors) make their files 0o600. Executable files stay executable."""
    os.chmod(folder, new_file_mode(0o777))
    for path in folder.rglob("*"):
        if not path.is_symlink():
            executable = path.is_dir() or path.stat().st_mode & 0o100
            os.chmod(path, new_file_mode(0o777 if executable else 0o666))


def sha256_of(path: os.PathLike | str) -> str:
    """The sha256 of a file's bytes, in hex, read 1 MiB at a time (the checks of downloads and of the box)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def save_figure(fig, path: os.PathLike | str, dpi: float | None = None) -> Path:
    """Write a matplotlib figure to `path` as PNG through `atomic_write` (the figure's own dpi unless `dpi`).

    A figure that fails to draw leaves an earlier file at `path` as it was
    (`test_save_figure_is_atomic`)."""
    options = {} if dpi is None else {"dpi": dpi}
    return atomic_write(path, lambda f: fig.savefig(f, format="png", **options))


def json_safe(value: Any, digits: int | None = None) -> Any:
    """`value` made fit for `json.dumps`: dict keys become strings, tuples lists, numpy arrays and scalars
    Python lists and numbers, NaN and infinities None (JSON has no such numbers), floats rounded to `digits`
    when given, and anything else its repr.

    >>> import numpy as np
    >>> json_safe({1: (np.float32(0.5), float("nan")), "x": np.arange(2), "f": 2 / 3}, digits=3)
    {'1': [0.5, None], 'x': [0, 1], 'f': 0.667}
    >>> json_safe({"path": Path("a")})
    {'path': "PosixPath('a')"}
    """
    if isinstance(value, dict):
        return {str(k): json_safe(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v, digits) for v in value]
    if hasattr(value, "tolist") and callable(value.tolist):  # numpy arrays and scalars, tensors
        return json_safe(value.tolist(), digits)
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        return value if digits is None else round(value, digits)
    if value is None or isinstance(value, (str, int, bool)):
        return value
    return repr(value)
