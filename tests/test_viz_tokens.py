"""Token heatmaps: token dumps from padded tensors, HTML content/colours/escaping, PNG, verl's text dumps.

Run: cd /work/main && .venv/bin/pytest -q tests/test_viz_tokens.py
"""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from matplotlib import colormaps
from matplotlib.image import imread

from gtpo.viz.__main__ import main as viz_main
from gtpo.viz.tokens import (
    ADVANTAGE_CMAP,
    ENTROPY_CMAP,
    find_dump,
    load_responses,
    records_from_batch,
    render_html,
    render_png,
    render_tokens,
    token_records,
    write_token_dump,
)
from tests.support.viz import RESPONSES, ByteTokenizer, padded_records, padded_responses, write_dump

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture()
def dump(tmp_path: Path) -> Path:
    return write_dump(tmp_path)


class _Page(HTMLParser):
    """Collects sections -> columns -> responses -> token spans (data-tok, background, title, shown text)."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tags: list[str] = []
        self.sections: list[dict] = []
        self._tok: dict | None = None
        self.legend: dict | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append(tag)
        cls = a.get("class", "")
        if tag == "section":
            self.sections.append({"uid": a["data-uid"], "cols": []})
        elif tag == "div" and cls.startswith("col "):
            self.sections[-1]["cols"].append({"name": cls.split()[1], "resps": []})
        elif tag == "div" and cls == "resp":
            self.sections[-1]["cols"][-1]["resps"].append({"key": a["data-key"], "toks": []})
        elif tag == "span" and cls == "tok":
            style = dict(p.split(":", 1) for p in a["style"].split(";"))
            self._tok = {"tok": a["data-tok"], "bg": style["background"], "title": a["title"], "shown": ""}
            self.sections[-1]["cols"][-1]["resps"][-1]["toks"].append(self._tok)
        elif tag == "span" and cls == "bar":
            self.legend = a

    def handle_endtag(self, tag):
        if tag == "span":
            self._tok = None

    def handle_data(self, data):
        if self._tok is not None:
            self._tok["shown"] += data


def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    page.close()
    return page


def _rgb(hex_colour: str) -> np.ndarray:
    return np.array([int(hex_colour[i : i + 2], 16) for i in (1, 3, 5)]) / 255.0


def _hex(rgba) -> str:
    return "#" + "".join(f"{int(round(c * 255)):02x}" for c in rgba[:3])


def _lum(rgb: np.ndarray) -> float:
    return float(0.2126 * rgb[0] + 0.7152 * rgb[1] + 0.0722 * rgb[2])


def _by_key(page: _Page) -> dict[str, list[dict]]:
    return {r["key"]: r["toks"] for s in page.sections for c in s["cols"] for r in c["resps"]}


# ---------------------------------------------------------------------------------------------------------------
# token_records
# ---------------------------------------------------------------------------------------------------------------


def test_token_records_drop_padding_and_keep_values():
    ids, mask, adv, ent, scores, uids = padded_responses()
    recs = padded_records(3)
    # Grouped by uid in order of first appearance: p0 rows (0, 1, 3) then p1 rows (2, 4).
    order = [0, 1, 3, 2, 4]
    assert [r["uid"] for r in recs] == [RESPONSES[i][0] for i in order]
    for rec, i in zip(recs, order, strict=True):
        _, toks, a, h, score = RESPONSES[i]
        assert rec["response_tokens"] == toks
        assert rec["token_ids"] == [ord(t) for t in toks]
        assert rec["advantages"] == a and rec["entropy"] == h  # no 99.0 from padding
        assert rec["score"] == score  # [B, L] scores summed over the mask only (padding junk 5.0 excluded)
        assert rec["step"] == 3 and rec["acc"] is None
        assert set(rec) == {
            "step",
            "uid",
            "key",
            "prompt",
            "response_tokens",
            "token_ids",
            "advantages",
            "entropy",
            "score",
            "acc",
            "model_mask",
        }
        assert rec["model_mask"] is None  # every token is the model's
    json.dumps(recs)  # JSON-ready


def test_token_records_max_groups_and_torch_input():
    torch = pytest.importorskip("torch")
    ids, mask, adv, ent, scores, uids = padded_responses()
    recs = token_records(
        step=0,
        uids=list(uids),
        responses=torch.from_numpy(ids),
        response_mask=torch.from_numpy(mask).bool(),
        tokenizer=ByteTokenizer(),
        advantages=torch.from_numpy(adv).to(torch.bfloat16),
        scores=torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0]),
        acc=torch.tensor([1, 0, 0, 1, 1]),
        max_groups=1,
    )
    assert [r["uid"] for r in recs] == ["p0", "p0", "p0"]
    assert [r["acc"] for r in recs] == [True, False, True]
    assert recs[1]["advantages"] == [-0.5, -1.0, -2.5, 0.0]  # exactly representable in bfloat16
    assert recs[0]["entropy"] is None


def test_token_records_merges_split_utf8_characters():
    text = "é=∑"  # 2-byte and 3-byte characters
    ids = list(text.encode())
    recs = token_records(
        step=0,
        uids=["u"],
        responses=np.array([ids + [0]]),
        response_mask=np.array([[1] * len(ids) + [0]]),
        tokenizer=ByteTokenizer(),
    )
    toks = recs[0]["response_tokens"]
    assert len(toks) == len(ids) == len(recs[0]["token_ids"])  # still 1:1 with ids
    assert toks == ["é", "", "=", "∑", "", ""]
    assert "".join(toks) == text


def test_records_from_batch_reads_transferqueue_fields():
    """The fields as verl's v1 trainer keeps them: jagged nested tensors plus non-tensor lists in a TensorDict."""
    torch = pytest.importorskip("torch")
    from verl.utils import tensordict_utils as tu

    def nested(rows, dtype):
        return torch.nested.as_nested_tensor([torch.tensor(r, dtype=dtype) for r in rows], layout=torch.jagged)

    rows = RESPONSES
    scores = [[0.0] * (len(t) - 1) + [s] for _, t, _, _, s in rows]
    data = tu.get_tensordict(
        {
            "uid": [u for u, *_ in rows],
            "prompts": nested([[ord(c) for c in f"Q {u}?"] for u, *_ in rows], torch.int64),
            "responses": nested([[ord(c) for c in t] for _, t, *_ in rows], torch.int64),
            "advantages": nested([a for *_, a, _, _ in rows], torch.float32),
            "entropy": nested([h for *_, h, _ in rows], torch.float32),
            "rm_scores": nested(scores, torch.float32),
            "extra_fields": [{"reward_extra_info": {"acc": s > 0, "pred": "2"}} for *_, s in rows],
        }
    )
    keys = [f"{u}_0_{i}" for i, (u, *_) in enumerate(rows)]
    recs = records_from_batch(data, tokenizer=ByteTokenizer(), step=4, keys=keys, max_groups=None)
    order = [0, 1, 3, 2, 4]  # grouped by uid
    assert [r["key"] for r in recs] == [keys[i] for i in order]
    for rec, i in zip(recs, order, strict=True):
        uid, toks, a, h, s = rows[i]
        assert rec["response_tokens"] == toks  # lengths from the nested offsets: no padding tokens
        assert np.allclose(rec["advantages"], a) and np.allclose(rec["entropy"], h)
        assert rec["score"] == s and rec["acc"] is (s > 0) and rec["prompt"] == f"Q {uid}?" and rec["step"] == 4
    one = records_from_batch(data, tokenizer=ByteTokenizer(), step=4, max_groups=1)
    assert [r["uid"] for r in one] == ["p0"] * 3 and one[0]["key"] is None
    with pytest.raises(ValueError, match="missing field"):
        records_from_batch({"uid": ["a"]}, tokenizer=ByteTokenizer(), step=0)


