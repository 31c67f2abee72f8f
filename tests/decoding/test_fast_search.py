"""The fast beam-search loop (`_FastDecoder`, annotated/decoding/search.py section 7) against the readable one.

The two loops compute the same function in a different order: the fast one attends through the heads'
circuits, from a sentence's k beams as k queries of one row (the readable one, through keys and values, k
rows of one query each), so the attention's sums round differently. Hence: in float64 the same token ids
and scores within 1e-12 (rounding at 2.2e-16 per operation, summed over at most 60 steps of a few thousand
operations each; the largest difference seen in these cases is 1.2e-14); in float32 the same token ids and
scores within 1e-4, where the largest difference seen in these cases is 7.6e-6 (float32 rounds at 6e-8 per
operation, 40x coarser than what separates the scores seen here). Equal ids need no rounding margin: a tie
closer than that between a kept and a dropped candidate would fail the test, and none occurs in these cases,
nor under the other kernels `make test-arith` runs them with (ATen's AVX2 and scalar code, MKL's AVX2 and
SSE paths), whose rounding differs from this CPU's default.
"""

import copy
from unittest import mock

import pytest
import torch

from annotated.checkpoint import load_checkpoint
from annotated.decoding import search
from annotated.decoding.search import beam_search
from annotated.shipped import shipped_model
from annotated.tokens import EOS, PAD
from annotated.training.data import load_multi30k
from annotated.transformer import make_model, padding_mask


def both(model, src, mask, max_len, k, alpha):
    """(ids, scores) of beam_search through the fast loop, then through the readable one."""
    return [
        beam_search(model, src, mask, max_len, beam_size=k, length_penalty=alpha, return_scores=True, fast=fast)
        for fast in (True, False)
    ]


TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-4}  # on the scores, see above


def assert_same(fast, readable, dtype=torch.float32):
    """The same ids; scores (float64 whatever the model's `dtype`) within that dtype's tolerance."""
    (ids, scores), (ids_r, scores_r) = fast, readable
    assert torch.equal(ids, ids_r), (ids, ids_r)
    gap = (scores - scores_r).abs().max().item()
    assert gap <= TOLERANCE[dtype], gap


def padded(rows: list[list[int]]) -> torch.Tensor:
    src = torch.full((len(rows), max(map(len, rows))), PAD, dtype=torch.long)  # (B, S)
    for r, ids in enumerate(rows):
        src[r, : len(ids)] = torch.tensor(ids)
    return src


@pytest.fixture(scope="module")
def shipped_and_sources(data_url):
    """The shipped de -> en model and 24 test sentences of Multi30k as padded ids."""
    model, tokenizer, _ = load_checkpoint(shipped_model("de-en"))
    pairs = load_multi30k("test_2016_flickr", "de", "en", base_url=data_url)[:24]
    return model, padded([tokenizer.encode(s) for s, _ in pairs])


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("alpha", [0.0, 0.6])
@pytest.mark.parametrize("max_len", [6, 60])  # 6: most sentences stop at the length limit
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fast_loop_equals_readable_loop_on_the_shipped_model(shipped_and_sources, k, alpha, max_len, dtype):
    model, src = shipped_and_sources
    model = copy.deepcopy(model).to(dtype)
    fast, readable = both(model, src, padding_mask(src, PAD), max_len, k, alpha)
    assert_same(fast, readable, dtype)
    ended = (fast[0] == EOS).any(dim=1)
    assert (~ended).any() if max_len == 6 else ended.all()  # the cut case, and the finished one, really occur


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("form", ["fused", "per_head"])
def test_fast_loop_equals_readable_loop_on_random_models(seed, k, form):
    """Small random models in both attention forms, vocabularies whose block size is 1, 2 or more
    (`_block_size`), and sentences of several lengths, so sentences leave the batch at different steps."""
    torch.manual_seed(seed)
    V = (7, 24, 60, 97, 128, 300)[seed]
    sizes = dict(d_v=5, bias=False) if seed % 2 else {}  # d_v != d_k, and no biases
    m = make_model(
        src_vocab=V, tgt_vocab=V, N=2, d_model=16, d_ff=32, h=2, dropout=0.0, max_len=32, attention=form, **sizes
    )
    m = m.eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if ".b_" in name:  # the attention's biases, zero when made: b_K's term must cancel, b_V's must not
                p.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(seed))
        m.generator.bias[EOS] += 1.0  # some translations end before the limit
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(4, V, (int(n),), generator=g).tolist() for n in torch.randint(1, 9, (7,), generator=g)]
    rows[seed] = [] if seed < 3 else rows[seed]  # a source of padding only: nothing to attend to
    src = padded(rows)
    for alpha in (0.0, 0.6, 1.0):
        for max_len in (3, 12):
            assert_same(*both(m, src, padding_mask(src, PAD), max_len, k, alpha))


