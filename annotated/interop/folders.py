# %% [markdown]
# # Export and import through folders
#
# `annotated/interop/marian.py` converts models in memory (`to_marian`,
# `from_marian`); this file writes and reads what `save_pretrained` and
# `from_pretrained` use, with the tokenizer, and holds the command:
#
# ```sh
# python -m annotated.interop.folders export runs/<run>/averaged.pt exported/   # make export
# python -m annotated.interop.folders import exported/ imported.pt              # make import
# ```

# %%
from __future__ import annotations

import contextlib
import importlib.util
import json
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from annotated.checkpoint import CheckpointError, case_table_in, loaded_from_state, read_checkpoint, save_checkpoint
from annotated.decoding.settings import Decoding, model_length_penalty
from annotated.door import CHECKPOINT_HELP, Door
from annotated.interop.card import model_card
from annotated.interop.marian import from_marian, marian_vocab, to_marian
from annotated.plumbing.files import staged_directory
from annotated.plumbing.options import Parser
from annotated.plumbing.scripts import usage_of
from annotated.shipped import is_shipped, read_card
from annotated.tokens import BOS, EOS, PAD, UNK, Tokenizer, TokenizerError
from annotated.transformer import AttentionForm

# %% [markdown]
# ## Folders and files
#
# An exported folder holds what `save_pretrained` writes (`config.json`,
# `generation_config.json`, `model.safetensors`: Marian's own tensors,
# section 1 of `marian.py`), `MarianTokenizer`'s files, a model card
# `README.md` (`card.py`), `annotated.json` and, where `ctranslate2` is
# installed, `ctranslate2/`. The tokenizer is our sentencepiece model as both
# `source.spm` and `target.spm`; `vocab.json` maps each piece to our id, the
# appended pad row named `<pad>` as in OPUS-MT (so our own pad, id 0, becomes
# `<annotated-pad>`). `tokenizer_config.json` names the language pair and
# `model_max_length`, so that `truncation=True` cuts a long source to what the
# model reads (`test_a_long_source_goes_through_generate`). `MarianTokenizer`
# appends `</s>` to every source, and our models were trained without it:
# encode with `tokenizer(text, add_special_tokens=False)`.
#
# The generation config asks for our translator's beam and
# `early_stopping=True` (our rule), with `transformers`' default
# `length_penalty=1.0`: no setting of `generate`'s `|Y|^length_penalty` ranks
# as GNMT's alpha does (section 6 of `marian.py`). It and `config.json` name
# the same special ids
# (`test_the_generation_config_starts_the_decoder_with_our_first_input`).
#
# **`annotated.json`** carries what our translator decodes with beyond the
# model, which `make import` reads back: the checkpoint's length penalty
# (`model_length_penalty`) and recasing table (`annotated/decoding/casing.py`),
# so that an export imported back translates as the checkpoint did, byte for
# byte (`test_export_then_import_translates_as_the_checkpoint`).
#
# **`ctranslate2/`** is written in CTranslate2's layout (section 1 of
# `marian.py`) to a scratch folder and converted there by CTranslate2's own
# converter (`TransformersConverter`, the code of
# `ct2-transformers-converter`); `ctranslate2.Translator("<folder>/ctranslate2")`
# loads it (`test_the_exported_ctranslate2_model_gives_our_log_probabilities`).
# A checkpoint without a tokenizer exports none (the converter needs it).
#
# The folder is written beside its target under a temporary name and renamed
# into place at the end; an existing one is replaced only with `--overwrite`
# and only if it holds a `config.json` (a model folder, not a home directory).


# %%
OUR_PAD_PIECE = "<annotated-pad>"  # vocab.json's name for our pad (id 0): `<pad>` is the appended row's


