"""benchmarks/int8_products.py runs and times every product shape of the shipped model (speed never asserted)."""

from benchmarks.int8_products import main


def test_the_int8_products_benchmark_times_every_shape(capsys):
    assert main(["--rows", "4", "--calls", "2"]) == 0
    out = capsys.readouterr().out
    for role in ("attention projection", "feed-forward W_1", "feed-forward W_2", "generator"):
        assert f"| {role} |" in out
    assert "| generator | 128 x 5000 | 640,000 |" in out
