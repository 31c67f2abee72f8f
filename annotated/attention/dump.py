# %% [markdown]
# # Looking at attention: dumps, pictures and a viewer
#
# The first chapter asked what queries, keys and values *do*. This chapter
# lets you watch them on your own trained translator: for a few sentences it
# saves every attention weight of every layer and head, draws them, and
# writes one HTML page to browse them offline.
#
# ```sh
# make attention                                   # best.pt of runs/latest, first 3 test sentences
# python -m annotated.attention.dump --checkpoint runs/x/best.pt "Ein Hund rennt über die Wiese."
# ```
#
# A Transformer translator has three kinds of attention, each with `N` layers
# of `h` heads (a pruned model, `annotated/attention/prune.py`, keeps fewer heads in some
# layers: `h` is then that layer's own count):
#
# | kind | queries | keys | shape per layer |
# | --- | --- | --- | --- |
# | `enc_self` | source tokens | source tokens | `(1, h, S, S)` |
# | `dec_self` | target positions | target positions (masked) | `(1, h, T, T)` |
# | `cross` | target positions | source tokens (the encoder output) | `(1, h, T, S)` |
#
# The kinds carry the names of `annotated/sites.py` (`KINDS`) everywhere.
# `annotated/attention/pictures.py` draws the pictures and explains how to read
# them; `annotated/attention/viewer.py` makes the page. Every claim that can be checked
# is checked in `tests/attention/test_dump.py` (test names in parentheses).

# %%
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from annotated.attention.pictures import alignment_figure, figure_rgb, grid_figure
from annotated.attention.viewer import circuits_beside, importance_fits, read_head_importance, viewer_html
from annotated.checkpoint import load_checkpoint
from annotated.checks import check_eval_mode, check_id_list, check_tokenizer
from annotated.decoding.search import translate_ids
from annotated.decoding.settings import Decoding, model_length_penalty
from annotated.door import Door
from annotated.plumbing.files import json_safe, save_figure, staged_directory
from annotated.plumbing.options import at_least, device, writable_dir
from annotated.plumbing.progress import tracked
from annotated.plumbing.scripts import usage_of
from annotated.recording import record_attention
from annotated.shipped import typed_name
from annotated.sites import KINDS, head_counts
from annotated.tokens import BOS, EOS, PAD, SPECIAL_LABELS
from annotated.transformer import EncoderDecoder, padding_mask, subsequent_mask

DOOR = Door(__file__)

FORMAT = "annotated-attention-v2"
OLD_FORMATS = ("annotated-attention-v1",)  # kinds named encoder / decoder_self: read no more, replaced on request

# %% [markdown]
# ## 1. Which tokens are the rows and the columns
#
# An attention weight `p[0, i, q, k]` says how much query position `q` of
# head `i` takes from key position `k`; every row `p[0, i, q, :]` is a
# probability distribution (non-negative, sums to one). The pictures are only
# honest if the labels on each axis are exactly the tokens at those
# positions, so here they are, for a source `x_1 ... x_S` and a translation
# `y_1 ... y_n` (the model's own output, as `make translate` prints it,
# `eos` included when it was produced):
#
# * **source tokens** (`src_tokens`, length `S`): the subwords of the
#   sentence, `x_1 ... x_S`; the source carries no `bos`/`eos` (as in
#   training).
# * **decoder input** (`tgt_in_tokens`, length `T = n`): `<s> y_1 ... y_{n-1}`,
#   what the decoder *reads*; position `t` reads `tgt_in_tokens[t]`.
# * **decoder output** (`tgt_out_tokens`, length `T = n`): `y_1 ... y_n`, what
#   position `t` *produces*. The last output is `</s>` when the model stopped
#   by itself; `</s>` is never read.
#
# A row is a query; a decoder row is labelled by the token the decoder
# predicts there, a key column by the token fed in there (`READING` of
# `annotated/attention/pictures.py`), which gives each kind's rows and
# columns, `ROWS_COLS` below. In `dec_self`, row `t` reads `tgt_in_tokens[t]`
# and predicts `tgt_out_tokens[t]`, so the diagonal cell, "a position looking
# at itself", sits where row *dog* meets the column of the token before *dog*;
# in `cross`, labelling row `t` by what it predicts gives the classic
# alignment picture of Bahdanau et al. (2015): "to write *dog*, the model
# looked at *Hund*". `index.json` records `ROWS_COLS` (`rows_cols`) and every
# sentence's three token lists, so any reader labels the arrays correctly
# (`test_dump_files_and_index` checks that every array's shape matches its two
# token lists).

