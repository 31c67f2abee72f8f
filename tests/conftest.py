import hashlib
import os
import subprocess
from pathlib import Path

import pytest
import torch

# Two cores on CI: one intra-op thread per process is as fast for the small
# models the tests build, and keeps timings steady.
torch.set_num_threads(1)


REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def data_url():
    """Where the Multi30k raw files come from: $MULTI30K_URL, else ../shared/data/multi30k beside the clone."""
    url = os.environ.get("MULTI30K_URL") or (REPO.parent / "shared" / "data" / "multi30k").as_uri() + "/"
    if url.startswith("file://") and not Path(url[len("file://") :]).is_dir():
        pytest.skip(f"no Multi30k files at {url}; set MULTI30K_URL")
    return url


@pytest.fixture(scope="session")
def cache(tmp_path_factory):
    """One download and tokenizer cache for the whole run (test files that need their own define `cache`)."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def fast_path():
    """`fast_path(False)` in a test: the chapter's `transformer.fast_path` for the rest of the test, undone after."""
    import contextlib

    from annotated import transformer

    with contextlib.ExitStack() as stack:
        yield lambda enabled: stack.enter_context(transformer.fast_path(enabled))


def tree_state(repo: Path) -> dict[str, str] | None:
    """{path: what git says of it and a hash of its bytes} for every file `git status` lists (changed tracked
    files and untracked files that are not ignored); None outside a git checkout (an unpacked archive)."""
    try:
        out = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain=v1", "-z", "--untracked-files=all", "--no-renames"],
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    state = {}
    for entry in filter(None, out.decode("utf-8", "surrogateescape").split("\0")):
        status, path = entry[:2], entry[3:]
        file = repo / path
        digest = hashlib.sha256(file.read_bytes()).hexdigest() if file.is_file() else "-"
        state[path] = f"{status} {digest}"
    return state


def changed_files(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """The paths whose state differs between two `tree_state`s (written, created or deleted in between).

    >>> changed_files({"a": "M 1", "b": "?? 2"}, {"a": "M 1", "b": "?? 3", "c": "?? 4"})
    ['b', 'c']
    """
    return sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))


@pytest.fixture(scope="session", autouse=True)
def the_suite_writes_nothing_in_the_tree():
    """The suite leaves the checkout as it found it: a test writes into its tmp_path, never over a tracked file
    or a new file beside them (`git status` before and after the run, with each listed file's bytes)."""
    before = tree_state(REPO)
    yield
    after = tree_state(REPO)
    if before is None or after is None:
        return
    changed = changed_files(before, after)
    if changed:
        pytest.fail(
            f"the test run changed {len(changed)} file(s) of the checkout: {', '.join(changed)} "
            "(tests write into tmp_path; `git status` shows them; an editor saving files during the run counts too)",
            pytrace=False,
        )
