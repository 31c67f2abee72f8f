"""The shared writers of annotated/plumbing/files.py: figures and JSON."""

import json

import numpy as np
import pytest
from matplotlib.figure import Figure

from annotated.plumbing.files import json_safe, save_figure

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