@pytest.mark.parametrize(
    ("kw", "msg"),
    [
        ({"response_mask": np.ones((5, 9))}, "response_mask shape"),
        ({"advantages": np.zeros((5, 3))}, "advantages shape"),
        ({"uids": ["a"]}, "uids must have 5"),
        ({"scores": np.zeros(4)}, "scores must be"),
        ({"max_groups": 0}, "max_groups=0"),
    ],
)
def test_token_records_rejects_bad_shapes(kw, msg):
    ids, mask, adv, ent, scores, uids = padded_responses()
    args = {"step": 0, "uids": uids, "responses": ids, "response_mask": mask, "tokenizer": ByteTokenizer()}
    args.update(kw)
    with pytest.raises(ValueError, match=msg):
        token_records(**args)


# ---------------------------------------------------------------------------------------------------------------
# HTML
# ---------------------------------------------------------------------------------------------------------------


def test_html_has_every_token_in_order_grouped_correct_incorrect(dump, tmp_path):
    page = _parse(render_html(load_responses(dump), tmp_path / "a.html", color="advantage"))
    assert [s["uid"] for s in page.sections] == ["p0", "p1"]
    for s in page.sections:
        assert [c["name"] for c in s["cols"]] == ["correct", "incorrect"]
        for c in s["cols"]:
            for r in c["resps"]:
                i = int(r["key"].rsplit("_", 1)[1])
                uid, toks, _, _, score = RESPONSES[i]
                assert uid == s["uid"]
                assert (score > 0) == (c["name"] == "correct")
                assert [t["tok"] for t in r["toks"]] == toks  # every token, in order, exact text
    keys = [r["key"] for s in page.sections for c in s["cols"] for r in c["resps"]]
    assert sorted(keys) == sorted(f"{u}_0_{i}" for i, (u, *_) in enumerate(RESPONSES))


