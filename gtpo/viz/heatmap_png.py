"""The heatmap as a PNG drawn with matplotlib's Agg canvas (no pyplot state).

Layout, top to bottom: the title; a legend band stating the box scale and the strip scale (one scale each for the
whole figure, drawn in rows of their own so nothing overlaps); then one block per prompt group, headed by the
prompt's text, with the correct and the incorrect responses side by side. Each token is a box with a gap after it
(so boundaries are visible), spaces shown as ``·``, newlines as ``↵`` (and a line break), special tokens framed;
under each box a thin strip shows the second signal (entropy under advantage boxes). A tool's output inside a
multi-turn response is a grey box with grey text and no strip. Lines wrap at ``width_chars`` character cells.

A response longer than ``png_max_tokens`` is drawn in compact mode: an overview row of the whole response (one
cell per bin of tokens, binned means of both signals) with the chosen spans outlined, then the
``spans_per_side`` most and least credited windows of ``span_tokens`` tokens (:func:`credited_spans`) with their
positions. The PNG keeps ``png_max_responses`` responses per column; the HTML keeps everything.
"""

from __future__ import annotations

import unicodedata
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gtpo.viz.dump_reader import Response
from gtpo.viz.heatmap_style import (
    TOOL_FACE,
    TOOL_LEGEND,
    TOOL_TEXT,
    ColorScale,
    columns,
    credited_spans,
    display_text,
    figure_scales,
    group_by_prompt,
    hex_colors,
    is_special,
    mode_label,
    prompt_preview,
    response_meta,
    scale_label,
    text_is_dark,
    token_values,
)

__all__ = ["render_png"]

# Advance width of DejaVu Sans Mono in em (1233 / 2048): one character cell = one layout unit along x.
_MONO_ADVANCE_EM = 0.602
_MONO_FONT = "DejaVu Sans Mono"
GAP = 0.45  # cells of white after each token box: the visible token boundary
COLUMN_GAP = 4.0  # cells between the correct and incorrect columns
LEGEND_BAR = 30.0  # cells of a legend colour bar
_SPAN_MARKS = {"most": "+", "least": "−"}


@dataclass
class _Canvas:
    """Draw commands in layout units: x in character cells, y in rows (0 at the top)."""

    rects: list[tuple[float, float, float, float, str, str, float]] = field(default_factory=list)
    texts: list[tuple[float, float, str, str, str, str, float]] = field(default_factory=list)

    def rect(self, x, y, w, h, face, edge="none", lw=0.0):
        self.rects.append((x, y, w, h, face, edge, lw))

    def text(self, x, y, s, color="#000", weight="normal", ha="left", scale=1.0):
        self.texts.append((x, y, s, color, weight, ha, scale))


def _cells(text: str) -> int:
    """Layout width of ``text`` in monospace cells (wide East Asian characters take 2)."""
    return sum(2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1 for ch in text)


def layout_tokens(tokens: Sequence[str], width: float) -> list[list[tuple[int, str, float, float]]]:
    """Wrap tokens into lines of ``width`` cells: lines of ``(token index, shown text, x, cells)``.

    Each token is followed by :data:`GAP` cells; a newline token ends its line; a token wider than a line is cut
    (the HTML keeps it whole); empty tokens (the tail of a merged UTF-8 span) take no room and are left out.
    """
    lines: list[list[tuple[int, str, float, float]]] = [[]]
    x = 0.0
    for i, tok in enumerate(tokens):
        if not tok:
            continue
        shown = display_text(tok)
        w = _cells(shown)
        if w > width:
            shown = shown[: int(width) - 1] + "…"
            w = _cells(shown)
        if x > 0 and x + w > width:
            lines.append([])
            x = 0.0
        lines[-1].append((i, shown, x, float(w)))
        x += w + GAP
        if "\n" in tok:
            lines.append([])
            x = 0.0
    if not lines[-1] and len(lines) > 1:
        lines.pop()
    return lines


