"""make circuits (annotated/circuits/command.py): one line and exit 2 for what it cannot read; pruned and
imported models read as they compute."""

import pytest
import torch

from annotated.checkpoint import save_checkpoint
from annotated.circuits.circuits import attention_inputs, circuits
from annotated.circuits.command import main
from annotated.circuits.direct import exact, sentence_vectors
from annotated.circuits.readout import Inputs, read_model
from annotated.sites import attention_at, remove_heads
from annotated.tokens import BOS, EOS, PAD
from annotated.transformer import make_model


@pytest.fixture(scope="module")
def shipped():
    from annotated.shipped import load_shipped

    return load_shipped("de-en")


def _refusal(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_a_checkpoint_without_its_tokenizer_is_refused(shipped, tmp_path, capsys):
    model, _, meta = shipped
    save_checkpoint(tmp_path / "bare.pt", model, None, meta)
    line = _refusal(capsys, ["--checkpoint", str(tmp_path / "bare.pt"), "--out", str(tmp_path / "out")])
    assert "holds no tokenizer" in line and "make import" in line
    assert not (tmp_path / "out").exists()  # nothing written


def test_a_tokenizer_that_does_not_fit_the_model_is_refused(shipped, tmp_path, capsys):
    _, tokenizer, meta = shipped
    small = make_model(src_vocab=50, tgt_vocab=50, N=1, d_model=16, d_ff=16, h=2)
    save_checkpoint(tmp_path / "other.pt", small, tokenizer, meta)
    line = _refusal(capsys, ["--checkpoint", str(tmp_path / "other.pt"), "--out", str(tmp_path)])
    assert "5000 subwords" in line and "50 (source) and 50 (target)" in line  # load_checkpoint's own check


def test_a_pruned_head_asked_for_by_number_is_refused(shipped, tmp_path, capsys):
    from annotated.attention.prune import save_pruned

    model, tokenizer, meta = shipped
    pruned = remove_heads(model, {("cross", 1): [0, 3]})
    save_pruned(tmp_path / "pruned.pt", pruned, tokenizer, meta)
    argv = ["--checkpoint", str(tmp_path / "pruned.pt"), "--out", str(tmp_path)]
    line = _refusal(capsys, [*argv, "--head", "cross:1:2"])
    assert "pruning kept 2 of its 4 heads" in line and "no circuit" in line
    assert "layers 0..1" in _refusal(capsys, [*argv, "--head", "cross:2:0"])
    assert "KIND:LAYER:HEAD" in _refusal(capsys, [*argv, "--head", "cross:one:0"])


def _inputs(tokenizer) -> Inputs:
    src = ["Ein Hund rennt über die Wiese.", "Zwei Männer spielen Fußball."]
    tgt = ["A dog runs across the meadow.", "Two men play soccer."]
    pad = lambda seqs: torch.nn.utils.rnn.pad_sequence([torch.tensor(s) for s in seqs], batch_first=True)
    batch = (pad([tokenizer.encode(s) for s in src]), pad([[BOS, *tokenizer.encode(t), EOS] for t in tgt]))
    from collections import Counter

    counts = Counter(i for s in src + tgt for i in tokenizer.encode(s))
    return Inputs(tokenizer.pieces, counts, counts, [batch], [batch], [], None, None)


def test_a_pruned_model_is_read_without_its_removed_heads(shipped):
    model, tokenizer, _ = shipped
    pruned = remove_heads(model, {("cross", 1): [0, 3], ("enc_self", 0): [1]})
    report = read_model(pruned, _inputs(tokenizer))
    kept = [(tuple(h["site"]), h["head"]) for h in report["heads"]]
    assert len(kept) == 24 - 3
    assert [i for s, i in kept if s == ("cross", 1)] == [0, 1] and [i for s, i in kept if s == ("enc_self", 0)] == [
        0,
        1,
        2,
    ]
    assert all("faithfulness" in h and "faithfulness_exact_norms" in h for h in report["heads"])


def test_an_imported_marian_model_is_read_as_it_computes():
    """A MarianMTModel without embedding scaling, imported: the direct path of its first layer is still exactly
    the input its attention reads, and the circuits give its scores."""
    pytest.importorskip("transformers")
    from transformers import MarianConfig, MarianMTModel

    from annotated.interop.marian import from_marian

    torch.manual_seed(0)
    config = MarianConfig(
        vocab_size=40,
        d_model=16,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=64,
        dropout=0.0,
        scale_embedding=False,
        pad_token_id=39,
        decoder_start_token_id=39,
        eos_token_id=0,
    )
    hf = MarianMTModel(config).double().eval()
    model, _, _ = from_marian(hf)
    model = model.double().eval()
    src = torch.tensor([[5, 6, 7, 8, 9]])
    tgt = torch.tensor([[BOS, 10, 11, 12]])
    inputs = attention_inputs(model, src, tgt, PAD)
    for site, ids in ((("enc_self", 0), src), (("dec_self", 0), tgt)):
        assert exact(model, site)
        assert (sentence_vectors(model, site, "q", ids) - inputs[site][0]).abs().max() < 1e-12
    for site, heads in circuits(model).items():
        att = attention_at(model, *site)
        x_q, x_kv = inputs[site]
        q, (k, _) = att.queries(x_q), att.keys_values(x_kv)
        real = q @ k.transpose(-1, -2) / att.d_k**0.5
        for c in heads:
            assert (c.scores(x_q, x_kv) - real[:, c.head]).abs().max() < 1e-12


def test_the_best_cross_head_is_the_one_with_the_lowest_aer():
    from annotated.circuits.command import best_cross_head

    heads = [
        {"site": ["cross", 0], "head": 0, "aer": 0.52},
        {"site": ["cross", 1], "head": 0, "aer": 0.41},
        {"site": ["cross", 1], "head": 2, "aer": 0.33},
        {"site": ["cross", 1], "head": 3, "aer": 0.38},
        {"site": ["enc_self", 0], "head": 0},  # no AER: not a candidate
    ]
    best = best_cross_head({"heads": heads})
    assert best is not None and (best["site"], best["head"]) == (["cross", 1], 2)
    assert best_cross_head({"heads": heads[-1:]}) is None  # without the aligner


def test_a_test_pair_too_long_for_the_model_is_dropped_with_its_links(monkeypatch):
    """The second test pair is longer than the model's max_len: it is left out of the test batches, and so are
    its reference links, so the third sentence is scored against its own links, not the second's."""
    from types import SimpleNamespace

    from annotated.circuits import command
    from annotated.circuits.command import gather_inputs

    train = [("a b", "c d")] * 3
    test = [("a b", "c d"), ("a " * 9, "c " * 9), ("b a", "d c")]  # 9 words: too long for max_len 6
    links = [{(0, 0)}, {(8, 8)}, {(0, 1), (1, 0)}]
    monkeypatch.setattr(command, "load_multi30k", lambda split, src, tgt, *a, **k: train)
    monkeypatch.setattr(
        command,
        "multi30k_alignments",
        lambda src, tgt, *a, **k: {"train": (train, [{(0, 0)}] * 3), "test_2016_flickr": (test, links)},
    )
    words = {"a": 4, "b": 5, "c": 6, "d": 7}
    tokenizer = SimpleNamespace(
        encode_batch=lambda texts: [[words[w] for w in t.split()] for t in texts],
        pieces=lambda ids: [f"\u2581{'abcd'[i - 4]}" for i in ids],
    )
    model = make_model(src_vocab=8, tgt_vocab=8, N=1, d_model=8, d_ff=8, h=2, max_len=6)
    args = SimpleNamespace(checkpoint="tiny.pt", sentences=3, pairs=3, no_aligner=False)
    inputs = gather_inputs(model, tokenizer, {"src_lang": "de", "tgt_lang": "en"}, args, lambda line: None)
    assert [src.tolist() for src, _ in inputs.test_batches] == [[[4, 5], [5, 4]]]
    assert inputs.test_links == [links[0], links[2]]
