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
# # Decoding: greedy, beam search, and the key/value cache
#
# A trained model gives, for a source sentence `X` and a target prefix
# `y_1 ... y_{t-1}`, a distribution over the next token. The probability of a
# whole translation `Y = y_1 ... y_n` (ending in `eos`) is the product of these
# conditionals, so its log-probability is a sum:
#
# $$\log P(Y \mid X) = \sum_{t=1}^{n} \log p(y_t \mid y_{<t}, X)$$
#
# The best translation would be the `Y` that maximises this, but there are
# `V^n` sequences of length `n` over a vocabulary of `V` subwords: nobody
# searches them all. This chapter builds the two standard approximations on
# top of `annotated/transformer.py`:
#
# 1. **greedy decoding** takes the most likely token at every step;
# 2. **beam search** keeps the `k` best prefixes at every step, and ranks
#    finished translations with a **length penalty**;
#
# and shows how both reuse the decoder's **key/value cache**, which beam
# search must *reorder* whenever a prefix changes hands.
#
# Every claim below is checked by a doctest here or by a test in
# `tests/decoding/` (test names in parentheses).

# %%
from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from annotated.checks import check_beam, check_decoder_output, check_decoding, check_sources
from annotated.decoding.quantize import float_attention
from annotated.decoding.settings import Decoding
from annotated.tokens import BOS, EOS, PAD
from annotated.transformer import (
    Cache,
    EncoderDecoder,
    Generator,
    greedy_decode,
    head_blocks,
    padding_mask,
    subsequent_mask,
)

# %% [markdown]
# ## 1. What every decoder checks first
#
# Decoding runs the model many times, so a bad argument fails before the
# first step, with a message that names it: `check_decoding` of
# `annotated/checks.py`, which every entry point of this file calls
# (`test_bad_arguments_are_named`). Training mode is an error, not a silent
# guess: dropout would draw new noise at every decoder call, so the output
# would be random and cached decoding would no longer equal recomputation.
# Source ids are range-checked here, once, because the model does not check
# them (reading the ids back to the host stalls a GPU at every step).


# %%
def _score_dtype(dtype: torch.dtype) -> torch.dtype:
    """Log-probabilities in at least float32: summed in bf16 they would drift."""
    return torch.promote_types(dtype, torch.float32)


# %% [markdown]
# ## 2. Greedy decoding
#
# `greedy_decode` of the main chapter (section 7), with the checks above:
# each step appends `argmax_w p(w | prefix, X)`. It is fast and often good,
# but one good-looking word can rule out the best sentence
# (`test_beam_finds_what_greedy_misses` builds such a case).


# %%
def greedy(
    model: EncoderDecoder,
    src: Tensor,
    src_mask: Tensor | None,
    max_len: int,
    bos: int = BOS,
    eos: int = EOS,
    pad: int = PAD,
    use_cache: bool = True,
) -> Tensor:
    """(B, S) source ids -> (B, <= max_len) ids (bos excluded, eos kept, pad after it)."""
    check_decoding(model, src, src_mask, max_len)
    return greedy_decode(model, src, src_mask, max_len, bos, eos, pad, use_cache)


# %% [markdown]
# ## 3. Scoring a given translation
#
# Teacher forcing computes all the conditionals of a returned sequence in
# one pass: feed `bos y_1 ... y_{n-1}` under the causal mask, read
# `log p(y_t | y_{<t}, X)` at every position, and sum up to and including
# the first `eos` (a sequence cut at `max_len` counts all its tokens).


# %%
@torch.no_grad()
def sequence_logprob(
    model: EncoderDecoder, src: Tensor, src_mask: Tensor | None, ys: Tensor, bos: int = BOS, eos: int = EOS
) -> tuple[Tensor, Tensor]:
    """log P(Y | X) of decoder outputs `ys` (B, L), as returned by `greedy` or `beam_search`.

    Returns (log-probabilities (B,), lengths (B,)) where a length counts the
    tokens up to and including the first eos (all L if there is none).
    """
    check_decoding(model, src, src_mask, model.config.max_len)
    check_decoder_output(model, src, ys)
    B, L = ys.shape
    tgt_in = torch.cat([torch.full((B, 1), bos, dtype=torch.long, device=ys.device), ys[:, :-1]], dim=1)  # (B, L)
    y = model.decode(model.encode(src, src_mask), src_mask, tgt_in, subsequent_mask(L).to(ys.device))  # (B, L, d_model)
    logits = model.generator(y)  # (B, L, V)
    logp = logits.to(_score_dtype(logits.dtype)).log_softmax(dim=-1)  # (B, L, V)
    token_logp = logp.gather(-1, ys.unsqueeze(-1)).squeeze(-1)  # (B, L)
    is_eos = (ys == eos).long()  # (B, L)
    counted = (is_eos.cumsum(dim=1) - is_eos) == 0  # (B, L) no eos strictly before this position
    # log P(Y | X) = sum_t log p(y_t | y_<t, X), over the counted positions
    return token_logp.masked_fill(~counted, 0.0).sum(dim=1), counted.sum(dim=1)  # (B,), (B,)