# %%
ROWS_COLS = {
    "enc_self": ("src_tokens", "src_tokens"),
    "dec_self": ("tgt_out_tokens", "tgt_in_tokens"),
    "cross": ("tgt_out_tokens", "src_tokens"),
}


def token_labels(tokenizer, ids: Sequence[int]) -> list[str]:
    """Subword strings for `ids`, with the special ids spelled as `SPECIAL_LABELS` spells them."""
    plain = [i for i in ids if i not in SPECIAL_LABELS]
    pieces = iter(tokenizer.pieces(plain) if plain else [])
    return [SPECIAL_LABELS[i] if i in SPECIAL_LABELS else next(pieces) for i in ids]


# %% [markdown]
# ## 2. One teacher-forced pass collects everything
#
# The decoder (section 3) produces the translation one token at a time. To get
# its attention we do not record anything during decoding and we keep no state on
# the modules: we run the model **once more**, teacher-forced, on the finished
# translation, and keep the probabilities that `record_attention`
# (`annotated/recording.py`) records during that pass.
#
# This gives exactly the weights the model used while translating: under the
# causal mask position `t` sees the same inputs `<s> y_1 ... y_{t-1}` in both
# runs, so its attention row is the same (the cached decoder equals the full
# recomputation, `test_cached_decoding_equals_full_recomputation` in the first
# chapter). A beam search keeps several prefixes, but the one it returns was
# extended one token at a time like any other, so the same holds.
# `test_rows_are_the_steps_of_greedy_decoding` checks it row by row against
# the incremental decoder, and, for greedy decoding, that position `t`'s
# logits pick `tgt_out_tokens[t]`. (`test_shapes_rows_and_masks` checks that every row
# sums to one and that the decoder's future is exactly zero.)
#
# `tgt_ids` may be any target, not only the model's output (for instance a
# reference translation followed by `EOS`): the pass feeds `BOS + tgt_ids[:-1]`
# and its `T = len(tgt_ids)` rows are the positions that predict `tgt_ids`.


# %%
@torch.no_grad()
def collect_attention(
    model: EncoderDecoder, src_ids: Sequence[int], tgt_ids: Sequence[int], *, dtype=np.float32
) -> dict:
    """Every attention weight of one sentence pair, from one teacher-forced pass.

    Returns {"enc_self": [...], "dec_self": [...], "cross": [...]}, each a
    list with one numpy array per layer (layer 0 nearest the embeddings) of
    shape (1, h, S, S), (1, h, T, T) and (1, h, T, S), T = len(tgt_ids), h = that
    attention's number of heads (fewer in the pruned layers of a pruned model).

    >>> from annotated.transformer import make_model
    >>> _ = torch.manual_seed(0)
    >>> m = make_model(src_vocab=20, tgt_vocab=20, N=2, d_model=16, d_ff=32, h=4).eval()
    >>> a = collect_attention(m, [5, 6, 7], [8, 9, EOS])
    >>> [(k, len(a[k]), a[k][0].shape) for k in KINDS]
    [('enc_self', 2, (1, 4, 3, 3)), ('dec_self', 2, (1, 4, 3, 3)), ('cross', 2, (1, 4, 3, 3))]
    >>> a["dec_self"][0][0, 0].round(3).tolist()[0]  # <s> can only look at itself
    [1.0, 0.0, 0.0]
    """
    check_eval_mode(model, "collect_attention")
    cfg = model.config
    src_ids = check_id_list("source", src_ids, cfg.src_vocab, cfg.max_len, allow_pad=False)
    # an untrained model may emit pad or bos as words; the pass feeds them back exactly as greedy did
    tgt_ids = check_id_list("target", tgt_ids, cfg.tgt_vocab, cfg.max_len, allow_pad=True)
    device = next(model.parameters()).device
    src = torch.tensor([src_ids], dtype=torch.long, device=device)  # (1, S)
    tgt_in = torch.tensor([[BOS] + tgt_ids[:-1]], dtype=torch.long, device=device)  # (1, T)
    probs = teacher_forced_attention(model, src, tgt_in, subsequent_mask(tgt_in.size(1)).to(device))
    wide = torch.float64 if np.dtype(dtype) == np.float64 else torch.float32
    return {k: [probs[k, l].to("cpu", wide).numpy().astype(dtype, copy=False) for l in range(cfg.N)] for k in KINDS}


