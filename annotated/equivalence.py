# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Per-head and fused attention are the same function: the proof, checked
#
# `annotated/transformer.py` writes multi-head attention twice.
# `PerHeadAttention` keeps the paper's `h` rectangular matrices per projection
# and loops over heads; `FusedAttention` lays them side by side and computes
# every head with one product and a `view`. This module proves that the two
# are one function: exactly (symbolically), numerically on hundreds of
# generated cases, against PyTorch's own `nn.MultiheadAttention`, and for
# whole models. `python -m annotated.equivalence` (or `make equivalence`)
# prints the report and exits non-zero if any check fails; the same check
# functions run in `tests/test_equivalence.py`, so `make test` runs them too.
#
# **Theorem.** Build the fused parameters from the per-head ones by blocks,
#
# $$W_Q = [\,W_Q^{(1)} \mid \dots \mid W_Q^{(h)}\,],\quad b_Q = [\,b_Q^{(1)} \mid \dots \mid b_Q^{(h)}\,],\quad
#   W_O = \begin{bmatrix} W_O^{(1)} \\ \vdots \\ W_O^{(h)} \end{bmatrix}$$
#
# (likewise `W_K`, `b_K`, `W_V`, `b_V`; `b_O` is shared). Then for every
# query input `X_q`, key/value input `X_kv` and mask, `FusedAttention` and
# `PerHeadAttention` return the same output and the same attention
# probabilities, and the gradient of any loss with respect to a fused matrix
# is the per-head gradients laid out in the same blocks.
#
# **Proof.**
# 1. *Block product.* Column `j` of `X W` only involves column `j` of `W`, so
#    `X [W^(1) | ... | W^(h)] + [b^(1) | ... | b^(h)] = [X W^(1) + b^(1) | ... | X W^(h) + b^(h)]`.
# 2. *Layout.* `X W + b` has shape `(B, T, h*d)`; in row-major order its
#    element `(n, t, j)` (sentence `n`) is number `(n*T + t)*h*d + j`.
#    `view(B, T, h, d)` reads the same numbers with index `(n, t, i, c)` at
#    `(n*T + t)*h*d + i*d + c`, i.e.
#    `[n, t, i, c] = (X W + b)[n, t, i*d + c] = (X W^(i) + b^(i))[n, t, c]`,
#    and `transpose(1, 2)` only renames axes. So the fused head `i` receives
#    exactly the per-head `Q^(i), K^(i), V^(i)`.
# 3. *Same attention per head.* Both forms then call the same `attention`
#    function on equal inputs with the same mask, so `head_i` and its
#    probabilities are equal.
# 4. *Output.* `transpose(1, 2).reshape(B, T, h*d_v)` is `Concat(head_1, ..., head_h)`
#    (step 2 backwards), and a column-block row times a row-block column is
#    the sum of block products: `Concat(heads) W_O + b_O = sum_i head_i W_O^(i) + b_O`.
#
# Hence the functions are equal. For gradients: the fused parameters are the
# per-head ones placed in blocks, a relabelling of coordinates, and the loss
# is the same function of them; so the derivative by an entry of `W_Q` is the
# derivative by the per-head entry it came from. QED.
#
# **Where each step is checked.**
#
# | step | check (function) | how | test in `tests/test_equivalence.py` |
# | --- | --- | --- | --- |
# | 1, 2, 4 | `symbolic_identities` | sympy, symbolic entries, the real `view`/`transpose` | `test_symbolic_identities_hold_exactly`, `test_the_checks_catch_a_wrong_head_layout` |
# | whole theorem, one size | `symbolic_identities` | sympy, softmax kept symbolic | the same |
# | whole theorem, with masks and gradients | `check_forms` | Hypothesis, float64 and float32 | `test_per_head_equals_fused_on_generated_cases` |
# | agreement with PyTorch | `check_torch_mha` | `nn.MultiheadAttention`, slow and fast paths | `test_torch_mha_agrees_in_every_mode`, `test_fast_path_really_runs_and_flag_is_restored` |
# | SDPA kernel = explicit softmax | `check_sdpa_paths` | Hypothesis | `test_sdpa_path_matches_explicit_path_on_generated_cases` |
# | whole models | `check_copy_model`, `check_checkpoint` | logits and greedy decodes | `test_whole_copy_model_converts_with_same_logits_and_decodes` |
# | bad conversions | `check_bad_conversions` | `ValueError` naming both shapes | `test_incompatible_copy_names_both_shapes_and_writes_nothing` |
#
# In floating point, steps 1 and 4 are still exact identities of real
# numbers, but the two forms add the same products in different orders (one
# matrix product over `h*d` columns, or `h` products and a sum), so results may
# differ by rounding. The tolerances below bound that, and are far below any
# real difference: float64 `1e-12`, float32 `1e-5`. Rounding grows with the
# size of a number (a float32 number of size `L` has an ulp of about
# `L * 1.2e-7`), and a generated case's gradients are not always of order 1:
# a 23,569-case run found one (`d_model` 2, `d_k` 5) whose key-projection
# gradient reached 7.5 and differed by `1.3e-5` between the forms, `1.8e-6` of
# its size. So the generated checks (sections 2 and 4) compare
# `max |a - b| / max(1, max |a|)`: absolute for values up to 1, relative to
# the largest value above that (`_max_scaled`), the same rule as the float32
# logits of section 4.

# %%
from __future__ import annotations

import argparse
import contextlib
import copy
import math
import os
import sys
import textwrap
from dataclasses import dataclass, field
from typing import Optional, Union

if __name__ == "__main__":  # as a command: a Ctrl-C while torch loads is one line, exit 130
    from annotated.cli import quiet_ctrl_c_while_starting
    quiet_ctrl_c_while_starting("python -m annotated.equivalence")

import hypothesis
import sympy
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from tqdm import tqdm

import annotated.transformer as T
from annotated.checks import check_token_ids
from annotated.cli import ctrl_c_requested
from annotated.transformer import (
    BOS, EOS, PAD, FusedAttention, PerHeadAttention, convert_model, fuse, greedy_decode, padding_mask,
    split, subsequent_mask, target_mask,  # subsequent_mask: used by the doctests
)

TOL = {torch.float64: 1e-12, torch.float32: 1e-5}

# %% [markdown]
# ## 0. A check's result
#
# Every check returns one or more `CheckResult` rows: what was checked, how
# many cases, the largest absolute difference seen, the tolerance, and
# whether it passed. A check that cannot be measured as a difference (an
# identity, an expected error) uses a difference of 0 and a tolerance of 0,
# printed as "exact".

# %%
@dataclass
class CheckResult:
    check: str
    cases: int
    max_diff: float
    tol: float
    passed: bool
    notes: list[str] = field(default_factory=list)
    coverage: dict[str, int] = field(default_factory=dict)  # for generated cases: how often each feature came up

    @staticmethod
    def of(check: str, cases: int, max_diff: float, tol: float, notes=()) -> "CheckResult":
        """A result that passes iff there were cases and every difference was within tolerance."""
        ok = cases > 0 and max_diff <= tol  # NaN fails: NaN <= tol is False
        return CheckResult(check, cases, max_diff, tol, ok, list(notes))


