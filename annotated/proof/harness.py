"""How the checks of `annotated/proof/equivalence.py` run (it says what each establishes): Hypothesis strategies
and their runner, the comparison of two attentions on one case (outputs, probabilities, gradients), the cases
against `torch.nn.MultiheadAttention` (with a dispatch mode that records whether its native fast-path kernel ran),
and the SDPA-versus-explicit comparison.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import sys
from collections import Counter
from dataclasses import dataclass, field

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from tqdm import tqdm

from annotated.plumbing.interrupts import ctrl_c_requested
from annotated.proof.torch_mha import from_torch_mha, fused_parameters, to_torch_mha, torch_mha_masks
from annotated.recording import attend_with_probabilities
from annotated.transformer import FusedAttention, PerHeadAttention, fast_path, fuse, split

# Tolerances of the numerical checks, and why, in annotated/proof/equivalence.py.
TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


# --- a check's result ----------------------------------------------------------------------------


@dataclass
class CheckResult:
    check: str
    cases: int
    max_diff: float
    tol: float
    passed: bool
    notes: list[str] = field(default_factory=list)
    coverage: dict[str, int] = field(default_factory=dict)  # for generated cases: how often each feature came up
    part: str = ""  # which part of the report (annotated/proof/equivalence.py) the row belongs to

    @staticmethod
    def of(check: str, cases: int, max_diff: float, tol: float, notes=()) -> CheckResult:
        """A result that passes iff there were cases and every difference was within tolerance."""
        ok = cases > 0 and max_diff <= tol  # NaN fails: NaN <= tol is False
        return CheckResult(check, cases, max_diff, tol, ok, list(notes))

    @staticmethod
    def holds(check: str, cases: int, ok: bool, notes=()) -> CheckResult:
        """An exact check's result: difference 0 if `ok` held in all `cases`, else infinite."""
        return CheckResult.of(check, cases, 0.0 if ok else math.inf, 0.0, notes)


def max_scaled(a: Tensor, b: Tensor) -> float:
    """Largest |a - b| / max(1, largest |a|): absolute for values up to 1, relative above (see the tolerances).

    >>> max_scaled(torch.tensor([0.5, 0.25]), torch.tensor([0.5, 0.5])), max_scaled(torch.tensor([20.0]), torch.tensor([21.0]))
    (0.25, 0.05)
    """
    d = max_abs(a, b)
    return d / max(1.0, a.detach().abs().max().item()) if a.numel() and not math.isnan(d) else d


def max_abs(a: Tensor, b: Tensor) -> float:
    """Largest |a - b| (0 for empty tensors); NaN anywhere gives NaN, so it fails every tolerance."""
    if a.shape != b.shape:
        raise ValueError(f"cannot compare tensors of shapes {tuple(a.shape)} and {tuple(b.shape)}")
    if a.numel() == 0:
        return 0.0
    d = (a.detach().double() - b.detach().double()).abs()
    return float("nan") if torch.isnan(d).any() else d.max().item()


# --- generated cases: per-head vs fused ------------------------------------------------------


@dataclass(frozen=True)
class Case:
    batch: int
    T_q: int
    T_k: int
    d_model: int
    h: int
    d_k: int
    d_v: int
    cross: bool
    padding: bool
    causal: bool
    bias: bool
    dtype: torch.dtype
    start: str  # "per_head" or "fused": the form built first
    seed: int


@st.composite
def attention_cases(draw, dtypes=(torch.float64, torch.float32)) -> Case:
    d_model = draw(st.integers(1, 8))
    h = draw(st.one_of(st.just(1), st.just(d_model), st.integers(1, d_model)))
    cross = draw(st.booleans())
    T_q = draw(st.integers(1, 5))
    T_k = draw(st.integers(1, 5)) if cross else T_q
    return Case(
        batch=draw(st.integers(1, 3)),
        T_q=T_q,
        T_k=T_k,
        d_model=d_model,
        h=h,
        d_k=draw(st.integers(1, 5)),
        d_v=draw(st.integers(1, 5)),
        cross=cross,
        padding=draw(st.booleans()),
        causal=draw(st.booleans()),
        bias=draw(st.booleans()),
        dtype=draw(st.sampled_from(dtypes)),
        start=draw(st.sampled_from(["per_head", "fused"])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def random_biases(att: nn.Module, gen: torch.Generator) -> None:
    """Fresh attentions have zero biases; draw them N(0, 1) so that the checks see them."""
    with torch.no_grad():
        for name, p in att.named_parameters():
            if name.split(".")[0].startswith("b_"):
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))


