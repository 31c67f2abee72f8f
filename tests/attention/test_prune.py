"""Pruning heads for real, fine-tuning, pruned checkpoints, and the command end to end
(annotated/attention/prune.py, annotated/attention/heads.py)."""

import json
from types import SimpleNamespace

import pytest
import torch
from test_sites import batch, logits, tiny_model
from tiny import write_tiny_checkpoint

from annotated.attention.prune import (
    count_parameters,
    finetune,
    greedy_prune,
    save_pruned,
    split_sentences,
)
from annotated.checkpoint import CheckpointError, load_checkpoint, read_checkpoint, save_checkpoint
from annotated.decoding.search import translate_ids
from annotated.sites import KINDS, attention_at, head_counts, remove_heads, sites
from annotated.transformer import FusedAttention


@pytest.mark.parametrize("form", ["per_head", "fused"])
def test_pruned_checkpoint_round_trips(form, tmp_path):
    model = tiny_model(form, dtype=torch.float32)
    pruned = remove_heads(model, {("enc_self", 0): [1], ("dec_self", 1): [0, 2], ("cross", 1): [2]})
    path = tmp_path / "pruned.pt"
    save_pruned(path, pruned, None, {"note": "kept"})
    loaded, tokenizer, meta = load_checkpoint(path)
    assert tokenizer is None and meta == {"note": "kept"}
    assert head_counts(loaded) == head_counts(pruned) == {"enc_self": [2, 3], "dec_self": [3, 1], "cross": [3, 2]}
    assert all(isinstance(attention_at(loaded, *s), FusedAttention) for s in sites(loaded))  # saved fused
    b = batch()
    assert torch.equal(logits(loaded, b), logits(convert_fused(pruned), b))  # the same numbers, the same form
    torch.testing.assert_close(logits(loaded, b), logits(pruned, b), rtol=0, atol=1e-4)  # either form
    sources = [row[row != 0].tolist() for row in b.src]
    assert translate_ids(loaded, sources) == translate_ids(convert_fused(pruned), sources)
    per_head = 2 * 12 * 4 * 2 + 3 * 4  # 2 d_model d_k + 2 d_model d_v + biases, d_k = d_v = 4
    assert count_parameters(model) - count_parameters(loaded) == 4 * per_head


def convert_fused(model):
    from annotated.transformer import convert_model

    return convert_model(model, "fused")


def test_an_unpruned_model_saves_as_an_ordinary_checkpoint(tmp_path):
    save_pruned(tmp_path / "m.pt", tiny_model("fused", dtype=torch.float32), None)
    assert "heads" not in read_checkpoint(tmp_path / "m.pt")
    load_checkpoint(tmp_path / "m.pt")


def test_head_counts_that_do_not_fit_the_parameters_are_a_clear_error(tmp_path):
    pruned = remove_heads(tiny_model("fused", dtype=torch.float32), {("cross", 0): [0]})
    save_checkpoint(tmp_path / "bad.pt", pruned, None, {}, heads={k: [3, 3] for k in KINDS})
    with pytest.raises(CheckpointError, match=r"bad\.pt.*parameters do not match its config"):
        load_checkpoint(tmp_path / "bad.pt")
    save_checkpoint(tmp_path / "worse.pt", pruned, None, {}, heads={"cross": [2, 3]})
    with pytest.raises(CheckpointError, match=r"worse\.pt.*config is invalid.*head counts"):
        load_checkpoint(tmp_path / "worse.pt")


def test_greedy_prune_follows_the_scores_and_stops_at_the_first_removal_that_breaks_the_rule():
    model = tiny_model("fused", N=1, h=2, dtype=torch.float32)
    # enc_self head 1 lowest (0.1), then cross head 0 (0.2), then dec_self head 1 (0.3)
    scores = {"enc_self": [0.9, 0.1], "dec_self": [0.8, 0.3], "cross": [0.2, 0.95]}

    def importance(m):  # the scores of the heads still there (enc_self keeps head 0)
        return {k: [scores[k] if attention_at(m, k, 0).h == 2 else [scores[k][0]]] for k in KINDS}

    def held_out_loss(m):  # an enc_self head costs 0.01 nats per token, a cross head 0.1
        c = head_counts(m)
        return 2.0 + 0.1 * (c["cross"] == [1]) + 0.01 * (c["enc_self"] == [1])

    result = greedy_prune(model, held_out_loss, importance, max_increase=0.02)
    assert result.baseline_loss == 2.0
    # dec_self head 1 would cost nothing, but the search ends at the cross head, before reaching it
    assert [(s.kind, s.head, s.kept) for s in result.steps] == [("enc_self", 1, True), ("cross", 0, False)]
    assert head_counts(result.model) == {"enc_self": [1], "dec_self": [2], "cross": [2]}
    assert [s.held_out_loss for s in result.removed] == [pytest.approx(2.01)]
    # the rule: every kept step within max_increase, the first step beyond it is the last step
    assert all(s.held_out_loss - 2.0 <= 0.02 for s in result.removed)
    assert result.steps[-1].held_out_loss - 2.0 > 0.02
    everything = greedy_prune(model, held_out_loss, importance, max_increase=5.0)
    assert head_counts(everything.model) == {k: [1] for k in KINDS}  # every attention keeps one head
    assert len(everything.steps) == 3