def export_vocab(tokenizer, size: int) -> dict[str, int]:
    """vocab.json of the export: our pieces at our ids (pad renamed), unused ids up to the appended row, `<pad>` last."""
    names = tokenizer.pieces(range(tokenizer.vocab_size))
    names[PAD] = OUR_PAD_PIECE
    names += [f"<unused-{i}>" for i in range(len(names), size - 1)] + ["<pad>"]
    return {piece: i for i, piece in enumerate(names)}


def _write_tokenizer(tokenizer, folder: Path, size: int, meta: dict, max_len: int) -> None:
    """source.spm, target.spm, vocab.json and MarianTokenizer's own config, for our tokenizer."""
    from transformers import MarianTokenizer

    for name in ("source.spm", "target.spm"):
        (folder / name).write_bytes(tokenizer.to_bytes())
    vocab = export_vocab(tokenizer, size)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    MarianTokenizer(
        str(folder / "source.spm"),
        str(folder / "target.spm"),
        str(folder / "vocab.json"),
        source_lang=meta.get("src_lang"),
        target_lang=meta.get("tgt_lang"),
        unk_token=tokenizer.pieces([UNK])[0],
        eos_token=tokenizer.pieces([EOS])[0],
        pad_token="<pad>",
        model_max_length=max_len,
    ).save_pretrained(str(folder))


def generation_config(config):
    """The export's generation config: our translator's search where `generate` has it, and the special ids of the
    model's MarianConfig `config`."""
    from transformers import GenerationConfig

    return GenerationConfig(
        decoder_start_token_id=config.decoder_start_token_id,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        num_beams=Decoding.beam,  # the translator's
        early_stopping=True,
        length_penalty=1.0,  # transformers' default: generate's |Y|^length_penalty is not our GNMT alpha
        max_length=config.max_position_embeddings,
        forced_eos_token_id=None,
    )


SIDE_FILE = "annotated.json"  # what our translator needs beyond the model; transformers ignores it
SIDE_FORMAT = "annotated-export-v1"


def side_file(meta: dict, table: dict | None) -> str:
    """annotated.json of an export: the chosen length penalty and the recasing table (None: the checkpoint has none)."""
    side = {"format": SIDE_FORMAT, "length_penalty": model_length_penalty(meta), "casing": table}
    return json.dumps(side, ensure_ascii=False, separators=(",", ":"), sort_keys=True) + "\n"


def read_side_file(folder: Path) -> tuple[dict, dict | None]:
    """(meta entries, recasing table or None) from `folder`'s annotated.json; nothing for a folder without one."""
    path = folder / SIDE_FILE
    if not path.is_file():
        return {}, None
    try:
        side = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); export the checkpoint again, or delete it") from None
    side = side if isinstance(side, dict) else {}
    alpha, table = side.get("length_penalty"), side.get("casing")
    good_alpha = isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and 0 <= alpha < float("inf")
    good_table = table is None or (isinstance(table, dict) and all(isinstance(v, str) for v in table.values()))
    if not (side.get("format") == SIDE_FORMAT and isinstance(alpha, (int, float)) and good_alpha and good_table):
        raise ValueError(f"{path} is not an {SIDE_FORMAT} file; export the checkpoint again, or delete it")
    return {"length_penalty": float(alpha)}, table


def write_ctranslate2_layout(model, heads: dict | None, tokenizer, meta: dict, folder: Path) -> Path:
    """`folder`: `model` in CTranslate2's layout (section 1 of marian.py) as a MarianMTModel folder with its
    tokenizer, for CTranslate2's converter only (saved again by transformers, it loses its start vector)."""
    hf = to_marian(model, heads, for_ctranslate2=True)
    hf.save_pretrained(str(folder))
    _write_tokenizer(tokenizer, folder, marian_vocab(model.config), meta, model.config.max_len)
    return folder


