"""The token heatmap's HTML page in a real browser (headless Chromium): every response and token drawn, each token's
box coloured, and hovering a token gives its exact advantage, entropy, position and id.

Skipped, with the reason, where no Chromium is installed (Debian: ``apt-get install chromium``; .ci/run installs it):

    .venv/bin/python -m pytest -q tests/test_viz_browser.py
"""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from gtpo.viz.heatmap_style import display_text, fmt_value
from gtpo.viz.tokens import render_tokens
from tests.support.browser import Browser
from tests.support.viz import RESPONSES, write_dump

CHROMIUM = Browser.find()
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on PATH (apt-get install chromium)")

# Per token, in page order: its text, box colour, hover title, and its box on the rendered page.
TOKENS_JS = """
Array.from(document.querySelectorAll('.resp')).map(resp => ({
  key: resp.dataset.key,
  toks: Array.from(resp.querySelectorAll('.tok')).map(t => {
    const r = t.getBoundingClientRect();
    return {tok: t.dataset.tok, title: t.title, bg: getComputedStyle(t).backgroundColor,
            x: r.left + r.width / 2 + window.scrollX, y: r.top + r.height / 2 + window.scrollY,
            w: r.width, h: r.height, shown: t.textContent};
  })
}))
"""


@pytest.fixture(scope="module")
def browser():
    b = Browser(CHROMIUM)
    yield b
    b.close()


@pytest.fixture()
def page(browser, tmp_path):
    html_path = render_tokens(write_dump(tmp_path), tmp_path / "heatmap", png=False)["html"]
    browser.open(html_path)
    return browser


def _expected_by_key() -> dict[str, tuple[list[str], list[float], list[float]]]:
    # keys as the fixture writes them: "<uid>_0_<row>"
    return {f"{uid}_0_{i}": (toks, adv, ent) for i, (uid, toks, adv, ent, _) in enumerate(RESPONSES)}


def test_every_response_and_token_is_drawn(page):
    drawn = page.evaluate(TOKENS_JS)
    expected = _expected_by_key()
    assert sorted(r["key"] for r in drawn) == sorted(expected)
    for resp in drawn:
        toks, adv, ent = expected[resp["key"]]
        assert [t["tok"] for t in resp["toks"]] == toks
        for i, t in enumerate(resp["toks"]):
            assert t["w"] > 0 and t["h"] > 0, f"token {i} of {resp['key']} has no box on the page: {t}"
            assert t["shown"].replace("\n", "") == display_text(toks[i])
            # the exact values, position and id behind the hover
            assert t["title"] == f"advantage={fmt_value(adv[i])}\n#{i} id={ord(toks[i])}\nentropy={fmt_value(ent[i])}"
        # the box colour follows the advantage: the most positive and the most negative token differ
        colours = {t["bg"] for t in resp["toks"]}
        assert len(colours) == len(set(adv)), (resp["key"], colours)


def test_hovering_a_token_targets_that_token(page):
    drawn = page.evaluate(TOKENS_JS)
    checked = 0
    for resp in drawn:
        for i, t in enumerate(resp["toks"]):
            page.hover(t["x"], t["y"])
            hovered = page.evaluate(
                "(() => { const h = document.querySelectorAll('.tok:hover');"
                " return h.length ? {tok: h[0].dataset.tok, i: h[0].dataset.i, title: h[0].title,"
                " key: h[0].closest('.resp').dataset.key} : null; })()"
            )
            assert hovered == {"tok": t["tok"], "i": str(i), "title": t["title"], "key": resp["key"]}, (resp, i)
            checked += 1
    assert checked == sum(len(toks) for _, toks, *_ in RESPONSES)


def test_the_rendered_page_shows_the_token_colours(page):
    drawn = page.evaluate(TOKENS_JS)
    shot = np.asarray(Image.open(io.BytesIO(page.screenshot())).convert("RGB"))
    assert shot.shape[0] > 100 and shot.shape[1] > 100
    for resp in drawn:
        for t in resp["toks"]:
            rgb = tuple(int(c) for c in t["bg"].removeprefix("rgb(").rstrip(")").split(","))
            # a pixel of the box, off the glyph: the left edge, inside the 1 px frame
            y, x = int(round(t["y"])), int(round(t["x"] - t["w"] / 2 + 1.5))
            patch = shot[y - 1 : y + 2, x - 1 : x + 2].reshape(-1, 3)
            assert any(np.abs(p.astype(int) - rgb).max() <= 40 for p in patch), (t, patch.tolist())
