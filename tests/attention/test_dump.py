"""Tests of annotated/attention/dump.py (dumps, tensorboard, the command line), pictures.py (the PNG pictures,
the colour map and the label convention) and viewer.py (the HTML viewer, in headless Chromium).

Models are tiny and random (the properties checked do not need training); the
tokenizer is trained on the first 300 Multi30k training pairs, read from
$MULTI30K_URL or the shared copy beside the repository (tests skip, saying so,
when neither exists).
"""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tiny
import torch
from browser import CHROMIUM, NO_CHROMIUM, Chromium

from annotated.attention import dump as A
from annotated.attention import pictures as P
from annotated.attention import viewer as V
from annotated.checkpoint import CheckpointError, save_checkpoint
from annotated.recording import record_attention
from annotated.shipped import typed_name
from annotated.sites import head_counts
from annotated.tokens import BOS, PAD
from annotated.transformer import convert_model, padding_mask

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared" / "data" / "multi30k"
MAX_LEN = 20  # the tiny models' positional table: translations stay short, so pictures draw fast
SENTENCES = ["Ein Hund rennt über die Wiese.", "Zwei Männer spielen Fußball."]


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def base_url():
    from annotated.training import data

    url = os.environ.get(data.URL_ENV) or SHARED.as_uri() + "/"
    resolved = data.resolve_base_url(url)
    if resolved.startswith("file://") and not Path(resolved[len("file://") :]).is_dir():
        pytest.skip(f"no Multi30k data source: {resolved} does not exist (set {data.URL_ENV})")
    return url


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def tokenizer(base_url, cache):
    """A joint BPE tokenizer of 800 pieces on 300 training pairs (its 256 byte pieces leave room for words)."""
    from annotated.training.data import load_multi30k, train_tokenizer

    pairs = load_multi30k("train", "de", "en", cache_dir=cache, base_url=base_url)[:300]
    return train_tokenizer([s for s, _ in pairs] + [t for _, t in pairs], 800, cache_dir=cache)


def tiny_model(
    vocab: int, attention: str = "per_head", dtype=torch.float64, seed: int = 0, h: int = 2, max_len: int = MAX_LEN
):
    """tiny.py's model of two layers; dropout 0.1, which a model left in training mode would apply."""
    return tiny.tiny_model(vocab, seed=seed, N=2, h=h, max_len=max_len, attention=attention, dropout=0.1).to(dtype)


@pytest.fixture(scope="module")
def checkpoints(tokenizer, tmp_path_factory):
    """A per-head float64 model and its fused conversion, saved as two checkpoints."""
    d = tmp_path_factory.mktemp("ckpt")
    per_head = tiny_model(tokenizer.vocab_size)
    fused = convert_model(per_head, "fused")
    meta = {"src_lang": "de", "tgt_lang": "en"}
    save_checkpoint(d / "per_head.pt", per_head, tokenizer, meta)
    save_checkpoint(d / "fused.pt", fused, tokenizer, meta)
    return d / "per_head.pt", d / "fused.pt"


@pytest.fixture(scope="module")
def full_dump(checkpoints, tmp_path_factory):
    """A float32 dump of two sentences with every picture and the viewer."""
    out = tmp_path_factory.mktemp("dump") / "attention"
    A.dump(checkpoints[1], SENTENCES, out, references=["A dog runs across the meadow.", None])
    return out


# ---------------------------------------------------------------- the arrays


def test_shapes_rows_and_masks(tokenizer):
    model = tiny_model(tokenizer.vocab_size)
    src = tokenizer.encode(SENTENCES[0])
    tgt = A.translate_sentence(model, src, beam_size=1)
    attn = A.collect_attention(model, src, tgt, dtype=np.float64)
    S, T, h = len(src), len(tgt), model.config.h
    assert set(attn) == set(A.KINDS)
    for kind, (q, k) in {"enc_self": (S, S), "dec_self": (T, T), "cross": (T, S)}.items():
        assert len(attn[kind]) == model.config.N
        for a in attn[kind]:
            assert a.shape == (1, h, q, k) and a.dtype == np.float64
            # every query's weights are a distribution over the keys (no padding here)
            np.testing.assert_allclose(a.sum(-1), 1.0, atol=1e-12)
            assert (a >= 0).all()
    for a in attn["dec_self"]:
        assert not np.triu(a[0], 1).any(), "a future position got weight: the causal mask leaked"
        np.testing.assert_array_equal(a[0, :, 0], np.eye(T)[np.zeros(h, dtype=int)])  # <s> sees only itself
    assert A.collect_attention(model, src, tgt)["enc_self"][0].dtype == np.float32  # the default


def test_rows_are_the_steps_of_greedy_decoding(tokenizer):
    """Row t of the teacher-forced pass is decoding step t: same weights, and it predicts tgt_ids[t]."""
    model = tiny_model(tokenizer.vocab_size, seed=3)
    src_ids = tokenizer.encode(SENTENCES[1])
    tgt_ids = A.translate_sentence(model, src_ids, beam_size=1)
    attn = A.collect_attention(model, src_ids, tgt_ids, dtype=np.float64)
    src = torch.tensor([src_ids])
    mask = padding_mask(src, PAD)
    cache, memory = model.new_cache(), model.encode(src, mask)
    inputs = [BOS] + tgt_ids[:-1]
    with torch.no_grad():
        for t, token in enumerate(inputs):
            with record_attention(model) as probs:
                y = model.decode(memory, mask, torch.tensor([[token]]), None, cache=cache, start=t)
            assert int(model.generator(y[:, -1]).argmax()) == tgt_ids[t]
            for layer in range(model.config.N):
                np.testing.assert_allclose(
                    attn["dec_self"][layer][0, :, t, : t + 1], probs["dec_self", layer][0][0, :, 0], rtol=0, atol=1e-12
                )
                np.testing.assert_allclose(
                    attn["cross"][layer][0, :, t], probs["cross", layer][0][0, :, 0], rtol=0, atol=1e-12
                )


def test_per_head_and_fused_give_identical_dumps(checkpoints, tmp_path):
    """float64: the two forms are the same function, so the dumps agree to rounding (<= 1e-12)."""
    outs = [
        A.dump(c, SENTENCES, tmp_path / c.stem, pictures=False, viewer=False, dtype=np.float64) for c in checkpoints
    ]
    (ia, ib) = (A.read_index(o) for o in outs)
    assert ia["model_config"]["attention"] == "per_head" and ib["model_config"]["attention"] == "fused"
    assert {k: v for k, v in ia["model_config"].items() if k != "attention"} == {
        k: v for k, v in ib["model_config"].items() if k != "attention"
    }
    for key in ("src_tokens", "tgt_in_tokens", "tgt_out_tokens", "translation", "shapes"):
        assert [s[key] for s in ia["sentences"]] == [s[key] for s in ib["sentences"]]
    worst = 0.0
    for i in range(len(SENTENCES)):
        a, _ = A.load_sentence(outs[0], i)
        b, _ = A.load_sentence(outs[1], i)
        for kind in A.KINDS:
            for x, y in zip(a[kind], b[kind]):
                assert x.dtype == y.dtype == np.float64 and x.shape == y.shape
                worst = max(worst, float(np.abs(x - y).max()))
    assert worst <= 1e-12, worst


# ---------------------------------------------------------------- files and bertviz


def test_dump_files_and_index(full_dump, checkpoints, tokenizer):
    index = A.read_index(full_dump)
    assert index["checkpoint"] == typed_name(checkpoints[1])
    assert index["model_config"]["N"] == index["layers"] == 2 and index["heads"] == 2
    assert index["format"] == "annotated-attention-v2" and index["kinds"] == ["enc_self", "dec_self", "cross"]
    assert index["head_counts"] == {kind: [2, 2] for kind in A.KINDS}
    assert index["meta"]["src_lang"] == "de" and index["dtype"] == "float32"
    assert [s["source"] for s in index["sentences"]] == SENTENCES
    assert index["sentences"][0]["reference"] == "A dog runs across the meadow."
    for i, entry in enumerate(index["sentences"]):
        assert entry["src_ids"] == tokenizer.encode(SENTENCES[i])
        assert entry["src_tokens"] == tokenizer.pieces(entry["src_ids"])
        assert entry["tgt_in_tokens"][0] == "<s>" and entry["tgt_in_tokens"][1:] == entry["tgt_out_tokens"][:-1]
        assert entry["translation"] == tokenizer.decode(entry["tgt_out_ids"])
        with np.load(full_dump / entry["file"]) as f:
            assert sorted(f.files) == sorted(f"{k}_layer{l}" for k in A.KINDS for l in range(2))
            for kind in A.KINDS:
                rows, cols = (entry[name] for name in index["rows_cols"][kind])
                for layer in range(2):
                    a = f[f"{kind}_layer{layer}"]
                    assert list(a.shape) == entry["shapes"][kind][layer] == [1, 2, len(rows), len(cols)]
        for name in entry["pictures"].values():
            png = full_dump / name
            assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            assert png.stat().st_size < 400_000
    assert not [p for p in full_dump.parent.iterdir() if p.name.startswith(".")], "temporary directory left"


