"""The door, annotated/checks.py: every entry point refuses bad input with one clear
ValueError (or CheckpointError) before any model work, and every check in it serves an entry point.

The tests call the entry points, never the checks themselves. "Before any model work" is shown
by a model whose encoder must not run: `encode` raises if it is reached.
"""

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

from annotated.attention.dump import collect_attention
from annotated.checkpoint import CheckpointError, save_checkpoint
from annotated.decoding.search import beam_search, greedy, translate_ids
from annotated.proof.equivalence import compare_model_forms
from annotated.proof.torch_mha import from_torch_mha
from annotated.transformer import make_model

REPO = Path(__file__).resolve().parents[1]
CHECKS = REPO / "annotated" / "checks.py"


def untouchable_model(max_len=8):
    """A small model whose encoder raises when reached: a refusal must come first."""
    m = make_model(src_vocab=11, tgt_vocab=13, N=1, d_model=8, d_ff=16, h=2, dropout=0.0, max_len=max_len).eval()

    def encode(*args, **kwargs):
        raise AssertionError("the model ran before the door refused the input")

    m.encode = encode
    return m


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda m: greedy(m, torch.tensor([[3, 11]]), None, 4), r"src token ids must lie in \[0, 11\)"),
        (lambda m: beam_search(m, torch.full((1, 9), 3), None, 4), "source length 9 exceeds the model's max_len=8"),
        (lambda m: beam_search(m, torch.full((1, 3), 3), None, 4, beam_size=0), "beam_size must be an int >= 1"),
        (lambda m: greedy(m, torch.full((1, 3), 3), torch.ones(1, 1, 3), 4), "src_mask must be a bool tensor"),
        (lambda m: translate_ids(m, [[3, 4], [-1]]), r"source 1 holds ids outside \[0, 11\)"),
        (
            lambda m: compare_model_forms(m, torch.full((2, 3), 3), torch.full((3, 3), 3), 4),
            "batch sizes differ: 2 source sentences, 3 target sentences",
        ),
        (
            lambda m: compare_model_forms(m, torch.full((1, 3), 3), torch.full((1, 9), 3), 4),
            "target length 9 exceeds the model's max_len=8",
        ),
        (
            lambda m: compare_model_forms(m, torch.full((1, 3), 3), torch.full((1, 3), 13), 4),
            r"target ids must lie in \[0, 13\)",
        ),
        (lambda m: collect_attention(m, [3, 0], [4]), r"source holds ids outside \[0, 11\) or the pad id 0"),
        (lambda m: collect_attention(m, [3], []), "target is empty"),
        (lambda m: collect_attention(m.train(), [3], [4]), "collect_attention needs the model in eval mode"),
    ],
)
def test_entry_points_refuse_bad_input_before_any_model_work(call, message):
    with pytest.raises(ValueError, match=message):
        call(untouchable_model())


@pytest.mark.parametrize(
    "module, message",
    [
        (nn.Linear(8, 8), "expected a torch.nn.MultiheadAttention, got Linear"),
        (nn.MultiheadAttention(8, 2, kdim=4, vdim=4), r"kdim=4, vdim=4 != embed_dim=8"),
        (nn.MultiheadAttention(8, 2, add_bias_kv=True), "add_bias_kv=True or add_zero_attn=True"),
    ],
)
def test_from_torch_mha_refuses_what_our_attentions_cannot_hold(module, message):
    with pytest.raises(ValueError, match=message):
        from_torch_mha(module)


def test_a_checkpoint_without_tokenizer_is_refused_by_every_command_on_text(tmp_path, capsys):
    from annotated.attention import dump, heads
    from annotated.decoding import translate

    path = tmp_path / "no_tokenizer.pt"
    save_checkpoint(path, make_model(src_vocab=11, tgt_vocab=13, N=1, d_model=8, d_ff=16, h=2), None)
    with pytest.raises(CheckpointError, match=f"checkpoint {path} holds no tokenizer, so it cannot turn sentences"):
        dump.dump(path, ["ein Satz"], tmp_path / "out")
    assert heads.main(["--checkpoint", str(path), "--out", str(tmp_path / "heads")]) == 2
    assert capsys.readouterr().err.endswith(f"checkpoint {path} holds no tokenizer, so it cannot be evaluated\n")
    assert translate.main(["--checkpoint", str(path), "ein Satz"]) == 2
    assert capsys.readouterr().err.endswith(f"checkpoint {path} holds no tokenizer, so it cannot translate text\n")
    assert not (tmp_path / "out").exists() and not (tmp_path / "heads").exists()


def test_every_check_serves_an_entry_point():
    """A check no entry point calls is deleted, not kept for tests: each is called in annotated/ outside checks.py."""
    tree = ast.parse(CHECKS.read_text(encoding="utf-8"))
    checks = [f.name for f in tree.body if isinstance(f, ast.FunctionDef) and not f.name.startswith("_")]
    sources = {p: p.read_text(encoding="utf-8") for p in (REPO / "annotated").rglob("*.py") if p != CHECKS}
    internal = CHECKS.read_text(encoding="utf-8")
    for name in checks:
        callers = [p for p, text in sources.items() if f"{name}(" in text]
        used_inside = internal.count(f"{name}(") > 1 + internal.count(f">>> {name}(")  # called by another check
        assert callers or used_inside, f"{name} is called by no entry point"