def test_html_escapes_and_shows_whitespace(dump, tmp_path):
    path = render_html(load_responses(dump), tmp_path / "a.html", color="advantage")
    raw = path.read_text(encoding="utf-8")
    page = _parse(path)
    assert "b" not in page.tags  # the "<", "b", ">" tokens never form a tag
    assert "&lt;" in raw and "&gt;" in raw and "&amp;" in raw
    assert "<x>" not in raw  # prompt text is escaped too
    contents = re.findall(r'<span class="tok"[^>]*>(.*?)</span>', raw, flags=re.S)
    assert len(contents) == sum(len(t) for _, t, *_ in RESPONSES)
    for c in contents:  # token text is escaped in the markup itself, not only tolerated by a lenient parser
        assert "<" not in c and ">" not in c and not re.search(r"&(?!(amp|lt|gt|quot|#x27|#\d+);)", c), c
    assert "<script" not in raw and "http" not in raw  # self-contained: no external assets
    toks = _by_key(page)["p0_0_0"]
    shown = {t["tok"]: t["shown"] for t in toks}
    assert shown["<"] == "<" and shown["&"] == "&"  # after unescaping, the text is the token itself
    assert shown["\n"] == "↵\n"  # newline visible and still breaks the line
    assert _by_key(page)["p0_0_1"][1]["shown"] == "·"  # whitespace-only token made visible
    assert _by_key(page)["p1_0_2"][1]["shown"] == "⇥"
    quotes = [t["tok"] for t in _by_key(page)["p1_0_4"]]
    assert quotes[:2] == ["'", '"']  # quotes survive attribute escaping


def test_html_advantage_colours_follow_advantages(dump, tmp_path):
    page = _parse(render_html(load_responses(dump), tmp_path / "a.html", color="advantage"))
    toks = _by_key(page)
    vmax = max(abs(v) for _, _, a, _, _ in RESPONSES for v in a)  # symmetric scale, padding (99) excluded
    assert vmax == 2.5  # |most negative| > most positive: the scale is symmetric, not [min, max]
    cmap = colormaps[ADVANTAGE_CMAP]
    pos, neg = [], []
    for i, (uid, _, adv, _, _) in enumerate(RESPONSES):
        for t, a in zip(toks[f"{uid}_0_{i}"], adv, strict=True):
            assert t["bg"] == _hex(cmap(0.5 + 0.5 * a / vmax)), (t, a)
            assert t["title"].startswith(f"advantage={a!r}")  # exact value on hover
            rgb = _rgb(t["bg"])
            if a == 0:
                assert rgb.min() > 0.9  # centre of the diverging map: near white
            elif a > 0:
                assert rgb[2] > rgb[0]  # positive: blue side
                pos.append((a, _lum(rgb)))
            else:
                assert rgb[0] > rgb[2]  # negative: red side
                neg.append((-a, _lum(rgb)))
    # Monotone intensity: larger |A| -> darker box, on both sides.
    for side in (pos, neg):
        side = sorted(set(side))
        assert len(side) >= 3
        lums = [lum for _, lum in side]
        assert all(b < a for a, b in zip(lums, lums[1:], strict=False)), side
    legend = page.legend
    assert float(legend["data-vmin"]) == -2.5 and float(legend["data-vmax"]) == 2.5


