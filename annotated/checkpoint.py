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
# **Clear failures.** Loading a missing, truncated or foreign file, or one
# whose parameters do not fit its own config, raises `CheckpointError` naming
# the file and what is wrong.

# %%
from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch

from annotated.transformer import EncoderDecoder, TransformerConfig, make_model

FORMAT = "annotated-checkpoint-v1"


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used; the message names the file."""


def atomic_torch_save(obj: Any, path: os.PathLike | str) -> None:
    """torch.save to `path` via a temporary file and an atomic rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


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
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # truncated zip, not a torch file, ...
        raise CheckpointError(f"checkpoint {path} is corrupt or not a torch file ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path} is not an annotated checkpoint "
                              f"(expected format {FORMAT!r})")
    return state


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
    return model, tokenizer, state.get("meta", {})