def _max_scaled(a: Tensor, b: Tensor) -> float:
    """Largest |a - b| / max(1, largest |a|): absolute for values up to 1, relative above (see the tolerances).

    >>> _max_scaled(torch.tensor([0.5, 0.25]), torch.tensor([0.5, 0.5])), _max_scaled(torch.tensor([20.0]), torch.tensor([21.0]))
    (0.25, 0.05)
    """
    d = _max_abs(a, b)
    return d / max(1.0, a.detach().abs().max().item()) if a.numel() and not math.isnan(d) else d


def _max_abs(a: Tensor, b: Tensor) -> float:
    """Largest |a - b| (0 for empty tensors); NaN anywhere gives NaN, so it fails every tolerance."""
    if a.shape != b.shape:
        raise ValueError(f"cannot compare tensors of shapes {tuple(a.shape)} and {tuple(b.shape)}")
    if a.numel() == 0:
        return 0.0
    d = (a.detach().double() - b.detach().double()).abs()
    return float("nan") if torch.isnan(d).any() else d.max().item()


# %% [markdown]
# ## 1. The exact proof, symbolically
#
# Sampled numbers can only make an identity likely; symbols make it certain.
# Each matrix below is a `sympy.Matrix` of independent symbols (`x0_1_2` is
# sentence 0, row 1, column 2 of `X`; `WQ1_0_1` an entry of `W_Q^(1)`; ...), so an identity that holds here holds for all real values.
# We check it for two sizes: the paper's shape `d_model = 4, h = 2,
# d_k = d_v = 2`, and `d_model = 3, h = 2, d_k = 2, d_v = 3`, where
# `h*d_k != d_model` and `d_k != d_v`; batch `B = 2`, length `T = 3`.
#
# **How the layout step is checked honestly.** sympy objects cannot live in a
# torch tensor, so we let torch move *labels*: a float64 tensor holding
# `0, 1, 2, ...` in row-major order goes through the real
# `FusedAttention._heads` (with `W = I`, `b = None`, so `X W = X` exactly)
# and therefore through its real `view(B, T, h, d).transpose(1, 2)`.
# `view`, `transpose` and `reshape` move numbers without looking at them, so
# where label `n` lands is where element `n` of any tensor lands; we then
# place the symbolic entries of `X W + b` by those labels and compare them
# with `X W^(i) + b^(i)`, symbol by symbol. The output side,
# `transpose(1, 2).reshape(B, T, h*d_v)`, is the same expression as in
# `FusedAttention._attend` (copied, since it sits inside that method).
#
# A difference of two sympy expressions that are equal polynomials expands to
# exactly `0`; for the end-to-end check, with `exp` inside, the two sides come
# out as structurally identical expressions, so their difference is `0`
# without any simplification heuristics.

# %%
SYMBOLIC_SIZES = (dict(d_model=4, h=2, d_k=2, d_v=2), dict(d_model=3, h=2, d_k=2, d_v=3))


def _sym(name: str, rows: int, cols: int) -> sympy.Matrix:
    """A rows x cols matrix of independent real symbols name_r_c."""
    return sympy.Matrix(rows, cols, lambda r, c: sympy.Symbol(f"{name}_{r}_{c}", real=True))


def _is_zero(M: sympy.Matrix) -> bool:
    return all(sympy.expand(e) == 0 for e in M)


def _head_labels(B: int, T_len: int, h: int, d: int) -> Tensor:
    """Where FusedAttention._heads sends each element: labels[b, i, t, c] = row-major index into (B, T, h*d)."""
    probe = FusedAttention(1, h, d_k=d, d_v=d, bias=False).double()
    labels = torch.arange(B * T_len * h * d, dtype=torch.float64).view(B, T_len, h * d)  # (B, T, h*d)
    moved = probe._heads(labels, torch.eye(h * d, dtype=torch.float64), None, d)  # (B, h, T, d)
    return moved.round().long()


def _concat_labels(B: int, T_len: int, h: int, d_v: int) -> Tensor:
    """labels[b, t, j] = row-major index into heads (B, h, T, d_v), moved as in FusedAttention._attend."""
    heads = torch.arange(B * h * T_len * d_v).view(B, h, T_len, d_v)  # (B, h, T, d_v)
    return heads.transpose(1, 2).reshape(B, T_len, h * d_v)  # (B, T, h*d_v)


def _symbolic_attention(Q: sympy.Matrix, K: sympy.Matrix, V: sympy.Matrix) -> sympy.Matrix:
    """softmax(Q K^T / sqrt(d_k)) V with the softmax written out in exp."""
    S = Q * K.T / sympy.sqrt(Q.cols)
    P = sympy.Matrix(S.rows, S.cols, lambda r, c: sympy.exp(S[r, c]) / sum(sympy.exp(S[r, j]) for j in range(S.cols)))
    return P * V


def _size_label(d_model: int, h: int, d_k: int, d_v: int) -> str:
    dk = f"d_k=d_v={d_k}" if d_k == d_v else f"d_k={d_k}, d_v={d_v}"
    return f"d_model={d_model}, h={h}, {dk}"


def symbolic_identities(B: int = 2, T_len: int = 3) -> list[tuple[str, str, bool]]:
    """The proof's steps as sympy identities. Returns (size, identity, holds) triples."""
    out = []
    for size in SYMBOLIC_SIZES:
        d_model, h, d_k, d_v = size["d_model"], size["h"], size["d_k"], size["d_v"]
        label = _size_label(d_model, h, d_k, d_v)
        X = [_sym(f"x{b}", T_len, d_model) for b in range(B)]  # B x (T, d_model)
        ones = sympy.ones(T_len, 1)

        # Step 1: X [W(1) | ... | W(h)] + [b(1) | ... | b(h)] = [X W(1) + b(1) | ...], for d = d_k and d = d_v.
        # Step 2: view(B, T, h, d).transpose(1, 2) of that puts block i at head i.
        step1 = step2 = True
        for proj, d in (("Q", d_k), ("V", d_v)):
            W = [_sym(f"W{proj}{i}", d_model, d) for i in range(h)]  # h x (d_model, d)
            bias = [_sym(f"b{proj}{i}", 1, d) for i in range(h)]  # h x (1, d)
            W_f, b_f = sympy.Matrix.hstack(*W), sympy.Matrix.hstack(*bias)  # (d_model, h*d), (1, h*d)
            Y = [X[b] * W_f + ones * b_f for b in range(B)]  # B x (T, h*d)
            per_head = [[X[b] * W[i] + ones * bias[i] for i in range(h)] for b in range(B)]
            step1 &= all(_is_zero(Y[b] - sympy.Matrix.hstack(*per_head[b])) for b in range(B))
            flat = [e for b in range(B) for e in Y[b]]  # row-major, as torch orders (B, T, h*d)
            L = _head_labels(B, T_len, h, d)  # (B, h, T, d)
            step2 &= all(sympy.expand(flat[L[b, i, t, c]] - per_head[b][i][t, c]) == 0
                         for b in range(B) for i in range(h) for t in range(T_len) for c in range(d))
        out.append((label, "X [W(1) | ... | W(h)] + [b(1) | ... | b(h)] = [X W(1) + b(1) | ... | X W(h) + b(h)]",
                    step1))
        out.append((label, "view(B, T, h, d).transpose(1, 2) of X W + b: head i = X W(i) + b(i), element by "
                           "element", step2))

        # Step 4: transpose(1, 2).reshape(B, T, h*d_v) = Concat(heads), and Concat(heads) W_O = sum_i head_i W_O(i).
        H = [[_sym(f"head{b}{i}", T_len, d_v) for i in range(h)] for b in range(B)]  # B x h x (T, d_v)
        W_O = [_sym(f"WO{i}", d_v, d_model) for i in range(h)]  # h x (d_v, d_model)
        b_O = _sym("bO", 1, d_model)
        flat = [e for b in range(B) for i in range(h) for e in H[b][i]]  # row-major (B, h, T, d_v)
        C = _concat_labels(B, T_len, h, d_v)  # (B, T, h*d_v)
        concat = [sympy.Matrix(T_len, h * d_v, lambda t, j: flat[C[b, t, j]]) for b in range(B)]
        out.append((label, "transpose(1, 2).reshape(B, T, h*d_v) of the heads = Concat(head_1, ..., head_h)",
                    all(_is_zero(concat[b] - sympy.Matrix.hstack(*H[b])) for b in range(B))))
        lhs = [concat[b] * sympy.Matrix.vstack(*W_O) + ones * b_O for b in range(B)]
        rhs = [sum((H[b][i] * W_O[i] for i in range(h)), sympy.zeros(T_len, d_model)) + ones * b_O
               for b in range(B)]
        out.append((label, "Concat(head_1, ..., head_h) W_O + b_O = sum_i head_i W_O(i) + b_O",
                    all(_is_zero(lhs[b] - rhs[b]) for b in range(B))))
    out.append(_symbolic_whole_attention())
    return out