def _write_ctranslate2(model, heads: dict | None, tokenizer, meta: dict, staging: Path) -> None:
    """staging/ctranslate2: the model converted by CTranslate2's own converter from its layout, written to a scratch
    folder that is removed afterwards."""
    from ctranslate2.converters import TransformersConverter

    scratch = Path(tempfile.mkdtemp(dir=staging, prefix=".ctranslate2-layout-"))
    try:
        write_ctranslate2_layout(model, heads, tokenizer, meta, scratch)
        TransformersConverter(str(scratch)).convert(str(staging / "ctranslate2"))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def has_ctranslate2() -> bool:
    return importlib.util.find_spec("ctranslate2") is not None


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """The command's output is its own lines: transformers' progress bars (the shards written, the weights
    loaded) and MarianTokenizer's hint to install sacremoses (its Moses punctuation normaliser, which the exported folder's
    sentencepiece models do not need) are kept off the terminal."""
    from transformers.utils import logging as transformers_logging

    shown = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Recommended: pip install sacremoses")
            yield
    finally:
        if shown:
            transformers_logging.enable_progress_bar()


def _refuse_existing(out: Path, overwrite: bool) -> None:
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass overwrite=True (--overwrite) to replace it, or choose another")


def export_marian(checkpoint: Path, out: Path, as_typed: str | None = None, overwrite: bool = False) -> Path:
    """Write checkpoint `checkpoint` (named `as_typed` on the command line) as a MarianMTModel folder `out`; an
    existing `out` is replaced only with `overwrite` and only if it is a model folder."""
    _refuse_existing(out, overwrite)
    if out.exists() and not (out / "config.json").is_file():
        raise FileExistsError(f"{out} exists and is not a model folder (no config.json in it): choose another folder")
    state = read_checkpoint(checkpoint)
    model, tokenizer, meta = loaded_from_state(state, checkpoint)
    hf = to_marian(model, state.get("heads"))
    hf.generation_config = generation_config(hf.config)
    shipped = read_card(Path(checkpoint).stem) if is_shipped(Path(checkpoint)) else None
    with staged_directory(out) as staging, _quiet_transformers():
        hf.save_pretrained(str(staging))
        (staging / SIDE_FILE).write_text(side_file(meta, case_table_in(state, checkpoint)), encoding="utf-8")
        if tokenizer is not None:
            _write_tokenizer(tokenizer, staging, marian_vocab(model.config), meta, model.config.max_len)
            if has_ctranslate2():
                _write_ctranslate2(model, state.get("heads"), tokenizer, meta, staging)
        card = model_card(as_typed or str(checkpoint), Path(checkpoint), meta, shipped, model.config)
        (staging / "README.md").write_text(card, encoding="utf-8")
    return out


def _tokenizer_of(folder: Path, src_map: list[int], tgt_map: list[int]):
    """Our Tokenizer for a Marian folder whose sentencepiece model has our ids (an export of ours), else None."""
    files = [folder / n for n in ("source.spm", "target.spm", "vocab.json")]
    if not all(f.is_file() for f in files) or files[0].read_bytes() != files[1].read_bytes():
        return None
    try:
        tokenizer = Tokenizer(files[0].read_bytes())
    except TokenizerError:
        return None
    vocab = json.loads(files[2].read_text(encoding="utf-8"))
    identity = list(range(tokenizer.vocab_size))
    return tokenizer if vocab == export_vocab(tokenizer, len(vocab)) and src_map == tgt_map == identity else None


