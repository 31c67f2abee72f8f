# %% [markdown]
# # Checkpoints: written whole or not at all
#
# A checkpoint is one `torch.save` file holding everything needed to use or
# continue a model: the config (so the model can be rebuilt without guessing
# sizes), the parameters, the tokenizer's sentencepiece model (so translations
# use exactly the subwords the model was trained on), and free-form metadata
# (languages, step, scores, and the beam search's length penalty the run chose
# on validation data: `model_length_penalty` of `annotated/decoding/settings.py`, which every tool decodes with
# unless told otherwise). Training adds the optimizer, scheduler and
# random-number states so `--resume` continues exactly where it stopped.
#
# **Atomic writes.** A crash, Ctrl-C or `kill -9` in the middle of a save
# must not destroy the previous checkpoint: every save goes through
# `atomic_write` of `annotated/plumbing/files.py`, which says how (and how it
# clears the leftovers of a killed write;
# `test_sigkill_during_checkpoint_writes_keeps_the_previous_one`).
#
# **Clear failures, checked before anything is built.** Loading a missing,
# truncated or foreign file, or one whose parameters do not fit its own
# config, raises `CheckpointError` naming the file and what is wrong
# (docs/faults.md#checkpoints-every-loader-training-translator-attention-heads-equivalence
# lists each case and its test). The file is read with `weights_only=True`,
# so it can hold tensors and plain data but no code. A file that is no
# checkpoint at all is called what it looks like before torch reads it. The
# stored config is data too: a crafted one could ask for gigabytes, so every
# field's type and range, and the parameter shapes it implies (worked out on
# PyTorch's `meta` device, which allocates nothing), are checked against the
# stored tensors before the model is built. And since `torch.load` does not
# check the CRC-32 that `torch.save`'s zip archive holds for every member, a
# changed byte would load silently as a different number: we verify every
# CRC (`zipfile.testzip`) first.

# %%
from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shlex
import zipfile
from pathlib import Path
from typing import Any

import torch

from annotated import sites
from annotated.plumbing.files import atomic_write
from annotated.tokens import Tokenizer
from annotated.transformer import EncoderDecoder, TransformerConfig, make_model

