"""A trained checkpoint and its MarianMTModel export on real test sentences (annotated/interop/agreement.py).

Runs on $ANNOTATED_CHECKPOINT, else on the model of the latest run under runs/; skipped only where neither exists.
"""
import os
from pathlib import Path

import pytest

pytest.importorskip("transformers")
from annotated.interop.agreement import compare
from annotated.plumbing.checkpoint import CheckpointError
from annotated.training.runs import latest_checkpoint

REPO = Path(__file__).resolve().parents[2]


def trained_checkpoint() -> Path | None:
    if os.environ.get("ANNOTATED_CHECKPOINT"):
        return Path(os.environ["ANNOTATED_CHECKPOINT"])
    try:
        return latest_checkpoint(REPO / "runs")
    except CheckpointError:
        return None


def test_a_trained_checkpoint_and_its_export_agree(data_url):
    checkpoint = trained_checkpoint()
    if checkpoint is None:
        pytest.skip("no trained checkpoint: set ANNOTATED_CHECKPOINT or train one (make train)")
    result = compare(checkpoint, sentences=200, data_url=data_url)
    print(result)
    assert result["max_abs_logit_difference"]["float64"] <= 1e-9
    assert result["max_abs_logit_difference"]["float32"] <= 1e-4
    same_search = result["no length penalty"]  # alpha = 0 on both sides: one search, so the same translations
    assert same_search["identical"] >= 0.99
    assert abs(same_search["our BLEU"] - same_search["generate BLEU"]) <= 0.1