def teacher_forced_attention(model: EncoderDecoder, src: Tensor, tgt_in: Tensor, tgt_mask: Tensor) -> dict:
    """{site: (B, h, T_q, T_k)} of one teacher-forced pass: sources `src` (B, S), decoder input `tgt_in` (B, T)."""
    src_mask = padding_mask(src, PAD)  # (B, 1, S)
    with record_attention(model) as probs:
        model.decode(model.encode(src, src_mask), src_mask, tgt_in, tgt_mask)
    return {site: calls[0] for site, calls in probs.items()}


# %% [markdown]
# ## 3. Translating, and what counts as bad input
#
# The translation is the translator's: `translate_ids` of
# `annotated/decoding/search.py` with `make translate`'s settings (`Decoding`,
# at the model's own length penalty, `model_length_penalty`), so the
# viewer and the translator show the same sentence
# (`test_the_dump_translates_as_the_translator_does`). `translate_ids` returns
# the ids before `eos`; a translation shorter than its limit stopped at `eos`,
# which is put back: the position that produced it is a row of the pictures
# too.
#
# A sentence is rejected, before anything is computed or written, when it is
# empty (nothing to look at) or longer than the model's `max_len` subwords
# (the model has no position for the rest; truncating would show attention on
# a sentence nobody typed).


# %%
def encode_sentence(tokenizer, sentence: str, max_len: int, name: str = "sentence") -> list[int]:
    """Source subword ids of `sentence`, or a ValueError naming what is wrong with it."""
    if not isinstance(sentence, str) or not sentence.strip():
        raise ValueError(f"{name} is empty")
    ids = tokenizer.encode(sentence)
    if not ids:
        raise ValueError(f"{name} encodes to no subwords: {sentence!r}")
    if len(ids) > max_len:
        short = sentence if len(sentence) <= 60 else sentence[:57] + "..."
        raise ValueError(f"{name} has {len(ids)} subwords, more than the model's max_len={max_len}: {short!r}")
    return ids


@torch.no_grad()
def translate_sentence(
    model: EncoderDecoder,
    src_ids: Sequence[int],
    beam_size: int = Decoding.beam,
    length_penalty: float = Decoding.length_penalty,
    max_extra: int = Decoding.max_extra,
) -> list[int]:
    """What `make translate` prints for `src_ids`, as ids y_1 ... y_n (eos kept when the search stopped there)."""
    ids = translate_ids(model, [list(src_ids)], beam_size, length_penalty, max_extra=max_extra)[0]
    limit = min(model.config.max_len, len(src_ids) + max_extra)
    return ids + [EOS] if len(ids) < limit else ids


# %% [markdown]
# ## 4. On disk: `.npz` arrays, a JSON index, and the bertviz layout
#
# A dump directory holds, for sentence `i`, `sentence_{i:03d}.npz` with one
# `(1, h, q, k)` array per kind and layer (`array_name`; axes: batch of one,
# head, query, key) and its PNG pictures; and once, `index.json` (`dump_model`
# lists what it records: every sentence's tokens, ids and shapes, `rows_cols`,
# the head order and `head_counts`, the checkpoint and its config) and
# `viewer.html` (`annotated/attention/viewer.py`).
#
# Head `i` is the model's head `i`: `W_Q[i]` of `PerHeadAttention`, column
# block `i` of `FusedAttention`'s `W_Q`. Since the two forms are the same
# function (first chapter, section 4), a per-head model and its fused
# conversion give the same dump (`test_per_head_and_fused_give_identical_dumps`).
#
# **A pruned model** keeps `h' < h` heads in some layers, numbered in their
# original order (the index's `head_order`); its arrays are `(1, h', q, k)`
# and `head_counts` lists every layer's `h'`
# (`test_a_pruned_model_dumps_and_shows_each_layer_with_its_own_heads`).
#
# **bertviz.** `head_view` and `model_view` of bertviz take, per kind, one
# `(1, h, q, k)` tensor per layer, exactly the arrays of a sentence file
# (`load_sentence`, then `torch.from_numpy`), with `encoder_tokens` the
# `src_tokens` and `decoder_tokens` the decoder's *input*, `tgt_in_tokens`
# (`test_bertviz_layout` checks this the way bertviz's own checks do). bertviz
# stacks a kind's layers, so a pruned model whose layers differ in head count
# is for `viewer.html` only.