FORMAT = "annotated-checkpoint-v1"


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used; the message names the file."""


def atomic_torch_save(obj: Any, path: os.PathLike | str) -> None:
    """torch.save to `path`, written whole or not at all (`annotated.plumbing.files.atomic_write`)."""
    atomic_write(path, lambda f: torch.save(obj, f))


def save_checkpoint(
    path: os.PathLike | str, model: EncoderDecoder, tokenizer, meta: dict | None = None, **training_state: Any
) -> None:
    """Write model, config, tokenizer and metadata (plus any training state) atomically."""
    if isinstance(training_state.get("casing"), dict):
        training_state["casing"] = stored_case_table(training_state["casing"])
    state = {
        "format": FORMAT,
        "config": dataclasses.asdict(model.config),
        "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "tokenizer": tokenizer.to_bytes() if tokenizer is not None else None,
        "meta": dict(meta or {}),
        **training_state,
    }
    atomic_torch_save(state, path)


def read_case_table(path: os.PathLike | str) -> dict | None:
    """The checkpoint's case table ({lower-case word: most frequent form}, `annotated/decoding/casing.py`), or
    None for a checkpoint written without one."""
    return case_table_in(read_checkpoint(path), path)


def stored_case_table(table: dict) -> str:
    """The case table as a checkpoint stores it: one JSON text, which torch.load's safe unpickler reads at once
    where a dict is built one object at a time (`test_the_case_table_is_stored_as_one_text_and_read_back_whole`;
    the times: benchmarks/README.md#levers-shared-memory-freed-memory-windows)."""
    return json.dumps(table, ensure_ascii=False, separators=(",", ":"))


def case_table_in(state: dict, path: os.PathLike | str) -> dict | None:
    """read_case_table() of a checkpoint already read (`state`, from `path`); the table as JSON text, or as a
    dict (checkpoints written before the text form)."""
    table = state.get("casing")
    if table is None:
        return None
    if isinstance(table, str):
        try:
            table = json.loads(table)
        except ValueError:
            raise CheckpointError(f"checkpoint {path}: its case table is not valid JSON") from None
    if not isinstance(table, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in table.items()):
        raise CheckpointError(f"checkpoint {path}: its case table is not a dict of words")
    return table


def add_case_table(path: os.PathLike | str, out: os.PathLike | str, table: dict) -> None:
    """Write a copy of checkpoint `path` to `out` with `table` as its case table."""
    atomic_torch_save(dict(read_checkpoint(path), casing=stored_case_table(table)), out)


def with_meta(path: os.PathLike | str, out: os.PathLike | str, **entries) -> None:
    """Write a copy of checkpoint `path` to `out` (atomically; `out` may be `path`) with `entries` added to its
    meta."""
    state = read_checkpoint(path)
    atomic_torch_save(dict(state, meta=dict(state.get("meta") or {}, **entries)), out)


def languages_of(meta: dict) -> tuple[str, str]:
    """(src_lang, tgt_lang) of a checkpoint's metadata; CheckpointError naming the fix where it names none (a model
    read in the wrong direction would look like a model that learnt nothing)."""
    src, tgt = meta.get("src_lang"), meta.get("tgt_lang")
    if not (isinstance(src, str) and isinstance(tgt, str) and src and tgt):
        raise CheckpointError(
            "the checkpoint's metadata names no language pair (src_lang/tgt_lang), so the direction to read it "
            "in is unknown; for an imported model, import it again naming them: make import HF=folder "
            "OUT=model.pt ARGS='--src de --tgt en'"
        )
    return src, tgt


def checkpoint_file(path: os.PathLike | str) -> Path:
    """`path`, a file; CheckpointError saying what it is instead: a folder (a transformers one points to
    `make import`) or nothing. Every command's door checks this before anything is loaded."""
    path = Path(path)
    if path.is_dir():
        if _model_type(path) == "marian":
            raise CheckpointError(
                f"{path} is a transformers MarianMTModel folder, not a checkpoint; import it first: "
                f"make import HF={shlex.quote(str(path))} OUT=model.pt, then use model.pt"
            )
        raise CheckpointError(
            f"checkpoint {path} is a directory; give the checkpoint file in it (for example {path / 'best.pt'})"
        )
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path}: no such file")
    return path


