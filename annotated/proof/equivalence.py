# %% [markdown]
# # Per-head and fused attention are the same function: the proof, checked
#
# `annotated/transformer.py` writes multi-head attention twice.
# `PerHeadAttention` keeps the paper's `h` rectangular matrices per projection
# and loops over heads; `FusedAttention` lays them side by side and computes
# every head with one product and a `view`. This module states the theorem,
# proves it on paper, and checks the proof in four parts of increasing reach
# and decreasing certainty. `python -m annotated.proof.equivalence` (or
# `make equivalence`) prints the report, part by part, and exits non-zero if
# any check fails; the same check functions run in `tests/proof/test_equivalence.py`.
#
# **Theorem.** Build the fused parameters from the per-head ones by blocks,
#
# $$W_Q = [\,W_Q^{(0)} \mid \dots \mid W_Q^{(h-1)}\,],\quad b_Q = [\,b_Q^{(0)} \mid \dots \mid b_Q^{(h-1)}\,],\quad
#   W_O = \begin{bmatrix} W_O^{(0)} \\ \vdots \\ W_O^{(h-1)} \end{bmatrix}$$
#
# (likewise `W_K`, `b_K`, `W_V`, `b_V`; `b_O` is shared). Then, with dropout
# off (eval mode, or dropout 0), for every query input `X_q`, key/value input
# `X_kv` and mask, `FusedAttention` and `PerHeadAttention` return the same
# output and the same attention probabilities, and the gradient of any loss
# with respect to a fused matrix is the per-head gradients laid out in the
# same blocks. (With dropout on, each form draws its own random dropout mask.)
#
# **Proof.**
# 1. *Block product.* Column `j` of `X W` only involves column `j` of `W`, so
#    `X [W^(0) | ... | W^(h-1)] + [b^(0) | ... | b^(h-1)] = [X W^(0) + b^(0) | ... | X W^(h-1) + b^(h-1)]`.
#    By induction on `h`: for `h = 1` there is nothing to show; for `h + 1`,
#    write the matrix as two blocks `[A | W^(h)]` with `A` the first `h`,
#    apply the two-block rule `X [A | W] = [X A | X W]`, and the hypothesis to `X A`.
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
# 4. *Output.* `transpose(1, 2).reshape(B, T, h*d_v)` is `Concat(head_0, ..., head_{h-1})`
#    (step 2 backwards), and a row of column blocks times a column of row
#    blocks is the sum of the block products (by the same induction):
#    `Concat(heads) W_O + b_O = sum_i head_i W_O^(i) + b_O`.
#
# Hence the functions are equal. For gradients: the fused parameters are the
# per-head ones placed in blocks, a relabelling of coordinates, and the loss
# is the same function of them; so the derivative by an entry of `W_Q` is the
# derivative by the per-head entry it came from. QED.
#
# **The four parts of the check, and what each establishes.**
#
# | part | what | reach | test in `tests/proof/test_equivalence.py` |
# | --- | --- | --- | --- |
# | 1. symbolic, all sizes | steps 1 and 4 (with and without biases) as sympy block-matrix identities | `h = 1..8` and the induction step for every `h`; every `T`, `d_model`, `d_k`, `d_v` (symbols) | `test_block_algebra_holds_for_every_size` |
# | 2. exact on the real code | steps 2 and 4's index moves in the real `_heads`, `_attend`, `keys_values`, `fuse`, `split`, on integer tracers | every `h <= 8`, `d_k, d_v <= 5`, three `(B, T)`; exact equality | `test_tracers_follow_the_real_code`, `test_tracers_catch_two_layout_bugs` |
# | 3. exact, the whole function | per-head = fused = `nn.MultiheadAttention`, bit for bit, where floating point is exact | generated cases with masks | `test_whole_function_is_bit_identical_where_arithmetic_is_exact` |
# | 4. numerical | outputs, probabilities, gradients; `nn.MultiheadAttention` in every mode; both kernels; whole models | generated cases, worst difference against a stated tolerance | `test_per_head_equals_fused_on_generated_cases` and others |

# %%
from __future__ import annotations

import copy
import itertools
import math
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import hypothesis
import sympy
import torch
from sympy import BlockMatrix, MatrixSymbol, OneMatrix, ZeroMatrix, block_collapse
from torch import Tensor
from tqdm import tqdm

from annotated import transformer
from annotated.checks import check_source_and_target
from annotated.door import Door
from annotated.plumbing.options import at_least
from annotated.proof.harness import (
    MHA_MODES,
    TOL,
    CheckResult,
    attention_cases,
    compare_forms,
    compare_paths,
    compare_with_torch_mha,
    dtype_name,
    max_abs,
    mha_cases,
    nanmax,
    run_property,
)
from annotated.proof.torch_mha import to_torch_mha, torch_mha_masks
from annotated.recording import attend_with_probabilities
from annotated.tokens import BOS, EOS, PAD
from annotated.transformer import (
    FusedAttention,
    PerHeadAttention,
    convert_model,
    fast_path,
    fuse,
    greedy_decode,
    padding_mask,
    split,
    target_mask,
)

