"""What both heatmap renderers share: the colour scales, the values each token shows, grouping and labels.

One figure, two signals: the box colour of each token shows the chosen ``color`` mode on one scale fitted over
every token of the figure, and a thin strip under each box (hover text in the HTML) shows the other per-token
signal: entropy under advantage boxes, advantage under entropy boxes (:func:`strip_mode`). A tool-output token inside
a multi-turn response (``model_mask`` 0 in the dump) has neither: it is drawn as a grey box with grey text
(:data:`TOOL_FACE`, :data:`TOOL_TEXT`) and no strip, since no advantage reaches it and no estimator reads its entropy.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gtpo.viz.dump_reader import Response

__all__ = [
    "ADVANTAGE_CMAP",
    "COLOR_MODES",
    "ENTROPY_CMAP",
    "TOOL_FACE",
    "TOOL_LEGEND",
    "TOOL_TEXT",
    "ColorScale",
    "credited_spans",
    "prompt_preview",
]

ADVANTAGE_CMAP = "RdBu"
ENTROPY_CMAP = "YlOrRd"
COLOR_MODES = ("advantage", "entropy", "score", "none")
# Tool-output tokens: a grey outside every colour scale (an advantage of 0 draws white), grey text, no strip.
TOOL_FACE = "#d4d4d4"
TOOL_TEXT = "#5f5f5f"
TOOL_LEGEND = "grey box, no strip: a tool's output inside the response (masked: no advantage, its entropy unused)"
# Special tokens as tokenizers print them: <|im_end|>, <|endoftext|>, <unk>, </s>, <s>, <pad>, <eos>.
_SPECIAL_RE = re.compile(r"^<\|[^|<>\s]+\|>$|^</?(s|unk|pad|eos|bos|mask)>$")
# Chat-templated prompts decoded without special tokens read "system\n...\nuser\n<question>\nassistant\n".
_CHAT_USER_RE = re.compile(r"(?:^|\n)user\n(?P<content>.*?)(?:\n?assistant\n?)?$", re.S)


@dataclass(frozen=True)
class ColorScale:
    """Value -> RGBA mapping. ``advantage``/``score``: symmetric diverging; ``entropy``: sequential from 0."""

    mode: str
    vmin: float
    vmax: float

    @property
    def cmap_name(self) -> str | None:
        return {"advantage": ADVANTAGE_CMAP, "score": ADVANTAGE_CMAP, "entropy": ENTROPY_CMAP}.get(self.mode)

    @classmethod
    def fit(cls, mode: str, values: Sequence[np.ndarray], vmax: float | None = None) -> ColorScale:
        """Scale over all rendered values (so colours compare across responses); ``vmax`` overrides it."""
        if mode not in COLOR_MODES:
            raise ValueError(f"color={mode!r}: expected one of {COLOR_MODES}")
        if vmax is not None and not (vmax > 0 and math.isfinite(vmax)):
            raise ValueError(f"vmax={vmax}: must be a positive finite number")
        flat = np.concatenate([np.asarray(v, dtype=np.float64) for v in values]) if values else np.zeros(0)
        flat = flat[np.isfinite(flat)]
        if mode == "entropy":
            top = vmax if vmax is not None else (float(flat.max()) if flat.size else 0.0)
            return cls(mode, 0.0, top if top > 0 else 1.0)
        top = vmax if vmax is not None else (float(np.abs(flat).max()) if flat.size else 0.0)
        top = top if top > 0 else 1.0  # all zeros: any scale draws white
        return cls(mode, -top, top)

    def normalize(self, values: np.ndarray) -> np.ndarray:
        """Values -> ``[0, 1]`` colormap positions (clipped); 0 maps to 0.5 on diverging scales."""
        v = np.asarray(values, dtype=np.float64)
        return np.clip((v - self.vmin) / (self.vmax - self.vmin), 0.0, 1.0)

    def rgba(self, values: np.ndarray) -> np.ndarray:
        """``[T]`` values -> ``[T, 4]`` RGBA floats; NaN (missing) and mode ``none`` -> white."""
        v = np.asarray(values, dtype=np.float64)
        out = np.ones((v.shape[0], 4))
        if self.cmap_name is None:
            return out
        from matplotlib import colormaps

        ok = np.isfinite(v)
        out[ok] = colormaps[self.cmap_name](self.normalize(v[ok]))
        return out


def hex_colors(rgba: np.ndarray) -> list[str]:
    rgb = np.clip(np.rint(np.asarray(rgba)[:, :3] * 255), 0, 255).astype(int)
    return [f"#{r:02x}{g:02x}{b:02x}" for r, g, b in rgb]


def text_is_dark(rgba: np.ndarray) -> np.ndarray:
    """Dark text on light boxes (relative luminance > 0.5)."""
    lum = 0.2126 * rgba[:, 0] + 0.7152 * rgba[:, 1] + 0.0722 * rgba[:, 2]
    return lum > 0.5


def token_values(resp: Response, mode: str) -> np.ndarray | None:
    """The ``[T]`` values a mode shows, NaN on tool-output tokens (they carry none)."""
    n = len(resp.tokens)
    if mode == "advantage":
        values = resp.advantages
    elif mode == "entropy":
        values = resp.entropy
    elif mode == "score":
        values = None if resp.score is None else np.full(n, resp.score)
    else:
        return np.full(n, math.nan)
    if values is None or resp.model_mask is None:
        return values
    return np.where(resp.model_mask, values, math.nan)


def check_mode(responses: Sequence[Response], mode: str) -> None:
    if mode not in COLOR_MODES:
        raise ValueError(f"color={mode!r}: expected one of {COLOR_MODES}")
    field = {"advantage": "advantages", "entropy": "entropy", "score": "score"}.get(mode)
    for r in responses:
        if field is not None and token_values(r, mode) is None:
            raise ValueError(
                f"color={mode}: response {r.key or r.uid} has no '{field}' (verl's rollout dumps are text only: "
                "use --color score or --color none, or write token dumps with gtpo.viz.tokens.token_records)"
            )


# --------------------------------------------------------------------------------------------------------------
# Grouping
# --------------------------------------------------------------------------------------------------------------


def columns(group: list[Response]) -> list[tuple[str, list[Response]]]:
    cols = [
        ("correct", [r for r in group if r.correct is True]),
        ("incorrect", [r for r in group if r.correct is False]),
    ]
    ungraded = [r for r in group if r.correct is None]
    if ungraded:
        cols.append(("ungraded", ungraded))
    return cols


def group_by_prompt(responses: Sequence[Response], max_prompts: int | None) -> list[list[Response]]:
    if max_prompts is not None and max_prompts < 1:
        raise ValueError(f"max_prompts={max_prompts}: must be >= 1 or None")
    groups: dict[str, list[Response]] = {}
    for r in responses:
        groups.setdefault(r.uid, []).append(r)
    return list(groups.values())[:max_prompts]


def mode_label(mode: str) -> str:
    return {"advantage": "advantage", "entropy": "entropy", "score": "score", "none": "token"}[mode]


def strip_mode(mode: str, responses: Sequence[Response]) -> str | None:
    """The signal drawn as a strip under each token: the other one of advantage / entropy, when every response has
    it; ``None`` otherwise (verl's text dumps, or a dump without entropy)."""
    other = {"advantage": "entropy", "entropy": "advantage", "score": "advantage"}.get(mode)
    if other is None or not responses or any(token_values(r, other) is None for r in responses):
        return None
    return other


def figure_scales(
    color: str, shown: Sequence[Response], vmax: float | None = None
) -> tuple[ColorScale, ColorScale | None]:
    """The box scale and the strip scale of one figure, each fitted once over every shown token."""
    check_mode(shown, color)
    scale = ColorScale.fit(color, [token_values(r, color) for r in shown] if color != "none" else [], vmax)
    strip = strip_mode(color, shown)
    return scale, (ColorScale.fit(strip, [token_values(r, strip) for r in shown]) if strip else None)


def scale_label(scale: ColorScale) -> str:
    """The legend's statement of a scale, e.g. ``advantage, -2.06 .. +2.06 (0 = white)``."""
    if scale.mode == "entropy":
        return f"entropy (nats), {scale.vmin:.3g} .. {scale.vmax:.3g}"
    return f"{mode_label(scale.mode)}, {scale.vmin:+.3g} .. {scale.vmax:+.3g} (0 = white)"


def is_special(token: str) -> bool:
    """Whether ``token`` is a special token's text (``<|im_end|>``, ``<unk>``, ``</s>``, ...)."""
    return bool(_SPECIAL_RE.match(token))


def display_text(token: str) -> str:
    """What a token box shows: spaces as ``·``, tab ``⇥``, newline ``↵``, carriage return ``␍``."""
    return token.replace(" ", "·").replace("\t", "⇥").replace("\r", "␍").replace("\n", "↵")


def prompt_preview(prompt: str | None, uid: str, limit: int = 80) -> str:
    """One line naming a prompt group: the prompt's text in quotes (the user turn of a chat-templated prompt),
    whitespace collapsed, at most ``limit`` characters; ``prompt <uid>`` when the dump has no prompt text."""
    if not prompt:
        return f"prompt {uid}"
    match = _CHAT_USER_RE.search(prompt)
    text = " ".join((match.group("content") if match else prompt).split())
    limit = max(limit - 2, 8)  # room for the quotes
    return f"“{text if len(text) <= limit else text[: limit - 1] + '…'}”"


def credited_spans(values: np.ndarray, span: int, k: int) -> list[tuple[str, int, int, float]]:
    """The ``k`` most and ``k`` least credited windows of ``span`` tokens, without overlap.

    Args:
        values: ``[T]`` per-token values (NaN = missing), e.g. advantages.
        span: window length in tokens (``T`` when shorter).
        k: windows per side.

    Returns:
        ``[(side, start, end, mean)]`` with ``side`` ``"most"`` or ``"least"``, ``values[start:end]`` the window
        and ``mean`` its mean over finite values; most credited first (by decreasing mean), then least credited
        (by increasing mean). A window chosen on one side is never chosen on the other.
    """
    v = np.asarray(values, dtype=np.float64)
    n = v.shape[0]
    span = max(1, min(span, n))
    if n == 0 or k < 1:
        return []
    ok = np.isfinite(v)
    # Windowed means over finite values by cumulative sums (vectorised over all T - span + 1 windows).
    sums = np.concatenate([[0.0], np.cumsum(np.where(ok, v, 0.0))])
    counts = np.concatenate([[0], np.cumsum(ok)])
    wsum = sums[span:] - sums[:-span]
    wcnt = counts[span:] - counts[:-span]
    means = np.where(wcnt > 0, wsum / np.maximum(wcnt, 1), np.nan)
    taken = np.zeros(n, dtype=bool)
    out: list[tuple[str, int, int, float]] = []
    for side, order in (
        ("most", np.argsort(-np.nan_to_num(means, nan=-np.inf), kind="stable")),
        ("least", np.argsort(np.nan_to_num(means, nan=np.inf), kind="stable")),
    ):
        picked = 0
        for start in order:
            if picked == k or not np.isfinite(means[start]):
                break
            if taken[start : start + span].any():
                continue
            taken[start : start + span] = True
            out.append((side, int(start), int(start + span), float(means[start])))
            picked += 1
    return out


def fmt_value(v: float) -> str:
    """Hover / data value: 6 significant digits (the dump keeps the exact float)."""
    return "nan" if not math.isfinite(v) else repr(float(f"{float(v):.6g}"))


def response_meta(r: Response, with_key: bool = True) -> str:
    parts = [f"{len(r.tokens):,} tokens"]
    if r.model_mask is not None:
        parts.append(f"{int(r.tool.sum()):,} from tools")
    if r.score is not None:
        parts.append(f"score={r.score:g}")
    if r.acc is not None:
        parts.append(f"acc={r.acc}")
    if r.advantages is not None and len(r.advantages):
        parts.append(f"mean adv={np.nanmean(r.advantages):+.4g}")
    if r.entropy is not None and len(r.entropy):
        parts.append(f"mean H={np.nanmean(r.entropy):.4g}")
    if r.key and with_key:
        parts.append(r.key)
    return " · ".join(parts)
