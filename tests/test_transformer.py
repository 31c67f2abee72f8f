"""The claims of annotated/transformer.py, one test each.

Tolerances: float64 results of the two attention forms differ only by the
order of floating-point additions (one matmul over h*d columns vs h matmuls
and a sum), which moves the result by a few ulps of values of order 1, far
below 1e-12. float32 ulps are about 1e-7; 1e-5 leaves room for the same
reordering over sums of up to a few hundred terms.
"""

import math

import pytest
import torch

from annotated import transformer
from annotated.checks import check_token_ids
from annotated.decoding.search import beam_search, greedy
from annotated.recording import attend_with_probabilities, record_attention
from annotated.tokens import BOS, EOS, PAD
from annotated.transformer import (
    BLOCKS,
    FusedAttention,
    PerHeadAttention,
    TransformerConfig,
    convert_model,
    fuse,
    greedy_decode,
    head_blocks,
    make_model,
    padding_mask,
    split,
    subsequent_mask,
    target_mask,
)

TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


def random_biases(module, gen):
    """Fresh modules have zero biases; make them non-zero so the tests see them."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if ".b_" in f".{name}" or name.startswith("b_"):
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))


def pair(d_model=12, h=3, d_k=None, d_v=None, bias=True, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    ph = PerHeadAttention(d_model, h, d_k, d_v, bias=bias).to(dtype)
    random_biases(ph, torch.Generator().manual_seed(seed))
    return ph, fuse(ph)


def random_mask(B, T_q, T_k, gen):
    pad = torch.rand(B, 1, T_k, generator=gen) > 0.3
    pad[:, :, 0] = True  # at least one real key per sentence
    return pad


# --- attention --------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("kind", ["self", "cross", "causal"])
def test_per_head_and_fused_agree(dtype, bias, kind):
    ph, fu = pair(d_model=12, h=3, d_k=5, d_v=7, bias=bias, dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    B, T_q = 3, 6
    T_k = 4 if kind == "cross" else T_q
    x = torch.randn(B, T_q, 12, generator=gen, dtype=dtype)
    m = torch.randn(B, T_k, 12, generator=gen, dtype=dtype) if kind == "cross" else x
    mask = random_mask(B, T_q, T_k, gen)
    if kind == "causal":
        mask = mask & subsequent_mask(T_q)
    out_ph, p_ph = attend_with_probabilities(ph, x, m, mask)
    out_fu, p_fu = attend_with_probabilities(fu, x, m, mask)
    assert out_ph.shape == out_fu.shape == (B, T_q, 12)
    assert p_ph.shape == p_fu.shape == (B, 3, T_q, T_k)
    assert (out_ph - out_fu).abs().max() <= TOL[dtype]
    assert (p_ph - p_fu).abs().max() <= TOL[dtype]


@pytest.mark.parametrize("cls", [PerHeadAttention, FusedAttention])
def test_sdpa_path_matches_explicit_path(cls, fast_path):
    torch.manual_seed(0)
    att = cls(16, 4).double()
    random_biases(att, torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 5, 16, generator=gen, dtype=torch.float64)
    mask = random_mask(2, 5, 5, gen) & subsequent_mask(5)
    fast_path(True)
    fast = att(x, x, mask)
    fast_path(False)
    slow = att(x, x, mask)
    assert (fast - slow).abs().max() <= 1e-12


def test_attention_weights_are_a_distribution_over_allowed_keys():
    ph, _ = pair()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 12, generator=gen, dtype=torch.float64)
    mask = random_mask(2, 5, 5, gen)
    _, p = attend_with_probabilities(ph, x, x, mask)
    assert torch.all(p[~mask.unsqueeze(1).expand_as(p)] == 0)  # blocked keys: exactly 0
    assert torch.allclose(p.sum(-1), torch.ones(2, 3, 5, dtype=torch.float64))


def test_fast_path_switches_and_restores(monkeypatch):
    real, calls = transformer.attention_explicit, []
    monkeypatch.setattr(transformer, "attention_explicit", lambda *a, **k: calls.append(1) or real(*a, **k))
    q = k = v = torch.randn(1, 3, 4)
    before = transformer.FAST_PATH
    with transformer.fast_path(not before):
        assert transformer.FAST_PATH is (not before)
        with transformer.fast_path(False):
            transformer.attention(q, k, v)  # the explicit form
        assert transformer.FAST_PATH is (not before)
    assert transformer.FAST_PATH is before and calls == [1]
    with transformer.fast_path(True):
        transformer.attention(q, k, v)  # SDPA: the explicit form is not called
    assert calls == [1]
    with pytest.raises(RuntimeError), transformer.fast_path(not before):
        raise RuntimeError("the switch is restored even after an error")
    assert transformer.FAST_PATH is before


def test_sdpa_is_safe_everywhere_but_a_backward_pass_on_cuda_with_a_mask():
    mask = torch.ones(3, 3, dtype=torch.bool)
    q = torch.randn(1, 3, 4, requires_grad=True)
    assert transformer.sdpa_is_safe(q, mask) and transformer.sdpa_is_safe(q, None)  # the CPU keeps SDPA
    if torch.cuda.is_available():
        q_gpu, mask_gpu = q.detach().cuda().requires_grad_(), mask.cuda()
        assert not transformer.sdpa_is_safe(q_gpu, mask_gpu)
        assert transformer.sdpa_is_safe(q_gpu, None) and transformer.sdpa_is_safe(q_gpu.detach(), mask_gpu)
        with torch.no_grad():
            assert transformer.sdpa_is_safe(q_gpu, mask_gpu)


def test_attention_takes_the_explicit_way_where_sdpa_is_unsafe(monkeypatch):
    real, calls = transformer.attention_explicit, []
    monkeypatch.setattr(transformer, "attention_explicit", lambda *a, **k: calls.append(1) or real(*a, **k))
    q = k = v = torch.randn(1, 3, 4)
    mask = torch.tensor([True, True, False])
    with transformer.fast_path(True):
        fast = transformer.attention(q, k, v, mask)  # SDPA
        assert calls == []
        monkeypatch.setattr(transformer, "sdpa_is_safe", lambda q, mask: False)
        explicit = transformer.attention(q, k, v, mask)
    assert calls == [1] and (fast - explicit).abs().max() <= 1e-6


def test_an_attention_form_must_provide_the_interface():
    class NoAttend(transformer._Attention):  # queries and keys_values, but not _attend
        def queries(self, x_q):
            return x_q

        def keys_values(self, x_kv):
            return x_kv, x_kv

    with pytest.raises(TypeError, match="_attend"):
        NoAttend(8, 2)
    for cls in (PerHeadAttention, FusedAttention):
        assert issubclass(cls, transformer._Attention) and not cls.__abstractmethods__
    assert transformer._Attention.__abstractmethods__ == {"queries", "keys_values", "_attend"}


@pytest.mark.parametrize("fast", [True, False])
def test_fully_masked_query_gives_zeros(fast, fast_path):
    fast_path(fast)
    q = torch.randn(1, 3, 4)
    k = v = torch.randn(1, 5, 4)
    mask = torch.ones(1, 3, 5, dtype=torch.bool)
    mask[0, 1] = False  # query 1 may attend to nothing
    out = transformer.attention(q, k, v, mask)
    _, p = transformer.attention_explicit(q, k, v, mask)
    assert torch.all(out[0, 1] == 0) and torch.all(p[0, 1] == 0)
    assert not torch.isnan(out).any()
    assert torch.all(out[0, 0] != 0)
    # the prose's example: an all-padding source sentence; its queries see no key, in the encoder and across
    torch.manual_seed(0)
    m = make_model(small_config()).eval()
    src = torch.tensor([[5, 6, 7], [PAD, PAD, PAD]])
    tgt = torch.tensor([[BOS, 4], [BOS, 4]])
    src_mask = padding_mask(src, PAD)
    with torch.no_grad(), record_attention(m) as probs:
        memory = m.encode(src, src_mask)
        y = m.decode(memory, src_mask, tgt, target_mask(tgt, PAD))
    assert torch.isfinite(memory).all() and torch.isfinite(y).all()
    enc_and_cross = [probs[kind, l][0] for kind in ("enc_self", "cross") for l in range(2)]
    assert all(torch.all(p[1] == 0) and torch.all(p[0].sum(-1) > 0.999) for p in enc_and_cross)


@pytest.mark.parametrize("fast", [True, False])
def test_scaling_keeps_score_variance_at_one(fast, fast_path):
    """attention() divides q.k by sqrt(d_k): its scores have variance 1 for unit-variance q and k.

    With two keys and values e_1, e_2, the output is the probabilities, and log(p_1 / p_2) = s_1 - s_2,
    whose variance is 2 var(s) for independent scores. 50,000 queries: the sample variance of a variance-2
    normal quantity is within 0.1 of 2 by about 8 standard errors. A scale of 1/d_k or none fails by far.
    """
    fast_path(fast)  # the SDPA kernel and the explicit form
    gen = torch.Generator().manual_seed(0)
    n = 50_000
    v = torch.eye(2, dtype=torch.float64).expand(n, 2, 2)  # (n, T_k=2, d_v=2)
    for d_k in (16, 64, 256):
        q = torch.randn(n, 1, d_k, generator=gen, dtype=torch.float64)  # (n, 1, d_k)
        k = torch.randn(n, 2, d_k, generator=gen, dtype=torch.float64)  # (n, 2, d_k)
        out = transformer.attention(q, k, v)  # (n, 1, 2): the two probabilities
        diff = out[:, 0, 0].log() - out[:, 0, 1].log()  # s_1 - s_2
        assert abs(diff.var().item() / 2 - 1) < 0.05, d_k


def _score_cycles(p):
    """For probabilities p (T, T) of scores S: S_ij - S_ji + S_jk - S_kj + S_ki - S_ik for all i, j, k.

    log p_ij = S_ij - c_i with an unknown row constant c_i, which cancels around a cycle; the sums are all
    zero iff S is symmetric up to rounding."""
    L = p.log()
    A = L - L.T  # (T, T)
    return A[:, :, None] + A[None, :, :] + A.T[:, None, :]  # [i, j, k] = A_ij + A_jk + A_ki


def test_shared_query_key_matrix_gives_symmetric_scores():
    # Why W_Q and W_K both exist: with one matrix W, the scores X W (X W)^T / sqrt(d_k) are symmetric.
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(6, 8, generator=gen, dtype=torch.float64)
    W, W2 = (torch.randn(8, 4, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.eye(6, dtype=torch.float64)
    _, p_shared = transformer.attention_explicit(X @ W, X @ W, v)  # (6, 6)
    _, p_two = transformer.attention_explicit(X @ W, X @ W2, v)
    # attention_explicit() computes exactly softmax(Q K^T / sqrt(d_k)): a wrong scale fails here
    assert torch.allclose(p_shared, ((X @ W) @ (X @ W).T / 2.0).softmax(-1), atol=1e-12, rtol=0)
    assert torch.allclose(p_two, ((X @ W) @ (X @ W2).T / 2.0).softmax(-1), atol=1e-12, rtol=0)
    assert _score_cycles(p_shared).abs().max() < 1e-9  # symmetric scores
    assert _score_cycles(p_two).abs().max() > 1.0  # not symmetric
    assert torch.linalg.matrix_rank(W @ W2.T) == 4  # the bilinear form W_Q W_K^T has rank d_k, not d_model


@pytest.mark.parametrize("cls", [PerHeadAttention, FusedAttention])
def test_attention_ignores_the_order_of_keys_and_values(cls):
    att = cls(12, 3).double().eval()
    random_biases(att, torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(4)
    x, m = (
        torch.randn(2, 3, 12, generator=gen, dtype=torch.float64),
        torch.randn(2, 5, 12, generator=gen, dtype=torch.float64),
    )
    perm = torch.tensor([3, 0, 4, 1, 2])
    out, p = attend_with_probabilities(att, x, m)
    out_perm, p_perm = attend_with_probabilities(att, x, m[:, perm])  # keys and values permuted together
    assert (out - out_perm).abs().max() <= 1e-12
    assert (p[..., perm] - p_perm).abs().max() <= 1e-12  # each key keeps its weight (sums in another order)
    K, V = att.keys_values(m)  # permuting only the values does change the result
    out_v = att(x, kv=(K, V[:, :, perm]))
    assert (out - out_v).abs().max() > 1e-3


@pytest.mark.parametrize("cls", [PerHeadAttention, FusedAttention])
@pytest.mark.parametrize("fast", [True, False])
def test_attention_dropout_is_off_in_eval_mode(cls, fast, fast_path):
    """An attention with dropout 0.5 in eval mode is deterministic and equals the same weights at dropout 0."""
    fast_path(fast)
    torch.manual_seed(0)
    att = cls(12, 3, dropout=0.5).double()
    random_biases(att, torch.Generator().manual_seed(0))
    ref = cls(12, 3, dropout=0.0).double()
    ref.load_state_dict(att.state_dict())
    x = torch.randn(2, 6, 12, dtype=torch.float64)
    att.eval()
    a1, a2, r = att(x, x), att(x, x), ref(x, x)
    assert torch.equal(a1, a2) and (a1 - r).abs().max() <= 1e-12
    att.train()  # and dropout really is on in training
    assert not torch.equal(att(x, x), att(x, x))


@pytest.mark.parametrize("attention", ["fused", "per_head"])
def test_model_with_dropout_is_deterministic_in_eval_mode(attention):
    torch.manual_seed(0)
    m = make_model(small_config(attention=attention, dropout=0.3)).double().eval()
    ref = make_model(small_config(attention=attention, dropout=0.0)).double().eval()
    ref.load_state_dict(m.state_dict())
    src, tgt = model_inputs(m.config)
    args = (src, tgt, padding_mask(src, PAD), target_mask(tgt, PAD))
    assert torch.equal(m(*args), m(*args)) and (m(*args) - ref(*args)).abs().max() <= 1e-12


def test_attention_dropout_is_its_own_setting(fast_path):
    """`attention_dropout` reaches every attention (None: `dropout`'s value), the sublayers keep `dropout`, and
    at 0, in training, `scaled_dot_product_attention` runs its fused CPU kernel, while any dropout on the weights
    sends it to the unfused one (the prose's claim, from torch's own dispatch)."""
    from torch.profiler import profile

    fast_path(True)
    ps = lambda m: {a.dropout for a in m.modules() if isinstance(a, (FusedAttention, PerHeadAttention))}
    assert ps(make_model(small_config(dropout=0.3))) == {0.3}
    m = make_model(small_config(dropout=0.3, attention_dropout=0.0))
    assert ps(m) == {0.0} and {d.p for d in m.modules() if isinstance(d, torch.nn.Dropout)} == {0.3}
    with pytest.raises(ValueError, match="attention_dropout must be in"):
        small_config(attention_dropout=1.0)
    for p, kernel in (
        (0.0, "aten::_scaled_dot_product_flash_attention_for_cpu"),
        (0.1, "aten::_scaled_dot_product_attention_math"),
    ):
        m = make_model(small_config(dropout=0.1, attention_dropout=p)).train()
        src, tgt = model_inputs(m.config)
        with profile() as prof:
            m(src, tgt, padding_mask(src, PAD), target_mask(tgt, PAD)).sum().backward()
        ran = {e.key for e in prof.key_averages()}
        assert kernel in ran, (p, sorted(k for k in ran if "attention" in k))


def test_fast_dropout_keeps_each_entry_with_its_probability(fast_path):
    """On the fast path each entry, in each of the four 16-bit lanes of a 64-bit draw, is kept with probability
    1 - c/65536 (within 5 standard deviations over 250,000 draws per lane), survivors are scaled by
    65536/(65536 - c) so the mean is 1, the gradient is the same mask and scale, the mask repeats under a seed and
    not between calls; in evaluation it is the identity."""
    fast_path(True)
    n = 250_000
    for p in (0.1, 0.3, 0.5):
        c = round(p * 65536)
        q, scale = 1 - c / 65536, 65536 / (65536 - c)
        d = transformer.Dropout(p).train()
        x = torch.ones(4 * n, dtype=torch.float64, requires_grad=True)
        torch.manual_seed(0)
        y = d(x)
        assert set(y.unique().tolist()) == {0.0, scale}
        kept = (y != 0).double().view(n, 4).mean(dim=0)  # one share per lane
        assert (kept - q).abs().max() < 5 * math.sqrt(q * (1 - q) / n), (p, kept.tolist())
        assert abs(y.mean().item() - 1) < 5 * scale * math.sqrt(q * (1 - q) / (4 * n))
        y.sum().backward()
        assert torch.equal(x.grad, y.detach())
        torch.manual_seed(0)
        again, next_call = d(x), d(x)
        assert torch.equal(again, y) and not torch.equal(next_call, y)
        assert d.eval()(x) is x
    odd = transformer.Dropout(0.1).train()(torch.ones(3, 5, 7, dtype=torch.bfloat16))  # n not a multiple of 4
    assert odd.shape == (3, 5, 7) and set(odd.unique().tolist()) <= {0.0, torch.tensor(1 / 0.9).bfloat16().item()}


def test_fast_dropout_off_the_fast_path_is_torch_dropout(fast_path):
    """Off the fast path `Dropout` is `nn.Dropout` draw for draw; on it, the masks differ (the fast path ran)."""
    x, d = torch.randn(3, 7, 11), transformer.Dropout(0.3).train()
    torch.manual_seed(1)
    torchs = torch.nn.functional.dropout(x, 0.3, training=True)
    fast_path(False)
    torch.manual_seed(1)
    assert torch.equal(d(x), torchs)
    fast_path(True)
    torch.manual_seed(1)
    assert not torch.equal(d(x), torchs)


def test_per_head_parameters_are_rectangular():
    ph = PerHeadAttention(d_model=10, h=2, d_k=3, d_v=4)
    assert len(ph.W_Q) == len(ph.W_K) == len(ph.W_V) == len(ph.W_O) == 2
    assert tuple(ph.W_Q[0].shape) == tuple(ph.W_K[1].shape) == (10, 3)
    assert tuple(ph.W_V[0].shape) == (10, 4) and tuple(ph.W_O[0].shape) == (4, 10)
    fu = fuse(ph)
    assert tuple(fu.W_Q.shape) == (10, 6) and tuple(fu.W_V.shape) == (10, 8) and tuple(fu.W_O.shape) == (8, 10)


def test_fused_view_picks_out_column_block_i():
    ph, fu = pair(d_model=8, h=4, d_k=3, d_v=2)
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    Q = fu._heads(x, fu.W_Q, fu.b_Q, fu.d_k)  # (B, h, T, d_k)
    for i in range(4):
        assert torch.equal(Q[:, i], transformer.affine(x, fu.W_Q, fu.b_Q)[..., 3 * i : 3 * (i + 1)])  # exactly block i
        assert torch.allclose(Q[:, i], x @ ph.W_Q[i] + ph.b_Q[i], atol=1e-12, rtol=0)


@pytest.mark.parametrize("bias", [True, False])
def test_fuse_split_round_trip_is_bit_identical(bias):
    ph, fu = pair(d_model=12, h=4, d_k=2, d_v=5, bias=bias)
    back = split(fu)
    for (n1, a), (n2, b) in zip(ph.named_parameters(), back.named_parameters()):
        assert n1 == n2 and torch.equal(a, b)
    again = fuse(back)
    for (n1, a), (n2, b) in zip(fu.named_parameters(), again.named_parameters()):
        assert n1 == n2 and torch.equal(a, b)


@pytest.mark.parametrize("bias", [True, False])
def test_head_blocks_are_the_blocks_split_hands_each_head(bias):
    ph, fu = pair(d_model=12, h=4, d_k=2, d_v=5, bias=bias)
    for name in BLOCKS:
        if name.startswith("b_") and not bias:
            assert head_blocks(ph, name) is None and head_blocks(fu, name) is None
            continue
        stacked = head_blocks(fu, name)
        assert torch.equal(stacked, head_blocks(ph, name)) and stacked.size(0) == 4
        for i in range(4):
            assert torch.equal(stacked[i], getattr(ph, name)[i])  # head i's own matrix, bit for bit


@pytest.mark.parametrize("cls", [PerHeadAttention, FusedAttention])
def test_cost_of_h_heads_is_similar_to_one_full_width_head(cls, fast_path):
    """With d_k = d_v = d_model / h the matrix products cost exactly as many FLOPs for h = 8 as for h = 1;
    the softmax handles h times as many scores (the prose's "similar")."""
    from torch.utils.flop_counter import FlopCounterMode

    fast_path(False)  # count the explicit form's products
    flops, scores = {}, {}
    for h in (1, 8):
        att = cls(64, h).eval()
        x = torch.randn(2, 10, 64)
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            att(x, x)
        flops[h], scores[h] = counter.get_total_flops(), attend_with_probabilities(att, x, x)[1].numel()
    assert flops[1] == flops[8] > 0
    assert scores[8] == 8 * scores[1] == 8 * 2 * 10 * 10


def test_default_head_size_needs_divisible_d_model():
    with pytest.raises(ValueError, match="d_model=10 is not divisible by h=3"):
        FusedAttention(10, 3)
    assert FusedAttention(10, 3, d_k=4, d_v=4).W_Q.shape == (10, 12)


# --- the model --------------------------------------------------------------


def small_config(**kw):
    base = dict(src_vocab=17, tgt_vocab=19, N=2, d_model=16, d_ff=32, h=4, dropout=0.0, max_len=40)
    base.update(kw)
    return TransformerConfig(**base)


def model_inputs(cfg, B=3, S=7, T_len=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(3, cfg.src_vocab, (B, S), generator=gen)
    tgt = torch.randint(3, cfg.tgt_vocab, (B, T_len), generator=gen)
    src[0, -2:] = PAD  # some padding
    return src, tgt


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_whole_model_converts_between_forms(norm):
    torch.manual_seed(0)
    cfg = small_config(norm=norm, attention="per_head")
    m = make_model(cfg).double().eval()
    fm = convert_model(m, "fused")
    assert fm.config.attention == "fused"
    assert isinstance(fm.encoder.layers[0].self_attn, FusedAttention)
    src, tgt = model_inputs(cfg)
    a = m(src, tgt, padding_mask(src, PAD), target_mask(tgt, PAD))
    b = fm(src, tgt, padding_mask(src, PAD), target_mask(tgt, PAD))
    assert (a - b).abs().max() <= 1e-12
    back = convert_model(fm, "per_head")
    for (n1, p1), (n2, p2) in zip(m.named_parameters(), back.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)


@pytest.mark.parametrize("attention", ["per_head", "fused"])
def test_decoder_does_not_see_the_future(attention):
    """Changing target tokens after position t leaves outputs at <= t unchanged, for every t."""
    torch.manual_seed(0)
    cfg = small_config(attention=attention)
    m = make_model(cfg).double().eval()
    src, tgt = model_inputs(cfg, B=2, T_len=8)
    src_mask = padding_mask(src, PAD)
    memory = m.encode(src, src_mask)
    base = m.decode(memory, src_mask, tgt, target_mask(tgt, PAD))  # (B, T, d_model)
    gen = torch.Generator().manual_seed(5)
    for t in range(tgt.size(1) - 1):
        changed = tgt.clone()
        changed[:, t + 1 :] = torch.randint(3, cfg.tgt_vocab, changed[:, t + 1 :].shape, generator=gen)
        assert not torch.equal(changed, tgt)
        out = m.decode(memory, src_mask, changed, target_mask(changed, PAD))
        assert (
            torch.equal(out[:, : t + 1], base[:, : t + 1]) or (out[:, : t + 1] - base[:, : t + 1]).abs().max() <= 1e-12
        )
        assert (out[:, t + 1 :] - base[:, t + 1 :]).abs().max() > 1e-6  # the later ones did change


@pytest.mark.parametrize("attention", ["per_head", "fused"])
def test_appending_padding_changes_no_real_output(attention):
    torch.manual_seed(0)
    cfg = small_config(attention=attention)
    m = make_model(cfg).double().eval()
    src, tgt = model_inputs(cfg, B=2)
    logits = m(src, tgt, padding_mask(src, PAD), target_mask(tgt, PAD))
    src_p = torch.cat([src, torch.full((2, 4), PAD)], dim=1)
    tgt_p = torch.cat([tgt, torch.full((2, 3), PAD)], dim=1)
    logits_p = m(src_p, tgt_p, padding_mask(src_p, PAD), target_mask(tgt_p, PAD))
    assert (logits_p[:, : tgt.size(1)] - logits).abs().max() <= 1e-12


def test_norm_placement_matches_prose():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8)
    sub = lambda z: 2 * z + 1  # any sublayer
    post = transformer.Residual(8, 0.0, "post")
    pre = transformer.Residual(8, 0.0, "pre")
    assert torch.allclose(post(x, sub), post.ln(x + sub(x)))  # LayerNorm(x + Sublayer(x))
    assert torch.allclose(pre(x, sub), x + sub(pre.ln(x)))  # x + Sublayer(LayerNorm(x))
    assert isinstance(make_model(small_config(norm="post")).encoder.final_ln, torch.nn.Identity)
    assert isinstance(make_model(small_config(norm="pre")).decoder.final_ln, torch.nn.LayerNorm)


def test_embeddings_are_scaled_and_tied():
    torch.manual_seed(0)
    m = make_model(small_config(src_vocab=19, share_embeddings=True, tie_generator=True))
    assert m.src_embed is m.tgt_embed and m.generator.weight is m.tgt_embed.weight
    ids = torch.tensor([[3, 4]])
    assert torch.allclose(m.src_embed(ids), m.src_embed.weight[ids] * 4.0)  # sqrt(16)
    untied = make_model(small_config())
    assert untied.generator.weight is not untied.tgt_embed.weight
    assert untied.src_embed is not untied.tgt_embed


def test_the_table_gradient_is_the_same_on_two_threads_as_on_one():
    """`Embeddings` looks its rows up with F.embedding: on two threads its table's gradient is, bit for bit, the
    sum that indexing (`weight[tokens]`, what it did before) makes on one thread, adding each row's gradients in
    the order of the tokens; so runs on one thread give the numbers they gave before. The batch is large enough
    (2,000 tokens x 64 = 128,000 numbers, over PyTorch's 32,768) that both kernels split it between threads."""
    torch.manual_seed(0)
    emb = transformer.Embeddings(50, 64)  # 50 rows: each shared by about 40 tokens
    tokens = torch.randint(0, 50, (40, 50))  # (B, T)
    upstream = torch.randn(40, 50, 64)  # (B, T, d_model)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        (emb.weight[tokens] * 8.0).backward(upstream)  # sqrt(64)
        one_thread, emb.weight.grad = emb.weight.grad, None
        torch.set_num_threads(2)
        for _ in range(3):
            emb(tokens).backward(upstream)
            assert torch.equal(emb.weight.grad, one_thread)
            emb.weight.grad = None
    finally:
        torch.set_num_threads(threads)


def test_positional_encoding_formula():
    pe = transformer.sinusoidal_encoding(30, 8)
    pos, i = 17, 2
    assert math.isclose(pe[pos, 2 * i].item(), math.sin(pos / 10000 ** (2 * i / 8)), abs_tol=1e-6)
    assert math.isclose(pe[pos, 2 * i + 1].item(), math.cos(pos / 10000 ** (2 * i / 8)), abs_tol=1e-6)


@pytest.mark.parametrize("attention", ["per_head", "fused"])
def test_cached_decoding_equals_full_recomputation(attention):
    torch.manual_seed(0)
    cfg = small_config(attention=attention, src_vocab=19, tgt_vocab=19)
    m = make_model(cfg).double().eval()
    src, _ = model_inputs(cfg, B=4)
    mask = padding_mask(src, PAD)
    cached = greedy_decode(m, src, mask, max_len=12, bos=BOS, eos=EOS, pad=PAD, use_cache=True)
    full = greedy_decode(m, src, mask, max_len=12, bos=BOS, eos=EOS, pad=PAD, use_cache=False)
    assert torch.equal(cached, full)
    # and the cached decoder states equal the full ones, position by position
    tgt = torch.cat([torch.full((4, 1), BOS), full[:, :-1]], dim=1)
    memory = m.encode(src, mask)
    whole = m.decode(memory, mask, tgt, subsequent_mask(tgt.size(1)))
    cache = m.new_cache()
    steps = [m.decode(memory, mask, tgt[:, t : t + 1], None, cache=cache, start=t) for t in range(tgt.size(1))]
    assert (torch.cat(steps, dim=1) - whole).abs().max() <= 1e-12


class StepModel(torch.nn.Module):
    """A stand-in model for greedy_decode: sentence b emits the token 3 + t at step t until step len_b - 1,
    where it emits eos; after that it would go on emitting 3 + t, which greedy_decode must turn into pad."""

    def encode(self, src, src_mask):
        return (src != PAD).sum(1, keepdim=True).double().unsqueeze(-1)  # (B, 1, 1): the source length

    def new_cache(self):
        return [{}]

    def decode(self, memory, src_mask, tgt, tgt_mask, *, cache=None, start=0):
        pos = torch.arange(start, start + tgt.size(1), dtype=torch.float64).expand(tgt.size(0), -1)  # (B, T)
        return torch.stack([pos, memory[:, :, 0].expand_as(pos)], dim=-1)  # (B, T, 2): position, length

    def generator(self, y):
        pos, length = y[..., 0].long(), y[..., 1].long()  # (B,)
        token = torch.where(pos + 1 >= length, EOS, 3 + pos)  # (B,)
        return torch.nn.functional.one_hot(token, 20).double()  # (B, 20) logits


@pytest.mark.parametrize("use_cache", [True, False])
def test_greedy_decode_stops_each_sentence_at_eos(use_cache):
    src = torch.tensor([[5, PAD, PAD], [5, 6, 7], [5, 6, PAD]])  # lengths 1, 3, 2
    out = greedy_decode(StepModel(), src, None, max_len=10, bos=BOS, eos=EOS, pad=PAD, use_cache=use_cache)
    # each sentence stops at its own eos, pad after it, and decoding stops when the last one is done
    assert out.tolist() == [[EOS, PAD, PAD], [3, 4, EOS], [3, EOS, PAD]]
    out = greedy_decode(StepModel(), src, None, max_len=2, bos=BOS, eos=EOS, pad=PAD, use_cache=use_cache)
    assert out.tolist() == [[EOS, PAD], [3, 4], [3, EOS]]  # max_len cuts the sentence without eos


@pytest.mark.parametrize("attention", ["fused", "per_head"])
def test_cached_greedy_gives_the_tokens_of_recomputed_greedy(attention):
    """float32: cached and recomputed logits agree to rounding: within 8 machine epsilons of the largest logit (the
    prose's bound; the kernels' reduction order sets the exact figure, 1.6e-6 to 1.7e-6 on the CPUs tried).

    The token ids are compared exactly, and that holds on any CPU, not by luck: along the greedy path the best
    token's logit beats the runner-up's by more than twice that bound at every step (at least 5.4e-4 against
    3.8e-6 in these models), so no rounding of the logits within the bound can change an argmax. A near-tie
    would fail the margin check on every machine, rather than the id check on some."""
    for seed in range(3):
        torch.manual_seed(seed)
        m = make_model(
            src_vocab=50, tgt_vocab=50, N=2, d_model=64, d_ff=128, h=4, dropout=0.0, attention=attention
        ).eval()
        src, tgt = torch.randint(3, 50, (8, 12)), torch.randint(3, 50, (8, 10))
        mask = padding_mask(src, PAD)
        with torch.no_grad():
            memory = m.encode(src, mask)
            whole = m.generator(m.decode(memory, mask, tgt, subsequent_mask(10)))  # (8, 10, 50)
            cache = m.new_cache()
            steps = torch.cat(
                [m.generator(m.decode(memory, mask, tgt[:, t : t + 1], None, cache=cache, start=t)) for t in range(10)],
                dim=1,
            )  # (8, 10, 50)
        largest = whole.abs().max()
        bound = 8 * torch.finfo(torch.float32).eps * largest
        assert largest <= 4.5 and (whole - steps).abs().max() <= bound
        a = greedy_decode(m, src, mask, 10, BOS, EOS, PAD, use_cache=True)
        b = greedy_decode(m, src, mask, 10, BOS, EOS, PAD, use_cache=False)
        with torch.no_grad():  # the logits along a's path: each row's steps up to its eos
            path = torch.cat([torch.full((8, 1), BOS), a[:, :-1]], dim=1)  # (8, T)
            on_path = m.generator(m.decode(memory, mask, path, subsequent_mask(path.size(1))))  # (8, T, 50)
        best, runner_up = on_path.topk(2, dim=-1).values.unbind(-1)  # (8, T) each
        live = (a != PAD) & ((a == EOS).long().cumsum(1) - (a == EOS).long() == 0)  # up to the first eos
        assert (best - runner_up)[live].min() > 2 * bound  # no argmax within rounding of a tie
        assert torch.equal(a, b)


def test_config_rejects_bad_settings():
    with pytest.raises(ValueError, match="norm must be 'post' or 'pre'"):
        small_config(norm="middle")
    with pytest.raises(ValueError, match="attention must be 'fused' or 'per_head'"):
        small_config(attention="square")
    with pytest.raises(ValueError, match="share_embeddings needs src_vocab == tgt_vocab"):
        small_config(share_embeddings=True)
    with pytest.raises(ValueError, match="not divisible"):
        small_config(d_model=18)


def test_bad_token_ids_are_rejected_at_the_door():
    m = make_model(small_config(max_len=8)).eval()
    src = torch.tensor([[3, 4, 99]])
    check_token_ids(torch.tensor([[0, 16]]), 17)  # the whole range passes
    for bad, why in (
        (src, r"token ids must lie in \[0, 17\).*max 99"),
        (torch.tensor([[-1, 3]]), r"must lie in \[0, 17\).*min -1"),
        (torch.tensor([[3.0, 4.0]]), "int64 or int32 tensor of shape"),
        (torch.tensor([3, 4]), r"shape \(B, T\), got torch.int64 \(2,\)"),
    ):
        with pytest.raises(ValueError, match=why):
            check_token_ids(bad, 17)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 17\)"):  # the decoders' entry check
        greedy(m, src, None, 5)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 17\)"):
        beam_search(m, src, None, 5)