# %% [markdown]
# ## 1. Symbolic, all sizes: the block algebra
#
# Steps 1 and 4 are statements about block matrices, and sympy states them
# with *sizes* that are symbols: `X` is a `T x d_model` `MatrixSymbol`, each
# `W_Q^(i)` is `d_model x d_k`, each bias `1 x d_k`, broadcast over the rows
# by the all-ones column `1` (`T x 1`). `block_collapse` multiplies and adds
# by the block rules, and every block of the difference from the claimed
# right-hand side must come out as sympy's zero matrix. For every `h` from 1
# to 8 we check step 1, `X [W^(0) | ... | W^(h-1)] = [X W^(0) | ... | X W^(h-1)]`
# with and without the biases `1 [b^(0) | ... | b^(h-1)]`, for blocks of
# width `d_k` and `d_v`, and step 4,
# `[H^(0) | ... | H^(h-1)] [W_O^(0); ...; W_O^(h-1)] = sum_i H^(i) W_O^(i)`, with
# and without `+ 1 b_O`. For the induction on `h`, the same two rules hold for
# **two** blocks whose first has a symbolic width `m` (the heads so far):
# that is exactly the proof's step from `h` to `h + 1`, so the identities
# hold for every `h`.
#
# **What sympy establishes, and what not.** The identities hold for all sizes
# and all real (indeed ring-valued) entries: no sampled numbers. sympy does
# not read our code (whether `_heads`, `_attend`, `fuse` and `split` lay the
# blocks out this way is part 2's job; that both forms call the same
# `attention` is read off the code, step 3), nor round (part 4); its own
# block rules we trust as we trust the textbook.

# %%
D_MODEL, D_K, D_V, T_LEN, M = sympy.symbols("d_model d_k d_v T m", positive=True, integer=True)
H_MAX = 8


def blocks_equal(lhs, rhs) -> bool:
    """True iff block_collapse(lhs) and rhs have the same block structure and every block difference is zero.

    >>> X, W1, W2 = MatrixSymbol("X", T_LEN, D_MODEL), MatrixSymbol("W1", D_MODEL, D_K), MatrixSymbol("W2", D_MODEL, D_K)
    >>> blocks_equal(X * BlockMatrix([[W1, W2]]), BlockMatrix([[X * W1, X * W2]]))
    True
    >>> blocks_equal(X * BlockMatrix([[W1, W2]]), BlockMatrix([[X * W2, X * W1]]))  # blocks swapped
    False
    """
    got, rhs = _one_block(block_collapse(lhs)), _one_block(rhs)
    if isinstance(got, BlockMatrix) != isinstance(rhs, BlockMatrix):
        return False
    if isinstance(rhs, BlockMatrix):
        return got.blockshape == rhs.blockshape and all(_is_zero(g - r) for g, r in zip(got.blocks, rhs.blocks))
    return _is_zero(got - rhs)


def _one_block(m):
    """A 1 x 1 block matrix is its one block."""
    return m.blocks[0, 0] if isinstance(m, BlockMatrix) and m.blockshape == (1, 1) else m


def _is_zero(difference) -> bool:
    d = difference.doit()
    return isinstance(d, ZeroMatrix) or d == 0


def _mats(name: str, h: int, rows, cols) -> list[MatrixSymbol]:
    return [MatrixSymbol(f"{name}{i}", rows, cols) for i in range(1, h + 1)]


def projection_identities(h: int, d) -> tuple[bool, bool]:
    """Step 1 for h blocks of width d: (without bias, with bias)."""
    X, ones = MatrixSymbol("X", T_LEN, D_MODEL), OneMatrix(T_LEN, 1)
    W, b = _mats("W", h, D_MODEL, d), _mats("b", h, 1, d)
    plain = blocks_equal(X * BlockMatrix([W]), BlockMatrix([[X * W_i for W_i in W]]))
    biased = blocks_equal(
        X * BlockMatrix([W]) + ones * BlockMatrix([b]), BlockMatrix([[X * W_i + ones * b_i for W_i, b_i in zip(W, b)]])
    )
    return plain, biased


def output_identities(h: int) -> tuple[bool, bool]:
    """Step 4 for h heads: Concat(heads) W_O = sum_i head_i W_O^(i) (without, with b_O)."""
    H, W_O = _mats("H", h, T_LEN, D_V), _mats("W_O", h, D_V, D_MODEL)
    b_O, ones = MatrixSymbol("b_O", 1, D_MODEL), OneMatrix(T_LEN, 1)
    total = sympy.MatAdd(*[H_i * W_i for H_i, W_i in zip(H, W_O)])
    concat, stacked = BlockMatrix([H]), BlockMatrix([[W_i] for W_i in W_O])
    return blocks_equal(concat * stacked, total), blocks_equal(concat * stacked + ones * b_O, total + ones * b_O)


def induction_step() -> tuple[bool, bool]:
    """The two-block rules with a first block of symbolic width m (all heads so far)."""
    X, ones = MatrixSymbol("X", T_LEN, D_MODEL), OneMatrix(T_LEN, 1)
    A, W, a, b = (MatrixSymbol(*s) for s in (("A", D_MODEL, M), ("W", D_MODEL, D_K), ("a", 1, M), ("b", 1, D_K)))
    proj = blocks_equal(
        X * BlockMatrix([[A, W]]) + ones * BlockMatrix([[a, b]]), BlockMatrix([[X * A + ones * a, X * W + ones * b]])
    )
    H_A, H = MatrixSymbol("H_A", T_LEN, M), MatrixSymbol("H", T_LEN, D_V)
    W_A, W_O = MatrixSymbol("W_A", M, D_MODEL), MatrixSymbol("W_O", D_V, D_MODEL)
    out = blocks_equal(BlockMatrix([[H_A, H]]) * BlockMatrix([[W_A], [W_O]]), H_A * W_A + H * W_O)
    return proj, out