def case_pair(case: Case) -> tuple[PerHeadAttention, FusedAttention]:
    """Both forms for a case: one built at random, the other converted from it."""
    torch.manual_seed(case.seed)
    form = PerHeadAttention if case.start == "per_head" else FusedAttention
    first = form(case.d_model, case.h, case.d_k, case.d_v, bias=case.bias).to(case.dtype)
    random_biases(first, torch.Generator().manual_seed(case.seed))
    return (first, fuse(first)) if isinstance(first, PerHeadAttention) else (split(first), first)


def case_inputs(case: Case) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    """x_q (B, T_q, d_model), x_kv (the same tensor for self-attention), mask or None, G (B, T_q, d_model)."""
    gen = torch.Generator().manual_seed(case.seed + 1)
    B, dt = case.batch, case.dtype
    x_q = torch.randn(B, case.T_q, case.d_model, generator=gen, dtype=torch.float64).to(dt)
    x_kv = torch.randn(B, case.T_k, case.d_model, generator=gen, dtype=torch.float64).to(dt) if case.cross else x_q
    mask = None
    if case.padding:
        mask = torch.rand(B, 1, case.T_k, generator=gen) > 0.3  # (B, 1, T_k) may block whole sentences
    if case.causal:
        causal = torch.ones(1, case.T_q, case.T_k, dtype=torch.bool).tril()  # (1, T_q, T_k)
        mask = causal if mask is None else mask & causal  # (B, T_q, T_k)
    G = torch.randn(B, case.T_q, case.d_model, generator=gen, dtype=torch.float64).to(dt)
    return x_q, x_kv, mask, G


def case_features(case: Case) -> list[str]:
    """The corner cases a generated case exercises (the report counts them, the tests require each)."""
    _, _, mask, _ = case_inputs(case)
    f = ["h = 1"] if case.h == 1 else ["h = d_model"] if case.h == case.d_model else []
    f += ["h*d_k != d_model"] if case.h * case.d_k != case.d_model else []
    f += ["d_k != d_v"] if case.d_k != case.d_v else []
    f += ["T_q = 1"] if case.T_q == 1 else []
    f += ["T_k = 1"] if case.T_k == 1 else []
    f += ["cross-attention" if case.cross else "self-attention"]
    f += ["padding mask"] if case.padding else []
    f += ["causal mask"] if case.causal else []
    f += ["padding + causal"] if case.padding and case.causal else []
    if mask is not None and not mask.expand(case.batch, case.T_q, case.T_k).any(-1).all():
        f.append("a query with no visible key")
    f += ["bias" if case.bias else "no bias", f"{case.start} built first"]
    return f


def run_with_grads(f, x_q: Tensor, x_kv: Tensor, G: Tensor, cross: bool):
    """(out, weights) = f(q, kv) on leaf copies of the inputs, then backward of sum(out * G).
    Returns (out, weights, input grads)."""
    q = x_q.clone().requires_grad_()
    kv = x_kv.clone().requires_grad_() if cross else q  # self-attention: one tensor in both roles
    out, p = f(q, kv)
    (out * G).sum().backward()
    return out, p, [q.grad] + ([kv.grad] if cross else [])


def with_probabilities(att, mask):
    """f(q, kv) = (out, probs) of `att` under `mask`, for `run_with_grads`."""
    return lambda q, kv: attend_with_probabilities(att, q, kv, mask)


def compare_forms(case: Case) -> dict[str, float]:
    """Max abs differences between the two forms on one case: output, probs, grads (inputs, parameters)."""
    ph, fu = case_pair(case)
    x_q, x_kv, mask, G = case_inputs(case)
    out_a, p_a, gin_a = run_with_grads(with_probabilities(ph, mask), x_q, x_kv, G, case.cross)
    out_b, p_b, gin_b = run_with_grads(with_probabilities(fu, mask), x_q, x_kv, G, case.cross)
    gpar_a, gpar_b = fused_parameters(ph, grads=True), fused_parameters(fu, grads=True)  # the same names
    return {
        "output": max_scaled(out_a, out_b),
        "probabilities": max_scaled(p_a, p_b),
        "grad inputs": max(max_scaled(a, b) for a, b in zip(gin_a, gin_b)),
        "grad parameters": max(max_scaled(gpar_a[n], gpar_b[n]) for n in gpar_a),
    }


