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
# At the end of a run, `finish` scores the test set with the best checkpoint
# (and with the average of the last epochs' checkpoints, when asked), greedy
# and with beam search, and writes `results.json`. The test set is named
# `test_2016_flickr`, or, when the user brought their own, by its two files.

# %%
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from typing import TYPE_CHECKING

import torch

from annotated.decoding import search as decoding
from annotated.plumbing.checkpoint import atomic_torch_save, load_checkpoint, read_checkpoint
from annotated.plumbing.files import atomic_write
from annotated.training.runs import average_checkpoints

if TYPE_CHECKING:
    from annotated.training.train import TrainConfig


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
    sources = [tokenizer.encode(s) for s, _ in pairs]
    truncated = sum(len(s) > model.config.max_len for s in sources)
    hyp_ids = decoding.translate_ids(model, sources, beam_size, length_penalty, device=device, progress=progress)
    hyps = [tokenizer.decode(h) for h in hyp_ids]
    result = score(hyps, [t for _, t in pairs])
    result.update(sentences=len(pairs), truncated_sources=truncated, beam_size=beam_size)
    return result, hyps


def finish(cfg: TrainConfig, run_dir: Path, tokenizer, test_pairs, dev, say, progress=True,
           test_files=None) -> dict:
    """Test BLEU of the best (and averaged) checkpoint, greedy and beam; writes results.json."""
    # a run stopped before its first epoch ended has no best.pt yet: use last.pt
    candidates = {"best": run_dir / "best.pt" if (run_dir / "best.pt").exists() else run_dir / "last.pt"}
    epochs = sorted(run_dir.glob("epoch*.pt"), key=lambda p: int(p.stem[5:]))
    if cfg.average_last >= 2 and len(epochs) >= 2:
        atomic_torch_save(average_checkpoints(epochs[-cfg.average_last:]), run_dir / "averaged.pt")
        candidates["averaged"] = run_dir / "averaged.pt"
    test_set = f"{test_files[0]} + {test_files[1]}" if test_files else "test_2016_flickr"  # named by its files
    results = {"run_dir": str(run_dir), "device": str(dev), "torch": torch.__version__,
               "train_config": dataclasses.asdict(cfg), "test_set": test_set, "test": {}}
    if test_files:
        results["test_files"] = [str(f) for f in test_files]
    last = read_checkpoint(run_dir / "last.pt")["run_state"]
    results.update(steps=last["step"], train_s=round(last.get("train_s", 0.0), 1), history=last["history"])
    samples = []
    for name, path in candidates.items():
        model, _, meta = load_checkpoint(path)
        model.to(dev)
        greedy, hyps = evaluate_bleu(model, tokenizer, test_pairs, 1, 0.0, dev, progress)
        beam, beam_hyps = evaluate_bleu(model, tokenizer, test_pairs, cfg.beam_size, cfg.length_penalty, dev,
                                        progress)
        results["test"][name] = {"checkpoint": str(path), "epoch": meta.get("epoch"), "greedy": greedy,
                                 "beam": dict(beam, length_penalty=cfg.length_penalty)}
        say(f"{test_set} {cfg.src_lang}->{cfg.tgt_lang} [{name}]: greedy BLEU {greedy['bleu']:.2f} "
            f"(lowercased {greedy['bleu_lowercase']:.2f}), beam {cfg.beam_size} BLEU {beam['bleu']:.2f} "
            f"(lowercased {beam['bleu_lowercase']:.2f}), chrF {beam['chrf']:.2f}")
        if not samples:
            samples = [{"source": s, "reference": r, "greedy": g, "beam": b}
                       for (s, r), g, b in list(zip(test_pairs, hyps, beam_hyps))[:5]]
    results["samples"] = samples
    atomic_write(run_dir / "results.json", json.dumps(results, indent=2, ensure_ascii=False))
    for s in samples[:3]:
        say(f"  src : {s['source']}\n  ref : {s['reference']}\n  beam: {s['beam']}")
    say(f"results: {run_dir / 'results.json'}; checkpoints: {run_dir}; tensorboard --logdir {run_dir / 'tb'}")
    return results