# --- the copy task ----------------------------------------------------------


@pytest.mark.parametrize("attention", ["fused", "per_head"])
def test_copy_task_learns_to_copy(attention):
    """Half the default steps (400, the last 100 cooling down), as the prose says: time the suite keeps."""
    model = transformer.train_copy_task(attention, steps=400)
    acc = transformer.copy_accuracy(model)
    print(f"copy task, {attention}: {acc:.1%}")
    assert acc >= 0.99


def test_the_copy_task_cools_down_over_the_last_quarter(monkeypatch):
    """The learning rates Adam applies in an 8-step copy run: the paper's rate(1..6), then 2/3 and 1/3 of
    rate(6) (the last round(0.25 x 8) = 2 steps), as cooled_rate gives them."""
    applied, adam_step = [], torch.optim.Adam.step

    def recording_step(self, *args, **kwargs):
        applied.append(self.param_groups[0]["lr"])
        return adam_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.Adam, "step", recording_step)
    transformer.train_copy_task(steps=8, batch_size=4, warmup=4)
    paper = [transformer.rate(n, 64, 4, 0.3) for n in range(1, 7)]
    assert applied == pytest.approx(paper + [paper[-1] * 2 / 3, paper[-1] / 3], rel=1e-12)


@pytest.mark.parametrize("cls", [PerHeadAttention, FusedAttention])
def test_key_bias_does_not_change_attention(cls):
    torch.manual_seed(0)
    att = cls(12, 3).double()
    random_biases(att, torch.Generator().manual_seed(0))
    x = torch.randn(2, 5, 12, dtype=torch.float64)
    mask = subsequent_mask(5)
    out, p = attend_with_probabilities(att, x, x, mask)
    with torch.no_grad():
        for name, b in att.named_parameters():
            if "b_K" in name:
                b.add_(torch.randn_like(b) * 10)
    out2, p2 = attend_with_probabilities(att, x, x, mask)
    assert (out - out2).abs().max() <= 1e-12 and (p - p2).abs().max() <= 1e-12
    out2.sum().backward()
    for name, b in att.named_parameters():
        if "b_K" in name:
            assert b.grad.abs().max() <= 1e-12  # zero up to rounding
        elif "W_Q" in name:
            assert b.grad.abs().max() > 1e-3  # a parameter that does matter