def run_property(name: str, strategy, compare, examples: int, progress: bool) -> list[CheckResult]:
    """Run `compare` on `examples` Hypothesis cases; one result row per (quantity, dtype), against TOL[dtype]."""
    worst: dict[tuple[str, torch.dtype], float] = {}
    counts: Counter[torch.dtype] = Counter()
    coverage: Counter[str] = Counter()
    bar = tqdm(total=examples, desc=name, leave=False, disable=not progress, file=sys.stderr)

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        print_blob=False,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def prop(case):
        diffs = compare(case)
        bar.update(1)
        counts[case.dtype] += 1
        coverage.update(case_features(case))
        for quantity, d in diffs.items():
            worst[quantity, case.dtype] = nanmax([worst.get((quantity, case.dtype), 0.0), d])
        bad = {q: d for q, d in diffs.items() if not d <= TOL[case.dtype]}
        assert not bad, f"differences above tolerance {TOL[case.dtype]:g}: {bad}"

    failure = None
    try:
        prop()
    except Exception as e:  # Hypothesis re-raises the (shrunk) failing example's error
        if ctrl_c_requested():  # not a failure: a Ctrl-C that torch turned into another error
            raise KeyboardInterrupt from e
        failure = " ".join([f"{type(e).__name__}: {e}"] + list(getattr(e, "__notes__", [])))
    finally:
        bar.close()
    rows = []
    order = ["output", "probabilities", "grad inputs", "grad parameters"]
    for (quantity, dtype), d in sorted(worst.items(), key=lambda kv: (TOL[kv[0][1]], order.index(kv[0][0]))):
        rows.append(CheckResult.of(f"{name}: {quantity}, {dtype_name(dtype)}", counts[dtype], d, TOL[dtype]))
    if failure is not None:
        rows.append(CheckResult.holds(f"{name}: Hypothesis run", sum(counts.values()), False, [failure]))
    if rows:
        rows[0].coverage = dict(coverage)
        per_dtype = ", ".join(f"{n} {dtype_name(dt)}" for dt, n in sorted(counts.items(), key=lambda kv: TOL[kv[0]]))
        rows[0].notes.append(
            f"{name}: {sum(counts.values())} generated cases ({per_dtype}); corner cases among "
            f"them: " + ", ".join(f"{k} ({v})" for k, v in sorted(coverage.items()))
        )
    return rows


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# --- nn.MultiheadAttention: cases, and whether its fast path ran ---------------------------------


class OpsSeen(TorchDispatchMode):
    """Records the names of the aten operators that run inside the `with` block."""

    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, _types, args=(), kwargs=None):
        self.ops.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def mha_fastpath(enabled: bool):
    """Switch nn.MultiheadAttention's fast path on or off inside the block, then restore it."""
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(enabled)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(before)


NATIVE_MHA = "aten._native_multi_head_attention"
MHA_MODES = ("train, dropout 0", "eval, fast path off", "eval, fast path on")


@dataclass(frozen=True)
class MhaCase:
    d_model: int
    h: int
    bias: bool
    batch_first: bool
    mode: str  # one of MHA_MODES
    cross: bool
    masks: str  # "none", "padding", "causal", "both, merged", "both, separate"
    form: str  # our form converted to nn.MultiheadAttention: "fused" or "per_head"
    need_weights: bool

    @property
    def fast_path_expected(self) -> bool:
        """Every documented condition of the fast path holds (see the prose above)."""
        return (
            self.mode == "eval, fast path on" and self.batch_first and not self.cross and self.h % 2 == 0 and self.bias
        )


def mha_cases() -> list[MhaCase]:
    """Every combination, for d_model=8 with h = 2 and 4 (even: fast path possible) and d_model=6 with h = 3;
    the form converted to nn.MultiheadAttention alternates between fused and per-head."""
    masks = ("none", "padding", "causal", "both, merged", "both, separate")
    bools = (True, False)
    combinations = itertools.product(((8, 2), (8, 4), (6, 3)), bools, bools, MHA_MODES, bools[::-1], masks, bools)
    return [
        MhaCase(d_model, h, bias, batch_first, mode, cross, mask, ("fused", "per_head")[k % 2], need_weights)
        for k, ((d_model, h), bias, batch_first, mode, cross, mask, need_weights) in enumerate(combinations)
    ]


def mha_inputs(case: MhaCase, seed: int):
    gen = torch.Generator().manual_seed(seed)
    B, T_q = 3, 5
    T_k = 4 if case.cross else T_q
    x_q = torch.randn(B, T_q, case.d_model, generator=gen, dtype=torch.float64)
    x_kv = torch.randn(B, T_k, case.d_model, generator=gen, dtype=torch.float64) if case.cross else x_q
    pad = torch.rand(B, 1, T_k, generator=gen) > 0.4  # (B, 1, T_k)
    pad[:, :, 0] = True  # every query keeps key 0 visible: nn.MultiheadAttention gives NaN for none
    causal = torch.ones(1, T_q, T_k, dtype=torch.bool).tril()  # (1, T_q, T_k), key 0 always allowed
    G = torch.randn(B, T_q, case.d_model, generator=gen, dtype=torch.float64)
    return x_q, x_kv, pad, causal, G