def test_html_entropy_colours_follow_entropy(dump, tmp_path):
    page = _parse(render_html(load_responses(dump), tmp_path / "e.html", color="entropy"))
    toks = _by_key(page)
    hmax = max(v for _, _, _, h, _ in RESPONSES for v in h)
    cmap = colormaps[ENTROPY_CMAP]
    seen = []
    for i, (uid, _, _, ent, _) in enumerate(RESPONSES):
        for t, h in zip(toks[f"{uid}_0_{i}"], ent, strict=True):
            assert t["bg"] == _hex(cmap(h / hmax)), (t, h)
            assert t["title"].startswith(f"entropy={h!r}")
            seen.append((h, _lum(_rgb(t["bg"]))))
    seen = sorted(set(seen))
    lums = [lum for _, lum in seen]
    assert all(b <= a for a, b in zip(lums, lums[1:], strict=False))  # more entropy -> darker
    assert lums[0] - lums[-1] > 0.4
    # Not the advantage colouring: token "b" of response 0 has A = 1.0 but H = 0.4.
    adv_page = _parse(render_html(load_responses(dump), tmp_path / "a.html", color="advantage"))
    assert _by_key(adv_page)["p0_0_0"][2]["bg"] != toks["p0_0_0"][2]["bg"]


def test_html_fixed_vmax_and_max_prompts(dump, tmp_path):
    page = _parse(render_html(load_responses(dump), tmp_path / "a.html", color="advantage", vmax=4.0, max_prompts=1))
    assert [s["uid"] for s in page.sections] == ["p0"]
    tok = _by_key(page)["p0_0_0"][3]  # A = 2.0 on a +-4 scale
    assert tok["bg"] == _hex(colormaps[ADVANTAGE_CMAP](0.75))


# ---------------------------------------------------------------------------------------------------------------
# PNG
# ---------------------------------------------------------------------------------------------------------------


def test_png_valid_and_carries_the_colours(dump, tmp_path):
    path = render_png(load_responses(dump), tmp_path / "a.png", color="advantage")
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 2000
    img = imread(path)[..., :3]
    assert img.shape[0] > 100 and img.shape[1] > 300
    # The boxes of the most positive (A = +2) and most negative (A = -2.5) tokens appear as solid colour.
    for a in (2.0, -2.5):
        want = np.array(colormaps[ADVANTAGE_CMAP](0.5 + 0.5 * a / 2.5)[:3])
        assert (np.abs(img - want).max(-1) < 0.02).sum() > 20, a


# ---------------------------------------------------------------------------------------------------------------
# verl's text dumps, folders, CLI
# ---------------------------------------------------------------------------------------------------------------


def _write_verl_dump(folder: Path, step: int) -> None:
    """Write a rollout dump with verl's own writer, exactly as trainer.rollout_data_dir does."""
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    keys = ["uA_0_0", "uA_0_1", "uB_0_0", "uB_0_1"]
    PPOTrainer._write_generations(
        inputs=["What is 1+1?", "What is 1+1?", "x < y & z?", "x < y & z?"],
        outputs=["It is 2.\nDone", "It is 3.", "yes <b>", "no"],
        gts=["2", "2", "yes", "yes"],
        scores=[1.0, -1.0, 1.0, -1.0],
        reward_extra_infos_dict={"uid": keys},
        dump_path=str(folder),
        global_steps=step,
    )


