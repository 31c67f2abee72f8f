"""annotated/training/add_case_table.py: a copy of an older checkpoint with its training data's case table."""

import pytest

from annotated.decoding import casing
from annotated.training import add_case_table


def test_the_command_writes_a_copy_with_the_training_datas_table_and_never_overwrites(
    tmp_path, data_url, cache, monkeypatch, capsys
):
    """`python -m annotated.training.add_case_table`: a new file with the table of Multi30k train (source side); the
    checkpoint it reads is left as it was; an existing --out is refused."""
    from annotated.checkpoint import read_case_table, save_checkpoint
    from annotated.training.data import load_multi30k
    from annotated.transformer import make_model

    monkeypatch.setenv("MULTI30K_URL", data_url)
    monkeypatch.setenv("ANNOTATED_CACHE", str(cache))
    old, new = tmp_path / "old.pt", tmp_path / "new.pt"
    save_checkpoint(
        old,
        make_model(src_vocab=8, tgt_vocab=8, N=1, d_model=8, d_ff=8, h=2),
        None,
        {"src_lang": "de", "tgt_lang": "en"},
    )
    before = old.read_bytes()
    assert add_case_table.main(["--checkpoint", str(old), "--out", str(new)]) == 0
    assert old.read_bytes() == before and read_case_table(old) is None
    sources = [s for s, _ in load_multi30k("train", "de", "en", cache_dir=cache, base_url=data_url)]
    assert read_case_table(new) == casing.case_table(sources)
    with pytest.raises(SystemExit) as stop:
        add_case_table.main(["--checkpoint", str(old), "--out", str(new)])
    assert stop.value.code == 2 and "exists and is not overwritten; name a new file" in capsys.readouterr().err
