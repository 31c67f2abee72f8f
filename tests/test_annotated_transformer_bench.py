"""benchmarks/annotated_transformer.py: only the model definitions of the file are run, a wrong file is one clear
error, and both steps train. The real file is not in the repository; a stand-in with its interface is.

No speed is asserted: the command prints ratios measured in one run.
"""

import pytest
import torch

from benchmarks import annotated_transformer as bench

# A stand-in with the Annotated Transformer's interface (make_model, subsequent_mask, model(src, tgt, masks),
# model.generator.proj), and top-level statements that must never run.
STAND_IN = """
import torchtext  # the real file's pipeline, which no longer installs: never imported here
raise SystemExit("the whole file ran")

def subsequent_mask(size):
    return torch.triu(torch.ones(1, size, size), diagonal=1) == 0

class Generator(nn.Module):
    def __init__(self, d_model, vocab):
        super().__init__()
        self.proj = nn.Linear(d_model, vocab)

class EncoderDecoder(nn.Module):
    def __init__(self, vocab, d_model):
        super().__init__()
        self.src, self.tgt = nn.Embedding(vocab, d_model), nn.Embedding(vocab, d_model)
        self.generator = Generator(d_model, vocab)

    def forward(self, src, tgt, src_mask, tgt_mask):
        assert src_mask.dtype == tgt_mask.dtype == torch.bool and tgt_mask.shape[-2:] == (tgt.size(1),) * 2
        return self.tgt(tgt) + self.src(src).mean(dim=1, keepdim=True)

def make_model(src_vocab, tgt_vocab, N=6, d_model=512, d_ff=2048, h=8, dropout=0.1):
    return EncoderDecoder(src_vocab, d_model)
""" + "".join(
    f"\ndef {name}():\n    pass\n"
    for name in bench.DEFINITIONS
    if name not in ("subsequent_mask", "Generator", "EncoderDecoder", "make_model")
)


def test_only_the_model_definitions_run_and_both_steps_train(tmp_path):
    source = tmp_path / "the_annotated_transformer.py"
    source.write_text(STAND_IN, encoding="utf-8")
    defs = bench.load_definitions(source)  # neither the import nor the SystemExit ran
    assert set(bench.DEFINITIONS) <= set(defs)
    r = bench.compare(defs, "cpu", rounds=1, window=0.01)
    assert r["tokens_per_second"]["ours"] > 0 and r["tokens_per_second"]["theirs"] > 0
    assert r["ours_over_theirs"] == r["ratios"][0] > 0
    v, d = 5000, 128  # the cpu size: two embedding tables and the projection
    assert r["parameters"]["theirs"] == 2 * v * d + d * v + v


def test_a_missing_or_wrong_source_is_one_line_naming_the_fix(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--source", str(tmp_path / "nowhere.py")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "no such file" in err and bench.URL in err
    wrong = tmp_path / "wrong.py"
    wrong.write_text("def make_model():\n    pass\n", encoding="utf-8")
    with pytest.raises(bench.SourceError, match=r"lacks .*EncoderDecoder.*is it https://"):
        bench.load_definitions(wrong)
    wrong.write_bytes(b"def (:\n")
    with pytest.raises(bench.SourceError, match="not Python source"):
        bench.load_definitions(wrong)


def test_their_masks_say_true_where_a_position_may_attend():
    defs = {"subsequent_mask": lambda n: torch.ones(1, n, n, dtype=torch.bool).tril()}
    seen = {}

    class Model(torch.nn.Module):
        generator = type("G", (), {"proj": staticmethod(lambda h: h)})

        def forward(self, src, tgt, src_mask, tgt_mask):
            seen.update(src=src_mask, tgt=tgt_mask)
            return torch.zeros(*tgt.shape, 7, requires_grad=True)

    src, tgt = torch.tensor([[5, 6, 0]]), torch.tensor([[1, 5, 2, 0]])  # bos 5 eos pad
    _, n = bench.their_loss(defs)(Model(), src, tgt, 0.1)
    assert seen["src"].tolist() == [[[True, True, False]]]
    assert seen["tgt"].tolist() == [[[True, False, False], [True, True, False], [True, True, True]]]
    assert int(n) == 2  # 5 and eos are predicted; the pad is not


def test_profile_names_each_steps_products_and_the_rest(tmp_path, capsys):
    """`--profile`: both steps profiled at a size, the matrix products a part of each one's self CPU time, and
    the printed ratio is theirs / ours of those totals."""
    source = tmp_path / "the_annotated_transformer.py"
    source.write_text(STAND_IN, encoding="utf-8")
    defs = bench.load_definitions(source)
    r = bench.profile_both(defs, "cpu", steps=1)
    for name in ("ours", "theirs"):
        assert 0 < r[name]["products"] < r[name]["seconds"]
        assert {e.key for e in r[name]["averages"]} >= {"aten::addmm"}  # the generator's projection, at least
    assert bench.main(["--source", str(source), "--sizes", "cpu", "--profile", "1", "--rows", "3"]) == 0
    out = capsys.readouterr().out
    assert out.count("top operators:") == 2 and "cpu: theirs / ours in self CPU time" in out
    assert out.count("the profiler's cost: a step takes") == 2 and "in wall time outside it" in out
    assert len([line for line in out.splitlines() if line.startswith("  aten::")]) <= 6
