"""The fast beam-search loop (`_search_fast`, annotated/decoding/search.py section 7) against the readable one.

Equality here is exact: the same token ids and the same float64 scores, bit for bit. The fast loop adds the
same two floats (log P(y) + log p(w | y)) for every candidate it keeps, takes log-softmax over the same
logits and divides by the same length penalty, so nothing may differ by rounding; only the order of exactly
equal candidates could (topk's tie order), and none occur in these cases (the test would say so).
"""

from unittest import mock

import pytest
import torch

from annotated.checkpoint import load_checkpoint
from annotated.decoding import search
from annotated.decoding.search import beam_search
from annotated.shipped import shipped_model
from annotated.tokens import EOS, PAD
from annotated.training.data import load_multi30k
from annotated.transformer import fast_path, make_model, padding_mask


def both(model, src, mask, max_len, k, alpha):
    """(ids, scores) of beam_search through the fast loop, then through the readable one."""
    fast = beam_search(model, src, mask, max_len, beam_size=k, length_penalty=alpha, return_scores=True)
    with mock.patch.object(search, "_search_fast", search._search):
        readable = beam_search(model, src, mask, max_len, beam_size=k, length_penalty=alpha, return_scores=True)
    return fast, readable


def assert_same(fast, readable):
    (ids, scores), (ids_r, scores_r) = fast, readable
    assert torch.equal(ids, ids_r), (ids, ids_r)
    assert torch.equal(scores, scores_r), (scores - scores_r).abs().max()


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
def test_fast_loop_equals_readable_loop_on_the_shipped_model(shipped_and_sources, k, alpha, max_len):
    model, src = shipped_and_sources
    fast, readable = both(model, src, padding_mask(src, PAD), max_len, k, alpha)
    assert_same(fast, readable)
    ended = (fast[0] == EOS).any(dim=1)
    assert (~ended).any() if max_len == 6 else ended.all()  # the cut case, and the finished one, really occur


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_fast_loop_equals_readable_loop_on_random_models(seed, k):
    """Small random models, vocabularies whose block size is 1, 2 or more (`_block_size`), and sentences of
    several lengths, so sentences leave the batch at different steps."""
    torch.manual_seed(seed)
    V = (7, 24, 60, 97, 128, 300)[seed]
    m = make_model(src_vocab=V, tgt_vocab=V, N=2, d_model=16, d_ff=32, h=2, dropout=0.0, max_len=32).eval()
    with torch.no_grad():
        m.generator.bias[EOS] += 1.0  # some translations end before the limit
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(4, V, (int(n),), generator=g).tolist() for n in torch.randint(1, 9, (7,), generator=g)]
    src = padded(rows)
    for alpha in (0.0, 0.6, 1.0):
        for max_len in (3, 12):
            assert_same(*both(m, src, padding_mask(src, PAD), max_len, k, alpha))


def test_the_fast_path_switch_chooses_the_loop(shipped_and_sources):
    """`FAST_PATH` on runs `_search_fast` only; off, `_search` only (each other loop would raise)."""
    model, src = shipped_and_sources
    mask = padding_mask(src[:2], PAD)

    def refuse(*args):
        raise AssertionError("the other loop ran")

    with fast_path(True), mock.patch.object(search, "_search", refuse):
        beam_search(model, src[:2], mask, 8)
    with fast_path(False), mock.patch.object(search, "_search_fast", refuse):
        beam_search(model, src[:2], mask, 8)