# %%
def array_name(kind: str, layer: int) -> str:
    """`enc_self_layer0`, `cross_layer5`, ...: the name of one layer's array in a sentence file."""
    return f"{kind}_layer{layer}"


def load_sentence(out_dir: os.PathLike | str, i: int) -> tuple[dict, dict]:
    """(arrays {kind: [per-layer (1, h, q, k)]}, index entry) of sentence `i` of a dump."""
    out_dir = Path(out_dir)
    index = read_index(out_dir)
    if not 0 <= i < len(index["sentences"]):
        raise ValueError(f"{out_dir} holds sentences 0..{len(index['sentences']) - 1}, not {i}")
    entry = index["sentences"][i]
    with np.load(out_dir / entry["file"]) as f:
        attn = {k: [f[array_name(k, layer)] for layer in range(index["layers"])] for k in KINDS}
    return attn, entry


def read_index(out_dir: os.PathLike | str) -> dict:
    path = Path(out_dir) / "index.json"
    if not path.is_file():
        raise ValueError(f"{path}: no such file (not an attention dump?)")
    index = json.loads(path.read_text(encoding="utf-8"))
    if index.get("format") in OLD_FORMATS:
        raise ValueError(
            f"{path} is an attention dump of format {index['format']!r} (kinds named encoder, "
            f"decoder_self, cross); this version reads {FORMAT!r}: re-run make attention "
            f"({usage_of(__file__)}) to write it again"
        )
    if index.get("format") != FORMAT:
        raise ValueError(f"{path} is not an attention index (expected format {FORMAT!r})")
    return index


# %% [markdown]
# ## 5. Writing a dump, all or nothing
#
# A dump is written in a temporary directory and renamed into place when
# complete (`staged_directory`), so a reader never finds half a dump. The
# target may be missing, empty, or **one of our dumps** (`not_a_dump`), which
# is replaced; anything else is refused in one line before any work, and left
# untouched (`test_failed_dump_leaves_nothing`,
# `test_out_dir_that_is_not_our_dump_is_refused_untouched`).

# %%
DUMP_FILE = re.compile(
    r"index\.json|viewer\.html|sentence_\d{3,}(\.npz|_(enc_self|dec_self|cross|alignment|"
    r"alignment_heads|encoder|decoder_self)\.png)"
)  # every name a dump writes (or wrote, v1)


def not_a_dump(out_dir: os.PathLike | str) -> str | None:
    """Why `out_dir` may not be replaced by a dump, or None (missing, empty, or a dump of ours)."""
    out_dir = Path(out_dir)
    if out_dir.is_symlink() or (out_dir.exists() and not out_dir.is_dir()):
        return "it is not a directory" if not out_dir.is_symlink() else "it is a symbolic link"
    if not out_dir.exists() or not any(out_dir.iterdir()):
        return None
    try:
        index = json.loads((out_dir / "index.json").read_text(encoding="utf-8"))
        ours = {"index.json", index.get("viewer") or "viewer.html"}
        for entry in index["sentences"]:
            ours |= {entry["file"], *(entry.get("pictures") or {}).values()}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return "it has no readable index.json of an attention dump"
    if index.get("format") not in (FORMAT, *OLD_FORMATS):
        return f"its index.json does not carry the format {FORMAT!r}"
    foreign = sorted(
        p.name
        for p in out_dir.iterdir()
        if p.name not in ours or not DUMP_FILE.fullmatch(p.name) or p.is_symlink() or not p.is_file()
    )
    return f"it holds {foreign[0]!r}, which is no file of a dump" if foreign else None


