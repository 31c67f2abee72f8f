# %% [markdown]
# # Translating and scoring
#
# Sentences are translated in batches of similar length (fewer pad
# positions), then put back in their original order and detokenised by
# sentencepiece before scoring. BLEU and chrF come from sacreBLEU with its
# defaults (cased, `13a` tokenisation); we also report lowercased BLEU, the
# number most Multi30k papers quote. A source longer than the model's
# `max_len` is truncated to `max_len` subwords (the rule, stated once, and
# counted in the results).
#
# The end of a run (test scores of its checkpoints, `results.json`) is
# `annotated/training/results.py`.

# %%
from __future__ import annotations

from annotated.decoding import search as decoding


def score(hypotheses: list[str], references: list[str]) -> dict:
    """sacreBLEU cased and lowercased BLEU, and chrF, with their signatures."""
    import sacrebleu

    bleu = sacrebleu.metrics.BLEU()
    bleu_lc = sacrebleu.metrics.BLEU(lowercase=True)
    chrf = sacrebleu.metrics.CHRF()
    b, bl, c = (m.corpus_score(hypotheses, [references]) for m in (bleu, bleu_lc, chrf))
    return {"bleu": round(b.score, 2), "bleu_lowercase": round(bl.score, 2), "chrf": round(c.score, 2),
            "signature": {"bleu": str(bleu.get_signature()), "bleu_lowercase": str(bleu_lc.get_signature()),
                          "chrf": str(chrf.get_signature())}}


def evaluate_bleu(model, tokenizer, pairs: list[tuple[str, str]], beam_size: int, length_penalty: float,
                  device=None, progress: bool = False) -> tuple[dict, list[str]]:
    """Translate the sources of `pairs` and score them against the references: (scores, translations)."""
    sources = [tokenizer.encode(s) for s, _ in pairs]
    truncated = sum(len(s) > model.config.max_len for s in sources)
    hyp_ids = decoding.translate_ids(model, sources, beam_size, length_penalty, device=device, progress=progress)
    hyps = [tokenizer.decode(h) for h in hyp_ids]
    result = score(hyps, [t for _, t in pairs])
    result.update(sentences=len(pairs), truncated_sources=truncated, beam_size=beam_size)
    return result, hyps
