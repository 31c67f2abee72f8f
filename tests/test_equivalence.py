"""The proof suite of annotated/equivalence.py, run inside `make test`.

Each test calls the same check function that `make equivalence` reports on
and asserts that every row passed; the tolerances are the module's (float64
1e-12, float32 1e-5, float32 logits 1e-5 relative to the largest logit; see
the prose there). Further tests show that the checks can fail (a broken head
layout is caught), that the fast path of nn.MultiheadAttention really ran,
and that bad conversions raise ValueErrors naming both shapes.
"""
import sys
import types

import pytest
import torch
from torch import nn

import annotated.equivalence as E
from annotated.equivalence import (
    Case, MhaCase, compare_forms, compare_with_torch_mha, copy_attention, fused_parameters, from_torch_mha,
    mha_fastpath, to_torch_mha, torch_mha_masks,
)
from annotated.transformer import FusedAttention, PerHeadAttention, make_model, split

CORNER_CASES = ["h = 1", "h = d_model", "h*d_k != d_model", "d_k != d_v", "T_q = 1", "T_k = 1", "self-attention",
                "cross-attention", "padding mask", "causal mask", "padding + causal", "a query with no visible key",
                "bias", "no bias", "per_head built first", "fused built first"]


def assert_all_pass(rows):
    assert rows, "a check returned no rows"
    for r in rows:
        assert r.passed, f"{r.check}: {r.cases} cases, max diff {r.max_diff} > tolerance {r.tol}; {r.notes}"


# --- 1. exact identities ------------------------------------------------------

def test_symbolic_identities_hold_exactly():
    row, identities = E.check_symbolic()
    assert_all_pass([row])
    sizes = {size for size, _, _ in identities}
    assert "d_model=4, h=2, d_k=d_v=2" in sizes and "d_model=3, h=2, d_k=2, d_v=3" in sizes  # h*d_k != d_model
    assert len(identities) == 9 and all(holds for _, _, holds in identities)


def _interleaved_heads(self, x, W, b, d):
    """A plausible bug: reading the h*d columns as (d, h), i.e. heads interleaved instead of in blocks."""
    B, T_len, _ = x.shape
    y = x @ W + b if b is not None else x @ W
    return y.view(B, T_len, d, self.h).permute(0, 3, 1, 2)


def test_the_checks_catch_a_wrong_head_layout(monkeypatch):
    monkeypatch.setattr(FusedAttention, "_heads", _interleaved_heads)
    row, identities = E.check_symbolic()
    assert not row.passed
    failing = [identity for _, identity, holds in identities if not holds]
    assert any(i.startswith("view(B, T, h, d).transpose(1, 2)") for i in failing)
    case = Case(batch=2, T_q=3, T_k=3, d_model=4, h=2, d_k=2, d_v=2, cross=False, padding=False, causal=False,
                bias=True, dtype=torch.float64, start="per_head", seed=0)
    assert compare_forms(case)["output"] > 1e-3


# --- 2. generated cases -------------------------------------------------------

def test_per_head_equals_fused_on_generated_cases():
    rows = E.check_forms(examples=200)
    assert_all_pass(rows)
    per_dtype = {r.check.rsplit(", ", 1)[1]: r.cases for r in rows if ": output," in r.check}
    assert set(per_dtype) == {"float32", "float64"} and sum(per_dtype.values()) >= 200
    quantities = {r.check.split(": ")[1].rsplit(",", 1)[0] for r in rows}
    assert quantities == {"output", "probabilities", "grad inputs", "grad parameters"}
    coverage = rows[0].coverage
    missing = [c for c in CORNER_CASES if coverage.get(c, 0) == 0]
    assert not missing, f"no generated case had: {missing}"