def check_output_dir(out_dir: os.PathLike | str) -> None:
    """ValueError naming the fix when `out_dir` is neither missing, empty, nor one of our dumps."""
    why = not_a_dump(out_dir)
    if why:
        raise ValueError(
            f"{out_dir} exists and is not an attention dump ({why}); it was left untouched: "
            f"choose another --out, or move it away yourself"
        )


def _pretty_json(value, indent: str = "") -> str:
    """JSON with one key per line but lists of plain values (ids, tokens, shapes) on one line."""
    inner = indent + " "
    if isinstance(value, dict) and value:
        items = [f"{inner}{json.dumps(str(k))}: {_pretty_json(v, inner)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + indent + "}"
    if isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
        return "[\n" + ",\n".join(inner + _pretty_json(v, inner) for v in value) + "\n" + indent + "]"
    return json.dumps(value, ensure_ascii=False)


def _pictures(tmp: Path, stem: str, attn: dict, entry: dict) -> dict:
    files = {}
    for kind in KINDS:
        rows, cols = (entry[name] for name in ROWS_COLS[kind])
        fig = grid_figure(attn[kind], rows, cols, kind, title=f"{stem}, ")
        files[kind] = f"{stem}_{kind}.png"
        save_figure(fig, tmp / files[kind])
    last = len(attn["cross"]) - 1
    title = f"{stem}: cross-attention of layer {last} (the last)"
    for name, per_head in (("alignment", False), ("alignment_heads", True)):
        fig = alignment_figure(attn["cross"][last], entry["src_tokens"], entry["tgt_out_tokens"], title, per_head)
        files[name] = f"{stem}_{name}.png"
        save_figure(fig, tmp / files[name])
    return files


def dump_model(
    model: EncoderDecoder,
    tokenizer,
    sentences: Sequence[str],
    out_dir: os.PathLike | str,
    *,
    checkpoint: str | None = None,
    meta: dict | None = None,
    references: Sequence[str | None] | None = None,
    pictures: bool = True,
    viewer: bool = True,
    dtype=np.float32,
    progress: bool = False,
    beam_size: int = Decoding.beam,
    importance: dict | None = None,
) -> Path:
    """Translate `sentences` as the translator does and write their attention dump into `out_dir` (atomically).

    `importance`: each head's score per kind, {kind: [per layer [per head]]} (see `read_head_importance`);
    it must list exactly the model's heads (ValueError otherwise)."""
    check_eval_mode(model, "dump")
    if not sentences:
        raise ValueError("no sentences to dump")
    if references is not None and len(references) != len(sentences):
        raise ValueError(f"{len(references)} references for {len(sentences)} sentences")
    cfg, alpha = model.config, model_length_penalty(meta or {})
    sources = [encode_sentence(tokenizer, s, cfg.max_len, name=f"sentence {i + 1}") for i, s in enumerate(sentences)]
    index = {
        "format": FORMAT,
        "checkpoint": checkpoint,
        "model_config": dataclasses.asdict(cfg),
        "meta": json_safe(dict(meta or {})),
        "kinds": list(KINDS),
        "layers": cfg.N,
        "heads": cfg.h,
        "head_counts": head_counts(model),
        "axes": ["batch", "head", "query", "key"],
        "array_names": "{kind}_layer{layer}",
        "layer_order": "layer 0 is nearest the embeddings, layer N-1 feeds the output",
        "head_order": "head i uses W_Q[i], W_K[i], W_V[i] (per-head form) = column block i (fused form); "
        "a pruned layer numbers its remaining heads 0 ... h'-1 in their original order",
        "rows_cols": {k: list(v) for k, v in ROWS_COLS.items()},
        "dtype": np.dtype(dtype).name,
        "decoder": {"beam_size": beam_size, "length_penalty": alpha},
        "head_importance": importance,
        "sentences": [],
    }
    if importance is not None and not all(importance_fits(importance.get(k), index["head_counts"][k]) for k in KINDS):
        raise ValueError(
            f"the head importance does not list one finite score per head of this model "
            f"(heads per layer: {index['head_counts']})"
        )
    all_arrays = []
    items = tracked(enumerate(zip(sentences, sources)), len(sentences), "attention", "sentence", progress)
    with staged_directory(out_dir, check_output_dir) as tmp:
        for i, (sentence, src_ids) in items:
            tgt_ids = translate_sentence(model, src_ids, beam_size, alpha)
            attn = collect_attention(model, src_ids, tgt_ids, dtype=dtype)
            stem = f"sentence_{i:03d}"
            words = tokenizer.decode(tgt_ids[:-1] if tgt_ids[-1:] == [EOS] else tgt_ids)
            entry = {
                "index": i,
                "file": f"{stem}.npz",
                "source": sentence,
                "reference": references[i] if references is not None else None,
                "translation": " ".join(words.splitlines()),
                "src_ids": src_ids,
                "tgt_out_ids": tgt_ids,
                "src_tokens": token_labels(tokenizer, src_ids),
                "tgt_in_tokens": token_labels(tokenizer, [BOS] + tgt_ids[:-1]),
                "tgt_out_tokens": token_labels(tokenizer, tgt_ids),
                "shapes": {k: [list(a.shape) for a in attn[k]] for k in KINDS},
            }  # per layer
            np.savez(tmp / f"{stem}.npz", **{array_name(k, layer): a for k in KINDS for layer, a in enumerate(attn[k])})
            if pictures:
                entry["pictures"] = _pictures(tmp, stem, attn, entry)
            index["sentences"].append(entry)
            all_arrays.append(attn)
        if viewer:
            page = viewer_html(index, all_arrays, circuits=circuits_beside(out_dir))
            (tmp / "viewer.html").write_text(page, encoding="utf-8")
            index["viewer"] = "viewer.html"
        (tmp / "index.json").write_text(_pretty_json(index) + "\n", encoding="utf-8")
    return Path(out_dir)


