"""annotated/decoding/settings.py: the decoding settings' defaults are written once, and every reader uses them."""

import ast
import inspect
from pathlib import Path

import pytest

from annotated.decoding.settings import Decoding, model_length_penalty

ROOT = Path(__file__).resolve().parents[2]
NAMES = {"beam", "beam_size", "num_beams", "length_penalty", "max_extra"}
OPTIONS = {"--beam", "--length-penalty", "--max-extra"}


def literal_defaults(path: Path) -> list[str]:
    """Where a file writes a decoding setting's default as a number: a parameter's default, a dataclass field, an
    option's `default=`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args.args + node.args.kwonlyargs
            defaults = [None] * (len(node.args.args) - len(node.args.defaults)) + node.args.defaults
            defaults += node.args.kw_defaults
            found += [
                f"{node.lineno}: {a.arg}={d.value}"
                for a, d in zip(args, defaults)
                if a.arg in NAMES and isinstance(d, ast.Constant) and isinstance(d.value, (int, float))
            ]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id in NAMES:
            if isinstance(node.value, ast.Constant) and isinstance(node.value.value, (int, float)):
                found.append(f"{node.lineno}: {node.target.id} = {node.value.value}")
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", "") == "add_argument"
            and any(isinstance(a, ast.Constant) and a.value in OPTIONS for a in node.args)
        ):
            found += [
                f"{node.lineno}: {node.args[0].value} default={k.value.value}"  # type: ignore[attr-defined]
                for k in node.keywords
                if k.arg == "default" and isinstance(k.value, ast.Constant) and k.value.value is not None
            ]
    return found


def test_the_defaults_are_written_once():
    """beam 4, alpha 0.6 and 50 extra subwords are written in `Decoding` only: no parameter, field or option of
    annotated/ writes its own."""
    found = {
        str(path.relative_to(ROOT)): literal_defaults(path)
        for path in sorted(ROOT.glob("annotated/**/*.py"))
        if path.name != "settings.py" or path.parent.name != "decoding"
    }
    assert {k: v for k, v in found.items() if v} == {}
    written = literal_defaults(ROOT / "annotated" / "decoding" / "settings.py")
    assert [w.split(": ", 1)[1] for w in written] == ["beam = 4", "length_penalty = 0.6", "max_extra = 50"]


def test_the_check_sees_a_literal_default(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "def search(model, beam_size=4, *, max_extra: int = 50): ...\n"
        "p.add_argument('--beam', type=int, default=4)\n"
        "class C:\n    length_penalty: float = 0.6\n"
    )
    assert sorted(literal_defaults(bad)) == [
        "1: beam_size=4",
        "1: max_extra=50",
        "2: --beam default=4",
        "4: length_penalty = 0.6",
    ]


def test_every_reader_uses_the_one_value():
    from annotated.attention.dump import dump, dump_model, translate_sentence
    from annotated.decoding.search import beam_search, translate_ids
    from annotated.decoding.translate import build_parser, translate, translate_prepared
    from annotated.training.config import TrainConfig
    from annotated.training.pack import BEAM

    for f in (translate_ids, translate, translate_prepared, translate_sentence, beam_search, dump, dump_model):
        parameters = inspect.signature(f).parameters
        assert parameters["beam_size"].default == Decoding.beam, f.__name__
        for name in ("length_penalty", "max_extra"):
            if name in parameters:
                assert parameters[name].default == getattr(Decoding, name), (f.__name__, name)
    p = build_parser()
    assert (p.get_default("beam"), p.get_default("max_extra"), p.get_default("length_penalty")) == (4, 50, None)
    assert TrainConfig().beam_size == BEAM == Decoding.beam


def test_the_export_asks_generate_for_the_translators_beam():
    pytest.importorskip("transformers")
    from annotated.interop.folders import generation_config
    from annotated.interop.marian import marian_config
    from annotated.transformer import TransformerConfig

    marian = marian_config(TransformerConfig(src_vocab=20, tgt_vocab=20))
    assert generation_config(marian).num_beams == Decoding.beam


def test_an_unset_length_penalty_is_the_models_own_else_the_papers():
    import argparse

    p = argparse.ArgumentParser()
    Decoding.add_options(p)
    assert p.parse_args([]).length_penalty is None  # the translator then reads the model's own
    assert model_length_penalty({"length_penalty": 1.5}) == 1.5
    assert model_length_penalty({}) == Decoding.length_penalty