def symbolic_identities(h_max: int = H_MAX) -> list[tuple[str, str, bool]]:
    """(reach, identity, holds) for each identity of part 1."""
    hs = range(1, h_max + 1)
    proj_plain, proj_bias = map(all, zip(*[projection_identities(h, d) for h in hs for d in (D_K, D_V)]))
    out_plain, out_bias = map(all, zip(*[output_identities(h) for h in hs]))
    step_proj, step_out = induction_step()
    every, step = f"h = 1..{h_max}, any T, d_model, d_k, d_v", "every h (induction step, first block of width m)"
    blocks, concat = "X [W(0) | ... | W(h-1)]", "[H(0) | ... | H(h-1)] [W_O(0); ...; W_O(h-1)]"
    return [
        (every, f"{blocks} = [X W(0) | ... | X W(h-1)], blocks of width d_k and d_v", proj_plain),
        (every, f"{blocks} + 1 [b(0) | ... | b(h-1)] = [X W(0) + 1 b(0) | ... | X W(h-1) + 1 b(h-1)]", proj_bias),
        (every, f"{concat} = sum_i H(i) W_O(i)", out_plain),
        (every, f"{concat} + 1 b_O = sum_i H(i) W_O(i) + 1 b_O", out_bias),
        (step, "X [A | W] + 1 [a | b] = [X A + 1 a | X W + 1 b]", step_proj),
        (step, "[H_A | H] [W_A; W_O] = H_A W_A + H W_O", step_out),
    ]


def check_symbolic() -> tuple[CheckResult, list[tuple[str, str, bool]]]:
    identities = symbolic_identities()
    ok = all(holds for _, _, holds in identities)
    return CheckResult.holds("block algebra of steps 1 and 4 (sympy, symbolic sizes)", len(identities), ok), identities


# %% [markdown]
# ## 2. Exact on the real code: integer tracers
#
# Step 2 (and step 4 read backwards) is index bookkeeping: `view`,
# `transpose`, `reshape`, `cat`, `split`. Symbolic matrices cannot reach it,
# and it is where real bugs live (a `view(B, T, d, h)`, a forgotten
# `transpose` before the `reshape`). So we run the project's own code on
# **tracers**: float64 tensors whose every entry is an integer that names
# where it came from,
#
# $$\mathrm{tag}(n, t, i, c) = 1000000\,n + 10000\,t + 100\,i + c$$
#
# (sentence `n`, position `t`, head or block `i`, column `c`, all below 100;
# every sum and product involved stays an integer far below `2^53`, exact in
# float64). Each check builds the expected tensor from the tag formula alone,
# not from the code's layout, and requires **exact equality**:
#
# - **`_heads`**, with identity weights (and a zero bias, `affine`'s `addmm`
#   path): head `i` of the output carries exactly the tags of column block `i`.
# - **the whole forward of both forms**: `W_V` and `W_O` the identity,
#   `W_Q = W_K = 0`, and a mask that lets query `t` see only key `t`, so each
#   softmax is exactly one-hot. The output must equal the input: every tag
#   went through `keys_values`, `_heads`, `attention`, the concatenation in
#   `_attend` and `W_O`, and came back to its own place.
# - **`keys_values` of both forms**: with `W_K` the identity, head `i` of the
#   keys carries the tags of block `i`.
# - **`fuse` and `split`**: per-head entries tagged `tag(p, r, i, c)`
#   (parameter `p`, row `r`, head `i`, column `c`) land in the fused matrices
#   at row `r`, column `i*d + c` (`W_O`: row `i*d_v + r`), and `split` puts
#   every entry back.
#
# This is exact but not symbolic: it covers the sizes of `TRACER_SIZES` only
# (every `h` from 1 to 8, `d_k` and `d_v` from 1 to 5, three `(B, T)`). The
# code's index formulas do not depend on the sizes (step 2), and these
# include the corner cases (one head, one column, one position,
# `h*d_k != d_model`).

# %%
TRACER_SIZES: dict[str, Any] = dict(h=range(1, 9), d=range(1, 6), BT=((1, 1), (2, 3), (3, 5)))


def sizes_text(sizes: dict) -> str:
    return f"h = 1..{max(sizes['h'])}, d_k, d_v = 1..{max(sizes['d'])}, (B, T) in {', '.join(map(str, sizes['BT']))}"


def tags(B: int, T: int, h: int, d: int) -> Tensor:
    """tag(n, t, i, c) = 1e6 n + 1e4 t + 100 i + c, laid out as (B, T, h, d) by broadcasting (no view).

    >>> tags(2, 1, 2, 2)[1, 0].tolist()
    [[1000000.0, 1000001.0], [1000100.0, 1000101.0]]
    """
    ar = lambda k, n: torch.arange(n, dtype=torch.float64).view([-1 if j == k else 1 for j in range(4)])
    return 1_000_000 * ar(0, B) + 10_000 * ar(1, T) + 100 * ar(2, h) + ar(3, d)  # (B, T, h, d)


