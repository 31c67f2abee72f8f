# %% [markdown]
# # The whole readout of one model
#
# `read_model` runs every reading of this part and returns one JSON-ready
# record per head, which `make circuits` writes as `circuits.json` and draws.
# Tables over the vocabulary range over the pieces that occur in each side's
# training text (`frequent_pieces`), in chunks with their best entries kept
# (`test_the_readout_ranges_over_the_frequent_pieces_and_scores_the_lexicons_first_words`).

# %%
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from annotated.circuits.circuits import HeadCircuit, circuits
from annotated.circuits.composition import composition_record, compositions
from annotated.circuits.dictionary import (
    attention_links,
    dictionary_precision,
    mean_inputs,
    ov_controls,
    qk_dictionary,
    word_starts,
)
from annotated.circuits.direct import (
    SIDES,
    best_pairs,
    copying_score,
    exact,
    ov_table,
    positional_table,
    preferred_offsets,
    token_vectors,
    top_table,
)
from annotated.circuits.faithfulness import faithfulness
from annotated.circuits.metrics import aer, unmatchable
from annotated.circuits.score_terms import aligned_shares, read_scores, reading_records
from annotated.plumbing.progress import tracked
from annotated.sites import Site
from annotated.tokens import PAD
from annotated.transformer import EncoderDecoder

VOCAB = 2000  # the most frequent pieces of each side that the vocabulary tables range over
POSITIONS = 24  # positions of the position table
SHOWN = 12  # the best token pairs kept per head
ROWS = 200  # tokens whose best matches and writes are kept per head (the viewer's choice of tokens)
VIEWED = 8  # entries kept per token
SHOWN_WORDS = 100  # source words whose dictionary entries are kept in the record
OFFSET_SHARE = 0.5  # a head is "positional" when at least half its queries prefer one offset (or one key)


@dataclass(frozen=True)
class Inputs:
    """What the readout reads besides the model: labelled pieces, batches of three splits, the aligner's output."""

    pieces: Callable[[Sequence[int]], list[str]]  # ids -> sentencepiece labels
    src_counts: Counter  # piece id -> occurrences in the training sources
    tgt_counts: Counter
    val_batches: list[tuple[Tensor, Tensor]]  # (src, BOS + tgt + EOS) for faithfulness
    train_batches: list[tuple[Tensor, Tensor]]  # for the words' mean inputs
    test_batches: list[tuple[Tensor, Tensor]]  # for the alignment error rate
    lexicon: dict[str, list[tuple[str, float]]] | None  # the aligner's, source word -> [(target word, p)]
    test_links: list[set[tuple[int, int]]] | None  # the aligner's links of the test pairs, in batch order
    top: int = 500  # source words a dictionary is scored on


def frequent_pieces(counts: Counter, n: int = VOCAB) -> Tensor:
    """The n most frequent piece ids, most frequent first (ties by id, so the order is fixed)."""
    return torch.tensor([i for i, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:n]])


def position_label(offsets: Tensor, first: int = 0, share: float = OFFSET_SHARE) -> str:
    """What the position table prefers, from each query's best offset (queries `first`, `first` + 1, ...):
    'previous' / 'self' / 'next' / 'offset +k' when `share` of the queries prefer one offset, 'position k' when
    they prefer one absolute key position, else 'mixed'.

    >>> position_label(torch.tensor([0, -1, -1, -1])), position_label(torch.tensor([0, -1, -2, -3]))
    ('previous', 'position 0')
    >>> position_label(torch.tensor([0, 2, -1, 1]))
    'mixed'
    """
    keys = offsets + torch.arange(first, first + len(offsets))
    value, count = Counter(offsets.tolist()).most_common(1)[0]
    key, key_count = Counter(keys.tolist()).most_common(1)[0]
    if count >= share * len(offsets) and count >= key_count:
        return {-1: "previous", 0: "self", 1: "next"}.get(value, f"offset {value:+d}")
    if key_count >= share * len(offsets):
        return f"position {key}"
    return "mixed"


def _ids(inputs: Inputs, site: Site, side: str) -> Tensor:
    language = SIDES[site[0]][0 if side == "q" else 1]
    return frequent_pieces(inputs.src_counts if language == "src" else inputs.tgt_counts)


def weights_record(model: EncoderDecoder, c: HeadCircuit) -> dict[str, Any]:
    """What the weights and the positions alone say of a head: its spectra and its position table."""
    table = positional_table(model, c, POSITIONS)
    first = 1 if c.site[0] == "dec_self" else 0  # the decoder's first query has no choice
    offsets = preferred_offsets(table)[first:]
    return {
        "site": list(c.site),
        "head": c.head,
        "exact_direct_path": exact(model, c.site),
        **{
            name: {"rank": f.rank(), "inner": f.inner, "singular_values": f.singular_values().tolist()}
            for name, f in (("qk", c.QK), ("ov", c.OV))
        },
        "key_bias_norm": None if c.key_bias is None else float(c.key_bias.norm()),
        "positions": {"table": table.tolist(), "offsets": offsets.tolist(), "label": position_label(offsets, first)},
    }


