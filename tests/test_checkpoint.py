"""annotated/checkpoint.py: round trip, atomic writes, clear errors."""
import os
import stat

import pytest
import torch

from annotated.checkpoint import CheckpointError, atomic_torch_save, load_checkpoint, read_checkpoint, save_checkpoint
from annotated.transformer import make_model


def tiny_model(**kw):
    torch.manual_seed(0)
    return make_model(**dict(dict(src_vocab=11, tgt_vocab=11, N=1, d_model=8, d_ff=16, h=2), **kw))


def test_round_trip_restores_config_and_parameters(tmp_path):
    m = tiny_model(attention="per_head", norm="pre")
    save_checkpoint(tmp_path / "a.pt", m, None, {"src_lang": "de"})
    back, tok, meta = load_checkpoint(tmp_path / "a.pt")
    assert back.config == m.config and tok is None and meta == {"src_lang": "de"}
    assert not back.training
    for (n1, p1), (n2, p2) in zip(m.state_dict().items(), back.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)


def test_missing_truncated_and_foreign_files_name_the_file(tmp_path):
    with pytest.raises(CheckpointError, match="nope.pt: no such file"):
        load_checkpoint(tmp_path / "nope.pt")
    save_checkpoint(tmp_path / "a.pt", tiny_model(), None)
    data = (tmp_path / "a.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="cut.pt is corrupt"):
        load_checkpoint(tmp_path / "cut.pt")
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="other.pt is not an annotated checkpoint"):
        load_checkpoint(tmp_path / "other.pt")


def test_parameters_that_do_not_fit_the_config_are_reported(tmp_path):
    save_checkpoint(tmp_path / "a.pt", tiny_model(), None)
    state = read_checkpoint(tmp_path / "a.pt")
    state["config"]["d_ff"] = 32
    torch.save(state, tmp_path / "b.pt")
    with pytest.raises(CheckpointError, match="b.pt: parameters do not match its config"):
        load_checkpoint(tmp_path / "b.pt")


def test_failed_write_keeps_the_previous_file(tmp_path):
    path = tmp_path / "a.pt"
    save_checkpoint(path, tiny_model(), None, {"version": 1})

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("boom in the middle of the write")

    with pytest.raises(RuntimeError, match="boom"):
        atomic_torch_save({"format": "x", "big": torch.zeros(1000), "bad": Unpicklable()}, path)
    assert load_checkpoint(path)[2] == {"version": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pt"]  # no temporary file left


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_checkpoints_get_the_mode_a_plain_open_would_give(tmp_path, umask):
    """Written through a private temporary file, but renamed into place with 0o666 less the umask."""
    old = os.umask(umask)
    try:
        save_checkpoint(tmp_path / "a.pt", tiny_model(), None)
        with open(tmp_path / "plain", "w"):
            pass
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.pt").stat().st_mode) == stat.S_IMODE((tmp_path / "plain").stat().st_mode)
    assert stat.S_IMODE((tmp_path / "a.pt").stat().st_mode) == 0o666 & ~umask
