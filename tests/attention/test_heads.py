"""Scoring, measuring and labelling heads, and their intervals (annotated/attention/importance.py, profiles.py,
bootstrap.py), and the command's options (annotated/attention/heads.py)."""

import io
import math
import subprocess
import sys
from pathlib import Path

import matplotlib
import numpy as np
import pytest
import torch
from test_sites import batch, tiny_model
from torch import nn

from annotated.attention.bootstrap import bleu_from_statistics, bleu_statistics, paired_bleu_change, paired_loss_change
from annotated.attention.importance import head_importance, mean_token_loss, sentence_losses
from annotated.attention.profiles import attention_sums, head_label, position_profiles, profile_rows, summarise
from annotated.sites import KINDS, attention_at, keep_heads, remove_heads, sites
from annotated.tokens import PAD
from annotated.transformer import PerHeadAttention

REPO = Path(__file__).resolve().parents[2]


class _Gated(nn.Module):
    """An attention whose head i is multiplied by a gate xi, built without the W_O identity:
    output = (attention without head i) + xi * (full output - attention without head i)."""

    def __init__(self, att, i, xi):
        super().__init__()
        self.full, self.xi = att, xi
        self.without = keep_heads(att, [j for j in range(att.h) if j != i])

    def forward(self, *args, **kwargs):
        out, rest = self.full(*args, **kwargs), self.without(*args, **kwargs)
        return rest + self.xi * (out - rest)


def test_importance_matches_finite_differences():
    model, b = tiny_model("fused", N=1, h=2), batch(B=3)
    got = head_importance(model, [b])  # mean over the 3 sentences of |dL/dxi|
    eps = 1e-6
    for kind, layer in sites(model):
        for i in range(2):
            diffs = []
            for r in range(3):  # each sentence alone, its padding cut off
                src = b.src[r : r + 1, : int((b.src[r] != PAD).sum())]
                tgt = b.tgt[r : r + 1, : int((b.tgt[r] != PAD).sum())]

                def loss(xi):
                    gated = remove_heads(model, {})
                    stack = gated.encoder if kind == "enc_self" else gated.decoder
                    name = "cross_attn" if kind == "cross" else "self_attn"
                    setattr(stack.layers[layer], name, _Gated(getattr(stack.layers[layer], name), i, xi))
                    with torch.no_grad():
                        return mean_token_loss(gated, src, tgt).item()

                diffs.append(abs((loss(1 + eps) - loss(1 - eps)) / (2 * eps)))
            want = sum(diffs) / 3
            # central differences in float64: truncation ~eps^2 * L''' and rounding ~1e-16 / eps ~1e-10
            assert got[kind][layer][i] == pytest.approx(want, rel=1e-6, abs=1e-9), (kind, layer, i)
            assert want > 1e-4  # not a comparison of two zeros


def test_position_profiles_sum_to_one_when_the_window_covers_every_offset():
    model, b = tiny_model("fused", dtype=torch.float32), batch()
    prof = position_profiles(model, [b], window=10)  # sequences are shorter than 10: every offset is shown
    for kind in KINDS:
        for measures in prof[kind]:
            rows = profile_rows(measures)  # (h, 2 window + 2)
            assert rows[:, :-1].sum(axis=1) == pytest.approx([1.0] * 3, abs=1e-5)  # offsets only
            assert measures["uniform_offsets"].sum() == pytest.approx(1.0, abs=1e-9)
            last = rows[:, -1]
            assert all(math.isnan(v) for v in last) if kind == "dec_self" else all(0 <= v <= 1 for v in last)
            assert ((measures["entropy"] >= 0) & (measures["entropy"] <= 1 + 1e-9)).all()


def test_dec_self_profile_puts_nothing_on_future_offsets():
    prof = position_profiles(tiny_model("per_head", dtype=torch.float32), [batch()], window=3)
    assert (prof["dec_self"][0]["offsets"][:, 4:7] == 0).all()  # offsets +1 ... +3 are masked (causal)
    assert (prof["dec_self"][0]["uniform_offsets"][4:7] == 0).all()


# ---------------------------------------------------------------- labels of heads built by hand


