"""Removing, scoring and inspecting heads (annotated/attention/importance.py, annotated/attention/profiles.py)."""
import math
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from annotated.attention.profiles import position_profiles
from annotated.sites import KINDS, attention_at, head_counts, keep_heads, keep_heads_fused, keep_heads_per_head, remove_heads, set_head_counts, sites
from annotated.attention.importance import head_importance, mean_token_loss
from annotated.tokens import PAD, BOS, EOS
from annotated.transformer import (PerHeadAttention, attention_explicit, convert_model, make_model, padding_mask,
                                   target_mask)

from conftest import REPO


def tiny_model(attention="per_head", dtype=torch.float64, seed=0, N=2, h=3, d_model=12, vocab=17):
    """A small model with every parameter random (biases too, so no block of zeros hides a mistake)."""
    torch.manual_seed(seed)
    m = make_model(src_vocab=vocab, tgt_vocab=vocab, N=N, d_model=d_model, d_ff=16, h=h, dropout=0.0,
                   max_len=20, attention=attention).to(dtype)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return m.eval()


def batch(seed=1, B=3, S=7, T=6, vocab=17):
    """Token ids with padding: src (B, S), tgt (B, T) = bos ... eos pad."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, vocab, (B, S), generator=g)
    tgt = torch.randint(4, vocab, (B, T), generator=g)
    tgt[:, 0] = BOS
    for b in range(B):
        s_len, t_len = S - b, T - b
        src[b, s_len:] = PAD
        tgt[b, t_len - 1] = EOS
        tgt[b, t_len:] = PAD
    return SimpleNamespace(src=src, tgt=tgt)


def logits(model, b):
    tgt_in = b.tgt[:, :-1]
    return model(b.src, tgt_in, padding_mask(b.src, PAD), target_mask(tgt_in, PAD))


@pytest.mark.parametrize("form", ["per_head", "fused"])
def test_removing_no_heads_changes_nothing(form):
    model, b = tiny_model(form), batch()
    same = remove_heads(model, {site: [] for site in sites(model)})
    assert torch.equal(logits(same, b), logits(model, b))  # exactly: the same numbers, the same operations
    for site in sites(model):
        att = attention_at(model, *site)
        kept = keep_heads(att, range(att.h))
        assert all(torch.equal(p, q) for p, q in zip(att.parameters(), kept.parameters()))


def test_per_head_removal_leaves_out_exactly_term_i():
    """keep_heads_per_head computes sum over the other heads of head_j W_O[j] + b_O, written out here."""
    att = attention_at(tiny_model(), "enc_self", 0)
    x = torch.randn(2, 5, att.d_model, dtype=torch.float64)
    mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])[:, None, :]  # (B, 1, T) padding mask
    for i in range(att.h):
        want = att.b_O.clone()
        for j in range(att.h):
            if j != i:
                head_j, _ = attention_explicit(x @ att.W_Q[j] + att.b_Q[j], x @ att.W_K[j] + att.b_K[j],
                                               x @ att.W_V[j] + att.b_V[j], mask)
                want = want + head_j @ att.W_O[j]
        got, _ = keep_heads_per_head(att, [j for j in range(att.h) if j != i])(x, x, mask)
        # float64, sums of a dozen products of O(1) numbers: rounding is ~1e-15; a wrong head is O(1) off
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_removing_a_head_per_head_equals_fused_without_its_blocks():
    per_head, b = tiny_model("per_head"), batch()
    fused = convert_model(per_head, "fused")
    for kind, layer in sites(per_head):
        for i in range(per_head.config.h):
            keep = [j for j in range(per_head.config.h) if j != i]
            a = remove_heads(per_head, {(kind, layer): [i]})  # term i left out of the per-head loop
            f = convert_model(fused, "fused")  # the fused model built without block i
            attn = attention_at(fused, kind, layer)
            stack = f.encoder if kind == "enc_self" else f.decoder
            setattr(stack.layers[layer], "cross_attn" if kind == "cross" else "self_attn",
                    keep_heads_fused(attn, keep))
            # float64: the two forms add the same products in a different order, so they differ by rounding
            # (~1e-15 relative on logits of size ~10); removing the wrong head changes logits by O(1)
            torch.testing.assert_close(logits(a, b), logits(f, b), rtol=0, atol=1e-10)
            # and the blocks are the same numbers: fusing the pruned per-head attention gives f's, bit for bit
            fused_a = convert_model(a, "fused")
            assert all(torch.equal(p, q) for p, q in zip(attention_at(fused_a, kind, layer).parameters(),
                                                         attention_at(f, kind, layer).parameters()))
            assert not torch.allclose(logits(a, b), logits(per_head, b), atol=1e-3)  # the head did matter


def test_remove_heads_leaves_the_model_alone_and_counts_heads():
    model = tiny_model("fused")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pruned = remove_heads(model, {("enc_self", 1): [0, 2], ("cross", 0): [1]})
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert head_counts(pruned) == {"enc_self": [3, 1], "dec_self": [3, 3], "cross": [2, 3]}
    assert head_counts(model) == {kind: [3, 3] for kind in KINDS}


def test_keep_heads_rejects_bad_indices():
    att = attention_at(tiny_model(), "cross", 0)
    with pytest.raises(ValueError, match="at least one head"):
        keep_heads(att, [])
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        keep_heads(att, [0, 3])
    with pytest.raises(ValueError, match="2 integers >= 1"):
        set_head_counts(tiny_model(), {"enc_self": [3], "dec_self": [3, 3], "cross": [3, 3]})


class _Gated(nn.Module):
    """An attention whose head i is multiplied by a gate xi, built without the W_O identity:
    output = (attention without head i) + xi * (full output - attention without head i)."""

    def __init__(self, att, i, xi):
        super().__init__()
        self.full, self.xi = att, xi
        self.without = keep_heads(att, [j for j in range(att.h) if j != i])

    def forward(self, *args, **kwargs):
        out, p = self.full(*args, **kwargs)
        rest, _ = self.without(*args, **kwargs)
        return rest + self.xi * (out - rest), p


def test_importance_matches_finite_differences():
    model, b = tiny_model("fused", N=1, h=2), batch(B=3)
    got = head_importance(model, [b])  # mean over the 3 sentences of |dL/dxi|
    eps = 1e-6
    for kind, layer in sites(model):
        for i in range(2):
            diffs = []
            for r in range(3):  # each sentence alone, its padding cut off
                src = b.src[r:r + 1, :int((b.src[r] != PAD).sum())]
                tgt = b.tgt[r:r + 1, :int((b.tgt[r] != PAD).sum())]

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
        for layer_profile in prof[kind]:
            sums = layer_profile[:, :-1].sum(axis=1)  # (h,) offsets only
            assert sums == pytest.approx([1.0] * 3, abs=1e-5)
            last = layer_profile[:, -1]
            assert all(math.isnan(v) for v in last) if kind == "dec_self" else all(0 <= v <= 1 for v in last)


def test_dec_self_profile_puts_nothing_on_future_offsets():
    prof = position_profiles(tiny_model("per_head", dtype=torch.float32), [batch()], window=3)
    assert (prof["dec_self"][0][:, 4:7] == 0).all()  # offsets +1 ... +3 are masked (causal)


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


@pytest.mark.parametrize("argv, words", [
    (["--checkpoint", "no/such.pt"], "no such file"),
    (["--checkpoint", "{ckpt}", "--sentences", "0"], "--sentences: must be a whole number >= 1"),
    (["--checkpoint", "{ckpt}", "--threshold", "0.5"], "--threshold only applies with --prune"),
    (["--checkpoint", "{ckpt}", "--prune", "--threshold", "-1"], "--threshold: must be a finite number >= 0"),
    (["--checkpoint", "{ckpt}", "--prune", "--threshold", "nan"], "--threshold: must be a finite number >= 0"),
    (["--checkpoint", "{ckpt}", "--test-sentences", "5"], "--test-sentences only applies with --prune"),
    (["--checkpoint", "{ckpt}", "--beam", "0"], "--beam: must be a whole number >= 1"),
    (["--checkpoint", "{ckpt}", "--threads", "0"], "--threads: must be a whole number >= 1"),
    (["--checkpoint", "{ckpt}", "--sentences", "many"], "--sentences: must be a whole number"),
    (["--checkpoint", "{ckpt}", "--bogus"], "unrecognized arguments"),
    (["--checkpoint"], "--checkpoint: expected one argument"),
    (["--checkpoint", "{ckpt}", "--out", "{ckpt}"], "is not a folder"),
    (["--checkpoint", "{ckpt}", "--out", "{old}"], "add --force"),
    (["--checkpoint", "{ckpt}", "--device", "tpu"], "--device: must be cpu, cuda or cuda:N"),
])
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


def test_without_a_checkpoint_or_a_run_it_says_how_to_get_one(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no runs/ here
    code, err = run_main([], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "no checkpoint found" in err


def test_command_misuse_exits_2_without_traceback():
    r = subprocess.run([sys.executable, "-m", "annotated.attention.heads", "--checkpoint", "x.pt", "--sentences", "-3"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