def _renumbered_tokenizer(folder: Path, src_map: list[int], tgt_map: list[int]):
    """Our Tokenizer for a Marian folder with one vocabulary (OPUS-MT's layout): its source sentencepiece model
    with the pieces renumbered to our ids, or None where that cannot be done."""
    from sentencepiece import sentencepiece_model_pb2

    pb: Any = sentencepiece_model_pb2  # generated protobuf classes: no types for mypy to read

    spm, vocab_file = folder / "source.spm", folder / "vocab.json"
    if src_map != tgt_map or not (spm.is_file() and vocab_file.is_file()):
        return None
    piece_of = {i: p for p, i in json.loads(vocab_file.read_text(encoding="utf-8")).items()}
    if sorted(piece_of) != sorted(set(src_map)):
        return None
    proto = pb.ModelProto()
    proto.ParseFromString(spm.read_bytes())
    known = {p.piece: (p.score, p.type) for p in proto.pieces}
    lowest = min((score for score, _ in known.values()), default=0.0) - 1000.0
    names = [piece_of[i] for i in src_map]
    if names[BOS] == names[PAD]:  # the decoder start is the pad: our bos needs a piece of its own
        names[BOS] = next(n for n in ("<s>", "<bos>", "<annotated-bos>") if n not in names)
    del proto.pieces[:]
    for i, name in enumerate(names):
        score, kind = known.get(name, (lowest, pb.ModelProto.SentencePiece.NORMAL))  # target-only: never chosen
        if i in (PAD, BOS, EOS, UNK):
            score, kind = 0.0, pb.ModelProto.SentencePiece.UNKNOWN if i == UNK else pb.ModelProto.SentencePiece.CONTROL
        elif kind in (pb.ModelProto.SentencePiece.UNKNOWN, pb.ModelProto.SentencePiece.CONTROL):
            kind = pb.ModelProto.SentencePiece.CONTROL  # the source model's own specials: never produced
        proto.pieces.add(piece=name, score=score, type=kind)
    spec = proto.trainer_spec
    spec.pad_id, spec.bos_id, spec.eos_id, spec.unk_id = PAD, BOS, EOS, UNK
    spec.pad_piece, spec.bos_piece, spec.eos_piece, spec.unk_piece = names[:4]
    spec.vocab_size = len(names)
    try:
        return Tokenizer(proto.SerializeToString())
    except TokenizerError:
        return None


def _languages(folder: Path, src: str | None, tgt: str | None) -> dict:
    """src_lang/tgt_lang: as given (--src/--tgt name the pair even where the folder names one), else
    tokenizer_config.json's source_lang/target_lang; ValueError where neither names both."""
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = {}
    found = {"src_lang": src or config.get("source_lang"), "tgt_lang": tgt or config.get("target_lang")}
    missing = [f"--{k.removesuffix('_lang')}" for k, v in found.items() if not (v and isinstance(v, str))]
    if missing:
        raise ValueError(
            f"{folder} names no language pair (no source_lang/target_lang in its tokenizer_config.json): name it "
            f"with {' and '.join(missing)} (make import HF=... OUT=... ARGS='--src de --tgt en')"
        )
    return found


def import_marian(
    folder: Path,
    out: Path,
    attention: AttentionForm = "fused",
    src: str | None = None,
    tgt: str | None = None,
    overwrite: bool = False,
) -> tuple[Path, bool]:
    """Write the MarianMTModel folder `folder` as our checkpoint `out`; returns (out, whether it holds a tokenizer).
    The language pair: `src`/`tgt` where given, else the folder's tokenizer_config.json (ValueError where neither
    names it). An export of ours brings back its length penalty and recasing table (annotated.json). An existing
    `out` is replaced only with `overwrite`."""
    from transformers import MarianMTModel

    _refuse_existing(out, overwrite)
    if out.is_dir():
        raise IsADirectoryError(f"{out} is a folder: name the checkpoint file to write, e.g. {out / 'model.pt'}")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} holds no config.json: give a folder written by save_pretrained")
    languages = _languages(folder, src, tgt)
    side_meta, table = read_side_file(folder)
    with _quiet_transformers():
        hf = MarianMTModel.from_pretrained(str(folder), local_files_only=True).float().eval()
    vocab = folder / "vocab.json"
    unk = json.loads(vocab.read_text(encoding="utf-8")).get("<unk>") if vocab.is_file() else None
    model, src_map, tgt_map = from_marian(hf, attention, unk)
    tokenizer = _tokenizer_of(folder, src_map, tgt_map) or _renumbered_tokenizer(folder, src_map, tgt_map)
    meta = {"imported_from": str(folder), "marian_source_ids": src_map, "marian_target_ids": tgt_map}
    meta.update(languages, **side_meta)
    save_checkpoint(out, model, tokenizer, meta, **({"casing": table} if table is not None else {}))
    return out, tokenizer is not None


