"""The heatmap as a self-contained HTML page: inline CSS, no external assets, every token HTML-escaped, whitespace
made visible, a hover title with the exact value, a colour legend; a tool's output inside a multi-turn response in
grey, without a strip (``data-tool``)."""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from gtpo.viz.dump_reader import Response
from gtpo.viz.heatmap_style import (
    TOOL_FACE,
    TOOL_LEGEND,
    TOOL_TEXT,
    ColorScale,
    columns,
    display_text,
    figure_scales,
    fmt_value,
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

__all__ = ["render_html"]

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:16px;color:#222;background:#fff}
h1{font-size:18px} h2{font-size:15px;margin:18px 0 4px} h3{font-size:13px;margin:4px 0}
.legend{display:flex;align-items:center;gap:8px;font-size:12px;margin:4px 0}
.legends{margin:8px 0 16px}
.bar{width:320px;height:14px;border:1px solid #999}
.strip-bar{width:320px;height:6px;border:1px solid #999}
.prompt{white-space:pre-wrap;background:#f6f6f6;border:1px solid #ddd;padding:6px;font-size:12px;max-height:12em;
overflow:auto}
.cols{display:grid;grid-template-columns:repeat(var(--ncols),minmax(0,1fr));gap:12px}
.col{min-width:0} .resp{border:1px solid #ccc;border-radius:4px;padding:6px;margin:6px 0}
.meta{font-size:11px;color:#555;margin-bottom:4px;word-break:break-all}
.toks{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px;line-height:2.0;white-space:pre-wrap;
word-break:break-word}
.tok{box-shadow:inset 0 0 0 1px rgba(0,0,0,.25);border-radius:2px;padding:1px 1px;margin-right:3px;
border-bottom:4px solid transparent}
.tok:empty{padding:1px 1px;margin-right:0}
.tok[data-special]{box-shadow:inset 0 0 0 2px #222;font-weight:bold}
.tok[data-tool]{font-style:italic}
"""


def _visible(tok: str) -> str:
    """Escaped display text: spaces -> '·', tab -> '⇥', newline -> '↵' + a line break (as :func:`display_text`)."""
    return html.escape(display_text(tok), quote=True).replace("↵", "↵\n")


def _attr(s: str) -> str:
    # Newlines and tabs as character references so attribute values survive any parser unchanged.
    return html.escape(s, quote=True).replace("\n", "&#10;").replace("\r", "&#13;").replace("\t", "&#9;")


def _legend_html(scale: ColorScale, what: str, bar_class: str) -> str:
    stops = np.linspace(scale.vmin, scale.vmax, 11)
    cols = hex_colors(scale.rgba(stops))
    grad = ", ".join(f"{c} {i * 10}%" for i, c in enumerate(cols))
    return (
        f'<div class="legend"><strong>{html.escape(what)}</strong><span>{scale.vmin:.4g}</span>'
        f'<span class="{bar_class}" style="background:linear-gradient(to right, {grad})" '
        f'data-vmin="{scale.vmin!r}" data-vmax="{scale.vmax!r}" data-cmap="{scale.cmap_name}"></span>'
        f"<span>{scale.vmax:.4g}</span><span>{html.escape(scale_label(scale))}; colormap {scale.cmap_name}; "
        "one scale for every token on this page</span></div>"
    )


def _legends_html(scale: ColorScale, strip_scale: ColorScale | None) -> str:
    if scale.cmap_name is None:
        return '<div class="legends"><div class="legend">colour: none</div></div>'
    parts = [_legend_html(scale, "box colour", "bar")]
    if strip_scale is not None:
        parts.append(_legend_html(strip_scale, "strip under each token", "strip-bar"))
    parts.append('<div class="legend">hover a token for its exact values, position and id</div>')
    return f'<div class="legends">{"".join(parts)}</div>'


def _response_html(r: Response, mode: str, scale: ColorScale, strip_scale: ColorScale | None) -> str:
    vals = token_values(r, mode)
    rgba = scale.rgba(vals)
    bgs = hex_colors(rgba)
    dark = text_is_dark(rgba)
    strips = hex_colors(strip_scale.rgba(token_values(r, strip_scale.mode))) if strip_scale is not None else None
    label = mode_label(mode)
    spans = []
    tool = r.tool
    for i, tok in enumerate(r.tokens):
        if tool[i]:
            title = f"tool output #{i}" + (f" id={r.token_ids[i]}" if r.token_ids is not None else "")
            title += "\nmasked: no advantage, entropy not used"
            spans.append(
                f'<span class="tok" data-i="{i}" data-tok="{_attr(tok)}" data-tool title="{_attr(title)}" '
                f'style="background:{TOOL_FACE};color:{TOOL_TEXT}">{_visible(tok)}</span>'
            )
            continue
        title = f"{label}={fmt_value(vals[i])}" if mode != "none" else f"token #{i}"
        if mode != "none":
            title += f"\n#{i}"
        if r.token_ids is not None:
            title += f" id={r.token_ids[i]}"
        if mode != "entropy" and r.entropy is not None:
            title += f"\nentropy={fmt_value(r.entropy[i])}"
        if mode != "advantage" and r.advantages is not None:
            title += f"\nadvantage={fmt_value(r.advantages[i])}"
        fg = "#000" if dark[i] else "#fff"
        strip = f";border-bottom-color:{strips[i]}" if strips is not None else ""
        special = " data-special" if is_special(tok) else ""
        spans.append(
            f'<span class="tok" data-i="{i}" data-tok="{_attr(tok)}" data-v="{fmt_value(vals[i])}"{special} '
            f'title="{_attr(title)}" style="background:{bgs[i]};color:{fg}{strip}">{_visible(tok)}</span>'
        )
    return (
        f'<div class="resp" data-uid="{_attr(r.uid)}" data-key="{_attr(r.key or "")}">'
        f'<div class="meta">{html.escape(response_meta(r))}</div><div class="toks">{"".join(spans)}</div></div>'
    )


def render_html(
    responses: Sequence[Response],
    out_path: str | Path,
    *,
    color: str = "advantage",
    max_prompts: int | None = None,
    vmax: float | None = None,
    title: str = "Token heatmap",
) -> Path:
    """Write the self-contained HTML page; returns its path. Groups by uid, columns correct | incorrect."""
    groups = group_by_prompt(responses, max_prompts)
    shown = [r for g in groups for r in g]
    # One scale per signal for the whole figure, fitted on every response of the shown groups.
    scale, strip_scale = figure_scales(color, shown, vmax)
    parts = [
        '<!DOCTYPE html><html><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        _legends_html(scale, strip_scale),
    ]
    if any(r.tool.any() for r in shown):
        sample = f'<span class="tok" data-tool style="background:{TOOL_FACE};color:{TOOL_TEXT}">tool</span>'
        parts.append(f'<div class="legend">{sample}<span>{html.escape(TOOL_LEGEND)}</span></div>')
    for g in groups:
        cols = columns(g)
        step = g[0].step
        head = prompt_preview(g[0].prompt, g[0].uid, limit=120)
        head += (f" · step {step}" if step is not None else "") + f" · {len(g)} responses"
        parts.append(f'<section class="group" data-uid="{_attr(g[0].uid)}"><h2>{html.escape(head)}</h2>')
        if g[0].prompt is not None:
            parts.append(f'<div class="prompt">{html.escape(g[0].prompt)}</div>')
        parts.append(f'<div class="cols" style="--ncols:{len(cols)}">')
        for name, rs in cols:
            parts.append(f'<div class="col {name}"><h3>{name} ({len(rs)})</h3>')
            parts.extend(_response_html(r, color, scale, strip_scale) for r in rs)
            parts.append("</div>")
        parts.append("</div></section>")
    parts.append("</body></html>\n")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text("".join(parts), encoding="utf-8")
    return out_path