def test_going_beyond_the_stop_keeps_the_same_model_and_follows_the_same_path():
    model = tiny_model("fused", N=1, h=2, dtype=torch.float32)
    scores = {"enc_self": [0.9, 0.1], "dec_self": [0.8, 0.3], "cross": [0.2, 0.95]}

    def importance(m):
        return {k: [scores[k] if attention_at(m, k, 0).h == 2 else [scores[k][0]]] for k in KINDS}

    def held_out_loss(m):  # the cross head breaks the rule (0.1 > 0.02); the dec_self head after it costs 0.005
        c = head_counts(m)
        return 2.0 + 0.1 * (c["cross"] == [1]) + 0.01 * (c["enc_self"] == [1]) + 0.005 * (c["dec_self"] == [1])

    seen = []
    stopped = greedy_prune(model, held_out_loss, importance, max_increase=0.02)
    beyond = greedy_prune(
        model,
        held_out_loss,
        importance,
        max_increase=0.02,
        beyond_stop=True,
        on_step=lambda step, m: seen.append((step.kind, step.kept, head_counts(m))),
    )
    # what the rule keeps does not change
    assert beyond.steps == stopped.steps and head_counts(beyond.model) == head_counts(stopped.model)
    assert head_counts(beyond.model) == {"enc_self": [1], "dec_self": [2], "cross": [2]}
    # the path goes on from the model without the removal that broke the rule, to one head per attention
    assert [(s.kind, s.head, s.kept) for s in beyond.beyond] == [("dec_self", 1, False)]
    assert beyond.beyond[0].held_out_loss == pytest.approx(2.115)  # all three removals together
    assert seen == [
        ("enc_self", True, {"enc_self": [1], "dec_self": [2], "cross": [2]}),
        ("cross", False, {"enc_self": [1], "dec_self": [2], "cross": [1]}),
        ("dec_self", False, {"enc_self": [1], "dec_self": [1], "cross": [1]}),
    ]


def test_alternating_speed_times_each_model_in_every_round_in_turn(monkeypatch):
    from annotated.attention import prune

    calls, speeds = [], {"a": iter([10.0, 12.0, 11.0]), "b": iter([20.0, 18.0, 33.0])}

    def fake_timing(model, sources, beam_size, length_penalty, progress=False):
        calls.append(model)
        return [], next(speeds[model])

    monkeypatch.setattr(prune, "timed_translation", fake_timing)
    got = prune.alternating_speed({"a": "a", "b": "b"}, [[4, 5]], 4, 0.6, rounds=3)
    assert calls == ["a", "b", "b", "a", "a", "b"]  # the order swaps every round
    assert got == {"a": [10.0, 12.0, 11.0], "b": [20.0, 18.0, 33.0]}
    # the ratio pairs each round's two timings: ratios 2.0, 1.5, 3.0, median 2.0 (not 33 / 12 of the fastest)
    assert prune.speed_ratio(got["b"], got["a"]) == 2.0
    with pytest.raises(ValueError, match="one speed per round"):
        prune.speed_ratio([1.0], [1.0, 2.0])


def test_greedy_prune_rejects_a_negative_max_increase():
    with pytest.raises(ValueError, match="max_increase"):
        greedy_prune(tiny_model(), lambda m: 0.0, lambda m: {}, max_increase=-0.1)


@pytest.mark.parametrize("n", [2, 3, 10, 301])
def test_held_out_sentences_are_disjoint_from_the_ranking_sentences(n):
    ranking, held_out = split_sentences(n)
    assert not set(ranking) & set(held_out)
    assert sorted(ranking + held_out) == list(range(n))  # every sentence used, once
    assert len(ranking) - len(held_out) in (0, 1) and held_out