def test_verl_rollout_dump_renders_by_score(tmp_path):
    folder = tmp_path / "rollouts"
    _write_verl_dump(folder, 5)
    rec = json.loads((folder / "5.jsonl").read_text().splitlines()[0])
    assert set(rec) == {"input", "output", "gts", "score", "step", "uid"}  # what verl 0.9.1 writes
    responses = load_responses(folder / "5.jsonl")
    assert [r.uid for r in responses] == ["uA", "uA", "uB", "uB"]  # prompt uid from "<uid>_<session>_<index>"
    assert "".join(responses[0].tokens) == "It is 2.\nDone"
    with pytest.raises(ValueError, match="--color score"):
        render_html(responses, tmp_path / "x.html", color="advantage")
    res = render_tokens(folder, tmp_path / "out", color="score")
    page = _parse(res["html"])
    assert [s["uid"] for s in page.sections] == ["uA", "uB"]
    ok = page.sections[0]["cols"][0]["resps"][0]["toks"]
    assert [t["tok"] for t in ok] == ["It", " ", "is", " ", "2", ".", "\n", "Done"]
    assert len({t["bg"] for t in ok}) == 1 and _rgb(ok[0]["bg"])[2] > _rgb(ok[0]["bg"])[0]  # score +1: blue
    assert res["png"].read_bytes()[:8] == PNG_MAGIC
    page_none = _parse(render_tokens(folder, tmp_path / "out", color="none", png=False)["html"])
    assert {t["bg"] for s in page_none.sections for c in s["cols"] for r in c["resps"] for t in r["toks"]} == {
        "#ffffff"
    }


def test_verl_dump_with_tokenizer(tmp_path):
    _write_verl_dump(tmp_path, 1)
    responses = load_responses(tmp_path / "1.jsonl", tokenizer=ByteTokenizer())
    assert responses[2].tokens == list("yes <b>") and responses[2].token_ids == list(b"yes <b>")


def test_find_dump_prefers_token_dumps_and_latest_step(dump, tmp_path):
    folder = dump.parent
    _write_verl_dump(folder, 9)
    assert find_dump(folder) == dump  # ours win over verl's text dumps
    assert find_dump(folder, step=9) == folder / "9.jsonl"
    with pytest.raises(ValueError, match="no such file"):
        find_dump(tmp_path / "missing")


def test_bad_dump_lines_name_the_line(tmp_path):
    p = tmp_path / "tokens_1.jsonl"
    p.write_text(json.dumps({"uid": "u", "response_tokens": ["a", "b"], "advantages": [1.0]}) + "\n")
    with pytest.raises(ValueError, match=r"tokens_1.jsonl:1: advantages has 1 values for 2"):
        load_responses(p)
    p.write_text("{not json\n")
    with pytest.raises(ValueError, match="invalid JSON"):
        load_responses(p)


def test_cli_tokens(dump, tmp_path, capsys):
    out = tmp_path / "viz"
    assert viz_main(["tokens", "--input", str(dump.parent), "--out", str(out), "--color", "entropy"]) == 0
    assert (out / "tokens_7.entropy.html").is_file()
    assert (out / "tokens_7.entropy.png").read_bytes()[:8] == PNG_MAGIC
    assert "2 prompts, 5 responses" in capsys.readouterr().out
    assert viz_main(["tokens", "--input", str(tmp_path / "nope"), "--out", str(out)]) == 2


# ---------------------------------------------------------------------------------------------------------------
# Reading at a glance: boundaries, prompt text, two signals, long responses
# ---------------------------------------------------------------------------------------------------------------


def _one_response_dump(tmp_path: Path, tokens, adv, ent, prompt="say 3", name="tokens_1.jsonl") -> Path:
    rec = {
        "step": 1,
        "uid": "0b6b4f6e-uuid",
        "key": "0b6b4f6e-uuid_0_0",
        "prompt": prompt,
        "response_tokens": list(tokens),
        "token_ids": list(range(len(tokens))),
        "advantages": list(adv),
        "entropy": list(ent),
        "score": 1.0,
        "acc": True,
    }
    return write_token_dump([rec], tmp_path / name)


def test_png_token_boundaries_are_visible(tmp_path):
    # Four tokens of the same colour that read "33twois" when drawn edge to edge.
    dump = _one_response_dump(tmp_path, ["3", "3", "two", "is"], [1.0] * 4, [0.5] * 4)
    path = render_png(load_responses(dump), tmp_path / "b.png", color="advantage")
    img = imread(path)[..., :3]
    box = np.array(colormaps[ADVANTAGE_CMAP](1.0)[:3])  # A = vmax
    is_box = np.abs(img - box).max(-1) < 0.02
    band = is_box.sum(1) > 0.5 * is_box.sum(1).max()  # the rows the boxes span
    has_box = is_box[band].any(0)  # glyph columns still have box pixels above and below the glyph
    x0, x1 = np.flatnonzero(has_box)[[0, -1]]
    inner = has_box[x0 : x1 + 1].astype(int)
    edges = np.flatnonzero(np.diff(inner))
    gaps = [(a, b) for a, b in zip(edges[::2], edges[1::2], strict=True) if b - a >= 2]  # >= 2 px with no box
    assert len(gaps) == 3  # between the four tokens


