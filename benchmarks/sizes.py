# %% [markdown]
# # Sizes and batches (`make bench`)
#
# A size is a `TrainConfig` (model sizes, vocabulary, label smoothing and
# optimiser settings, exactly as training uses them) plus the number of
# sentences per batch on each kind of device. `cpu` and `gpu` are the training
# presets; `base` is the paper's base model (N=6, d_model=512, d_ff=2048,
# h=8, dropout 0.1) with its shared 37000-token vocabulary. Batches on the
# GPU, and for the cpu preset also on the CPU, hold about the preset's
# `max_tokens` tokens (the gpu preset's for base); on this project's 2-core
# CPU the larger models get small batches, so that the whole `make bench`
# stays within about ten minutes (the ratios are per step, and the batch is
# the same for every implementation in a row).
# Decoding batches hold 64 sentences, as `decoding.translate_ids` uses, except
# for the larger models on the CPU (32).
#
# **Sentences like Multi30k's.** test_2016_flickr, cut into subwords by a
# joint 8000-piece sentencepiece model trained on Multi30k's training text,
# has sentences of 15.0 (de) and 14.6 (en) subwords on average, standard
# deviation 5.7 and 5.0, from 5 to 43. We draw source lengths from a normal
# distribution with mean 15 and standard deviation 5.5, clipped to [5, 43],
# and target lengths as the source length plus a normal error of standard
# deviation 2, with random token ids (speed does not depend on which ids).
# Training batches are built as the length-bucketed batcher builds them:
# sort a large sample by length and take consecutive sentences, here the
# buckets around the median, so a batch has little padding. All batches of a
# size are padded to one common shape, so `torch.compile` compiles once.

# %%
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from annotated.tokens import BOS, EOS, PAD
from annotated.training.config import PRESETS, TrainConfig, config_dict, config_from_dict, joint_model
from annotated.transformer import TransformerConfig


@dataclass(frozen=True)
class Size:
    name: str
    train: TrainConfig
    train_sentences: dict  # device type ("cpu", "cuda") -> sentences per training batch
    decode_sentences: dict  # device type -> sentences per decoding batch

    def model_config(self) -> TransformerConfig:
        return self.train.model

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "train": config_dict(self.train),
            "train_sentences": self.train_sentences,
            "decode_sentences": self.decode_sentences,
        }

    @staticmethod
    def from_json(d: dict) -> Size:
        return Size(d["name"], config_from_dict(d["train"]), d["train_sentences"], d["decode_sentences"])


BASE = TrainConfig(
    model=joint_model(37000, N=6, d_model=512, d_ff=2048, h=8, dropout=0.1, max_len=256),
    warmup=4000,
    max_tokens=PRESETS["gpu"].max_tokens,
)


def _sentences_for(cfg: TrainConfig) -> int:
    """Sentences holding about `max_tokens` padded tokens; a median bucket pads targets to about 20."""
    return max(1, cfg.max_tokens // 20)


SIZES = {
    "cpu": Size(
        "cpu",
        PRESETS["cpu"],
        {"cpu": _sentences_for(PRESETS["cpu"]), "cuda": _sentences_for(PRESETS["cpu"])},
        {"cpu": 64, "cuda": 64},
    ),
    "gpu": Size("gpu", PRESETS["gpu"], {"cpu": 24, "cuda": _sentences_for(PRESETS["gpu"])}, {"cpu": 32, "cuda": 64}),
    "base": Size("base", BASE, {"cpu": 16, "cuda": _sentences_for(BASE)}, {"cpu": 32, "cuda": 64}),
}


def sample_lengths(n: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """Source and target lengths (n,) like Multi30k's in subwords (see above)."""
    src = (15.0 + 5.5 * torch.randn(n, generator=gen)).round().clamp(5, 43).long()  # (n,)
    tgt = (src + 2.0 * torch.randn(n, generator=gen)).round().clamp(5, 43).long()  # (n,)
    return src, tgt


def make_batches(n_batches: int, sentences: int, vocab: int, seed: int) -> list[tuple[Tensor, Tensor]]:
    """`n_batches` (src (B, S), tgt (B, T)) pairs from the median length buckets, one common shape.

    tgt is `bos y_1 ... y_n eos pad...`, as training feeds it.
    """
    if n_batches < 1 or sentences < 1 or vocab < 5:
        raise ValueError(f"need n_batches >= 1, sentences >= 1 and vocab >= 5, got {n_batches}, {sentences}, {vocab}")
    gen = torch.Generator().manual_seed(seed)
    pool = 20 * n_batches * sentences
    src_len, tgt_len = sample_lengths(pool, gen)  # (pool,)
    order = torch.argsort(src_len * 100 + tgt_len, stable=True)  # by length, as the batcher sorts
    start = (pool - n_batches * sentences) // 2  # the buckets around the median
    chosen = order[start : start + n_batches * sentences].view(n_batches, sentences)  # (n_batches, B)
    S, T = int(src_len[chosen].max()), int(tgt_len[chosen].max()) + 2  # + bos, eos
    batches = []
    for rows in chosen:
        s_len, t_len = src_len[rows], tgt_len[rows]  # (B,)
        src = torch.randint(4, vocab, (sentences, S), generator=gen)  # (B, S) ids above pad/bos/eos/unk
        src = src.masked_fill(torch.arange(S) >= s_len[:, None], PAD)  # (B, S)
        body = torch.randint(4, vocab, (sentences, T - 1), generator=gen)  # (B, T-1)
        pos = torch.arange(T - 1)  # (T-1,)
        body = body.masked_fill(pos == t_len[:, None], EOS).masked_fill(pos > t_len[:, None], PAD)  # (B, T-1)
        tgt = torch.cat([torch.full((sentences, 1), BOS), body], dim=1)  # (B, T)
        batches.append((src, tgt))
    return batches


def real_lengths(batches) -> tuple[list[int], list[int], int]:
    """(source lengths, decoder-input lengths, predicted tokens) over all batches, padding excluded."""
    src_l, tgt_l = [], []
    for src, tgt in batches:
        src_l += (src != PAD).sum(dim=1).tolist()
        tgt_l += (tgt[:, 1:] != PAD).sum(dim=1).tolist()  # decoder input bos y_1..y_n = predictions y_1..eos
    return src_l, tgt_l, sum(tgt_l)
