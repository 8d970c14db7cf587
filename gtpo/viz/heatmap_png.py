"""The heatmap as a PNG overview drawn with matplotlib's Agg canvas (no pyplot state).

It keeps ``png_max_responses`` responses per column and ``png_max_tokens`` tokens per response (the HTML keeps
everything) and uses one monospace text run per line, so glyphs outside the monospace font may drift from their
boxes.
"""

from __future__ import annotations

import functools
import unicodedata
import warnings
from collections.abc import Sequence
from pathlib import Path

from gtpo.viz.dump_reader import Response
from gtpo.viz.heatmap_style import (
    ColorScale,
    check_mode,
    columns,
    group_by_prompt,
    hex_colors,
    mode_label,
    response_meta,
    text_is_dark,
    token_values,
)

__all__ = ["render_png"]

# Advance width of DejaVu Sans Mono in em (1233 / 2048): one character = one layout unit in the PNG.
_MONO_ADVANCE_EM = 0.602
_MONO_FONT = "DejaVu Sans Mono"


@functools.cache
def _mono_charmap() -> frozenset[int]:
    """Code points the monospace font draws itself (others fall back to fonts of another width)."""
    from matplotlib import font_manager, ft2font

    return frozenset(ft2font.FT2Font(font_manager.findfont(_MONO_FONT)).get_charmap())


def _cells(text: str) -> tuple[int, bool]:
    """Layout width of ``text`` in monospace cells (wide East Asian characters take 2) and whether every
    character is drawn by the monospace font at one cell (then it can join a line's single text run)."""
    charmap = _mono_charmap()
    width, mono = 0, True
    for ch in text:
        wide = unicodedata.east_asian_width(ch) in ("W", "F")
        width += 2 if wide else 1
        mono = mono and not wide and ord(ch) in charmap
    return width, mono