def test_prompt_text_names_the_group(tmp_path):
    from gtpo.viz.heatmap_style import prompt_preview

    chat = "system\nYou are Qwen, created by Alibaba Cloud.\nuser\nWhat is  1+1?\nassistant\n"
    assert prompt_preview(chat, "u") == "“What is 1+1?”"  # the user turn, whitespace collapsed
    assert prompt_preview("x" * 100, "u", limit=12) == "“xxxxxxxxx…”"
    assert prompt_preview(None, "u-1") == "prompt u-1"
    dump = _one_response_dump(tmp_path, ["3"], [1.0], [0.5], prompt=chat)
    raw = render_html(load_responses(dump), tmp_path / "p.html").read_text(encoding="utf-8")
    assert re.search(r"<h2>“What is 1\+1\?”", raw)
    assert "<h2>prompt 0b6b4f6e" not in raw


def test_html_entropy_strip_and_both_values_on_hover(dump, tmp_path):
    path = render_html(load_responses(dump), tmp_path / "a.html", color="advantage")
    raw = path.read_text(encoding="utf-8")
    page = _parse(path)
    hmax = max(v for _, _, _, h, _ in RESPONSES for v in h)
    cmap = colormaps[ENTROPY_CMAP]
    spans = re.findall(r'<span class="tok" [^>]*style="([^"]*)"', raw)
    strips = [dict(p.split(":", 1) for p in st.split(";"))["border-bottom-color"] for st in spans]
    want = [_hex(cmap(h / hmax)) for s in page.sections for c in s["cols"] for r in c["resps"] for h in _ent(r)]
    assert strips == want  # the strip under each token is its entropy, on one scale for the page
    bar = re.search(r'class="strip-bar"[^>]*data-vmin="([^"]+)" data-vmax="([^"]+)"', raw)
    assert bar and float(bar.group(1)) == 0.0 and float(bar.group(2)) == hmax
    tok = _by_key(page)["p0_0_0"][3]
    assert tok["title"].startswith("advantage=2.0") and "entropy=0.8" in tok["title"]


def _ent(resp: dict) -> list[float]:
    i = int(resp["key"].rsplit("_", 1)[1])
    return RESPONSES[i][3]


def test_special_tokens_are_marked(tmp_path):
    dump = _one_response_dump(tmp_path, ["4", "<|im_end|>", "<unk>", "<b>"], [1.0] * 4, [0.5] * 4)
    raw = render_html(load_responses(dump), tmp_path / "s.html").read_text(encoding="utf-8")
    marked = re.findall(r'data-tok="([^"]*)"[^>]*data-special', raw)
    assert marked == ["&lt;|im_end|&gt;", "&lt;unk&gt;"]  # an HTML-looking "<b>" is not a special token


def test_credited_spans_hand_computed():
    from gtpo.viz.heatmap_style import credited_spans

    v = np.array([0.0, 0.0, 5.0, 5.0, 0.0, 1.0, -3.0, -3.0, 0.0, np.nan])
    assert credited_spans(v, 2, 1) == [("most", 2, 4, 5.0), ("least", 6, 8, -3.0)]
    spans = credited_spans(v, 2, 2)
    assert [s[:3] for s in spans] == [("most", 2, 4), ("most", 4, 6), ("least", 6, 8), ("least", 0, 2)]
    taken = np.zeros(10, dtype=int)
    for _, a, b, _ in spans:
        taken[a:b] += 1
    assert taken.max() == 1  # never overlapping, never on both sides
    assert credited_spans(np.array([np.nan, 1.0]), 1, 1) == [("most", 1, 2, 1.0)]  # NaN windows are never picked


def _long_response(n: int = 4096):
    rng = np.random.default_rng(0)
    tokens = [("·" if i % 7 == 0 else "") + f"w{i % 97}" for i in range(n)]
    adv = rng.normal(0, 0.1, n)
    adv[1000:1024] = 3.0  # the most credited span
    adv[3000:3024] = -3.0  # the least credited span
    return tokens, adv, rng.gamma(1.0, 1.0, n)