def _as_columns(tg: Tensor) -> Tensor:
    """(B, T, h, d) tags -> (B, T, h*d) with column i*d + c holding tag(n, t, i, c), built block by block."""
    return torch.cat([tg[:, :, i] for i in range(tg.size(2))], dim=-1)  # (B, T, h*d)


def _heads_case(h: int, d: int, B: int, T: int) -> bool:
    att = FusedAttention(h * d, h, d_k=d, d_v=d).double()
    tg = tags(B, T, h, d)  # (B, T, h, d)
    x, eye = _as_columns(tg), torch.eye(h * d, dtype=torch.float64)
    want = tg.permute(0, 2, 1, 3)  # (B, h, T, d): head i holds block i (a permute of the tag axes, not the code)
    return all(torch.equal(att._heads(x, eye, b, d), want) for b in (None, torch.zeros(h * d, dtype=torch.float64)))


def _identity_attention(cls: type, h: int, d_k: int, d_v: int) -> PerHeadAttention | FusedAttention:
    fused = FusedAttention(h * d_v, h, d_k=d_k, d_v=d_v).double().eval()
    with torch.no_grad():
        for p in fused.parameters():
            p.zero_()
        fused.W_V.copy_(torch.eye(h * d_v))
        fused.W_O.copy_(torch.eye(h * d_v))
    return fused if cls is FusedAttention else split(fused)


def _forward_case(cls: type, h: int, d_k: int, d_v: int, B: int, T: int) -> bool:
    att = _identity_attention(cls, h, d_k, d_v)
    x = _as_columns(tags(B, T, h, d_v))  # (B, T, h*d_v)
    diagonal = torch.eye(T, dtype=torch.bool).unsqueeze(0)  # (1, T, T): query t sees key t only
    with torch.no_grad():
        outs = []
        for flag in (True, False):  # the SDPA kernel and the explicit softmax
            with fast_path(flag):
                outs.append(att(x, x, diagonal))
        K, _ = att.keys_values(x)  # (B, h, T, d_k) with W_K = 0
    return all(torch.equal(out, x) for out in outs) and K.shape == (B, h, T, d_k)


def _keys_case(cls: type, h: int, d: int, B: int, T: int) -> bool:
    fused = FusedAttention(h * d, h, d_k=d, d_v=d).double()
    with torch.no_grad():
        fused.W_K.copy_(torch.eye(h * d))
        if fused.b_K is not None:  # built with biases
            fused.b_K.zero_()
    att = fused if cls is FusedAttention else split(fused)
    tg = tags(B, T, h, d)
    with torch.no_grad():
        K, _ = att.keys_values(_as_columns(tg))  # (B, h, T, d)
    return torch.equal(K, tg.permute(0, 2, 1, 3))


def _fuse_split_case(h: int, d_k: int, d_v: int) -> bool:
    d_model = 3
    per_head = PerHeadAttention(d_model, h, d_k=d_k, d_v=d_v).double()
    widths = {"W_Q": d_k, "W_K": d_k, "W_V": d_v, "W_O": d_model, "b_Q": d_k, "b_K": d_k, "b_V": d_v}
    wants = {}
    with torch.no_grad():
        for p, (name, width) in enumerate(widths.items()):
            matrix = name.startswith("W")
            tg = tags(p + 1, (d_v if name == "W_O" else d_model) if matrix else 1, h, width)[p]  # (rows, h, width)
            for i, block in enumerate(getattr(per_head, name)):
                block.copy_(tg[:, i] if matrix else tg[0, i])  # head i's block: tag(p, r, i, c)
            # W_O: row i*d_v + r holds tag(p, r, i, c) (row blocks); the others: column i*d + c (column blocks)
            want = torch.cat([tg[:, i] for i in range(h)], dim=0 if name == "W_O" else 1)
            wants[name] = want if matrix else want[0]
        assert per_head.b_O is not None  # built with biases
        per_head.b_O.copy_(tags(8, 1, 1, d_model)[7, 0, 0])
    fused = fuse(per_head)
    ok = all(torch.equal(getattr(fused, name), want) for name, want in wants.items())
    ok &= fused.b_O is not None and torch.equal(fused.b_O, per_head.b_O)
    back = split(fused)
    return ok and all(torch.equal(a, b) for a, b in zip(per_head.parameters(), back.parameters(), strict=True))


def tracer_checks(progress: bool = False, sizes: dict | None = None) -> list[CheckResult]:
    """Part 2: the real code's index moves, exactly, for every size of `sizes` (default TRACER_SIZES)."""
    sizes = TRACER_SIZES if sizes is None else sizes
    hs, ds, BTs = sizes["h"], sizes["d"], sizes["BT"]
    forms, product = (PerHeadAttention, FusedAttention), itertools.product
    checks: dict[str, list[tuple[Callable[..., bool], tuple]]] = {
        "FusedAttention._heads: head i = column block i (with and without bias)": [
            (_heads_case, (h, d, B, T)) for h, d, (B, T) in product(hs, ds, BTs)
        ],
        "whole forward of both forms, identity weights: every tag returns to its place (concatenation in _attend)": [
            (_forward_case, (cls, h, d_k, d_v, B, T)) for cls, h, d_k, d_v, (B, T) in product(forms, hs, ds, ds, BTs)
        ],
        "keys_values of both forms: (B, h, T, d_k), head i = block i": [
            (_keys_case, (cls, h, d, B, T)) for cls, h, d, (B, T) in product(forms, hs, ds, BTs)
        ],
        "fuse puts head i's entries in block i (W_O: row block i); split puts every entry back": [
            (_fuse_split_case, args) for args in product(hs, ds, ds)
        ],
    }
    rows = []
    bar = tqdm(total=sum(map(len, checks.values())), desc="tracers", leave=False, disable=not progress, file=sys.stderr)
    for what, cases in checks.items():
        failed = []
        for fn, args in cases:
            if not fn(*args):
                failed.append(args)
            bar.update(1)
        notes = [f"{what}: fails for {len(failed)} sizes, e.g. {failed[:3]}"] if failed else []
        rows.append(CheckResult.holds(what, len(cases), not failed, notes))
    bar.close()
    rows[0].notes.append(f"tracer sizes: {sizes_text(sizes)}")
    return rows


