"""Progress of a long loop: a bar with its total and ETA on a terminal, plain lines in a log file.

`progress(total, desc)` returns an object with `update(n=1)`, `set_postfix_str(text)` and `close()` (also a
context manager). When the stream (stderr by default) is a terminal it is a `tqdm` bar that knows its total,
so it shows the count, the rate and the time left. When the stream is a file or a pipe, a bar's carriage
returns would fill the log with fragments; instead it writes one plain line at the start and one at every tenth
of the way (the last at the end), each with the count, the elapsed time and the estimated time left:

>>> import io
>>> log = io.StringIO()
>>> with progress(total=20, desc="ablation", stream=log) as bar:
...     for _ in range(20):
...         bar.update()
>>> lines = log.getvalue().splitlines()
>>> lines[0], len(lines), lines[-1].startswith("ablation: 20/20 (100%)")
('ablation: 0/20', 11, True)
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import TextIO, TypeVar

T = TypeVar("T")
LINES = 10  # plain lines between start and end


class PlainProgress:
    """Lines, not a bar: `desc: done/total (pct), elapsed s, about N s left`."""

    def __init__(self, total: int, desc: str, stream: TextIO):
        self.total, self.desc, self.stream = max(int(total), 0), desc, stream
        self.done, self.start, self.next_line, self.postfix = 0, time.monotonic(), 1, ""
        self._write(f"{desc}: 0/{self.total}")

    def _write(self, line: str) -> None:
        print(line, file=self.stream, flush=True)

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.total and (self.done * LINES >= self.next_line * self.total or self.done >= self.total):
            self.next_line = self.done * LINES // self.total + 1
            elapsed = time.monotonic() - self.start
            left = elapsed / self.done * (self.total - self.done) if self.done else 0.0
            extra = f", {self.postfix}" if self.postfix else ""
            self._write(
                f"{self.desc}: {self.done}/{self.total} ({self.done / self.total:.0%}), "
                f"{elapsed:.0f} s, about {left:.0f} s left{extra}"
            )

    def set_postfix_str(self, text: str) -> None:
        self.postfix = text

    def close(self) -> None:
        if self.done < self.total:  # a loop that ended early (a search that stopped) says where
            self._write(f"{self.desc}: ended at {self.done}/{self.total}, {time.monotonic() - self.start:.0f} s")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress(total: int, desc: str, unit: str = "it", stream: TextIO | None = None):
    """A tqdm bar with `total` (and so an ETA) when `stream` is a terminal, else a `PlainProgress`."""
    stream = sys.stderr if stream is None else stream
    if getattr(stream, "isatty", lambda: False)():
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, unit=unit, file=stream, leave=False)
    return PlainProgress(total, desc, stream)


def tracked(items: Iterable[T], total: int, desc: str, unit: str = "it", enabled: bool = True) -> Iterator[T]:
    """`items`, reporting through `progress` as each one is consumed (nothing at all when not `enabled`)."""
    if not enabled:
        yield from items
        return
    with progress(total, desc, unit) as bar:
        for item in items:
            yield item
            bar.update(1)