def _symbolic_whole_attention(d_model: int = 4, h: int = 2, d_k: int = 2, d_v: int = 2,
                              T_q: int = 2, T_k: int = 3) -> tuple[str, str, bool]:
    """The theorem itself for one size: fused MultiHead(X_q, X_kv) = per-head MultiHead(X_q, X_kv)."""
    X_q, X_kv = _sym("xq", T_q, d_model), _sym("xkv", T_k, d_model)
    W = {p: [_sym(f"W{p}{i}", d_model, d_v if p == "V" else d_k) for i in range(h)] for p in "QKV"}
    bias = {p: [_sym(f"b{p}{i}", 1, d_v if p == "V" else d_k) for i in range(h)] for p in "QKV"}
    W_O, b_O = [_sym(f"WO{i}", d_v, d_model) for i in range(h)], _sym("bO", 1, d_model)

    def proj(X, p, i):  # per head: X W(i) + b(i)
        return X * W[p][i] + sympy.ones(X.rows, 1) * bias[p][i]

    per_head = sum((_symbolic_attention(proj(X_q, "Q", i), proj(X_kv, "K", i), proj(X_kv, "V", i)) * W_O[i]
                    for i in range(h)), sympy.zeros(T_q, d_model)) + sympy.ones(T_q, 1) * b_O

    def heads(X, p, d):  # fused: one product, then the real view/transpose moves (labels)
        Y = X * sympy.Matrix.hstack(*W[p]) + sympy.ones(X.rows, 1) * sympy.Matrix.hstack(*bias[p])
        L, flat = _head_labels(1, X.rows, h, d), list(Y)
        return [sympy.Matrix(X.rows, d, lambda t, c: flat[L[0, i, t, c]]) for i in range(h)]

    Q, K, V = heads(X_q, "Q", d_k), heads(X_kv, "K", d_k), heads(X_kv, "V", d_v)
    H = [_symbolic_attention(Q[i], K[i], V[i]) for i in range(h)]
    flat = [e for i in range(h) for e in H[i]]
    C = _concat_labels(1, T_q, h, d_v)
    concat = sympy.Matrix(T_q, h * d_v, lambda t, j: flat[C[0, t, j]])
    fused = concat * sympy.Matrix.vstack(*W_O) + sympy.ones(T_q, 1) * b_O
    label = _size_label(d_model, h, d_k, d_v) + f", T_q={T_q}, T_k={T_k}"
    return (label, "fused MultiHead(X_q, X_kv) = per-head MultiHead(X_q, X_kv), softmax kept symbolic",
            _is_zero(fused - per_head))


def check_symbolic() -> tuple[CheckResult, list[tuple[str, str, bool]]]:
    identities = symbolic_identities()
    ok = all(holds for _, _, holds in identities)
    return CheckResult("exact identities (sympy): proof steps 1, 2, 4 and the whole", len(identities),
                       0.0 if ok else math.inf, 0.0, ok), identities


# %% [markdown]
# ## 2. Numerically, on generated cases
#
# Hypothesis draws the cases: batch size, query and key lengths (1 included),
# `d_model`, `h` (with `h = 1` and `h = d_model` drawn on purpose), `d_k` and
# `d_v` chosen freely (the forms do not need `h * d_k = d_model`), self- or
# cross-attention, a random padding mask (which can block *every* key of a
# sentence: both forms must then return zeros), a causal mask, bias on or
# off, float64 or float32, and which form is built first (the other is made
# by `fuse` or `split`). Biases are drawn non-zero so that they matter.
#
# For each case we compare the outputs, the probabilities, and the gradients
# of `sum(out * G)` (a random `G`) with respect to the inputs and to every
# parameter, the per-head gradients laid out in blocks by `fused_parameters`.
# Sizes stay small (at most 8 wide, 5 long) so hundreds of cases run in
# seconds; the proof does not depend on size, and section 1 covers the index
# arithmetic symbolically.
#
# `derandomize=True` fixes Hypothesis' seed: CI runs the same cases every
# time, and a failure is reproducible with the falsifying case it prints.

# %%
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
    return Case(batch=draw(st.integers(1, 3)), T_q=T_q, T_k=T_k, d_model=d_model, h=h,
                d_k=draw(st.integers(1, 5)), d_v=draw(st.integers(1, 5)), cross=cross,
                padding=draw(st.booleans()), causal=draw(st.booleans()), bias=draw(st.booleans()),
                dtype=draw(st.sampled_from(dtypes)), start=draw(st.sampled_from(["per_head", "fused"])),
                seed=draw(st.integers(0, 2**31 - 1)))


def random_biases(att: nn.Module, gen: torch.Generator) -> None:
    """Fresh attentions have zero biases; draw them N(0, 1) so that the checks see them."""
    with torch.no_grad():
        for name, p in att.named_parameters():
            if name.split(".")[0].startswith("b_"):
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))


def case_pair(case: Case) -> tuple[PerHeadAttention, FusedAttention]:
    """Both forms for a case: one built at random, the other converted from it."""
    torch.manual_seed(case.seed)
    cls = PerHeadAttention if case.start == "per_head" else FusedAttention
    first = cls(case.d_model, case.h, case.d_k, case.d_v, bias=case.bias).to(case.dtype)
    random_biases(first, torch.Generator().manual_seed(case.seed))
    return (first, fuse(first)) if case.start == "per_head" else (split(first), first)


def case_inputs(case: Case) -> tuple[Tensor, Tensor, Optional[Tensor], Tensor]:
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