def _token_rows(
    cv: _Canvas,
    x0: float,
    y: float,
    tokens: Sequence[str],
    box: np.ndarray,
    strip: np.ndarray | None,
    width: float,
    tool: np.ndarray | None = None,
) -> float:
    """Draw wrapped token boxes (colours ``box`` ``[T, 4]``, optional ``strip`` ``[T, 4]``; ``tool`` ``[T]`` bool: the
    tool-output tokens, grey and without a strip); returns the next row."""
    bgs, dark = hex_colors(box), text_is_dark(box)
    strips = hex_colors(strip) if strip is not None else None
    box_h = 0.62 if strips is not None else 0.8
    for line in layout_tokens(tokens, width):
        for i, shown, x, w in line:
            special = is_special(tokens[i])
            edge, lw = ("#222222", 0.9) if special else ("#00000050", 0.4)
            from_tool = tool is not None and bool(tool[i])
            cv.rect(x0 + x, y + 0.08, w, box_h, TOOL_FACE if from_tool else bgs[i], edge, lw)
            if strips is not None and not from_tool:
                cv.rect(x0 + x, y + 0.74, w, 0.2, strips[i])
            colour = TOOL_TEXT if from_tool else "#000" if dark[i] else "#fff"
            cv.text(x0 + x + w / 2, y + 0.08 + box_h / 2, shown, colour, "bold" if special else "normal", "center")
        y += 1
    return y


def _binned(values: np.ndarray, bins: int) -> np.ndarray:
    """``[T]`` -> ``[bins]`` means over consecutive equal-size chunks (NaN-aware; empty chunk -> NaN)."""
    n = values.shape[0]
    edges = np.linspace(0, n, bins + 1).round().astype(int)
    ok = np.isfinite(values)
    sums = np.concatenate([[0.0], np.cumsum(np.where(ok, values, 0.0))])
    counts = np.concatenate([[0], np.cumsum(ok)])
    cnt = counts[edges[1:]] - counts[edges[:-1]]
    return np.where(cnt > 0, (sums[edges[1:]] - sums[edges[:-1]]) / np.maximum(cnt, 1), np.nan)


def _compact_rows(
    cv: _Canvas,
    x0: float,
    y: float,
    r: Response,
    mode: str,
    scale: ColorScale,
    strip_scale: ColorScale | None,
    width: float,
    span_tokens: int,
    spans_per_side: int,
) -> float:
    """A long response: an overview row of the whole response, then its most and least credited spans."""
    values = token_values(r, mode)
    strip_values = token_values(r, strip_scale.mode) if strip_scale is not None else None
    n = len(r.tokens)
    bins = int(width)
    per_bin = n / bins
    spans = credited_spans(values, span_tokens, spans_per_side)
    cv.text(x0, y + 0.5, f"overview of all {n:,} tokens (one cell = {per_bin:.3g} tokens); spans marked:", "#555")
    y += 1
    box_rgba = scale.rgba(_binned(values, bins))
    strip_rgba = strip_scale.rgba(_binned(strip_values, bins)) if strip_scale is not None else None
    for b, colour in enumerate(hex_colors(box_rgba)):
        cv.rect(x0 + b, y + 0.08, 1.0, 0.62 if strip_rgba is not None else 0.8, colour)
    if strip_rgba is not None:
        for b, colour in enumerate(hex_colors(strip_rgba)):
            cv.rect(x0 + b, y + 0.74, 1.0, 0.2, colour)
    labels_y = y + 1
    marks = _span_marks(spans)
    rows_end = [-1.0, -1.0]  # labels of neighbouring spans go on a second row instead of overlapping
    for (_, start, end, _), mark in sorted(zip(spans, marks, strict=True), key=lambda sm: sm[0][1]):
        a, b = start / per_bin, max(end / per_bin, start / per_bin + 0.6)
        cv.rect(x0 + a, y + 0.02, b - a, 0.94, "none", "#000000", 1.0)
        row = 0 if a > rows_end[0] else 1
        rows_end[row] = a + len(mark) + 0.5
        cv.text(x0 + a, labels_y + 0.5 + 0.9 * row, mark, "#000", "bold")
    y = labels_y + (1.9 if rows_end[1] >= 0 else 1)
    for (side, start, end, mean), mark in zip(spans, marks, strict=True):
        head = f"{mark} {side} credited · tokens {start:,}–{end - 1:,} · mean {mode_label(mode)} {mean:+.3g}"
        cv.text(x0, y + 0.5, head[: int(width)], "#333", "bold")
        y += 1
        box = scale.rgba(values[start:end])
        strip = strip_scale.rgba(strip_values[start:end]) if strip_scale is not None else None
        y = _token_rows(cv, x0, y, r.tokens[start:end], box, strip, width, r.tool[start:end]) + 0.3
    return y