def test_bertviz_layout(full_dump):
    """bertviz's head_view/model_view input: per kind a tuple of (1, h, q, k) tensors, layer order kept, made
    from a sentence file as dump.py's prose says."""
    attn, entry = A.load_sentence(full_dump, 1)
    names = {"encoder_attention": "enc_self", "decoder_attention": "dec_self", "cross_attention": "cross"}
    args = {name: tuple(torch.from_numpy(a) for a in attn[kind]) for name, kind in names.items()}
    args.update(encoder_tokens=entry["src_tokens"], decoder_tokens=entry["tgt_in_tokens"])
    S, T = len(entry["src_tokens"]), len(entry["tgt_in_tokens"])
    with np.load(full_dump / entry["file"]) as f:
        for name, kind, (q, k) in (
            ("encoder_attention", "enc_self", (S, S)),
            ("decoder_attention", "dec_self", (T, T)),
            ("cross_attention", "cross", (T, S)),
        ):
            layers = args[name]
            assert isinstance(layers, tuple) and len(layers) == 2
            for layer, tensor in enumerate(layers):
                assert isinstance(tensor, torch.Tensor) and tuple(tensor.shape) == (1, 2, q, k)
                np.testing.assert_array_equal(tensor.numpy(), f[f"{kind}_layer{layer}"])
            # what bertviz does with it (util.format_attention and head_view's token checks)
            assert all(len(t.shape) == 4 for t in layers)
            stacked = torch.stack([t.squeeze(0) for t in layers])  # (layers, heads, q, k)
            left = args["decoder_tokens"] if kind != "enc_self" else args["encoder_tokens"]
            right = args["encoder_tokens"] if kind != "dec_self" else args["decoder_tokens"]
            assert len(stacked[0][0]) == len(left) and len(stacked[0][0][0]) == len(right)


def colour_bars(fig) -> list:
    """The colour bars of a figure: axes labelled with the pictures' colour-bar label."""
    return [ax for ax in fig.axes if P.COLOUR_BAR in (ax.get_ylabel(), ax.get_xlabel())]


def test_pictures_follow_the_label_convention(full_dump):
    """Every picture: the one colour map on 0..1 with one colour bar; a decoder row labelled by the token
    predicted there, a key column by the token fed in there; captions in those words, not internal names."""
    attn, entry = A.load_sentence(full_dump, 0)
    labels = {
        "enc_self": (entry["src_tokens"], entry["src_tokens"]),
        "dec_self": (entry["tgt_out_tokens"], entry["tgt_in_tokens"]),  # predicted / fed in
        "cross": (entry["tgt_out_tokens"], entry["src_tokens"]),
    }
    assert {k: tuple(entry[n] for n in A.ROWS_COLS[k]) for k in A.KINDS} == labels
    figures = {kind: P.grid_figure(attn[kind], *labels[kind], kind) for kind in A.KINDS}
    figures["alignment"] = P.alignment_figure(
        attn["cross"][1], entry["src_tokens"], entry["tgt_out_tokens"], per_head=True
    )
    for name, fig in figures.items():
        images = [ax.images[0] for ax in fig.axes if ax.images]
        assert images and all(im.get_cmap().name.startswith(P.CMAP) and im.get_clim() == (0.0, 1.0) for im in images), (
            name
        )
        [bar] = colour_bars(fig)
        assert bar.get_ylim() == (0.0, 1.0), name
        title = fig._suptitle.get_text()
        assert "row = query, it sums to 1" in title and "\u2581 marks the start of a word" in title, name
        assert not any(word in title for word in ("tgt_out_tokens", "tgt_in_tokens", "src_tokens", "rows:")), name
        kind = "cross" if name == "alignment" else name
        assert P.KIND_LABELS[kind] in title or name == "alignment"
    for kind in A.KINDS:
        assert P.AXIS_LABELS[kind][0] in figures[kind]._suptitle.get_text()
        axes = [ax for ax in figures[kind].axes if ax.images]
        assert len(axes) == 4  # 2 layers x 2 heads
        assert [t.get_text() for t in axes[0].get_yticklabels()] == labels[kind][0]  # left column labelled
        assert [t.get_text() for t in axes[2].get_xticklabels()] == labels[kind][1]  # bottom row labelled
        assert not axes[1].get_yticklabels() and not axes[0].get_xticklabels()
    T = len(entry["tgt_in_tokens"])
    for ax in (ax for ax in figures["dec_self"].axes if ax.images):
        shown = ax.images[0].get_array()
        np.testing.assert_array_equal(np.ma.getmaskarray(shown), np.triu(np.ones((T, T), bool), 1))
        assert shown[0, 0] == 1.0  # the first prediction reads only <s>, the first key column
    assert "predicts" in P.AXIS_LABELS["dec_self"][0] and "fed in" in P.AXIS_LABELS["dec_self"][1]

    panels = [ax for ax in figures["alignment"].axes if ax.images]
    assert [ax.get_title() for ax in panels] == ["mean over heads", "head 0", "head 1"]
    np.testing.assert_allclose(panels[0].images[0].get_array(), attn["cross"][1][0].mean(0), rtol=1e-6)
    np.testing.assert_array_equal(panels[2].images[0].get_array(), attn["cross"][1][0, 1])
    assert [t.get_text() for t in panels[0].get_xticklabels()] == entry["src_tokens"]
    assert [t.get_text() for t in panels[0].get_yticklabels()] == entry["tgt_out_tokens"]
    assert "predicts" in panels[0].get_ylabel()
    assert P.label_font_size(60, 3.0) < P.label_font_size(10, 3.0)  # more tokens, smaller labels
    assert P._tex_safe("$5") == r"\$5"  # a '$' token does not start a formula