def test_float32_differences_are_scaled_by_the_size_of_the_values():
    """The case a 23,569-case run found: gradients up to 26, so float32 rounding alone exceeds 1e-5 absolute
    on some of them; scaled by max(1, largest |value|) every quantity is within 1e-5 (the prose's rule)."""
    case = Case(batch=2, T_q=3, T_k=3, d_model=2, h=1, d_k=5, d_v=2, cross=False, padding=False, causal=False,
                bias=True, dtype=torch.float32, start="per_head", seed=11586)
    diffs = compare_forms(case)
    assert all(d <= E.TOL[torch.float32] for d in diffs.values()), diffs
    assert E._max_scaled(torch.tensor([30.0]), torch.tensor([30.0006])) == pytest.approx(2e-5, rel=1e-2)
    assert E._max_scaled(torch.tensor([0.5]), torch.tensor([0.5 + 2e-5])) == pytest.approx(2e-5, rel=1e-2)


def test_fused_gradient_is_the_per_head_gradients_in_blocks():
    torch.manual_seed(0)
    ph = PerHeadAttention(6, 3, d_k=2, d_v=4).double()
    x = torch.randn(2, 4, 6, dtype=torch.float64)
    out, _ = ph(x, x)
    out.square().sum().backward()
    g = fused_parameters(ph, grads=True)
    assert torch.equal(g["W_Q"][:, 2:4], ph.W_Q[1].grad) and torch.equal(g["W_V"][:, 8:12], ph.W_V[2].grad)
    assert torch.equal(g["W_O"][4:8], ph.W_O[1].grad) and torch.equal(g["b_K"][4:6], ph.b_K[2].grad)


# --- 3. nn.MultiheadAttention -------------------------------------------------

def test_torch_mha_agrees_in_every_mode():
    rows = E.check_torch_mha()
    assert_all_pass(rows)
    modes = {r.check for r in rows}
    assert any("train, dropout 0" in m for m in modes) and any("fast path on" in m for m in modes)
    assert {c.batch_first for c in E.mha_cases()} == {True, False}


def test_fast_path_really_runs_and_flag_is_restored():
    before = torch.backends.mha.get_fastpath_enabled()
    on = MhaCase(8, 2, bias=True, batch_first=True, mode="eval, fast path on", cross=False, masks="both, separate",
                 form="per_head", need_weights=True)
    assert on.fast_path_expected
    res = compare_with_torch_mha(on)
    assert res["native kernel ran"] and res["output"] <= 1e-12 and res["weights"] <= 1e-12
    off = MhaCase(8, 2, bias=True, batch_first=True, mode="eval, fast path off", cross=False,
                  masks="both, separate", form="per_head", need_weights=True)
    assert not compare_with_torch_mha(off)["native kernel ran"]
    # one violated condition (batch_first=False) is enough to take the slow path
    slow = MhaCase(8, 2, bias=True, batch_first=False, mode="eval, fast path on", cross=False, masks="padding",
                   form="fused", need_weights=False)
    assert not slow.fast_path_expected and not compare_with_torch_mha(slow)["native kernel ran"]
    assert torch.backends.mha.get_fastpath_enabled() == before
    with pytest.raises(RuntimeError), mha_fastpath(not before):
        raise RuntimeError("the flag is restored even after an error")
    assert torch.backends.mha.get_fastpath_enabled() == before


def test_mask_mapping_inverts_the_convention():
    pad = torch.tensor([[[True, True, False]], [[True, False, False]]])  # (B=2, 1, T_k=3)
    attn, kpm = torch_mha_masks(pad, batch=2, h=2)
    assert attn is None and torch.equal(kpm, ~pad[:, 0])
    causal = torch.ones(1, 3, 3, dtype=torch.bool).tril()
    attn, kpm = torch_mha_masks(causal, batch=2, h=2)
    assert kpm is None and torch.equal(attn, ~causal[0])
    both = pad & causal  # (2, 3, 3): one mask per sentence -> one per (sentence, head), row b*h + i
    attn, kpm = torch_mha_masks(both, batch=2, h=3)
    assert kpm is None and attn.shape == (6, 3, 3)
    for b in range(2):
        for i in range(3):
            assert torch.equal(attn[b * 3 + i], ~both[b])
    assert torch_mha_masks(None, 2, 2) == (None, None)
    with pytest.raises(ValueError, match="does not match batch size 5"):
        torch_mha_masks(both, batch=5, h=1)
    with pytest.raises(ValueError, match="expected a bool mask"):
        torch_mha_masks(both.float(), batch=2, h=1)