def _span_marks(spans: list[tuple[str, int, int, float]]) -> list[str]:
    """``+1, +2, ...`` for the most credited spans, ``−1, −2, ...`` for the least credited."""
    counts = {"most": 0, "least": 0}
    marks = []
    for side, *_ in spans:
        counts[side] += 1
        marks.append(f"{_SPAN_MARKS[side]}{counts[side]}")
    return marks


def _legend_rows(cv: _Canvas, y: float, label: str, scale: ColorScale) -> float:
    """A legend item: its statement on one row, the colour bar with its ends on the next."""
    cv.text(0, y + 0.5, label, "#222", "bold")
    y += 1
    stops = np.linspace(scale.vmin, scale.vmax, 64)
    left = 8.0
    for j, colour in enumerate(hex_colors(scale.rgba(stops))):
        cv.rect(left + j * LEGEND_BAR / 64, y + 0.15, LEGEND_BAR / 64 + 0.02, 0.7, colour)
    cv.rect(left, y + 0.15, LEGEND_BAR, 0.7, "none", "#888888", 0.5)
    cv.text(
        left - 0.6,
        y + 0.5,
        f"{scale.vmin:+.3g}" if scale.mode != "entropy" else f"{scale.vmin:.3g}",
        "#222",
        ha="right",
    )
    cv.text(
        left + LEGEND_BAR + 0.6,
        y + 0.5,
        f"{scale.vmax:+.3g}" if scale.mode != "entropy" else f"{scale.vmax:.3g}",
        "#222",
    )
    if scale.mode != "entropy":
        cv.text(left + LEGEND_BAR / 2, y + 1.35, "0", "#444", ha="center", scale=0.85)
        return y + 1.8
    return y + 1.3