def _layout_response(tokens: Sequence[str], width: int) -> list[list[tuple[int, str, int, int, bool]]]:
    """Wrap tokens into lines of ``width`` cells.

    Returns lines of ``(token index, display text, x, cells, mono)``; empty tokens (the tail of a merged UTF-8
    span) take no cells and are left out.
    """
    lines: list[list[tuple[int, str, int, int, bool]]] = [[]]
    x = 0
    for i, tok in enumerate(tokens):
        newline = "\n" in tok
        shown = tok.replace("\r", "").replace("\t", "⇥").replace("\n", "↵")
        if shown.strip() == "" and shown:
            shown = shown.replace(" ", "·")
        # A token longer than a line is cut (the HTML keeps it whole).
        shown = shown[: width // 2] if len(shown) > width // 2 else shown
        if shown:
            w, mono = _cells(shown)
            if x + w > width and x > 0:
                lines.append([])
                x = 0
            lines[-1].append((i, shown, x, w, mono))
            x += w
        if newline:
            lines.append([])
            x = 0
    if not lines[-1] and len(lines) > 1:
        lines.pop()
    return lines


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
    png_max_tokens: int = 300,
    fontsize: float = 7.0,
    dpi: int = 110,
    max_lines: int = 3000,
) -> Path:
    """Draw the overview PNG (matplotlib Agg, no pyplot state); returns its path."""
    from matplotlib import colormaps, rc_context
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.cm import ScalarMappable
    from matplotlib.collections import PatchCollection
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    if width_chars < 8:
        raise ValueError(f"width_chars={width_chars}: must be >= 8")
    groups = group_by_prompt(responses, max_prompts)
    shown_all = [r for g in groups for r in g]
    check_mode(shown_all, color)
    # Same scale as the HTML: fitted on every response of the shown groups, not only the ones drawn here.
    scale = ColorScale.fit(color, [token_values(r, color) for r in shown_all] if color != "none" else [], vmax)

    gap = 4
    # Rows of draw commands in layout units: x in characters, y in lines (0 at the top).
    rects: list[tuple[float, float, float, str]] = []  # x, y, w, colour hex
    texts: list[tuple[float, float, str, str, str]] = []  # x, y, text, colour, weight
    y = 3  # title + legend
    truncated = False
    ncols_max = 1
    for g in groups:
        cols = columns(g)
        ncols_max = max(ncols_max, len(cols))
        head = f"prompt {g[0].uid}" + (f" · step {g[0].step}" if g[0].step is not None else "")
        if g[0].prompt:
            first = " ".join(g[0].prompt.split())
            head += " · " + (first[:width_chars] + "…" if len(first) > width_chars else first)
        texts.append((0, y, head, "#000", "bold"))
        y += 1
        bottoms = []
        for c, (name, rs) in enumerate(cols):
            x0 = c * (width_chars + gap)
            cy = y
            texts.append((x0, cy, f"{name} ({len(rs)})", "#333", "bold"))
            cy += 1
            for r in rs[:png_max_responses]:
                texts.append((x0, cy, response_meta(r)[:width_chars], "#555", "normal"))
                cy += 1
                toks = r.tokens[:png_max_tokens]
                vals = token_values(r, color)
                rgba = scale.rgba(vals[: len(toks)])
                bgs, dark = hex_colors(rgba), text_is_dark(rgba)
                for line in _layout_response(toks, width_chars):
                    run = []
                    for i, shown, x, w, mono in line:
                        rects.append((x0 + x, cy, w, bgs[i]))
                        # One text run per line keeps the PNG fast; a token joins it only when it is dark text
                        # in one-cell monospace glyphs, else it is drawn on its own and the run keeps its cells.
                        if mono and dark[i]:
                            run.append(shown)
                        else:
                            run.append(" " * w)
                            texts.append((x0 + x, cy, shown, "#000" if dark[i] else "#fff", "normal"))
                    if line and "".join(run).strip():
                        texts.append((x0 + line[0][2], cy, "".join(run), "#000", "normal"))
                    cy += 1
                if len(r.tokens) > png_max_tokens:
                    texts.append((x0, cy, f"… {len(r.tokens) - png_max_tokens} more tokens", "#888", "normal"))
                    cy += 1
                cy += 0.5
            if len(rs) > png_max_responses:
                texts.append((x0, cy, f"… {len(rs) - png_max_responses} more responses", "#888", "normal"))
                cy += 1
            bottoms.append(cy)
        y = max(bottoms) + 1
        if y > max_lines:
            truncated = True
            break
    if truncated:
        texts.append((0, y, "… more prompts in the HTML", "#888", "normal"))
        y += 1

    # Unhinted glyphs advance by exactly 0.602 em, so text runs line up with the cell-sized boxes
    # (hinting rounds each advance to whole pixels and drifts by several cells per line).
    with rc_context({"text.hinting": "no_hinting"}):
        total_w = ncols_max * width_chars + (ncols_max - 1) * gap
        char_in = _MONO_ADVANCE_EM * fontsize / 72.0
        line_in = 1.45 * fontsize / 72.0
        fig = Figure(figsize=(total_w * char_in + 0.4, y * line_in + 0.3), dpi=dpi)
        FigureCanvasAgg(fig)
        fw, fh = fig.get_size_inches()
        ax = fig.add_axes((0.2 / fw, 0.15 / fh, total_w * char_in / fw, y * line_in / fh))
        ax.set_xlim(0, total_w)
        ax.set_ylim(y, 0)
        ax.axis("off")
        if rects:
            patches = [Rectangle((x, yy + 0.08), w, 0.84) for x, yy, w, _ in rects]
            coll = PatchCollection(patches, facecolors=[c for *_, c in rects], edgecolors="#00000022", linewidths=0.3)
            ax.add_collection(coll)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Glyph .* missing from font")
            ax.text(0, 0.5, title, fontsize=fontsize + 2, fontweight="bold", va="center", parse_math=False)
            for x, yy, s, c, weight in texts:
                ax.text(
                    x,
                    yy + 0.5,
                    s,
                    fontsize=fontsize,
                    family=_MONO_FONT,
                    color=c,
                    fontweight=weight,
                    va="center",
                    ha="left",
                    parse_math=False,
                    clip_on=False,
                )
            if scale.cmap_name is not None:
                # Colour legend: a horizontal colorbar in the header band.
                cax = fig.add_axes(
                    (
                        0.2 / fw + 0.35 * total_w * char_in / fw,
                        1 - (2.6 * line_in + 0.15) / fh,
                        min(3.0, 0.5 * total_w * char_in) / fw,
                        0.7 * line_in / fh,
                    )
                )
                sm = ScalarMappable(norm=Normalize(scale.vmin, scale.vmax), cmap=colormaps[scale.cmap_name])
                cb = fig.colorbar(sm, cax=cax, orientation="horizontal")
                cb.ax.tick_params(labelsize=fontsize - 1, length=2, pad=1)
                cb.ax.set_title(mode_label(scale.mode), fontsize=fontsize, loc="left", pad=2)
            out_path = Path(out_path)
            out_path.parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(out_path, format="png", dpi=dpi, facecolor="white")
    return out_path
