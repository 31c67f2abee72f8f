"""Pruning heads for real, pruned checkpoints, and the command end to end (annotated/prune.py, heads_cli.py)."""
import json

import pytest
import torch

from annotated.checkpoint import CheckpointError, load_checkpoint, read_checkpoint, save_checkpoint
from annotated.decoding import translate_ids
from annotated.heads import KINDS, attention_at, head_counts, remove_heads, sites
from annotated.prune import count_parameters, greedy_prune, save_pruned
from annotated.transformer import FusedAttention

from test_heads import batch, logits, tiny_model


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


def test_greedy_prune_follows_the_scores_and_stops_at_the_first_removal_that_costs_too_much():
    model = tiny_model("fused", N=1, h=2, dtype=torch.float32)
    # enc_self head 1 lowest (0.1), then cross head 0 (0.2), then dec_self head 1 (0.3)
    scores = {"enc_self": [0.9, 0.1], "dec_self": [0.8, 0.3], "cross": [0.2, 0.95]}

    def importance(m):  # the scores of the heads still there (enc_self keeps head 0)
        return {k: [scores[k] if attention_at(m, k, 0).h == 2 else [scores[k][0]]] for k in KINDS}

    def val_bleu(m):  # an enc_self head costs 0.2 BLEU, a cross head 2
        c = head_counts(m)
        return 30.0 - 2.0 * (c["cross"] == [1]) - 0.2 * (c["enc_self"] == [1])

    result = greedy_prune(model, val_bleu, importance, threshold=0.5, baseline=30.0)
    # dec_self head 1 would cost nothing, but the search ends at the cross head, before reaching it
    assert [(s.kind, s.head, s.kept) for s in result.steps] == [("enc_self", 1, True), ("cross", 0, False)]
    assert head_counts(result.model) == {"enc_self": [1], "dec_self": [2], "cross": [2]}
    assert [s.val_bleu for s in result.removed] == [pytest.approx(29.8)]
    everything = greedy_prune(model, val_bleu, importance, threshold=5.0, baseline=30.0)
    assert head_counts(everything.model) == {k: [1] for k in KINDS}  # every attention keeps one head
    assert len(everything.steps) == 3


def test_greedy_prune_rejects_a_negative_threshold():
    with pytest.raises(ValueError, match="threshold"):
        greedy_prune(tiny_model(), lambda m: 0.0, lambda m: {}, threshold=-0.1)


# ---------------------------------------------------------------- the command, end to end

@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, data_url, cache):
    """A small untrained model with a real tokenizer, saved as a checkpoint."""
    from annotated import data
    from annotated.transformer import make_model

    pairs = data.load_multi30k("train", cache_dir=cache, base_url=data_url)[:300]
    tok = data.train_tokenizer([s for s, _ in pairs] + [t for _, t in pairs], 400, cache_dir=cache)
    torch.manual_seed(0)
    model = make_model(src_vocab=tok.vocab_size, tgt_vocab=tok.vocab_size, N=1, d_model=16, d_ff=32, h=2,
                       dropout=0.0, max_len=64, share_embeddings=True, tie_generator=True)
    path = tmp_path_factory.mktemp("ckpt") / "best.pt"
    save_checkpoint(path, model, tok, {"src_lang": "de", "tgt_lang": "en"})
    return path


def test_command_writes_table_json_pictures_and_a_pruned_checkpoint(tiny_checkpoint, data_url, cache, tmp_path,
                                                                     monkeypatch, capsys):
    from annotated.heads_cli import main

    monkeypatch.setenv("MULTI30K_URL", data_url)
    monkeypatch.setenv("ANNOTATED_CACHE", str(cache))
    out = tmp_path / "out"
    argv = ["--checkpoint", str(tiny_checkpoint), "--out", str(out), "--sentences", "4", "--prune",
            "--test-sentences", "3", "--beam", "2", "--threshold", "100"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert sum(line.split()[:1] in (["enc_self"], ["dec_self"], ["cross"]) for line in text.splitlines()) == 6
    text_json = (out / "heads.json").read_text()
    assert "NaN" not in text_json and "Infinity" not in text_json  # strict JSON: a browser's JSON.parse reads it
    report = json.loads(text_json)
    assert report["kinds"]["dec_self"]["position_profile"][0][0][-1] is None  # no last-source-token weight
    for kind in KINDS:
        assert (out / f"heads_{kind}.png").stat().st_size > 0
        for key in ("importance", "ablation_bleu", "ablation_loss"):
            assert [len(row) for row in report["kinds"][kind][key]] == [2]
    assert (out / "heads_inspect.png").stat().st_size > 0
    assert set(report["baseline"]) == {"bleu", "loss"}
    # threshold 100: every attention gives up all but one head
    assert report["pruning"]["after"]["heads"] == 3 and report["pruning"]["before"]["heads"] == 6
    pruned, _, meta = load_checkpoint(out / "pruned.pt")
    assert head_counts(pruned) == {k: [1] for k in KINDS} and len(meta["heads_removed"]) == 3
    assert report["pruning"]["after"]["parameters"] == count_parameters(pruned)
    # a second run does not overwrite the first without --force
    before = (out / "heads.json").read_bytes()
    assert main(argv) == 2 and "--force" in capsys.readouterr().err
    assert (out / "heads.json").read_bytes() == before