# %% [markdown]
# ## 4. The length penalty
#
# Every token multiplies the probability by a number below one, so raw
# log-probability prefers short translations: a search that ranks finished
# sentences by `log P` alone stops too early. GNMT (Wu et al., 2016, eq. 14)
# divides by a length penalty instead, and the Transformer paper decodes with
# it (beam size 4, alpha = 0.6, section 6.1):
#
# $$lp(Y) = \frac{(5 + |Y|)^\alpha}{(5 + 1)^\alpha} = \left(\frac{5 + |Y|}{6}\right)^\alpha,
# \qquad \mathrm{score}(Y) = \frac{\log P(Y \mid X)}{lp(Y)}$$
#
# `|Y|` is the number of generated tokens, `eos` included. `alpha = 0` gives
# `lp = 1`, the raw log-probability; larger `alpha` favours longer outputs
# (a negative log-probability divided by a larger number moves towards 0).
# The `5` makes the penalty grow slowly for the first few tokens; `lp(1) = 1`
# (doctest of `gnmt_lp`). The decoders' argument `length_penalty` is this
# `alpha`.


# %%
def gnmt_lp(length: int, alpha: float) -> float:
    """GNMT length penalty lp = ((5 + length) / 6) ** alpha.

    >>> gnmt_lp(1, 0.6), gnmt_lp(7, 0.0), gnmt_lp(25, 0.6) == (30 / 6) ** 0.6
    (1.0, 1.0, True)
    """
    # lp(Y) = ((5 + |Y|) / 6)^alpha
    return ((5 + length) / 6) ** alpha


# %% [markdown]
# ## 5. The key/value cache, and reordering it
#
# With `cache=model.new_cache()` each call of `model.decode` (the main
# chapter) feeds only the newest token and appends its keys and values to
# the cache, tensors `(B, h, T, d_k)` and `(B, h, T, d_v)`: **the batch is
# dim 0 of every tensor**. Beam search runs one row per hypothesis, and
# after each step row `r` continues old row `index[r]`, so every tensor of
# the cache is re-indexed along dim 0; an index that omits rows drops them,
# which is how a finished sentence leaves the batch. `reorder_cache` returns
# a new cache and leaves the old one unchanged
# (`test_reorder_cache_moves_and_drops_rows_of_a_real_cache`).


# %%
def reorder_cache(cache: Cache, index: Tensor) -> Cache:
    """A copy of `cache` whose keys and values K, V become K[index], V[index] (along the batch, dim 0).

    >>> K, V = torch.tensor([[1.], [2.], [3.]]), torch.tensor([[10], [20], [30]])
    >>> reorder_cache([{"self": (K, V)}], torch.tensor([2, 2, 0]))  # row r continues old row index[r]
    [{'self': (tensor([[3.], [3.], [1.]]), tensor([[30], [30], [10]]))}]
    """
    return [
        {
            name: (K.index_select(0, index), V.index_select(0, index))  # (len(index), h, T, d)
            for name, (K, V) in layer.items()
        }
        for layer in cache
    ]


# %% [markdown]
# ## 6. Beam search
#
# Beam search keeps, for each sentence, the `k` best prefixes (the *beam*)
# and their log-probabilities. One step:
#
# 1. **Expand.** Every prefix `y` of the beam and every token `w` give a
#    candidate with log-probability
#    $$\log P(y\,w) = \log P(y) + \log p(w \mid y, X),$$
#    `k * V` candidates per sentence. Take the best `2k`.
# 2. **Finish.** A candidate ending in `eos` *and ranked among the best `k`*
#    is a finished translation: it leaves the beam and is kept with its
#    score `log P / lp` (section 4). (Only the best `k` may finish, as in
#    fairseq; an `eos` ranked lower is dropped.)
# 3. **Continue.** The best `k` candidates that do not end in `eos` form the
#    next beam. Among `2k` candidates there are always `k` of them, because
#    each of the `k` prefixes contributes at most one `eos` candidate, so the
#    beam never shrinks.
#
# **When to stop.** We use the standard rule (fairseq's; Hugging Face's
# `early_stopping=True`): a sentence is done as soon as `k` translations have
# finished. At `max_len` every sentence stops; one with fewer than `k`
# finished translations then also ranks its beam's prefixes, unfinished at
# `max_len` tokens, beside them (as greedy returns such a prefix too). The
# answer is the finished translation with the best score. The rule is cheap
# and works well on trained models, but it proves nothing: a live prefix
# could still grow into a better translation. The stricter rule "stop when
# no live prefix can beat the best finished one" would, for `alpha > 0`,
# run to `max_len` almost every time. What the standard rule does make
# exact:
#
# - **`k = 1` is greedy decoding, for every `alpha`.** With one prefix, the
#   best candidate is greedy's `argmax`; if it is `eos`, it is the one
#   finished translation the rule waits for, with nothing for the length
#   penalty to compare it with; if not, it is the next beam. So both give the
#   same tokens, unless rounding ties the two best
#   (`test_beam_of_one_is_greedy`).
# - **With `k >= V^max_len`, beam search is exhaustive**: no candidate is ever
#   pruned (at most `V^max_len` candidates exist at any step), every
#   translation of at most `max_len` tokens is ranked, and the answer is the
#   exact argmax of the score (`test_wide_beam_is_exhaustive_search`).
#
# For `1 < k < V^max_len` nothing general holds: a wider beam usually scores
# better, but it can also prune the prefix greedy follows, and end worse.
#
# **n-best.** With `nbest=n` (`n <= k`), `beam_search` returns each
# sentence's finished translations (at `max_len`, with the prefixes ranked
# beside them) in score order, each with its `log P` and score; the first is
# the answer. It is no list of the model's `n` best translations: a prefix
# leaves the beam once `k` others outrank it, and the search stops once `k`
# have finished, so a longer list needs a wider beam
# (`test_nbest_above_the_beam_is_refused`; the fast loop of section 7 returns
# the same lists, `test_the_two_loops_return_the_same_nbest_lists_and_scores`).
#
# **Batching.** `B` sentences run together as `B * k` rows, row `b*k + j`
# being hypothesis `j` of sentence `b`, the memory computed once per
# sentence. The search starts with one row per sentence, the lone `bos`,
# whose best candidates make its `k` (with fewer than `2k` words in the
# vocabulary, `k` copies of `bos`, all but one at `log P = -inf`). A done
# sentence's rows leave the prefixes, the memory, the mask and the cache by
# the index that reorders the beams. Each sentence's search is independent
# of the others in the batch
# (`test_batched_beam_equals_one_sentence_at_a_time`).
#
# **The loop and its decoder.** `_search` holds these rules, once. It asks
# a decoder for the logits after each prefix, the best `2k` candidates, and
# its rows reordered along the beams. `_Decoder` does it with `model.decode`:
# with the cache, each step feeds the newest token and reorders the cache,
# memory and mask with the beams (section 5); without
# (`test_beam_search_without_the_cache_recomputes_the_whole_prefix`), each
# step recomputes the whole prefix, with the same tokens
# (`test_cached_beam_equals_recomputed_beam`). Section 7's `_FastDecoder`
# does the same with less work.


