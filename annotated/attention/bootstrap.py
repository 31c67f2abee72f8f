# %% [markdown]
# # How sure is a change? Paired bootstrap intervals
#
# Removing a head changes validation BLEU by a point or two on a few hundred
# sentences, and so does the choice of those sentences. A change is worth
# reading only with its uncertainty. We use the **paired bootstrap** (Koehn,
# EMNLP 2004): draw `n` sentence indices with replacement from the `n`
# sentences, score *both* systems (the model with every head, and the model
# without one) on that same sample, and keep the difference. Repeated
# `resamples` times (1000 by default), the 2.5th and 97.5th percentiles of
# the differences are the 95% interval of the change. Both systems always see
# the same resampled sentences, which is what makes the test *paired*: the
# sentences that are hard for both cancel out.
#
# **BLEU** is a corpus score, not an average of sentence scores: the n-gram
# matches and lengths are summed over the corpus, and BLEU is computed once
# from the sums. So each sentence is reduced to sacreBLEU's own statistics
# (hypothesis length, reference length, matches and totals for 1- to 4-grams),
# a resample sums them with the multiplicity each sentence was drawn with,
# and sacreBLEU computes corpus BLEU from the sums, exactly as it does from a
# corpus (`test_bleu_of_all_sentences_is_sacrebleus_corpus_bleu`).
#
# **Loss** is cross-entropy per target token: per sentence, the summed loss
# and the number of tokens; a resample's loss is the ratio of the two sums.
#
# The resamples come from one seeded generator, so the same seed gives the
# same interval, and every head's change is measured on the same resamples.

# %%
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

RESAMPLES = 1000
CONFIDENCE = 0.95
SEED = 0


@dataclass(frozen=True)
class Change:
    """`value` = (system b) - (system a) on all sentences; [low, high] its bootstrap interval."""

    value: float
    low: float
    high: float

    @property
    def significant(self) -> bool:
        """False when the interval contains 0: the data do not tell the change from no change."""
        return not self.low <= 0.0 <= self.high


def resample_counts(n: int, resamples: int = RESAMPLES, seed: int = SEED) -> np.ndarray:
    """(resamples, n): how often each of the `n` sentences is drawn in each resample of `n` draws.

    >>> c = resample_counts(5, resamples=3, seed=1)
    >>> c.shape, c.sum(axis=1).tolist()
    ((3, 5), [5, 5, 5])
    """
    if n < 1 or resamples < 1:
        raise ValueError(f"a bootstrap needs at least one sentence and one resample, got n={n}, resamples={resamples}")
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, n, size=(resamples, n))  # (R, n) sentence indices
    return np.stack([np.bincount(row, minlength=n) for row in draws])  # (R, n)


def _interval(value: float, samples: np.ndarray) -> Change:
    tail = 100 * (1 - CONFIDENCE) / 2
    low, high = np.percentile(samples, [tail, 100 - tail])
    return Change(float(value), float(low), float(high))


# %% [markdown]
# ## BLEU


# %%
def bleu_statistics(hypotheses: list[str], references: list[str]) -> np.ndarray:
    """(n, 10) sacreBLEU statistics per sentence: hyp length, ref length, 4 match counts, 4 totals."""
    from sacrebleu.metrics import BLEU

    if len(hypotheses) != len(references) or not hypotheses:
        raise ValueError(
            f"need as many hypotheses as references, at least one: got {len(hypotheses)} and {len(references)}"
        )
    # the statistics sacreBLEU sums in corpus_score (and its own paired bootstrap resamples)
    return np.array(BLEU()._extract_corpus_statistics(hypotheses, [references]), dtype=np.int64)  # (n, 10)


def bleu_from_statistics(sums: np.ndarray) -> float:
    """Corpus BLEU (sacreBLEU's defaults: cased, 13a, exp smoothing) from summed (10,) statistics."""
    from sacrebleu.metrics import BLEU

    s = [int(x) for x in sums]
    return BLEU.compute_bleu(correct=s[2:6], total=s[6:10], sys_len=s[0], ref_len=s[1], smooth_method="exp").score


def resampled_bleu(stats: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """(R,) corpus BLEU of each resample: `counts` (R, n) from `resample_counts`, `stats` (n, 10)."""
    return np.array([bleu_from_statistics(row) for row in counts @ stats])  # (R, 10) sums -> (R,)


def paired_bleu_change(
    hyps_a: list[str], hyps_b: list[str], references: list[str], resamples: int = RESAMPLES, seed: int = SEED
) -> Change:
    """BLEU(b) - BLEU(a) on all sentences, and its paired bootstrap interval.

    >>> refs = ["a dog runs.", "two men talk."]
    >>> paired_bleu_change(refs, refs, refs, resamples=50)
    Change(value=0.0, low=0.0, high=0.0)
    """
    a, b = bleu_statistics(hyps_a, references), bleu_statistics(hyps_b, references)
    counts = resample_counts(len(references), resamples, seed)
    value = bleu_from_statistics(b.sum(0)) - bleu_from_statistics(a.sum(0))
    return _interval(value, resampled_bleu(b, counts) - resampled_bleu(a, counts))


# %% [markdown]
# ## Loss


# %%
def paired_loss_change(
    loss_a: np.ndarray,
    tokens_a: np.ndarray,
    loss_b: np.ndarray,
    tokens_b: np.ndarray,
    resamples: int = RESAMPLES,
    seed: int = SEED,
) -> Change:
    """Loss per token of b minus that of a: per sentence summed losses (n,) and token counts (n,).

    >>> one = np.ones(4)
    >>> paired_loss_change(one, one, 2 * one, one, resamples=20)
    Change(value=1.0, low=1.0, high=1.0)
    """
    arrays = [np.asarray(x, dtype=np.float64) for x in (loss_a, tokens_a, loss_b, tokens_b)]
    if len({len(x) for x in arrays}) != 1:
        raise ValueError(
            f"paired losses need one value per sentence for both systems, got lengths {[len(x) for x in arrays]}"
        )
    la, ta, lb, tb = arrays
    counts = resample_counts(len(la), resamples, seed)  # (R, n)
    value = lb.sum() / tb.sum() - la.sum() / ta.sum()
    return _interval(value, (counts @ lb) / (counts @ tb) - (counts @ la) / (counts @ ta))


# %% [markdown]
# ## A mean over sentences
#
# Not every measure compares two systems: the circuits' faithfulness
# (`annotated/circuits/faithfulness.py`) is one number per sentence, and its
# interval is that of the mean, over the same kind of resamples.


# %%
def mean_interval(values: np.ndarray, resamples: int = RESAMPLES, seed: int = SEED) -> Change:
    """The mean of per-sentence `values` (n,) and its bootstrap interval.

    >>> mean_interval(np.array([0.5, 0.5, 0.5]), resamples=10)
    Change(value=0.5, low=0.5, high=0.5)
    """
    values = np.asarray(values, dtype=np.float64)
    counts = resample_counts(len(values), resamples, seed)  # (R, n)
    return _interval(values.mean(), counts @ values / len(values))
