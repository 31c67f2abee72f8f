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
#   through `W_OV`, the norms after the head and the generator, raises most
#   (`test_the_ov_dictionary_reads_the_write_through_the_norms_after_the_head`).
#
# Both are scored against an independent reference, the lexicon of a
# statistical aligner run on the same training pairs
# (`annotated/circuits/aligner.py`), by precision@1 and @5 over those of the
# lexicon's 500 most frequent source words that occur in the pairs read (the
# record's `coverage` says how many; `annotated/circuits/metrics.py`), with
# four controls beside the OV dictionary (section 2). And the head's
# attention itself, on test sentences, is an alignment: its alignment error
# rate against the aligner's links says how well "where the head looks" is
# "which word this translates" (Garg et al. 2019).
#
# A target word is tied to the decoder position that *predicts* its first
# piece (whose input is the previous token), as Garg et al. read alignments;
# a source word's input is the mean over its pieces
# (`test_a_words_mean_input_is_its_pieces_mean_at_the_row_that_predicts_it`).
# A target word needs `MIN_COUNT` occurrences for a mean query; from too few
# pairs none has one, and the QK dictionary is empty
# (`test_a_readout_from_too_few_pairs_to_read_a_qk_dictionary_still_works`).

# %%
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from annotated.circuits.aligner import Links, normalize_word
from annotated.circuits.circuits import Factored, HeadCircuit, attention_inputs
from annotated.circuits.direct import layer_norms_after, through, token_vectors
from annotated.circuits.metrics import attention_to_word_links, piece_words, precision_at_k
from annotated.recording import record_attention
from annotated.sites import Site
from annotated.tokens import BOS, PAD, SPECIAL_LABELS
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
    src_pieces: dict[str, list[int]] = field(default_factory=dict)  # a word's piece ids, as first seen

    def source(self, site: Site, words: Sequence[str]) -> Tensor:
        """Mean key inputs (n, d_model) of `words` (each must have occurred)."""
        index = {w: i for i, w in enumerate(self.src_words)}
        rows = torch.tensor([index[w] for w in words], dtype=torch.long)  # long even when empty
        return self.src_sum[site][rows] / torch.tensor(self.src_count, dtype=torch.float64)[rows, None]

    def frequent_targets(self, min_count: int = MIN_COUNT) -> list[str]:
        return [w for w, n in zip(self.tgt_words, self.tgt_count) if n >= min_count]

    def target(self, site: Site, words: Sequence[str]) -> Tensor:
        """Mean query inputs (n, d_model) of `words`."""
        index = {w: i for i, w in enumerate(self.tgt_words)}
        rows = torch.tensor([index[w] for w in words], dtype=torch.long)  # no word occurs MIN_COUNT times: none
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
            for w, text in enumerate(texts):
                if text and text not in means.src_pieces:
                    means.src_pieces[text] = [i for i, n in zip(ids, number) if n == w]
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


def _word_pieces(model: EncoderDecoder, pieces) -> tuple[list[int], Tensor]:
    """The word-starting pieces of the target vocabulary: their ids, and their generator rows (m, d_model)."""
    labels = pieces(list(range(model.generator.weight.size(0))))
    starts = [i for i, p in enumerate(labels) if p.startswith(WORD_START) and len(p) > 1]
    return starts, model.generator.weight.detach()[starts]


def spelled_words(model: EncoderDecoder, pieces) -> set[str]:
    """The words one word-starting piece spells: all an OV dictionary can propose."""
    labels = pieces(list(range(model.generator.weight.size(0))))
    return {normalize_word(labels[i][1:]) for i in _word_pieces(model, pieces)[0]}


@torch.no_grad()
def written_words(
    model: EncoderDecoder, site: Site, written: Tensor, words: Sequence[str], pieces, k: int = 5
) -> dict[str, list[str]]:
    """For each of `words`, the k words (word-starting pieces) whose logits its row of `written` (n, d_model),
    read through the norms after `site` and the generator, raises most."""
    labels = pieces(list(range(model.generator.weight.size(0))))
    starts, W_gen = _word_pieces(model, pieces)  # (m, d_model)
    best = (through(layer_norms_after(model, site), written.to(W_gen.dtype)) @ W_gen.T).topk(k, dim=-1).indices
    return {w: [normalize_word(labels[starts[i]][1:]) for i in best[j].tolist()] for j, w in enumerate(words)}


@torch.no_grad()
def ov_dictionary(
    model: EncoderDecoder, c: HeadCircuit, means: WordMeans, sources: Sequence[str], pieces, k: int = 5
) -> dict[str, list[str]]:
    """For each source word, the k words (word-starting pieces) whose logits its mean value raises most."""
    x_kv = means.source(c.site, sources).to(c.OV.left.dtype)  # (n, d_model)
    return written_words(model, c.site, c.OV.apply(x_kv), sources, pieces, k)  # x W_OV, through the generator


