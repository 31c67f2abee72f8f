# %% [markdown]
# # Roles tested by intervention: what changes when a head's output is replaced
#
# A reading says what a head could do; whether the model *uses* it comes from
# changing the head and watching the output (Meng et al. 2022, Wang et al.
# 2022: activation patching). Head `i`'s term of its attention's output,
# `P_i X W_OV + (P_i 1) b_V W_O` (`HeadCircuit.writes`), is replaced three
# ways: **zero** (removed, as `annotated/sites.py` removes a head:
# `test_zero_ablation_is_removing_the_head`; this also moves the stream's
# size, which the LayerNorms divide by), **mean** (its mean over the
# validation positions: the size kept, the information gone) and
# **resample** (the same head's output at the same position of another
# sentence at least as long: right kind, wrong sentence; positions past the
# longest sentence's donor take the mean, counted as `fallback`). A role the
# three agree on is a role.
#
# Measured per target token, with a paired bootstrap interval over sentences
# (`paired_loss_change`): the change in log-probability of **the reference
# next token**, and for a cross head of **the aligner's translation of the
# source word the head attends to** (positions whose translation no single
# word-initial piece spells are left out, and counted), each beside the same
# intervention on **another head of the layer**, drawn at random (seeded).
# `test_ablating_the_planted_head_destroys_its_behaviour` checks it all on a
# model built by hand; the shipped models' figures are in
# docs/circuits.md#roles-tested-by-intervention.

# %%
from __future__ import annotations

import inspect
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from annotated.attention.bootstrap import Change, paired_loss_change
from annotated.circuits.circuits import HeadCircuit, attentions, circuit, teacher_forced
from annotated.circuits.dictionary import word_starts
from annotated.circuits.metrics import piece_words
from annotated.sites import Site
from annotated.tokens import PAD
from annotated.transformer import EncoderDecoder, head_mask

HOWS = ("zero", "mean", "resample")
SEED = 0  # the random neighbour head and the resample donors

# %% [markdown]
# ## 1. One head's term, computed and replaced inside the model
#
# A forward hook on the attention recomputes head `i`'s term from the
# attention's own inputs (its circuit's scores, the mask, the softmax,
# `writes`) and swaps it for `replacement(term)`.