def mha_call(mha: nn.MultiheadAttention, x_q: Tensor, x_kv: Tensor, attn_mask, kpm, need_weights: bool):
    """Call with batch-first tensors whatever mha.batch_first is; the same tensor object for q, k, v if x_q is x_kv."""
    t = (lambda x: x) if mha.batch_first else (lambda x: x.transpose(0, 1))  # (B, T, d_model) <-> (T, B, d_model)
    q = t(x_q)
    kv = q if x_kv is x_q else t(x_kv)
    out, w = mha(
        q, kv, kv, key_padding_mask=kpm, need_weights=need_weights, attn_mask=attn_mask, average_attn_weights=False
    )
    return t(out), w  # (B, T_q, d_model), (B, h, T_q, T_k)


def compare_with_torch_mha(case: MhaCase, seed: int = 0) -> dict:
    """Convert our attention to nn.MultiheadAttention (and back) and compare on one case."""
    torch.manual_seed(seed)
    fu = FusedAttention(case.d_model, case.h, bias=case.bias).double()
    random_biases(fu, torch.Generator().manual_seed(seed))
    ours = fu if case.form == "fused" else split(fu)
    train = case.mode == "train, dropout 0"
    ours.train(train)
    mha = to_torch_mha(ours, batch_first=case.batch_first)
    back = from_torch_mha(mha)
    x_q, x_kv, pad, causal, G = mha_inputs(case, seed)
    B = x_q.size(0)
    ours_mask = {"none": None, "padding": pad, "causal": causal}.get(case.masks, pad & causal)
    if case.masks == "both, separate":  # padding -> key_padding_mask, causal -> attn_mask
        attn_mask, kpm = torch_mha_masks(causal, B, case.h)[0], torch_mha_masks(pad, B, case.h)[1]
    else:
        attn_mask, kpm = torch_mha_masks(ours_mask, B, case.h)

    before, after = fused_parameters(fu), fused_parameters(back)
    same = before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)
    res: dict[str, float] = {"roundtrip": same}
    if train:  # compare gradients too
        out_o, p_o, gin_o = run_with_grads(with_probabilities(ours, ours_mask), x_q, x_kv, G, case.cross)
        theirs = lambda q, kv: mha_call(mha, q, kv, attn_mask, kpm, case.need_weights)
        out_t, w_t, gin_t = run_with_grads(theirs, x_q, x_kv, G, case.cross)
        g_o, g_t = fused_parameters(ours, grads=True), fused_parameters(mha, grads=True)
        res["grad"] = max([max_abs(a, b) for a, b in zip(gin_o, gin_t)] + [max_abs(g_o[n], g_t[n]) for n in g_o])
        res["native kernel ran"] = False
    else:
        with torch.no_grad(), mha_fastpath(case.mode == "eval, fast path on"), OpsSeen() as seen:
            out_t, w_t = mha_call(mha, x_q, x_kv, attn_mask, kpm, case.need_weights)
        res["native kernel ran"] = NATIVE_MHA in seen.ops
        with torch.no_grad():
            out_o, p_o = attend_with_probabilities(ours, x_q, x_kv, ours_mask)
    res["output"] = max_abs(out_o, out_t)
    if case.need_weights:
        res["weights"] = max_abs(p_o, w_t)
    return res


def nanmax(values) -> float:
    values = list(values)
    if any(math.isnan(v) for v in values):
        return math.nan
    return max(values, default=0.0)


# --- the SDPA kernel vs the explicit softmax ------------------------------------------------------


def compare_paths(case: Case) -> dict[str, float]:
    """SDPA path vs explicit path, for both forms, on one case: outputs and input gradients."""
    worst = {"output": 0.0, "grad inputs": 0.0}
    for att in case_pair(case):
        x_q, x_kv, mask, G = case_inputs(case)
        forward = lambda q, kv, att=att, mask=mask: (att(q, kv, mask), None)  # out alone: no probabilities
        got = {}
        for flag in (True, False):
            with fast_path(flag):
                got[flag] = run_with_grads(forward, x_q, x_kv, G, case.cross)
        worst["output"] = nanmax([worst["output"], max_scaled(got[True][0], got[False][0])])
        worst["grad inputs"] = nanmax(
            [worst["grad inputs"]] + [max_scaled(a, b) for a, b in zip(got[True][2], got[False][2])]
        )
    return worst
