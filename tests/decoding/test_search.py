"""The claims of annotated/decoding/search.py, one test each.

Models: a copy-task model trained for only 100 steps (about 4 s on one core),
so its distributions have structure (eos becomes likely near the source
length) yet are flat enough that beam search often leaves greedy's path and
reorders its cache; random untrained models where structure does not matter
(exhaustive search); and a table-driven stand-in model whose probabilities are
written out by hand.

Tolerances: token sequences are compared exactly, which holds on any CPU where no choice is a near-tie: along
the copy model's greedy paths the best token's log-probability beats the runner-up's by at least 1.4e-2 (float32
and float64, measured on an Intel Xeon), while two ways of computing a float32 score differ by at most 7.6e-6
(test_fast_search.py), and `make test-arith` runs these tests under other kernels. Scores computed two ways
in float64 (cached vs recomputed, batched vs alone, fused vs per-head, beam
score vs teacher forcing) differ only by the order of floating-point
additions over sums of a few hundred terms of order 1: 1e-10 leaves room for
that and would still catch any wrong token probability (those differ by
far more than 1e-3 here).
"""

import copy
import itertools
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from annotated.decoding.search import (
    beam_search,
    gnmt_lp,
    greedy,
    reorder_cache,
    sequence_logprob,
    translate_ids,
)
from annotated.tokens import BOS, EOS, PAD
from annotated.transformer import convert_model, copy_batch, make_model, padding_mask, train_copy_task

TOL = 1e-10


@pytest.fixture(scope="module")
def copy_models():
    """{"fused": model, "per_head": the same function in the other form}, float64, eval."""
    m = train_copy_task(steps=100, batch_size=64, max_symbols=8, seed=0).double().eval()
    return {"fused": m, "per_head": convert_model(m, "per_head").eval()}


def copy_sources(n=8, seed=5):
    src, _ = copy_batch(n, 8, 13, torch.Generator().manual_seed(seed))  # (n, 8), padded
    return src, padding_mask(src, PAD)


def assert_well_formed(out, max_len):
    """bos excluded, at most max_len tokens, nothing but pad after the first eos."""
    assert out.dim() == 2 and out.size(1) <= max_len and (out != BOS).all()
    after_eos = (out == EOS).long().cumsum(1) - (out == EOS).long() > 0
    assert (out[after_eos] == PAD).all()


# --- beam of one is greedy --------------------------------------------------


@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.0])
@pytest.mark.parametrize("max_len", [10, 4])  # 4: some sentences are cut before their eos
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_beam_of_one_is_greedy(copy_models, alpha, max_len, dtype):
    m = copy.deepcopy(copy_models["fused"]).to(dtype)
    src, mask = copy_sources(16)
    want = greedy(m, src, mask, max_len)
    got = beam_search(m, src, mask, max_len, beam_size=1, length_penalty=alpha)
    assert torch.equal(got, want)
    if max_len == 4:
        assert ((want == EOS).sum(1) == 0).any()  # the cut case really occurs


# --- cache, attention forms, batching ---------------------------------------


@pytest.mark.parametrize("attention", ["fused", "per_head"])
@pytest.mark.parametrize("k", [2, 5])
def test_cached_beam_equals_recomputed_beam(copy_models, attention, k):
    m = copy_models[attention]
    src, mask = copy_sources()
    cached, s_cached = beam_search(m, src, mask, 10, beam_size=k, return_scores=True)
    full, s_full = beam_search(m, src, mask, 10, beam_size=k, use_cache=False, return_scores=True)
    assert torch.equal(cached, full)
    assert (s_cached - s_full).abs().max() <= TOL
    assert_well_formed(cached, 10)


@pytest.mark.parametrize("attention", ["fused", "per_head"])
def test_beam_search_without_the_cache_recomputes_the_whole_prefix(copy_models, attention, monkeypatch):
    """`use_cache=False`, with `fast` on: every step runs the model's decoder over the whole
    prefix, bos first, under the causal mask and with no cache (the fast loop, which always caches, does not
    run), so `test_cached_beam_equals_recomputed_beam` compares two different computations."""
    m = copy_models[attention]
    src, mask = copy_sources()
    calls, decode = [], m.decode

    def watched(memory, src_mask, tgt, tgt_mask, *, cache=None, start=0):
        calls.append((tgt.size(1), tgt_mask is not None, cache is None, start))
        return decode(memory, src_mask, tgt, tgt_mask, cache=cache, start=start)

    monkeypatch.setattr(m, "decode", watched)
    out = beam_search(m, src, mask, 10, beam_size=2, use_cache=False, fast=True)
    assert len(calls) >= out.size(1) >= 2  # a step for each token of the longest translation at least
    assert calls == [(t + 1, True, True, 0) for t in range(len(calls))]  # (length, causal mask, no cache, start)


