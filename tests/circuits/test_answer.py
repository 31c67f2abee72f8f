"""Part V's "The answer, in this model's own terms" (docs/circuits.md, cited by annotated/circuits/readout.py)
quotes the readout of the shipped de -> en model: every figure in it is checked against the circuits.json that
`make circuits` writes.

The readout runs once for this file, as `make circuits CHECKPOINT=shipped:de-en` runs it (its defaults: 200
validation sentences, 4,000 training pairs, the 1,000 test pairs), into a temporary folder. It needs Multi30k
(`MULTI30K_URL`, else skipped) and the aligner; the aligner's links are read from the data cache, where the first
`make circuits` (or the first run of this test) leaves them, as every run of the command does.

Each claim is a sentence of the paragraph with `{}` where its figure stands, and the function that computes that
figure from the JSON, written as the prose writes it (percentages rounded to whole numbers, the rest to two
decimals). A figure that no longer matches, or a sentence reworded without its claim, fails the test with both
texts; the paragraph's whitespace is normalised, so rewrapping changes nothing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from annotated.circuits.command import main

ROOT = Path(__file__).resolve().parents[2]
HEADING = "## The answer, in this model's own terms"
FIGURE = r"((?:\d[\d.]*%?|to|and|head|,| )+?)"  # what a claim's figure may look like: "56% to 66%", "2, 0 and 1"


def answer_text() -> str:
    """The section's markdown, up to the next heading, whitespace collapsed to single spaces."""
    lines = (ROOT / "docs" / "circuits.md").read_text(encoding="utf-8").splitlines()
    start = lines.index(HEADING)
    body = []
    for line in lines[start + 1 :]:
        if line.startswith("## "):
            break
        body.append(line)
    return " ".join(" ".join(body).split())


def heads(report: dict, kind: str, layers: tuple[int, ...] = (0, 1)) -> list[dict]:
    return [h for h in report["heads"] if h["site"][0] == kind and h["site"][1] in layers]


def head(report: dict, kind: str, layer: int, i: int) -> dict:
    return next(h for h in report["heads"] if h["site"] == [kind, layer] and h["head"] == i)


def percent(v: float) -> str:
    return f"{100 * v:.0f}%"


def percents(values: list[float]) -> str:
    """'56% to 66%' (one figure when all round alike)."""
    low, high = percent(min(values)), percent(max(values))
    return low if low == high else f"{low} to {high}"


def decimals(values: list[float]) -> str:
    low, high = f"{min(values):.2f}", f"{max(values):.2f}"
    return low if low == high else f"{low} to {high}"


def share(hs: list[dict], part: str, name: str) -> list[float]:
    return [h[part][name][0] for h in hs]


def rho(hs: list[dict], reading: str = "faithfulness") -> str:
    """The range of the heads' rank correlations: weights only ("faithfulness") or with the norms exact."""
    return decimals([h[reading]["rho"][0] for h in hs])


def over_chance(p: dict) -> float:
    return p["score"] / p["baseline"][0]


def _reads(report: dict, kind: str) -> list:
    return report["composition"]["best_cross_head_reads"][kind]