def test_4096_token_response_stays_legible_in_compact_mode(tmp_path):
    tokens, adv, ent = _long_response()
    dump = _one_response_dump(tmp_path, tokens, adv, ent)
    path = render_png(load_responses(dump), tmp_path / "long.png", color="advantage", span_tokens=24)
    img = imread(path)[..., :3]
    # One response of 4,096 tokens wrapped in full would need ~300 rows; compact mode draws a screenful.
    assert img.shape[0] < 900
    short = render_png(load_responses(dump), tmp_path / "full.png", png_max_tokens=5000)
    assert imread(short).shape[0] > 4 * img.shape[0]
    # Both hand-placed spans are drawn as token boxes in the extreme colours of the scale.
    vmax = float(np.abs(adv).max())
    for a in (3.0, -3.0):
        want = np.array(colormaps[ADVANTAGE_CMAP](0.5 + 0.5 * a / vmax)[:3])
        assert (np.abs(img - want).max(-1) < 0.02).sum() > 400, a


def test_compact_mode_reports_span_positions(tmp_path, monkeypatch):
    import gtpo.viz.heatmap_png as png

    drawn = []
    original = png._Canvas.text
    monkeypatch.setattr(
        png._Canvas, "text", lambda self, x, y, s, *a, **k: (drawn.append(s), original(self, x, y, s, *a, **k))
    )
    tokens, adv, ent = _long_response()
    render_png(load_responses(_one_response_dump(tmp_path, tokens, adv, ent)), tmp_path / "l.png", span_tokens=24)
    heads = [s for s in drawn if "credited · tokens" in s]
    assert heads[0].startswith("+1 most credited · tokens 1,000–1,023 · mean advantage +3")
    assert any(h.startswith("−1 least credited · tokens 3,000–3,023 · mean advantage -3") for h in heads)
    assert any("overview of all 4,096 tokens" in s for s in drawn)


def test_verl_dump_with_an_empty_response(tmp_path):
    class BatchTokenizer(ByteTokenizer):
        def batch_decode(self, seqs, skip_special_tokens=False):
            return [self.decode(s) for s in seqs] or [""]  # as transformers 5 answers an empty batch

    p = tmp_path / "3.jsonl"
    p.write_text(json.dumps({"input": "say 3", "output": "", "score": 0.0, "step": 3, "uid": "u_0_0"}) + "\n")
    (resp,) = load_responses(p, tokenizer=BatchTokenizer())
    assert resp.tokens == [] and resp.token_ids == []


def test_cli_compact_mode_options(tmp_path, capsys):
    tokens, adv, ent = _long_response(1500)
    dump = _one_response_dump(tmp_path, tokens, adv, ent)
    out = tmp_path / "viz"
    assert viz_main(["tokens", "--input", str(dump), "--out", str(out), "--png-max-tokens", "2000"]) == 0
    full = imread(out / "tokens_1.advantage.png").shape[0]
    assert viz_main(["tokens", "--input", str(dump), "--out", str(out), "--span-tokens", "8"]) == 0
    assert imread(out / "tokens_1.advantage.png").shape[0] < full / 2  # 1,500 tokens > 240: compact


# ---------------------------------------------------------------------------------------------------------------
# tool-output tokens inside multi-turn responses
# ---------------------------------------------------------------------------------------------------------------


def _tool_batch():
    """Two responses of one prompt: "ab" + tool output "[7]" + "c", and "xy" without a tool call."""
    texts = ["ab[7]c", "xy"]
    width = 6
    ids = np.zeros((2, width), dtype=np.int64)
    length = np.zeros((2, width), dtype=bool)
    for r, t in enumerate(texts):
        ids[r, : len(t)] = [ord(c) for c in t]
        length[r, : len(t)] = True
    model = length.copy()
    model[0, 2:5] = False  # "[7]" came from the tool
    adv = np.where(model, np.array([[1.0, -2.0, 0.0, 0.0, 0.0, 0.5], [0.25, -0.25, 0, 0, 0, 0]]), 0.0)
    ent = np.where(length, 0.5, np.nan)
    ent[0, 2:5] = 9.0  # verl's old-log-prob pass computes it on tool tokens too; nobody reads it
    return ids, length, model, adv, ent