def test_beams_really_leave_greedys_path(copy_models):
    """Guards the tests above: on these sources beam search does reorder beams and differ from greedy."""
    m = copy_models["fused"]
    src, mask = copy_sources()
    g, b = greedy(m, src, mask, 10), beam_search(m, src, mask, 10, beam_size=4)
    width = max(g.size(1), b.size(1))
    g, b = (torch.nn.functional.pad(x, (0, width - x.size(1)), value=PAD) for x in (g, b))
    assert not torch.equal(g, b)


def test_attention_forms_give_identical_beams(copy_models):
    src, mask = copy_sources()
    fused, s_fused = beam_search(copy_models["fused"], src, mask, 10, return_scores=True)
    per_head, s_per_head = beam_search(copy_models["per_head"], src, mask, 10, return_scores=True)
    assert torch.equal(fused, per_head)
    assert (s_fused - s_per_head).abs().max() <= TOL


@pytest.mark.parametrize("attention", ["fused", "per_head"])
def test_batched_beam_equals_one_sentence_at_a_time(copy_models, attention):
    m = copy_models[attention]
    src, mask = copy_sources()
    batch, s_batch = beam_search(m, src, mask, 10, beam_size=3, return_scores=True)
    for b in range(src.size(0)):
        alone = src[b : b + 1, : int((src[b] != PAD).sum())]  # (1, S_b), no padding at all
        one, s_one = beam_search(m, alone, padding_mask(alone, PAD), 10, beam_size=3, return_scores=True)
        row = batch[b, : one.size(1)]
        assert torch.equal(row, one[0]) and (batch[b, one.size(1) :] == PAD).all()
        assert abs(s_batch[b] - s_one[0]) <= TOL


def test_scores_are_teacher_forced_logprob_over_length_penalty(copy_models):
    m = copy_models["fused"]
    src, mask = copy_sources()
    for alpha in (0.0, 0.6):
        out, scores = beam_search(m, src, mask, 10, beam_size=4, length_penalty=alpha, return_scores=True)
        logp, lengths = sequence_logprob(m, src, mask, out)
        # score(Y) = log P(Y | X) / lp(Y)
        want = torch.tensor(
            [lp_ / gnmt_lp(n, alpha) for lp_, n in zip(logp.tolist(), lengths.tolist())], dtype=torch.float64
        )
        assert (scores - want).abs().max() <= TOL


# --- exhaustive search ------------------------------------------------------


def all_outputs(V, max_len):
    """Every output greedy or beam search can return: ends in eos, or has max_len tokens."""
    words = [w for w in range(V) if w != EOS]
    for n in range(1, max_len + 1):
        for prefix in itertools.product(words, repeat=n - 1):
            yield list(prefix) + [EOS]
            if n == max_len:
                yield from ([*prefix, w] for w in words)


@pytest.mark.parametrize("alpha", [0.0, 0.6])
@pytest.mark.parametrize("seed", [0, 1])
def test_wide_beam_is_exhaustive_search(alpha, seed):
    V, max_len = 5, 3
    torch.manual_seed(seed)
    m = make_model(src_vocab=V, tgt_vocab=V, N=1, d_model=16, d_ff=32, h=2, dropout=0.0, max_len=8).double().eval()
    with torch.no_grad():
        m.generator.weight.mul_(3)  # sharper distributions, so the argmax is well separated
    src = torch.tensor([[3, 4, 3], [4, 4, 0]])
    mask = padding_mask(src, PAD)
    out, scores = beam_search(m, src, mask, max_len, beam_size=V**max_len, length_penalty=alpha, return_scores=True)
    candidates = list(all_outputs(V, max_len))
    ys = torch.tensor([c + [PAD] * (max_len - len(c)) for c in candidates])  # (n, max_len)
    for b in range(src.size(0)):
        n = len(candidates)
        logp, lengths = sequence_logprob(m, src[b : b + 1].expand(n, -1), mask[b : b + 1].expand(n, -1, -1), ys)
        exact = torch.tensor(
            [x / gnmt_lp(k, alpha) for x, k in zip(logp.tolist(), lengths.tolist())], dtype=torch.float64
        )
        best = int(exact.argmax())
        assert out[b, : len(candidates[best])].tolist() == candidates[best]
        assert abs(scores[b] - exact[best]) <= TOL
        assert exact.topk(2).values.diff().abs() > 1e-6  # the argmax is unique, so the test is sharp