def dump(
    checkpoint_path: os.PathLike | str,
    sentences: Sequence[str] | None = None,
    out_dir: os.PathLike | str | None = None,
    *,
    n: int = 3,
    data_url: str | None = None,
    cache_dir: os.PathLike | str | None = None,
    references: Sequence[str | None] | None = None,
    dtype=np.float32,
    device: str | None = None,
    beam_size: int = Decoding.beam,
    say=None,
    name: str | None = None,
    **options,
) -> Path:
    """Load a checkpoint and write the attention dump of `sentences` into `out_dir`; returns `out_dir`.

    No `sentences`: the first `n` of Multi30k's test_2016_flickr, with their references. No `out_dir`:
    `attention/` next to the checkpoint. `dtype=np.float64` runs the model in float64 too (exact comparisons).
    `say` gets the line of `read_head_importance`; `name`: the checkpoint as typed (default `typed_name`);
    `options`: `dump_model`'s. CheckpointError or ValueError before anything is written.
    """
    checkpoint = Path(checkpoint_path).resolve()
    out_dir = Path(out_dir) if out_dir is not None else checkpoint.parent / "attention"
    check_output_dir(out_dir)  # before any work
    model, tokenizer, meta = load_checkpoint(checkpoint_path)
    check_tokenizer(tokenizer, checkpoint_path, "turn sentences into ids")
    model = model.to(device or "cpu", torch.float64 if np.dtype(dtype) == np.float64 else torch.float32)
    if sentences is None:
        from annotated.training.data import load_multi30k

        if not meta.get("src_lang") or not meta.get("tgt_lang"):
            raise ValueError("the checkpoint's metadata names no src_lang/tgt_lang; give the sentences explicitly")
        pairs = load_multi30k(
            "test_2016_flickr", meta["src_lang"], meta["tgt_lang"], cache_dir=cache_dir, base_url=data_url
        )
        sentences, references = [s for s, _ in pairs[:n]], [t for _, t in pairs[:n]]
    importance, note = read_head_importance(checkpoint, model.config, head_counts(model))
    if note and say:
        say(note)
    return dump_model(
        model,
        tokenizer,
        sentences,
        out_dir,
        checkpoint=name if name is not None else typed_name(checkpoint),
        meta=meta,
        references=references,
        dtype=dtype,
        beam_size=beam_size,
        importance=importance,
        **options,
    )


