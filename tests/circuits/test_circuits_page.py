"""The circuits page (annotated/circuits/page.py, web/circuits.*) in headless Chromium, built from the real
readout (`read_model`) of a tiny random model, and the attention viewer's link to it."""

from __future__ import annotations

import base64
import copy
import json
from collections import Counter
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import numpy as np
import pytest
import torch
from browser import CHROMIUM, NO_CHROMIUM, Chromium

from annotated.attention import pictures as P
from annotated.attention import viewer as V
from annotated.circuits.command import best_cross_head
from annotated.circuits.page import DIGITS, circuits_html, page_file, write_page
from annotated.circuits.readout import Inputs, read_model
from annotated.plumbing.files import json_safe
from annotated.sites import remove_heads
from annotated.tokens import BOS, EOS, PAD
from annotated.transformer import make_model

VOCAB = 40
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
MARKUP = "\u2581</script><!--"  # a piece that must stay data, not markup (script_json)
ROUNDED = 0.5e-4 + 1e-9  # the page keeps 4 decimals (DIGITS): a shown number is within half a unit of the last


def _fixed(x: float) -> str:
    """`x.toFixed(2)` as the page's JavaScript writes it: the exact binary value rounded half up, where Python's
    format rounds half to even (0.125 is '0.13' on the page, '0.12' from `f"{0.125:.2f}"`)."""
    return str(Decimal(x).quantize(Decimal("0.01"), rounding=ROUND_HALF_UP))


def piece(i: int) -> str:
    if i < len(SPECIALS):
        return SPECIALS[i]
    if i == 4:
        return MARKUP
    return f"\u2581w{i}" if i % 5 else f"x{i}"  # every fifth piece continues a word