# --- a hand-made case where greedy goes wrong -------------------------------

A, B_ = 3, 4  # two ordinary words


class TableModel(nn.Module):
    """p(next word | words so far) from a table, keyed by the words after bos.

    Incremental decoding keeps the words so far in its cache, the way the
    real decoder keeps keys and values, so a wrongly reordered cache would
    look up the wrong row.
    """

    table = {
        (): {A: 0.5, B_: 0.4, EOS: 0.1},
        (A,): {A: 0.36, B_: 0.34, EOS: 0.3},
        (B_,): {EOS: 0.9, A: 0.05, B_: 0.05},
        (A, B_): {EOS: 0.5, A: 0.5},
    }

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(max_len=8, N=1, src_vocab=6, tgt_vocab=5)
        self.generator = nn.Identity()

    def encode(self, src, src_mask):
        return torch.zeros(src.size(0), src.size(1), 1, dtype=torch.float64)

    def new_cache(self):
        return [{}]

    def decode(self, memory, src_mask, tgt, tgt_mask, *, cache=None, start=0):
        if cache is not None:  # the words so far stand in for both keys and values
            tgt = torch.cat([cache[0]["self"][0], tgt], dim=1) if "self" in cache[0] else tgt
            cache[0]["self"] = (tgt, tgt)
        rows = []
        for prefix in tgt[:, 1:].tolist():
            probs = self.table.get(tuple(prefix), {EOS: 1.0})
            rows.append([math.log(probs.get(w, 1e-9)) for w in range(5)])
        return torch.tensor(rows, dtype=torch.float64).unsqueeze(1)  # (B, 1, V): logits of the last position


def test_beam_finds_what_greedy_misses():
    m = TableModel().eval()
    src = torch.tensor([[5]])
    # greedy: A (0.5), then A (0.36 > 0.34 > 0.3), then eos: P = 0.18
    assert greedy(m, src, None, 5).tolist() == [[A, A, EOS]]
    # beam of 2: B eos has P = 0.4 * 0.9 = 0.36, found because B stays in the beam at step 1
    for use_cache in (True, False):
        out, score = beam_search(
            m, src, None, 5, beam_size=2, length_penalty=0.0, use_cache=use_cache, return_scores=True
        )
        assert out.tolist() == [[B_, EOS]]
        # the 1e-9 floors of unlisted words make each row sum to 1 + 3e-9: log_softmax shifts by that much
        assert abs(score.item() - math.log(0.36)) <= 1e-8


# --- the cache, and bad arguments -------------------------------------------


def test_reorder_cache_moves_and_drops_rows_of_a_real_cache():
    torch.manual_seed(0)
    for attention in ("fused", "per_head"):
        m = make_model(src_vocab=7, tgt_vocab=7, N=2, d_model=16, d_ff=32, h=2, dropout=0.0, attention=attention).eval()
        src = torch.randint(3, 7, (3, 4))
        memory, cache = m.encode(src, None), m.new_cache()
        with torch.no_grad():
            m.decode(memory, None, torch.full((3, 1), BOS), None, cache=cache, start=0)
        index = torch.tensor([2, 0])
        moved = reorder_cache(cache, index)
        tensors = lambda c: [t for layer in c for kv in layer.values() for t in kv]
        assert len(tensors(cache)) == 2 * 2 * 2  # layers x (self, cross) x (keys, values)
        for before, after in zip(tensors(cache), tensors(moved), strict=True):
            assert after.shape == (2, 2) + before.shape[2:] and torch.equal(after, before[index])  # (2, h, T, d)