# %% [markdown]
# ## 6. During training: one alignment picture per epoch in tensorboard
#
# `log_alignment_image` translates one fixed sentence greedily (the cheapest
# search shows the alignment as well) with the model as it is, so
# tensorboard's slider shows the alignment sharpening from blur to a diagonal
# over the epochs. It draws no random numbers.


# %%
def log_alignment_image(
    writer, model: EncoderDecoder, tokenizer, src_sentence: str, step: int, tag: str = "attention/alignment"
) -> np.ndarray:
    """Log the alignment figure of `src_sentence` to a tensorboard SummaryWriter; returns the image."""
    was_training = model.training
    model.eval()
    try:
        src_ids = encode_sentence(tokenizer, src_sentence, model.config.max_len, name="alignment sentence")
        tgt_ids = translate_sentence(model, src_ids, beam_size=1)  # greedy
        attn = collect_attention(model, src_ids, tgt_ids)
        last = model.config.N - 1
        fig = alignment_figure(
            attn["cross"][last],
            token_labels(tokenizer, src_ids),
            token_labels(tokenizer, tgt_ids),
            title=f"step {step}: cross-attention of layer {last}, mean over heads",
        )
        image = figure_rgb(fig)  # (H, W, 3)
        writer.add_image(tag, image, step, dataformats="HWC")
        return image
    finally:
        model.train(was_training)


# %% [markdown]
# ## 7. The command line
#
# `python -m annotated.attention.dump [--checkpoint PATH] [--out DIR] [--n 3] [sentence ...]`
# (`make attention ARGS='...'`) chooses its checkpoint and output folder as
# every command does (`annotated/door.py`), and calls `dump`. Bad input
# prints one line on stderr and exits with status 2, writing nothing.


# %%
def parse_args(argv=None) -> argparse.Namespace:
    p = DOOR.parser(description="Dump, draw and browse every attention weight of a trained translator.")
    p.add_argument("sentences", nargs="*", help="source sentences (default: the first --n of test_2016_flickr)")
    DOOR.checkpoint_options(p)
    DOOR.output_options(
        p,
        type=Path,  # a folder that exists and is not a dump is refused by `dump`, untouched
        help="output directory (default: attention/ next to the checkpoint; runs/shipped-<src>-<tgt>/attention/ for a "
        "shipped model)",
        force=False,
    )
    p.add_argument("--n", type=at_least(1), default=3, help="how many test sentences when none are given (default 3)")
    p.add_argument("--data-url", help="base URL of the Multi30k files (default $MULTI30K_URL, else GitHub)")
    p.add_argument("--cache-dir", type=writable_dir, help="download cache (default as in training)")
    p.add_argument("--device", type=device, help="cpu, cuda, cuda:1 (default cpu)")
    Decoding.add_options(p, "beam", beam_help="beam width of the translation, as for make translate; 1 = greedy")
    p.add_argument("--no-pictures", action="store_true", help="skip the PNG files")
    p.add_argument("--no-viewer", action="store_true", help="skip viewer.html")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        DOOR.outputs(args, [], DOOR.checkpoint(args), under="attention")  # an earlier dump is replaced
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    try:
        out = dump(
            args.checkpoint,
            args.sentences or None,
            args.out,
            n=args.n,
            data_url=args.data_url,
            cache_dir=args.cache_dir,
            pictures=not args.no_pictures,
            viewer=not args.no_viewer,
            device=args.device,
            progress=sys.stderr.isatty(),
            beam_size=args.beam,
            say=lambda line: DOOR.say(f"note: {line}"),
            name=args.typed_checkpoint,
        )
    except (ValueError, OSError) as e:  # CheckpointError and the data errors are ValueErrors
        DOOR.say(f"error: {e}")
        return 2
    count = len(read_index(out)["sentences"])
    print(
        f"wrote the attention of {count} sentence(s) to {out}/: index.json, sentence_*.npz"
        f"{', *.png' if not args.no_pictures else ''}{', viewer.html' if not args.no_viewer else ''}"
    )
    if not args.no_viewer:
        print(f"open {(out / 'viewer.html').resolve().as_uri()}")
    return 0


if __name__ == "__main__":
    from annotated.plumbing.scripts import run_main

    run_main(main)
