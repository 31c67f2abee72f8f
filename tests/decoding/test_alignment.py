"""annotated/decoding/alignment.py: word alignments read from one cross-attention head.

A planted model (after tests/circuits/planted.py): every weight zero but a cross head whose QK circuit makes
the decoder input token c_k read source word k, so a known permutation of the source is what the head aligns.
"""

import pytest
import torch
from tiny import blank_model

from annotated.decoding.alignment import alignment, head_attention, pharaoh
from annotated.tokens import BOS

V, A, C, D = 40, 10, 20, 32  # vocabulary; source tokens A..A+4; target tokens C..C+4; d_model
PERM = [3, 0, 4, 1, 2]
R = 20.0  # query size: scores of R / sqrt(d_k) ~ 9 for the planted pairs, about 0 for the others


class Pieces:
    """A tokenizer's `pieces`: every token one word."""

    @staticmethod
    def pieces(ids):
        return [f"\u2581t{i}" for i in ids]


def planted(head: int = 1):
    """Decoder layer 0, cross head `head`: input token C + k (and bos, as C + PERM[0]) reads source A + k."""
    m = blank_model(V, d_model=D, d_ff=8, h=2, d_k=5, d_v=5, attention="per_head")
    e = torch.eye(D, dtype=torch.float64)
    with torch.no_grad():
        for k in range(5):
            m.src_embed.weight[A + k] = e[k] / D**0.5  # the embedding scales by sqrt(d_model): e_k
            m.tgt_embed.weight[C + k] = R * e[5 + k] / D**0.5
        m.tgt_embed.weight[BOS] = R * e[5 + PERM[0]] / D**0.5
        cross = m.decoder.layers[0].cross_attn
        for i in range(5):
            cross.W_Q[head][:, i] = e[5 + i]  # the query of an input selecting word i ...
            cross.W_K[head][:, i] = e[i]  # ... meets source word i's key
    return m


@pytest.mark.parametrize("head", [0, 1])
def test_the_planted_head_aligns_the_known_permutation_and_its_neighbour_does_not(head):
    """Target word j is predicted from the row of y_(j-1) (bos for j = 0), which reads source word PERM[j]:
    the links are exactly (PERM[j], j). The other head attends uniformly: its argmax is source word 0."""
    m = planted(head)
    src = [A + k for k in range(5)]
    ys = [C + PERM[j] for j in range(1, 5)] + [C]  # y_(j) reads PERM[j] for the next word
    links = alignment(m, Pieces, src, ys, (0, head))
    assert links == {(PERM[j], j) for j in range(5)}
    assert pharaoh(links) == " ".join(f"{PERM[j]}-{j}" for j in range(5))
    other = alignment(m, Pieces, src, ys, (0, 1 - head))
    assert other == {(0, j) for j in range(5)}
    p = head_attention(m, src, ys, 0, head)  # (5, 5) rows: bos, y_1 .. y_4
    assert p.shape == (5, 5) and torch.allclose(p.sum(dim=1), torch.ones(5, dtype=torch.float64))


def test_a_word_of_several_subwords_takes_the_union_of_their_links():
    class Split(Pieces):
        @staticmethod
        def pieces(ids):  # target words: y_1 y_2 | y_3 | y_4 y_5 (pieces without ▁ continue a word)
            return [f"\u2581t{i}" if n in (0, 2, 3) or i < C else f"t{i}" for n, i in enumerate(ids)]

    m = planted(1)
    src = [A + k for k in range(5)]
    ys = [C + PERM[j] for j in range(1, 5)] + [C]
    links = alignment(m, Split, src, ys, (0, 1))
    assert links == {(PERM[0], 0), (PERM[1], 0), (PERM[2], 1), (PERM[3], 2), (PERM[4], 2)}
