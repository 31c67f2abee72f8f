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
# # A trained model and its export, on real sentences
#
# ```sh
# python -m annotated.interop.agreement runs/<run>/averaged.pt [--sentences 1000] [--hf-length-penalty 0.6 1.0]
# ```
#
# exports the checkpoint into a temporary folder, loads it back with
# `MarianMTModel.from_pretrained`, and compares on test_2016_flickr (the
# checkpoint's languages):
#
# 1. **logits**, teacher-forced on each source and its reference, in
#    float64 and in float32: the largest absolute difference over every
#    position and every token;
# 2. **translations**, our `translate_ids` (beam 4) against `generate`
#    (`num_beams=4`, `early_stopping=True`) on the same batches, with the
#    same output length limit: the share of identical translations and each
#    one's corpus BLEU. First with no length penalty on either side (`alpha =
#    0` and `length_penalty=0`, where the two formulas agree, so any
#    difference is a difference of search), then with our translator's
#    GNMT `alpha` (the model's own, `model_length_penalty`, unless `--alpha`
#    names one) against `generate`'s `|Y|^length_penalty`.
#
# `tests/interop/test_agreement.py` runs it on a trained checkpoint where
# there is one.

# %%
from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from annotated.decoding.search import MAX_EXTRA, translate_ids
from annotated.interop.folders import export_marian
from annotated.plumbing.scripts import name_of
from annotated.tokens import BOS, EOS, PAD
from annotated.transformer import padding_mask, subsequent_mask

NAME = name_of(__file__)