@pytest.mark.parametrize("batch_first", [True, False])
def test_mha_conversions_are_exact_and_keep_settings(batch_first):
    torch.manual_seed(0)
    ph = PerHeadAttention(8, 4, dropout=0.25).double().eval()
    E.random_biases(ph, torch.Generator().manual_seed(0))
    mha = to_torch_mha(ph, batch_first=batch_first)
    assert mha.batch_first == batch_first and mha.dropout == 0.25 and not mha.training
    assert mha.in_proj_weight.dtype == torch.float64
    assert torch.equal(mha.in_proj_weight[2:4], ph.W_Q[1].T)  # rows of head 1's query block = W_Q[1]^T
    assert torch.equal(mha.in_proj_weight[8 + 6:8 + 8], ph.W_K[3].T)
    assert torch.equal(mha.out_proj.weight[:, 4:6], ph.W_O[2].T)
    back = split(from_torch_mha(mha))
    for (n1, a), (n2, b) in zip(ph.named_parameters(), back.named_parameters()):
        assert n1 == n2 and torch.equal(a, b)
    assert back.dropout == 0.25 and not back.training


def test_copy_attention_between_all_kinds():
    torch.manual_seed(1)
    src = FusedAttention(8, 2).double()
    E.random_biases(src, torch.Generator().manual_seed(1))
    for dst in (PerHeadAttention(8, 2), FusedAttention(8, 2), nn.MultiheadAttention(8, 2)):
        copy_attention(src, dst)
        got, want = fused_parameters(dst), fused_parameters(src)
        assert got.keys() == want.keys()
        assert all(torch.equal(got[n], want[n].float()) for n in want)


# --- 4. kernels and whole models ----------------------------------------------

def test_sdpa_path_matches_explicit_path_on_generated_cases():
    before = E.T.FAST_PATH
    assert_all_pass(E.check_sdpa_paths(examples=100))
    assert E.T.FAST_PATH == before


def test_whole_copy_model_converts_with_same_logits_and_decodes():
    rows = E.check_copy_model(steps=40, batch_size=32, sentences=200)
    assert_all_pass(rows)
    assert any("greedy decodes identical" in r.check for r in rows)


def test_compare_model_forms_leaves_the_model_alone():
    torch.manual_seed(0)
    m = make_model(src_vocab=11, tgt_vocab=11, N=1, d_model=8, d_ff=16, h=2, dropout=0.0, max_len=16,
                   attention="fused").train()
    src = torch.randint(3, 11, (4, 6))
    res = E.compare_model_forms(m, src, src[:, :5], max_len=8)
    assert res["tokens differing"] == 0 and res[torch.float64][0] <= 1e-12
    assert m.training and next(m.parameters()).dtype == torch.float32


def test_checkpoint_check_uses_load_checkpoint(monkeypatch, tmp_path):
    torch.manual_seed(0)
    model = make_model(src_vocab=23, tgt_vocab=29, N=1, d_model=16, d_ff=32, h=4, dropout=0.0, max_len=40,
                       attention="per_head").eval()
    seen = []

    def load_checkpoint(path, map_location="cpu"):
        seen.append(path)
        return model, None, {"src_lang": "en", "tgt_lang": "de"}

    fake = types.ModuleType("annotated.checkpoint")
    fake.load_checkpoint = load_checkpoint
    monkeypatch.setitem(sys.modules, "annotated.checkpoint", fake)
    path = str(tmp_path / "model.pt")
    rows = E.check_checkpoint(path, sentences=16)
    assert seen == [path]
    assert_all_pass(rows)
    assert all(path in r.check for r in rows)