# %% [markdown]
# ## 3. Exact: the whole function, where floating point is exact
#
# Parts 1 and 2 check the pieces; here the whole function runs, masks, biases
# and all, in both forms (each with the SDPA kernel and with the explicit
# softmax) and in `nn.MultiheadAttention` (via `to_torch_mha`), on inputs
# where floating point makes no rounding error at all, so the results must be
# **bit-identical**: inputs, weights and biases are small integers (`-3..3`),
# so every product and sum of the projections is an exact integer in float64;
# the mask leaves each query exactly one visible key (drawn at random), so
# each softmax is exactly one-hot (`exp(0) = 1`, and `0` for the blocked
# keys), and the probabilities must be exactly the mask; dropout is off. Then
# every remaining operation is an exact integer sum. How the forms round a
# softmax that is not one-hot is part 4's, with a tolerance.


# %%
def exact_cases(n: int = 200, seed: int = 0) -> list[dict]:
    """n cases: h in 1..4, d_k = d_v in 1..3, B in 1..3, T_q, T_k in 1..5, bias or not, self or cross."""
    gen = torch.Generator().manual_seed(seed)
    pick = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=gen))
    out = []
    for k in range(n):
        h, d, cross, T_q, B = pick(1, 4), pick(1, 3), bool(k % 2), pick(1, 5), pick(1, 3)  # drawn in this order
        T_k = pick(1, 5) if cross else T_q
        out.append(dict(h=h, d=d, B=B, T_q=T_q, T_k=T_k, bias=bool(pick(0, 1)), cross=cross, seed=k))
    return out


def _integers(shape, gen) -> Tensor:
    return torch.randint(-3, 4, shape, generator=gen).double()


def compare_exactly(case: dict) -> tuple[float, bool]:
    """(largest |difference| between any two of the five results, probabilities exactly the mask)."""
    h, d, B, T_q, T_k = case["h"], case["d"], case["B"], case["T_q"], case["T_k"]
    gen = torch.Generator().manual_seed(case["seed"])
    fused = FusedAttention(h * d, h, bias=case["bias"]).double().eval()
    with torch.no_grad():
        for p in fused.parameters():
            p.copy_(_integers(p.shape, gen))
    per_head, mha = split(fused), to_torch_mha(fused).eval()
    x_q = _integers((B, T_q, h * d), gen)
    x_kv = _integers((B, T_k, h * d), gen) if case["cross"] else x_q
    visible = torch.randint(0, T_k, (B, T_q), generator=gen)  # (B, T_q): the one key each query sees
    mask = torch.nn.functional.one_hot(visible, T_k).bool()  # (B, T_q, T_k)
    results, probs = [], []
    with torch.no_grad():
        for att in (per_head, fused):
            for flag in (True, False):
                with fast_path(flag):
                    results.append(att(x_q, x_kv, mask))
            probs.append(attend_with_probabilities(att, x_q, x_kv, mask)[1])
        attn_mask, key_padding_mask = torch_mha_masks(mask, B, h)  # (T_q = 1: a padding-shaped mask)
        results.append(
            mha(x_q, x_kv, x_kv, attn_mask=attn_mask, key_padding_mask=key_padding_mask, need_weights=False)[0]
        )
    worst = max(max_abs(r, results[0]) for r in results)
    one_hot = all(torch.equal(p, mask.unsqueeze(1).expand_as(p).double()) for p in probs)
    return worst, one_hot


def check_exact_whole(n: int = 200, progress: bool = False) -> list[CheckResult]:
    cases = exact_cases(n)
    worst, all_one_hot = 0.0, True
    for case in tqdm(cases, desc="exact whole function", leave=False, disable=not progress, file=sys.stderr):
        d, one_hot = compare_exactly(case)
        worst, all_one_hot = nanmax([worst, d]), all_one_hot and one_hot
    check = "per-head (SDPA, explicit) = fused (SDPA, explicit) = nn.MultiheadAttention, bit for bit"
    row = CheckResult.of(check, len(cases), worst, 0.0)
    row.passed &= all_one_hot
    row.notes.append(
        f"exact whole function: {len(cases)} cases with integer inputs, weights and biases and one "
        f"visible key per query (h = 1..4, d_k = d_v = 1..3, self- and cross-attention, bias on and "
        f"off); probabilities exactly the mask: {'yes' if all_one_hot else 'NO'}"
    )
    return [row]


