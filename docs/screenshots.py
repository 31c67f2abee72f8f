"""`make screenshots`: the README's pictures of the book and of the attention viewer, from the shipped model.

One command makes every screenshot under docs/screenshots/ (`python -m docs.screenshots --help`): it builds the
book with the shipped de->en model into a temporary folder (as `make docs` does with
`CHECKPOINT=annotated/shipped/de-en.pt`), dumps that model's attention for one sentence (as `make attention
CHECKPOINT=shipped:de-en` does), and photographs both in headless Chromium (docs/browser.py) at 1400 px:

- top.png: the book's first screenful (title, introduction, the block-matrix figure);
- block-matrices.png, one-head.png: the figures `fig-block_matrices` and `fig-one_head`;
- embedded-viewer.png: the viewer at the end of the chapter;
- viewer.png: viewer.html of the dump, on the view it opens with.

heads-pruning.png is not a screenshot: it is the pruning curve `make heads CHECKPOINT=shipped:de-en
ARGS=--prune` draws (docs/heads.md). The tests never write here: theirs go to their tmp_path.
"""

from __future__ import annotations

import base64
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from docs.browser import CHROMIUM, NO_CHROMIUM, Chromium

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "screenshots"
WIDTH = 1400
SENTENCE = "Ein Mann mit einem orangefarbenen Hut, der etwas anstarrt."  # test_2016_flickr's first sentence
BOOK_SHOTS = {  # file: (element id to scroll to, or None for the top; window height)
    "top.png": (None, 1000),
    "block-matrices.png": ("fig-block_matrices", 1000),
    "one-head.png": ("fig-one_head", 1000),
    "embedded-viewer.png": ("viewer", 1000),
}


def _binary() -> str:
    """Chromium's path (main() has refused to start without one)."""
    assert CHROMIUM is not None, NO_CHROMIUM
    return CHROMIUM


def shoot(browser: Chromium, url: str, height: int, element: str | None = None, ready: str = "true") -> bytes:
    """PNG bytes of `url` in a WIDTH x `height` window, scrolled to `element`, once the JavaScript `ready` holds
    in the page (and, where the page has frames, in its one frame: the embedded viewer has drawn)."""
    browser.open(url, WIDTH, height)
    browser.wait_js(ready)
    if element is not None:
        browser.js(f"document.getElementById({element!r}).scrollIntoView()")
    frames = browser.page("Page.getFrameTree")["frameTree"].get("childFrames", [])
    for frame in frames:  # a file:// frame is another origin: read it from a world of its own
        world = browser.page("Page.createIsolatedWorld", frameId=frame["frame"]["id"])["executionContextId"]
        deadline = time.time() + 60
        while not browser.page(
            "Runtime.evaluate", expression="!!document.body.dataset.rendered", contextId=world, returnByValue=True
        )["result"]["value"]:
            if time.time() > deadline:
                raise TimeoutError(f"the frame of {url} never drew its view")
            time.sleep(0.1)
    browser.js("new Promise(r => requestAnimationFrame(() => setTimeout(r, 500)))")  # painted after the scroll
    return base64.b64decode(browser.page("Page.captureScreenshot", format="png")["data"])


def book_shots(tmp: Path, say: Callable[[str], None], index: Path | None = None) -> dict[str, bytes]:
    """The book's screenshots; `index`: a book already built (else it is built here from the shipped model)."""
    from annotated.shipped import shipped_model
    from docs import build

    if index is None:
        say("building the book with the shipped de->en model (a few minutes) ...")
        index = build.build(
            tmp / "book", checkpoint=shipped_model("de-en"), progress=False, say=lambda line: None
        ).index
    shots = {}
    for name, (element, height) in BOOK_SHOTS.items():
        browser = Chromium(_binary(), tmp / f"profile-{name}", tmp / "chromium.log")
        try:
            shots[name] = shoot(
                browser, index.resolve().as_uri(), height, element, "document.readyState === 'complete'"
            )
        finally:
            browser.close()
    return shots


def viewer_shot(tmp: Path, say: Callable[[str], None]) -> bytes:
    from annotated.attention.dump import dump
    from annotated.shipped import NAME_PREFIX, shipped_model

    say(f"dumping the attention of {SENTENCE!r} ...")
    folder = dump(shipped_model("de-en"), [SENTENCE], tmp / "attention", pictures=False, name=f"{NAME_PREFIX}de-en")
    browser = Chromium(_binary(), tmp / "profile-viewer", tmp / "chromium.log")
    try:
        return shoot(
            browser, (folder / "viewer.html").resolve().as_uri(), 900, None, "!!document.body.dataset.rendered"
        )
    finally:
        browser.close()


def make_screenshots(out: Path = OUT, say: Callable[[str], None] = print, book: Path | None = None) -> list[Path]:
    """Take every screenshot and write it into `out` (each file replaced whole); returns the files written.
    `book`: the index.html of a book built with the shipped model, to photograph instead of building one."""
    from annotated.plumbing.files import atomic_write

    with tempfile.TemporaryDirectory(prefix="screenshots-") as tmp:
        shots = book_shots(Path(tmp), say, book) | {"viewer.png": viewer_shot(Path(tmp), say)}
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, png in shots.items():
        atomic_write(out / name, png)
        written.append(out / name)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    from annotated.plumbing.options import Parser
    from annotated.plumbing.scripts import name_of

    name = name_of(__file__)
    p = Parser(
        command=__file__,
        description="Retake the README's screenshots (docs/screenshots/*.png) from the shipped de->en model.",
    )
    p.add_argument("--out", type=Path, default=OUT, help="folder of the pictures (default docs/screenshots)")
    p.add_argument("--book", type=Path, help="index.html of a book already built with the shipped model")
    args = p.parse_args(argv)
    if CHROMIUM is None:
        print(f"{name}: error: {NO_CHROMIUM}", file=sys.stderr)
        return 2
    start = time.monotonic()
    written = make_screenshots(args.out, say=lambda line: print(f"{name}: {line}", file=sys.stderr), book=args.book)
    print(f"wrote {len(written)} screenshots in {time.monotonic() - start:.0f} s: " + ", ".join(map(str, written)))
    return 0


if __name__ == "__main__":
    from annotated.plumbing.scripts import run_main

    run_main(main)