def test_checkpoint_that_does_not_load_fails_its_row(monkeypatch, tmp_path):
    def load_checkpoint(path, map_location="cpu"):
        raise ValueError(f"checkpoint {path} is corrupt")

    fake = types.ModuleType("annotated.checkpoint")
    fake.load_checkpoint = load_checkpoint
    monkeypatch.setitem(sys.modules, "annotated.checkpoint", fake)
    rows = E.check_checkpoint(str(tmp_path / "bad.pt"))
    assert len(rows) == 1 and not rows[0].passed and "bad.pt is corrupt" in rows[0].notes[0]
    with pytest.raises(SystemExit) as err:
        E.main(["--checkpoint", str(tmp_path / "missing.pt")])
    assert err.value.code == 2


# --- 5. bad input ---------------------------------------------------------------

def test_bad_conversions_all_raise():
    assert_all_pass(E.check_bad_conversions())


@pytest.mark.parametrize("src,dst,differ", [
    (lambda: PerHeadAttention(8, 2), lambda: FusedAttention(8, 4), "h, d_k, d_v"),
    (lambda: FusedAttention(8, 2, 3, 4), lambda: PerHeadAttention(8, 2, 4, 4), "d_k"),
    (lambda: FusedAttention(8, 2, 4, 4), lambda: FusedAttention(6, 2, 4, 4), "d_model"),
    (lambda: PerHeadAttention(8, 2, bias=False), lambda: nn.MultiheadAttention(8, 2), "bias"),
])
def test_incompatible_copy_names_both_shapes_and_writes_nothing(src, dst, differ):
    s, d = src(), dst()
    before = {n: p.clone() for n, p in d.named_parameters()}
    s_str, d_str = E._shape_str(E.attention_shape(s)), E._shape_str(E.attention_shape(d))
    with pytest.raises(ValueError) as err:
        copy_attention(s, d)
    msg = str(err.value)
    assert s_str in msg and d_str in msg and f"differ in {differ})" in msg
    assert all(torch.equal(p, before[n]) for n, p in d.named_parameters())


def test_torch_mha_shapes_it_cannot_hold():
    with pytest.raises(ValueError, match=r"needs d_k = d_v = d_model / h, got FusedAttention with shape "
                                         r"\{d_model=8, h=2, d_k=3, d_v=3, bias=True\}"):
        to_torch_mha(FusedAttention(8, 2, 3, 3))
    with pytest.raises(ValueError, match=r"kdim=4, vdim=4 != embed_dim=8"):
        from_torch_mha(nn.MultiheadAttention(8, 2, kdim=4, vdim=4))
    with pytest.raises(ValueError, match="add_bias_kv"):
        from_torch_mha(nn.MultiheadAttention(8, 2, add_bias_kv=True))
    with pytest.raises(TypeError, match="got Linear"):
        copy_attention(nn.Linear(2, 2), FusedAttention(8, 2))


# --- the report -------------------------------------------------------------------

def _fake_results(passed):
    row = E.CheckResult.of("some check", 3, 0.0 if passed else 1.0, 1e-12)
    return [row], [("d_model=4, h=2, d_k=d_v=2", "an identity", True)]


@pytest.mark.parametrize("passed,code", [(True, 0), (False, 1)])
def test_main_prints_the_table_and_exits_by_result(passed, code, monkeypatch, capsys):
    monkeypatch.setattr(E, "run_checks", lambda *a, **k: _fake_results(passed))
    assert E.main([]) == code
    out = capsys.readouterr().out
    header = out.split("an identity: holds exactly")[1].strip().splitlines()[0]
    assert [c.strip() for c in header.split("|")] == ["check", "cases", "max diff", "tolerance", "result"]
    assert "an identity: holds exactly" in out
    assert ("FAIL" in out) != passed
