# %% [markdown]
# # The model card of an exported folder
#
# An exported folder goes where the checkpoint's own files do not follow, so
# it carries its card as `README.md`: what the model learnt from and what it
# is not for, how it was trained, its test scores with their sacreBLEU
# signatures, and how the folder was made, all from what the checkpoint
# already records: the shipped models' cards, a run's `results.json` beside
# its checkpoint
# (`test_the_export_card_of_a_runs_checkpoint_gives_that_checkpoints_scores`),
# and its metadata (`test_the_export_carries_its_model_card`). A card holds
# no absolute path of the machine that wrote it (`shown_path`;
# `test_no_card_holds_an_absolute_path`).

# %%
from __future__ import annotations

import json
from pathlib import Path

MULTI30K = (
    "Multi30k (Elliott et al., 2016): about 29,000 English descriptions of Flickr photos and their German "
    "translations. The model knows photo captions (people, animals, clothes, streets, sports); everyday language "
    "outside them is out of its domain and comes back as nonsense."
)


def shown_path(path: str) -> str:
    """`path` as a card shows it: a shipped model by its name, else relative to the working folder, else its last
    two parts; never absolute.

    >>> shown_path("runs/r1/best.pt"), shown_path("/elsewhere/runs/r1/best.pt")
    ('runs/r1/best.pt', 'r1/best.pt')
    """
    from annotated.shipped import is_shipped

    p = Path(path)
    if is_shipped(p):
        return f"shipped:{p.stem}"
    if not p.is_absolute():
        return path
    try:
        return str(p.relative_to(Path.cwd()))
    except ValueError:
        return str(Path(*p.parts[-2:]))


def _scores_of_run(checkpoint: Path) -> dict | None:
    """The test scores `results.json` beside `checkpoint` records for it (beam search), else None."""
    try:
        results = json.loads((checkpoint.parent / "results.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    for entry in (results.get("test") or {}).values():
        if isinstance(entry, dict) and Path(str(entry.get("checkpoint"))).name == checkpoint.name:
            beam = entry.get("beam") or {}
            return {
                "test_set": results.get("test_set"),
                "beam": (results.get("train_config") or {}).get("beam_size"),
                "length_penalty": beam.get("length_penalty"),
                "test": beam,
                "signatures": beam.get("signature", {}),
            }
    return None


def _score_lines(scores: dict | None) -> list[str]:
    if not scores or not scores.get("test"):
        return ["No test scores are recorded with this checkpoint."]
    test, signatures = scores["test"], scores.get("signatures") or {}
    lines = [
        f"On {scores.get('test_set')}, beam {scores.get('beam')}, GNMT length penalty alpha "
        f"{scores.get('length_penalty')} (this project's translator; `generate`'s length penalty has another "
        "form, see below):",
        "",
        "| metric | score | sacreBLEU signature |",
        "| --- | ---: | --- |",
    ]
    for name in ("bleu", "bleu_lowercase", "chrf"):
        if name in test:
            lines.append(f"| {name} | {test[name]} | `{signatures.get(name, '')}` |")
    return lines


def _alpha_clause(scores: dict | None) -> str:
    """The model's own alpha, which no `length_penalty` of `generate` expresses, where its scores name one."""
    alpha = (scores or {}).get("length_penalty")
    if alpha is None or alpha == 0:
        return ""
    return (
        f" (this model's translator decodes at alpha {alpha:g}, its scores above; no `length_penalty` of `generate` "
        "ranks as it does, so `generation_config.json` keeps `transformers`' default 1.0)"
    )


def model_card(checkpoint_as_typed: str, checkpoint: Path, meta: dict, shipped_card: dict | None, cfg) -> str:
    """README.md of the export of `checkpoint` (named as the user typed it), its metadata `meta`, the shipped
    model's card where it is one, and our model config `cfg`."""
    src, tgt = meta.get("src_lang", "?"), meta.get("tgt_lang", "?")
    made = (shipped_card or {}).get("made") or {}
    train = made.get("train_config") or meta.get("train_config")
    trained_on = (shipped_card or {}).get("trained_on") or (
        MULTI30K if train else f"not recorded (imported from {shown_path(str(meta.get('imported_from', 'elsewhere')))})"
    )
    scores = (shipped_card or {}).get("scores") or _scores_of_run(checkpoint)
    recipe = [f"- command: `{made['command']}`"] if made.get("command") else []
    if isinstance(train, dict):
        recipe.append(
            "- training settings: "
            + ", ".join(f"{k}={train[k]}" for k in ("max_steps", "lr_factor", "label_smoothing", "seed") if k in train)
        )
    for key in ("commit", "steps", "precision", "cpu"):
        if key in made:
            recipe.append(f"- {key}: {made[key]}")
    size = f"N={cfg.N}, d_model={cfg.d_model}, d_ff={cfg.d_ff}, h={cfg.h}, vocabulary {cfg.tgt_vocab}"
    lines = [
        "---",
        "library_name: transformers",
        f"language: [{src}, {tgt}]",
        "tags: [translation, marian]",
        "---",
        "",
        f"# A {src} -> {tgt} Transformer (Vaswani et al., 2017) from `annotated`",
        "",
        f"A post-norm encoder-decoder ({size}), exported as a `MarianMTModel` by "
        f"`make export CHECKPOINT={shown_path(checkpoint_as_typed)}` (`python -m annotated.interop.folders export`).",
        "",
        "## What it learnt from, and what it is not for",
        "",
        trained_on,
        "",
        "## How it was trained",
        "",
        *(recipe or ["Not recorded in the checkpoint."]),
        "",
        "## Scores",
        "",
        *_score_lines(scores),
        "",
        "## How it was exported, and how to use it",
        "",
        f"Our ids 0 ... {cfg.tgt_vocab - 1} are the checkpoint's; one row is appended, `<pad>`: Marian's pad, a zero "
        "embedding as in OPUS-MT, never predicted. The decoder starts with `<s>` (id 1, `decoder_start_token_id` "
        "in `config.json` and `generation_config.json`): its embedding plus Marian's own sinusoid for position 0 is "
        "the model's first decoder input, so the folder holds only Marian's own tensors, and a copy loaded with "
        "`from_pretrained`, fine-tuned or not, and saved with `save_pretrained` stays this model. `annotated.json` "
        "holds this project's translator settings (the length penalty, the recasing table) for `make import`; "
        "`transformers` ignores it.",
        "",
        "- `transformers`: `MarianMTModel.from_pretrained(folder)`, `MarianTokenizer.from_pretrained(folder)`; "
        "encode with `add_special_tokens=False` (the model was trained on sources without `</s>`) and "
        "`truncation=True` (at most the model's positions).",
        "- CTranslate2: `ctranslate2.Translator('<folder>/ctranslate2')`, the model converted by CTranslate2's own "
        "converter from the layout it needs (where `ctranslate2` was installed at export). Do not run "
        "`ct2-transformers-converter` on this folder itself: it starts a Marian decoder from a zero vector, which "
        "this model never saw (the `ctranslate2/` model stores its start vector as the first position instead). "
        "It computes this model's log-probabilities, and its beam search stops by its own rule (when its best "
        "candidate ends), so a few translations differ from this project's.",
        "- `generate` ranks finished translations with `|Y|^length_penalty`, this project's translator with GNMT's "
        f"`((5 + |Y|) / 6)^alpha`{_alpha_clause(scores)}; with both off (`length_penalty=0`, alpha 0) the two "
        "searches agree but for outputs cut at the length limit (section 5 of `annotated/interop/marian.py`).",
        "",
    ]
    return "\n".join(lines)