# %%
def _head_term(c: HeadCircuit, x_q: Tensor, x_kv: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """(head c's term (B, T_q, d_model) of the attention output, its probabilities (B, T_q, T_k))."""
    s = c.scores(x_q, x_kv)  # (B, T_q, T_k)
    allowed = head_mask(mask, x_q.size(0), x_q.size(1), x_kv.size(1))  # (B, 1, T_q, T_k) or None
    if allowed is not None:
        s = s.masked_fill(~allowed[:, 0], torch.finfo(s.dtype).min)
    p = s.softmax(-1)  # (B, T_q, T_k)
    if allowed is not None:
        p = p * allowed[:, 0]  # a fully blocked row writes nothing, as the model's attention
    return c.writes(p, x_kv), p


class _Swap:
    """A forward hook that replaces head c's term by `replacement(term)`; keeps the last term and probabilities."""

    def __init__(self, c: HeadCircuit, replacement: Callable[[Tensor], Tensor] | None):
        self.c, self.replacement = c, replacement
        self.term: Tensor | None = None
        self.p: Tensor | None = None

    def __call__(self, att, args, kwargs, output: Tensor) -> Tensor:
        call = inspect.signature(att.forward).bind(*args, **kwargs).arguments
        if call.get("kv") is not None:
            raise ValueError("intervene on a teacher-forced pass: the attention got cached keys and values")
        self.term, self.p = _head_term(self.c, call["x_q"], call["x_kv"], call.get("mask"))
        if self.replacement is None:
            return output
        return output - self.term + self.replacement(self.term)  # (B, T_q, d_model)


# %% [markdown]
# ## 2. A pass over the validation sentences
#
# `run_pass` hooks one attention: the first circuit's term replaced (or
# not), every circuit's term recorded. A decoder-side head changes nothing
# in the encoder, so each batch's encoder output is kept (`memory`).


# %%
@dataclass
class Pass:
    """One pass's per-sentence numbers, in batch order."""

    reference: list[Tensor]  # per sentence: (T_n,) log p(reference next token) at each real position
    terms: list[list[Tensor]]  # per circuit, per sentence: (T_n, d_model) its term at each real query position
    measured: list[float]  # per sentence: measure(sentence, attention (T_n, S_n), log-probabilities (T_n, V))


def _for_batch(replacement: Callable[[Tensor, int], Tensor], number: int) -> Callable[[Tensor], Tensor]:
    return lambda term: replacement(term, number)


@torch.no_grad()
def run_pass(
    model: EncoderDecoder,
    batches: Sequence[tuple[Tensor, Tensor]],
    heads: Sequence[HeadCircuit],
    replacement: Callable[[Tensor, int], Tensor] | None = None,
    measure: Callable[[int, Tensor, Tensor], float] | None = None,
    memory: dict[int, Tensor] | None = None,
) -> Pass:
    """Teacher-forced pass, heads[0]'s term replaced by replacement(term, batch number) (None: unchanged)."""
    site = heads[0].site
    out = Pass([], [[] for _ in heads], [])
    for number, (src, tgt) in enumerate(batches):
        swaps = [_Swap(heads[0], None if replacement is None else _for_batch(replacement, number))]
        swaps += [_Swap(c, None) for c in heads[1:]]
        handles = [attentions(model)[site].register_forward_hook(w, with_kwargs=True) for w in swaps]
        tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]  # (B, T), (B, T)
        known = None if memory is None or site[0] == "enc_self" else memory.get(number)  # unchanged by this head
        encoded, decoded = teacher_forced(model, src, tgt_in, PAD, handles, known)
        if memory is not None:
            memory[number] = encoded  # (B, S, d_model)
        logp = model.generator(decoded).log_softmax(-1)  # (B, T, V)
        ref = logp.gather(-1, tgt_out.unsqueeze(-1)).squeeze(-1).double()  # (B, T)
        for b in range(src.size(0)):
            T, S = int((tgt_out[b] != PAD).sum()), int((src[b] != PAD).sum())
            out.reference.append(ref[b, :T])
            for terms, w in zip(out.terms, swaps):
                assert w.term is not None
                terms.append(w.term[b, :S] if site[0] == "enc_self" else w.term[b, :T])
            if measure is not None:
                assert swaps[0].p is not None
                out.measured.append(measure(len(out.reference) - 1, swaps[0].p[b, :T, :S], logp[b, :T]))
    return out


# %% [markdown]
# ## 3. The three replacements
#
# Each is built from the unchanged pass's terms; the donors are drawn once,
# seeded, so the head and its neighbour are changed by the same sentences.


# %%
def donors(lengths: Sequence[int], seed: int = SEED) -> list[int]:
    """For each sentence, another whose length is at least its own (the longest other one if none).

    >>> d = donors([3, 5, 4, 5])
    >>> all(d[n] != n and [3, 5, 4, 5][d[n]] >= [3, 5, 4, 5][n] for n in range(4))
    True
    """
    rng = random.Random(seed)
    out = []
    for n, length in enumerate(lengths):
        longer = [m for m, other in enumerate(lengths) if m != n and other >= length]
        if not longer:
            longest = max(other for m, other in enumerate(lengths) if m != n)
            longer = [m for m, other in enumerate(lengths) if m != n and other == longest]
        out.append(rng.choice(longer))
    return out


def replacements(terms: list[Tensor], batches: Sequence[tuple[Tensor, Tensor]], seed: int = SEED):
    """{how: replacement(term, batch number)} for zero, mean and resample from one head's unchanged `terms`
    (one (T_n, d_model) per sentence), and the number of positions the resample fills with the mean."""
    mean = torch.cat(terms).mean(0)  # (d_model,) over every real position of every sentence
    lengths = [t.size(0) for t in terms]
    donor = donors(lengths, seed)
    starts = np.cumsum([0] + [b[0].size(0) for b in batches])
    fallback = sum(max(0, lengths[n] - lengths[d]) for n, d in enumerate(donor))

    def zero(term: Tensor, number: int) -> Tensor:
        return torch.zeros_like(term)

    def average(term: Tensor, number: int) -> Tensor:
        return mean.to(term.dtype).expand_as(term)

    def resample(term: Tensor, number: int) -> Tensor:
        out = mean.to(term.dtype).expand_as(term).clone()  # (B, T_q, d_model): the mean past a donor's end
        for b in range(term.size(0)):
            other = terms[donor[int(starts[number]) + b]]
            n = min(other.size(0), term.size(1))
            out[b, :n] = other[:n].to(term.dtype)
        return out

    return {"zero": zero, "mean": average, "resample": resample}, fallback