def _padded(rows: list[list[int]]) -> torch.Tensor:
    out = torch.full((len(rows), max(map(len, rows))), PAD, dtype=torch.long)  # (B, T)
    for r, ids in enumerate(rows):
        out[r, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out


@torch.no_grad()
def logit_difference(
    model, hf, sources: list[list[int]], targets: list[list[int]], dtype: torch.dtype, batch_size: int = 50
) -> float:
    """The largest |our logit - Marian's logit| over every sentence, position and token, in `dtype`."""
    model, hf, worst = model.to(dtype), hf.to(dtype), 0.0
    for i in range(0, len(sources), batch_size):
        src, tgt = _padded(sources[i : i + batch_size]), _padded([[BOS] + t for t in targets[i : i + batch_size]])
        ours = model(src, tgt, padding_mask(src, PAD), subsequent_mask(tgt.size(1)))  # (B, T, V)
        theirs = hf(input_ids=src, attention_mask=(src != PAD).long(), decoder_input_ids=tgt).logits  # (B, T, V)
        real = (tgt != PAD).unsqueeze(-1)  # (B, T, 1) the positions of real target tokens
        worst = max(worst, ((ours - theirs).abs() * real).max().item())
    model.float(), hf.float()
    return worst


@torch.no_grad()
def generate_ids(
    hf, sources: list[list[int]], length_penalty: float, batch_size: int = 64, max_extra: int = MAX_EXTRA
) -> list[list[int]]:
    """`generate` with beam 4 on `translate_ids`' batches and length limits; ids without eos, in input order."""
    limit = hf.config.max_position_embeddings
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    out: list[list[int]] = [[] for _ in sources]
    for k in range(0, len(order), batch_size):
        idx = order[k : k + batch_size]
        src = _padded([sources[i][:limit] for i in idx])
        ys = hf.generate(
            input_ids=src,
            attention_mask=(src != PAD).long(),
            num_beams=4,
            do_sample=False,
            early_stopping=True,
            length_penalty=length_penalty,
            # at most min(limit, T + max_extra) new tokens; max_length counts the decoder start too
            # (max_new_tokens beside the export's max_length draws a warning per batch)
            max_length=1 + min(limit, src.size(1) + max_extra),
        )[:, 1:]  # without the decoder start
        for r, i in enumerate(idx):
            row = ys[r].tolist()
            out[i] = row[: row.index(EOS)] if EOS in row else [t for t in row if t != PAD]
    return out


def compare(
    checkpoint: Path,
    sentences: int = 1000,
    alpha: float | None = None,
    hf_length_penalties: tuple[float, ...] = (1.0,),
    data_url: str | None = None,
) -> dict:
    """The figures of this module for `checkpoint` on the first `sentences` test sentences: with no length
    penalty, then our alpha (`alpha`, else the model's) against each of `generate`'s `hf_length_penalties`
    (none: the search without penalties only)."""
    from transformers import MarianMTModel

    from annotated.checkpoint import load_checkpoint, model_length_penalty
    from annotated.training.data import load_multi30k
    from annotated.training.evaluate import score

    model, tokenizer, meta = load_checkpoint(checkpoint)
    alpha = model_length_penalty(meta) if alpha is None else alpha
    src_lang, tgt_lang = meta.get("src_lang", "de"), meta.get("tgt_lang", "en")
    pairs = load_multi30k("test_2016_flickr", src_lang, tgt_lang, base_url=data_url)[:sentences]
    limit = model.config.max_len
    sources = [tokenizer.encode(s)[:limit] for s, _ in pairs]
    targets = [tokenizer.encode(t)[: limit - 1] for _, t in pairs]
    with tempfile.TemporaryDirectory() as folder:
        export_marian(checkpoint, Path(folder) / "export")
        hf = MarianMTModel.from_pretrained(str(Path(folder) / "export"), local_files_only=True).float().eval()
    result = {
        "sentences": len(pairs),
        "max_abs_logit_difference": {
            name: logit_difference(model, hf, sources, targets, dtype)
            for name, dtype in (("float64", torch.float64), ("float32", torch.float32))
        },
    }
    references = [t for _, t in pairs]
    settings = [("no length penalty", 0.0, 0.0)] + [
        (f"alpha {alpha:g} against length_penalty {lp:g}", alpha, lp) for lp in hf_length_penalties
    ]
    ours_at: dict[float, list[list[int]]] = {}
    for name, ours_alpha, theirs_lp in settings:
        if ours_alpha not in ours_at:
            ours_at[ours_alpha] = translate_ids(model, sources, beam_size=4, length_penalty=ours_alpha)
        ours, theirs = ours_at[ours_alpha], generate_ids(hf, sources, theirs_lp)
        bleu = [score([tokenizer.decode(h) for h in hyps], references)["bleu"] for hyps in (ours, theirs)]
        result[name] = {
            "our alpha": ours_alpha,
            "generate length_penalty": theirs_lp,
            "identical": sum(a == b for a, b in zip(ours, theirs)) / len(pairs),
            "our BLEU": bleu[0],
            "generate BLEU": bleu[1],
        }
    return result


def main(argv: list[str] | None = None) -> int:
    import json
    import sys

    from annotated.checkpoint import PAPER_LENGTH_PENALTY, CheckpointError
    from annotated.plumbing.options import Parser, at_least, number
    from annotated.shipped import choose_checkpoint

    p = Parser(
        command=__file__,
        description="A checkpoint against its MarianMTModel export on test_2016_flickr.",
    )
    p.add_argument("checkpoint", help="checkpoint file, or shipped:de-en / shipped:en-de")
    p.add_argument("--sentences", type=at_least(1), default=1000)
    p.add_argument(
        "--alpha",
        type=number(0, None),
        default=None,
        help=f"our GNMT length penalty (default: the model's, else the paper's {PAPER_LENGTH_PENALTY})",
    )
    p.add_argument(
        "--hf-length-penalty",
        type=number(None, None),
        nargs="*",
        default=[1.0],
        help="generate's length_penalty, one comparison each (default 1.0)",
    )
    args = p.parse_args(argv)
    try:
        checkpoint = choose_checkpoint(args.checkpoint, say=lambda line: print(f"{NAME}: {line}", file=sys.stderr))
    except CheckpointError as e:
        p.error(str(e))
    if not checkpoint.is_file():
        p.error(f"checkpoint {checkpoint}: no such file")
    torch.set_num_threads(1)
    print(json.dumps(compare(checkpoint, args.sentences, args.alpha, tuple(args.hf_length_penalty)), indent=1))
    return 0


if __name__ == "__main__":
    from annotated.plumbing.scripts import run_main

    run_main(main)