# %% [markdown]
# ## 4. Numerical: generated cases, PyTorch's module, both kernels, whole models
#
# The rest compares the forms on ordinary floating-point inputs, where steps 1
# and 4 are still identities of real numbers but the two forms add the same
# products in different orders (one product over `h*d` columns, or `h`
# products and a sum), so results may differ by rounding. The tolerances
# bound that, far below any real difference: float64 `1e-12`, float32 `1e-5`.
# Rounding grows with the size of a number (a float32 number of size `L` has
# an ulp of about `L * 1.2e-7`), and a generated case's gradients can reach
# well above 1 (`test_float32_differences_are_scaled_by_the_size_of_the_values`),
# so the generated checks compare `max |a - b| / max(1, max |a|)`: absolute
# for values up to 1, relative above (`max_scaled` in
# `annotated/proof/harness.py`), the rule of the whole models' float32 logits
# below too. The report gives, for each row, the number of cases, the worst
# difference seen and the tolerance.
#
# ### Generated cases
#
# Hypothesis draws the cases: batch size, query and key lengths (1 included),
# `d_model`, `h` (with `h = 1` and `h = d_model` drawn on purpose), `d_k` and
# `d_v` chosen freely (the forms do not need `h * d_k = d_model`), self- or
# cross-attention, a random padding mask (which can block *every* key of a
# sentence: both forms must then return zeros), a causal mask, bias on or
# off (non-zero biases, so that they matter), float64 or float32, and which
# form is built first (the other is made by `fuse` or `split`). For each case
# we compare the outputs, the probabilities (`attend_with_probabilities`) and
# the gradients of `sum(out * G)` (a random `G`) with respect to the inputs
# and to every parameter, the per-head gradients laid out in blocks by
# `fused_parameters` (`annotated/proof/torch_mha.py`); the modules run in
# training mode with dropout 0, so that gradients flow. `derandomize=True`
# fixes Hypothesis' seed: every run checks the same cases, and a failure is
# reproducible with the falsifying case it prints.


# %%
def check_forms(examples: int = 300, progress: bool = False) -> list[CheckResult]:
    """Per-head vs fused on `examples` generated cases (outputs, probabilities, gradients)."""
    return run_property("per-head = fused", attention_cases(), compare_forms, examples, progress)


# %% [markdown]
# ### Against `torch.nn.MultiheadAttention`
#
# `annotated/proof/torch_mha.py` converts our attentions to PyTorch's module
# and back. Every combination of `mha_cases` (`d_model = 8` with `h = 2, 4`
# and `d_model = 6` with `h = 3`, bias or not, `batch_first` or not, self- or
# cross-attention, five mask set-ups, weights asked or not) runs in three
# modes: training with dropout 0 (gradients compared too), eval with its fast
# path off, and eval with it on. Every query keeps a visible key: with none,
# `nn.MultiheadAttention` returns NaN and ours zeros.
#
# In eval mode `nn.MultiheadAttention` may skip its Python code for one fused
# C++ kernel, `torch._native_multi_head_attention`, but only when *all* of
# these hold (read from its source in torch 2.13): the fast path enabled
# (`torch.backends.mha.set_fastpath_enabled`, the default); batched 3-D inputs
# with `batch_first=True`; query, key and value *the same tensor object*;
# eval mode; no autograd; an even number of heads; biases; no
# `add_bias_kv`/`add_zero_attn`; `kdim = vdim = embed_dim`; no autocast.
# Otherwise it silently takes the slow path, so a test that merely sets the
# flag proves nothing. The "eval, fast path on" cases that meet every
# condition (`MhaCase.fast_path_expected`) run under a `TorchDispatchMode`
# that records the aten operators: the check requires
# `aten._native_multi_head_attention` in every such case, and in no case
# with the fast path off. The flag is restored afterwards.


# %%
def check_torch_mha(progress: bool = False) -> list[CheckResult]:
    """Our attentions vs nn.MultiheadAttention, in each mode; conversions round-trip bit-identically."""
    cases = tqdm(mha_cases(), desc="nn.MultiheadAttention", leave=False, disable=not progress, file=sys.stderr)
    results = [(c, compare_with_torch_mha(c, seed=k)) for k, c in enumerate(cases)]
    rows = []
    for mode in MHA_MODES:
        mine = [(c, r) for c, r in results if c.mode == mode]
        diffs = [r[q] for _, r in mine for q in ("output", "weights", "grad") if q in r]
        what = "outputs, per-head weights" + (", gradients" if mode.startswith("train") else "")
        row = CheckResult.of(f"nn.MultiheadAttention, {mode}: {what}", len(mine), nanmax(diffs), TOL[torch.float64])
        if mode == "eval, fast path on":
            ran = [r["native kernel ran"] for c, r in mine if c.fast_path_expected]
            row.notes.append(
                f"nn.MultiheadAttention, fast path on: its native kernel ran in {sum(ran)} of {len(ran)} cases "
                f"meeting all the fast path's conditions (self-attention, batch_first, even h, bias, eval, no grad)"
            )
            row.passed &= len(ran) > 0 and all(ran)
        elif mode == "eval, fast path off":
            ran = [r["native kernel ran"] for _, r in mine]
            row.notes.append(
                f"nn.MultiheadAttention, fast path off: its native kernel ran in {sum(ran)} of {len(ran)} cases"
            )
            row.passed &= not any(ran)
        rows.append(row)
    trips = [r["roundtrip"] for _, r in results]
    return rows + [
        CheckResult.holds("ours -> nn.MultiheadAttention -> ours: bit-identical parameters", len(trips), all(trips))
    ]