# %% [markdown]
# ## The command
#
# `export [CHECKPOINT] DIR` and `import HF_DIR OUT.pt`; the checkpoint is
# chosen by the door, as for every command (`annotated/door.py`). A refusal
# is one line on stderr that names the fix, exit code 2, and starts with
# `export:` or `import:`, as `make` names the two
# (`test_export_takes_shipped_names_and_says_what_is_missing`,
# `test_export_and_import_name_themselves`); what they print is their own
# lines, none of transformers' progress bars or hints
# (`test_export_and_import_print_only_their_own_lines`).


# %%
EXPORT_USAGE = f"make export CHECKPOINT=shipped:de-en OUT=exported (or {usage_of(__file__)} export CHECKPOINT DIR)"
IMPORT_USAGE = f"make import HF=folder OUT=model.pt (or {usage_of(__file__)} import HF_DIR OUT.pt)"


def build_parser():
    p = Parser(
        command=__file__,
        description="Export a checkpoint as a transformers MarianMTModel folder, or import one.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="checkpoint -> MarianMTModel folder")
    e.name = "export"  # its errors start `export: error:`, as make export names it
    e.add_argument("checkpoint", nargs="?", default=None, help=CHECKPOINT_HELP)
    e.add_argument("out", nargs="?", default=None, help="the folder to write")
    i = sub.add_parser("import", help="MarianMTModel folder -> checkpoint")
    i.name = "import"
    i.add_argument("hf_dir", nargs="?", default=None, help="a folder written by save_pretrained")
    i.add_argument("out", nargs="?", default=None, help="the checkpoint to write (.pt)")
    i.add_argument("--attention", choices=("fused", "per_head"), default="fused")
    i.add_argument("--src", default=None, help="source language (default: the folder's tokenizer_config.json's)")
    i.add_argument("--tgt", default=None, help="target language, likewise")
    for s in (e, i):
        s.add_argument("--overwrite", action="store_true", help="replace an existing output")
    return p


def _export(args, door) -> None:
    if not args.out:
        door.fail(f"name the folder to write: {EXPORT_USAGE}")
    door.checkpoint(args)
    door.keep(args, [Path(args.out)], flag="--overwrite", elsewhere="name another folder")
    out = export_marian(args.checkpoint, Path(args.out), as_typed=args.typed_checkpoint, overwrite=args.overwrite)
    print(f"wrote {out}: MarianMTModel.from_pretrained({str(out)!r}) loads it")


def _import(args, door) -> None:
    if not args.hf_dir or not args.out:
        door.fail(f"name the folder to read and the checkpoint to write: {IMPORT_USAGE}")
    door.keep(args, [Path(args.out)], flag="--overwrite", elsewhere="name another file")
    out, has_tokenizer = import_marian(
        Path(args.hf_dir), Path(args.out), args.attention, args.src, args.tgt, overwrite=args.overwrite
    )
    note = (
        ": without a tokenizer (its sentencepiece model does not use this project's ids), so it translates token ids, "
        "not text"
    )
    print(f"wrote {out}{'' if has_tokenizer else note}")


def main(argv: list[str] | None = None) -> int:
    args, unknown = build_parser().parse_known_args(argv)
    door = Door(__file__, name=args.command)  # `make export`, `make import`: each names itself
    if unknown:
        door.fail(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        _export(args, door) if args.command == "export" else _import(args, door)
    except (CheckpointError, ValueError, FileExistsError, FileNotFoundError, OSError) as e:
        door.fail(str(e))
    return 0


if __name__ == "__main__":
    from annotated.plumbing.scripts import run_main

    run_main(main)