def _head_record(model: EncoderDecoder, c: HeadCircuit, inputs: Inputs) -> dict[str, Any]:
    q_ids, kv_ids = _ids(inputs, c.site, "q"), _ids(inputs, c.site, "kv")
    x_q, x_kv = token_vectors(model, c.site, "q", q_ids), token_vectors(model, c.site, "kv", kv_ids)
    label = lambda i: inputs.pieces([int(i)])[0]
    top = top_table(c, x_q, x_kv, k=VIEWED)
    out_ids = frequent_pieces(inputs.tgt_counts)
    ov = ov_table(model, c, x_kv[:ROWS], out_ids, k=VIEWED)
    same = token_vectors(model, c.site, "kv", out_ids)  # the output tokens read as keys: a square table
    return {
        **weights_record(model, c),
        "token_pairs": [[label(q_ids[r]), label(kv_ids[k]), v] for r, k, v in best_pairs(top, SHOWN)],
        "qk_rows": [  # the most frequent query tokens: the keys each matches best, with centred scores
            [label(q_ids[r]), [[label(kv_ids[k]), float(v)] for k, v in zip(top.ids[r], top.values[r])]]
            for r in range(min(ROWS, top.ids.size(0)))
        ],
        "ov_rows": [  # the most frequent key tokens: the output tokens whose logits reading it raises most
            [label(kv_ids[j]), [[label(i), float(v)] for i, v in zip(ov.ids[j].tolist(), ov.values[j])]]
            for j in range(ov.ids.size(0))
        ],
        "copying_score": copying_score(model, c, same, out_ids),
        # the share of the ROWS tokens read whose top write is that very token: copying, taken literally
        "reads_itself": float((ov.ids[:, 0] == kv_ids[: ov.ids.size(0)]).double().mean()),
    }


def read_model(model: EncoderDecoder, inputs: Inputs) -> dict[str, Any]:
    """Every reading of every head of `model` (eval mode), as a JSON-ready dict; progress bars on stderr."""
    model = model.eval()
    heads = circuits(model)
    bar = lambda batches, what: tracked(batches, len(batches), what, unit="batch", enabled=bool(batches))
    records = {
        (c.site, c.head): _head_record(model, c, inputs)
        for c in tracked([c for cs in heads.values() for c in cs], sum(map(len, heads.values())), "circuits", "head")
    }
    val = [(s, t[:, :-1]) for s, t in inputs.val_batches]
    for key, readings in faithfulness(model, bar(val, "faithfulness"), PAD).items():
        for reading, f in readings.items():  # "faithfulness" (weights only), "faithfulness_exact_norms"
            records[key]["faithfulness" if reading == "weights_only" else f"faithfulness_{reading}"] = {
                "rho": [f.rho.value, f.rho.low, f.rho.high],
                "argmax": [f.argmax.value, f.argmax.low, f.argmax.high],
            }
    cross = [s for s in heads if s[0] == "cross"]
    if inputs.lexicon is not None:
        means = mean_inputs(model, inputs.pieces, bar(inputs.train_batches, "dictionaries"), cross)
        top_words = list(inputs.lexicon)[: inputs.top]
        sources = [w for w in top_words if w in set(means.src_words)]  # only words that occur are scored
        spelled = set(word_starts(inputs.pieces, model.generator.weight.size(0))[1])  # all an OV dictionary proposes
        missing = unmatchable(inputs.lexicon, sources, spelled)
        score = lambda d: list(dictionary_precision(d, inputs.lexicon, inputs.top, sources))
        for site in cross:
            for c in heads[site]:
                qk = qk_dictionary(c, means, sources)
                controls = ov_controls(model, c, means, sources, inputs.pieces)
                ov = controls.pop("in context")
                records[(site, c.head)]["dictionary"] = {
                    "words": len(sources),
                    "coverage": [len(sources), len(top_words)],  # of the lexicon's `top` words, those that occur
                    "ov_unmatchable": [len(missing), missing],  # no accepted translation is one word-initial piece
                    "qk_precision": score(qk),
                    "ov_precision": score(ov),
                    "ov_controls": {name: score(d) for name, d in controls.items()},
                    "qk": {w: qk[w] for w in sources[:SHOWN_WORDS]},
                    "ov": {w: ov[w] for w in sources[:SHOWN_WORDS]},
                }
    if inputs.test_links is not None:
        links = attention_links(model, inputs.pieces, bar(inputs.test_batches, "alignments"), cross)
        for key, predicted in links.items():
            records[key]["aer"] = aer(predicted, inputs.test_links)
    scored = read_scores(model, bar(val, "score terms"), PAD)
    aligned = None
    if inputs.test_links is not None:
        aligned = aligned_shares(
            model, inputs.pieces, bar(inputs.test_batches, "aligned words"), inputs.test_links, PAD
        )
    for key, measured in reading_records(scored, aligned).items():
        records[key].update(measured)
    return {"heads": list(records.values()), "composition": composition_record(compositions(model))}


# %% [markdown]
# ## The answer, in this model's own terms
#
# Part I asked what queries, keys and values *are*; for the shipped de -> en
# model `make circuits` answers with its own weights and attention in
# docs/circuits.md#the-answer-in-this-models-own-terms, each figure checked
# against its JSON (`test_the_answer_quotes_the_readout_of_the_shipped_model`).
