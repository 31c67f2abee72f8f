"""annotated/training/results.py and runs.py: `averaged.pt` is the element-wise mean of exactly the last
`average_last` epoch checkpoints (the smoke preset never averages, so its run cannot show it)."""

import dataclasses

import pytest
import torch

from annotated.checkpoint import read_checkpoint, save_checkpoint
from annotated.run_folder import epoch_files
from annotated.training import train
from annotated.training.results import checkpoints_to_test
from annotated.transformer import make_model


@pytest.mark.parametrize("average_last, epochs", [(3, 5), (2, 2), (5, 3)])
def test_averaged_is_the_mean_of_exactly_the_last_epochs(average_last, epochs, tmp_path):
    """Epoch checkpoints with different random parameters; averaged.pt holds, for every parameter, the mean of
    the last `average_last` of them (all of them when fewer exist), to float32 rounding of the float64 mean."""
    cfg = dataclasses.replace(train.PRESETS["smoke"], average_last=average_last)
    states = []
    for epoch in range(1, epochs + 1):
        torch.manual_seed(epoch)
        model = make_model(src_vocab=11, tgt_vocab=11, N=1, d_model=8, d_ff=16, h=2, dropout=0.0, max_len=16)
        save_checkpoint(tmp_path / f"epoch{epoch}.pt", model, None, {"epoch": epoch})
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    save_checkpoint(tmp_path / "best.pt", model, None, {"epoch": epochs})
    paths = checkpoints_to_test(cfg, tmp_path)
    assert set(paths) == {"best", "averaged"}
    averaged = read_checkpoint(paths["averaged"])["model"]
    last = states[-average_last:]
    for name, value in averaged.items():
        mean = (sum(s[name].double() for s in last) / len(last)).float()
        assert torch.equal(value, mean), name
    assert read_checkpoint(paths["averaged"])["meta"]["averaged"] == [
        str(tmp_path / f"epoch{e}.pt") for e in range(max(1, epochs - average_last + 1), epochs + 1)
    ]


def test_epoch_files_are_ordered_by_epoch_not_by_name(tmp_path):
    """epoch7.pt ... epoch11.pt kept (a run resumed with a smaller average_last leaves more than it averages),
    average_last 3: averaged.pt is the mean of epochs 9, 10 and 11, listed in that order, with epoch 11's meta.
    By name, epoch10.pt and epoch11.pt sort before epoch7.pt, and the last three would be epochs 7, 8 and 9."""
    cfg = dataclasses.replace(train.PRESETS["smoke"], average_last=3)
    states = {}
    for epoch in range(7, 12):
        torch.manual_seed(epoch)
        model = make_model(src_vocab=11, tgt_vocab=11, N=1, d_model=8, d_ff=16, h=2, dropout=0.0, max_len=16)
        save_checkpoint(tmp_path / f"epoch{epoch}.pt", model, None, {"epoch": epoch})
        states[epoch] = model.state_dict()
    save_checkpoint(tmp_path / "best.pt", model, None, {"epoch": 11})
    assert epoch_files(tmp_path) == [tmp_path / f"epoch{e}.pt" for e in range(7, 12)]
    averaged = read_checkpoint(checkpoints_to_test(cfg, tmp_path)["averaged"])
    assert averaged["meta"]["averaged"] == [str(tmp_path / f"epoch{e}.pt") for e in (9, 10, 11)]
    assert averaged["meta"]["epoch"] == 11
    for name, value in averaged["model"].items():
        mean = (sum(states[e][name].double() for e in (9, 10, 11)) / 3).float()
        assert torch.equal(value, mean), name
