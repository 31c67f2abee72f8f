import os
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