def _head(kind, S, T, where, share=0.9):
    """(T_q, T_k) probabilities: `share` on key where(q) (None: nowhere), the rest spread evenly over the
    visible keys (all S source keys, or keys 0 ... q in dec_self)."""
    T_q = S if kind == "enc_self" else T
    T_k = T if kind == "dec_self" else S
    p = torch.zeros(T_q, T_k, dtype=torch.float64)
    for q in range(T_q):
        n = q + 1 if kind == "dec_self" else S
        key = where(q, n)
        rest = 1.0 if key is None else 1.0 - share
        p[q, :n] = rest / n
        if key is not None:
            p[q, key] += share
    return p


def _label(kind, heads, S=14, T=12, window=4):
    """Labels of hand-built heads (a list of (T_q, T_k) tensors) as `position_profiles` would measure them."""
    p = torch.stack(heads)[None]  # (1, h, T_q, T_k)
    sums = attention_sums(p, kind, torch.tensor([S]), torch.tensor([T]), window)
    measures = summarise(sums)
    return [head_label(measures, i, kind) for i in range(len(heads))]


def test_labels_of_constructed_heads():
    S, T = 14, 12
    flat = lambda q, n: None  # uniform over the visible keys: 1/14 = 0.07 on the previous token too
    previous = lambda q, n: max(q - 1, 0)
    last = lambda q, n: S - 1
    first = lambda q, n: 0
    diagonal = lambda q, n: round(q * (S - 1) / (T - 1))
    two_back = lambda q, n: max(q - 2, 0)
    # a flat head weighs its previous token exactly as uniform attention does: diffuse, not positional
    assert _label("enc_self", [_head("enc_self", S, T, f) for f in (flat, previous, last, two_back)]) == [
        "diffuse",
        "positional (offset -1)",
        "aligns to the last source token",
        "positional (offset -2)",
    ]
    assert _label("dec_self", [_head("dec_self", S, T, f) for f in (flat, previous, first)]) == [
        "diffuse",
        "positional (offset -1)",
        "aligns to <s>",
    ]
    assert _label("cross", [_head("cross", S, T, f) for f in (flat, diagonal, last, first)]) == [
        "diffuse",
        "monotonic alignment",
        "aligns to the last source token",
        "aligns to the first source token",
    ]


def test_a_head_split_between_many_offsets_is_mixed():
    S = 20

    def spread(q):  # a quarter each on q-3, q-1, q+1 and q+3 (folded back into the sentence at its ends)
        row = torch.zeros(S, dtype=torch.float64)
        for d in (-3, -1, 1, 3):
            row[min(max(q + d, 0), S - 1)] += 0.25
        return row

    p = torch.stack([spread(q) for q in range(S)])  # (S, S)
    assert _label("enc_self", [p], S=S, T=S) == ["mixed"]


def test_a_weak_preference_for_the_previous_token_is_not_positional():
    """0.3 on the previous token, the rest on two keys far away that move around: not diffuse (three keys),
    and the previous token clears uniform's 1/14 by 0.23, less than MARGIN (0.25)."""
    S = 14
    p = torch.zeros(S, S, dtype=torch.float64)
    for q in range(S):
        p[q, max(q - 1, 0)] += 0.3
        p[q, (q + 5) % S] += 0.35
        p[q, (q + 9) % S] += 0.35
    assert _label("enc_self", [p], S=S, T=S) == ["mixed"]
    p_strong = p.clone()
    for q in range(S):  # 0.1 taken from each far key and given to the previous token: 0.5 clears 1/14 by 0.43
        p_strong[q, max(q - 1, 0)] += 0.2
        p_strong[q, (q + 5) % S] -= 0.1
        p_strong[q, (q + 9) % S] -= 0.1
    assert _label("enc_self", [p_strong], S=S, T=S) == ["positional (offset -1)"]


# ---------------------------------------------------------------- bootstrap intervals

REFS = [f"a man number {i} walks his dog in the park." for i in range(40)]


def test_bleu_of_all_sentences_is_sacrebleus_corpus_bleu():
    import sacrebleu

    hyps = [r.replace("dog", "cat") if i % 3 else r.replace(" in the park", "") for i, r in enumerate(REFS)]
    want = sacrebleu.metrics.BLEU().corpus_score(hyps, [REFS]).score
    assert bleu_from_statistics(bleu_statistics(hyps, REFS).sum(0)) == pytest.approx(want, abs=1e-9)


def test_identical_systems_give_an_interval_of_width_zero_around_zero():
    hyps = [r.replace("park", "garden") if i % 2 else r for i, r in enumerate(REFS)]
    c = paired_bleu_change(hyps, hyps, REFS)
    assert (c.value, c.low, c.high) == (0.0, 0.0, 0.0) and not c.significant