# %% [markdown]
# ### Two kernels, and whole models
#
# **SDPA vs explicit softmax.** `attention()` runs PyTorch's fused
# `scaled_dot_product_attention` when `transformer.FAST_PATH` is on, else the
# explicit `softmax(Q K^T / sqrt(d_k)) V`. On generated cases (fully masked
# queries included) both forms must give the same outputs and input
# gradients either way; the flag is restored afterwards.
#
# **Whole models.** A model built with per-head attention and its
# `convert_model(model, "fused")` copy must give the same logits under
# teacher forcing and the same greedy decodes. We check a copy-task model
# trained for a few steps (`train_copy_task(attention="per_head")`): the
# decodes need not be good, only equal, and training makes the logits less
# uniform than at initialisation, so near-ties in the argmax are rare.
# Logits are compared in float32 (as trained) and float64, decodes in
# float32. `--checkpoint PATH` runs the same comparison on a trained
# translation checkpoint. A trained model's logits reach about 10, and the
# rounding of every attention of both stacks ends up in them scaled by their
# size; so float32 logits are compared with `1e-5 * max(1, max |logit|)`,
# float64 logits at `1e-12` absolute.


# %%
def check_sdpa_paths(examples: int = 100, progress: bool = False) -> list[CheckResult]:
    return run_property("SDPA path = explicit path", attention_cases(), compare_paths, examples, progress)


def compare_model_forms(model: transformer.EncoderDecoder, src: Tensor, tgt: Tensor, max_len: int) -> dict:
    """Convert `model` to the other attention form; compare logits (float32, float64) and greedy decodes."""
    check_source_and_target(model, src, tgt)  # the door, before any model work
    other: transformer.AttentionForm = "fused" if model.config.attention == "per_head" else "per_head"
    a = copy.deepcopy(model).eval()  # the caller's model keeps its dtype and mode
    b = convert_model(a, other).eval()
    src_mask, tgt_mask = padding_mask(src, PAD), target_mask(tgt, PAD)
    res: dict[Any, Any] = {}
    with torch.no_grad():
        for dtype in (torch.float32, torch.float64):
            ma, mb = a.to(dtype), b.to(dtype)
            la, lb = ma(src, tgt, src_mask, tgt_mask), mb(src, tgt, src_mask, tgt_mask)
            scale = 1.0 if dtype == torch.float64 else max(1.0, la.abs().max().item())  # float32: relative
            res[dtype] = (max_abs(la, lb), TOL[dtype] * scale)
        a, b = a.float(), b.float()
    da, db = (greedy_decode(m, src, src_mask, max_len, BOS, EOS, PAD) for m in (a, b))
    width = max(da.size(1), db.size(1))
    da, db = (torch.nn.functional.pad(d, (0, width - d.size(1)), value=PAD) for d in (da, db))
    res["tokens differing"], res["sentences"] = int((da != db).sum()), src.size(0)
    return res


def _model_rows(name: str, res: dict) -> list[CheckResult]:
    n = res["sentences"]
    rows = [
        CheckResult.of(f"{name}: logits, per-head = fused, {dtype_name(dt)}", n, *res[dt])
        for dt in (torch.float64, torch.float32)
    ]
    rows[1].notes.append(
        f"{name}: the float32 logits tolerance is relative, 1e-5 x the largest |logit| "
        f"({res[torch.float32][1] / TOL[torch.float32]:.1f}), see section 4"
    )
    differing = float(res["tokens differing"])
    return rows + [CheckResult.of(f"{name}: greedy decodes identical (tokens differing)", n, differing, 0.0)]