def _run_with_grads(att, x_q: Tensor, x_kv: Tensor, mask, G: Tensor, cross: bool):
    """Forward with probabilities, backward of sum(out * G). Returns (out, probs, input grads)."""
    q = x_q.clone().requires_grad_()
    kv = x_kv.clone().requires_grad_() if cross else q  # self-attention: one tensor in both roles
    out, p = att(q, kv, mask, return_attention=True)
    (out * G).sum().backward()
    return out, p, [q.grad] + ([kv.grad] if cross else [])


def compare_forms(case: Case) -> dict[str, float]:
    """Max abs differences between the two forms on one case: output, probs, grads (inputs, parameters)."""
    ph, fu = case_pair(case)
    x_q, x_kv, mask, G = case_inputs(case)
    out_a, p_a, gin_a = _run_with_grads(ph, x_q, x_kv, mask, G, case.cross)
    out_b, p_b, gin_b = _run_with_grads(fu, x_q, x_kv, mask, G, case.cross)
    gpar_a, gpar_b = fused_parameters(ph, grads=True), fused_parameters(fu, grads=True)
    if gpar_a.keys() != gpar_b.keys():
        raise AssertionError(f"parameter names differ: {sorted(gpar_a)} vs {sorted(gpar_b)}")
    return {
        "output": _max_scaled(out_a, out_b),
        "probabilities": _max_scaled(p_a, p_b),
        "grad inputs": max(_max_scaled(a, b) for a, b in zip(gin_a, gin_b)),
        "grad parameters": max(_max_scaled(gpar_a[n], gpar_b[n]) for n in gpar_a),
    }


def _run_property(name: str, strategy, compare, examples: int, tol_of, progress: bool) -> list[CheckResult]:
    """Run `compare` on `examples` Hypothesis cases; one result row per (quantity, dtype)."""
    worst: dict[tuple[str, torch.dtype], float] = {}
    counts: dict[torch.dtype, int] = {}
    coverage: dict[str, int] = {}
    bar = tqdm(total=examples, desc=name, leave=False, disable=not progress, file=sys.stderr)

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None, print_blob=False,
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def prop(case):
        diffs = compare(case)
        bar.update(1)
        counts[case.dtype] = counts.get(case.dtype, 0) + 1
        for feature in case_features(case):
            coverage[feature] = coverage.get(feature, 0) + 1
        for quantity, d in diffs.items():
            key = (quantity, case.dtype)
            worst[key] = max(worst.get(key, 0.0), d, key=lambda v: math.inf if math.isnan(v) else v)
        bad = {q: d for q, d in diffs.items() if not d <= tol_of(case)}
        assert not bad, f"differences above tolerance {tol_of(case):g}: {bad}"

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
        rows.append(CheckResult.of(f"{name}: {quantity}, {_dtype_name(dtype)}", counts[dtype], d, TOL[dtype]))
    if failure is not None:
        rows.append(CheckResult(f"{name}: Hypothesis run", sum(counts.values()), math.inf, 0.0, False, [failure]))
    if rows:
        rows[0].coverage = coverage
        per_dtype = ", ".join(f"{n} {_dtype_name(dt)}" for dt, n in sorted(counts.items(), key=lambda kv: TOL[kv[0]]))
        rows[0].notes.append(f"{name}: {sum(counts.values())} generated cases ({per_dtype}); corner cases among "
                             f"them: " + ", ".join(f"{k} ({v})" for k, v in sorted(coverage.items())))
    return rows


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_forms(examples: int = 300, progress: bool = False) -> list[CheckResult]:
    """Per-head vs fused on `examples` generated cases (outputs, probabilities, gradients)."""
    return _run_property("per-head = fused", attention_cases(), compare_forms, examples,
                         lambda case: TOL[case.dtype], progress)


# %% [markdown]
# ## 3. Against `torch.nn.MultiheadAttention`
#
# PyTorch's module stores the fused parameters in its own orientation. It
# computes `x @ in_proj_weight.T`, so its weights are our fused matrices
# transposed and stacked:
#
# $$\texttt{in\_proj\_weight} = \begin{bmatrix} W_Q^\top \\ W_K^\top \\ W_V^\top \end{bmatrix}
#   \in \mathbb{R}^{3 d_{model} \times d_{model}},\qquad
#   \texttt{out\_proj.weight} = W_O^\top$$
#
# so rows `i*d_k ... (i+1)*d_k - 1` of its query block are `W_Q^(i)` transposed:
# head `i`'s projection. `in_proj_bias = [b_Q | b_K | b_V]`, `out_proj.bias = b_O`.
#
# **Shapes it can hold.** Its heads are always `d_model / h` wide:
# `d_k = d_v = d_model / h`. Its `kdim`/`vdim` arguments are something else,
# the widths of the key and value *inputs*; with them it keeps three separate
# input projections, which our forms (one input width `d_model`) do not have.
# Converting anything else raises a `ValueError` naming the shapes. Its
# `add_bias_kv` and `add_zero_attn` options add keys our forms do not have
# and are refused too.
#
# **Masks.** Its boolean masks mean the opposite of ours: `True` = *blocked*.
# `torch_mha_masks` maps ours: a padding-shaped mask `(B, 1, T_k)` becomes
# `key_padding_mask = ~mask` of shape `(B, T_k)`; a mask shared by the batch
# `(1, T_q, T_k)` becomes a 2-D `attn_mask (T_q, T_k)`; a general
# `(B, T_q, T_k)` mask is repeated for each head into the 3-D
# `attn_mask (B*h, T_q, T_k)`, whose row `b*h + i` is batch `b`, head `i`.
# One difference remains: where a query may attend to *no* key,
# `nn.MultiheadAttention` returns NaN and ours returns zeros, so the
# comparisons keep at least one key visible for every query.

# %%
AttentionLike = Union[PerHeadAttention, FusedAttention, nn.MultiheadAttention]


def _shape_str(shape: dict) -> str:
    return "{" + ", ".join(f"{k}={v}" for k, v in shape.items()) + "}"


def mha_shape(mha: nn.MultiheadAttention) -> dict:
    """The shape dict (as `att.shape()`) of an nn.MultiheadAttention our forms can hold; ValueError otherwise."""
    if not mha._qkv_same_embed_dim:
        raise ValueError(f"nn.MultiheadAttention with kdim={mha.kdim}, vdim={mha.vdim} != embed_dim={mha.embed_dim} "
                         f"has separate input projections for keys and values of other widths; our attentions "
                         f"read keys and values of width d_model")
    if mha.bias_k is not None or mha.add_zero_attn:
        raise ValueError("nn.MultiheadAttention with add_bias_kv=True or add_zero_attn=True adds keys and values "
                         "that our attentions do not have")
    d = mha.embed_dim // mha.num_heads
    return dict(d_model=mha.embed_dim, h=mha.num_heads, d_k=d, d_v=d, bias=mha.in_proj_bias is not None)


def attention_shape(att: AttentionLike) -> dict:
    """d_model, h, d_k, d_v, bias of any of the three kinds of attention."""
    if isinstance(att, (PerHeadAttention, FusedAttention)):
        return att.shape()
    if isinstance(att, nn.MultiheadAttention):
        return mha_shape(att)
    raise TypeError(f"expected PerHeadAttention, FusedAttention or nn.MultiheadAttention, got {type(att).__name__}")


