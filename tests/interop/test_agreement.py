"""A trained checkpoint and its MarianMTModel export on real test sentences (annotated/interop/agreement.py).

Runs on $ANNOTATED_CHECKPOINT, else on the latest run's model under runs/, else on the shipped de -> en model
(`annotated/shipped/`, the commands' own rule): never skipped.
"""

import os
from pathlib import Path

import pytest

pytest.importorskip("transformers")
from annotated.interop.agreement import compare
from annotated.shipped import choose_checkpoint

REPO = Path(__file__).resolve().parents[2]


def test_a_trained_checkpoint_and_its_export_agree(data_url):
    checkpoint = choose_checkpoint(os.environ.get("ANNOTATED_CHECKPOINT"), REPO / "runs")
    result = compare(checkpoint, sentences=200, hf_length_penalties=(), data_url=data_url)  # no penalty only
    print(result)
    assert result["max_abs_logit_difference"]["float64"] <= 1e-9
    assert result["max_abs_logit_difference"]["float32"] <= 1e-4
    same_search = result["no length penalty"]  # alpha = 0 on both sides: one search, so the same translations
    assert same_search["identical"] >= 0.99
    assert abs(same_search["our BLEU"] - same_search["generate BLEU"]) <= 0.1