def test_tool_tokens_are_kept_marked_and_carry_no_values(tmp_path):
    ids, length, model, adv, ent = _tool_batch()
    recs = token_records(
        step=3, uids=["p", "p"], responses=ids, response_mask=length, tokenizer=ByteTokenizer(), advantages=adv,
        entropy=ent, scores=[1.0, -1.0], model_mask=model,
    )  # fmt: skip
    assert recs[0]["response_tokens"] == list("ab[7]c") and recs[0]["model_mask"] == [1, 1, 0, 0, 0, 1]
    assert recs[0]["advantages"] == [1.0, -2.0, None, None, None, 0.5]
    assert recs[0]["entropy"] == [0.5, 0.5, None, None, None, 0.5]
    assert recs[1]["model_mask"] is None and recs[1]["entropy"] == [0.5, 0.5]  # a single-turn response as before
    dump = write_token_dump(recs, tmp_path / "tokens_3.jsonl")
    first = load_responses(dump)[0]
    assert first.tool.tolist() == [False, False, True, True, True, False]
    assert "3 from tools" in render_html(load_responses(dump), tmp_path / "m.html").read_text(encoding="utf-8")


def test_records_from_batch_marks_the_tool_tokens_of_jagged_responses():
    torch = pytest.importorskip("torch")
    from verl.utils import tensordict_utils as tu

    ids, length, model, adv, ent = _tool_batch()
    lengths = length.sum(-1)

    def nested(values, dtype):
        return torch.nested.as_nested_tensor(
            [torch.tensor(v[:n], dtype=dtype) for v, n in zip(values, lengths, strict=True)], layout=torch.jagged
        )

    data = tu.get_tensordict(
        {
            "uid": ["p", "p"],
            "responses": nested(ids, torch.int64),
            "response_mask": nested(model.astype(np.int64), torch.int64),
            "advantages": nested(adv, torch.float32),
            "entropy": nested(ent, torch.float32),
        }
    )
    recs = records_from_batch(data, tokenizer=ByteTokenizer(), step=1)
    assert recs[0]["response_tokens"] == list("ab[7]c") and recs[0]["model_mask"] == [1, 1, 0, 0, 0, 1]
    assert recs[0]["entropy"][2:5] == [None, None, None]


def test_tool_tokens_are_grey_without_a_strip(tmp_path):
    ids, length, model, adv, ent = _tool_batch()
    recs = token_records(
        step=3, uids=["p", "p"], responses=ids, response_mask=length, tokenizer=ByteTokenizer(), advantages=adv,
        entropy=ent, scores=[1.0, -1.0], model_mask=model,
    )  # fmt: skip
    dump = write_token_dump(recs, tmp_path / "tokens_3.jsonl")
    raw = render_html(load_responses(dump), tmp_path / "t.html", color="advantage").read_text(encoding="utf-8")
    spans = re.findall(r'<span class="tok" ([^>]*)>', raw)
    tool = [s for s in spans if "data-tool" in s and "data-i" in s]
    assert [re.search(r'data-tok="([^"]*)"', s).group(1) for s in tool] == ["[", "7", "]"]
    for s in tool:
        assert "background:#d4d4d4" in s and "border-bottom" not in s and "masked: no advantage" in s
    model_spans = [s for s in spans if "data-tool" not in s]
    assert all("border-bottom-color" in s for s in model_spans)  # every model token keeps its entropy strip
    assert "a tool&#x27;s output inside the response" in raw or "a tool's output inside the response" in raw
    # the PNG draws the grey face and omits those three strips
    png = render_png(load_responses(dump), tmp_path / "t.png", color="advantage")
    img = imread(png)[..., :3]
    assert (np.abs(img - _rgb("#d4d4d4")).max(-1) < 0.01).sum() > 50


def test_png_rows_skip_the_strip_of_tool_tokens():
    from gtpo.viz import heatmap_png

    cv = heatmap_png._Canvas()
    box = np.ones((4, 4))
    strip = np.zeros((4, 4))
    strip[:, 3] = 1.0
    heatmap_png._token_rows(cv, 0, 0, list("abcd"), box, strip, 40, np.array([False, True, True, False]))
    faces = [face for *_, face, _, _ in cv.rects]
    assert faces == ["#ffffff", "#000000", "#d4d4d4", "#d4d4d4", "#ffffff", "#000000"]
