"""The shared writers of annotated/plumbing/files.py: figures and JSON."""

import json
import os
import stat

import numpy as np
import pytest
from matplotlib.figure import Figure

from annotated.plumbing.files import json_safe, save_figure, staged_directory

PNG = b"\x89PNG\r\n\x1a\n"


def test_save_figure_is_atomic(tmp_path):
    """A PNG is written whole; a figure that fails to draw leaves the earlier file untouched, and no temporary."""
    fig = Figure(figsize=(1, 1))
    fig.add_subplot().plot([0, 1], [1, 0])
    path = save_figure(fig, tmp_path / "a.png", dpi=50)
    first = path.read_bytes()
    assert first.startswith(PNG)

    broken = Figure(figsize=(1, 1))
    broken.add_subplot().set_title("$\\frac{$")  # mathtext that cannot be parsed: fails while drawing
    with pytest.raises(ValueError):
        save_figure(broken, path)
    assert path.read_bytes() == first and [p.name for p in tmp_path.iterdir()] == ["a.png"]


def test_json_safe_gives_strict_json():
    thing = object()
    value = {"scores": np.array([0.25, np.nan]), 3: (np.int64(2), float("inf")), "thing": thing}
    text = json.dumps(json_safe(value), allow_nan=False)  # strict JSON: no NaN, no Infinity
    assert json.loads(text) == {"scores": [0.25, None], "3": [2, None], "thing": repr(thing)}


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077])
def test_a_published_folder_gets_the_mode_of_the_umask(tmp_path, umask):
    """`staged_directory` stages in mkdtemp's private 0o700 folder; the folder it publishes has the mode a plain
    mkdir gives under the same umask (0o777 less it), whether it is new or replaces an old one."""
    old = os.umask(umask)
    try:
        (tmp_path / "plain").mkdir()
        for _ in range(2):  # a new folder, then one that replaces it
            with staged_directory(tmp_path / "out") as staging:
                (staging / "a.txt").write_text("a")
    finally:
        os.umask(old)
    mode = stat.S_IMODE((tmp_path / "out").stat().st_mode)
    assert mode == stat.S_IMODE((tmp_path / "plain").stat().st_mode) == 0o777 & ~umask
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "plain"]  # no staging or old folder left


def test_a_failed_or_refused_publish_leaves_the_old_folder_and_no_staging(tmp_path):
    """An error in the block, or a `check` that refuses the target after the work, keeps the old folder whole."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(RuntimeError), staged_directory(out) as staging:
        (staging / "new.txt").write_text("new")
        raise RuntimeError("the work failed")
    calls = []

    def refuse_the_second_time(target):
        calls.append(target)
        if len(calls) == 2:
            raise ValueError(f"{target} is not ours")

    with pytest.raises(ValueError), staged_directory(out, refuse_the_second_time) as staging:
        (staging / "new.txt").write_text("new")
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and [p.name for p in out.iterdir()] == ["old.txt"]
