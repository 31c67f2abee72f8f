# %% [markdown]
# # Checkpoints: written whole or not at all
#
# A checkpoint is one `torch.save` file holding everything needed to use or
# continue a model: the config (so the model can be rebuilt without guessing
# sizes), the parameters, the tokenizer's sentencepiece model (so translations
# use exactly the subwords the model was trained on), and free-form metadata
# (languages, step, scores). Training adds the optimizer, scheduler and
# random-number states so `--resume` continues exactly where it stopped.
#
# **Atomic writes.** A crash or Ctrl-C in the middle of `torch.save` must not
# destroy the previous checkpoint. We write to a temporary file in the same
# directory, flush it to disk, and `os.replace` it over the old name: on POSIX
# that rename is atomic, so a reader sees either the old file or the new one,
# never half of one.
#
# **Leftovers of a killed write.** A Ctrl-C or an exception removes the
# temporary file, but a process killed outright (`kill -9`, the out-of-memory
# killer, a power cut) cannot: it leaves `.<name>.<random>.tmp` beside the
# target. Nothing reads such files (loaders open the exact name, and hidden
# names match no `epoch*.pt` pattern). The next successful save of the same
# target deletes them, but only those that no live writer holds: each writer
# keeps an exclusive `flock` on its temporary file until the rename, and the
# kernel drops the lock when the process dies. (`test_faults.py`:
# `test_sigkill_during_checkpoint_writes_keeps_the_previous_one`.)
#
# **Clear failures.** Loading a missing, truncated or foreign file, or one
# whose parameters do not fit its own config, raises `CheckpointError` naming
# the file and what is wrong. A flipped bit is caught too: `torch.save` writes
# a zip archive with a CRC-32 for every member, but `torch.load` does not
# check them, so a changed byte in a tensor's data loads silently as a
# different number (in a small checkpoint, a third of all single-byte changes
# did). We verify every CRC (`zipfile.testzip`, a fraction of the load time)
# before loading. (`test_faults.py`:
# `test_a_flipped_byte_would_load_silently_without_the_crc_check`.)

# %%
from __future__ import annotations

import dataclasses
import os
import zipfile
from pathlib import Path
from typing import Any, Optional

import torch

from annotated.files import atomic_write, remove_stale_temporaries  # noqa: F401 (re-exported)
from annotated.transformer import EncoderDecoder, TransformerConfig, make_model

FORMAT = "annotated-checkpoint-v1"


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used; the message names the file."""


def atomic_torch_save(obj: Any, path: os.PathLike | str) -> None:
    """torch.save to `path`, written whole or not at all (`annotated.files.atomic_write`)."""
    atomic_write(path, lambda f: torch.save(obj, f))


def save_checkpoint(path: os.PathLike | str, model: EncoderDecoder, tokenizer, meta: Optional[dict] = None,
                    **training_state: Any) -> None:
    """Write model, config, tokenizer and metadata (plus any training state) atomically."""
    state = {
        "format": FORMAT,
        "config": dataclasses.asdict(model.config),
        "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "tokenizer": tokenizer.to_bytes() if tokenizer is not None else None,
        "meta": dict(meta or {}),
        **training_state,
    }
    atomic_torch_save(state, path)


def read_checkpoint(path: os.PathLike | str, map_location: str = "cpu") -> dict:
    """The raw checkpoint dict, after checking that it is one of ours."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path}: no such file")
    try:
        damage = _zip_damage(path)
        if damage:
            raise CheckpointError(f"checkpoint {path} is corrupt: {damage}")
        state = torch.load(path, map_location=map_location, weights_only=True)
    except CheckpointError:
        raise
    except Exception as e:  # truncated zip, not a torch file, ...
        raise CheckpointError(f"checkpoint {path} is corrupt or not a torch file ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path} is not an annotated checkpoint "
                              f"(expected format {FORMAT!r})")
    missing = [key for key in ("config", "model") if not isinstance(state.get(key), dict)]
    if missing:
        raise CheckpointError(f"checkpoint {path} is incomplete: it has no {' and no '.join(map(repr, missing))} "
                              f"dict")
    return state


def _zip_damage(path: Path) -> Optional[str]:
    """What is wrong with the zip archive torch.save wrote (every member's CRC-32 checked), or None."""
    if not zipfile.is_zipfile(path):
        return None  # no zip directory at the end: torch.load says what it is
    with zipfile.ZipFile(path) as z:
        for info in z.infolist():
            if info.external_attr & 0x10:  # the MS-DOS directory bit: PyTorch's reader would skip the data
                return f"member {info.filename} is marked as a directory"
        bad = z.testzip()
    return f"member {bad} fails its CRC-32 check (the bytes changed after writing)" if bad else None


def model_from_state(state: dict, path: os.PathLike | str = "<checkpoint>") -> EncoderDecoder:
    """Rebuild the model from the stored config and load its parameters strictly."""
    try:
        config = TransformerConfig(**state["config"])
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: its config is invalid: {e}") from None
    model = make_model(config)
    try:
        model.load_state_dict(state["model"], strict=True)
    except RuntimeError as e:
        first = str(e).strip().splitlines()
        raise CheckpointError(f"checkpoint {path}: parameters do not match its config: "
                              f"{' '.join(line.strip() for line in first[:3])}") from None
    return model


def load_checkpoint(path: os.PathLike | str, map_location: str = "cpu"):
    """Returns (model in eval mode, tokenizer or None, meta dict)."""
    state = read_checkpoint(path, map_location)
    model = model_from_state(state, path).eval()
    tokenizer = None
    if state.get("tokenizer") is not None:
        from annotated.data import Tokenizer

        try:
            tokenizer = Tokenizer.from_bytes(state["tokenizer"])
        except Exception as e:
            raise CheckpointError(f"checkpoint {path}: its tokenizer does not load ({e})") from None
        cfg = model.config
        if not tokenizer.vocab_size == cfg.src_vocab == cfg.tgt_vocab:
            raise CheckpointError(f"checkpoint {path}: its tokenizer has {tokenizer.vocab_size} subwords but the "
                                  f"model's vocabularies have {cfg.src_vocab} (source) and {cfg.tgt_vocab} "
                                  f"(target); they do not belong together")
    return model, tokenizer, state.get("meta", {})
