# %% [markdown]
# # Decoding throughput at a fixed length (`make bench`)
#
# A randomly initialised model produces `eos` whenever it likes, and the
# cached and recomputing decoders would then stop at different moments only
# by chance. For a fair comparison every decoder must run the same number of
# steps: we set the generator's bias for `eos` to `-inf`, so `eos` has
# probability exactly zero, no sentence ever finishes, and every decoder runs
# exactly `steps` steps (the benchmark checks the output length). `steps` is
# the longest target in the batch plus its `eos`, the length a real batch
# decodes to. Beam search uses width 4 and the paper's length penalty 0.6.
#
# Besides: the translator reading sentences from stdin against one batched
# `translate_ids` call on the same sentences (`bench_translator_cli`).

# %%
from __future__ import annotations

import io
import random
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from annotated import transformer
from annotated.decoding import search as decoding
from annotated.decoding.settings import Decoding
from annotated.tokens import EOS, PAD
from annotated.transformer import EncoderDecoder, make_model, padding_mask
from benchmarks.rows import DECODERS, DecodeRow
from benchmarks.sizes import Size, make_batches
from benchmarks.timing import Settings, interleaved_times, median


@torch.no_grad()
def suppress_eos(model: EncoderDecoder) -> EncoderDecoder:
    """Make eos unreachable: its generator bias becomes -inf, so its probability is exactly 0."""
    model.generator.bias[EOS] = float("-inf")
    return model


def decode_fns(model, batches, steps: int, amp) -> dict:
    """key -> function decoding every batch for exactly `steps` steps."""

    def run(decode):
        def go():
            for src, _ in batches:
                with amp():
                    out = decode(src, padding_mask(src, PAD))
                if out.size(1) != steps:
                    raise RuntimeError(f"decoder stopped after {out.size(1)} of {steps} steps; eos must be unreachable")

        return go

    return {
        "greedy_cached": run(lambda s, m: decoding.greedy(model, s, m, steps, use_cache=True)),
        "greedy_recompute": run(lambda s, m: decoding.greedy(model, s, m, steps, use_cache=False)),
        "beam4_cached": run(
            lambda s, m: decoding.beam_search(model, s, m, steps, Decoding.beam, Decoding.length_penalty)
        ),
    }


def bench_decoding(size: Size, st: Settings, log: Callable[[str], None]) -> list[DecodeRow]:
    device = st.device
    sentences = size.decode_sentences[device.type]
    batches = [
        (s.to(device), t.to(device))
        for s, t in make_batches(st.decode_batches, sentences, size.train.vocab_size, st.seed + 1)
    ]
    steps = batches[0][1].size(1) - 1  # the longest target plus eos
    torch.manual_seed(st.seed)
    model = suppress_eos(make_model(size.model_config()).to(device).eval())
    fns = decode_fns(model, batches, steps, st.amp())
    log(f"[{size.name}] decoding: {len(batches)} x {sentences} sentences, {steps} steps each")
    times, iters, errors = interleaved_times(
        fns, st.reps, st.window, st.sync, lambda s: log(f"[{size.name}] decoding {s}"), st.timer()
    )
    recompute_s = median(times.get("greedy_recompute", []))
    return [
        DecodeRow(
            size=size.name,
            key=key,
            device=device.type,
            dtype=st.dtype,
            sentences=len(batches) * sentences,
            steps=steps,
            src_shape=list(batches[0][0].shape),
            seconds_rounds=times.get(key, []),
            calls_per_round=iters.get(key),
            recompute_s=recompute_s,
            error=errors.get(key),
        )
        for key in DECODERS
    ]


def bench_translator_cli(st: Settings, log: Callable[[str], None], sentences: int = 48, beam: int = 2) -> dict:
    """The translator reading `sentences` lines from stdin (annotated/decoding/translate.py's main, in process:
    checkpoint loading, reading, input rules, output) against one `translate_ids` call on the same sentences'
    ids with the same beam, on the CPU, a tiny random model. ratio = CLI seconds / translate_ids seconds."""
    from annotated.checkpoint import save_checkpoint
    from annotated.decoding import translate as cli
    from annotated.training.data import train_tokenizer

    words = [
        "ein",
        "hund",
        "eine",
        "frau",
        "zwei",
        "männer",
        "rennt",
        "liest",
        "spielt",
        "über",
        "die",
        "wiese",
        "im",
        "park",
        "buch",
        "ball",
    ]
    pick = random.Random(st.seed)
    texts = [" ".join(pick.choice(words) for _ in range(pick.randint(3, 10))) + "." for _ in range(sentences)]
    with tempfile.TemporaryDirectory() as folder:
        tok = train_tokenizer(texts, 320, cache_dir=folder)
        torch.manual_seed(st.seed)
        model = transformer.make_model(
            src_vocab=tok.vocab_size, tgt_vocab=tok.vocab_size, N=2, d_model=32, d_ff=64, h=4, dropout=0.0, max_len=64
        ).eval()
        save_checkpoint(Path(folder) / "tiny.pt", model, tok)
        lines, ids = "".join(t + "\n" for t in texts).encode(), [tok.encode(t) for t in texts]
        argv = ["--checkpoint", str(Path(folder) / "tiny.pt"), "--beam", str(beam), "--device", "cpu"]
        fns = {
            "cli": lambda: cli.main(argv, stdin=io.BytesIO(lines), stdout=io.BytesIO(), stderr=io.StringIO()),
            "translate_ids": lambda: decoding.translate_ids(model, ids, beam),
        }
        times, _, errors = interleaved_times(
            fns, st.reps, st.window, lambda: None, lambda s: log(f"translator {s}"), st.timer()
        )
    cli_s, batched_s = median(times.get("cli", [])), median(times.get("translate_ids", []))
    return {
        "sentences": sentences,
        "beam": beam,
        "cli_s": cli_s,
        "translate_ids_s": batched_s,
        "ratio": cli_s / batched_s if cli_s and batched_s else None,
        **({"error": errors} if errors else {}),
    }