def test_the_command_ranks_on_one_part_and_judges_on_the_other(monkeypatch):
    """What `prune_and_measure` hands to the search: importance on the ranking pairs, loss on the held-out."""
    from annotated.attention import heads

    encoded = [([4 + i, 5], [6, 7 + i]) for i in range(9)]  # source ids tell the pairs apart
    seen = {}

    def spy_search(model, held_out_loss, importance, *args, **kwargs):
        raise StopIteration  # what it was given is all this test needs

    monkeypatch.setattr("annotated.attention.heads.greedy_prune", spy_search)
    monkeypatch.setattr(heads, "_batches", lambda enc, idx, max_len: seen.setdefault(len(seen), list(idx)))
    args = SimpleNamespace(max_loss_increase=0.02, finetune_steps=0)
    with pytest.raises(StopIteration):
        heads.prune_and_measure(tiny_model(), None, {}, [("s", "t")] * 9, encoded, [], args, print)
    ranking, held_out = seen[0], seen[1]
    assert ranking == [0, 2, 4, 6, 8] and held_out == [1, 3, 5, 7]


def _copy_task_batches(vocab=12, n=6):
    """A tiny task: the target repeats the source (ids 4 ... vocab - 1), in padded Batch objects."""
    from annotated.training.data import collate

    g = torch.Generator().manual_seed(0)
    pairs = [
        (seq, seq)
        for seq in (
            torch.randint(4, vocab, (int(L),), generator=g).tolist() for L in torch.randint(3, 7, (n * 4,), generator=g)
        )
    ]
    return [collate(pairs, range(k, k + 4)) for k in range(0, len(pairs), 4)]


def test_finetune_zero_steps_changes_nothing():
    model = tiny_model("fused", dtype=torch.float32, vocab=12)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tuned = finetune(model, _copy_task_batches(), steps=0).model
    assert all(torch.equal(before[k], v) for k, v in tuned.state_dict().items())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_finetune_lowers_the_training_loss_of_a_pruned_model():
    from annotated.attention.importance import sentence_losses

    batches = _copy_task_batches()
    pruned = remove_heads(
        tiny_model("fused", dtype=torch.float32, vocab=12), {("enc_self", 0): [0], ("cross", 1): [1, 2]}
    )
    before = {k: v.clone() for k, v in pruned.state_dict().items()}

    def loss(m):
        total, tokens = sentence_losses(m, batches)
        return total.sum() / tokens.sum()

    tuned = finetune(pruned, batches, steps=40, lr=3e-3).model
    assert head_counts(tuned) == head_counts(pruned)  # the same pruned shape, trained further
    assert all(torch.equal(before[k], v) for k, v in pruned.state_dict().items())  # the input is left alone
    # a random model's loss on a copy task with 8 words is several nats per token; 40 Adam steps on these same
    # batches bring it down by far more than the step-to-step wobble of a few hundredths
    assert loss(tuned) < loss(pruned) - 0.5, (loss(pruned), loss(tuned))


def test_finetune_on_held_out_keeps_the_lowest_held_out_loss_and_stops_after_its_patience():
    batches = _copy_task_batches()
    model = tiny_model("fused", dtype=torch.float32, vocab=12)
    losses = iter([5.0, 4.0, 3.0, 3.5, 3.0, 3.2, 9.9, 9.9])  # step 0, 2, 4, ...: lowest at step 4, no new low after
    seen = []

    def held_out(m):
        seen.append({k: v.clone() for k, v in m.state_dict().items()})
        return next(losses)

    got = finetune(model, batches, 100, held_out, lr=3e-3, check_every=2, patience=3)
    assert got.checks == [(0, 5.0), (2, 4.0), (4, 3.0), (6, 3.5), (8, 3.0), (10, 3.2)]  # a tie is no new low
    assert got.steps == 4
    kept = got.model.state_dict()
    assert all(torch.equal(seen[2][k], v) for k, v in kept.items())  # the very model measured at step 4
    assert not all(torch.equal(seen[5][k], kept[k]) for k in kept)  # not the last one trained
    again = finetune(model, batches, 4, lr=3e-3).model  # dropout 0, the same batches: the same 4 steps
    assert all(torch.equal(again.state_dict()[k], v) for k, v in kept.items())


