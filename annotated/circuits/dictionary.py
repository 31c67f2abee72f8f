# %% [markdown]
# # The cross-attention as a dictionary and as an aligner
#
# A cross-attention head's QK circuit is a table between two vocabularies
# (the queries made while writing *dog* match the keys of *Hund*), its OV
# circuit a second one (what it writes reading *Hund*). Its keys are the
# encoder's last layer, so we read it **in context**: over training pairs,
# the mean input at the keys of each source word (over its pieces) and at the
# query that predicts each target word
# (`test_a_words_mean_input_is_its_pieces_mean_at_the_row_that_predicts_it`);
# queries, keys and values are affine, so one mean per word serves every
# head. The **QK dictionary** of source word `s`: the target words whose mean
# query gives `s` the most weight among the words scored (each needing
# `MIN_COUNT` occurrences:
# `test_a_readout_from_too_few_pairs_to_read_a_qk_dictionary_still_works`);
# the **OV dictionary**: the words whose logits `s`'s mean value, through
# `W_OV`, the norms after the head and the generator, raises most
# (`test_the_ov_dictionary_reads_the_write_through_the_norms_after_the_head`).
# Both are scored against the aligner's lexicon (`metrics.py`), with four
# controls (section 2), and the attention against the aligner's links.

# %%
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from annotated.circuits.aligner import Links, normalize_word
from annotated.circuits.circuits import Factored, HeadCircuit, attention_inputs, teacher_forced
from annotated.circuits.direct import layer_norms_after, through, token_vectors
from annotated.circuits.metrics import attention_to_word_links, piece_words, precision_at_k
from annotated.recording import record_attention
from annotated.sites import Site
from annotated.tokens import BOS, PAD, SPECIAL_LABELS
from annotated.transformer import EncoderDecoder, padding_mask

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
        return _means(self.src_sum[site], self.src_count, self.src_words, words)

    def frequent_targets(self, min_count: int = MIN_COUNT) -> list[str]:
        return [w for w, n in zip(self.tgt_words, self.tgt_count) if n >= min_count]

    def target(self, site: Site, words: Sequence[str]) -> Tensor:
        """Mean query inputs (n, d_model) of `words`."""
        return _means(self.tgt_sum[site], self.tgt_count, self.tgt_words, words)


def _means(sums: Tensor, counts: list[int], known: list[str], words: Sequence[str]) -> Tensor:
    index = {w: i for i, w in enumerate(known)}
    rows = torch.tensor([index[w] for w in words], dtype=torch.long)  # long even when no word is asked for
    return sums[rows] / torch.tensor(counts, dtype=torch.float64)[rows, None]  # (n, d_model)


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


def word_starts(pieces, vocab: int) -> tuple[list[int], list[str]]:
    """The word-starting pieces of a vocabulary of `vocab` ids: their ids, and the word each spells."""
    labels = pieces(list(range(vocab)))
    starts = [i for i, p in enumerate(labels) if p.startswith(WORD_START) and len(p) > 1]
    return starts, [normalize_word(labels[i][1:]) for i in starts]


@torch.no_grad()
def written_words(
    model: EncoderDecoder, site: Site, written: Tensor, words: Sequence[str], pieces, k: int = 5
) -> dict[str, list[str]]:
    """For each of `words`, the k words (word-starting pieces) whose logits its row of `written` (n, d_model),
    read through the norms after `site` and the generator, raises most."""
    starts, spelled = word_starts(pieces, model.generator.weight.size(0))
    W_gen = model.generator.weight.detach()[starts]  # (m, d_model)
    best = (through(layer_norms_after(model, site), written.to(W_gen.dtype)) @ W_gen.T).topk(k, dim=-1).indices
    return {w: [spelled[i] for i in best[j].tolist()] for j, w in enumerate(words)}


# %% [markdown]
# ### The OV dictionary's controls
#
# How much of the precision is the head's? Four readings of the same words,
# scored the same way: **no head** (the word's mean key input read by the
# generator directly: what the encoder's output already says), **random OV**
# (`W_OV` replaced by random factors of `W_V[i]`'s and `W_O[i]`'s shapes and
# norms), **weights only** (the bare embeddings of the word's pieces through
# the norms before the attention: `direct.py`'s direct path) and **whole
# path** (the word alone through the whole encoder).


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
    """The OV dictionary and its four controls, each {source word: the k words (word-starting pieces)
    whose logits its reading raises most}; "in context" is the OV dictionary."""
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
# Target word `y_p` is read from row `p - 1`, the row that predicts it
# (`test_attention_links_read_each_target_word_from_the_row_that_predicts_it`).


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
            teacher_forced(model, src, tgt_in, PAD)
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
