"""Word alignments read from one cross-attention head: the translator's `--alignment`.

Part V (`annotated/circuits/`, `docs/circuits.md`) names the cross-attention head that aligns words best; this
module reads a given head, so that the translator, below circuits/, can use it: teacher-force the translation,
record the head's attention (`annotated/recording.py`), and link each subword `y_p` to the source subword most
attended by the row that predicted it, Part V's rule (`attention_to_word_links`, after Garg et al., 2019); words
start at `▁`. Pairs are written `i-j` (source word i, target word j, from 0), as eflomal writes them.

>>> word_numbers(["▁Ein", "▁Spiel", "haus", "▁", "東", "</s>"])
[0, 1, 1, None, 2, None]
>>> pharaoh({(1, 0), (0, 2), (1, 1)})
'1-0 1-1 0-2'
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from annotated.recording import record_attention
from annotated.tokens import BOS, EOS, SPECIAL_LABELS
from annotated.transformer import EncoderDecoder, subsequent_mask

SPECIALS = (*SPECIAL_LABELS.values(), "<unk>")  # pieces that belong to no word


def word_numbers(pieces: Sequence[str]) -> list[int | None]:
    """The word number of each sentencepiece piece: a piece starting with `▁` starts a word, a lone `▁` is
    none (the piece after it starts the word), specials (`<s>`, `</s>`, ...) None."""
    numbers: list[int | None] = []
    words, inside = -1, False  # inside: the last piece belongs to a word, which a piece without ▁ continues
    for piece in pieces:
        if piece in SPECIALS or piece == "▁":
            numbers.append(None)
            inside = False
            continue
        if piece.startswith("▁") or not inside:
            words += 1
            inside = True
        numbers.append(words)
    return numbers


def pharaoh(links) -> str:
    """Links (source word, target word) as `i-j` pairs, in target then source order."""
    return " ".join(f"{i}-{j}" for i, j in sorted(links, key=lambda link: (link[1], link[0])))


@torch.no_grad()
def head_attention(model: EncoderDecoder, src: list[int], ys: list[int], layer: int, head: int) -> torch.Tensor:
    """Cross-attention of decoder layer `layer`, head `head` when the decoder reads `bos y_1 ... y_(n-1)`, the
    inputs that predicted y_1 ... y_n (ys without eos), against the source `src`: (n, S), row p the input
    `bos` (p = 0) or y_p. (The row y_n would read predicts what follows the translation: not needed, and a
    translation cut at max_len has no position for it.) The translator checks the head exists (`_load`)."""
    device = next(model.parameters()).device
    x = torch.tensor([src], dtype=torch.long, device=device)  # (1, S)
    y = torch.tensor([[BOS, *ys[:-1]]], dtype=torch.long, device=device)  # (1, n)
    with record_attention(model) as probs:
        model(x, y, None, subsequent_mask(y.size(1)).to(device))
    return probs[("cross", layer)][0][0, head].double()  # (n, S)


def word_links(attention: torch.Tensor, src_pieces: Sequence[str], tgt_pieces: Sequence[str]) -> set[tuple[int, int]]:
    """(source word, target word) links from one head's attention (n, S) over the target subwords
    `tgt_pieces` (n, y_1 ... y_n) and the source subwords (S): y_p's link is row p - 1's most attended source
    subword.

    >>> p = torch.eye(3)[[2, 0, 1]]  # row 0 (bos) reads source 2, row 1 source 0, row 2 source 1
    >>> sorted(word_links(p, ["▁a", "▁b", "▁c"], ["▁x", "▁y", "z"]))
    [(0, 1), (1, 1), (2, 0)]
    """
    src_word, tgt_word = word_numbers(src_pieces), word_numbers(tgt_pieces)
    best = attention[: len(tgt_pieces)].argmax(dim=1).tolist()  # (n,) row p - 1 predicted y_p
    links = set()
    for p, j in enumerate(tgt_word):
        i = src_word[best[p]]
        if i is not None and j is not None:
            links.add((i, j))
    return links


def alignment(model: EncoderDecoder, tokenizer, src: list[int], ys: list[int], head: tuple[int, int]) -> set:
    """The word links of translation `ys` (ids, eos cut or not) of source `src` read from `head` (layer, head)."""
    ys = ys[: ys.index(EOS)] if EOS in ys else ys
    attention = head_attention(model, src, ys, *head)
    return word_links(attention, tokenizer.pieces(src), tokenizer.pieces(ys))
