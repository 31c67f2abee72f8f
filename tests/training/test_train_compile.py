"""`--compile`: the compiled step computes the eager step's losses, and batches of few shapes keep recompiles few.

torch.compile's inductor backend turns each graph into C++ that g++ compiles: minutes on two busy CPU cores,
too slow for the suite (`make bench` measures inductor's speed-up). Here the same TorchDynamo capture, guards
and recompiles run with the `aot_eager` backend: the graphs AOTAutograd traces for forward and backward, run
op by op. Everything about shapes and recompiles is the same; only the kernels' code generation is skipped.
"""

import dataclasses
import functools

from annotated.training import train

SMOKE = dataclasses.replace(train.PRESETS["smoke"], test_sentences=2, val_bleu_sentences=2, log_every=1, max_steps=14)


def rows(run):
    return [
        (int(a), float(b))
        for a, b in (line.split("\t") for line in (run / "train_loss.tsv").read_text().split("\n") if line)
    ]


def test_compiled_training_matches_eager_with_few_recompiles(tmp_path, data_url, cache, monkeypatch):
    """One epoch of the smoke run (14 steps, 13 batch shapes), compiled and eager: every step's loss agrees to
    1e-4 relative (float32: the traced graphs decompose some operators and sum in another order, ~1e-6 per step,
    and Adam's normalised updates keep the runs together), and the whole epoch compiles at most 4 graphs
    (`dynamic=True`: one for forward and backward, plus re-specialisations), not one per shape."""
    import torch._dynamo

    quiet = dict(source=train.DataSource(data_url, cache), progress=False, log=lambda s: None)
    train.train(SMOKE, tmp_path / "eager", **quiet)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    train.train(dataclasses.replace(SMOKE, compile=True), tmp_path / "compiled", **quiet)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    eager, compiled = rows(tmp_path / "eager"), rows(tmp_path / "compiled")
    assert [s for s, _ in eager] == [s for s, _ in compiled] == list(range(1, 15))
    for (step, a), (_, b) in zip(eager, compiled):
        assert abs(a - b) <= 1e-4 * abs(a), (step, a, b)
    assert 1 <= graphs <= 4, dict(torch._dynamo.utils.counters["stats"])
    torch._dynamo.reset()