def fused_parameters(att: AttentionLike, *, grads: bool = False) -> dict[str, Tensor]:
    """The parameters of any attention (or their .grad) in our fused layout: W_Q (d_model, h*d_k), ...

    >>> ph = PerHeadAttention(6, 2, d_k=1, d_v=4)
    >>> {n: tuple(t.shape) for n, t in fused_parameters(ph).items()}
    {'W_Q': (6, 2), 'W_K': (6, 2), 'W_V': (6, 8), 'W_O': (8, 6), 'b_Q': (2,), 'b_K': (2,), 'b_V': (8,), 'b_O': (6,)}
    """
    shape = attention_shape(att)

    def get(p: Optional[Tensor]) -> Tensor:
        if not grads:
            return p
        return p.grad if p.grad is not None else torch.zeros_like(p)

    if isinstance(att, FusedAttention):
        return {n: get(p) for n, p in att.named_parameters()}
    if isinstance(att, PerHeadAttention):
        out = {n: torch.cat([get(p) for p in getattr(att, n)], dim=1) for n in ("W_Q", "W_K", "W_V")}  # (d_model, h*d)
        out["W_O"] = torch.cat([get(p) for p in att.W_O], dim=0)  # (h*d_v, d_model)
        if att.bias:
            out.update({n: torch.cat([get(p) for p in getattr(att, n)]) for n in ("b_Q", "b_K", "b_V")})  # (h*d,)
            out["b_O"] = get(att.b_O)
        return out
    E = shape["d_model"]
    W_in = get(att.in_proj_weight)  # (3 d_model, d_model) = [W_Q^T; W_K^T; W_V^T]
    out = {"W_Q": W_in[:E].T, "W_K": W_in[E:2 * E].T, "W_V": W_in[2 * E:].T, "W_O": get(att.out_proj.weight).T}
    if shape["bias"]:
        b_in = get(att.in_proj_bias)  # (3 d_model,) = [b_Q | b_K | b_V]
        out.update(b_Q=b_in[:E], b_K=b_in[E:2 * E], b_V=b_in[2 * E:], b_O=get(att.out_proj.bias))
    return out


@torch.no_grad()
def _load_fused_parameters(dst: AttentionLike, params: dict[str, Tensor]) -> None:
    """Write fused-layout parameters into `dst` (any kind); shapes were checked by the caller."""
    s = attention_shape(dst)
    if isinstance(dst, FusedAttention):
        for n, p in dst.named_parameters():
            p.copy_(params[n])
    elif isinstance(dst, PerHeadAttention):
        for n, d in (("W_Q", s["d_k"]), ("W_K", s["d_k"]), ("W_V", s["d_v"])):
            for W_i, block in zip(getattr(dst, n), params[n].split(d, dim=1)):
                W_i.copy_(block)  # (d_model, d)
        for W_i, block in zip(dst.W_O, params["W_O"].split(s["d_v"], dim=0)):
            W_i.copy_(block)  # (d_v, d_model)
        if s["bias"]:
            for n, d in (("b_Q", s["d_k"]), ("b_K", s["d_k"]), ("b_V", s["d_v"])):
                for b_i, block in zip(getattr(dst, n), params[n].split(d)):
                    b_i.copy_(block)
            dst.b_O.copy_(params["b_O"])
    else:
        dst.in_proj_weight.copy_(torch.cat([params["W_Q"].T, params["W_K"].T, params["W_V"].T], dim=0))
        dst.out_proj.weight.copy_(params["W_O"].T)  # (d_model, h*d_v)
        if s["bias"]:
            dst.in_proj_bias.copy_(torch.cat([params["b_Q"], params["b_K"], params["b_V"]]))
            dst.out_proj.bias.copy_(params["b_O"])


def copy_attention(src: AttentionLike, dst: AttentionLike) -> AttentionLike:
    """Copy the parameters of `src` into the existing `dst` (any of the three kinds); returns `dst`.

    Both must have the same `attention_shape`; otherwise a ValueError names both shapes.
    Numbers are copied, never recomputed, so a round trip is bit-identical.
    """
    s, d = attention_shape(src), attention_shape(dst)
    if s != d:
        differ = ", ".join(k for k in s if s[k] != d[k])
        raise ValueError(f"cannot copy attention parameters: source {type(src).__name__} has shape {_shape_str(s)}, "
                         f"destination {type(dst).__name__} has shape {_shape_str(d)} (they differ in {differ})")
    _load_fused_parameters(dst, fused_parameters(src))
    return dst


def to_torch_mha(att: Union[PerHeadAttention, FusedAttention], batch_first: bool = True) -> nn.MultiheadAttention:
    """An nn.MultiheadAttention computing the same function as `att` (same dtype, device, mode, dropout)."""
    s = attention_shape(att)
    if not (s["d_k"] == s["d_v"] and s["h"] * s["d_k"] == s["d_model"]):
        raise ValueError(f"nn.MultiheadAttention needs d_k = d_v = d_model / h, got {type(att).__name__} with shape "
                         f"{_shape_str(s)} (its kdim/vdim are the widths of the key/value inputs, not head sizes)")
    p = next(att.parameters())
    mha = nn.MultiheadAttention(s["d_model"], s["h"], dropout=att.dropout, bias=s["bias"], batch_first=batch_first,
                                device=p.device, dtype=p.dtype)
    return copy_attention(att, mha).train(att.training)


def from_torch_mha(mha: nn.MultiheadAttention) -> FusedAttention:
    """A FusedAttention computing the same function as `mha` (use `split` on it for the per-head form)."""
    s = mha_shape(mha)
    p = mha.in_proj_weight
    att = FusedAttention(s["d_model"], s["h"], s["d_k"], s["d_v"], bias=s["bias"], dropout=mha.dropout)
    return copy_attention(mha, att.to(device=p.device, dtype=p.dtype)).train(mha.training)


def torch_mha_masks(mask: Optional[Tensor], batch: int, h: int) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """Our mask (True = may attend) -> nn.MultiheadAttention's (attn_mask, key_padding_mask), True = blocked.

    >>> pad = torch.tensor([[[True, True, False]]])           # (B=1, 1, T_k=3): the last key is padding
    >>> torch_mha_masks(pad, batch=1, h=2)
    (None, tensor([[False, False,  True]]))
    >>> attn, kpm = torch_mha_masks(subsequent_mask(2), batch=4, h=2)   # (1, T, T): shared by the batch
    >>> attn, kpm
    (tensor([[False,  True],
            [False, False]]), None)
    """
    if mask is None:
        return None, None
    if mask.dtype != torch.bool or mask.dim() not in (2, 3):
        raise ValueError(f"expected a bool mask of shape (T_q, T_k) or (B or 1, T_q or 1, T_k), "
                         f"got dtype {mask.dtype}, shape {tuple(mask.shape)}")
    mask = mask if mask.dim() == 3 else mask.unsqueeze(0)  # (B or 1, T_q or 1, T_k)
    if mask.size(0) not in (1, batch):
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not match batch size {batch}")
    if mask.size(1) == 1:
        return None, ~mask[:, 0, :].expand(batch, -1)  # key_padding_mask (B, T_k)
    if mask.size(0) == 1:
        return ~mask[0], None  # attn_mask (T_q, T_k)
    return (~mask).repeat_interleave(h, dim=0), None  # attn_mask (B*h, T_q, T_k), row b*h + i