def _model_type(folder: Path) -> str | None:
    """The `model_type` of a transformers folder's config.json, else None."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config.get("model_type") if isinstance(config, dict) else None


def read_checkpoint(path: os.PathLike | str, map_location: str = "cpu") -> dict:
    """The raw checkpoint dict, after checking that it is one of ours."""
    path = checkpoint_file(path)
    looks = _looks_like(path)
    if looks is not None:  # said before torch reads it (and warns about it)
        raise CheckpointError(
            f"{path} is not a checkpoint: it is {looks}; give a .pt file written by training or make import, "
            f"or shipped:de-en"
        )
    try:
        damage = _zip_damage(path)
        if damage:
            raise CheckpointError(f"checkpoint {path} is corrupt: {damage}")
        state = torch.load(path, map_location=map_location, weights_only=True)
    except CheckpointError:
        raise
    except pickle.UnpicklingError:  # torch's message suggests weights_only=False: never for a file we did not write
        raise CheckpointError(
            f"checkpoint {path} holds Python objects other than tensors and plain data; "
            f"it is not an annotated checkpoint and is not loaded"
        ) from None
    except Exception as e:  # noqa: BLE001 torch.load raises many kinds: truncated zip, not a torch file, ...
        raise CheckpointError(
            f"checkpoint {path} is corrupt or not a torch file ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''})"
        ) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path} is not an annotated checkpoint (expected format {FORMAT!r})")
    missing = [key for key in ("config", "model") if not isinstance(state.get(key), dict)]
    if missing:
        raise CheckpointError(f"checkpoint {path} is incomplete: it has no {' and no '.join(map(repr, missing))} dict")
    return state


def _looks_like(path: Path) -> str | None:
    """What a file torch cannot load looks like (an empty file, text, a zip archive of other files, a pickle,
    other bytes); None for what torch.save writes, a zip archive with a data.pkl, whole or cut short.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     _ = (Path(d) / "notes.txt").write_text("epoch 3, loss 2.1\\n")
    ...     _ = (Path(d) / "noise.bin").write_bytes(bytes(range(7, 250, 3)))
    ...     _looks_like(Path(d) / "notes.txt"), _looks_like(Path(d) / "noise.bin")[:29]
    ("text (it begins 'epoch 3, loss 2.1')", 'binary data, not a torch file')
    """
    with path.open("rb") as f:
        head = f.read(4096)
    if not head:
        return "an empty file"
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
        if any(n.endswith("/data.pkl") for n in names):
            return None
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        return f"a zip archive of {len(names)} file(s) ({shown}), not one torch.save wrote"
    if head.startswith(b"PK\x03\x04"):  # a zip's first member, no directory at the end: cut short
        return None
    if head[:1] == b"\x80":
        return "a Python pickle, not the zip archive torch.save writes"
    text = head.decode("utf-8", errors="replace")
    if text.count("\ufffd") <= 4 and sum(c.isprintable() or c.isspace() for c in text) >= 0.95 * len(text):
        return f"text (it begins {text.strip().splitlines()[0][:40] if text.strip() else ''!r})"
    return f"binary data, not a torch file (it begins {head[:8].hex(' ')})"


def _zip_damage(path: Path) -> str | None:
    """What is wrong with the zip archive torch.save wrote (every member's CRC-32 checked), or None."""
    if not zipfile.is_zipfile(path):
        return None  # no zip directory at the end: torch.load says what it is
    with zipfile.ZipFile(path) as z:
        for info in z.infolist():
            if info.external_attr & 0x10:  # the MS-DOS directory bit: PyTorch's reader would skip the data
                return f"member {info.filename} is marked as a directory"
        bad = z.testzip()
    return f"member {bad} fails its CRC-32 check (the bytes changed after writing)" if bad else None


MAX_POSITIONS = 65536  # max_len above this is refused: the positional table alone is max_len x d_model floats


def _check_field(name: str, kind: str, value) -> str | None:
    """What is wrong with one config value of declared type `kind` ("int", "int | None", ...), or None."""
    kinds = {part.strip() for part in kind.split("|")}
    if value is None and "None" in kinds:
        return None
    if "bool" in kinds:
        return None if isinstance(value, bool) else f"must be true or false, got {value!r}"
    if "int" in kinds:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            return f"must be a whole number >= 1, got {value!r}"
        return None
    if "float" in kinds:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1
        return None if ok else f"must be a number in [0, 1), got {value!r}"
    return None if isinstance(value, str) else f"must be a string, got {value!r}"


def check_config(
    config, tensors: dict, path: os.PathLike | str = "<checkpoint>", heads: dict | None = None
) -> TransformerConfig:
    """The stored config as a TransformerConfig, checked field by field and against the stored tensors'
    shapes, without building the model (CheckpointError naming the field otherwise).

    `heads`, stored by a pruned checkpoint (`annotated/attention/prune.py`), gives each attention its own number of
    heads, at most the config's `h`."""
    fields = {f.name: str(f.type) for f in dataclasses.fields(TransformerConfig)}
    unknown = sorted(set(config) - set(fields), key=str)
    if unknown:
        raise CheckpointError(f"checkpoint {path}: its config is invalid: unknown fields {unknown}")
    for name, kind in fields.items():
        problem = _check_field(name, kind, config[name]) if name in config else None
        if problem:
            raise CheckpointError(f"checkpoint {path}: its config is invalid: {name} {problem}")
    bounds = {"max_len": MAX_POSITIONS, "N": len(tensors)}  # every layer stores tensors of its own
    if config.get("attention") == "per_head":
        bounds["h"] = len(tensors)  # and so does every head of the per-head form
    for name, most in bounds.items():
        if config.get(name, 0) > most:
            raise CheckpointError(
                f"checkpoint {path}: its config is invalid: {name}={config[name]} is more than {most}"
            )
    try:
        cfg = TransformerConfig(**config)
        with torch.device("meta"):  # shapes only: nothing is allocated
            model = make_model(cfg)
            if heads is not None:
                _set_head_counts(model, heads, cfg.h)
            wanted = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: its config is invalid: {e}") from None
    stored = {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in tensors.items()}
    for name in sorted(wanted.keys() | stored.keys(), key=str):  # (a crafted file may use other keys than str)
        if name not in stored:
            problem = f"the config needs {name} {list(wanted[name])}, which the file does not hold"
        elif name not in wanted:
            problem = f"the file holds {name}, which the config does not make"
        elif (got := stored[name]) != wanted[name]:
            problem = (
                f"{name} is stored as {list(got) if got is not None else 'no tensor'} "
                f"but the config needs {list(wanted[name])}"
            )
        else:
            continue
        raise CheckpointError(f"checkpoint {path}: parameters do not match its config: {problem}")
    return cfg


def _set_head_counts(model: EncoderDecoder, heads, most: int) -> None:
    """A pruned model's per-attention head counts, each between 1 and the config's h (ValueError otherwise)."""
    counts = heads.values() if isinstance(heads, dict) else ()
    if not all(isinstance(hs, (list, tuple)) and all(type(h) is int and 1 <= h <= most for h in hs) for hs in counts):
        raise ValueError(f"head counts must be lists of whole numbers from 1 to h={most}, got {heads!r:.200}")
    sites.set_head_counts(model, heads)


def model_from_state(state: dict, path: os.PathLike | str = "<checkpoint>") -> EncoderDecoder:
    """Rebuild the model from the stored config (checked first) and load its parameters strictly.

    A pruned checkpoint's `"heads"` entry gives each attention its own number of heads."""
    heads = state.get("heads")
    cfg = check_config(state["config"], state["model"], path, heads)
    model = make_model(cfg)
    if heads is not None:
        _set_head_counts(model, heads, cfg.h)
    try:
        model.load_state_dict(state["model"], strict=True)
    except RuntimeError as e:
        first = str(e).strip().splitlines()
        raise CheckpointError(
            f"checkpoint {path}: parameters do not match its config: {' '.join(line.strip() for line in first[:3])}"
        ) from None
    return model


def load_checkpoint(path: os.PathLike | str, map_location: str = "cpu"):
    """Returns (model in eval mode, tokenizer or None, meta dict)."""
    return loaded_from_state(read_checkpoint(path, map_location), path)


def loaded_from_state(state: dict, path: os.PathLike | str):
    """load_checkpoint() of a checkpoint already read (`state`, from `path`)."""
    model = model_from_state(state, path).eval()
    tokenizer = None
    if state.get("tokenizer") is not None:
        try:
            tokenizer = Tokenizer.from_bytes(state["tokenizer"])
        except Exception as e:  # noqa: BLE001 sentencepiece raises many kinds on bad bytes
            raise CheckpointError(f"checkpoint {path}: its tokenizer does not load ({e})") from None
        cfg = model.config
        if not tokenizer.vocab_size == cfg.src_vocab == cfg.tgt_vocab:
            raise CheckpointError(
                f"checkpoint {path}: its tokenizer has {tokenizer.vocab_size} subwords but the "
                f"model's vocabularies have {cfg.src_vocab} (source) and {cfg.tgt_vocab} "
                f"(target); they do not belong together"
            )
    return model, tokenizer, state.get("meta", {})
