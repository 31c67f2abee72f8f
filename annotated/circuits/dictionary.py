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
# # The cross-attention as a dictionary and as an aligner
#
# A cross-attention head's queries come from the target sentence and its
# keys from the source, so its QK circuit is a table between two
# vocabularies: if the queries made while writing *dog* match the keys of
# *Hund*, the head has learned an entry of a dictionary. Its OV circuit is
# a second one: what it writes when it reads *Hund*.
#
# Read through the bare embeddings (`annotated/circuits/direct.py`) the
# cross-attention is only an approximation, since its keys are the encoder's
# last layer. So here we read it **in context**: over training pairs, the
# mean input at the keys of each source word and at the query that predicts
# each target word, both as the model computes them. Because queries, keys
# and values are affine in their inputs, the mean key of a word is the key
# of its mean input, and one `d_model` vector per word and layer holds all
# heads' readings.
#
# * **the QK dictionary** of a head: for a source word `s`, the target
#   words whose mean query gives `s` the highest attention weight when the
#   keys are the mean keys of the 500 source words scored (the softmax over
#   them, as the head computes it: a query with large scores for every key
#   does not win every column);
# * **the OV dictionary**: the words whose logits `s`'s mean value, written
#   through `W_OV`, the norms after the head and the generator, raises most.
#
# Both are scored against an independent reference, the lexicon of a
# statistical aligner run on the same training pairs
# (`annotated/circuits/aligner.py`), by precision@1 and @5 over the 500 most
# frequent source words (`annotated/circuits/metrics.py`). And the head's
# attention itself, on test sentences, is an alignment: its alignment error
# rate against the aligner's links says how well "where the head looks" is
# "which word this translates" (Garg et al. 2019).
#
# A target word is tied to the decoder position that *predicts* its first
# piece (whose input is the previous token), as Garg et al. read alignments;
# a source word's input is the mean over its pieces.

# %%
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from annotated.circuits.aligner import Links, normalize_word
from annotated.circuits.circuits import HeadCircuit, attention_inputs
from annotated.circuits.direct import layer_norms_after, through
from annotated.circuits.metrics import attention_to_word_links, piece_words, precision_at_k
from annotated.recording import record_attention
from annotated.sites import Site
from annotated.tokens import BOS, PAD
from annotated.transformer import EncoderDecoder, padding_mask, target_mask

MIN_COUNT = 5  # a target word's mean query needs this many occurrences: fewer is one context, not a reading
WORD_START = "\u2581"  # sentencepiece's mark of a piece that starts a word

# %% [markdown]
# ## 1. Mean inputs per word, in context


# %%
@dataclass
class WordMeans:
    """Per cross-attention site: the mean key input of each source word, the mean query input of each target word."""

    src_words: list[str] = field(default_factory=list)
    tgt_words: list[str] = field(default_factory=list)
    src_sum: dict[Site, Tensor] = field(default_factory=dict)  # (n_src, d_model)
    tgt_sum: dict[Site, Tensor] = field(default_factory=dict)  # (n_tgt, d_model)
    src_count: list[int] = field(default_factory=list)
    tgt_count: list[int] = field(default_factory=list)

    def source(self, site: Site, words: Sequence[str]) -> Tensor:
        """Mean key inputs (n, d_model) of `words` (each must have occurred)."""
        index = {w: i for i, w in enumerate(self.src_words)}
        rows = torch.tensor([index[w] for w in words])
        return self.src_sum[site][rows] / torch.tensor(self.src_count, dtype=torch.float64)[rows, None]

    def frequent_targets(self, min_count: int = MIN_COUNT) -> list[str]:
        return [w for w, n in zip(self.tgt_words, self.tgt_count) if n >= min_count]

    def target(self, site: Site, words: Sequence[str]) -> Tensor:
        """Mean query inputs (n, d_model) of `words`."""
        index = {w: i for i, w in enumerate(self.tgt_words)}
        rows = torch.tensor([index[w] for w in words])
        return self.tgt_sum[site][rows] / torch.tensor(self.tgt_count, dtype=torch.float64)[rows, None]


def _number(words: list[str], counts: list[int], table: dict[str, int], text: str) -> int:
    if text not in table:
        table[text] = len(words)
        words.append(text)
        counts.append(0)
    counts[table[text]] += 1
    return table[text]