# %% [markdown]
# ### The OV dictionary's controls
#
# A precision means little alone: how much of it is the head's? Four
# readings of the same words, scored the same way, say (Elhage et al.'s
# "no head" and random baselines, and the two approximations of this part):
#
# * **no head**: the word's mean input at the keys read by the generator
#   directly (`W_OV` taken out: the identity): what the encoder's output
#   already says in the target vocabulary;
# * **random OV**: `W_OV` replaced by a product of two random matrices of
#   the shapes and Frobenius norms of `W_V[i]` and `W_O[i]` (rank `d_v`): the
#   precision any map of that rank and size would reach;
# * **weights only**: the bare embedding of the word's pieces through the
#   norms before the attention, `W_OV` and the generator: the direct path of
#   `direct.py`, no context and no encoder layer;
# * **whole path**: the word alone run through the whole encoder, then
#   `W_OV` and the generator: the encoder's layers, without a sentence
#   around the word.
#
# The in-context reading is the dictionary itself.


# %%
@torch.no_grad()
def random_ov(c: HeadCircuit, seed: int = 0) -> Factored:
    """Random factors with W_V's and W_O's shapes and Frobenius norms."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for m in (c.OV.left, c.OV.right):
        r = torch.randn(m.shape, generator=g, dtype=torch.float64).to(m.dtype)
        out.append(r * (m.norm() / r.norm()))
    return Factored(*out)


@torch.no_grad()
def whole_path_inputs(model: EncoderDecoder, means: WordMeans, words: Sequence[str]) -> Tensor:
    """Each word alone through the encoder: the mean of its pieces' outputs, (n, d_model)."""
    ids = [torch.tensor(means.src_pieces[w]) for w in words]
    src = torch.nn.utils.rnn.pad_sequence(ids, batch_first=True, padding_value=PAD)  # (n, L)
    memory = model.encode(src, padding_mask(src, PAD))  # (n, L, d_model)
    real = (src != PAD).unsqueeze(-1).to(memory.dtype)  # (n, L, 1)
    return (memory * real).sum(1) / real.sum(1)  # (n, d_model)


@torch.no_grad()
def ov_controls(
    model: EncoderDecoder, c: HeadCircuit, means: WordMeans, sources: Sequence[str], pieces, k: int = 5
) -> dict[str, dict[str, list[str]]]:
    """The OV dictionary and its four controls, each a dictionary as `ov_dictionary` returns."""
    dtype = c.OV.left.dtype
    x = means.source(c.site, sources).to(dtype)  # (n, d_model) in context
    direct = torch.stack(
        [token_vectors(model, c.site, "kv", torch.tensor(means.src_pieces[w])).mean(0) for w in sources]
    )  # (n, d_model): the bare embeddings through the norms before
    read = lambda written: written_words(model, c.site, written, sources, pieces, k)
    return {
        "in context": read(c.OV.apply(x)),
        "no head": read(x),
        "random OV": read(random_ov(c).apply(x)),
        "weights only": read(c.OV.apply(direct.to(dtype))),
        "whole path": read(c.OV.apply(whole_path_inputs(model, means, sources).to(dtype))),
    }


# %% [markdown]
# ## 3. The attention as an aligner
#
# Teacher-forced, the decoder reads `<s> y_1 .. y_n`: its row `p` is
# labelled with its input, so target word `y_p` is read from row `p - 1`,
# the row that predicts it (`attention_to_word_links`' default;
# `test_attention_links_read_each_target_word_from_the_row_that_predicts_it`).


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
            src_pieces, tgt_pieces = pieces(src_ids), [SPECIAL_LABELS[BOS], *pieces(y)]
            for site in sites:
                p = probs[site][0][b, :, : len(tgt_pieces), : len(src_ids)]  # (h, T, S)
                for head in range(p.size(0)):
                    links = attention_to_word_links(p[head].double().numpy(), src_pieces, tgt_pieces)
                    out.setdefault((site, head), []).append(links)
    return out


def dictionary_precision(
    dictionary: dict[str, list[str]], lexicon, top: int, words: Sequence[str] | None = None
) -> tuple[float, float]:
    """(precision@1, precision@5) of a dictionary against the aligner's lexicon over `words` (default: the
    lexicon's `top` first words)."""
    return precision_at_k(dictionary, lexicon, 1, top, words=words), precision_at_k(
        dictionary, lexicon, 5, top, words=words
    )