def test_a_dump_of_the_first_format_is_refused_naming_the_fix_and_replaced_on_request(checkpoints, tmp_path):
    out = A.dump(checkpoints[0], SENTENCES[:1], tmp_path / "attention", pictures=False, viewer=False)
    index = json.loads((out / "index.json").read_text())
    index["format"], index["kinds"] = "annotated-attention-v1", ["encoder", "decoder_self", "cross"]
    (out / "index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"annotated-attention-v1.*re-run make attention"):
        A.read_index(out)
    with pytest.raises(ValueError, match="re-run make attention"):
        A.load_sentence(out, 0)
    A.dump(checkpoints[0], SENTENCES[:1], out, pictures=False, viewer=False)  # what the message says to do
    assert A.read_index(out)["format"] == A.FORMAT


# ---------------------------------------------------------------- tensorboard


def test_tensorboard_alignment_image(tokenizer, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    model = tiny_model(tokenizer.vocab_size, dtype=torch.float32).train()
    rng = torch.get_rng_state()
    with SummaryWriter(log_dir=str(tmp_path)) as writer:
        image = A.log_alignment_image(writer, model, tokenizer, SENTENCES[0], step=7)
    assert model.training, "the model must be back in training mode"
    assert torch.equal(rng, torch.get_rng_state()), "logging drew random numbers"
    assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3 and image.std() > 10
    events = EventAccumulator(str(tmp_path), size_guidance={"images": 0})
    events.Reload()
    assert "attention/alignment" in events.Tags()["images"]
    [logged] = events.Images("attention/alignment")
    assert logged.step == 7 and (logged.height, logged.width) == image.shape[:2]


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_a_dump_directory_gets_the_mode_mkdir_would_give(checkpoints, tmp_path, umask):
    """Staged in a private mkdtemp directory (0o700), renamed into place as 0o777 less the umask."""
    old = os.umask(umask)
    try:
        A.dump(checkpoints[0], SENTENCES[:1], tmp_path / "attention", pictures=False, viewer=False)
        (tmp_path / "plain").mkdir()
    finally:
        os.umask(old)
    mode = stat.S_IMODE((tmp_path / "attention").stat().st_mode)
    assert mode == stat.S_IMODE((tmp_path / "plain").stat().st_mode) == 0o777 & ~umask


def test_failed_dump_leaves_nothing(checkpoints, tmp_path, monkeypatch):
    out = tmp_path / "attention"
    A.dump(checkpoints[0], SENTENCES[:1], out, pictures=False, viewer=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("disk on fire")
        return real(*args, **kwargs)

    real = A.collect_attention
    monkeypatch.setattr(A, "collect_attention", failing)
    with pytest.raises(RuntimeError, match="disk on fire"):
        A.dump(checkpoints[0], SENTENCES, out, pictures=False, viewer=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the old dump, untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["attention"]  # no temporary directory left
    monkeypatch.setattr(A, "collect_attention", real)
    with pytest.raises(ValueError, match=r"sentence 2 is empty"):
        A.dump(checkpoints[0], [SENTENCES[0], "   "], tmp_path / "new")
    with pytest.raises(ValueError, match=r"sentence 1 has \d+ subwords, more than the model's max_len=20"):
        A.dump(checkpoints[0], [" ".join(["Hund"] * 30)], tmp_path / "new")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="is not an attention dump"):
        A.dump(checkpoints[0], SENTENCES[:1], tmp_path / "mine", pictures=False, viewer=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["attention", "mine"]
    with pytest.raises(CheckpointError, match="no such file"):
        A.dump(tmp_path / "missing.pt", SENTENCES, tmp_path / "new")
    with pytest.raises(ValueError, match="eval mode"):
        A.collect_attention(tiny_model(50).train(), [5], [6])


def tree(path: Path) -> dict:
    """Every file and folder under `path` with its bytes (None for folders, the target for links)."""
    return {
        str(p.relative_to(path)): (os.readlink(p) if p.is_symlink() else None if p.is_dir() else p.read_bytes())
        for p in sorted(path.rglob("*"))
    }


@pytest.mark.parametrize(
    "case",
    [
        "foreign index",
        "dump plus a user file",
        "dump plus a folder",
        "a file",
        "index without marker",
        "a link",
        "index naming a user file",
    ],
)
def test_out_dir_that_is_not_our_dump_is_refused_untouched(case, checkpoints, tmp_path, capsys):
    """Only a dump of ours (format marker, nothing but the files its index names) is ever replaced."""
    out = tmp_path / "out"
    if case == "foreign index":  # the old rule: any file named index.json made a folder "a dump"
        (out / "photos").mkdir(parents=True)
        (out / "index.json").write_text('{"pages": [1, 2]}')
        (out / "photos" / "a.jpg").write_bytes(b"\xff\xd8 holiday")
    elif case in ("dump plus a user file", "dump plus a folder"):
        A.dump(checkpoints[0], SENTENCES[:1], out, pictures=False)
        if case == "dump plus a user file":
            (out / "thesis.tex").write_text("chapter 1")
        else:
            (out / "drafts").mkdir()
    elif case == "a file":
        out.write_text("a file, not a folder")
    elif case == "index without marker":
        out.mkdir()
        (out / "index.json").write_text('{"sentences": []}')
    elif case == "index naming a user file":  # our marker, but the "sentence file" is not a name a dump writes
        out.mkdir()
        (out / "index.json").write_text(json.dumps({"format": A.FORMAT, "sentences": [{"file": "thesis.tex"}]}))
        (out / "thesis.tex").write_text("chapter 1")
    else:
        (tmp_path / "elsewhere").mkdir()
        (tmp_path / "elsewhere" / "keep.txt").write_text("keep")
        out.symlink_to("elsewhere")
    before = tree(tmp_path)
    code = A.main(["--checkpoint", str(checkpoints[0]), "--out", str(out), "--no-pictures", SENTENCES[0]])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "is not an attention dump" in err and "choose another --out" in err
    assert tree(tmp_path) == before  # nothing changed, nothing added beside it


def run_cli(*args, cwd=ROOT):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "annotated.attention.dump", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=300,
    )


@pytest.mark.parametrize("case", ["missing", "incompatible", "empty", "too_long"])
def test_cli_bad_input_exits_2_and_writes_nothing(case, checkpoints, tmp_path, capsys):
    ckpt = checkpoints[0]
    sentences = ["Ein Hund."]
    if case == "missing":
        ckpt = tmp_path / "nope.pt"
    elif case == "incompatible":
        ckpt = tmp_path / "other.pt"
        torch.save(
            {
                "format": "annotated-checkpoint-v1",
                "config": {"src_vocab": 10, "tgt_vocab": 10, "N": 1},
                "model": {"weight": torch.zeros(2)},
                "tokenizer": None,
                "meta": {},
            },
            ckpt,
        )
    elif case == "empty":
        sentences = ["Ein Hund.", ""]
    else:
        sentences = ["Ein " + "sehr " * 40 + "großer Hund."]
    out = tmp_path / "out"
    code = A.main(["--checkpoint", str(ckpt), "--out", str(out), *sentences])
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith("attention: error: ")
    assert "Traceback" not in err
    want = {
        "missing": "no such file",
        "incompatible": "do not match its config",
        "empty": "sentence 2 is empty",
        "too_long": "more than the model's max_len=20",
    }[case]
    assert want in err
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name != "other.pt"] == []


def test_cli_defaults_in_a_real_process(tokenizer, base_url, tmp_path):
    """No --checkpoint: runs/latest/best.pt; no sentences: the first --n of test_2016_flickr (de)."""
    from annotated.training.data import load_multi30k

    run = tmp_path / "runs" / "run-1"
    run.mkdir(parents=True)
    model = tiny_model(tokenizer.vocab_size, max_len=40)  # room for the test sentences' 25 subwords
    save_checkpoint(run / "best.pt", model, tokenizer, {"src_lang": "de", "tgt_lang": "en"})
    (tmp_path / "runs" / "latest").symlink_to("run-1")
    r = run_cli("--n", 2, "--no-pictures", "--data-url", base_url, "--cache-dir", tmp_path / "cache", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    index = A.read_index(run / "attention")
    test = load_multi30k("test_2016_flickr", "de", "en", cache_dir=tmp_path / "cache", base_url=base_url)[:2]
    assert [(s["source"], s["reference"]) for s in index["sentences"]] == test
    assert (run / "attention" / "viewer.html").is_file() and "run-1/attention" in r.stdout
    # the viewer's address, to open it as make docs prints the book's; the caption names the model relatively
    assert r.stdout.splitlines()[-1] == f"open {(run / 'attention' / 'viewer.html').resolve().as_uri()}"
    assert index["checkpoint"] == "runs/run-1/best.pt", index["checkpoint"]  # the run itself, not latest


@pytest.mark.parametrize(
    "option, message",
    [
        (["--n", "0"], "argument --n: must be a whole number >= 1, got '0'"),
        (["--n", "-5"], "argument --n: must be a whole number >= 1, got '-5'"),
        (["--device", "tpu"], "argument --device: must be cpu, cuda or cuda:N"),
        (["--device", "meta"], "argument --device: must be cpu, cuda or cuda:N"),
        (["--cache-dir", "/dev/null/cache"], "argument --cache-dir: '/dev/null/cache': /dev/null is not a folder"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_cli_bad_options_exit_2_with_one_line_before_any_work(option, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        A.main(["--checkpoint", str(tmp_path / "none.pt"), "--out", str(tmp_path / "out"), *option])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"attention: error: {message}") and len(err.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_cli_without_any_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no runs/ here
    monkeypatch.setattr("annotated.shipped.FOLDER", tmp_path / "empty box")  # and no shipped model
    assert A.main(["Ein Hund."]) == 2
    err = capsys.readouterr().err
    assert err.startswith("attention: error: no checkpoint found") and len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- the viewer in a browser

WIDTH = 1400  # px: the page width the layout is checked at


def png_pixels(data: bytes) -> np.ndarray:
    import matplotlib.image

    return matplotlib.image.imread(io.BytesIO(data), format="png")  # (H, W, 3 or 4) floats in [0, 1]


def open_viewer(page: Path, tmp_path: Path, fragment: str = "", width: int = WIDTH) -> Chromium:
    """Chromium showing `page` at `width` px, recording console messages, exceptions and CSP reports."""
    if CHROMIUM is None:
        pytest.skip(NO_CHROMIUM)
    browser = Chromium(CHROMIUM, tmp_path / "profile")
    browser.open(
        page.as_uri() + (f"#{fragment}" if fragment else ""),
        width=width,
        height=900,
        domains=("Network", "Page", "Runtime", "Log"),
    )
    return browser


def console_errors(browser: Chromium) -> list:
    """Every exception, console error or warning, and browser log error (CSP violations land there)."""
    return [
        e["params"]
        for e in browser.events
        if e["method"] == "Runtime.exceptionThrown"
        or (e["method"] == "Runtime.consoleAPICalled" and e["params"]["type"] in ("error", "warning", "assert"))
        or (e["method"] == "Log.entryAdded" and e["params"]["entry"]["level"] in ("error", "warning"))
    ]


def show(browser: Chromium, fragment: str, rendered: str) -> None:
    browser.js(f"location.hash = '{fragment}'")
    browser.wait_js(f"document.body.dataset.rendered === '{rendered}'")


def opening(folder: Path) -> str:
    """What `document.body.dataset.rendered` says when the dump's viewer opens (its best-aligned cross head)."""
    index = A.read_index(folder)
    arrays = [A.load_sentence(folder, i)[0] for i in range(len(index["sentences"]))]
    view = dict(part.split("=") for part in V.opening_view(arrays, index["head_counts"]).split("&"))
    assert view["kind"] == "cross" and view["view"] == "head"
    return f"{view['s']}/cross/{view['layer']}/{view['head']}"


def weights_from_colours(rgb: np.ndarray) -> np.ndarray:
    """Read weights back from colours of the viewer's table (CMAP sampled at 64 points): (..., 3) -> (...)."""
    table = np.array([[int(c[i : i + 2], 16) for i in (1, 3, 5)] for c in P.colour_table(64)])  # (64, 3)
    dist = np.abs(rgb[..., None, :].astype(int) - table).sum(-1)  # (..., 64)
    assert (dist.min(-1) == 0).all(), "a colour that is not in the colour table"
    return dist.argmin(-1) / 63


def test_the_viewer_uses_the_pictures_colour_map():
    import matplotlib

    table = P.colour_table(64)
    want = matplotlib.colormaps[P.CMAP]
    for i in (0, 21, 63):
        assert table[i] == matplotlib.colors.to_hex(want(i / 63))
    page = V.viewer_html(
        {"kinds": list(A.KINDS), "layers": 1, "heads": 1, "rows_cols": A.ROWS_COLS, "sentences": []}, []
    )
    data = json.loads(page.split('id="attention-data">', 1)[1].split("</script>", 1)[0])
    assert data["colours"] == table and data["captions"]["cross"] == P.caption("cross")


def test_viewer_in_headless_chromium(full_dump, tmp_path):
    page = full_dump / "viewer.html"
    text = page.read_text(encoding="utf-8")
    # statically: nothing in the page can fetch anything, and its policy lets only its own script run
    for pattern in ("<link", "src=", "href=", "@import", "url(", "fetch(", "XMLHttpRequest", "WebSocket", " on"):
        assert pattern + ("" if pattern != " on" else "click=") not in text, f"the viewer contains {pattern!r}"
    assert V.content_security_policy(V.viewer_file("viewer.js")) in text and "default-src 'none'" in text
    index = A.read_index(full_dump)
    browser = open_viewer(page, tmp_path)
    try:
        assert browser.js("document.body.dataset.rendered") == opening(full_dump)

        # every kind draws one cell per (query, key) and labels every row and column with its token
        for s, entry in enumerate(index["sentences"]):
            for kind in A.KINDS:
                rows, cols = (entry[name] for name in index["rows_cols"][kind])
                show(browser, f"s={s}&kind={kind}&layer=1&head=mean", f"{s}/{kind}/1/mean")
                counts = browser.js(
                    "[document.querySelectorAll('td.cell').length, "
                    "document.querySelectorAll('td.blocked').length, "
                    "[...document.querySelectorAll('th.row')].map(t => t.textContent), "
                    "[...document.querySelectorAll('th.col')].map(t => t.textContent)]"
                )
                blocked = len(rows) * (len(rows) - 1) // 2 if kind == "dec_self" else 0
                assert counts == [len(rows) * len(cols), blocked, rows, cols], (s, kind)

        # a real hover (mouse moved by the browser's input layer) colours the column labels by the query's row
        attn, entry = A.load_sentence(full_dump, 0)
        show(browser, "s=0&kind=cross&layer=1&head=0", "0/cross/1/0")

        def hover(selector: str):
            x, y = browser.js(
                f"(() => {{ const e = document.querySelector('{selector}'); e.scrollIntoView(); "
                f"const r = e.getBoundingClientRect(); "
                f"return [r.x + r.width / 2, r.y + r.height / 2]; }})()"
            )
            browser.page("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)

        q = 2
        hover(f'td.cell[data-q="{q}"][data-k="0"]')
        shaded = browser.js("[...document.querySelectorAll('th.col')].map(t => parseFloat(t.dataset.w))")
        np.testing.assert_allclose(shaded, attn["cross"][1][0, 0, q], atol=1.1e-4)  # 4 decimals stored and shown
        k = 1
        hover(f'th.col[data-k="{k}"]')
        shaded = browser.js("[...document.querySelectorAll('th.row')].map(t => parseFloat(t.dataset.w))")
        np.testing.assert_allclose(shaded, attn["cross"][1][0, 0, :, k], atol=1.1e-4)
        assert "is read by the queries" in browser.js("document.getElementById('status').textContent")

        shot = png_pixels(base64.b64decode(browser.page("Page.captureScreenshot", format="png")["data"]))
        assert shot.shape[:2] == (900, WIDTH)
        not_white = (shot[..., :3] < 0.95).any(axis=-1).mean()
        assert 0.02 < not_white < 0.95 and len(np.unique(shot[..., :3].reshape(-1, 3), axis=0)) > 20

        # without heads.json beside the checkpoint the model view says so and shows no scores
        show(browser, "s=0&kind=enc_self&view=model", "0/model")
        assert browser.js("document.querySelectorAll('td.thumb').length") == 3 * index["layers"] * index["heads"]
        assert browser.js("document.querySelectorAll('.score').length") == 0
        assert browser.js("document.getElementById('importance').textContent").startswith("no heads.json")
        assert console_errors(browser) == []

        # the only request the page caused is the page itself
        assert browser.requests() == [page.as_uri()]
        # and the check can fail: a page with an external image shows up in the log
        control = tmp_path / "control.html"
        control.write_text('<img src="http://example.invalid/x.png">')
        browser.page("Page.navigate", url=control.as_uri())
        browser.wait_event("Page.loadEventFired")
        assert "http://example.invalid/x.png" in browser.requests()
    finally:
        browser.close()


def test_the_policy_stops_a_script_that_is_not_the_viewers(full_dump, tmp_path):
    """The CSP is real: a second inline script (one the page did not ship) does not run and is reported."""
    page = tmp_path / "tampered.html"
    page.write_text(
        (full_dump / "viewer.html")
        .read_text(encoding="utf-8")
        .replace("</body>", "<script>document.title = 'injected';</script></body>"),
        encoding="utf-8",
    )
    browser = open_viewer(page, tmp_path)
    try:
        browser.wait_js(f"document.body.dataset.rendered === '{opening(full_dump)}'")  # the viewer's script ran
        assert browser.js("document.title") != "injected"
        assert any("Content Security Policy" in json.dumps(e) for e in console_errors(browser))
    finally:
        browser.close()


def test_head_view_fills_the_page_and_labels_every_token(full_dump, tmp_path):
    """At 1400 px the heatmap is at least 60% of the page wide, no row or column label is cut to nothing,
    the controls stay on one line, and the caption gives the label convention; the screenshot goes to tmp_path
    (the README's are made by `make screenshots` from the shipped model)."""
    index = A.read_index(full_dump)
    entry = index["sentences"][1]
    browser = open_viewer(full_dump / "viewer.html", tmp_path, "s=1&kind=cross&layer=1&head=mean&view=head")
    try:
        browser.wait_js("document.body.dataset.rendered === '1/cross/1/mean'")
        width = browser.js("document.querySelector('table.heat').getBoundingClientRect().width")
        assert width >= 0.6 * WIDTH, width
        labels = browser.js("""[...document.querySelectorAll('th.row, th.col')].map(t => {
            const r = t.getBoundingClientRect(); return [t.className, t.textContent, r.width, r.height]; })""")
        rows = [text for cls, text, *_ in labels if cls.startswith("row")]
        cols = [text for cls, text, *_ in labels if cls.startswith("col")]
        assert rows == entry["tgt_out_tokens"] and cols == entry["src_tokens"]
        assert all(w >= 8 and h >= 8 for _, _, w, h in labels)  # every label has room on the page
        tops = browser.js("[...document.querySelectorAll('#controls > *')].map(e => e.getBoundingClientRect().top)")
        assert max(tops) - min(tops) < 10, tops  # one line of controls, however long the sentence
        assert browser.js("document.getElementById('controls').scrollHeight") < 40
        caption = browser.js("document.getElementById('caption').textContent")
        for words in (
            "row = query, it sums to 1",
            "\u2581 marks the start of a word",
            "labelled by the token the decoder predicts there",
            "column = key, labelled by the source token",
        ):
            assert words in caption, words
        legend = browser.js(
            "(() => { const r = document.querySelector('#legend .bar').getBoundingClientRect(); "
            "return [r.width, r.height, document.getElementById('legend').innerText]; })()"
        )
        assert legend[0] > 50 and legend[1] > 5 and "attention weight" in legend[2]
        assert "causal mask" not in legend[2]  # cross-attention has no masked cell: no grey swatch
        assert console_errors(browser) == []
        shot = base64.b64decode(browser.page("Page.captureScreenshot", format="png")["data"])
        (tmp_path / "viewer.png").write_bytes(shot)
    finally:
        browser.close()


def test_arrow_keys_move_between_heads_and_layers(full_dump, tmp_path):
    """Left/right: the head ("mean" before head 0), up/down: the layer; held at the ends; not while a menu has
    the focus (it keeps its own arrow keys)."""
    browser = open_viewer(full_dump / "viewer.html", tmp_path, "s=0&kind=dec_self&layer=0&head=0&view=head")
    try:
        browser.wait_js("document.body.dataset.rendered === '0/dec_self/0/0'")
        codes = {"ArrowLeft": 37, "ArrowUp": 38, "ArrowRight": 39, "ArrowDown": 40}

        def press(key: str, want: str):
            for kind in ("keyDown", "keyUp"):
                browser.page("Input.dispatchKeyEvent", type=kind, key=key, code=key, windowsVirtualKeyCode=codes[key])
            browser.wait_js(f"document.body.dataset.rendered === '0/dec_self/{want}'")

        press("ArrowRight", "0/1")
        press("ArrowRight", "0/1")  # the layer has 2 heads: head 1 is the last
        press("ArrowDown", "1/1")
        press("ArrowDown", "1/1")  # 2 layers
        press("ArrowLeft", "1/0")
        press("ArrowLeft", "1/mean")
        press("ArrowUp", "0/mean")
        browser.js("document.getElementById('kind').focus()")
        for kind in ("keyDown", "keyUp"):  # a focused menu keeps its keys (the kind menu moves on): the head stays
            browser.page(
                "Input.dispatchKeyEvent",
                type=kind,
                key="ArrowRight",
                code="ArrowRight",
                windowsVirtualKeyCode=codes["ArrowRight"],
            )
        browser.js("new Promise(r => setTimeout(r, 300))")
        assert browser.js("[document.getElementById('layer').value, document.getElementById('head').value]") == [
            "0",
            "mean",
        ]
        assert browser.js("location.hash").endswith("&layer=0&head=mean&view=head")
        browser.js("document.getElementById('kind').blur()")
        browser.js("location.hash = 's=0&kind=dec_self&layer=0&head=mean&view=head'")
        # the menu may have changed the kind with the key: wait for the hash's view before pressing again
        browser.wait_js("document.body.dataset.rendered === '0/dec_self/0/mean'")
        press("ArrowRight", "0/0")  # the menu left: the keys move heads again
        assert console_errors(browser) == []
    finally:
        browser.close()


def test_the_controls_wrap_on_a_narrow_screen(full_dump, tmp_path):
    """At 800 px every menu is whole on the screen (the controls wrap onto a second line), the sentence menu
    keeps a readable width, and nothing makes the page scroll sideways."""
    browser = open_viewer(full_dump / "viewer.html", tmp_path, width=800)
    try:
        browser.wait_js(f"document.body.dataset.rendered === '{opening(full_dump)}'")
        boxes = browser.js(
            "[...document.querySelectorAll('#controls select')].map(e => { "
            "const r = e.getBoundingClientRect(); return [e.id, r.left, r.right, r.width]; })"
        )
        assert len(boxes) == 5
        for name, left, right, width in boxes:
            assert left >= 0 and right <= 800 and width >= 60, (name, left, right, width)
        assert {b[0]: b[3] for b in boxes}["sentence"] >= 200
        assert browser.js("document.documentElement.scrollWidth") <= 800
        assert console_errors(browser) == []
    finally:
        browser.close()


def test_the_legend_shows_only_what_applies(full_dump, tmp_path):
    """The colour bar where colours are weights (head and model views, not the lines view); the grey swatch of
    the causal mask only where cells are blocked (the decoder's self-attention, and the model view)."""
    browser = open_viewer(full_dump / "viewer.html", tmp_path)
    try:
        seen = {}
        for fragment, rendered in (
            ("s=0&kind=cross&layer=1&head=0&view=head", "0/cross/1/0"),
            ("s=0&kind=enc_self&layer=1&head=0&view=head", "0/enc_self/1/0"),
            ("s=0&kind=dec_self&layer=1&head=0&view=head", "0/dec_self/1/0"),
            ("s=0&kind=dec_self&layer=1&head=0&view=lines", "0/dec_self/1/0/lines"),
            ("s=0&kind=cross&layer=1&head=0&view=model", "0/model"),
        ):
            show(browser, fragment, rendered)
            seen[rendered] = browser.js(
                "[document.getElementById('colour-bar').getBoundingClientRect().width > 0, "
                "document.querySelector('#legend .swatch').getBoundingClientRect().width > 0]"
            )
        assert seen == {
            "0/cross/1/0": [True, False],
            "0/enc_self/1/0": [True, False],
            "0/dec_self/1/0": [True, True],
            "0/dec_self/1/0/lines": [False, False],
            "0/model": [True, True],
        }
        show(browser, "s=0&kind=enc_self&layer=1&head=0&view=head", "0/enc_self/1/0")
        assert "decoder" not in browser.js("document.getElementById('caption').textContent")  # the encoder's own words
        assert console_errors(browser) == []
    finally:
        browser.close()


def test_the_viewer_opens_on_the_head_that_aligns(tmp_path):
    """Without a start view the page opens on the cross-attention head with the best `alignment`: a head that
    walks the source beats a sharper one whose every row sits on one token, and beats the spread-out ones."""
    index, arrays = synthetic_dump(heads=3)
    rows, cols = arrays[0]["cross"][0].shape[2:]
    diagonal = np.full((rows, cols), 0.1 / (cols - 1))
    diagonal[np.arange(rows), np.minimum(np.arange(rows), cols - 1)] = 0.9
    stripe = np.full((rows, cols), 0.01 / (cols - 1))
    stripe[:, -1] = 0.99  # sharper than the diagonal, but every row reads the same token
    arrays[0]["cross"][0][0, 1], arrays[0]["cross"][0][0, 2] = diagonal, stripe
    assert V.alignment(stripe) > 0 and V.alignment(diagonal) > 3 * V.alignment(stripe)
    counts = {k: [3] for k in A.KINDS}
    assert V.opening_view(arrays, counts) == "s=0&kind=cross&layer=0&head=1&view=head"
    page = tmp_path / "viewer.html"
    page.write_text(V.viewer_html(index, arrays), encoding="utf-8")
    browser = open_viewer(page, tmp_path)
    try:
        browser.wait_js("document.body.dataset.rendered === '0/cross/0/1'")
        assert console_errors(browser) == []
    finally:
        browser.close()


def synthetic_dump(seed: int = 0, heads: int = 3) -> tuple[dict, list]:
    """(index, arrays) of one made-up sentence whose weights are spread out (Dirichlet, alpha 0.3): many lie
    below the lines view's threshold without being zero."""
    rng = np.random.default_rng(seed)
    entry = {
        "source": "Ein Hund rennt.",
        "translation": "A dog runs.",
        "reference": None,
        "src_tokens": ["\u2581Ein", "\u2581Hund", "\u2581renn", "t", "."],
        "tgt_in_tokens": ["<s>", "\u2581A", "\u2581dog", "\u2581runs", "."],
        "tgt_out_tokens": ["\u2581A", "\u2581dog", "\u2581runs", ".", "</s>"],
    }
    size = {k: (len(entry[r]), len(entry[c])) for k, (r, c) in A.ROWS_COLS.items()}
    attn = {k: [rng.dirichlet(np.full(size[k][1], 0.3), size=(1, heads, size[k][0]))] for k in A.KINDS}
    causal = np.tril(np.ones(size["dec_self"], dtype=bool))
    attn["dec_self"][0] = attn["dec_self"][0] * causal
    attn["dec_self"][0] /= attn["dec_self"][0].sum(-1, keepdims=True)
    index = {"kinds": list(A.KINDS), "layers": 1, "heads": heads, "rows_cols": A.ROWS_COLS, "sentences": [entry]}
    return index, [attn]


def test_lines_view_draws_one_path_per_weight_above_the_threshold(tmp_path):
    """bertviz's head view: one path per (head, query, key) with weight >= LINE_MIN (0.02), in its head's colour,
    its opacity the weight; query tokens on the left, keys on the right; clicking a head's swatch hides its
    lines, a double click shows it alone."""
    index, arrays = synthetic_dump()
    page = tmp_path / "viewer.html"
    page.write_text(V.viewer_html(index, arrays), encoding="utf-8")
    entry = index["sentences"][0]
    for kind in ("dec_self", "cross"):
        weights = np.round(arrays[0][kind][0][0], 4)  # (h, q, k) as the page holds them
        assert ((weights > 0) & (weights < V.LINE_MIN)).sum() >= 5  # the threshold has something to leave out
        browser = open_viewer(page, tmp_path, f"s=0&kind={kind}&layer=0&head=mean&view=lines")
        try:
            browser.wait_js(f"document.body.dataset.rendered === '0/{kind}/0/mean/lines'")

            def paths():
                return browser.js(
                    "[...document.querySelectorAll('#lines-body path')].map(p => "
                    "[+p.dataset.h, +p.dataset.q, +p.dataset.k, +p.getAttribute('stroke-opacity'), "
                    "p.getAttribute('stroke')])"
                )

            def want(heads):
                return sorted((h, q, k) for h in heads for q, k in zip(*np.nonzero(weights[h] >= V.LINE_MIN)))

            drawn = paths()
            assert sorted((h, q, k) for h, q, k, _, _ in drawn) == want(range(len(weights)))
            colours = P.head_colours(len(weights))
            assert len(set(colours)) == len(weights)
            for h, q, k, opacity, stroke in drawn:
                assert abs(opacity - weights[h, q, k]) <= 5e-4 + 1e-9 and stroke == colours[h]  # 3 decimals
                assert kind != "dec_self" or k <= q  # the causal mask: nothing from the future
            tokens = browser.js(
                "[[...document.querySelectorAll('span.tok.q')].map(t => t.textContent), "
                "[...document.querySelectorAll('span.tok.k')].map(t => t.textContent)]"
            )
            assert tokens == [entry[name] for name in A.ROWS_COLS[kind]]

            def click(selector: str, count: int = 1):
                x, y = browser.js(
                    f"(() => {{ const r = document.querySelector('{selector}').getBoundingClientRect(); "
                    f"return [r.x + r.width / 2, r.y + r.height / 2]; }})()"
                )
                for n in range(1, count + 1):
                    for kind_ in ("mousePressed", "mouseReleased"):
                        browser.page("Input.dispatchMouseEvent", type=kind_, x=x, y=y, button="left", clickCount=n)

            click('#swatches .head[data-h="0"]')
            browser.wait_js("document.querySelector('#swatches .head[data-h=\"0\"]').classList.contains('off')")
            assert sorted((h, q, k) for h, q, k, _, _ in paths()) == want([1, 2])
            click('#swatches .head[data-h="1"]', count=2)  # a double click: head 1 alone
            browser.wait_js("document.querySelector('#swatches .head[data-h=\"2\"]').classList.contains('off')")
            assert sorted((h, q, k) for h, q, k, _, _ in paths()) == want([1])
            assert console_errors(browser) == []
        finally:
            browser.close()


HOSTILE = "Ein Hund <!--<script> rennt & </script> über\u2028die\u2029Wiese > 1."


def test_viewer_survives_markup_in_the_sentences(tokenizer, tmp_path):
    """Text that HTML would read as markup inside <script> (`<!--<script>`, `</script>`) stays text."""
    if CHROMIUM is None:
        pytest.skip(NO_CHROMIUM)
    model = tiny_model(tokenizer.vocab_size, max_len=80)  # room for the byte pieces of the markup
    out = A.dump_model(model, tokenizer, [HOSTILE, SENTENCES[1]], tmp_path / "dump", pictures=False)
    page = (out / "viewer.html").read_text(encoding="utf-8")
    data = page.split('id="attention-data">', 1)[1].split("</script>", 1)[0]
    assert not set("<>&\u2028\u2029") & set(data)  # every one escaped
    assert json.loads(data)["sentences"][0]["source"] == HOSTILE  # and read back unchanged
    browser = open_viewer(out / "viewer.html", tmp_path)
    try:
        assert browser.js("document.body.dataset.rendered") == opening(out)  # the script ran
        assert browser.js("DATA.sentences[0].source") == HOSTILE
        assert HOSTILE in browser.js("document.getElementById('sentence-text').textContent")
        assert browser.js("document.querySelectorAll('script').length") == 2  # no element made from the text
        assert console_errors(browser) == []
    finally:
        browser.close()


def test_the_dump_decodes_at_the_models_length_penalty(tokenizer, tmp_path):
    """A model whose run chose an alpha on validation (meta `length_penalty`) is dumped as the translator, by
    default, translates it: at that alpha."""
    from annotated.decoding.translate import translate

    model = tiny_model(tokenizer.vocab_size)
    with torch.no_grad():  # eos about as likely as the rest: the length penalty then changes the translations
        model.generator.bias[A.EOS] += 3.0
    at = {a: [translate(model, tokenizer, s, length_penalty=a)[0] for s in SENTENCES] for a in (0.6, 3.0)}
    assert at[0.6] != at[3.0]
    out = A.dump_model(
        model,
        tokenizer,
        SENTENCES,
        tmp_path / "dump",
        pictures=False,
        viewer=False,
        meta={"src_lang": "de", "tgt_lang": "en", "length_penalty": 3.0},
    )
    index = A.read_index(out)
    assert index["decoder"] == {"beam_size": 4, "length_penalty": 3.0}
    assert [entry["translation"] for entry in index["sentences"]] == at[3.0]


def test_the_dump_translates_as_the_translator_does(full_dump, checkpoints):
    """The viewer and `make translate` show the same sentence: same decoder (beam 4), same settings."""
    from annotated.checkpoint import load_checkpoint
    from annotated.decoding.translate import translate

    model, tokenizer, _ = load_checkpoint(checkpoints[1])
    index = A.read_index(full_dump)
    assert index["decoder"] == {"beam_size": 4, "length_penalty": 0.6}
    for entry in index["sentences"]:
        assert entry["translation"] == translate(model, tokenizer, entry["source"])[0]
        ids = entry["tgt_out_ids"]
        assert tokenizer.decode(ids[:-1] if ids[-1] == A.EOS else ids) == entry["translation"]


def test_head_scores_are_read_only_when_they_fit_the_checkpoint(checkpoints, tmp_path):
    model = tiny_model(50)
    ckpt = tmp_path / "best.pt"
    assert V.read_head_importance(ckpt, model.config) == (None, None)  # no heads.json: nothing to say
    scores = heads_json(model.config, ckpt)
    (tmp_path / "heads.json").write_text(json.dumps(scores))
    importance, note = V.read_head_importance(ckpt, model.config)
    assert note is None and importance["dec_self"] == scores["kinds"]["dec_self"]["importance"]
    scores["kinds"]["cross"]["importance"][1].pop()  # a pruned model's table: one head short
    (tmp_path / "heads.json").write_text(json.dumps(scores))
    assert V.read_head_importance(ckpt, model.config)[0] is None
    assert "does not hold 2 layers x 2 finite head scores" in V.read_head_importance(ckpt, model.config)[1]
    (tmp_path / "heads.json").write_text(json.dumps(heads_json(model.config, tmp_path / "other.pt")))
    assert "not this checkpoint" in V.read_head_importance(ckpt, model.config)[1]


def heads_json(cfg, checkpoint: Path) -> dict:
    """A heads.json as `python -m annotated.attention.heads` writes it, with distinct made-up scores."""
    kinds = {
        kind: {
            "importance": [
                [round(0.1 * (k + 1) + 0.01 * layer + 0.001 * head, 6) for head in range(cfg.h)]
                for layer in range(cfg.N)
            ]
        }
        for k, kind in enumerate(("enc_self", "dec_self", "cross"))
    }
    return {"checkpoint": str(checkpoint), "kinds": kinds}


THUMBS = """(kind => [...document.querySelectorAll(`td.thumb[data-kind="${kind}"]`)].map(td => {
    const c = td.querySelector('canvas'), px = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
    const score = td.querySelector('.score');
    return {layer: +td.dataset.layer, head: +td.dataset.head, w: c.width, h: c.height, rgba: [...px],
            score: score && score.textContent}; }))"""


def check_thumbnail(t: dict, weights: np.ndarray, kind: str) -> None:
    """A thumbnail is one pixel per (query, key) in the colour table's colour of its weight; grey where masked."""
    assert (t["h"], t["w"]) == weights.shape
    rgba = np.array(t["rgba"]).reshape(t["h"], t["w"], 4)
    blocked = np.triu(np.ones(weights.shape, dtype=bool), 1) if kind == "dec_self" else np.zeros(weights.shape, bool)
    grey = [int(P.MASKED[i : i + 2], 16) for i in (1, 3, 5)] + [255]
    assert (rgba[blocked] == grey).all()  # the causal mask's grey
    assert (rgba[~blocked][:, 3] == 255).all()
    shown = weights_from_colours(rgba[~blocked][:, :3])
    assert (abs(shown - weights[~blocked]) <= 0.5 / 63 + 1e-4).all()  # the nearest of 64 colours


def test_model_view_in_headless_chromium(checkpoints, tmp_path):
    """The three kinds, labelled, each a layer x head grid of thumbnails (pixels = the weights, in the colour
    map), token labels where they fit, each head's importance under it, click to zoom, nothing fetched."""
    ckpt = tmp_path / "run" / "best.pt"
    ckpt.parent.mkdir()
    shutil.copy(checkpoints[0], ckpt)
    model, _, _ = A.load_checkpoint(ckpt)
    scores = heads_json(model.config, ckpt)
    (ckpt.parent / "heads.json").write_text(json.dumps(scores))
    out = A.dump(ckpt, SENTENCES, pictures=False)
    index = A.read_index(out)
    assert index["head_importance"]["cross"] == scores["kinds"]["cross"]["importance"]
    page = out / "viewer.html"
    browser = open_viewer(page, tmp_path, "s=1&kind=cross&view=model")
    try:
        browser.wait_js("document.body.dataset.rendered === '1/model'")
        attn, entry = A.load_sentence(out, 1)
        blocks = browser.js(
            "[...document.querySelectorAll('.kind-block')].map(b => "
            "[b.dataset.kind, b.querySelector('h3').textContent, b.querySelector('.how').textContent])"
        )
        assert blocks == [[k, P.KIND_LABELS[k], P.caption(k)] for k in A.KINDS]
        for kind in A.KINDS:
            thumbs = browser.js(f"{THUMBS}('{kind}')")
            assert len(thumbs) == index["layers"] * index["heads"]
            for t in thumbs:
                check_thumbnail(t, attn[kind][t["layer"]][0, t["head"]], kind)
                want = scores["kinds"][kind]["importance"][t["layer"]][t["head"]]
                assert t["score"] == f"importance {want:.3f}"
            # token labels where they fit: beside the first head, under the last layer, in the convention's order
            rows, cols = (entry[n] for n in index["rows_cols"][kind])
            scale = browser.js(
                f"parseFloat(document.querySelector('td.thumb[data-kind=\"{kind}\"] canvas').style.width) / {len(cols)}"
            )
            strips = browser.js(f"""[...document.querySelectorAll('td.thumb[data-kind="{kind}"] .rlabels, '
                                 + 'td.thumb[data-kind="{kind}"] .clabels')].map(d => [d.className,
                                 [...d.children].map(s => s.textContent)])""")
            if scale >= 8:
                assert strips == [["rlabels", rows]] * index["layers"] + [["clabels", cols]] * index["heads"], kind
            else:
                assert strips == [], kind

        # a real click on the cross-attention thumbnail of layer 1, head 0 opens that head
        x, y = browser.js(
            '(() => { const e = document.querySelector(\'td.thumb[data-kind="cross"][data-layer="1"]'
            '[data-head="0"]\'); e.scrollIntoView(); const r = e.getBoundingClientRect(); '
            "return [r.x + r.width / 2, r.y + r.height / 2]; })()"
        )
        for kind in ("mousePressed", "mouseReleased"):
            browser.page("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)
        browser.wait_js("document.body.dataset.rendered === '1/cross/1/0'")
        assert browser.js("document.getElementById('model').hidden") is True
        want = scores["kinds"]["cross"]["importance"][1][0]
        assert f"importance of layer 1, head 0: {want:.3f}" in browser.js(
            "document.getElementById('importance').textContent"
        )
        assert [url.split("#")[0] for url in browser.requests()] == [page.as_uri()]
        assert console_errors(browser) == []
    finally:
        browser.close()


def test_the_embedded_viewer_opens_on_its_start_view_without_heading(full_dump, tmp_path):
    index = A.read_index(full_dump)
    arrays = [A.load_sentence(full_dump, i)[0] for i in range(len(index["sentences"]))]
    page = tmp_path / "embedded.html"
    page.write_text(
        V.viewer_html(index, arrays, embedded=True, start="s=1&kind=cross&layer=0&head=1&view=lines"), encoding="utf-8"
    )
    browser = open_viewer(page, tmp_path)
    try:
        browser.wait_js("document.body.dataset.rendered === '1/cross/0/1/lines'")
        assert browser.js(
            "[getComputedStyle(document.getElementById('heading')).display, "
            "getComputedStyle(document.getElementById('footer')).display]"
        ) == ["none", "none"]
        assert console_errors(browser) == []
    finally:
        browser.close()


# ---------------------------------------------------------------- a pruned model

PRUNED = {("enc_self", 0): [1], ("dec_self", 1): [0, 2, 3], ("cross", 0): [3], ("cross", 1): [0, 1]}
PRUNED_COUNTS = {"enc_self": [3, 4], "dec_self": [4, 1], "cross": [3, 2]}  # of 4 heads each


def test_a_pruned_model_dumps_and_shows_each_layer_with_its_own_heads(tokenizer, tmp_path):
    """A pruned checkpoint (fewer heads in some layers): per-layer arrays of its own heads, pictures with
    empty cells, head scores that fit it, and a viewer whose rows and menus hold exactly each layer's heads."""
    from annotated.attention.prune import save_pruned
    from annotated.sites import remove_heads

    full = tiny_model(tokenizer.vocab_size, attention="fused", dtype=torch.float32, h=4)
    ckpt = tmp_path / "run" / "pruned.pt"
    ckpt.parent.mkdir()
    save_pruned(ckpt, remove_heads(full, PRUNED), tokenizer, {"src_lang": "de", "tgt_lang": "en"})
    model, _, _ = A.load_checkpoint(ckpt)
    assert head_counts(model) == PRUNED_COUNTS
    scores = heads_json(model.config, ckpt)  # a table of the unpruned shape: 4 scores in every layer
    for kind in A.KINDS:
        scores["kinds"][kind]["importance"] = [
            row[:n] for row, n in zip(scores["kinds"][kind]["importance"], PRUNED_COUNTS[kind])
        ]
    unpruned = heads_json(model.config, ckpt)
    (ckpt.parent / "heads.json").write_text(json.dumps(unpruned))
    importance, note = V.read_head_importance(ckpt, model.config, PRUNED_COUNTS)
    assert importance is None and "one finite score per head of this pruned model" in note
    (ckpt.parent / "heads.json").write_text(json.dumps(scores))
    importance, note = V.read_head_importance(ckpt, model.config, PRUNED_COUNTS)
    assert note is None and importance["cross"] == [[0.3, 0.301, 0.302], [0.31, 0.311]]
    out = A.dump(ckpt, SENTENCES)
    index = A.read_index(out)
    assert index["heads"] == 4 and index["head_counts"] == PRUNED_COUNTS
    assert index["head_importance"]["cross"] == scores["kinds"]["cross"]["importance"]
    for s, entry in enumerate(index["sentences"]):
        attn, _ = A.load_sentence(out, s)
        for kind in A.KINDS:
            rows, cols = (entry[name] for name in index["rows_cols"][kind])
            want = [[1, n, len(rows), len(cols)] for n in PRUNED_COUNTS[kind]]
            assert [list(a.shape) for a in attn[kind]] == entry["shapes"][kind] == want, (s, kind)
            for a in attn[kind]:
                np.testing.assert_allclose(a.sum(-1), 1.0, atol=1e-5)
            figure = P.grid_figure(attn[kind], rows, cols, kind)
            assert len([ax for ax in figure.axes if ax.images]) == sum(PRUNED_COUNTS[kind])  # empty cells: none
        # the encoder's first layer reads the embeddings, which pruning leaves alone: its heads are the
        # unpruned model's heads 0, 2 and 3, in that order
        full_attn = A.collect_attention(full, entry["src_ids"], entry["tgt_out_ids"])
        np.testing.assert_allclose(attn["enc_self"][0][0], full_attn["enc_self"][0][0, [0, 2, 3]], rtol=0, atol=1e-6)
        assert (out / entry["pictures"]["cross"]).stat().st_size > 0
    with pytest.raises(ValueError, match="one finite score per head of this model"):  # the unpruned table
        A.dump_model(
            model,
            tokenizer,
            SENTENCES,
            tmp_path / "other",
            pictures=False,
            importance={kind: unpruned["kinds"][kind]["importance"] for kind in A.KINDS},
        )
    assert not (tmp_path / "other").exists()
    assert "pruned to enc_self [3, 4], dec_self [4, 1], cross [3, 2] heads per layer" in (
        out / "viewer.html"
    ).read_text(encoding="utf-8")

    page = out / "viewer.html"
    browser = open_viewer(page, tmp_path, "s=1&kind=dec_self&layer=1&head=3&view=head")
    try:
        # head 3 of a layer that kept one head: the page shows the one head there is
        browser.wait_js("document.body.dataset.rendered === '1/dec_self/1/0'")
        for kind in A.KINDS:
            for layer, n in enumerate(PRUNED_COUNTS[kind]):  # the head menu offers exactly the layer's heads
                show(browser, f"s=1&kind={kind}&layer={layer}&head=mean&view=head", f"1/{kind}/{layer}/mean")
                options = browser.js("[...document.getElementById('head').options].map(o => o.value)")
                assert options == ["mean"] + [str(h) for h in range(n)], (kind, layer)
                cells = browser.js(
                    "[...document.querySelectorAll('td.cell:not(.blocked)')].map(td => "
                    "[+td.dataset.q, +td.dataset.k, parseFloat(td.title.split(': ').pop())])"
                )
                mean = attn[kind][layer][0].mean(0)  # (q, k): the mean over this layer's heads only
                assert len(cells) > 0
                for q, k, shown in cells:  # each cell's title gives its weight to 3 decimals
                    assert abs(shown - mean[q, k]) <= 6e-4, (kind, layer, q, k)
                show(browser, f"s=1&kind={kind}&layer={layer}&head=mean&view=lines", f"1/{kind}/{layer}/mean/lines")
                assert browser.js("document.querySelectorAll('#swatches .head').length") == n

        show(browser, "s=1&view=model", "1/model")
        for kind in A.KINDS:
            block = f'.kind-block[data-kind="{kind}"]'
            rows = browser.js(f"""[...document.querySelectorAll('{block} table.model tr')].slice(1).map(tr => ({{
                header: tr.querySelector('th').textContent,
                thumbs: [...tr.querySelectorAll('td.thumb')].map(td => [+td.dataset.layer, +td.dataset.head])}}))""")
            assert len(rows) == 2
            header = browser.js(f"document.querySelector('{block} table.model tr').querySelectorAll('th').length")
            assert header == 1 + max(PRUNED_COUNTS[kind])  # a column per head of the fullest layer
            thumbs = browser.js(f"{THUMBS}('{kind}')")
            for layer, row in enumerate(rows):
                n = PRUNED_COUNTS[kind][layer]
                assert row["thumbs"] == [[layer, h] for h in range(n)], (kind, layer)
                assert row["header"] == f"layer {layer} ({n} head{'s' if n > 1 else ''})"
            for t in thumbs:
                check_thumbnail(t, attn[kind][t["layer"]][0, t["head"]], kind)
                want = scores["kinds"][kind]["importance"][t["layer"]][t["head"]]
                assert t["score"] == f"importance {want:.3f}"
        assert [url.split("#")[0] for url in browser.requests()] == [page.as_uri()]
        assert console_errors(browser) == []
    finally:
        browser.close()


@pytest.mark.parametrize("width", [1000, 1400])
def test_the_model_views_labels_are_whole(tmp_path, width):
    """The model view's token labels (rotated under the last layer, upright beside head 0) show the whole
    token: `orangefarbenen`, not `orangefarbe`; nothing the label holds is cut off by its box."""
    index, arrays = synthetic_dump()
    entry = index["sentences"][0]
    long = ["\u2581Ein", "\u2581Mann", "\u2581mit", "\u2581einem", "\u2581orangefarbenen", "\u2581Hut", "."]
    entry.update(src_tokens=long, tgt_in_tokens=["<s>", *long[:-1]], tgt_out_tokens=long)
    size = {k: (len(entry[r]), len(entry[c])) for k, (r, c) in A.ROWS_COLS.items()}
    rng = np.random.default_rng(0)
    arrays = [{k: [rng.dirichlet(np.ones(size[k][1]), size=(1, index["heads"], size[k][0]))] for k in A.KINDS}]
    page = tmp_path / "viewer.html"
    page.write_text(V.viewer_html(index, arrays), encoding="utf-8")
    browser = open_viewer(page, tmp_path, "s=0&kind=cross&layer=0&head=0&view=model", width=width)
    try:
        browser.wait_js("document.body.dataset.rendered === '0/model'")
        labels = browser.js(
            "[...document.querySelectorAll('.clabels span, .rlabels span')].map(s => "
            "[s.parentElement.className, s.textContent, s.scrollWidth - s.clientWidth, "
            "s.scrollHeight - s.clientHeight, (() => { const r = document.createRange(); r.selectNodeContents(s);"
            " const t = r.getBoundingClientRect(), b = s.getBoundingClientRect();"
            " return [t.height - b.height, t.width - b.width, t.height]; })()])"
        )
        across = [label for label in labels if label[0] == "clabels"]
        assert across and "\u2581orangefarbenen" in [label[1] for label in across]
        # the label's box holds its text (no scrolling inside, the text's own box no longer than the label's);
        # 1 px: subpixel rounding
        cut = [label for label in labels if max(label[2], label[3], label[4][0], label[4][1]) > 1]
        assert cut == [], cut
        text = {label[1]: label[4][2] for label in across}  # the rotated text's length on the page
        assert text["\u2581orangefarbenen"] > 4 * text["."], text
        assert console_errors(browser) == []
    finally:
        browser.close()