@torch.no_grad()
def mean_inputs(
    model: EncoderDecoder, pieces, batches: Iterable[tuple[Tensor, Tensor]], sites: Sequence[Site]
) -> WordMeans:
    """Accumulate WordMeans over (src (B, S), tgt (B, T): BOS + target + EOS) batches; `pieces(ids)` labels ids."""
    means = WordMeans()
    src_table: dict[str, int] = {}
    tgt_table: dict[str, int] = {}
    for src, tgt in batches:
        inputs = attention_inputs(model, src, tgt[:, :-1], PAD)
        src_rows: list[int] = []  # (b * S + s) of every source piece that belongs to a word
        src_word: list[int] = []
        src_weight: list[float] = []
        tgt_rows: list[int] = []
        tgt_word: list[int] = []
        T_in = tgt.size(1) - 1
        for b in range(src.size(0)):
            ids = [i for i in src[b].tolist() if i != PAD]
            number, texts = piece_words(pieces(ids))
            occ = [_number(means.src_words, means.src_count, src_table, t) if t else -1 for t in texts]
            sizes = [number.count(k) for k in range(len(texts))]
            for s, k in enumerate(number):
                if k is not None and occ[k] >= 0:
                    src_rows.append(b * src.size(1) + s)
                    src_word.append(occ[k])
                    src_weight.append(1.0 / sizes[k])  # the word's input: the mean over its pieces
            out = [i for i in tgt[b, 1:].tolist() if i not in (PAD, BOS)]  # y_1 .. y_n, EOS
            number, texts = piece_words(pieces(out))
            first = {}
            for p, k in enumerate(number):
                if k is not None and k not in first and texts[k]:
                    first[k] = p  # decoder row p (input y_p, or BOS for p = 0) predicts piece p of `out`
            for k, p in first.items():
                tgt_rows.append(b * T_in + p)
                tgt_word.append(_number(means.tgt_words, means.tgt_count, tgt_table, texts[k]))
        for site in sites:
            x_q, x_kv = inputs[site]
            d = x_kv.size(-1)
            s_sum = means.src_sum.setdefault(site, torch.zeros(0, d, dtype=torch.float64))
            t_sum = means.tgt_sum.setdefault(site, torch.zeros(0, d, dtype=torch.float64))
            s_sum = torch.cat([s_sum, s_sum.new_zeros(len(means.src_words) - s_sum.size(0), d)])
            t_sum = torch.cat([t_sum, t_sum.new_zeros(len(means.tgt_words) - t_sum.size(0), d)])
            weight = torch.tensor(src_weight, dtype=torch.float64).unsqueeze(1)
            s_sum.index_add_(0, torch.tensor(src_word), x_kv.reshape(-1, d)[src_rows].double() * weight)
            t_sum.index_add_(0, torch.tensor(tgt_word), x_q.reshape(-1, d)[tgt_rows].double())
            means.src_sum[site], means.tgt_sum[site] = s_sum, t_sum
    return means


# %% [markdown]
# ## 2. A head's two dictionaries


# %%
@torch.no_grad()
def qk_dictionary(c: HeadCircuit, means: WordMeans, sources: Sequence[str], k: int = 5) -> dict[str, list[str]]:
    """For each source word, the k target words whose mean queries give its mean key the most weight."""
    targets = means.frequent_targets()
    x_q = means.target(c.site, targets).to(c.QK.left.dtype)  # (m, d_model)
    x_kv = means.source(c.site, sources).to(c.QK.left.dtype)  # (n, d_model)
    s = c.matching(x_q, x_kv).log_softmax(-1)  # (m, n) log p(source word | the query of target word)
    best = s.topk(min(k, len(targets)), dim=0).indices  # (k, n): for each source word, the queries that pick it
    return {w: [targets[i] for i in best[:, j].tolist()] for j, w in enumerate(sources)}


@torch.no_grad()
def ov_dictionary(
    model: EncoderDecoder, c: HeadCircuit, means: WordMeans, sources: Sequence[str], pieces, k: int = 5
) -> dict[str, list[str]]:
    """For each source word, the k words (word-starting pieces) whose logits its mean value raises most."""
    vocab = model.generator.weight.size(0)
    labels = pieces(list(range(vocab)))
    starts = [i for i, p in enumerate(labels) if p.startswith(WORD_START) and len(p) > 1]
    W_gen = model.generator.weight.detach()[starts]  # (m, d_model)
    x_kv = means.source(c.site, sources).to(W_gen.dtype)  # (n, d_model)
    written = through(layer_norms_after(model, c.site), c.OV.apply(x_kv))  # (n, d_model)
    best = (written @ W_gen.T).topk(k, dim=-1).indices  # (n, k)
    return {w: [normalize_word(labels[starts[i]][1:]) for i in best[j].tolist()] for j, w in enumerate(sources)}


# %% [markdown]
# ## 3. The attention as an aligner


# %%
@torch.no_grad()
def attention_links(
    model: EncoderDecoder, pieces, batches: Iterable[tuple[Tensor, Tensor]], sites: Sequence[Site]
) -> dict[tuple[Site, int], list[Links]]:
    """Word links of every cross head's attention, one set per sentence in batch order (teacher forcing)."""
    out: dict[tuple[Site, int], list[Links]] = {}
    for src, tgt in batches:
        tgt_in = tgt[:, :-1]
        with record_attention(model) as probs:
            model(src, tgt_in, padding_mask(src, PAD), target_mask(tgt_in, PAD))
        for b in range(src.size(0)):
            src_ids = [i for i in src[b].tolist() if i != PAD]
            y = [i for i in tgt[b, 1:].tolist() if i != PAD][:-1]  # y_1 .. y_n (EOS dropped)
            src_pieces, tgt_pieces = pieces(src_ids), ["<s>", *pieces(y)]
            for site in sites:
                p = probs[site][0][b, :, : len(tgt_pieces), : len(src_ids)]  # (h, T, S)
                for head in range(p.size(0)):
                    links = attention_to_word_links(p[head].double().numpy(), src_pieces, tgt_pieces)
                    out.setdefault((site, head), []).append(links)
    return out


def dictionary_precision(dictionary: dict[str, list[str]], lexicon, top: int) -> tuple[float, float]:
    """(precision@1, precision@5) of a dictionary against the aligner's lexicon over its `top` first words."""
    return precision_at_k(dictionary, lexicon, 1, top), precision_at_k(dictionary, lexicon, 5, top)