# %%
@torch.no_grad()
def beam_search(
    model: EncoderDecoder,
    src: Tensor,
    src_mask: Tensor | None,
    max_len: int,
    beam_size: int = Decoding.beam,
    length_penalty: float = Decoding.length_penalty,
    bos: int = BOS,
    eos: int = EOS,
    pad: int = PAD,
    use_cache: bool = True,
    return_scores: bool = False,
    nbest: int = 0,
    fast: bool = True,
):
    """(B, S) source ids -> (B, <= max_len) best ids (bos excluded, eos kept, pad after it).

    `length_penalty` is GNMT's alpha (0 = raw log-probability). With `return_scores`, also returns each
    translation's score log P / lp, (B,). With `nbest` n >= 1 (at most `beam_size`), returns instead each
    sentence's n best finished hypotheses, best score first (fewer only when the beam finished fewer).
    `fast`: the fast decoder of section 7, where it runs.
    """
    check_decoding(model, src, src_mask, max_len)
    check_beam(beam_size, length_penalty)
    _check_nbest(nbest, beam_size)
    found = _hypotheses(model, src, src_mask, max_len, beam_size, length_penalty, bos, eos, use_cache, fast)
    if nbest:
        return [hyps[:nbest] for hyps in found]
    best = [hyps[0] for hyps in found]  # the first of equal scores wins
    out = padded([h.ids for h in best], pad).to(src.device)  # (B, L)
    scores = torch.tensor([h.score for h in best], dtype=torch.float64, device=src.device)  # (B,)
    return (out, scores) if return_scores else out