def check_copy_model(
    steps: int = 150, batch_size: int = 64, sentences: int = 500, seed: int = 0, progress: bool = False
) -> list[CheckResult]:
    """A per-head copy-task model (briefly trained) vs its fused conversion."""
    if progress:
        print(f"training the copy-task model ({steps} steps)", file=sys.stderr, flush=True)
    model = transformer.train_copy_task(attention="per_head", steps=steps, batch_size=batch_size, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    src, tgt = transformer.copy_batch(sentences, 10, model.config.src_vocab, gen)
    rows = _model_rows(f"copy-task model ({steps} steps)", compare_model_forms(model, src, tgt[:, :-1], max_len=11))
    exact = transformer.copy_accuracy(model, sentences, seed + 1)  # the same sentences, decoded the same way
    rows[-1].notes.append(
        f"copy-task model: it copies {exact:.0%} of the {sentences} sentences exactly, so the "
        f"decodes are not trivial; both forms produce the same ones"
    )
    return rows


def check_checkpoint(path: str, sentences: int = 64, seed: int = 0) -> list[CheckResult]:
    """A trained checkpoint vs its conversion to the other form, on random source and target ids.

    A file that does not load gives one failing row whose note is the loader's error (it names the file).
    """
    from annotated.checkpoint import load_checkpoint  # lazily: only this check needs it

    try:
        model, _tokenizer, _meta = load_checkpoint(path)
    except (OSError, ValueError) as e:
        return [CheckResult.holds(f"checkpoint {path}: loads", 0, False, [f"{type(e).__name__}: {e}"])]
    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    S = T = min(20, cfg.max_len)
    src = torch.randint(4, cfg.src_vocab, (sentences, S), generator=gen)  # (n, S) ids past pad/bos/eos/unk
    lengths = torch.randint(1, S + 1, (sentences,), generator=gen)
    src = src.masked_fill(torch.arange(S) >= lengths[:, None], PAD)  # (n, S) with padding
    words = torch.randint(4, cfg.tgt_vocab, (sentences, T - 1), generator=gen)  # (n, T - 1)
    tgt = torch.cat([torch.full((sentences, 1), BOS), words], dim=1)  # (n, T)
    res = compare_model_forms(model, src, tgt, max_len=min(30, cfg.max_len))
    return _model_rows(f"checkpoint {path}", res)


# %% [markdown]
# ## 5. The report
#
# One table row per check, under the heading of its part, which says what
# kind of evidence it is; `main` exits with status 1 if any check failed.

# %%
PARTS = {
    "symbolic": "1. symbolic, all sizes",
    "tracers": "2. exact on the real code, {sizes}",
    "exact": "3. exact, the whole function, bit for bit",
    "numerical": "4. numerical, generated and enumerated cases: worst difference against the tolerance",
}


def run_checks(
    examples: int = 300,
    copy_steps: int = 150,
    checkpoint: str | None = None,
    progress: bool = False,
):
    """All checks, each row tagged with its part. Returns (results, identities)."""
    sym, identities = check_symbolic()
    parts = {
        "symbolic": [sym],
        "tracers": tracer_checks(progress),
        "exact": check_exact_whole(progress=progress),
        "numerical": check_forms(examples, progress)
        + check_torch_mha(progress)
        + check_sdpa_paths(progress=progress)
        + check_copy_model(steps=copy_steps, progress=progress)
        + ([] if checkpoint is None else check_checkpoint(checkpoint)),
    }
    for part, rows in parts.items():
        for r in rows:
            r.part = part
    return [r for rows in parts.values() for r in rows], identities


def _fmt(x: float) -> str:
    if math.isnan(x) or math.isinf(x):
        return str(x)
    return "0" if x == 0 else f"{x:.1e}"


def format_report(results: list[CheckResult], identities: list[tuple[str, str, bool]]) -> str:
    lines = [
        "Per-head and fused multi-head attention: equivalence report",
        f"torch {torch.__version__}, sympy {sympy.__version__}, hypothesis {hypothesis.__version__}",
        "",
        f"Part {PARTS['symbolic']}: block identities of proof steps 1 and 4 (sympy MatrixSymbol/BlockMatrix, "
        f"T, d_model, d_k, d_v symbols):",
    ]
    for reach, group in itertools.groupby(identities, key=lambda row: row[0]):
        lines += [f"  {reach}:"] + [f"    {identity}: {'holds' if holds else 'FAILS'}" for _, identity, holds in group]
    lines.append("")
    sizes = sizes_text(TRACER_SIZES)
    header = ("check", "cases", "max diff", "tolerance", "result")
    tol = lambda r: "exact" if r.tol == 0 else f"{r.tol:.0e}"
    table = [(r.check, str(r.cases), _fmt(r.max_diff), tol(r), "pass" if r.passed else "FAIL") for r in results]
    widths = [max(len(row[i]) for row in table + [header]) for i in range(5)]
    fmt = lambda row: " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
    lines += [fmt(header), "-+-".join("-" * w for w in widths)]
    for part, rows in itertools.groupby(zip(results, table), key=lambda pair: pair[0].part):
        lines += [f"Part {PARTS.get(part, part).format(sizes=sizes)}:"] + [fmt(row) for _, row in rows]
    lines.append("max diff: the largest |a - b|; in the generated (Hypothesis) checks divided by max(1, largest |a|)")
    notes = [
        textwrap.fill(n, width=110, initial_indent="  - ", subsequent_indent="    ") for r in results for n in r.notes
    ]
    if notes:
        lines += ["", "Notes:"] + notes
    failed = sum(not r.passed for r in results)
    lines += [
        "",
        f"{len(results) - failed} of {len(results)} checks passed." + ("" if not failed else f" {failed} FAILED."),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    door = Door(__file__)
    ap = door.parser(description="Prove that per-head and fused attention are the same function.")
    door.checkpoint_options(
        ap,
        languages=False,
        help="also compare both forms of a trained checkpoint (a .pt file, or shipped:de-en / shipped:en-de for a "
        "model shipped in the package)",
    )
    ap.add_argument("--examples", type=at_least(1), default=300, help="Hypothesis cases for per-head vs fused")
    ap.add_argument("--copy-steps", type=at_least(1), default=150, help="training steps of the copy-task model")
    args = ap.parse_args(argv)
    checkpoint = door.given_checkpoint(args)  # a shipped model by name or path: found and its sha256 checked
    # Every tensor here is tiny: one thread is as fast, and is not slowed down by other busy processes.
    torch.set_num_threads(1)
    results, identities = run_checks(
        args.examples,
        copy_steps=args.copy_steps,
        checkpoint=None if checkpoint is None else str(checkpoint),
        progress=True,
    )
    print(format_report(results, identities))
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    from annotated.plumbing.scripts import run_main

    run_main(main)
