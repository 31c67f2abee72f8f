"""A one-layer translator built by hand, whose cross-attention head 0 is a known dictionary.

Every weight is zero but these (float64, no positions, LayerNorms with gain 1 and bias 0):

* source token a_j = A + j (j < 5) embeds as e_j, so the encoder's output at it is LayerNorm(e_j);
* cross head 0 maps the source word it reads to target token b_j = B + PERM[j]: W_V[0] column i reads e_i,
  W_O[0] row i writes f_i = e_(10+i) - e_(15+i) (mean zero, so the LayerNorms' centring keeps it), and the
  generator's row b_i is f_i. Its QK circuit is a second, separate table: W_Q[0] column i reads e_(5+i)
  (where the target words' mean queries of `planted_means` lie), W_K[0] column i reads e_i;
* cross head 1 reads the same source word and writes a small vector in directions 25..29, which no
  generator row reads (it moves only the LayerNorm's divisor, a little).

The decoder's own inputs are zero, so the model's output depends on the source word only through the
cross heads, and with head 0 it puts b_j first for source a_j.
"""

from __future__ import annotations

import torch
from tiny import blank_model

from annotated.circuits.dictionary import MIN_COUNT, WordMeans, written_words
from annotated.tokens import BOS

V = 40  # vocabulary, shared by the two sides
A = 10  # source tokens A .. A + 4
B = 20  # target tokens B .. B + 4
PERM = [3, 0, 4, 1, 2]  # a_j -> b_(PERM[j])
D = 32  # d_model
R = 20.0  # size of a target word's mean query input: QK scores of R / sqrt(d_k) ~ 9 for the planted pairs
LOUD = 1.5  # the "loud" target word's query scores LOUD times a planted pair's on every source word


def label(i: int) -> str:
    if A <= i < A + 5:
        return f"\u2581src{i - A}"
    if B <= i < B + 5:
        return f"\u2581tgt{i - B}"
    return f"\u2581x{i}"


def pieces(ids) -> list[str]:
    return [label(int(i)) for i in ids]


def lexicon() -> dict[str, list[tuple[str, float]]]:
    """The planted dictionary as an aligner's lexicon: src j -> tgt PERM[j]."""
    return {f"src{j}": [(f"tgt{PERM[j]}", 1.0)] for j in range(5)}


def planted_model():
    model = blank_model(V, d_model=D, d_ff=8, h=2, d_k=5, d_v=5, attention="per_head")
    e = torch.eye(D, dtype=torch.float64)
    f = [e[10 + i] - e[15 + i] for i in range(5)]
    with torch.no_grad():
        for j in range(5):
            model.src_embed.weight[A + j] = e[j] / D**0.5  # the embedding scales by sqrt(d_model): e_j
            model.generator.weight[B + PERM[j]] = f[PERM[j]]
        cross = model.decoder.layers[0].cross_attn
        for i in range(5):
            cross.W_V[0][:, i] = e[i]  # reads source word i
            cross.W_O[0][i] = f[PERM[i]]  # writes its translation's direction
            cross.W_Q[0][:, i] = e[5 + i]  # the QK table: the query of target word PERM[i] ...
            cross.W_K[0][:, i] = e[i]  # ... picks source word i
            cross.W_V[1][:, i] = e[i]
            cross.W_O[1][i] = 0.5 * (e[25 + i] - e[26 + i]) if i < 4 else 0.0  # read by no generator row
    return model


def planted_batch():
    """Five one-word sentences a_j, each with the target b_(PERM[j]) three times: (src (5, 1), tgt (5, 4))."""
    src = torch.tensor([[A + j] for j in range(5)])
    tgt = torch.tensor([[BOS] + [B + PERM[j]] * 3 for j in range(5)])
    return src, tgt


def planted_means(loud: bool = True) -> WordMeans:
    """Mean inputs as `dictionary.mean_inputs` keeps them: source word j's key input e_j; target word
    tgt PERM[j]'s query input R e_(5+j); and a "loud" target word whose query scores every source word
    LOUD times higher than its own target word does."""
    e = torch.eye(D, dtype=torch.float64)
    site = ("cross", 0)
    means = WordMeans()
    means.src_words = [f"src{j}" for j in range(5)]
    means.src_sum[site] = torch.stack([e[j] for j in range(5)])
    means.src_count = [1] * 5
    means.src_pieces = {f"src{j}": [A + j] for j in range(5)}  # one piece each
    means.tgt_words = [f"tgt{PERM[j]}" for j in range(5)]
    queries = [R * e[5 + j] for j in range(5)]
    if loud:
        means.tgt_words.append("loud")
        queries.append(LOUD * R * sum(e[5 + j] for j in range(5)))
    means.tgt_count = [MIN_COUNT] * len(means.tgt_words)
    means.tgt_sum[site] = MIN_COUNT * torch.stack(queries)
    return means


@torch.no_grad()
def ov_dictionary(model, c, means, sources, pieces, k: int = 5) -> dict[str, list[str]]:
    """For each source word, the k words (word-starting pieces) whose logits its mean value raises most: the
    readout's OV dictionary in context (`ov_controls`' "in context"), without the controls."""
    x_kv = means.source(c.site, sources).to(c.OV.left.dtype)  # (n, d_model)
    return written_words(model, c.site, c.OV.apply(x_kv), sources, pieces, k)  # x W_OV, through the generator