def test_finetune_on_held_out_keeps_the_input_when_nothing_beats_it_and_checks_the_last_step():
    model = tiny_model("fused", dtype=torch.float32, vocab=12)
    losses = iter([1.0, 2.0, 2.0])
    got = finetune(model, _copy_task_batches(), 5, lambda m: next(losses), check_every=3, patience=9)
    assert got.checks == [(0, 1.0), (3, 2.0), (5, 2.0)]  # every 3 steps and at the budget's end
    assert got.model is model and got.steps == 0


def test_finetune_with_dropout_repeats_by_its_seed_and_leaves_the_callers_random_state():
    import tiny

    model = tiny.tiny_model(12, dropout=0.3).float()  # dropout draws a new mask at every step
    batches, before = _copy_task_batches(), torch.get_rng_state()
    runs = [finetune(model, batches, 3, lr=3e-3, seed=s).model.state_dict() for s in (0, 0, 1)]
    assert torch.equal(torch.get_rng_state(), before)
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])  # seed 0 twice: the same weights
    assert not all(torch.equal(runs[0][k], runs[2][k]) for k in runs[0])  # seed 1: other masks, other steps


# ---------------------------------------------------------------- the command, end to end


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, data_url, cache):
    """A small untrained model with a real tokenizer, saved as a checkpoint."""
    from annotated.training import data

    pairs = data.load_multi30k("train", cache_dir=cache, base_url=data_url)[:300]
    texts = [s for s, _ in pairs] + [t for _, t in pairs]
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "best.pt", texts, 400, cache_dir=cache)


def test_command_writes_table_json_pictures_and_a_pruned_checkpoint(
    tiny_checkpoint, data_url, cache, tmp_path, monkeypatch, capsys
):
    from annotated.attention.heads import main

    monkeypatch.setenv("MULTI30K_URL", data_url)
    monkeypatch.setenv("ANNOTATED_CACHE", str(cache))
    out = tmp_path / "out"
    argv = [
        "--checkpoint",
        str(tiny_checkpoint),
        "--out",
        str(out),
        "--sentences",
        "6",
        "--prune",
        "--test-sentences",
        "3",
        "--beam",
        "2",
        "--max-loss-increase",
        "100",
        "--resamples",
        "50",
        "--finetune-steps",
        "1",
    ]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert sum(line.split()[:1] in (["enc_self"], ["dec_self"], ["cross"]) for line in text.splitlines()) == 6
    text_json = (out / "heads.json").read_text()
    assert "NaN" not in text_json and "Infinity" not in text_json  # strict JSON: a browser's JSON.parse reads it
    report = json.loads(text_json)
    assert report["kinds"]["dec_self"]["position_profile"][0][0][-1] is None  # no last-source-token weight
    for kind in KINDS:
        assert (out / f"heads_{kind}.png").stat().st_size > 0
        for key in ("importance", "bleu_change", "loss_change", "label"):
            assert [len(row) for row in report["kinds"][kind][key]] == [2]
        for key in ("bleu_change", "loss_change"):
            for c in report["kinds"][kind][key][0]:
                assert c["low"] <= c["value"] <= c["high"] and c["significant"] == (not c["low"] <= 0 <= c["high"])
    assert (out / "heads_inspect.png").stat().st_size > 0 and (out / "heads_examples.png").stat().st_size > 0
    assert set(report["baseline"]) == {"bleu", "loss", "label_smoothing", "loss_label_smoothed"}
    assert report["baseline"]["label_smoothing"] is None  # this checkpoint does not say how it was trained
    assert report["validation"]["resamples"] == 50
    assert "[" in text and "paired bootstrap interval" in text
    assert report["pruning"]["ranking_sentences"] == 3 and report["pruning"]["held_out_sentences"] == 3
    assert report["pruning"]["length_penalty"] == 0.6  # the checkpoint names none: the paper's
    c = report["pruning"]["test_bleu_change"]
    assert c["low"] <= c["value"] <= c["high"]
    # --max-loss-increase 100: every attention gives up all but one head
    assert report["pruning"]["after"]["heads"] == 3 and report["pruning"]["before"]["heads"] == 6
    pruned, _, meta = load_checkpoint(out / "pruned.pt")
    assert head_counts(pruned) == {k: [1] for k in KINDS} and len(meta["heads_removed"]) == 3
    # fine-tuning checks the held-out loss before and after its one step, and the saved model is the lower
    (_, before), (_, after) = checks = report["pruning"]["finetune_checks"]
    assert [s for s, _ in checks] == [0, 1] and report["pruning"]["finetune_max_steps"] == 1
    assert before == report["pruning"]["steps"][-1]["held_out_loss"]  # step 0: the pruned model at the stop
    assert after != before  # the step changed the model
    assert meta["finetune_steps"] == report["pruning"]["finetune_steps"] == (1 if after < before else 0)
    assert report["pruning"]["held_out_loss_final"] == pytest.approx(min(before, after), abs=1e-12)
    assert report["pruning"]["finetuned"]["held_out_loss"] == report["pruning"]["held_out_loss_final"]
    assert report["pruning"]["finetuned"]["finetune_steps"] == meta["finetune_steps"]
    assert "test_bleu" in report["pruning"]["finetuned"]
    assert report["pruning"]["after"]["parameters"] == count_parameters(pruned)
    # the curve: the unpruned model, then every removal of the path (past the stop too), drawn in one picture
    curve, pruning = report["pruning"]["curve"], report["pruning"]
    assert [p["heads_removed"] for p in curve] == list(range(1 + len(pruning["steps"]) + len(pruning["beyond_stop"])))
    assert curve[0]["held_out_loss"] == pruning["baseline_held_out_loss"]
    assert [p["held_out_loss"] for p in curve[1:]] == [s["held_out_loss"] for s in pruning["steps"]]
    assert (out / "heads_pruning.png").stat().st_size > 0
    assert len(pruning["before"]["speeds"]) == len(pruning["after"]["speeds"]) == pruning["speed_rounds"]
    # a second run does not overwrite the first without --force
    before = (out / "heads.json").read_bytes()
    assert main(argv) == 2 and "--force" in capsys.readouterr().err
    assert (out / "heads.json").read_bytes() == before