# %% [markdown]
# ### The fast path, and how we know it ran
#
# In eval mode `nn.MultiheadAttention` may skip its Python code and call one
# fused C++ kernel, `torch._native_multi_head_attention`. It does so only
# when *all* of these hold (read from its source in torch 2.13): the
# fast path is enabled (`torch.backends.mha.set_fastpath_enabled(True)`, the
# default); inputs are batched 3-D with `batch_first=True`; query, key and
# value are *the same tensor object* (self-attention); eval mode; no autograd
# (`torch.no_grad()`, or nothing requires grad); an even number of heads;
# biases present (`bias=True`); no `add_bias_kv`/`add_zero_attn`; `kdim =
# vdim = embed_dim`; no autocast. Otherwise it silently takes the slow path.
#
# So a test that merely sets the flag proves nothing. The "eval, fast path
# on" cases below are built to meet every condition (self-attention with one
# tensor, `batch_first=True`, `h = 2` or `4`, bias, under `no_grad`), and a
# `TorchDispatchMode` records which aten operators ran: the check requires
# `aten._native_multi_head_attention` in every such case, and never when the
# fast path is switched off. The flag is restored afterwards.

# %%
class _OpsSeen(TorchDispatchMode):
    """Records the names of the aten operators that run inside the `with` block."""

    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
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
        return (self.mode == "eval, fast path on" and self.batch_first and not self.cross and self.h % 2 == 0
                and self.bias)


def mha_cases() -> list[MhaCase]:
    """Every combination, for d_model=8 with h = 2 and 4 (even: fast path possible) and d_model=6 with h = 3;
    the form converted to nn.MultiheadAttention alternates between fused and per-head."""
    out = []
    for d_model, h in ((8, 2), (8, 4), (6, 3)):
        for bias in (True, False):
            for batch_first in (True, False):
                for mode in MHA_MODES:
                    for cross in (False, True):
                        for masks in ("none", "padding", "causal", "both, merged", "both, separate"):
                            for need_weights in (True, False):
                                form = ("fused", "per_head")[len(out) % 2]  # both forms, alternately
                                out.append(MhaCase(d_model, h, bias, batch_first, mode, cross, masks, form,
                                                   need_weights))
    return out


def _mha_inputs(case: MhaCase, seed: int):
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


def _mha_call(mha: nn.MultiheadAttention, x_q: Tensor, x_kv: Tensor, attn_mask, kpm, need_weights: bool):
    """Call with batch-first tensors whatever mha.batch_first is; the same tensor object for q, k, v if x_q is x_kv."""
    if not mha.batch_first:
        q = x_q.transpose(0, 1)  # (T_q, B, d_model)
        kv = q if x_kv is x_q else x_kv.transpose(0, 1)
    else:
        q, kv = x_q, x_kv
    out, w = mha(q, kv, kv, key_padding_mask=kpm, need_weights=need_weights, attn_mask=attn_mask,
                 average_attn_weights=False)
    return (out if mha.batch_first else out.transpose(0, 1)), w  # (B, T_q, d_model), (B, h, T_q, T_k)


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
    x_q, x_kv, pad, causal, G = _mha_inputs(case, seed)
    B = x_q.size(0)
    ours_mask = {"none": None, "padding": pad, "causal": causal}.get(case.masks, pad & causal)
    if case.masks == "both, separate":  # padding -> key_padding_mask, causal -> attn_mask
        attn_mask, kpm = torch_mha_masks(causal, B, case.h)[0], torch_mha_masks(pad, B, case.h)[1]
    else:
        attn_mask, kpm = torch_mha_masks(ours_mask, B, case.h)

    before, after = fused_parameters(fu), fused_parameters(back)
    res = {"roundtrip": before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)}
    if train:  # compare gradients too
        out_o, p_o, gin_o = _run_with_grads(ours, x_q, x_kv, ours_mask, G, case.cross)
        q = x_q.clone().requires_grad_()
        kv = x_kv.clone().requires_grad_() if case.cross else q
        out_t, w_t = _mha_call(mha, q, kv, attn_mask, kpm, case.need_weights)
        (out_t * G).sum().backward()
        gin_t = [q.grad] + ([kv.grad] if case.cross else [])
        g_o, g_t = fused_parameters(ours, grads=True), fused_parameters(mha, grads=True)
        res["grad"] = max([_max_abs(a, b) for a, b in zip(gin_o, gin_t)] + [_max_abs(g_o[n], g_t[n]) for n in g_o])
        res["native kernel ran"] = False
    else:
        with torch.no_grad(), mha_fastpath(case.mode == "eval, fast path on"), _OpsSeen() as seen:
            out_t, w_t = _mha_call(mha, x_q, x_kv, attn_mask, kpm, case.need_weights)
        res["native kernel ran"] = NATIVE_MHA in seen.ops
        with torch.no_grad():
            out_o, p_o = ours(x_q, x_kv, ours_mask, return_attention=True)
    res["output"] = _max_abs(out_o, out_t)
    if case.need_weights:
        res["weights"] = _max_abs(p_o, w_t)
    return res


def check_torch_mha(progress: bool = False) -> list[CheckResult]:
    """Our attentions vs nn.MultiheadAttention, in each mode; conversions round-trip bit-identically."""
    cases = mha_cases()
    rows = []
    results = [(c, compare_with_torch_mha(c, seed=k))
               for k, c in enumerate(tqdm(cases, desc="nn.MultiheadAttention", leave=False, disable=not progress,
                                          file=sys.stderr))]
    tol = TOL[torch.float64]
    for mode in MHA_MODES:
        mine = [(c, r) for c, r in results if c.mode == mode]
        diffs = [r["output"] for _, r in mine] + [r["weights"] for _, r in mine if "weights" in r]
        diffs += [r["grad"] for _, r in mine if "grad" in r]
        what = "outputs, per-head weights" + (", gradients" if mode.startswith("train") else "")
        notes = []
        ok_path = True
        if mode == "eval, fast path on":
            eligible = [r["native kernel ran"] for c, r in mine if c.fast_path_expected]
            notes.append(f"nn.MultiheadAttention, fast path on: its native kernel ran in {sum(eligible)} of "
                         f"{len(eligible)} cases meeting all the fast path's conditions (self-attention, "
                         f"batch_first, even h, bias, eval, no grad)")
            ok_path = len(eligible) > 0 and all(eligible)
        elif mode == "eval, fast path off":
            ran = sum(r["native kernel ran"] for _, r in mine)
            notes.append(f"nn.MultiheadAttention, fast path off: its native kernel ran in {ran} of {len(mine)} "
                         f"cases")
            ok_path = ran == 0
        row = CheckResult.of(f"nn.MultiheadAttention, {mode}: {what}", len(mine), _nanmax(diffs), tol, notes)
        row.passed &= ok_path
        rows.append(row)
    trips = [r["roundtrip"] for _, r in results]
    rows.append(CheckResult("ours -> nn.MultiheadAttention -> ours: bit-identical parameters", len(trips),
                            0.0 if all(trips) else math.inf, 0.0, all(trips)))
    return rows


def _nanmax(values) -> float:
    values = list(values)
    if any(math.isnan(v) for v in values):
        return math.nan
    return max(values, default=0.0)


