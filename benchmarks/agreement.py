"""A trained model and its MarianMTModel export, on real sentences.

    python -m benchmarks.agreement runs/<run>/averaged.pt [--sentences 1000] [--hf-length-penalty 0.6 1.0]

exports the checkpoint into a temporary folder, loads it back with `MarianMTModel.from_pretrained`, and compares
on test_2016_flickr (the checkpoint's languages):

1. **logits**, teacher-forced on each source and its reference, in float64 and in float32: the largest absolute
   difference over every position and every token of ours (the export's added `<pad>` row is `-inf`). In float32
   the folder as `from_pretrained` loads it; in float64 the conversion of our float64 model (`to_marian`), the
   folder being float32;
2. **translations**, our `translate_ids` (beam 4) against `generate` (`num_beams=4`, `early_stopping=True`) on the
   same batches, with the same output length limit: the share of identical translations and each one's corpus
   BLEU. First with no length penalty on either side (`alpha = 0` and `length_penalty=0`, where the two formulas
   agree, so any difference is a difference of search), then with our translator's GNMT `alpha` (the model's own,
   `model_length_penalty`, unless `--alpha` names one) against `generate`'s `|Y|^length_penalty`;
3. where `ctranslate2` is installed, **CTranslate2**: the export's `ctranslate2/` model, which CTranslate2's own
   converter (the code of `ct2-transformers-converter`, nothing patched) made from the layout it needs (section 1
   of `annotated/interop/marian.py`; `ctranslate2_ids`), `translate_batch` with beam 4 and `length_penalty=0`, the
   same output length limits, against our search with `alpha = 0`: the share of identical translations and each
   one's corpus BLEU.

Its figures for the shipped models are in docs/training.md#exported-and-imported-the-shipped-models;
`tests/test_agreement_bench.py` runs it on a trained checkpoint.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from annotated.decoding.search import padded, translate_ids
from annotated.decoding.settings import Decoding
from annotated.interop.folders import export_marian, has_ctranslate2
from annotated.interop.marian import to_marian
from annotated.tokens import BOS, EOS, PAD
from annotated.transformer import padding_mask, subsequent_mask


def export_ids(ids: torch.Tensor, pad: int, decoder_start: int | None = None) -> torch.Tensor:
    """Our ids (B, T) as the export's (section 1 of annotated/interop/marian.py): our pad -> Marian's pad `pad`,
    and a decoder input's bos at position 0 -> `decoder_start` where given; every other id is the same."""
    out = ids.masked_fill(ids == PAD, pad)  # (B, T)
    if decoder_start is not None:
        out[:, 0] = decoder_start
    return out


@torch.no_grad()
def logit_difference(
    model, hf, sources: list[list[int]], targets: list[list[int]], dtype: torch.dtype, batch_size: int = 50
) -> float:
    """The largest |our logit - Marian's logit| over every sentence, position and token, in `dtype`."""
    model, hf, worst = model.to(dtype), hf.to(dtype), 0.0
    pad, start, V = hf.config.pad_token_id, hf.config.decoder_start_token_id, model.config.tgt_vocab
    for i in range(0, len(sources), batch_size):
        src, tgt = padded(sources[i : i + batch_size]), padded([[BOS] + t for t in targets[i : i + batch_size]])
        ours = model(src, tgt, padding_mask(src, PAD), subsequent_mask(tgt.size(1)))  # (B, T, V)
        theirs = hf(
            input_ids=export_ids(src, pad),
            attention_mask=(src != PAD).long(),
            decoder_input_ids=export_ids(tgt, pad, decoder_start=start),
        ).logits[..., :V]  # (B, T, V)
        real = (tgt != PAD).unsqueeze(-1)  # (B, T, 1) the positions of real target tokens
        worst = max(worst, ((ours - theirs).abs() * real).max().item())
    model.float(), hf.float()
    return worst