def batch(rng: np.random.Generator, n: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(src (n, length), tgt (n, length + 2): BOS + target + EOS), frequent ids small (a Zipf-like draw)."""
    draw = lambda: 4 + np.minimum(rng.zipf(1.3, size=(n, length)), VOCAB - 5) - 1
    src = torch.tensor(np.concatenate([draw(), np.full((n, 1), EOS)], 1))
    tgt = torch.tensor(np.concatenate([np.full((n, 1), BOS), draw(), np.full((n, 1), EOS)], 1))
    src[0, -2:] = PAD  # one padded source, as batches have
    return src, tgt


def readout(model) -> dict:
    """`circuits.json`'s content for `model`, with a lexicon that translates w{i} as w{i} and its alignments."""
    rng = np.random.default_rng(0)
    val, train, test = batch(rng, 6, 7), batch(rng, 12, 7), batch(rng, 4, 7)
    counts = lambda ids: Counter(int(i) for i in ids.flatten() if i >= len(SPECIALS))
    words = sorted({piece(i).lstrip("\u2581") for i in range(4, VOCAB) if piece(i).startswith("\u2581")})
    lexicon = {w.lower(): [(w.lower(), 1.0)] for w in words}
    links = [{(j, j) for j in range(3)} for _ in range(test[0].size(0))]
    inputs = Inputs(
        pieces=lambda ids: [piece(int(i)) for i in ids],
        src_counts=counts(train[0]),
        tgt_counts=counts(train[1]),
        val_batches=[val],
        train_batches=[train],
        test_batches=[test],
        lexicon=lexicon,
        test_links=links,
        top=20,
    )
    report = {"checkpoint": "tiny.pt", "direction": "xx-yy", **read_model(model, inputs)}
    best = best_cross_head(report)
    report["best_cross_head"] = None if best is None else [*best["site"], best["head"]]
    return json_safe(report, digits=5)  # as circuits.json holds it (the command's rounding)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return make_model(src_vocab=VOCAB, tgt_vocab=VOCAB, N=2, d_model=32, d_ff=64, h=4, max_len=40).eval()


@pytest.fixture(scope="module")
def report(model):
    return readout(model)


def _role(r: dict) -> str:
    """The picker's role: measured on the real attention, the weights' position label beside it where they differ."""
    role, weights = r["roles"]["label"], r["positions"]["label"]
    return role if role == weights else f"{role} (weights: {weights})"


def open_page(page: Path, tmp_path: Path, fragment: str = "", width: int = 1400) -> Chromium:
    if CHROMIUM is None:
        pytest.skip(NO_CHROMIUM)
    browser = Chromium(CHROMIUM, tmp_path / "profile")
    browser.open(
        page.as_uri() + (f"#{fragment}" if fragment else ""),
        width=width,
        height=900,
        domains=("Network", "Page", "Runtime", "Log"),
    )
    browser.wait_js("document.body.dataset.rendered")
    return browser


def problems(browser: Chromium) -> list:
    """Exceptions, console errors and warnings, and log errors (CSP violations land there)."""
    return [
        e["params"]
        for e in browser.events
        if e["method"] == "Runtime.exceptionThrown"
        or (e["method"] == "Runtime.consoleAPICalled" and e["params"]["type"] in ("error", "warning", "assert"))
        or (e["method"] == "Log.entryAdded" and e["params"]["entry"]["level"] in ("error", "warning"))
    ]


def click(browser: Chromium, selector: str) -> None:
    """A real click (the browser's input layer) in the middle of the first element matching `selector`."""
    x, y = browser.js(
        f"(() => {{ const e = document.querySelector({json.dumps(selector)}); e.scrollIntoView({{block: 'center'}}); "
        "const r = e.getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; })()"
    )
    for kind in ("mousePressed", "mouseReleased"):
        browser.page("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)


def css_string(text: str) -> str:
    """`text` as a quoted CSS string (for an attribute selector)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def shown_bars(browser: Chromium, box: str) -> list:
    return browser.js(
        f"[...document.querySelectorAll('#{box} .barrow')].map(r => "
        "[r.querySelector('.label').textContent, parseFloat(r.querySelector('.number').textContent), "
        "parseFloat(r.dataset.value)])"
    )


def assert_bars(shown: list, entries: list) -> None:
    """The bars are the record's entries, in order, each with its number (2 decimals shown, 4 kept)."""
    assert [s[0] for s in shown] == [e[0] for e in entries]
    np.testing.assert_allclose([s[2] for s in shown], [e[1] for e in entries], rtol=0, atol=ROUNDED)
    np.testing.assert_allclose([s[1] for s in shown], [e[1] for e in entries], rtol=0, atol=0.005 + ROUNDED)


def record(report: dict, kind: str, layer: int, head: int) -> dict:
    return next(r for r in report["heads"] if r["site"] == [kind, layer] and r["head"] == head)


def test_circuits_page_shows_the_chosen_rows(report, tmp_path):
    """Pick a head in the menu and a token in each list (real clicks): the QK bars are that record's qk_rows
    entry for the token, the OV bars its ov_rows entry, in order, with their numbers; the picker lists every
    head grouped by kind and layer; the filter, the position table, the exactness note and the dictionary
    rows follow the record; nothing is fetched; screenshots at 1400 and 1000 px."""
    (tmp_path / "attention").mkdir()
    (tmp_path / "attention" / "viewer.html").write_text("a dump's viewer")
    page = write_page(tmp_path, report)
    text = page.read_text(encoding="utf-8")
    for pattern in ("<link", "src=", "href=", "@import", "url(", "fetch(", "XMLHttpRequest", "WebSocket", "onclick="):
        assert pattern not in text, f"the page contains {pattern!r}"
    assert V.content_security_policy(page_file("circuits.js")) in text and "default-src 'none'" in text
    browser = open_page(page, tmp_path)
    try:
        # opens on the best cross head; every head is in the picker, grouped by kind, then layer
        best = report["best_cross_head"]
        assert browser.js("document.body.dataset.rendered").startswith(":".join(map(str, best)) + "/")
        groups = browser.js(
            "[...document.querySelectorAll('#head optgroup')].map(g => [g.label, [...g.children].map(o => o.value)])"
        )
        want = [
            (kind, layer, [f"{kind}:{layer}:{h}" for h in range(4)])
            for kind in ("enc_self", "dec_self", "cross")
            for layer in range(2)
        ]
        assert [g[1] for g in groups] == [w[2] for w in want]
        assert groups[0][0] == "encoder self-attention, layer 0"
        assert browser.js("document.getElementById('pruned').hidden")

        # a cross head: its query tokens (target side) and key tokens (source side) are two lists
        r = record(report, "cross", 1, 2)
        label = browser.js("document.querySelector('#head option[value=\"cross:1:2\"]').textContent")
        rho, aer, p1 = r["faithfulness"]["rho"][0], r["aer"], r["dictionary"]["ov_precision"][0]
        assert label == f"head 2: {_role(r)}, rho {_fixed(rho)}, AER {_fixed(aer)}, OV P@1 {_fixed(p1)}"
        # every head's role in the picker is the measured one, the weights' label beside it where they differ
        texts = browser.js(
            "Object.fromEntries([...document.querySelectorAll('#head option')].map(o => [o.value, o.textContent]))"
        )
        roles = {f"{h['site'][0]}:{h['site'][1]}:{h['head']}": _role(h) for h in report["heads"]}
        assert {k: t.split(", rho")[0] for k, t in texts.items()} == {k: f"head {k[-1]}: {v}" for k, v in roles.items()}
        assert any("(weights: " in v for v in roles.values())  # the tiny model has heads where the two disagree
        browser.js(
            "(() => { const s = document.getElementById('head'); s.value = 'cross:1:2'; "
            "s.dispatchEvent(new Event('change')); })()"
        )
        browser.wait_js("document.body.dataset.rendered.startsWith('cross:1:2/')")
        listed = browser.js("[...document.querySelectorAll('#qk-tokens button.tok')].map(b => b.textContent)")
        assert listed == [row[0] for row in r["qk_rows"]]
        q_row, k_row = r["qk_rows"][3], r["ov_rows"][2]
        click(browser, f"#qk-tokens button.tok:nth-of-type({3 + 1})")
        browser.wait_js(f"document.body.dataset.rendered.startsWith('cross:1:2/' + {json.dumps(q_row[0])} + '/')")
        assert_bars(shown_bars(browser, "qk-bars"), q_row[1])
        click(browser, f"#ov-tokens button.tok:nth-of-type({2 + 1})")
        browser.wait_js(f"document.body.dataset.rendered === 'cross:1:2/' + {json.dumps(q_row[0] + '/' + k_row[0])}")
        assert_bars(shown_bars(browser, "ov-bars"), k_row[1])
        assert_bars(shown_bars(browser, "qk-bars"), q_row[1])  # a cross head: the query stays
        assert "approximation" in browser.js("document.getElementById('exactness').textContent")
        assert f"rho {rho:.2f}" in browser.js("document.getElementById('exactness').textContent")
        dictionary = browser.js(
            "[...document.querySelectorAll('table.dictionary tr[data-word]')].map(t => "
            "[...t.cells].map(c => c.textContent))"
        )
        d = r["dictionary"]
        assert dictionary == [[w, ", ".join(d["ov"][w]), ", ".join(d["qk"][w])] for w in d["ov"]]
        link = browser.js("document.getElementById('viewer-link').getAttribute('href')")
        assert link == "attention/viewer.html#kind=cross&layer=1&head=2&view=head"
        assert browser.js("document.getElementById('mask-key').hidden")  # nothing masked in cross-attention
        shots = {}
        for width in (1400, 1000):
            browser.page(
                "Emulation.setDeviceMetricsOverride", width=width, height=900, deviceScaleFactor=1, mobile=False
            )
            shots[width] = base64.b64decode(browser.page("Page.captureScreenshot", format="png")["data"])
            (tmp_path / f"circuits-{width}.png").write_bytes(shots[width])
            # the two panels' bars are on the page, not squeezed to nothing
            widths = browser.js(
                "[...document.querySelectorAll('.bars .track')].map(t => t.getBoundingClientRect().width)"
            )
            assert min(widths) > 40, (width, widths)

        # a self-attention head of the first layer: exact; one click chooses the token in both lists
        show = "kind=enc_self&layer=0&head=1"
        browser.js(f"location.hash = '{show}'")
        browser.wait_js("document.body.dataset.rendered.startsWith('enc_self:0:1/')")
        r = record(report, "enc_self", 0, 1)
        assert browser.js("document.getElementById('exactness').textContent").startswith("Exact")
        both = next(row[0] for row in r["qk_rows"][1:] if row[0] in {k[0] for k in r["ov_rows"]})
        click(browser, f"#qk-tokens button.tok[data-token={css_string(both)}]")
        browser.wait_js(f"document.body.dataset.rendered === 'enc_self:0:1/' + {json.dumps(both + '/' + both)}")
        assert_bars(shown_bars(browser, "qk-bars"), dict(r["qk_rows"])[both])
        assert_bars(shown_bars(browser, "ov-bars"), dict(r["ov_rows"])[both])
        assert browser.js("document.getElementById('dictionary-panel').hidden")  # self-attention: no dictionary

        # the markup piece is shown as text
        assert MARKUP in browser.js("document.getElementById('qk-tokens').textContent")

        # the filter keeps the tokens that hold what is typed
        browser.js(
            "(() => { const f = document.getElementById('find'); f.value = 'w1'; "
            "f.dispatchEvent(new Event('input')); })()"
        )
        kept = browser.js("[...document.querySelectorAll('#qk-tokens button.tok')].map(b => b.textContent)")
        assert kept == [row[0] for row in r["qk_rows"] if "w1" in row[0].lower()] and kept

        # the decoder's position table: 24 x 24 cells, its future grey
        browser.js("location.hash = 'kind=dec_self&layer=1&head=0'")
        browser.wait_js("document.body.dataset.rendered.startsWith('dec_self:1:0/')")
        cells = browser.js("[...document.querySelectorAll('table.positions td')].map(c => c.style.background)")
        table = record(report, "dec_self", 1, 0)["positions"]["table"]
        assert len(cells) == 24 * 24 == sum(len(row) for row in table)
        grey = [c == "rgb(208, 208, 208)" for c in cells]
        assert grey == [v is None for row in table for v in row] and sum(grey) == 24 * 23 // 2
        # the other cells: the pictures' colour map from -1 to 1, the table divided by its largest magnitude
        values = np.array([round(v, DIGITS) for row in table for v in row if v is not None])  # as the page has it
        colours = P.colour_table(64)
        index = np.floor((0.5 + 0.5 * values / np.abs(values).max()) * 63 + 0.5).astype(int)  # JS's Math.round
        rgb = lambda c: "rgb({}, {}, {})".format(*(int(c[i : i + 2], 16) for i in (1, 3, 5)))
        assert [c for c, g in zip(cells, grey) if not g] == [rgb(colours[i]) for i in index]
        assert not browser.js("document.getElementById('mask-key').hidden")

        assert problems(browser) == []
        assert browser.requests() == [page.as_uri()]  # nothing fetched but the page itself
    finally:
        browser.close()


def test_circuits_page_of_a_pruned_model(model, tmp_path):
    """A pruned model's removed heads have no record: the picker lists the heads kept, and the page says that
    heads removed by pruning have no circuit, naming the attention that keeps fewer."""
    pruned = remove_heads(copy.deepcopy(model), {("enc_self", 1): [0, 2]})
    report = readout(pruned.eval())
    assert len(report["heads"]) == 6 * 4 - 2
    page = write_page(tmp_path, report)
    browser = open_page(page, tmp_path, "kind=enc_self&layer=1&head=1")
    try:
        note = browser.js("document.getElementById('pruned').textContent")
        assert not browser.js("document.getElementById('pruned').hidden")
        assert note.startswith("heads removed by pruning have no circuit: ")
        assert "encoder self-attention layer 1 keeps 2 of 4" in note and "layer 0" not in note
        options = browser.js("[...document.querySelectorAll('#head optgroup')][1].children.length")
        assert options == 2
        assert browser.js("document.body.dataset.rendered").startswith("enc_self:1:1/")
        assert browser.js("document.getElementById('viewer-link').hidden")  # no viewer beside it
        assert problems(browser) == []
    finally:
        browser.close()


def test_the_page_refuses_a_report_without_heads():
    with pytest.raises(ValueError, match="no head records"):
        circuits_html({"heads": []})


def test_the_viewer_links_the_circuits_page_beside_it(tmp_path):
    """`circuits_beside`: circuits.html in the dump's folder or the one above; the viewer's link opens the head
    it shows."""
    dump = tmp_path / "attention"
    dump.mkdir()
    assert V.circuits_beside(dump) is None
    (tmp_path / "circuits.html").write_text("circuits")
    assert V.circuits_beside(dump) == "../circuits.html"
    (dump / "circuits.html").write_text("circuits")
    assert V.circuits_beside(dump) == "circuits.html"
    if CHROMIUM is None:
        pytest.skip(NO_CHROMIUM)
    index = {
        "kinds": ["enc_self", "dec_self", "cross"],
        "layers": 1,
        "heads": 2,
        "sentences": [],
        "rows_cols": {
            "enc_self": ["src_tokens", "src_tokens"],
            "dec_self": ["tgt_out_tokens", "tgt_in_tokens"],
            "cross": ["tgt_out_tokens", "src_tokens"],
        },
    }
    tokens = {
        "source": "a b",
        "translation": "c",
        "src_tokens": ["a", "b"],
        "tgt_in_tokens": ["<s>"],
        "tgt_out_tokens": ["c"],
    }
    index["sentences"] = [tokens]
    arrays = [
        {
            "enc_self": [np.full((1, 2, 2, 2), 0.5)],
            "dec_self": [np.ones((1, 2, 1, 1))],
            "cross": [np.full((1, 2, 1, 2), 0.5)],
        }
    ]
    for circuits, shown in (("../circuits.html", True), (None, False)):
        (tmp_path / str(shown)).mkdir()
        page = tmp_path / f"viewer-{shown}.html"
        page.write_text(V.viewer_html(index, arrays, circuits=circuits), encoding="utf-8")
        browser = open_page(page, tmp_path / str(shown), "s=0&kind=cross&layer=0&head=1&view=head")
        try:
            assert browser.js("document.getElementById('circuits-link').hidden") is not shown
            if shown:
                href = browser.js("document.getElementById('circuits-link').getAttribute('href')")
                assert href == "../circuits.html#kind=cross&layer=0&head=1"
                browser.js("location.hash = 's=0&kind=dec_self&layer=0&head=mean&view=head'")
                browser.wait_js("document.body.dataset.rendered === '0/dec_self/0/mean'")
                href = browser.js("document.getElementById('circuits-link').getAttribute('href')")
                assert href == "../circuits.html#kind=dec_self&layer=0&head=0"
            assert problems(browser) == []
        finally:
            browser.close()
