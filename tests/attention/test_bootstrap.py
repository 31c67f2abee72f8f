"""annotated/attention/bootstrap.py: the interval is the central 95% of the resampled changes, and a loss change
is per token over all sentences."""

import numpy as np

from annotated.attention.bootstrap import paired_loss_change, resample_counts


def sentences(seed: int = 0, n: int = 40):
    """Per sentence summed losses and token counts, of very different lengths; b worse on long sentences."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(2, 60, size=n).astype(float)
    loss_a = tokens * rng.uniform(1.5, 2.5, size=n)
    loss_b = loss_a + tokens * (tokens > 30) * 0.5 + rng.normal(0, 1, size=n)
    return loss_a, tokens, loss_b, tokens


def test_the_interval_is_the_central_95_percent_of_the_resampled_changes():
    la, ta, lb, tb = sentences()
    change = paired_loss_change(la, ta, lb, tb, resamples=1000, seed=3)
    counts = resample_counts(len(la), 1000, 3)  # the same resamples (same seed)
    samples = (counts @ lb) / (counts @ tb) - (counts @ la) / (counts @ ta)
    inside = np.mean((samples >= change.low) & (samples <= change.high))
    assert 0.945 <= inside <= 0.955  # 95% of 1000 resamples inside, within the percentile's interpolation
    assert np.mean(samples < change.low) == np.mean(samples > change.high) == 0.025  # the same tail each side


def test_a_loss_change_is_per_token_over_all_sentences():
    """Not the mean of per-sentence means: the two differ when b is worse on the long sentences only."""
    la, ta, lb, tb = sentences()
    change = paired_loss_change(la, ta, lb, tb, resamples=50)
    per_token = lb.sum() / tb.sum() - la.sum() / ta.sum()
    mean_of_means = np.mean(lb / tb) - np.mean(la / ta)
    assert abs(per_token - mean_of_means) > 0.05  # the test can tell them apart
    assert change.value == per_token
