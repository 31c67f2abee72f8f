"""benchmarks/padding.py: the five ways time training's step on the same sentences, and the padding shares it
prints are the batches' own. No speed is asserted: the command prints ratios measured in one run."""

import dataclasses
import random

import pytest
import torch

from annotated.tokens import PAD
from annotated.training.config import PRESETS
from benchmarks import padding


def pairs(n: int = 60, seed: int = 0):
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(4, 50) for _ in range(rng.randint(2, 12))],
            [rng.randrange(4, 50) for _ in range(rng.randint(2, 12))],
        )
        for _ in range(n)
    ]


def test_padding_share_counts_the_padded_positions():
    from annotated.training.data import collate

    b = collate([([5, 6, 7], [8]), ([9], [10, 11])], [0, 1])  # src [[5 6 7] [9 pad pad]], tgt[:, 1:] [8 eos pad]
    assert padding.padding_share([b]) == pytest.approx({"source": 2 / 6, "target": 1 / 6})


def test_every_way_trains_on_the_same_sentences_and_reports_its_speed():
    cfg = dataclasses.replace(PRESETS["smoke"].with_model(vocab_size=50), max_tokens=120)
    r = padding.compare(cfg, pairs(), n_batches=3, rounds=1, window=0.01, precision="fp32")
    assert set(r["tokens_per_second"]) == set(r["speed_over_first"]) == set(padding.WAYS)
    assert r["speed_over_first"]["pad 8, every position"] == 1.0
    assert (
        r["padding"][8]["target"] > r["padding"][1]["target"] and r["padding"][8]["source"] > r["padding"][1]["source"]
    )


def test_every_position_way_projects_every_position(monkeypatch):
    """Without `real`, the step's model projects all B * (T - 1) decoder positions; with it, only the real ones."""
    from annotated.training import data

    cfg = dataclasses.replace(PRESETS["smoke"].with_model(vocab_size=50), max_tokens=120)
    batches = data.make_batches(pairs(), cfg.max_tokens, pad_to=8)[:1]
    seen = []
    for real in (False, True):
        step = padding.stepper(cfg, batches, real, "fp32", 0)
        seen.clear()
        hook = torch.nn.modules.module.register_module_forward_hook(
            lambda m, args, out: seen.append(out.shape[0]) if type(m).__name__ == "Generator" else None
        )
        try:
            step()
        finally:
            hook.remove()
        b = batches[0]
        want = b.tgt[:, 1:].numel() if not real else int((b.tgt[:, 1:] != PAD).sum())
        assert seen == [want] and (b.tgt[:, 1:] == PAD).any()


def test_torch_dropout_way_runs_torch_dropout_only(monkeypatch):
    """With `torch_dropout` the step never reaches the chapter's `Dropout`; without it, it does."""
    from annotated import transformer
    from annotated.training import data

    cfg = dataclasses.replace(PRESETS["smoke"].with_model(vocab_size=50), max_tokens=120)
    batches = data.make_batches(pairs(), cfg.max_tokens, pad_to=1)[:1]
    calls = []
    chapters = transformer.Dropout.forward
    monkeypatch.setattr(transformer.Dropout, "forward", lambda self, x: calls.append(1) or chapters(self, x))
    for torch_dropout, want_calls in ((True, False), (False, True)):
        calls.clear()
        padding.stepper(cfg, batches, True, "fp32", 0, torch_dropout)()
        assert bool(calls) == want_calls