def padded(rows: list[list[int]], pad: int = PAD, width: int = 0) -> Tensor:
    """The id lists as one (B, T) tensor, each filled up with `pad`; T the longest one's length, at least `width`.

    >>> padded([[5, 6], [7]]).tolist()
    [[5, 6], [7, 0]]
    """
    out = torch.full((len(rows), max([width, *map(len, rows)])), pad, dtype=torch.long)  # (B, T)
    for r, ids in enumerate(rows):
        out[r, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out


def _check_nbest(nbest: int, beam_size: int) -> None:
    if not 0 <= nbest <= beam_size:
        raise ValueError(f"nbest must be between 1 and the beam size {beam_size}, got {nbest}")


class Hypothesis(NamedTuple):
    """One finished hypothesis of a sentence: its ids (eos kept where it ended, in `beam_search`'s lists), its
    log P(Y | X), and the score the search ranked it by, log P / lp(|Y|)."""

    ids: list[int]
    log_prob: float
    score: float


def _hypotheses(model, src, src_mask, max_len, k, length_penalty, bos, eos, use_cache, fast) -> list[list[Hypothesis]]:
    """Each sentence's finished hypotheses, best score first (the first of equal scores first); at least one."""
    finished: list[list[Hypothesis]] = [[] for _ in range(src.size(0))]
    if src.size(0) > 0:
        _search(model, src, src_mask, max_len, k, length_penalty, bos, eos, use_cache, fast, finished)
    empty = [b for b, f in enumerate(finished) if not f]
    if empty:
        raise ValueError(
            f"beam search found no translation with a finite log-probability for sentences "
            f"{empty}: the model's logits are not finite (NaN or inf)"
        )
    return [sorted(f, key=lambda h: h.score, reverse=True) for f in finished]  # a stable sort, also reversed


def _search(model, src, src_mask, max_len, k, length_penalty, bos, eos, use_cache, fast, finished) -> None:
    """The beam search loop; appends each finished translation's `Hypothesis` to its sentence's list in `finished`."""
    B, device = src.size(0), src.device
    memory = model.encode(src, src_mask)  # (B, S, d_model)
    w = 1 if 2 * k <= model.config.tgt_vocab else k  # rows per sentence now: the lone bos (section 6)
    decoder: _Decoder | _FastDecoder
    if fast and use_cache and isinstance(model, EncoderDecoder):  # the one place that chooses (section 7)
        decoder = _FastDecoder(model, memory, src_mask)
    else:
        decoder = _Decoder(model, memory, src_mask, w, use_cache)
    ys = torch.full((B * w, 1), bos, dtype=torch.long, device=device)  # (B*w, 1) prefixes, bos first
    scores = torch.full((B, w), -math.inf, dtype=_score_dtype(memory.dtype), device=device)  # (B, w) log P
    scores[:, 0] = 0.0  # only the lone bos is live at first
    alive = torch.arange(B, device=device)  # (A,) the sentence of each block of w rows
    n_done = torch.zeros(B, dtype=torch.long, device=device)  # (A,) finished translations per sentence
    for t in range(max_len):
        A = alive.numel()
        logp = decoder(ys).to(scores.dtype).log_softmax(dim=-1)  # (A*w, V) log p(w | y, X)
        # 1. expand: the best 2k of log P(y w) = log P(y) + log p(w | y, X)
        top, parent, token = decoder.best(scores, logp, 2 * k)  # (A, 2k) each, best first; parent within a sentence
        is_eos = token == eos  # (A, 2k)
        # 2. finish: eos among the best k, with score log P / lp(t + 1)
        ends = is_eos[:, :k] & top[:, :k].isfinite()  # (A, k)
        if ends.any():
            a, j = ends.nonzero(as_tuple=True)  # row-major: best first within a sentence
            for b, logP, ids in zip(alive[a].tolist(), top[a, j].tolist(), ys[a * w + parent[a, j], 1:].tolist()):
                finished[b].append(Hypothesis(ids + [eos], logP, logP / gnmt_lp(t + 1, length_penalty)))
            n_done += ends.sum(dim=1)
        # 3. continue: the best k candidates that do not end in eos (a stable sort keeps their order)
        pick = torch.sort(is_eos.long(), dim=-1, stable=True).indices[:, :k]  # (A, k)
        scores = top.gather(1, pick)  # (A, k)
        rows = (torch.arange(A, device=device).unsqueeze(1) * w + parent.gather(1, pick)).view(-1)  # (A*k,)
        ys, w = torch.cat([ys[rows], token.gather(1, pick).view(-1, 1)], dim=1), k  # (A*k, t+2): k beams from here
        if t == max_len - 1:  # sentences with fewer than k finished translations rank their live prefixes too
            for a, j in (scores.isfinite() & (n_done < k).unsqueeze(1)).nonzero().tolist():
                logP, ids = scores[a, j].item(), ys[a * k + j, 1:].tolist()
                finished[int(alive[a])].append(Hypothesis(ids, logP, logP / gnmt_lp(len(ids), length_penalty)))
            return
        # which sentences are done: k finished, or no live prefix left
        done = (n_done >= k) | ~scores.isfinite().any(dim=1)  # (A,)
        if done.all():
            return
        keep = None
        if done.any():  # drop the done sentences' rows along with the reordering
            keep = (~done).nonzero(as_tuple=True)[0]  # (A',)
            keep_rows = (keep.unsqueeze(1) * k + torch.arange(k, device=device)).view(-1)  # (A'*k,)
            ys, scores, alive, n_done, rows = ys[keep_rows], scores[keep], alive[keep], n_done[keep], rows[keep_rows]
        decoder.reorder(rows, keep)


class _Decoder:
    """The readable loop's decoder: `model.decode`, with each row's memory, mask and cache (B*w rows at first)."""

    def __init__(self, model, memory: Tensor, src_mask: Tensor | None, w: int, use_cache: bool):
        B = memory.size(0)
        self.model, self.memory = model, memory.repeat_interleave(w, dim=0)  # (B*w, S, d_model)
        if src_mask is not None:
            src_mask = src_mask.expand(B, *src_mask.shape[1:]).repeat_interleave(w, dim=0)  # (B*w, 1|S, S)
        self.mask, self.cache = src_mask, model.new_cache() if use_cache else None

    def __call__(self, ys: Tensor) -> Tensor:
        """The logits of the token after each prefix of ys (R, t+1), bos first: (R, V)."""
        model, t = self.model, ys.size(1) - 1
        if self.cache is not None:  # the newest token, at position t
            y = model.decode(self.memory, self.mask, ys[:, -1:], None, cache=self.cache, start=t)  # (R, 1, d_model)
        else:  # the whole prefix
            y = model.decode(self.memory, self.mask, ys, subsequent_mask(t + 1).to(ys.device))  # (R, t+1, d_model)
        return model.generator(y[:, -1])  # (R, V)

    @staticmethod
    def best(scores: Tensor, logp: Tensor, n: int) -> tuple[Tensor, Tensor, Tensor]:
        """The n best candidates log P(y) + log p(w | y) of each sentence among its w*V: (values, parent within
        the sentence, token), each (A, n), best first."""
        A, w = scores.shape
        V = logp.size(-1)
        top, flat = (scores.view(A * w, 1) + logp).view(A, w * V).topk(n, dim=-1)  # (A, n)
        return top, flat // V, flat % V

    def reorder(self, rows: Tensor, keep: Tensor | None) -> None:
        """Row r now continues row rows[r] of the step before (the done sentences' rows left out; `keep`, the
        sentences still searched, is the fast decoder's)."""
        self.memory = self.memory.index_select(0, rows)  # (A'*k, S, d_model)
        self.mask = None if self.mask is None else self.mask.index_select(0, rows)  # (A'*k, 1|S, S)
        if self.cache is not None:
            self.cache = reorder_cache(self.cache, rows)


# %% [markdown]
# ## 7. The same search with less around it
#
# A beam step does the **products** (the decoder layers, the generator,
# attention) and **the rest** (a log-softmax over the `A*k x V` logits, the
# topk over each sentence's `k * V` candidates, the cache reordered, the
# prefixes copied). For models as small as the shipped ones the rest takes
# longer (benchmarks/README.md#where-a-beam-search-spends-its-time).
# `_FastDecoder` gives `_search` the same steps with less of the rest (the
# *fast loop*; with `_Decoder`, the *readable loop*):
#
# - **topk over blocks.** Cut the vocabulary into blocks; a block's best
#   candidate is `log P(y)` plus the block's largest log-probability. A
#   candidate among a sentence's `n = 2k` best lies in one of the `n` blocks
#   whose best candidates rank highest (were its block ranked lower, `n`
#   blocks above it would hold `n` better candidates). So one pass takes the
#   block maxima, a small topk picks `n` blocks, and only their scores are
#   summed and ranked: the full sum and the wide topk are gone.
# - **attention through the circuits.** Head `i`'s score for an earlier
#   position `b` is `q (x_b W_K[i] + b_K[i])^T / sqrt(d_k)` with
#   `q = z W_Q[i] + b_Q[i]` the newest position's query: that is
#   `(q W_K[i]^T) x_b^T / sqrt(d_k)` plus `q b_K[i]^T / sqrt(d_k)`, the same
#   for every `b`, which cancels in the softmax. And what the head reads is
#   `sum_b p_b (x_b W_V[i] + b_V[i]) = (sum_b p_b x_b) W_V[i] + b_V[i]`, the
#   weights summing to 1. These are Part V's QK and OV circuits
#   (`annotated/circuits/circuits.py`, section 3) used forwards: the decoder
#   keeps each layer's *inputs* `x_b` of the beams' positions, one cache
#   instead of keys and values, projects nothing at a step but the newest
#   query, and gets a beam's scores for all `h` heads from one product
#   (`_attend`). The cache is gathered along the chosen beams where the next
#   step appends to it: one copy into place. The cross-attention reads the
#   memory once per sentence, a sentence's `k` beams as `k` queries of one
#   problem. Below 16 scores per row the softmax is written out (`_softmax`:
#   PyTorch's kernel is slower there), subtracting each row's maximum first,
#   as PyTorch's kernel does, so large scores do not overflow
#   (`test_the_written_out_softmax_subtracts_the_row_maximum`;
#   benchmarks/README.md#levers-the-circuits-two-threads).
# - **the generator's bias inside its product.** `y W_gen^T + b` is the
#   product of `[y, 1]` with `[W_gen, b]^T`: one more column of ones instead
#   of one more pass over the `A*k x V` logits (`_generator_with_bias_inside`).
#
# The two loops compute the same function with the sums in another order:
# in float64 they return the same hypotheses with scores within 1e-12, in
# float32 within 1e-4, on the shipped model and on random ones
# (`test_fast_loop_equals_readable_loop_on_the_shipped_model`,
# `test_fast_loop_equals_readable_loop_on_random_models`). `_search` chooses
# the fast loop in one place: `fast=True` (the default), the cache in use,
# and a model of the main chapter; `fast=False` runs the readable loop
# (`test_the_fast_setting_chooses_the_decoder`).
#
# **int8.** `--quantize int8` runs the larger products in int8
# (`annotated/decoding/quantize.py` says which, and what that gains). Each
# weight is then off by at most half a step of its column's largest
# magnitude / 127, small beside the gaps between the log-probabilities the
# search ranks: most translations do not change, and BLEU stays within a
# margin of float32's (`test_int8_bleu_stays_within_the_margin_of_float32`).
# The activations' scale is taken over the whole batch, so an int8
# translation can depend on the sentences batched with it
# (`test_batched_beam_equals_one_sentence_at_a_time`). The fast loop reads an
# int8 attention's circuits from `float_attention`, so only the activations'
# rounding differs between the loops: they may break a near-tie differently,
# and each loop's score is the int8 model's log-probability within 0.1 nats
# per token (`test_each_loop_scores_its_int8_translations_as_the_int8_model_does`).
# Every option with every other translates, and the loops translate the same
# in float32 (`tests/decoding/test_option_matrix.py`).


# %%
class _FastDecoder:
    """What `_search` asks of the model, with less work per step: the decoder layers run on the beams' inputs,
    attention through the circuits, the memory once per sentence."""

    def __init__(self, model, memory: Tensor, src_mask: Tensor | None):
        self.model, self.sources = model, _Sources.of(memory, src_mask)  # (B, S, d_model) once per sentence
        self.circuits = [(_Circuits.of(l.self_attn), _Circuits.of(l.cross_attn)) for l in model.decoder.layers]
        self.inputs: list = [None] * len(self.circuits)  # per layer: the self-attention inputs so far, (R, t, d_model)
        self.rows: Tensor | None = None  # (R,) the row of the step before that each row continues
        self.logits, self.best = _generator_with_bias_inside(model.generator), _best_candidates

    def __call__(self, ys: Tensor) -> Tensor:
        """`_Decoder`'s logits: the decoder layer's three sublayers on the newest tokens, w beams per sentence."""
        model, inputs, rows, sources = self.model, self.inputs, self.rows, self.sources
        t, w = ys.size(1) - 1, ys.size(0) // sources.memory.size(0)
        y = model.pos(model.tgt_embed(ys[:, -1:]), t)  # (A*w, 1, d_model)
        for i, (layer, (self_c, cross_c)) in enumerate(zip(model.decoder.layers, self.circuits)):
            y = layer.res_self(y, functools.partial(_self_attention, layer.self_attn, self_c, inputs, i, rows))
            y = layer.res_cross(y, functools.partial(_cross_attention, layer.cross_attn, cross_c, sources, w))
            y = layer.res_ffn(y, layer.ffn)  # (A*w, 1, d_model)
        return self.logits(model.decoder.final_ln(y)[:, -1])  # (A*w, V)

    def reorder(self, rows: Tensor, keep: Tensor | None) -> None:
        """The self-attention inputs follow `rows` at the next step, gathered where they are appended to; the
        sentences not in `keep` leave."""
        self.rows = rows
        if keep is not None:
            self.sources = self.sources.keep(keep)


class _Sources(NamedTuple):
    """What the cross-attention reads, one block per sentence: the memory, and where it is padding."""

    memory: Tensor  # (A, S, d_model)
    bias: Tensor | None  # (A, 1, S): 0 where a sentence may be attended to, -inf at its padding; None: no mask
    empty: Tensor | None  # (A,) True for a sentence with nothing to attend to; None when no sentence is

    @staticmethod
    def of(memory: Tensor, src_mask: Tensor | None) -> _Sources:
        if src_mask is None:
            return _Sources(memory, None, None)
        A, S, _ = memory.shape
        mask = src_mask.expand(A, 1, S)  # (A, 1, S) the same for every query
        bias = torch.zeros(mask.shape, dtype=memory.dtype, device=memory.device).masked_fill(~mask, -math.inf)
        empty = ~mask.any(dim=-1).view(A)  # (A,)
        return _Sources(memory, bias, empty if bool(empty.any()) else None)

    def keep(self, keep: Tensor) -> _Sources:
        """The sentences `keep` (A',) only."""
        pick = lambda x: None if x is None else x.index_select(0, keep)
        return _Sources(self.memory.index_select(0, keep), pick(self.bias), pick(self.empty))


class _Circuits(NamedTuple):
    """One attention's matrices as `_attend` uses them, read from either form."""

    W_K_T: Tensor  # (h, d_k, d_model): W_K[i]^T / sqrt(d_k)
    W_V: Tensor  # (h, d_model, d_v)
    b_V: Tensor | None  # (h, 1, d_v)
    W_O: Tensor  # (h*d_v, d_model): W_O[0] over ... over W_O[h-1]
    b_O: Tensor | None  # (d_model,)

    @staticmethod
    def of(attn) -> _Circuits:
        attn = float_attention(attn)  # int8 projections (quantize.py): their weights in float32, biases out
        W_K, W_V, W_O, b_V = (head_blocks(attn, name) for name in ("W_K", "W_V", "W_O", "b_V"))
        assert W_K is not None and W_V is not None and W_O is not None
        W_K_T = (W_K.transpose(1, 2) / math.sqrt(attn.d_k)).contiguous()  # (h, d_k, d_model)
        b_V = None if b_V is None else b_V.unsqueeze(1)  # (h, 1, d_v)
        return _Circuits(W_K_T, W_V.contiguous(), b_V, W_O.reshape(-1, attn.d_model), attn.b_O)


def _generator_with_bias_inside(generator) -> Callable[[Tensor], Tensor]:
    """The generator's logits y W_gen^T + b as one product [y, 1] [W_gen, b]^T (section 7); any other generator
    (`quantize.py`'s int8 one) is called as it is."""
    if not isinstance(generator, Generator):
        return generator
    W_b = torch.cat([generator.weight, generator.bias[:, None]], dim=1)  # (V, d_model + 1)
    return lambda y: F.linear(F.pad(y, (0, 1), value=1.0), W_b)  # (A*k, V)


def _self_attention(attn, c: _Circuits, inputs: list, i: int, rows: Tensor | None, z: Tensor) -> Tensor:
    """Self-attention of the newest position, z (A*w, 1, d_model), to the inputs of its beam's positions so
    far: layer i's past inputs (inputs[i], None at the first step) gathered along `rows`, z appended."""
    R, d_model = z.size(0), z.size(-1)
    t = 0 if inputs[i] is None else inputs[i].size(1)
    X = torch.empty(R, t + 1, d_model, dtype=z.dtype, device=z.device)  # (A*w, t+1, d_model)
    if t:
        assert rows is not None, "after the first step every row continues one of the step before"
        torch.index_select(inputs[i], 0, rows, out=X[:, :t])  # reordered straight into place: one copy
    X[:, t:] = z
    inputs[i] = X
    return _attend(attn, c, z, X, None, None, 1)  # (A*w, 1, d_model)


def _cross_attention(attn, c: _Circuits, sources: _Sources, w: int, z: Tensor) -> Tensor:
    """Cross-attention with the w beams of a sentence as w queries against its one copy of the memory."""
    return _attend(attn, c, z, sources.memory, sources.bias, sources.empty, w)  # (A*w, 1, d_model)


def _attend(attn, c: _Circuits, z: Tensor, X: Tensor, bias: Tensor | None, empty: Tensor | None, w: int) -> Tensor:
    """Multi-head attention of one query position, z (A*w, 1, d_model), to the inputs X (A, T, d_model)
    themselves, the w rows of block a reading X[a] (bias (A, 1, T) added to the scores; `empty` sentences,
    all padding, write nothing): (A*w, 1, d_model)."""
    R, A, h = z.size(0), X.size(0), attn.h
    q = attn.queries(z).reshape(R, h, attn.d_k).transpose(0, 1)  # (h, R, d_k) q = z W_Q[i] + b_Q[i]
    # score(b) = q W_K[i]^T x_b^T / sqrt(d_k), plus q b_K[i]^T / sqrt(d_k): the same for every b, it cancels
    q_read = torch.bmm(q, c.W_K_T).transpose(0, 1).reshape(A, w * h, -1)  # (A, w*h, d_model)
    X_T = X.transpose(1, 2)  # (A, d_model, T)
    p = _softmax(torch.bmm(q_read, X_T) if bias is None else torch.baddbmm(bias, q_read, X_T))  # (A, w*h, T)
    if empty is not None:
        p = p.masked_fill(empty.view(A, 1, 1), 0.0)  # (A, w*h, T) no key: no weight
    # head_i = sum_b p_b (x_b W_V[i] + b_V[i]) = (sum_b p_b x_b) W_V[i] + b_V[i] (the weights sum to 1)
    read = torch.bmm(p, X).view(R, h, -1).transpose(0, 1)  # (h, R, d_model) sum_b p_b x_b
    heads = torch.bmm(read, c.W_V) if c.b_V is None else torch.baddbmm(c.b_V, read, c.W_V)  # (h, R, d_v)
    if empty is not None:
        heads = heads.masked_fill(empty.repeat_interleave(w).view(1, R, 1), 0.0)  # (h, R, d_v)
    # MultiHead = Concat(head_0, ..., head_{h-1}) W_O + b_O
    concat = heads.transpose(0, 1).reshape(R, -1)  # (R, h*d_v)
    out = concat @ c.W_O if c.b_O is None else torch.addmm(c.b_O, concat, c.W_O)  # (R, d_model)
    return out.view(R, 1, -1)  # (A*w, 1, d_model)


def _softmax(scores: Tensor) -> Tensor:
    """Softmax over the last dimension, written out below 16 entries, where PyTorch's kernel is slower (section 7)."""
    if scores.size(-1) >= 16:
        return scores.softmax(dim=-1)
    e = (scores - scores.amax(dim=-1, keepdim=True)).exp_()
    return e.div_(e.sum(dim=-1, keepdim=True))


def _best_candidates(scores: Tensor, logp: Tensor, n: int) -> tuple[Tensor, Tensor, Tensor]:
    """The n best log P(y w) = log P(y) + log p(w | y) of each sentence, as `_Decoder.best`'s topk over all k*V
    finds them: (values, parent row within the sentence, token), each (A, n), best first. The topk over blocks of
    section 7: block j holds tokens j, j + blocks, ... (so that the maximum over a block runs along memory)."""
    A, k = scores.shape
    V = logp.size(-1)
    size = _block_size(V, n)
    blocks = V // size
    grid = logp.view(A * k, size, blocks)  # (A*k, size, blocks) token i*blocks + j at [., i, j]
    bound = (scores.view(A * k, 1) + grid.amax(dim=1)).view(A, k * blocks)  # (A, k*blocks) best per block
    chosen = bound.topk(n, dim=-1).indices  # (A, n) which (parent, block)
    parent_rows = torch.arange(A, device=logp.device).unsqueeze(1) * k + chosen // blocks  # (A, n)
    values = grid[parent_rows.view(-1), :, (chosen % blocks).view(-1)]  # (A*n, size)
    cand = (scores.view(A * k)[parent_rows.view(-1)].unsqueeze(1) + values).view(A, n * size)  # (A, n*size)
    top, flat = cand.topk(n, dim=-1)  # (A, n) best first
    block = chosen.gather(1, flat // size)  # (A, n) which (parent, block)
    return top, block // blocks, (flat % size) * blocks + block % blocks  # values, parents, tokens (A, n)


@functools.cache
def _block_size(V: int, n: int) -> int:
    """The divisor of V nearest below sqrt(V / n): blocks and their n chosen ones hold about as many scores."""
    target = max(1, math.isqrt(V // n))
    return max(d for d in range(1, target + 1) if V % d == 0)


# %% [markdown]
# ## 8. Translating many sentences
#
# `translate_ids` is what the rest of the project calls: lists of subword ids
# in, lists of subword ids out, greedy (`beam_size=1`) or beam search. It
# runs under `torch.inference_mode`, so PyTorch keeps no version counters or
# view records for the search's tensors
# (benchmarks/README.md#levers-one-beam-at-the-start-inference-mode); no
# tensor leaves it, so the model trains after it
# (`test_translate_ids_searches_in_inference_mode_and_the_model_trains_after_it`).
#
# **More than one thread.** Most of a beam step's few hundred operators are
# too small for PyTorch to share between threads, so on the CPU with `n`
# threads `translate_ids` searches `n` batches at once, each on one thread
# (PyTorch lets go of the interpreter inside its operators;
# benchmarks/README.md#levers-the-circuits-two-threads). Each batch is
# searched as it would be alone: the translations are those of one thread,
# in input order
# (`test_translate_ids_on_two_threads_runs_two_batches_at_once_and_translates_the_same`).
# Inference mode belongs to a thread, so each batch enters it
# (`_translate_batch`).


# %%
def translate_ids(
    model: EncoderDecoder,
    sources: list[list[int]],
    beam_size: int = Decoding.beam,
    length_penalty: float = Decoding.length_penalty,
    batch_size: int = 64,
    max_extra: int = Decoding.max_extra,
    device: torch.device | None = None,
    progress: bool = False,
    nbest: int = 0,
    fast: bool = True,
) -> list:
    """Translate subword-id sequences; returns output ids (up to, not including, eos), in input order. With `nbest`
    n >= 1 (at most `beam_size`), each sentence's n best `Hypothesis` instead (`beam_search`'s lists), ids so cut.

    Sentences go in batches of similar length; a source longer than the model's `max_len` is cut to it, and an
    output is at most `min(max_len, S + max_extra)` subwords for a source of `S`. `beam_size=1` is greedy, its one
    hypothesis scored by teacher forcing (`sequence_logprob`). `fast` as in `beam_search`.
    """
    check_sources(model, sources, batch_size, max_extra)
    check_beam(beam_size, length_penalty)
    _check_nbest(nbest, beam_size)
    device = device or next(model.parameters()).device
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    settings = (beam_size, length_penalty, max_extra, device, nbest, fast)
    translate = functools.partial(_translate_batch, model, sources, *settings)
    workers = min(torch.get_num_threads(), len(batches)) if device.type == "cpu" else 1
    out: list = [[] for _ in sources]
    with _side_by_side(workers) as run:
        results = run(translate, batches)
        if progress:
            from tqdm.auto import tqdm

            results = tqdm(results, total=len(batches), desc="translate", leave=False)
        for idx, outputs in zip(batches, results):
            for i, ids in zip(idx, outputs):
                out[i] = ids
    return out


@torch.inference_mode()
def _translate_batch(model, sources, beam_size, length_penalty, max_extra, device, nbest, fast, idx) -> list:
    """`translate_ids` of the sources `idx`, one batch (inference mode is per thread: entered here)."""
    limit = model.config.max_len
    seqs = [sources[i][:limit] for i in idx]
    src = padded(seqs, width=1).to(device)  # (B, S)
    S = src.size(1)
    max_len = min(limit, S + max_extra)
    mask = padding_mask(src, PAD)  # (B, 1, S)
    if beam_size > 1:  # the batch is well formed by construction: checked once, in translate_ids
        found = _hypotheses(model, src, mask, max_len, beam_size, length_penalty, BOS, EOS, True, fast)
        hyps = [[h._replace(ids=_cut(h.ids)) for h in f[: max(nbest, 1)]] for f in found]
        return hyps if nbest else [f[0].ids for f in hyps]
    ys = greedy_decode(model, src, mask, max_len, BOS, EOS, PAD)
    out = [_cut(row) for row in ys.tolist()]
    if not nbest:
        return out
    logP, lengths = sequence_logprob(model, src, mask, ys)  # (B,) each: greedy's own, by teacher forcing
    return [
        [Hypothesis(ids, p, p / gnmt_lp(n, length_penalty))] for ids, p, n in zip(out, logP.tolist(), lengths.tolist())
    ]


def _cut(ids: list[int]) -> list[int]:
    """The ids up to, not including, eos; without eos, the pad removed."""
    return ids[: ids.index(EOS)] if EOS in ids else [t for t in ids if t != PAD]


@contextlib.contextmanager
def _side_by_side(workers: int) -> Iterator[Callable]:
    """A `map` running `workers` calls at once, each on one of PyTorch's threads (its thread count is 1
    inside the block and back to what it was after); with one worker, the plain `map`."""
    if workers <= 1:
        yield map
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # each batch on one thread: the threads started below read this
    try:
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="translate") as pool:
            yield pool.map
    finally:
        torch.set_num_threads(threads)