def _times(values: list[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values[:-1]) + f" and {values[-1]:.2f}"


def _previous_head_into_cross_keys(report: dict) -> list[float]:
    return [
        over_chance(p)
        for p in report["composition"]["pairs"]
        if p["writer"] == ["enc_self", 1, 2] and p["reader"][:2] == ["cross", 1] and p["kind"] == "K"
    ]


def _strongest_writer(report: dict) -> list:
    best = max(report["composition"]["pairs"], key=over_chance)
    return best["writer"]


CLAIMS: list[tuple[str, Callable[[dict], str]]] = [
    (
        "of rank at most `d_k = 32`, and every head here uses all {} directions",
        lambda r: (
            str(min(h["qk"]["rank"] for h in r["heads"]))
            if len({h["qk"]["rank"] for h in r["heads"]}) == 1
            else "(ranks differ)"
        ),
    ),
    (
        "the query's position against the key's token carries {}, the two tokens",
        lambda r: percents(share(heads(r, "enc_self", (0,)), "score_terms", "position x token")),
    ),
    (
        "the two tokens {}, the two positions",
        lambda r: percents(share(heads(r, "enc_self", (0,)), "score_terms", "token x token")),
    ),
    (
        "the two positions {}. On the real",
        lambda r: percents(share(heads(r, "enc_self", (0,)), "score_terms", "position x position")),
    ),
    (
        "their argmax on the first source piece for {} of queries",
        lambda r: percents(share(heads(r, "enc_self", (0,)), "roles", "first")),
    ),
    ("(on the previous position for {})", lambda r: percents(share(heads(r, "enc_self", (0,)), "roles", "previous"))),
    ("on `<s>` for {} and on the token", lambda r: percents(share(heads(r, "dec_self", (0,)), "roles", "first"))),
    ("on the token being read for {}.", lambda r: percents(share(heads(r, "dec_self", (0,)), "roles", "self"))),
    (
        "the weights-only reading is the head (rank correlation {})",
        lambda r: decimals([h["faithfulness"]["rho"][0] for h in r["heads"] if h["exact_direct_path"]]),
    ),
    (
        "wrote carries {} of the second encoder layer's score variance",
        lambda r: percents(share(heads(r, "enc_self", (1,)), "score_terms", "written")),
    ),
    ("{} of the first cross layer's and", lambda r: percents(share(heads(r, "cross", (0,)), "score_terms", "written"))),
    (
        "and {} of the second decoder and cross layers'",
        lambda r: percents(share(heads(r, "dec_self", (1,)) + heads(r, "cross", (1,)), "score_terms", "written")),
    ),
    ("encoder layer's heads partly (rank correlation {} weights only,", lambda r: rho(heads(r, "enc_self", (1,)))),
    ("weights only, {} with the norms exact", lambda r: rho(heads(r, "enc_self", (1,)), "faithfulness_exact_norms")),
    ("the first cross layer about as well ({};", lambda r: rho(heads(r, "cross", (0,)))),
    ("about as well (0.64 to 0.68; {})", lambda r: rho(heads(r, "cross", (0,)), "faithfulness_exact_norms")),
    (
        "the second decoder and cross layers poorly ({};",
        lambda r: rho(heads(r, "dec_self", (1,)) + heads(r, "cross", (1,))),
    ),
    (
        "layers poorly (0.24 to 0.37; {})",
        lambda r: rho(heads(r, "dec_self", (1,)) + heads(r, "cross", (1,)), "faithfulness_exact_norms"),
    ),
    (
        "look one position back: head 2 for {} of its",
        lambda r: percent(head(r, "enc_self", 1, 2)["roles"]["previous"][0]),
    ),
    ("queries, head 0 for {}.", lambda r: percent(head(r, "enc_self", 1, 0)["roles"]["previous"][0])),
    (
        "(chance's 95% intervals end {} times their means)",
        lambda r: decimals([p["baseline"][2] / p["baseline"][0] for p in r["composition"]["pairs"]]),
    ),
    (
        "The strongest pairs of the model run from the previous-position head of the second encoder layer, head {},",
        lambda r: (
            str(_strongest_writer(r)[2]) if _strongest_writer(r)[:2] == ["enc_self", 1] else str(_strongest_writer(r))
        ),
    ),
    ("four second-layer cross heads, at {} times chance", lambda r: decimals(_previous_head_into_cross_keys(r))),
    (
        "The best cross head (layer {}) reads",
        lambda r: "{}, head {}".format(*r["best_cross_head"][1:]) if r["best_cross_head"][0] == "cross" else "?",
    ),
    (
        "reads its keys through encoder layer 1's heads {} (",
        lambda r: (
            _times([float(w[0][2]) for w in _reads(r, "K")]).replace(".00", "")
            if all(w[0][:2] == ["enc_self", 1] for w in _reads(r, "K"))
            else str(_reads(r, "K"))
        ),
    ),
    ("heads 2, 0 and 1 ({} times chance)", lambda r: _times([w[2] for w in _reads(r, "K")])),
    (
        "its queries through the first cross layer's head {} and the second decoder layer's head",
        lambda r: str(_reads(r, "Q")[0][0][2]) if _reads(r, "Q")[0][0][:2] == ["cross", 0] else str(_reads(r, "Q")[0]),
    ),
    (
        "the second decoder layer's head {} (",
        lambda r: (
            str(_reads(r, "Q")[1][0][2]) if _reads(r, "Q")[1][0][:2] == ["dec_self", 1] else str(_reads(r, "Q")[1])
        ),
    ),
    ("decoder layer's head 0 ({} times)", lambda r: _times([w[2] for w in _reads(r, "Q")[:2]])),
    (
        "its values through no head more than chance (at most {} times)",
        lambda r: f"{_reads(r, 'V')[0][2]:.2f}" if not any(w[3] for w in _reads(r, "V")) else "(one stands out)",
    ),
    (
        "over the {} of its 500 most frequent German words",
        lambda r: (
            str(head(r, "cross", 1, 2)["dictionary"]["coverage"][0])
            if head(r, "cross", 1, 2)["dictionary"]["coverage"][1] == 500
            else "(not of 500)"
        ),
    ),
    (
        "OV dictionaries are right at the first guess for {} of them",
        lambda r: percents([h["dictionary"]["ov_precision"][0] for h in heads(r, "cross", (1,))]),
    ),
    (
        "of them ({} within five)",
        lambda r: percents([h["dictionary"]["ov_precision"][1] for h in heads(r, "cross", (1,))]),
    ),
    ("their copying scores are {}.", lambda r: decimals([h["copying_score"] for h in heads(r, "cross", (1,))])),
    (
        "are right at the first guess for {} (",
        lambda r: percents([h["dictionary"]["qk_precision"][0] for h in heads(r, "cross", (1,))]),
    ),
    (
        "guess for 14% to 17% ({} within five)",
        lambda r: percents([h["dictionary"]["qk_precision"][1] for h in heads(r, "cross", (1,))]),
    ),
    (
        "the aligner links to it for {} of the linked words",
        lambda r: percents(share(heads(r, "cross", (1,)), "roles", "aligned")),
    ),
    ("an alignment error rate of {} against", lambda r: decimals([h["aer"] for h in heads(r, "cross", (1,))])),
    ("the best head is layer 1, head 2 ({})", lambda r: f"{head(r, 'cross', *r['best_cross_head'][1:])['aer']:.2f}"),
    ("aligns far worse ({}; on a linked word", lambda r: decimals([h["aer"] for h in heads(r, "cross", (0,))])),
    ("on a linked word for {}), and its", lambda r: percents(share(heads(r, "cross", (0,)), "roles", "aligned"))),
    (
        "(precision@1 at most {})",
        lambda r: f"{max(h['dictionary']['ov_precision'][0] for h in heads(r, 'cross', (0,))):.2f}",
    ),
]


@pytest.fixture(scope="module")
def report(data_url, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("circuits")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MULTI30K_URL", data_url)
        assert main(["--checkpoint", "shipped:de-en", "--out", str(out)]) == 0
    return json.loads((out / "circuits.json").read_text(encoding="utf-8"))


def test_the_claims_find_their_sentences_and_cover_every_figure():
    """Each claim's sentence is in the paragraph once, and every figure of the paragraph belongs to a claim."""
    text = answer_text()
    claimed: list[tuple[int, int]] = []  # where each claim's figure stands in the paragraph
    for template, _ in CLAIMS:
        pattern = re.escape(template).replace(r"\{\}", FIGURE)
        found = list(re.finditer(pattern, text))
        assert len(found) == 1, f"the claim {template!r} is in the paragraph {len(found)} times"
        claimed.append(found[0].span(1))
    # every measured figure is a percentage or a decimal; what stays unclaimed is the setup (200 sentences, 4,000
    # pairs, d_k = 32, the heads named by number) and the intervals' confidence
    unclaimed = [
        m.group(0)
        for m in re.finditer(r"\d+(?:\.\d+)?%?", text)
        if ("%" in m.group(0) or "." in m.group(0)) and not any(a <= m.start() < b for a, b in claimed)
    ]
    assert set(unclaimed) <= {"95%"}, f"figures of the paragraph that no claim checks: {unclaimed}"


def test_the_answer_quotes_the_readout_of_the_shipped_model(report):
    assert report["direction"] == "de-en" and report["checkpoint"] == "shipped:de-en"
    text = answer_text()
    wrong = []
    for template, figure in CLAIMS:
        expected = template.replace("{}", figure(report))
        if expected not in text:
            pattern = re.escape(template).replace(r"\{\}", FIGURE)
            said = re.search(pattern, text)
            wrong.append(
                f"{template!r}: the readout gives {figure(report)!r}, the prose {said.group(1) if said else None!r}"
            )
    assert not wrong, "\n".join(wrong)