# ---------------------------------------------------------------- a pruned checkpoint wherever a checkpoint goes

PRUNED = {("enc_self", 1): [0, 3], ("dec_self", 0): [2], ("cross", 1): [0, 1, 2]}
PRUNED_COUNTS = {"enc_self": [4, 2], "dec_self": [3, 4], "cross": [4, 1]}
SENTENCES = ["Ein Hund.", "Eine Frau singt.", "Ein Mann läuft."]  # short: the model has max_len 20


@pytest.fixture(scope="module")
def pruned_checkpoint(tiny_checkpoint, tmp_path_factory):
    """A pruned random model (2 layers of 4 heads, some layers with fewer) with tiny_checkpoint's tokenizer."""
    _, tok, meta = load_checkpoint(tiny_checkpoint)
    model = tiny_model("fused", dtype=torch.float32, N=2, h=4, d_model=16, vocab=tok.vocab_size)
    path = tmp_path_factory.mktemp("pruned") / "pruned.pt"
    save_pruned(path, remove_heads(model, PRUNED), tok, meta)
    return path


def test_a_pruned_checkpoint_works_with_the_translator_the_equivalence_check_and_the_attention_dump(
    pruned_checkpoint, tmp_path
):
    import io

    import numpy as np

    from annotated.attention import dump as attention_maps
    from annotated.decoding import translate
    from annotated.proof.equivalence import check_checkpoint

    model, tok, _ = load_checkpoint(pruned_checkpoint)
    assert read_checkpoint(pruned_checkpoint)["heads"] == head_counts(model) == PRUNED_COUNTS
    sources = [tok.encode(s) for s in SENTENCES]
    assert all(0 < len(ids) <= model.config.max_len for ids in sources)  # nothing is cut
    want = [" ".join(tok.decode(translate_ids(model, [ids], 2, 0.6)[0]).splitlines()) for ids in sources]
    assert any(want)  # the random model says something

    # the translator, in process
    out, err = io.BytesIO(), io.StringIO()
    argv = ["--checkpoint", str(pruned_checkpoint), "--beam", "2", "--device", "cpu", *SENTENCES]
    assert translate.main(argv, stdout=out, stderr=err) == 0, err.getvalue()
    assert out.getvalue().decode("utf-8").splitlines() == want and err.getvalue() == ""

    # python -m annotated.proof.equivalence --checkpoint: the per-head conversion computes the same function
    rows = check_checkpoint(str(pruned_checkpoint), sentences=8)
    assert len(rows) == 3 and all(r.passed and r.cases == 8 for r in rows), [(r.check, r.notes) for r in rows]

    # the attention dump: every layer's arrays hold that layer's heads
    dump = attention_maps.dump(pruned_checkpoint, SENTENCES, tmp_path / "attention", pictures=False, beam_size=2)
    index = attention_maps.read_index(dump)
    assert index["head_counts"] == PRUNED_COUNTS
    assert [entry["translation"] for entry in index["sentences"]] == want
    for i, _entry in enumerate(index["sentences"]):
        attn, _ = attention_maps.load_sentence(dump, i)
        for kind in KINDS:
            assert [a.shape[1] for a in attn[kind]] == PRUNED_COUNTS[kind]
            for a in attn[kind]:
                np.testing.assert_allclose(a.sum(-1), 1.0, atol=1e-5)