# %% [markdown]
# ## 4. The translation of the attended word
#
# At each decoder position of the unchanged pass: the source word the tested
# head's argmax falls in, its best translation in the lexicon, and the
# word-initial pieces spelling it (`▁dog` and `▁Dog` for *dog*).


# %%
class Translation:
    """measure() for run_pass: the clean pass finds each position's target, every pass scores them."""

    def __init__(
        self,
        batches: Sequence[tuple[Tensor, Tensor]],
        pieces: Callable[[Sequence[int]], list[str]],
        lexicon: dict[str, list[tuple[str, float]]],
        vocab: int,
    ):
        self.spelled: dict[str, list[int]] = {}
        for i, word in zip(*word_starts(pieces, vocab)):
            self.spelled.setdefault(word, []).append(i)
        srcs = [s[b][s[b] != PAD].tolist() for s, _ in batches for b in range(s.size(0))]
        self.words = [piece_words(pieces(ids)) for ids in srcs]
        self.lexicon = lexicon
        self.targets: dict[int, list[tuple[int, list[int]]]] = {}  # sentence -> [(position, candidate ids)]
        self.looked = 0  # positions looked at

    def find(self, n: int, p: Tensor) -> None:
        """The targets of sentence n from the head's unchanged attention p (T, S)."""
        number, texts = self.words[n]
        chosen = []
        for t, s in enumerate(p.argmax(-1).tolist()):  # the source position each decoder row attends to most
            self.looked += 1
            k = number[s]
            word = texts[k] if k is not None else ""
            translation = self.lexicon[word][0][0] if word in self.lexicon else None
            if translation in self.spelled:
                chosen.append((t, self.spelled[translation]))
        self.targets[n] = chosen

    def clean(self, n: int, p: Tensor, logp: Tensor) -> float:
        self.find(n, p)
        return self(n, p, logp)

    def __call__(self, n: int, p: Tensor, logp: Tensor) -> float:
        """Sentence n's summed log-probability of its targets' pieces (logsumexp over a word's pieces)."""
        return sum(float(logp[t, ids].logsumexp(0)) for t, ids in self.targets[n])

    def counts(self) -> np.ndarray:
        return np.array([len(self.targets[n]) for n in range(len(self.targets))], dtype=np.float64)


# %% [markdown]
# ## 5. A head and its neighbour, three ways
#
# `intervene` returns, for the head and for its neighbour, each measure's
# change per token `[value, low, high]` (95% paired bootstrap interval).


# %%
def _change(clean: np.ndarray, changed: np.ndarray, tokens: np.ndarray) -> list[float]:
    """Per-token change of summed log-probabilities, changed - clean, with its interval; NaN without tokens."""
    if tokens.sum() == 0:
        return [float("nan")] * 3
    keep = tokens > 0  # a sentence with nothing scored adds nothing to either sum
    c: Change = paired_loss_change(clean[keep], tokens[keep], changed[keep], tokens[keep])
    return [c.value, c.low, c.high]


def neighbour(model: EncoderDecoder, site: Site, head: int, seed: int = SEED) -> int:
    """Another head of the same attention, drawn at random (seeded by the site and head)."""
    h = attentions(model)[site].h
    if h < 2:
        raise ValueError(f"{site[0]} layer {site[1]} has one head: there is no other head to compare with")
    rng = random.Random(f"{seed}:{site[0]}:{site[1]}:{head}")
    return rng.choice([i for i in range(h) if i != head])