def test_bad_arguments_are_named(copy_models):
    """Every entry point of search.py refuses bad arguments at the door, naming them, before any model work."""
    m = copy_models["fused"]
    src, mask = copy_sources(2)
    with pytest.raises(ValueError, match="beam_size"):
        beam_search(m, src, mask, 5, beam_size=0)
    with pytest.raises(ValueError, match="length_penalty"):
        beam_search(m, src, mask, 5, length_penalty=-0.5)
    with pytest.raises(ValueError, match=r"max_len must be an int in \[1, 10\]"):
        beam_search(m, src, mask, 11)
    with pytest.raises(ValueError, match="src token ids must be an int64 or int32 tensor"):
        greedy(m, src.float(), mask, 5)
    with pytest.raises(ValueError, match=r"src_mask of shape \(2, 1, 3\) does not broadcast"):
        beam_search(m, src, mask[:, :, :3], 5)
    with pytest.raises(ValueError, match=r"ys must have shape \(B=2, L\)"):
        sequence_logprob(m, src, mask, torch.ones(3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"source 1 holds ids outside \[0, 13\)"):
        translate_ids(m, [[4, 5], [4, 99]])
    with pytest.raises(ValueError, match="source 0 must be a list of int token ids"):
        translate_ids(m, ["ein Satz"])
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        translate_ids(m, [[4, 5]], batch_size=0)
    with pytest.raises(ValueError, match="beam_size"):
        translate_ids(m, [[4, 5]], beam_size=0)
    m.train()
    try:
        for call in (
            lambda: beam_search(m, src, mask, 5),
            lambda: greedy(m, src, mask, 5),
            lambda: translate_ids(m, [[4, 5]]),
        ):
            with pytest.raises(ValueError, match="eval mode"):
                call()
    finally:
        m.eval()


def test_long_inputs_are_refused_at_the_door_or_cut_as_documented():
    m = make_model(src_vocab=17, tgt_vocab=19, N=1, d_model=16, d_ff=32, h=4, dropout=0.0, max_len=8).eval()
    long = torch.full((1, 9), 3)
    for call in (
        lambda: greedy(m, long, None, 5),
        lambda: beam_search(m, long, None, 5),
        lambda: sequence_logprob(m, long, None, torch.full((1, 2), 3)),
    ):
        with pytest.raises(ValueError, match="source length 9 exceeds the model's max_len=8"):
            call()
    with pytest.raises(ValueError, match=r"max_len must be an int in \[1, 8\]"):
        greedy(m, torch.full((1, 3), 3), None, 9)  # the decoder would need position 8
    with pytest.raises(ValueError, match=r"ys must have shape \(B=1, L\) with 1 <= L <= max_len=8"):
        sequence_logprob(m, torch.full((1, 3), 3), None, torch.full((1, 9), 3))
    out = translate_ids(m, [[3] * 20], max_extra=50)  # translate_ids cuts the source to max_len
    assert out == translate_ids(m, [[3] * 8], max_extra=50) and len(out[0]) <= 8


def test_translate_ids_searches_in_inference_mode_and_the_model_trains_after_it(monkeypatch):
    """Section 8: the search runs under `torch.inference_mode` (not only without gradients), and nothing of it
    reaches the caller: lists come back, and the same model then trains (a backward pass through it works)."""
    from annotated.decoding import search

    torch.manual_seed(0)
    model = make_model(src_vocab=13, tgt_vocab=13, N=1, d_model=16, d_ff=32, h=2, dropout=0.0, max_len=16).eval()
    seen, beam = [], search._search
    monkeypatch.setattr(search, "_search", lambda *a: seen.append(torch.is_inference_mode_enabled()) or beam(*a))
    out = translate_ids(model, [[4, 5, 6], [7, 8]], beam_size=2)
    assert seen == [True] and not torch.is_inference_mode_enabled()
    assert all(isinstance(ids, list) and all(isinstance(t, int) for t in ids) for ids in out)
    src, tgt = torch.tensor([[4, 5, 6]]), torch.tensor([[BOS, 4, 5]])
    model.train()(src, tgt, None, None).sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_translate_ids_on_two_threads_runs_two_batches_at_once_and_translates_the_same(monkeypatch):
    """Section 8: with 2 threads on the CPU, batches run side by side on 2 threads, each with PyTorch set to one
    thread (and inference mode), PyTorch's thread count is back after, and the translations are those of one
    thread, in input order."""
    import threading

    from annotated.decoding import search

    torch.manual_seed(0)
    model = make_model(src_vocab=40, tgt_vocab=40, N=1, d_model=16, d_ff=32, h=2, dropout=0.0, max_len=16).eval()
    g = torch.Generator().manual_seed(0)
    sources = [torch.randint(4, 40, (int(n),), generator=g).tolist() for n in torch.randint(1, 12, (30,), generator=g)]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = translate_ids(model, sources, beam_size=3, batch_size=4)
        torch.set_num_threads(2)
        seen, beam, both = [], search._search, threading.Barrier(2, timeout=20)

        def watched(*a):
            seen.append((threading.get_ident(), torch.get_num_threads(), torch.is_inference_mode_enabled()))
            if len(seen) <= 2:
                both.wait()  # the first two batches meet: they run at the same time (one thread alone would time out)
            return beam(*a)

        monkeypatch.setattr(search, "_search", watched)
        assert translate_ids(model, sources, beam_size=3, batch_size=4) == alone
        assert len(seen) == 8 and len({ident for ident, _, _ in seen}) == 2, seen
        assert all(n == 1 and inference for _, n, inference in seen) and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
