"""benchmarks/translate.py: every tool runs and translates, and the CTranslate2 conversion is our model.

No speed is asserted: the benchmark prints ratios measured in one run.
"""

import json
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
ctranslate2 = pytest.importorskip("ctranslate2")
from tiny import DE_EN, SENTENCES, tiny_translator

from annotated.checkpoint import save_checkpoint
from annotated.interop.folders import write_ctranslate2_layout
from annotated.tokens import BOS, EOS, PAD
from annotated.transformer import padding_mask, subsequent_mask
from benchmarks import translate as bench


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("bench")
    model, tokenizer = tiny_translator(SENTENCES * 20, 300, folder, N=2, h=4, max_len=256, noise=0.3)
    with torch.no_grad():
        model.generator.bias[EOS] += 3.0  # translations that end
    save_checkpoint(folder / "model.pt", model, tokenizer, DE_EN)
    return folder / "model.pt"


def test_ctranslate2_scores_tokens_as_our_model_does(checkpoint, tmp_path):
    from annotated.checkpoint import load_checkpoint

    model, tokenizer, _ = load_checkpoint(checkpoint)
    layout = write_ctranslate2_layout(model, None, tokenizer, {}, tmp_path / "layout")
    converted = bench.convert_ctranslate2(layout, tmp_path / "ct2", None)
    engine = ctranslate2.Translator(str(converted), device="cpu", intra_threads=1)
    src, tgt = tokenizer.encode(SENTENCES[0]), tokenizer.encode(SENTENCES[3]) + [EOS]
    theirs = engine.score_batch([tokenizer.pieces(src)], [tokenizer.pieces(tgt[:-1])])[0].log_probs
    s, t = torch.tensor([src]), torch.tensor([[BOS] + tgt[:-1]])
    with torch.no_grad():
        logp = model(s, t, padding_mask(s, PAD), subsequent_mask(t.size(1))).log_softmax(-1)[0]  # (T, V)
    ours = logp.gather(-1, torch.tensor(tgt)[:, None])[:, 0]
    assert len(theirs) == len(tgt) and (ours - torch.tensor(theirs)).abs().max() <= 1e-4


def test_every_tool_translates(checkpoint, data_url):
    result = bench.measure(checkpoint, sentences=5, threads=1, rounds=2, data_url=data_url)
    rows = result["rows"]
    assert list(rows) == [
        "translator (stdin)",
        "translate_ids",
        "translator int8 (stdin)",
        "translate_ids int8",
        "generate",
        "CTranslate2 float32",
        "CTranslate2 int8",
    ]
    assert rows["CTranslate2 float32"]["x CTranslate2 float32"] == 1.0
    assert rows["CTranslate2 int8"]["x CTranslate2 same precision"] == 1.0
    assert rows["CTranslate2 float32"]["BLEU - own float32"] == rows["translate_ids"]["BLEU - own float32"] == 0
    for name, own in (("translate_ids int8", "translate_ids"), ("CTranslate2 int8", "CTranslate2 float32")):
        assert rows[name]["BLEU - own float32"] == round(rows[name]["bleu"] - rows[own]["bleu"], 2)
    assert all(row["sentences_per_s"] > 0 for row in rows.values())
    for name, row in rows.items():  # each tool's speed is its fastest round's
        assert len(result["seconds"][name]) == 2
        assert row["sentences_per_s"] == round(5 / min(result["seconds"][name]), 1)
    assert "| translate_ids int8 |" in bench.table(result) and "load average" in bench.table(result)


def test_on_two_threads_ctranslate2_runs_in_its_faster_configuration(checkpoint, data_url):
    """On n > 1 threads CTranslate2 is timed both as `intra_threads=n` and as `inter_threads=n` (batches side
    by side, as ours), in the same rounds; its row is the faster configuration's and names it, as every row
    names how its tool used the threads."""
    result = bench.measure(checkpoint, sentences=5, threads=2, rounds=2, data_url=data_url, int8=False)
    rows, seconds = result["rows"], result["seconds"]
    assert rows["translate_ids"]["threads"] == "2 batches side by side, 1 thread each"
    assert rows["generate"]["threads"] == "2 PyTorch thread(s)"
    for name in ("CTranslate2 float32", "CTranslate2 int8"):
        both = {inter: seconds[f"{name}, intra_threads={2 // inter}, inter_threads={inter}"] for inter in (1, 2)}
        assert all(len(s) == 2 for s in both.values())
        faster = min(both, key=lambda inter: min(both[inter]))
        assert rows[name]["threads"] == f"intra_threads={2 // faster}, inter_threads={faster}"
        assert rows[name]["sentences_per_s"] == round(5 / min(both[faster]), 1)
    assert "| CTranslate2 int8 | intra_threads=" in bench.table(result)


def test_the_cpu_clock_times_a_run_by_its_process_cpu_time(monkeypatch):
    """`--clock cpu` reads `time.process_time` (what other jobs take from the process is not counted), the
    default clock the wall clock; a run is timed between two readings of its clock."""
    readings = iter([10.0, 12.5])
    monkeypatch.setitem(bench.CLOCKS, "cpu", lambda: next(readings))
    assert bench.timed(lambda: ["a text"], "cpu") == (2.5, ["a text"])
    monkeypatch.undo()
    assert bench.CLOCKS["cpu"] is time.process_time and bench.CLOCKS["wall"] is time.perf_counter


def test_the_cpu_clock_is_refused_on_more_than_one_thread(capsys):
    """On n > 1 threads a process's CPU time adds its threads up, which is not how long a run took: refused
    in one line, before any model or data is loaded."""
    with pytest.raises(SystemExit) as stop:
        bench.main(["--clock", "cpu", "--threads", "2"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "--clock cpu adds up the CPU time of every thread" in err


@pytest.mark.parametrize(
    "given, message",
    [
        ("nothing.pt", "translate-bench: error: checkpoint nothing.pt: no such file"),
        ("shipped:xx-yy", "translate-bench: error: there is no shipped xx->yy model"),
    ],
)
def test_the_checkpoint_is_chosen_by_the_commands_one_rule(given, message, capsys, monkeypatch, tmp_path):
    """`--checkpoint shipped:de-en` names a shipped model, as in every command (`choose_checkpoint`); a wrong
    name is one line and exit 2, before any model or data is loaded."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        bench.main(["--checkpoint", given])
    assert stop.value.code == 2 and capsys.readouterr().err.startswith(message)


def test_a_tool_in_its_own_process_translates_as_it_does_here(checkpoint, tmp_path):
    """`--processes each`: the worker process (`python -m benchmarks.translate --worker ...`) times one run
    and returns the same translations as the tool run in this process."""
    from annotated.checkpoint import load_checkpoint

    tokenizer = load_checkpoint(checkpoint)[1]
    texts = SENTENCES[:4]
    sources = [tokenizer.encode(s) for s in texts]
    bench.prepare(checkpoint, tmp_path)
    (tmp_path / "inputs.json").write_text(json.dumps({"sources": sources, "texts": texts}))
    seconds, there = bench.in_its_own_process("translate_ids", checkpoint, tmp_path, threads=1)
    here = bench.tool("translate_ids", checkpoint, tmp_path, sources, texts, threads=1)()
    assert here != here[::-1]  # a mix-up of order would show
    assert seconds > 0 and there == here and len(here) == 4
