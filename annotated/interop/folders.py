# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

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

from pathlib import Path
from typing import Any

from annotated.interop.marian import from_marian, to_marian
from annotated.plumbing.files import staged_directory
from annotated.plumbing.scripts import name_of
from annotated.tokens import BOS, EOS, PAD, UNK
from annotated.transformer import AttentionForm, TransformerConfig

NAME = name_of(__file__)

# %% [markdown]
# ## Folders and files
#
# An exported folder holds what `save_pretrained` writes (`config.json`,
# `generation_config.json`, `model.safetensors`) and the tokenizer files of
# `MarianTokenizer`: our sentencepiece model as both `source.spm` and
# `target.spm`, and `vocab.json`, which maps each piece to its id (ours: the
# sentencepiece model's own ids). One difference in use: `MarianTokenizer`
# appends `</s>` to every source, and our models were trained on sources
# without it. To give the exported model what ours sees, encode with
# `tokenizer(text, add_special_tokens=False)`.
#
# The generation config asks for our translator's search where
# `transformers` has it: beam 4, stop a sentence when 4 translations have
# finished (`early_stopping=True`, our rule, `annotated/decoding/search.py`).
# The length penalties differ in form: ours is GNMT's `((5 + |Y|) / 6)^alpha`,
# `generate` divides by `|Y|^length_penalty`; the two agree only at 0. The
# export writes `length_penalty=1.0`, `transformers`' default, and section 6
# of `marian.py` measures what that changes.
#
# Nothing is overwritten without `--overwrite`: the folder is written
# beside its target under a temporary name and renamed into place at the end,
# and an existing target is replaced only with `--overwrite` and only if it
# holds a `config.json` (it looks like a model folder, not a home directory).


# %%
def _write_tokenizer(tokenizer, folder: Path) -> None:
    """source.spm, target.spm, vocab.json and MarianTokenizer's own config, for our tokenizer."""
    import json

    from transformers import MarianTokenizer

    for name in ("source.spm", "target.spm"):
        (folder / name).write_bytes(tokenizer.to_bytes())
    vocab = {piece: i for i, piece in enumerate(tokenizer.pieces(range(tokenizer.vocab_size)))}
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    MarianTokenizer(
        str(folder / "source.spm"),
        str(folder / "target.spm"),
        str(folder / "vocab.json"),
        unk_token=vocab_piece(tokenizer, UNK),
        eos_token=vocab_piece(tokenizer, EOS),
        pad_token=vocab_piece(tokenizer, PAD),
    ).save_pretrained(str(folder))


def vocab_piece(tokenizer, i: int) -> str:
    return tokenizer.pieces([i])[0]


def generation_config(cfg: TransformerConfig, length_penalty: float = 1.0):
    from transformers import GenerationConfig

    return GenerationConfig(
        decoder_start_token_id=BOS,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        num_beams=4,
        early_stopping=True,
        length_penalty=length_penalty,
        max_length=cfg.max_len,
        forced_eos_token_id=None,
    )


def _check_target(out: Path, overwrite: bool, kind: str) -> None:
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass --overwrite to replace it, or choose another {kind}")
    if out.exists() and kind == "folder" and not (out.is_dir() and (out / "config.json").is_file()):
        raise FileExistsError(
            f"{out} exists and is not a model folder (no config.json in it); it is not replaced: choose another folder"
        )
    if out.exists() and kind == "file" and not out.is_file():
        raise FileExistsError(f"{out} exists and is not a file; choose another output path")


def export_marian(checkpoint: Path, out: Path, overwrite: bool = False) -> Path:
    """Write checkpoint `checkpoint` as a MarianMTModel folder `out`; returns `out`."""
    from annotated.checkpoint import load_checkpoint, read_checkpoint

    _check_target(out, overwrite, "folder")
    model, tokenizer, _ = load_checkpoint(checkpoint)
    hf = to_marian(model, read_checkpoint(checkpoint).get("heads"))
    hf.generation_config = generation_config(model.config)
    with staged_directory(out) as staging:
        hf.save_pretrained(str(staging))
        if tokenizer is not None:
            _write_tokenizer(tokenizer, staging)
    return out