# %% [markdown]
# ## 4. Two kernels, and whole models
#
# **SDPA vs explicit softmax.** `attention()` runs PyTorch's fused
# `scaled_dot_product_attention` when nobody asks for the probabilities and
# `T.FAST_PATH` is on, else the explicit `softmax(Q K^T / sqrt(d_k)) V`. On
# generated cases (fully masked queries included) both forms must give the
# same outputs and input gradients either way. The flag is set inside the
# check and restored afterwards.
#
# **Whole models.** A model built with per-head attention and its
# `convert_model(model, "fused")` copy must give the same logits under teacher
# forcing and the same greedy decodes. We check a copy-task model trained for
# a few steps (`train_copy_task(attention="per_head", steps=...)`): the
# decodes need not be good, only equal; training makes the logits less
# uniform than at initialisation, so near-ties in the argmax are rare. Logits
# are compared in float32 (as trained) and float64; decodes in float32, the
# dtype the model runs in. `--checkpoint PATH` runs the same comparison on a
# trained translation checkpoint.
#
# *float32 logits: a relative tolerance.* Unlike the single attentions of
# section 2 (values of order 1), a trained model's logits reach about 10, and
# a float32 number of size `L` has an ulp of about `L * 1.2e-7`; rounding
# differences from every attention in both stacks (two layers each, three
# attentions per decoder layer) end up in the logits scaled by their size
# (measured: up to about `1.5e-5` on logits up to 9, i.e. `1.7e-6` relative). So
# float32 logits are compared with `1e-5 * max(1, max |logit|)`, `1e-5`
# relative to the largest logit; float64 logits stay at `1e-12` absolute.

# %%
@contextlib.contextmanager
def fast_path(enabled: bool):
    """Set annotated.transformer.FAST_PATH inside the block, then restore it."""
    before = T.FAST_PATH
    T.FAST_PATH = enabled
    try:
        yield
    finally:
        T.FAST_PATH = before


def compare_paths(case: Case) -> dict[str, float]:
    """SDPA path vs explicit path, for both forms, on one case: outputs and input gradients."""
    worst = {"output": 0.0, "grad inputs": 0.0}
    for att in case_pair(case):
        x_q, x_kv, mask, G = case_inputs(case)
        got = {}
        for flag in (True, False):
            q = x_q.clone().requires_grad_()
            kv = x_kv.clone().requires_grad_() if case.cross else q
            with fast_path(flag):
                out, p = att(q, kv, mask)
            if flag and p is not None:
                raise AssertionError("the fast path returned probabilities: it did not run")
            (out * G).sum().backward()
            got[flag] = (out, [q.grad] + ([kv.grad] if case.cross else []))
        worst["output"] = _nanmax([worst["output"], _max_scaled(got[True][0], got[False][0])])
        worst["grad inputs"] = _nanmax([worst["grad inputs"]] +
                                       [_max_scaled(a, b) for a, b in zip(got[True][1], got[False][1])])
    return worst


def check_sdpa_paths(examples: int = 100, progress: bool = False) -> list[CheckResult]:
    return _run_property("SDPA path = explicit path", attention_cases(), compare_paths, examples,
                         lambda case: TOL[case.dtype], progress)


def logits_tolerance(dtype: torch.dtype, logits: Tensor) -> float:
    """float64: 1e-12 absolute; float32: 1e-5 relative to the largest logit (see the prose)."""
    if dtype == torch.float64:
        return TOL[torch.float64]
    return TOL[torch.float32] * max(1.0, logits.abs().max().item())


def compare_model_forms(model: T.EncoderDecoder, src: Tensor, tgt: Tensor, max_len: int) -> dict:
    """Convert `model` to the other attention form; compare logits (float32, float64) and greedy decodes."""
    check_token_ids(src, model.config.src_vocab)
    check_token_ids(tgt, model.config.tgt_vocab)
    other = "fused" if model.config.attention == "per_head" else "per_head"
    a = copy.deepcopy(model).eval()  # the caller's model keeps its dtype and mode
    b = convert_model(a, other).eval()
    src_mask, tgt_mask = padding_mask(src, PAD), target_mask(tgt, PAD)
    res = {}
    with torch.no_grad():
        for dtype in (torch.float32, torch.float64):
            ma, mb = a.to(dtype), b.to(dtype)
            la, lb = ma(src, tgt, src_mask, tgt_mask), mb(src, tgt, src_mask, tgt_mask)
            res[dtype] = (_max_abs(la, lb), logits_tolerance(dtype, la))
        a, b = a.float(), b.float()
    da = greedy_decode(a, src, src_mask, max_len, BOS, EOS, PAD)
    db = greedy_decode(b, src, src_mask, max_len, BOS, EOS, PAD)
    width = max(da.size(1), db.size(1))
    da, db = (torch.nn.functional.pad(d, (0, width - d.size(1)), value=PAD) for d in (da, db))
    res["tokens differing"] = int((da != db).sum())
    res["sentences"] = src.size(0)
    res["decodes"] = da  # (n, width) of the original form, padded with PAD
    return res


def _model_rows(name: str, res: dict) -> list[CheckResult]:
    n = res["sentences"]
    rows = [CheckResult.of(f"{name}: logits, per-head = fused, {_dtype_name(dt)}", n, *res[dt])
            for dt in (torch.float64, torch.float32)]
    rows[1].notes.append(f"{name}: the float32 logits tolerance is relative, 1e-5 x the largest |logit| "
                         f"({res[torch.float32][1] / TOL[torch.float32]:.1f}), see section 4")
    rows.append(CheckResult.of(f"{name}: greedy decodes identical (tokens differing)", n,
                               float(res["tokens differing"]), 0.0))
    return rows


def check_copy_model(steps: int = 150, batch_size: int = 64, sentences: int = 500, seed: int = 0,
                     progress: bool = False) -> list[CheckResult]:
    """A per-head copy-task model (briefly trained) vs its fused conversion."""
    with tqdm(total=1, desc=f"training the copy-task model ({steps} steps)", leave=False, disable=not progress,
              file=sys.stderr) as bar:
        model = T.train_copy_task(attention="per_head", steps=steps, batch_size=batch_size, seed=seed)
        bar.update(1)
    gen = torch.Generator().manual_seed(seed + 1)
    src, tgt = T.copy_batch(sentences, 10, model.config.src_vocab, gen)
    res = compare_model_forms(model, src, tgt[:, :-1], max_len=11)
    rows = _model_rows(f"copy-task model ({steps} steps)", res)
    want = tgt[:, 1:]  # (n, 11): symbols, eos, pad
    got = torch.nn.functional.pad(res["decodes"], (0, max(0, want.size(1) - res["decodes"].size(1))), value=PAD)
    exact = (got[:, :want.size(1)] == want).all(dim=1).float().mean().item()
    rows[-1].notes.append(f"copy-task model: it copies {exact:.0%} of the {sentences} sentences exactly, so the "
                          f"decodes are not trivial; both forms produce the same ones")
    return rows