def render_png(
    responses: Sequence[Response],
    out_path: str | Path,
    *,
    color: str = "advantage",
    max_prompts: int | None = None,
    vmax: float | None = None,
    title: str = "Token heatmap",
    width_chars: int = 72,
    png_max_responses: int = 3,
    png_max_tokens: int = 240,
    span_tokens: int = 24,
    spans_per_side: int = 2,
    fontsize: float = 7.5,
    dpi: int = 130,
    max_lines: int = 3000,
) -> Path:
    """Draw the PNG; returns its path. Responses over ``png_max_tokens`` tokens are drawn in compact mode."""
    from matplotlib import rc_context
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.collections import PatchCollection
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    if width_chars < 24:
        raise ValueError(f"width_chars={width_chars}: must be >= 24")
    if png_max_tokens < 1 or span_tokens < 1 or spans_per_side < 1:
        raise ValueError(
            f"png_max_tokens={png_max_tokens}, span_tokens={span_tokens}, spans_per_side={spans_per_side}: must be >= 1"
        )
    groups = group_by_prompt(responses, max_prompts)
    shown_all = [r for g in groups for r in g]
    # One scale per signal for the whole figure, fitted on every response of the shown groups.
    scale, strip_scale = figure_scales(color, shown_all, vmax)

    ncols_max = max((len(columns(g)) for g in groups), default=1)
    total_w = ncols_max * width_chars + (ncols_max - 1) * COLUMN_GAP
    cv = _Canvas()
    y = 1.6  # the title takes the first rows
    if scale.cmap_name is not None:
        y = _legend_rows(cv, y, f"box colour: {scale_label(scale)}; one scale for every token in this figure", scale)
    if strip_scale is not None:
        y = _legend_rows(
            cv, y + 0.2, f"strip under each token: {scale_label(strip_scale)}; one scale likewise", strip_scale
        )
    if any(r.tool.any() for r in shown_all):
        cv.rect(0, y + 0.28, 3.0, 0.62, TOOL_FACE, "#00000050", 0.4)
        cv.text(3.8, y + 0.6, TOOL_LEGEND, "#222")
        y += 1.2
    y += 0.8
    truncated = False
    for g in groups:
        cols = columns(g)
        tail = (f" · step {g[0].step}" if g[0].step is not None else "") + f" · {len(g)} responses"
        # The header row is drawn 1.1x larger: its text must fit in total_w / 1.1 cells.
        head = prompt_preview(g[0].prompt, g[0].uid, limit=int(total_w / 1.1) - len(tail)) + tail
        cv.text(0, y + 0.5, head, "#000", "bold", scale=1.1)
        y += 1.3
        bottoms = []
        for c, (name, rs) in enumerate(cols):
            x0 = c * (width_chars + COLUMN_GAP)
            cy = y
            cv.text(x0, cy + 0.5, f"{name} ({len(rs)})", "#333", "bold")
            cy += 1
            for r in rs[:png_max_responses]:
                cv.text(x0, cy + 0.5, response_meta(r, with_key=False)[:width_chars], "#555")
                cy += 1
                if len(r.tokens) > png_max_tokens and color != "none":
                    cy = _compact_rows(
                        cv, x0, cy, r, color, scale, strip_scale, width_chars, span_tokens, spans_per_side
                    )
                else:
                    toks = r.tokens[:png_max_tokens]
                    box = scale.rgba(token_values(r, color)[: len(toks)])
                    strip_rgba = (
                        strip_scale.rgba(token_values(r, strip_scale.mode)[: len(toks)]) if strip_scale else None
                    )
                    cy = _token_rows(cv, x0, cy, toks, box, strip_rgba, width_chars, r.tool[: len(toks)])
                    if len(r.tokens) > png_max_tokens:
                        cv.text(x0, cy + 0.5, f"… {len(r.tokens) - png_max_tokens:,} more tokens", "#888")
                        cy += 1
                cy += 0.5
            if len(rs) > png_max_responses:
                cv.text(x0, cy + 0.5, f"… {len(rs) - png_max_responses} more responses in the HTML", "#888")
                cy += 1
            bottoms.append(cy)
        y = max(bottoms) + 0.8
        if y > max_lines:
            truncated = True
            break
    if truncated:
        cv.text(0, y + 0.5, "… more prompts in the HTML", "#888")
        y += 1

    # Unhinted glyphs advance by exactly 0.602 em, so text widths match the cell-sized boxes.
    with rc_context({"text.hinting": "no_hinting"}):
        char_in = _MONO_ADVANCE_EM * fontsize / 72.0
        line_in = 1.7 * fontsize / 72.0
        fig = Figure(figsize=(total_w * char_in + 0.4, y * line_in + 0.3), dpi=dpi)
        FigureCanvasAgg(fig)
        fw, fh = fig.get_size_inches()
        ax = fig.add_axes((0.2 / fw, 0.15 / fh, total_w * char_in / fw, y * line_in / fh))
        ax.set_xlim(0, total_w)
        ax.set_ylim(y, 0)
        ax.axis("off")
        if cv.rects:
            patches = [Rectangle((x, yy), w, h) for x, yy, w, h, *_ in cv.rects]
            ax.add_collection(
                PatchCollection(
                    patches,
                    facecolors=[f for *_, f, _, _ in cv.rects],
                    edgecolors=[e for *_, e, _ in cv.rects],
                    linewidths=[lw for *_, lw in cv.rects],
                )
            )
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Glyph .* missing from font")
            ax.text(0, 0.7, title, fontsize=fontsize + 3, fontweight="bold", va="center", parse_math=False)
            for x, yy, s, c, weight, ha, size in cv.texts:
                ax.text(
                    x,
                    yy,
                    s,
                    fontsize=fontsize * size,
                    family=_MONO_FONT,
                    color=c,
                    fontweight=weight,
                    va="center",
                    ha=ha,
                    parse_math=False,
                    clip_on=False,
                )
            out_path = Path(out_path)
            out_path.parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(out_path, format="png", dpi=dpi, facecolor="white")
    return out_path