def test_a_clearly_better_system_gives_an_interval_excluding_zero():
    worse = [r.replace("walks his dog", "runs") if i % 2 else r for i, r in enumerate(REFS)]
    c = paired_bleu_change(worse, REFS, REFS)
    assert c.value > 0 and c.low > 0 and c.significant
    assert c.low <= c.value <= c.high


def test_a_change_on_few_sentences_is_not_significant():
    """One sentence of 40 slightly different, in either direction: the interval contains 0."""
    a = list(REFS)
    b = list(REFS)
    b[0] = b[0].replace("park", "garden")
    c = paired_bleu_change(a, b, REFS)
    assert c.value < 0 and c.low < 0 <= c.high and not c.significant


def test_the_same_seed_gives_the_same_interval_and_another_seed_another():
    worse = [
        r.replace("dog", "cat") if i % 3 == 0 else r.replace("park", "street") if i % 5 == 0 else r
        for i, r in enumerate(REFS)
    ]
    assert paired_bleu_change(worse, REFS, REFS, seed=3) == paired_bleu_change(worse, REFS, REFS, seed=3)
    assert paired_bleu_change(worse, REFS, REFS, seed=3) != paired_bleu_change(worse, REFS, REFS, seed=4)


def test_loss_interval_is_paired():
    """b is a's loss plus 0.1 per token on every sentence, with sentences of very different losses: pairing
    cancels the spread between sentences, so the interval is exactly the 0.1 shift."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(5, 20, size=50).astype(float)
    loss_a = tokens * rng.uniform(1.0, 5.0, size=50)
    c = paired_loss_change(loss_a, tokens, loss_a + 0.1 * tokens, tokens)
    assert c.value == pytest.approx(0.1) and c.low == pytest.approx(0.1) and c.high == pytest.approx(0.1)


def test_sentence_losses_add_up_to_the_mean_token_loss():
    model, b = tiny_model("fused"), batch()
    loss, tokens = sentence_losses(model, [b])
    assert tokens.tolist() == [5, 4, 3]  # T - 1 - b predicted tokens in row b
    assert loss.sum() / tokens.sum() == pytest.approx(mean_token_loss(model, b.src, b.tgt).item(), rel=1e-9)
    for r in range(3):  # one sentence at a time, its padding cut off, gives its own loss
        src = b.src[r : r + 1, : int((b.src[r] != PAD).sum())]
        tgt = b.tgt[r : r + 1, : int((b.tgt[r] != PAD).sum())]
        assert loss[r] / tokens[r] == pytest.approx(mean_token_loss(model, src, tgt).item(), rel=1e-9)


def test_per_head_importance_input_is_not_changed():
    model = tiny_model("per_head")
    model.train()
    head_importance(model, [batch()])
    assert model.training and isinstance(attention_at(model, "enc_self", 0), PerHeadAttention)


# ---------------------------------------------------------------- the command line


def run_main(argv, capsys):
    from annotated.attention.heads import main

    code = main(argv)
    err = capsys.readouterr().err
    return code, err


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--checkpoint", "no/such.pt"], "no such file"),
        (["--checkpoint", "{ckpt}", "--sentences", "1"], "--sentences: must be a whole number >= 2"),
        (["--checkpoint", "{ckpt}", "--max-loss-increase", "0.5"], "--max-loss-increase only applies with --prune"),
        (
            ["--checkpoint", "{ckpt}", "--prune", "--max-loss-increase", "-1"],
            "--max-loss-increase: must be a finite number >= 0",
        ),
        (
            ["--checkpoint", "{ckpt}", "--prune", "--max-loss-increase", "nan"],
            "--max-loss-increase: must be a finite number >= 0",
        ),
        (["--checkpoint", "{ckpt}", "--test-sentences", "5"], "--test-sentences only applies with --prune"),
        (["--checkpoint", "{ckpt}", "--finetune-steps", "5"], "--finetune-steps only applies with --prune"),
        (["--checkpoint", "{ckpt}", "--length-penalty", "2"], "--length-penalty only applies with --prune"),
        (
            ["--checkpoint", "{ckpt}", "--prune", "--length-penalty", "-1"],
            "--length-penalty: must be a finite number >= 0",
        ),
        (
            ["--checkpoint", "{ckpt}", "--prune", "--finetune-steps", "-1"],
            "--finetune-steps: must be a whole number >= 0",
        ),
        (["--checkpoint", "{ckpt}", "--resamples", "0"], "--resamples: must be a whole number >= 1"),
        (["--checkpoint", "{ckpt}", "--beam", "0"], "--beam: must be a whole number >= 1"),
        (["--checkpoint", "{ckpt}", "--threads", "0"], "--threads: must be a whole number >= 1"),
        (["--checkpoint", "{ckpt}", "--sentences", "many"], "--sentences: must be a whole number"),
        (["--checkpoint", "{ckpt}", "--bogus"], "unrecognized arguments"),
        (["--checkpoint"], "--checkpoint: expected one argument"),
        (["--checkpoint", "{ckpt}", "--out", "{ckpt}"], "is not a folder"),
        (["--checkpoint", "{ckpt}", "--out", "{old}"], "add --force"),
        (["--checkpoint", "{ckpt}", "--device", "tpu"], "--device: must be cpu, cuda or cuda:N"),
    ],
)
def test_bad_options_give_one_line_and_exit_2(argv, words, tmp_path, capsys):
    ckpt = tmp_path / "model.pt"
    ckpt.write_bytes(b"not looked at: options are checked before anything is loaded")
    old = tmp_path / "old"
    old.mkdir()
    (old / "heads.json").write_text("an earlier result")
    code, err = run_main([a.format(ckpt=ckpt, old=old) for a in argv], capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and words in err, err
    assert (old / "heads.json").read_text() == "an earlier result"


def test_bad_checkpoint_file_is_one_line_exit_2(tmp_path, capsys):
    ckpt = tmp_path / "model.pt"
    ckpt.write_bytes(b"garbage")
    code, err = run_main(["--checkpoint", str(ckpt), "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "model.pt" in err
    assert not (tmp_path / "o").exists()


def test_a_model_without_a_language_pair_is_refused(tmp_path, capsys):
    """No src_lang/tgt_lang in the metadata (an imported folder that named none): refused in one line naming the
    fix, not scored in a guessed direction."""
    from annotated.checkpoint import save_checkpoint
    from annotated.training.data import train_tokenizer
    from annotated.transformer import make_model

    tokenizer = train_tokenizer(["Ein Hund rennt.", "A dog runs.", "Zwei Männer.", "Two men."] * 20, 300, tmp_path)
    model = make_model(src_vocab=300, tgt_vocab=300, N=1, d_model=8, d_ff=8, h=2)
    for meta in ({}, {"src_lang": "de"}):
        save_checkpoint(tmp_path / "model.pt", model, tokenizer, meta)
        code, err = run_main(["--checkpoint", str(tmp_path / "model.pt"), "--out", str(tmp_path / "o")], capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert "names no language pair" in err and "ARGS='--src de --tgt en'" in err
    assert not (tmp_path / "o").exists()


def test_without_a_checkpoint_or_a_run_it_says_how_to_get_one(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no runs/ here
    monkeypatch.setattr("annotated.shipped.FOLDER", tmp_path / "empty box")  # and no shipped model
    code, err = run_main([], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "no checkpoint found" in err


def test_help_states_the_stop_rule(capsys):
    from annotated.attention.heads import main

    assert main(["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "stops at the first removal that raises the held-out validation loss" in text
    assert "--finetune-steps" in text and "--resamples" in text


# ---------------------------------------------------------------- pictures


def _change(value, significant):
    return {
        "value": value,
        "low": value - 0.5 if significant else -1.0,
        "high": value + 0.5 if significant else 1.0,
        "significant": significant,
    }


def _report():
    """A heads report of one layer of two heads per kind, with made-up numbers."""
    bleu = {
        "enc_self": [(0.5, False), (-3.0, True)],
        "dec_self": [(-1.0, False), (0.2, False)],
        "cross": [(-2.0, True), (0.0, False)],
    }
    loss = {
        "enc_self": [(0.01, False), (0.3, True)],
        "dec_self": [(0.02, True), (-0.05, False)],
        "cross": [(0.1, True), (0.0, False)],
    }
    importance = {"enc_self": [0.1, 0.2], "dec_self": [0.05, 0.9], "cross": [0.3, 0.4]}
    return {
        "kinds": {
            k: {
                "importance": [importance[k]],
                "bleu_change": [[_change(*c) for c in bleu[k]]],
                "loss_change": [[_change(*c) for c in loss[k]]],
            }
            for k in KINDS
        }
    }


def test_heat_maps_share_one_colour_range_per_measure_and_hatch_what_is_not_significant():
    from annotated.attention.heads import heat_map, measure_ranges
    from annotated.attention.pictures import CMAP

    report = _report()
    ranges = measure_ranges(report)
    assert ranges == {"importance": (0.0, 0.9), "bleu_change": (-3.0, 3.0), "loss_change": (-0.3, 0.3)}
    for kind in KINDS:
        fig = heat_map(kind, report, ranges)
        panels = [ax for ax in fig.axes if ax.images]
        assert len(panels) == 3 and len(fig.axes) == 6  # three panels, each with its colour bar
        for ax, key in zip(panels, ("importance", "bleu_change", "loss_change")):
            assert ax.images[0].get_clim() == ranges[key] and ax.images[0].get_cmap().name == CMAP
            assert (ax.get_xlabel(), ax.get_ylabel()) == ("head", "layer")
            hatched = sum(1 for patch in ax.patches if patch.get_hatch())
            quiet = 0 if key == "importance" else sum(not c["significant"] for c in report["kinds"][kind][key][0])
            assert hatched == quiet, (kind, key)


def test_the_example_figure_shows_every_head_with_its_label():
    from types import SimpleNamespace

    from annotated.attention.heads import examples_figure

    model = tiny_model("fused", dtype=torch.float32)
    tokenizer = SimpleNamespace(pieces=lambda ids: [f"w{i}" for i in ids])
    labels = {k: [[f"{k} {l} {i}" for i in range(3)] for l in range(2)] for k in KINDS}
    fig = examples_figure(model, tokenizer, [5, 6, 7, 8, 12], [9, 10, 11], labels)
    grids = [ax for ax in fig.axes if ax.images and ax.get_title()]
    assert len(grids) == 6 * 3  # 3 attentions x 2 layers, 3 heads each
    for ax in grids:
        kind = ax.get_title().split("[")[0]
        layer, head = int(ax.get_title().split("[")[1][0]), int(ax.get_title().split("head ")[1][0])
        assert ax.get_title().endswith(labels[kind][layer][head])
        weights = ax.images[0].get_array()  # (T_q, T_k): 5 source tokens; 4 target positions (<s> + 3 words)
        assert weights.shape == {"enc_self": (5, 5), "dec_self": (4, 4), "cross": (4, 5)}[kind]
        assert np.allclose(weights.sum(-1), 1.0, atol=1e-5)  # each query's row of the head's attention


def test_progress_is_a_bar_with_a_total_on_a_terminal_and_plain_lines_in_a_log():
    from tqdm import tqdm

    from annotated.plumbing.progress import progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    screen, log = Terminal(), io.StringIO()
    with progress(total=7, desc="ablation", stream=screen) as bar:
        assert isinstance(bar, tqdm) and bar.total == 7
        bar.update(7)
    with progress(total=7, desc="ablation", stream=log) as bar:
        bar.update(7)
    assert "\r" not in log.getvalue() and log.getvalue().splitlines()[-1].startswith("ablation: 7/7 (100%)")
    assert "left" in log.getvalue().splitlines()[-1]


def test_command_misuse_exits_2_without_traceback():
    r = subprocess.run(
        [sys.executable, "-m", "annotated.attention.heads", "--checkpoint", "x.pt", "--sentences", "-3"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


# ---------------------------------------------------------------- one loss, named


def test_by_default_every_validation_sentence_and_the_label_smoothed_loss_is_the_runs_logged_val_loss(
    tmp_path, monkeypatch, data_url, cache
):
    import re

    from annotated.attention.heads import _data, label_smoothing_of, parse_args
    from annotated.checkpoint import load_checkpoint
    from annotated.training import train

    monkeypatch.setenv("MULTI30K_URL", data_url)
    monkeypatch.setenv("ANNOTATED_CACHE", str(cache))
    lines = []
    train.train(
        train.PRESETS["smoke"],
        tmp_path / "run",
        source=train.DataSource(data_url, cache),
        progress=False,
        log=lines.append,
    )
    best = tmp_path / "run" / "best.pt"
    model, tokenizer, meta = load_checkpoint(best)
    [logged] = [
        float(re.search(r"val loss ([0-9.]+)", line).group(1))
        for line in lines
        if line.startswith(f"epoch {meta['epoch']:3d} ")
    ]
    args = parse_args(["--checkpoint", str(best), "--out", str(tmp_path / "out")])
    val, _encoded, batches, _, available = _data(meta, tokenizer, args.sentences, model.config.max_len, False, None)
    assert len(val) == available == 1014  # the whole validation split
    assert label_smoothing_of(meta) == train.PRESETS["smoke"].label_smoothing == 0.1
    got = train.evaluate_loss(model, batches, label_smoothing_of(meta), torch.device("cpu"))  # as the command
    # the log prints 3 decimals and the checkpoint keeps 4; the sums differ only in float rounding
    assert got == pytest.approx(logged, abs=5e-4) and got == pytest.approx(meta["val_loss"], abs=1e-4)
    loss, tokens = sentence_losses(model, batches)
    assert abs(loss.sum() / tokens.sum() - meta["val_loss"]) > 0.01  # the plain cross-entropy is another number


def test_the_table_names_each_loss_and_what_the_runs_log_scored():
    from annotated.attention.heads import format_table, run_log_loss

    meta = {"val_loss": 2.6631, "epoch": 20, "averaged": [f"runs/r/epoch{e}.pt" for e in range(16, 21)]}
    report = _report()
    for kind in KINDS:
        report["kinds"][kind]["label"] = [["mixed", "mixed"]]
    report.update(
        baseline={"bleu": 30.0, "loss": 1.573, "loss_label_smoothed": 2.612, "label_smoothing": 0.1},
        validation={"sentences": 1014, "of": 1014, "confidence": 0.95, "resamples": 1000, "seed": 0},
        run_log=run_log_loss(meta),
    )
    text = " ".join(format_table(report).split())
    assert "val loss 1.573 (cross-entropy per target token, no label smoothing) on 1014 validation sentences" in text
    assert "with the training's label smoothing 0.1 the same sentences give 2.612" in text
    assert "the run's log: val loss 2.663 for the model of epoch 20, the last of the 5 epochs" in text
    assert run_log_loss({"epoch": 3}) is None and run_log_loss({"val_loss": 1.0, "epoch": 3})["averaged"] is None


# ---------------------------------------------------------------- the pruning curve


def test_the_pruning_curve_marks_the_stop_and_draws_every_point_of_the_path():
    from annotated.attention.curve import curve_figure
    from annotated.attention.pictures import colour_table

    losses, test, held = [1.70, 1.72, 1.78, 1.85, 2.10], [38.0, 38.1, 37.6, 36.0, 30.0], [35.0, 35.2, 34.0, 33.5, 28.0]
    curve = [
        {"heads_removed": i, "held_out_loss": l, "test_bleu": t, "held_out_bleu": h, "kept": i <= 2}
        for i, (l, t, h) in enumerate(zip(losses, test, held))
    ]
    fig = curve_figure(curve, 1.70, 0.1, stop=2, test_sentences=1000)
    top, bottom = fig.axes
    lines = {ax: [line for line in ax.get_lines() if len(line.get_xdata()) == 5] for ax in (top, bottom)}
    assert list(lines[top][0].get_ydata()) == losses
    assert np.allclose(lines[bottom][0].get_ydata(), [t - 38.0 for t in test])  # changes from the unpruned model
    assert np.allclose(lines[bottom][1].get_ydata(), [h - 35.0 for h in held])
    ceiling = [line for line in top.get_lines() if np.allclose(line.get_ydata(), 1.8)]
    assert len(ceiling) == 1
    for ax in (top, bottom):
        stops = [line for line in ax.get_lines() if list(line.get_xdata()) == [2, 2]]
        assert len(stops) == 1  # the dotted line at the stop
        filled, hollow = ax.collections[:2]
        assert [x for x, _ in filled.get_offsets()] == [0, 1, 2] and [x for x, _ in hollow.get_offsets()] == [3, 4]
    colours = {c.lower() for c in colour_table(5)}
    assert {matplotlib.colors.to_hex(line.get_color()) for ax in (top, bottom) for line in lines[ax]} <= colours
    assert "heads removed" in bottom.get_xlabel() and "no label smoothing" in top.get_ylabel()
    with pytest.raises(ValueError, match="unpruned"):
        curve_figure(curve[1:], 1.70, 0.1, stop=2, test_sentences=1000)
