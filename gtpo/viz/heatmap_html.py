"""The heatmap as a self-contained HTML page: inline CSS, no external assets, every token HTML-escaped, whitespace
made visible, a hover title with the exact value, a colour legend."""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from gtpo.viz.dump_reader import Response
from gtpo.viz.heatmap_style import (
    ColorScale,
    check_mode,
    columns,
    fmt_value,
    group_by_prompt,
    hex_colors,
    mode_label,
    response_meta,
    text_is_dark,
    token_values,
)

__all__ = ["render_html"]

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:16px;color:#222;background:#fff}
h1{font-size:18px} h2{font-size:15px;margin:18px 0 4px} h3{font-size:13px;margin:4px 0}
.legend{display:flex;align-items:center;gap:8px;font-size:12px;margin:8px 0 16px}
.bar{width:320px;height:14px;border:1px solid #999}
.prompt{white-space:pre-wrap;background:#f6f6f6;border:1px solid #ddd;padding:6px;font-size:12px;max-height:12em;
overflow:auto}
.cols{display:grid;grid-template-columns:repeat(var(--ncols),minmax(0,1fr));gap:12px}
.col{min-width:0} .resp{border:1px solid #ccc;border-radius:4px;padding:6px;margin:6px 0}
.meta{font-size:11px;color:#555;margin-bottom:4px;word-break:break-all}
.toks{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px;line-height:1.7;white-space:pre-wrap;
word-break:break-word}
.tok{box-shadow:inset 0 0 0 1px rgba(0,0,0,.10);border-radius:2px;padding:1px 0}
.tok:empty{padding:1px 1px}
"""


def _visible(tok: str) -> str:
    """Escaped display text: newline -> '↵' + line break, tab -> '⇥', spaces of whitespace-only tokens -> '·'."""
    shown = tok
    if tok and tok.strip() == "":
        shown = shown.replace(" ", "·")
    shown = html.escape(shown, quote=True).replace("\t", "⇥").replace("\r", "␍").replace("\n", "↵\n")
    return shown


def _attr(s: str) -> str:
    # Newlines and tabs as character references so attribute values survive any parser unchanged.
    return html.escape(s, quote=True).replace("\n", "&#10;").replace("\r", "&#13;").replace("\t", "&#9;")


def _legend_html(scale: ColorScale) -> str:
    if scale.cmap_name is None:
        return '<div class="legend">colour: none</div>'
    stops = np.linspace(scale.vmin, scale.vmax, 11)
    cols = hex_colors(scale.rgba(stops))
    grad = ", ".join(f"{c} {i * 10}%" for i, c in enumerate(cols))
    mid = "0" if scale.mode != "entropy" else f"{(scale.vmin + scale.vmax) / 2:.4g}"
    return (
        f'<div class="legend"><span>{mode_label(scale.mode)}</span><span>{scale.vmin:.4g}</span>'
        f'<span class="bar" style="background:linear-gradient(to right, {grad})" '
        f'data-vmin="{scale.vmin!r}" data-vmax="{scale.vmax!r}" data-cmap="{scale.cmap_name}"></span>'
        f"<span>{scale.vmax:.4g}</span><span>(centre {mid}; colormap {scale.cmap_name})</span></div>"
    )


def _response_html(r: Response, mode: str, scale: ColorScale) -> str:
    vals = token_values(r, mode)
    rgba = scale.rgba(vals)
    bgs = hex_colors(rgba)
    dark = text_is_dark(rgba)
    label = mode_label(mode)
    spans = []
    for i, tok in enumerate(r.tokens):
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
        spans.append(
            f'<span class="tok" data-i="{i}" data-tok="{_attr(tok)}" data-v="{fmt_value(vals[i])}" '
            f'title="{_attr(title)}" style="background:{bgs[i]};color:{fg}">{_visible(tok)}</span>'
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
    check_mode(shown, color)
    scale = ColorScale.fit(color, [token_values(r, color) for r in shown] if color != "none" else [], vmax)
    parts = [
        '<!DOCTYPE html><html><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        _legend_html(scale),
    ]
    for g in groups:
        cols = columns(g)
        step = g[0].step
        head = f"prompt {g[0].uid}" + (f" · step {step}" if step is not None else "") + f" · {len(g)} responses"
        parts.append(f'<section class="group" data-uid="{_attr(g[0].uid)}"><h2>{html.escape(head)}</h2>')
        if g[0].prompt is not None:
            parts.append(f'<div class="prompt">{html.escape(g[0].prompt)}</div>')
        parts.append(f'<div class="cols" style="--ncols:{len(cols)}">')
        for name, rs in cols:
            parts.append(f'<div class="col {name}"><h3>{name} ({len(rs)})</h3>')
            parts.extend(_response_html(r, color, scale) for r in rs)
            parts.append("</div>")
        parts.append("</div></section>")
    parts.append("</body></html>\n")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text("".join(parts), encoding="utf-8")
    return out_path