def _tokenizer_of(folder: Path, src_map: list[int], tgt_map: list[int]):
    """Our Tokenizer for a Marian folder whose sentencepiece model has our ids (an export of ours), else None."""
    import json

    from annotated.tokens import Tokenizer, TokenizerError

    files = [folder / n for n in ("source.spm", "target.spm", "vocab.json")]
    if not all(f.is_file() for f in files) or files[0].read_bytes() != files[1].read_bytes():
        return None
    try:
        tokenizer = Tokenizer(files[0].read_bytes())
    except TokenizerError:
        return None
    vocab = json.loads(files[2].read_text(encoding="utf-8"))
    identity = list(range(tokenizer.vocab_size))
    pieces = dict(zip(tokenizer.pieces(identity), identity))
    return tokenizer if vocab == pieces and src_map == tgt_map == identity else None


def _renumbered_tokenizer(folder: Path, src_map: list[int], tgt_map: list[int]):
    """Our Tokenizer for a Marian folder with one vocabulary (OPUS-MT's layout): its source sentencepiece model
    with the pieces renumbered to our ids, or None where that cannot be done."""
    import json

    from sentencepiece import sentencepiece_model_pb2

    pb: Any = sentencepiece_model_pb2  # generated protobuf classes: no types for mypy to read

    from annotated.tokens import Tokenizer, TokenizerError

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


def _unk_of(folder: Path) -> int | None:
    import json

    vocab = folder / "vocab.json"
    return json.loads(vocab.read_text(encoding="utf-8")).get("<unk>") if vocab.is_file() else None


def import_marian(
    folder: Path, out: Path, attention: AttentionForm = "fused", overwrite: bool = False
) -> tuple[Path, bool]:
    """Write the MarianMTModel folder `folder` as our checkpoint `out`; returns (out, whether it holds a tokenizer)."""
    from transformers import MarianMTModel

    from annotated.checkpoint import save_checkpoint

    _check_target(out, overwrite, "file")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} holds no config.json: give a folder written by save_pretrained")
    hf = MarianMTModel.from_pretrained(str(folder), local_files_only=True).float().eval()
    model, src_map, tgt_map = from_marian(hf, attention, _unk_of(folder))
    tokenizer = _tokenizer_of(folder, src_map, tgt_map) or _renumbered_tokenizer(folder, src_map, tgt_map)
    meta = {"imported_from": str(folder), "marian_source_ids": src_map, "marian_target_ids": tgt_map}
    save_checkpoint(out, model, tokenizer, meta)
    return out, tokenizer is not None


# %% [markdown]
# ## The command
#
# `export CHECKPOINT DIR` and `import HF_DIR OUT.pt` (`--attention per_head`
# stores the imported model head by head; `--overwrite` replaces an earlier
# output). A refusal is one line on stderr that names the fix, exit code 2.


# %%
def build_parser():
    from annotated.plumbing.options import Parser

    p = Parser(
        command=__file__,
        description="Export a checkpoint as a transformers MarianMTModel folder, or import one.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="checkpoint -> MarianMTModel folder")
    e.add_argument("checkpoint", type=Path)
    e.add_argument("out", type=Path, help="the folder to write")
    i = sub.add_parser("import", help="MarianMTModel folder -> checkpoint")
    i.add_argument("hf_dir", type=Path, help="a folder written by save_pretrained")
    i.add_argument("out", type=Path, help="the checkpoint to write (.pt)")
    i.add_argument("--attention", choices=("fused", "per_head"), default="fused")
    for s in (e, i):
        s.add_argument("--overwrite", action="store_true", help="replace an existing output")
    return p


def main(argv: list[str] | None = None) -> int:
    from annotated.checkpoint import CheckpointError
    from annotated.plumbing.options import fail

    args = build_parser().parse_args(argv)
    try:
        if args.command == "export":
            out = export_marian(args.checkpoint, args.out, args.overwrite)
            print(f"wrote {out}: MarianMTModel.from_pretrained({str(out)!r}) loads it")
        else:
            out, has_tokenizer = import_marian(args.hf_dir, args.out, args.attention, args.overwrite)
            print(
                f"wrote {out}"
                + (
                    ""
                    if has_tokenizer
                    else ": without a tokenizer (its sentencepiece model does "
                    "not use this project's ids), so it translates token ids, not text"
                )
            )
    except (CheckpointError, ValueError, FileExistsError, FileNotFoundError, OSError) as e:
        fail(NAME, str(e))
    return 0


if __name__ == "__main__":
    from annotated.plumbing.scripts import run_main

    run_main(main)