@torch.no_grad()
def intervene(
    model: EncoderDecoder,
    batches: Sequence[tuple[Tensor, Tensor]],
    site: Site,
    head: int,
    pieces: Callable[[Sequence[int]], list[str]] | None = None,
    lexicon: dict[str, list[tuple[str, float]]] | None = None,
) -> dict[str, Any]:
    """Head `head` of `site` and a random neighbour, each replaced the `HOWS` ways: the changes of section intro's
    measures. The translation measure needs `pieces` and `lexicon`, and a cross-attention site."""
    model = model.eval()
    other = neighbour(model, site, head)
    att = attentions(model)[site]
    tested = {"head": circuit(att, head, site), "neighbour": circuit(att, other, site)}
    translate = site[0] == "cross" and pieces is not None and lexicon is not None
    measure = None
    if translate:
        assert pieces is not None and lexicon is not None
        measure = Translation(batches, pieces, lexicon, model.generator.weight.size(0))
    memory: dict[int, Tensor] = {}
    clean = run_pass(model, batches, list(tested.values()), measure=measure.clean if measure else None, memory=memory)
    tokens = np.array([r.numel() for r in clean.reference], dtype=np.float64)
    base = np.array([float(r.sum()) for r in clean.reference])
    record: dict[str, Any] = {
        "site": list(site),
        "head": head,
        "neighbour": other,
        "sentences": len(tokens),
        "tokens": int(tokens.sum()),
        "reference": {},
    }
    if measure is not None:
        counted = measure.counts()
        base_t = np.array(clean.measured)
        record.update(translation={}, translation_positions=[int(counted.sum()), measure.looked])
    for (name, c), terms in zip(tested.items(), clean.terms):
        swaps, fallback = replacements(terms, batches)
        record.setdefault("fallback", fallback)
        for how in HOWS:
            changed = run_pass(model, batches, [c], swaps[how], measure, memory)
            after = np.array([float(r.sum()) for r in changed.reference])
            record["reference"].setdefault(how, {})[name] = _change(base, after, tokens)
            if measure is not None:
                after_t = np.array(changed.measured)
                record["translation"].setdefault(how, {})[name] = _change(base_t, after_t, counted)
    return record


# %% [markdown]
# ## 6. The roles this part names
#
# The best cross head (the lowest AER), and for each role of `ROLES` the head
# of that attention whose real argmax takes it most often, not the one its
# weights' label names (`test_role_heads_are_chosen_by_the_measured_share`).

# %%
ROLES = {"previous": "enc_self", "self": "dec_self"}  # position role -> the attention it is tested in


def role_heads(report: dict[str, Any]) -> list[tuple[str, Site, int]]:
    """(role, site, head) to test: the best cross head, then for each role of ROLES the head of its attention
    with the largest measured share (the first of equals).

    >>> heads = [{"site": ["enc_self", 1], "head": 0, "roles": {"previous": [0.45, 0.4, 0.5]}},
    ...          {"site": ["enc_self", 1], "head": 2, "roles": {"previous": [0.59, 0.5, 0.6]}},
    ...          {"site": ["cross", 1], "head": 2, "roles": {"aligned": [0.75, 0.7, 0.8]}}]
    >>> role_heads({"heads": heads, "best_cross_head": ["cross", 1, 2]})
    [('aligns and translates', ('cross', 1), 2), ('previous', ('enc_self', 1), 2)]
    """
    out: list[tuple[str, Site, int]] = []
    best = report.get("best_cross_head")
    if best is not None:
        out.append(("aligns and translates", (best[0], best[1]), best[2]))
    for role, kind in ROLES.items():
        measured = [h for h in report["heads"] if h["site"][0] == kind and role in h.get("roles", {})]
        if measured:
            h = max(measured, key=lambda h: h["roles"][role][0])  # max keeps the first of equals
            out.append((role, (h["site"][0], h["site"][1]), h["head"]))
    return out


def role_interventions(
    model: EncoderDecoder,
    batches: Sequence[tuple[Tensor, Tensor]],
    report: dict[str, Any],
    pieces: Callable[[Sequence[int]], list[str]] | None,
    lexicon: dict[str, list[tuple[str, float]]] | None,
) -> list[dict[str, Any]]:
    """`intervene` on each of `role_heads(report)` whose attention has another head, its role in the record."""
    return [
        {"role": role, **intervene(model, batches, site, head, pieces, lexicon)}
        for role, site, head in role_heads(report)
        if attentions(model)[site].h > 1
    ]


def format_interventions(records: list[dict[str, Any]]) -> list[str]:
    """One line per role, measure and intervention: the head's change [95%] beside its neighbour's."""
    lines = []
    for r in records:
        for measure in ("reference", "translation"):
            for how, pair in r.get(measure, {}).items():
                h, n = pair["head"], pair["neighbour"]
                lines.append(
                    f"{r['role']:<22} {r['site'][0]} {r['site'][1]}.{r['head']} {measure:<11} {how:<8} "
                    f"{h[0]:+.3f} [{h[1]:+.3f}, {h[2]:+.3f}]  head {r['neighbour']}: {n[0]:+.3f} [{n[1]:+.3f}, {n[2]:+.3f}]"
                )
    return lines
