"""The proof suite of annotated/proof/equivalence.py, run inside `make test`.

Each test calls the same check function that `make equivalence` reports on
and asserts that every row passed; the tolerances are the module's (float64
1e-12, float32 1e-5, float32 logits 1e-5 relative to the largest logit; see
the prose there). Further tests show that the checks can fail (two layout
bugs are caught by the tracers, a swapped block by the symbolic check), and
that the fast path of nn.MultiheadAttention really ran. The conversions to
and from nn.MultiheadAttention are tested in tests/proof/test_torch_mha.py.
"""

import sys
import types

import pytest
import torch

import annotated.proof.equivalence as E
from annotated import transformer
from annotated.proof.harness import (
    TOL,
    Case,
    MhaCase,
    compare_forms,
    compare_with_torch_mha,
    max_scaled,
    mha_cases,
    mha_fastpath,
    random_biases,
)
from annotated.proof.torch_mha import fused_parameters
from annotated.transformer import FusedAttention, PerHeadAttention, fuse, make_model

CORNER_CASES = [
    "h = 1",
    "h = d_model",
    "h*d_k != d_model",
    "d_k != d_v",
    "T_q = 1",
    "T_k = 1",
    "self-attention",
    "cross-attention",
    "padding mask",
    "causal mask",
    "padding + causal",
    "a query with no visible key",
    "bias",
    "no bias",
    "per_head built first",
    "fused built first",
]


def assert_all_pass(rows):
    assert rows, "a check returned no rows"
    for r in rows:
        assert r.passed, f"{r.check}: {r.cases} cases, max diff {r.max_diff} > tolerance {r.tol}; {r.notes}"


# --- 1. symbolic, all sizes -------------------------------------------------------


def test_block_algebra_holds_for_every_size():
    row, identities = E.check_symbolic()
    assert_all_pass([row])
    assert len(identities) == 6 and all(holds for _, _, holds in identities)
    assert {reach for reach, _, _ in identities} == {
        "h = 1..8, any T, d_model, d_k, d_v",
        "every h (induction step, first block of width m)",
    }
    assert all(E.projection_identities(h, E.D_V) == (True, True) for h in (1, 5))
    # the comparison can fail: a claim with two blocks swapped, or a stacked W_O in the wrong order
    X, W1, W2 = (
        E.MatrixSymbol(n, *s)
        for n, s in (("X", (E.T_LEN, E.D_MODEL)), ("W1", (E.D_MODEL, E.D_K)), ("W2", (E.D_MODEL, E.D_K)))
    )
    assert not E.blocks_equal(X * E.BlockMatrix([[W1, W2]]), E.BlockMatrix([[X * W2, X * W1]]))
    H1, H2 = E.MatrixSymbol("H1", E.T_LEN, E.D_V), E.MatrixSymbol("H2", E.T_LEN, E.D_V)
    O1, O2 = E.MatrixSymbol("O1", E.D_V, E.D_MODEL), E.MatrixSymbol("O2", E.D_V, E.D_MODEL)
    assert not E.blocks_equal(E.BlockMatrix([[H1, H2]]) * E.BlockMatrix([[O2], [O1]]), H1 * O1 + H2 * O2)


# --- 2. exact on the real code: tracers ----------------------------------------------


def test_tracers_follow_the_real_code():
    rows = E.tracer_checks()
    assert_all_pass(rows)
    assert len(rows) == 4 and rows[1].cases == 2 * 8 * 5 * 5 * 3  # both forms, h, d_k, d_v, (B, T)
    assert list(E.TRACER_SIZES["h"]) == list(range(1, 9)) and list(E.TRACER_SIZES["d"]) == [1, 2, 3, 4, 5]


def _heads_swapping_1_and_2(original):
    """Bug 1: a _heads that swaps heads 1 and 2 (0-based) when h >= 3."""

    def heads(self, x, W, b, d):
        out = original(self, x, W, b, d)  # (B, h, T, d)
        if self.h >= 3:
            order = list(range(self.h))
            order[1], order[2] = 2, 1
            out = out[:, order]
        return out

    return heads


def _attend_without_transpose(self, x_q, K, V, mask):
    """Bug 2: FusedAttention._attend, but concatenating the heads without the transpose."""
    B, T_q, _ = x_q.shape
    if mask is not None:
        mask = mask.expand(B, T_q, K.size(-2)).unsqueeze(1)
    heads = transformer.attention(self.queries(x_q), K, V, mask)  # (B, h, T_q, d_v)
    concat = heads.reshape(B, T_q, self.h * self.d_v)  # the bug: no transpose(1, 2)
    return transformer.affine(concat, self.W_O, self.b_O)