def ctranslate2_ids(
    folder: Path, tokenizer, sources: list[list[int]], max_extra: int = Decoding.max_extra
) -> list[list[int]]:
    """CTranslate2's beam 4, no length penalty, on the export `folder`'s `ctranslate2/` model (made by the stock
    converter); output lengths at most min(max_len, S + max_extra) as `translate_ids`; our ids without eos, in input
    order."""
    import ctranslate2

    translator = ctranslate2.Translator(
        str(folder / "ctranslate2"), device="cpu", intra_threads=torch.get_num_threads()
    )
    limit = json.loads((folder / "config.json").read_text(encoding="utf-8"))["max_position_embeddings"]
    piece_id = {p: i for i, p in enumerate(tokenizer.pieces(range(tokenizer.vocab_size)))}
    out = []
    for ids in sources:  # one call per sentence: each its own length limit
        r = translator.translate_batch(
            [tokenizer.pieces(ids[:limit])],
            beam_size=Decoding.beam,
            length_penalty=0.0,
            max_decoding_length=min(limit, len(ids) + max_extra),
        )[0]
        out.append([piece_id[p] for p in r.hypotheses[0]])
    return out


@torch.no_grad()
def generate_ids(
    hf, sources: list[list[int]], length_penalty: float, batch_size: int = 64, max_extra: int = Decoding.max_extra
) -> list[list[int]]:
    """`generate` with beam 4 on `translate_ids`' batches and length limits; our ids without eos, in input order."""
    limit, pad = hf.config.max_position_embeddings, hf.config.pad_token_id
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    out: list[list[int]] = [[] for _ in sources]
    for k in range(0, len(order), batch_size):
        idx = order[k : k + batch_size]
        src = padded([sources[i][:limit] for i in idx])
        ys = hf.generate(
            input_ids=export_ids(src, pad),
            attention_mask=(src != PAD).long(),
            num_beams=Decoding.beam,
            do_sample=False,
            early_stopping=True,
            length_penalty=length_penalty,
            # at most min(limit, T + max_extra) new tokens; max_length counts the decoder start too
            # (max_new_tokens beside the export's max_length draws a warning per batch)
            max_length=1 + min(limit, src.size(1) + max_extra),
        )[:, 1:]  # without the decoder start
        for r, i in enumerate(idx):
            row = ys[r].tolist()
            out[i] = row[: row.index(EOS)] if EOS in row else [t for t in row if t != pad]
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

    from annotated.checkpoint import load_checkpoint
    from annotated.decoding.settings import model_length_penalty
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
        ct2 = ctranslate2_ids(Path(folder) / "export", tokenizer, sources) if has_ctranslate2() else None
    result = {
        "sentences": len(pairs),
        "max_abs_logit_difference": {
            "float64": logit_difference(model, to_marian(model.double()), sources, targets, torch.float64),
            "float32": logit_difference(model, hf, sources, targets, torch.float32),
        },
    }
    references = [t for _, t in pairs]
    settings = [("no length penalty", 0.0, 0.0)] + [
        (f"alpha {alpha:g} against length_penalty {lp:g}", alpha, lp) for lp in hf_length_penalties
    ]
    ours_at: dict[float, list[list[int]]] = {}
    for name, ours_alpha, theirs_lp in settings:
        if ours_alpha not in ours_at:
            ours_at[ours_alpha] = translate_ids(model, sources, Decoding.beam, ours_alpha)
        ours, theirs = ours_at[ours_alpha], generate_ids(hf, sources, theirs_lp)
        bleu = [score([tokenizer.decode(h) for h in hyps], references)["bleu"] for hyps in (ours, theirs)]
        result[name] = {
            "our alpha": ours_alpha,
            "generate length_penalty": theirs_lp,
            "identical": sum(a == b for a, b in zip(ours, theirs)) / len(pairs),
            "our BLEU": bleu[0],
            "generate BLEU": bleu[1],
        }
    if ct2 is not None:
        ours = ours_at[0.0]
        result["CTranslate2, no length penalty"] = {
            "identical": sum(a == b for a, b in zip(ours, ct2)) / len(pairs),
            "our BLEU": score([tokenizer.decode(h) for h in ours], references)["bleu"],
            "CTranslate2 BLEU": score([tokenizer.decode(h) for h in ct2], references)["bleu"],
        }
    return result


def main(argv: list[str] | None = None) -> int:
    from annotated.decoding.settings import PAPER_LENGTH_PENALTY
    from annotated.door import Door
    from annotated.plumbing.options import at_least, number

    door = Door(__file__)
    p = door.parser(description="A checkpoint against its MarianMTModel export on test_2016_flickr.")
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
    door.checkpoint(args)
    torch.set_num_threads(1)
    print(json.dumps(compare(args.checkpoint, args.sentences, args.alpha, tuple(args.hf_length_penalty)), indent=1))
    return 0


if __name__ == "__main__":
    from annotated.plumbing.scripts import run_main

    run_main(main)
