"""benchmarks/int8_products.py runs and times every product shape of the shipped model (speed never asserted)."""

import pytest

from benchmarks.int8_products import main


def test_the_int8_products_benchmark_times_every_shape(capsys):
    assert main(["--rows", "4,16", "--shapes", "256x1024", "--calls", "2"]) == 0
    out = capsys.readouterr().out
    assert "| product | n x m | weights | 4 rows | 16 rows |" in out
    for role in ("attention projection", "feed-forward W_1", "feed-forward W_2", "generator"):
        assert f"| {role} |" in out
    assert "| generator | 128 x 5000 | 640,000 |" in out
    assert "| --shapes 256x1024 | 256 x 1024 | 262,144 |" in out


def test_a_shape_that_is_not_n_x_m_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--shapes", "256x"])
    assert stop.value.code == 2
    assert "entry '256x' of '256x' must be a shape NxM" in capsys.readouterr().err