def test_head_counts_above_the_configs_h_are_refused_before_anything_is_built(tmp_path, monkeypatch):
    import io

    from annotated import checkpoint, sites
    from annotated.decoding import translate
    from annotated.transformer import make_model

    model = tiny_model("fused", dtype=torch.float32, N=1, h=2)
    greedy = tmp_path / "greedy.pt"
    save_checkpoint(greedy, model, None, {}, heads={"enc_self": [10**9], "dec_self": [2], "cross": [2]})
    fine = tmp_path / "fine.pt"
    save_pruned(fine, remove_heads(model, {("enc_self", 0): [0]}), None)
    built, counted = [], []

    def spy_make_model(*args, **kwargs):
        built.append(torch.empty(0).device.type)  # "meta" while only shapes are worked out
        return make_model(*args, **kwargs)

    real_set_head_counts = sites.set_head_counts

    def spy_set_head_counts(m, counts):
        counted.append(next(m.parameters()).device.type)
        return real_set_head_counts(m, counts)

    monkeypatch.setattr(checkpoint, "make_model", spy_make_model)
    monkeypatch.setattr(sites, "set_head_counts", spy_set_head_counts)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(greedy)
    message = str(e.value)
    assert str(greedy) in message and "head counts" in message and "h=2" in message and "\n" not in message
    assert built == ["meta"] and counted == []  # only the meta-device shape check ran, and it stopped there
    out, err = io.BytesIO(), io.StringIO()
    assert translate.main(["--checkpoint", str(greedy), "Hallo"], stdout=out, stderr=err) == 2
    assert err.getvalue() == f"translate: error: {message}\n" and out.getvalue() == b""
    # the spies see a real build: a pruned checkpoint that fits is built once on the meta device, then for real
    built.clear()
    assert head_counts(load_checkpoint(fine)[0])["enc_self"] == [1]
    assert built == ["meta", "cpu"] and counted == ["meta", "cpu"]


def test_every_removal_is_judged_against_the_unpruned_model():
    """Each head removed costs 0.015 nats per token more than the model before it: every step is within
    max_increase = 0.02 of the previous one, but only the first is within it of the unpruned model, so the search
    keeps one removal and stops at the second (a rule comparing with the previous step would remove every head
    and let the loss drift without bound)."""
    model = tiny_model("fused", N=1, h=2, dtype=torch.float32)
    scores = {"enc_self": [0.9, 0.1], "dec_self": [0.8, 0.3], "cross": [0.2, 0.95]}

    def importance(m):
        return {k: [scores[k] if attention_at(m, k, 0).h == 2 else [scores[k][0]]] for k in KINDS}

    def held_out_loss(m):
        return 2.0 + 0.015 * sum(c == [1] for c in head_counts(m).values())

    result = greedy_prune(model, held_out_loss, importance, max_increase=0.02)
    assert [s.kept for s in result.steps] == [True, False]
    assert [s.held_out_loss for s in result.steps] == [pytest.approx(2.015), pytest.approx(2.03)]
    assert sum(c == [1] for c in head_counts(result.model).values()) == 1


def test_max_loss_increase_reaches_the_pruning_rule(monkeypatch):
    """`--max-loss-increase` is the `max_increase` the search stops at (a value no default has)."""
    from annotated.attention import heads

    given = {}

    def spy_search(model, held_out_loss, importance, max_increase=None, *args, **kwargs):
        given["max_increase"] = kwargs.get("max_increase", max_increase)
        raise StopIteration

    monkeypatch.setattr("annotated.attention.heads.greedy_prune", spy_search)
    monkeypatch.setattr(heads, "_batches", lambda enc, idx, max_len: list(idx))
    encoded = [([4 + i, 5], [6, 7 + i]) for i in range(9)]
    args = SimpleNamespace(max_loss_increase=0.37, finetune_steps=0)
    with pytest.raises(StopIteration):
        heads.prune_and_measure(tiny_model(), None, {}, [("s", "t")] * 9, encoded, [], args, print)
    assert given == {"max_increase": 0.37}