def check_checkpoint(path: str, sentences: int = 64, seed: int = 0) -> list[CheckResult]:
    """A trained checkpoint vs its conversion to the other form, on random source and target ids.

    A file that does not load gives one failing row whose note is the loader's error (it names the file).
    """
    from annotated.checkpoint import load_checkpoint  # lazily: only this check needs it

    try:
        model, _tokenizer, _meta = load_checkpoint(path)
    except (OSError, ValueError) as e:
        return [CheckResult(f"checkpoint {path}: loads", 0, math.inf, 0.0, False, [f"{type(e).__name__}: {e}"])]
    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    S, T_len = min(20, cfg.max_len), min(20, cfg.max_len)
    src = torch.randint(4, cfg.src_vocab, (sentences, S), generator=gen)  # (n, S) ids past pad/bos/eos/unk
    lengths = torch.randint(1, S + 1, (sentences,), generator=gen)
    src = src.masked_fill(torch.arange(S) >= lengths[:, None], PAD)  # (n, S) with padding
    tgt = torch.cat([torch.full((sentences, 1), BOS), torch.randint(4, cfg.tgt_vocab, (sentences, T_len - 1),
                                                                    generator=gen)], dim=1)  # (n, T)
    res = compare_model_forms(model, src, tgt, max_len=min(30, cfg.max_len))
    return _model_rows(f"checkpoint {path}", res)


# %% [markdown]
# ## 5. Bad input
#
# Copying parameters between attentions of different shapes must fail loudly,
# naming both shapes, and leave the destination untouched (the shapes are
# compared before anything is written). `bad_conversions` lists such pairs:
# a different `h`, `d_k`, `d_v`, `d_model`, bias against no bias, in every
# direction between our two forms and `nn.MultiheadAttention`, plus
# `to_torch_mha` on shapes `nn.MultiheadAttention` cannot hold.

# %%
def bad_conversions() -> list[tuple[str, object]]:
    """(description, thunk) pairs; each thunk must raise a ValueError naming the shapes."""
    P, F_, M = PerHeadAttention, FusedAttention, nn.MultiheadAttention
    return [
        ("different h", lambda: copy_attention(P(8, 2, 4, 4), F_(8, 4, 4, 4))),
        ("different d_k", lambda: copy_attention(F_(8, 2, 3, 4), P(8, 2, 4, 4))),
        ("different d_v", lambda: copy_attention(P(8, 2, 4, 4), P(8, 2, 4, 5))),
        ("different d_model", lambda: copy_attention(F_(8, 2, 4, 4), F_(6, 2, 4, 4))),
        ("bias vs no bias", lambda: copy_attention(P(8, 2, bias=True), F_(8, 2, bias=False))),
        ("into nn.MultiheadAttention, different h", lambda: copy_attention(F_(8, 2), M(8, 4))),
        ("from nn.MultiheadAttention, no bias", lambda: copy_attention(M(8, 2, bias=False), P(8, 2))),
        ("to_torch_mha, d_k != d_model / h", lambda: to_torch_mha(F_(8, 2, 3, 3))),
        ("to_torch_mha, d_k != d_v", lambda: to_torch_mha(P(8, 2, 4, 2))),
        ("from_torch_mha, kdim != embed_dim", lambda: from_torch_mha(M(8, 2, kdim=4, vdim=4))),
    ]


def check_bad_conversions() -> list[CheckResult]:
    failures = []
    cases = bad_conversions()
    for what, thunk in cases:
        try:
            thunk()
            failures.append(f"{what}: no error")
        except ValueError as e:
            if not any(s in str(e) for s in ("shape {", "kdim=")):
                failures.append(f"{what}: message names no shape: {e}")
    return [CheckResult("incompatible conversions raise ValueError naming the shapes", len(cases),
                        0.0 if not failures else math.inf, 0.0, not failures, failures)]


# %% [markdown]
# ## 6. The report
#
# `run_checks` runs everything; `format_report` prints the identities of
# section 1 and one table row per check. `main` exits with status 1 if any
# check failed.

# %%
def run_checks(examples: int = 300, sdpa_examples: int = 100, copy_steps: int = 150,
               checkpoint: Optional[str] = None, progress: bool = False):
    """All checks. Returns (results, identities)."""
    sym, identities = check_symbolic()
    results = [sym]
    results += check_forms(examples, progress)
    results += check_torch_mha(progress)
    results += check_sdpa_paths(sdpa_examples, progress)
    results += check_copy_model(steps=copy_steps, progress=progress)
    if checkpoint is not None:
        results += check_checkpoint(checkpoint)
    results += check_bad_conversions()
    return results, identities


def _fmt(x: float) -> str:
    if math.isnan(x) or math.isinf(x):
        return str(x)
    return "0" if x == 0 else f"{x:.1e}"


def format_report(results: list[CheckResult], identities: list[tuple[str, str, bool]]) -> str:
    lines = ["Per-head and fused multi-head attention: equivalence report",
             f"torch {torch.__version__}, sympy {sympy.__version__}, hypothesis {hypothesis.__version__}", "",
             "Exact identities (sympy, every entry an independent symbol; B=2, T=3 unless stated):"]
    last = None
    for size, identity, holds in identities:
        if size != last:
            lines.append(f"  {size}:")
            last = size
        lines.append(f"    {identity}: {'holds exactly' if holds else 'FAILS'}")
    lines.append("")
    header = ("check", "cases", "max diff", "tolerance", "result")
    rows = [(r.check, str(r.cases), _fmt(r.max_diff), "exact" if r.tol == 0 else f"{r.tol:.0e}",
             "pass" if r.passed else "FAIL") for r in results]
    widths = [max(len(row[i]) for row in rows + [header]) for i in range(5)]
    fmt = lambda row: " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in  # noqa: E731
                                 enumerate(zip(row, widths)))
    lines += [fmt(header), "-+-".join("-" * w for w in widths)] + [fmt(r) for r in rows]
    lines.append("max diff: the largest |a - b|; in the generated (Hypothesis) checks divided by max(1, largest |a|)")
    notes = [textwrap.fill(n, width=110, initial_indent="  - ", subsequent_indent="    ")
             for r in results for n in r.notes]
    if notes:
        lines += ["", "Notes:"] + notes
    failed = sum(not r.passed for r in results)
    lines += ["", f"{len(results) - failed} of {len(results)} checks passed." +
              ("" if not failed else f" {failed} FAILED.")]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="Prove that per-head and fused attention are the same function.")
    ap.add_argument("--checkpoint", help="also compare both forms of a trained checkpoint (a .pt file)")
    ap.add_argument("--examples", type=int, default=300, help="Hypothesis cases for per-head vs fused")
    ap.add_argument("--copy-steps", type=int, default=150, help="training steps of the copy-task model")
    args = ap.parse_args(argv)
    if args.examples < 1 or args.copy_steps < 1:
        ap.error("--examples and --copy-steps must be positive")
    if args.checkpoint is not None and not os.path.isfile(args.checkpoint):
        ap.error(f"checkpoint file {args.checkpoint} does not exist")
    # Every tensor here is tiny: one thread is as fast, and is not slowed down by other busy processes.
    torch.set_num_threads(1)
    results, identities = run_checks(args.examples, copy_steps=args.copy_steps, checkpoint=args.checkpoint,
                                     progress=True)
    print(format_report(results, identities))
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    from annotated.cli import run_command
    run_command(main, "python -m annotated.equivalence")  # Ctrl-C: one line and exit code 130, not a traceback