SMALL = dict(h=range(1, 5), d=range(1, 4), BT=((2, 3),))  # enough sizes to show each bug


def test_tracers_catch_two_layout_bugs(monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(FusedAttention, "_heads", _heads_swapping_1_and_2(FusedAttention._heads))
        rows = {r.check.split(":")[0]: r for r in E.tracer_checks(sizes=SMALL)}
        assert not rows["FusedAttention._heads"].passed
        assert not rows["whole forward of both forms, identity weights"].passed
        assert "(3, " in rows["FusedAttention._heads"].notes[0]  # the first failing size has h = 3
        assert rows["fuse puts head i's entries in block i (W_O"].passed  # fuse/split do not use _heads
        assert not E.check_exact_whole(40)[0].passed
    with monkeypatch.context() as m:
        m.setattr(FusedAttention, "_attend", _attend_without_transpose)
        rows = {r.check.split(":")[0]: r for r in E.tracer_checks(sizes=SMALL)}
        assert rows["FusedAttention._heads"].passed
        assert not rows["whole forward of both forms, identity weights"].passed
        assert not E.check_exact_whole(40)[0].passed
    assert_all_pass(E.tracer_checks(sizes=SMALL))  # and the real code passes again


# --- 3. exact, the whole function ---------------------------------------------------


def test_whole_function_is_bit_identical_where_arithmetic_is_exact():
    rows = E.check_exact_whole(200)
    assert_all_pass(rows)
    assert rows[0].max_diff == 0.0 and rows[0].cases == 200
    cases = E.exact_cases(200)
    assert {c["h"] for c in cases} == {1, 2, 3, 4} and {c["cross"] for c in cases} == {True, False}
    assert any(c["T_q"] == 1 for c in cases) and {c["bias"] for c in cases} == {True, False}


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
    case = Case(
        batch=2,
        T_q=3,
        T_k=3,
        d_model=2,
        h=1,
        d_k=5,
        d_v=2,
        cross=False,
        padding=False,
        causal=False,
        bias=True,
        dtype=torch.float32,
        start="per_head",
        seed=11586,
    )
    diffs = compare_forms(case)
    assert all(d <= TOL[torch.float32] for d in diffs.values()), diffs
    assert max_scaled(torch.tensor([30.0]), torch.tensor([30.0006])) == pytest.approx(2e-5, rel=1e-2)
    assert max_scaled(torch.tensor([0.5]), torch.tensor([0.5 + 2e-5])) == pytest.approx(2e-5, rel=1e-2)


def test_fused_gradient_is_the_per_head_gradients_in_blocks():
    """The real FusedAttention's gradients equal the per-head module's, laid out in blocks."""
    torch.manual_seed(0)
    ph = PerHeadAttention(6, 3, d_k=2, d_v=4).double()
    random_biases(ph, torch.Generator().manual_seed(0))
    fu = fuse(ph)
    x = torch.randn(2, 4, 6, dtype=torch.float64)
    for att in (ph, fu):
        att(x, x).square().sum().backward()
    g = {n: p.grad for n, p in fu.named_parameters()}  # the fused module's own gradients
    assert set(g) == {"W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O"}
    for i in range(3):  # head i's blocks: columns i*d_k.. of W_Q, W_K; i*d_v.. of W_V; rows i*d_v.. of W_O
        for name, d in (("W_Q", 2), ("W_K", 2), ("W_V", 4)):
            assert torch.allclose(g[name][:, d * i : d * (i + 1)], getattr(ph, name)[i].grad, atol=1e-12, rtol=0)
        assert torch.allclose(g["W_O"][4 * i : 4 * (i + 1)], ph.W_O[i].grad, atol=1e-12, rtol=0)
        assert torch.allclose(g["b_V"][4 * i : 4 * (i + 1)], ph.b_V[i].grad, atol=1e-12, rtol=0)
    assert torch.allclose(g["b_O"], ph.b_O.grad, atol=1e-12, rtol=0)
    assert g["W_Q"].abs().max() > 1e-3  # the gradients are not trivially zero
    per_head_in_blocks = fused_parameters(ph, grads=True)  # the same layout, as the report compares it
    assert all(torch.allclose(per_head_in_blocks[n], g[n], atol=1e-12, rtol=0) for n in g)


# --- 3. nn.MultiheadAttention -------------------------------------------------


def test_torch_mha_agrees_in_every_mode():
    rows = E.check_torch_mha()
    assert_all_pass(rows)
    modes = {r.check for r in rows}
    assert any("train, dropout 0" in m for m in modes) and any("fast path on" in m for m in modes)
    assert {c.batch_first for c in mha_cases()} == {True, False}


def test_fast_path_really_runs_and_flag_is_restored():
    before = torch.backends.mha.get_fastpath_enabled()
    on = MhaCase(
        8,
        2,
        bias=True,
        batch_first=True,
        mode="eval, fast path on",
        cross=False,
        masks="both, separate",
        form="per_head",
        need_weights=True,
    )
    assert on.fast_path_expected
    res = compare_with_torch_mha(on)
    assert res["native kernel ran"] and res["output"] <= 1e-12 and res["weights"] <= 1e-12
    off = MhaCase(
        8,
        2,
        bias=True,
        batch_first=True,
        mode="eval, fast path off",
        cross=False,
        masks="both, separate",
        form="per_head",
        need_weights=True,
    )
    assert not compare_with_torch_mha(off)["native kernel ran"]
    # one violated condition (batch_first=False) is enough to take the slow path
    slow = MhaCase(
        8,
        2,
        bias=True,
        batch_first=False,
        mode="eval, fast path on",
        cross=False,
        masks="padding",
        form="fused",
        need_weights=False,
    )
    assert not slow.fast_path_expected and not compare_with_torch_mha(slow)["native kernel ran"]
    assert torch.backends.mha.get_fastpath_enabled() == before
    with pytest.raises(RuntimeError), mha_fastpath(not before):
        raise RuntimeError("the flag is restored even after an error")
    assert torch.backends.mha.get_fastpath_enabled() == before


# --- 4. kernels and whole models ----------------------------------------------


def test_sdpa_path_matches_explicit_path_on_generated_cases():
    before = transformer.FAST_PATH
    assert_all_pass(E.check_sdpa_paths(examples=100))
    assert before == transformer.FAST_PATH


def test_whole_copy_model_converts_with_same_logits_and_decodes():
    rows = E.check_copy_model(steps=40, batch_size=32, sentences=200)
    assert_all_pass(rows)
    assert any("greedy decodes identical" in r.check for r in rows)


def test_compare_model_forms_leaves_the_model_alone():
    torch.manual_seed(0)
    m = make_model(
        src_vocab=11, tgt_vocab=11, N=1, d_model=8, d_ff=16, h=2, dropout=0.0, max_len=16, attention="fused"
    ).train()
    src = torch.randint(3, 11, (4, 6))
    res = E.compare_model_forms(m, src, src[:, :5], max_len=8)
    assert res["tokens differing"] == 0 and res[torch.float64][0] <= 1e-12
    assert m.training and next(m.parameters()).dtype == torch.float32


def test_checkpoint_check_uses_load_checkpoint(monkeypatch, tmp_path):
    torch.manual_seed(0)
    model = make_model(
        src_vocab=23, tgt_vocab=29, N=1, d_model=16, d_ff=32, h=4, dropout=0.0, max_len=40, attention="per_head"
    ).eval()
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

    monkeypatch.setattr("annotated.checkpoint.load_checkpoint", load_checkpoint)
    rows = E.check_checkpoint(str(tmp_path / "bad.pt"))
    assert len(rows) == 1 and not rows[0].passed and "bad.pt is corrupt" in rows[0].notes[0]
    with pytest.raises(SystemExit) as err:
        E.main(["--checkpoint", str(tmp_path / "missing.pt")])
    assert err.value.code == 2


# --- the report -------------------------------------------------------------------


def _fake_results(passed):
    row = E.CheckResult.of("some check", 3, 0.0 if passed else 1.0, 1e-12)
    row.part = "numerical"
    return [row], [("h = 1..8, any T, d_model, d_k, d_v", "an identity", True)]


@pytest.mark.parametrize("passed,code", [(True, 0), (False, 1)])
def test_main_prints_the_table_and_exits_by_result(passed, code, monkeypatch, capsys):
    monkeypatch.setattr(E, "run_checks", lambda *a, **k: _fake_results(passed))
    assert E.main([]) == code
    out = capsys.readouterr().out
    header = out.split("an identity: holds")[1].strip().splitlines()[0]
    assert [c.strip() for c in header.split("|")] == ["check", "cases", "max diff", "tolerance", "result"]
    assert "Part 1. symbolic, all sizes" in out and "Part 4. numerical" in out
    assert ("FAIL" in out) != passed