def test_the_fast_setting_chooses_the_decoder(shipped_and_sources):
    """`fast=True` (the default) runs `_FastDecoder` only; `fast=False`, `_Decoder` only (the other would raise)."""
    model, src = shipped_and_sources
    mask = padding_mask(src[:2], PAD)

    def refuse(*args):
        raise AssertionError("the other decoder ran")

    with mock.patch.object(search, "_Decoder", refuse):
        beam_search(model, src[:2], mask, 8)
    with mock.patch.object(search, "_FastDecoder", refuse):
        beam_search(model, src[:2], mask, 8, fast=False)


@pytest.mark.parametrize("T", [1, 2, 12, 15, 16, 40])
def test_the_written_out_softmax_is_torchs(T):
    """`_softmax` (written out below 16 entries) equals `Tensor.softmax`, masked entries (-inf) included, and
    a row with nothing to attend to is NaN in both (the caller zeroes it)."""
    s = torch.randn(5, 3, T, dtype=torch.float64)
    s[0, 0, 1:] = -torch.inf  # padding after the first key
    s[1, 2] = -torch.inf
    got, want = search._softmax(s.clone()), s.softmax(dim=-1)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-15, equal_nan=True)
    assert got[1, 2].isnan().all() and got[0, 0, 1:].eq(0).all() and got[0, 0, 0] == 1


@pytest.mark.parametrize("T", [2, 12, 15])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_written_out_softmax_subtracts_the_row_maximum(T, dtype):
    """Rows of scores near 1,000, -1,000, 100 and -200: exp of them overflows float32 (above 88) and float64
    (above 709), or is 0 for every entry of a row; with the row's maximum subtracted first, the written-out
    softmax is torch's (`test_the_written_out_softmax_is_torchs` uses scores near 0, where both forms agree)."""
    s = torch.randn(4, 3, T, dtype=torch.float64, generator=torch.Generator().manual_seed(T))
    s = (s + torch.tensor([1000.0, -1000.0, 100.0, -200.0], dtype=torch.float64).view(4, 1, 1)).to(dtype)
    got, want = search._softmax(s.clone()), s.softmax(dim=-1)
    assert got.isfinite().all()
    # a few roundings of at most 6e-8 (float32) per entry, which lies in [0, 1]
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-7)


def nbest_both(model, src, mask, max_len, k, alpha, n):
    """`beam_search`'s n-best lists through the fast loop, then through the readable one."""
    return [beam_search(model, src, mask, max_len, k, alpha, nbest=n, fast=fast) for fast in (True, False)]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("k", [1, 3, 5])
def test_the_two_loops_return_the_same_nbest_lists_and_scores(seed, k):
    """In float64: the same hypotheses in the same order, identical ids, and log P and scores within 1e-12
    (the tolerance of the module's docstring); each list in score order, its first `beam_search`'s answer."""
    torch.manual_seed(seed)
    V = (24, 60, 97)[seed]
    m = make_model(src_vocab=V, tgt_vocab=V, N=2, d_model=16, d_ff=32, h=2, dropout=0.0, max_len=32)
    m = m.eval().to(torch.float64)
    with torch.no_grad():
        m.generator.bias[EOS] += 1.0  # some translations end before the limit
    g = torch.Generator().manual_seed(seed)
    src = padded([torch.randint(4, V, (int(n),), generator=g).tolist() for n in torch.randint(1, 9, (6,), generator=g)])
    mask = padding_mask(src, PAD)
    lengths = set()
    for alpha in (0.0, 0.6):
        for max_len in (3, 12):
            fast, readable = nbest_both(m, src, mask, max_len, k, alpha, k)
            best, _ = beam_search(m, src, mask, max_len, beam_size=k, length_penalty=alpha, return_scores=True)
            for b, (f, r) in enumerate(zip(fast, readable)):
                assert len(f) == len(r) == k  # every sentence here finishes k hypotheses, or is cut with k live
                assert [h.ids for h in f] == [h.ids for h in r]
                for hf, hr in zip(f, r):
                    assert abs(hf.log_prob - hr.log_prob) <= 1e-12 and abs(hf.score - hr.score) <= 1e-12
                    assert hf.score == pytest.approx(hf.log_prob / search.gnmt_lp(len(hf.ids), alpha), abs=1e-12)
                assert [h.score for h in f] == sorted((h.score for h in f), reverse=True)
                assert best[b].tolist() == f[0].ids + [PAD] * (best.size(1) - len(f[0].ids))  # pad after it
                lengths.update(len(h.ids) for h in f)
    assert len(lengths) > 1  # hypotheses of several lengths: the length penalty had something to rank


def test_nbest_above_the_beam_is_refused():
    m = make_model(src_vocab=12, tgt_vocab=12, N=1, d_model=8, d_ff=16, h=2, dropout=0.0, max_len=8).eval()
    src = torch.tensor([[5, 6]])
    with pytest.raises(ValueError, match="nbest must be between 1 and the beam size 2, got 3"):
        beam_search(m, src, None, 4, beam_size=2, nbest=3)
