"""The training step never waits for the host: counted sync operators, log rows, skipped non-finite steps."""

import dataclasses
import doctest
import math
from pathlib import Path

import pytest
import torch

from annotated.training import data, train
from annotated.transformer import make_model
from benchmarks import syncs
from benchmarks.syncs import SyncCounter

SMOKE = dataclasses.replace(train.PRESETS["smoke"], test_sentences=2, val_bleu_sentences=2)


def toy_epoch(n_batches=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    encoded = [
        (
            [int(t) for t in torch.randint(4, 60, (int(torch.randint(3, 20, (1,), generator=gen)),), generator=gen)],
            [int(t) for t in torch.randint(4, 60, (int(torch.randint(3, 20, (1,), generator=gen)),), generator=gen)],
        )
        for _ in range(8 * n_batches)
    ]
    return data.make_batches(encoded, 200, shuffle=True, seed=seed)


def run_steps(batches, log_every, patch=None):
    """The real train_step and log_point over `batches` on the CPU, under a SyncCounter; (counter, reasons)."""
    cfg = dataclasses.replace(SMOKE, log_every=log_every, max_steps=None, epochs=1)
    torch.manual_seed(0)
    model = make_model(src_vocab=60, tgt_vocab=60, N=1, d_model=32, d_ff=64, h=2, dropout=0.1, max_len=64)
    opt, sched = train.make_optimizer(model, cfg)
    rows = []
    # rank 1: log_point reads and agrees as every rank does; only rank 0 writes rows (no run folder here)
    run = train.Run(
        cfg,
        None,
        train.Placement(1, 1, torch.device("cpu")),
        train.Arithmetic("fp32", "test", 1),
        train.Learner(model, patch(model) if patch else model, opt, sched),
        train.RunData(None, [], [], [], [], {}),
        {},
        print,
        writer=type("W", (), {"add_scalar": lambda *a: None})(),
    )
    meter = train.Meter(run.place.dev)
    tokens = train.step_tokens(batches, cfg.accum)
    state = train.RunState()
    with SyncCounter() as counter:
        for i, b in enumerate(batches):
            meter.add(*train.train_step(run.learner.model_for_step, opt, sched, [b], tokens[i], cfg, run.place.dev))
            state.step += 1
            if state.step % log_every == 0 or i == len(batches) - 1:
                rows.append(train.log_point(run, state, meter, False, False))
    return counter, rows


@pytest.mark.parametrize("log_every", [1, 5])
def test_steps_between_log_points_dispatch_no_sync(log_every):
    """N steps dispatch no synchronising operator at all: bounded by the number of reads ceil(N / log_every)
    (a read's .cpu() copy is a sync only on an accelerator, so on the CPU even those count 0)."""
    batches = toy_epoch()
    counter, _rows = run_steps(batches, log_every)
    assert counter.total <= math.ceil(len(batches) / log_every), counter.counts
    assert counter.total == 0, counter.counts


def test_the_counter_counts_a_read_and_a_boolean_index():
    """benchmarks/syncs.py's doctest: a queued sum no sync, .item() one, a boolean index one."""
    failures, tried = doctest.testmod(syncs)
    assert tried > 0 and failures == 0


def test_the_counter_sees_a_sync_in_the_step():
    """The same harness with one loss.item() per step counts one sync per step: the test above can fail."""
    batches = toy_epoch()

    class Reading(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, *args, **kwargs):
            out = self.model(*args, **kwargs)
            out.sum().item()
            return out

    counter, _ = run_steps(batches, 50, patch=Reading)
    assert counter.counts["_local_scalar_dense"] == len(batches)


def test_log_rows_are_token_weighted_means_of_the_steps(tmp_path, data_url, cache):
    """Rows every 5 steps and at each epoch end; each is the token-weighted mean of the per-step rows of the same
    run logged every step (same arithmetic: the sums differ only in float64 rounding, relative 1e-12)."""
    quiet = dict(source=train.DataSource(data_url, cache), progress=False, log=lambda s: None)
    train.train(dataclasses.replace(SMOKE, log_every=1), tmp_path / "each", **quiet)
    train.train(dataclasses.replace(SMOKE, log_every=5), tmp_path / "five", **quiet)
    each, five = (rows(tmp_path / r) for r in ("each", "five"))
    assert [s for s, _ in five] == [5, 10, 14, 15, 20, 25, 28]  # every 5th step, and each epoch's end (14, 28)
    tokenizer, pairs, _, _ = train.prepare_data(SMOKE, train.DataSource(data_url, cache))
    encoded = data.encode_pairs(pairs, tokenizer)
    encoded = [encoded[i] for i in data.split_long(encoded, SMOKE.max_len)[0]]
    n = [
        k
        for e in (0, 1)
        for k in train.step_tokens(
            data.make_batches(encoded, SMOKE.max_tokens, shuffle=True, seed=SMOKE.seed + e, max_len=SMOKE.max_len), 1
        )
    ]
    prev = 0
    for step, mean in five:
        want = sum(each[s][1] * n[s] for s in range(prev, step)) / sum(n[prev:step])
        assert math.isclose(mean, want, rel_tol=1e-6), (step, mean, want)  # rows print 8 decimals
        prev = step


def rows(run):
    return [
        (int(a), float(b))
        for a, b in (line.split("\t") for line in (run / "train_loss.tsv").read_text().split("\n") if line)
    ]


def test_resume_cuts_the_log_back_to_the_checkpoint(tmp_path, data_url, cache):
    """After a SIGKILL the log holds rows past last.pt's step; --resume drops them (else they would appear twice)."""
    quiet = dict(source=train.DataSource(data_url, cache), progress=False, log=lambda s: None)
    cfg = dataclasses.replace(SMOKE, log_every=1)
    train.train(cfg, tmp_path / "whole", **quiet)
    train.train(dataclasses.replace(cfg, max_steps=7), tmp_path / "parts", **quiet)
    with open(tmp_path / "parts" / "train_loss.tsv", "a") as f:  # steps a killed run logged after its checkpoint
        f.write("8\t9.0\n9\t9.0\n")
    train.train(cfg, tmp_path / "parts", resume=True, **quiet)
    assert rows(tmp_path / "parts") == rows(tmp_path / "whole")


def test_a_non_finite_step_is_skipped_on_the_device_and_stops_the_run_at_the_next_read(
    tmp_path, data_url, cache, monkeypatch
):
    """A NaN loss at step 3 of epoch 2 with log_every 4: the fused Adam kernel skips that update (found_inf), the
    run goes on to the read at the next multiple of 4 and stops there naming the step; last.pt stays epoch 1's."""
    run = tmp_path / "run"
    batch_loss, seen = train.batch_loss, []

    def faulty(model, src, tgt, eps, real=None):
        loss, n = batch_loss(model, src, tgt, eps, real)
        if model.training and (run / "last.pt").exists():
            seen.append(1)
            if len(seen) == 3:
                return loss * float("nan"), n
        return loss, n

    monkeypatch.setattr(train, "batch_loss", faulty)
    with pytest.raises(
        train.TrainingError,
        match=r"the loss became nan at step 17 \(epoch 2\); 1 step\(s\) with a "
        r"non-finite loss or gradient were skipped; stopped at step 20, the "
        r"last good checkpoint .*last\.pt is kept",
    ):
        train.train(
            dataclasses.replace(SMOKE, log_every=4),
            run,
            source=train.DataSource(data_url, cache),
            progress=False,
            log=lambda s: None,
        )
    from annotated.checkpoint import read_checkpoint

    assert read_checkpoint(run / "last.pt")["run_state"]["step"] == 14
    assert [s for s, _ in rows(run)] == [4, 8, 12, 14, 16]


def test_a_non_finite_loss_skips_only_its_own_update_and_the_next_read_names_it(monkeypatch):
    """Fast, on a toy model: the 3rd of 5 steps gets a NaN loss. That step leaves every parameter and every Adam
    moment exactly as they were (found_inf = 1, computed on the device); the steps before and after it update
    them; the one read after step 5 raises, naming step 3 and the skipped count. Bit-exact comparisons: a skipped
    update must not touch a single bit."""
    batches = toy_epoch()[:5]
    cfg = dataclasses.replace(SMOKE, log_every=50, max_steps=None, epochs=1)
    torch.manual_seed(0)
    model = make_model(src_vocab=60, tgt_vocab=60, N=1, d_model=32, d_ff=64, h=2, dropout=0.1, max_len=64)
    opt, sched = train.make_optimizer(model, cfg)
    run = train.Run(
        cfg,
        Path("toy-run"),
        train.Placement(0, 1, torch.device("cpu")),
        train.Arithmetic("fp32", "test", 1),
        train.Learner(model, model, opt, sched),
        train.RunData(None, [], [], [], [], {}),
        {},
        print,
        writer=type("W", (), {"add_scalar": lambda *a: None})(),
    )
    batch_loss, calls = train.batch_loss, []

    def nan_at_the_third(m, src, tgt, eps, real=None):
        loss, n = batch_loss(m, src, tgt, eps, real)
        calls.append(1)
        return (loss * float("nan") if len(calls) == 3 else loss), n

    monkeypatch.setattr(train, "batch_loss", nan_at_the_third)

    def snapshot():
        moments = [t.clone() for s in opt.state.values() for k, t in sorted(s.items()) if k != "step"]
        return [p.detach().clone() for p in model.parameters()] + moments

    def same(a, b):
        return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))

    meter, state, tokens, found = train.Meter(run.place.dev), train.RunState(), train.step_tokens(batches, 1), []
    for i, b in enumerate(batches):
        before = snapshot()
        loss, n, gnorm, found_inf = train.train_step(model, opt, sched, [b], tokens[i], cfg, run.place.dev)
        meter.add(loss, n, gnorm, found_inf)
        state.step += 1
        found.append(float(found_inf))
        assert same(before, snapshot()) == (i == 2), f"step {i + 1}: updated or not, the wrong way"
    assert found == [0, 0, 1, 0, 0]
    with pytest.raises(
        train.TrainingError,
        match=r"^the loss became nan at step 3 \(epoch 1\); 1 step\(s\) with a "
        r"non-finite loss or gradient were skipped; stopped at step 5, "
        r"the last good checkpoint toy-run/last\.pt is kept$",
    ):
        train.log_point(run, state, meter, False, False)
    assert not Path("toy-run").exists()  # the read raised before writing anything


def test_results_name_the_commit_the_run_started_from(tmp_path, data_url, cache, monkeypatch):
    """The checkout may move on while a run trains (a pull, a commit): results.json records the code that
    trained, taken when the run starts, not the checkout when it ends."""
    from annotated.plumbing import provenance

    commits = iter(["the commit at the start", "a commit made while it trained"])
    monkeypatch.setattr(provenance, "code_commit", lambda root=provenance.ROOT: next(commits))
    results = train.train(
        SMOKE, tmp_path / "run", source=train.DataSource(data_url, cache), progress=False, log=lambda s: None
    )
    assert results["environment"]["commit"] == "the commit at the start"
