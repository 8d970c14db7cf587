"""Token-level heatmaps: each sampled response drawn token by token, coloured by advantage or entropy.

GTPO (arXiv 2508.04349, Eqs. 3-6) and GTPO-trajectory (arXiv 2508.03772) move credit *inside* a response, so a
single scalar per response hides what the estimator did. This module shows it: for every prompt group (verl's
``uid``), the correct and the incorrect samples side by side, each token a box whose colour is

* ``advantage``: the per-token advantage on a diverging colormap (``RdBu``: red < 0 < blue), centred at 0 on a
  symmetric scale ``[-vmax, vmax]`` with ``vmax = max |A|`` over everything rendered (or ``--vmax``);
* ``entropy``: the old-policy per-token entropy on a sequential colormap (``YlOrRd``) over ``[0, vmax]``;
* ``score``: the response's sequence reward, copied to each token (the only signal verl's text dumps carry);
* ``none``: no colour.

Outputs: a self-contained HTML page (inline CSS, no external assets, every token HTML-escaped, whitespace made
visible, a hover title with the exact value, a colour legend) and a PNG drawn with matplotlib's Agg canvas.

Modules: :mod:`gtpo.viz.dump_writer` (records from the trainer's tensors), :mod:`gtpo.viz.dump_reader` (token dumps
and verl's text dumps -> :class:`Response`), :mod:`gtpo.viz.heatmap_style` (colour scale, grouping, labels),
:mod:`gtpo.viz.heatmap_html` and :mod:`gtpo.viz.heatmap_png` (the two renderers). This module holds the one call
behind ``python -m gtpo.viz tokens`` and re-exports the public names.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gtpo.viz.dump_reader import Response, find_dump, load_responses
from gtpo.viz.dump_writer import TOKEN_DUMP_FIELDS, records_from_batch, token_records, write_token_dump
from gtpo.viz.heatmap_html import render_html
from gtpo.viz.heatmap_png import render_png
from gtpo.viz.heatmap_style import (
    ADVANTAGE_CMAP,
    COLOR_MODES,
    ENTROPY_CMAP,
    ColorScale,
    figure_scales,
    group_by_prompt,
    mode_label,
)

__all__ = [
    "ADVANTAGE_CMAP",
    "ENTROPY_CMAP",
    "COLOR_MODES",
    "TOKEN_DUMP_FIELDS",
    "Response",
    "ColorScale",
    "token_records",
    "records_from_batch",
    "write_token_dump",
    "load_responses",
    "find_dump",
    "render_html",
    "render_png",
    "heatmap_title",
    "render_heatmap",
    "render_tokens",
]


def heatmap_title(color: str, responses: Sequence[Response], source: str = "") -> str:
    """``Token advantage · step 39 · tokens_39.jsonl``: the mode, the step when all responses share one, the source."""
    steps = {r.step for r in responses}
    parts = [f"Token {mode_label(color)}"]
    if len(steps) == 1 and None not in steps:
        parts.append(f"step {steps.pop()}")
    if source:
        parts.append(source)
    return " · ".join(parts)


def render_heatmap(
    responses: Sequence[Response],
    out_stem: str | Path,
    *,
    color: str = "advantage",
    max_prompts: int | None = 16,
    vmax: float | None = None,
    title: str | None = None,
    png: bool = True,
    **png_options: Any,
) -> tuple[Path, Path | None]:
    """Write ``<out_stem>.html`` and (with ``png``) ``<out_stem>.png``; returns both paths. ``png_options`` go to
    :func:`render_png` (``png_max_tokens``, ``span_tokens``, ...)."""
    out_stem = Path(out_stem)
    title = title or heatmap_title(color, group_responses(responses, max_prompts))
    kwargs = dict(color=color, max_prompts=max_prompts, vmax=vmax, title=title)
    html_path = render_html(responses, out_stem.with_name(out_stem.name + ".html"), **kwargs)
    png_path = (
        render_png(responses, out_stem.with_name(out_stem.name + ".png"), **kwargs, **png_options) if png else None
    )
    return html_path, png_path


def group_responses(responses: Sequence[Response], max_prompts: int | None) -> list[Response]:
    """The responses a page with ``max_prompts`` prompt groups shows."""
    return [r for g in group_by_prompt(responses, max_prompts) for r in g]


def render_tokens(
    input_path: str | Path,
    out_dir: str | Path,
    *,
    color: str = "advantage",
    tokenizer: Any = None,
    max_prompts: int | None = 16,
    step: int | None = None,
    vmax: float | None = None,
    correct_threshold: float = 0.0,
    png: bool = True,
    **png_options: Any,
) -> dict[str, Any]:
    """Load a dump (file or rollout_data_dir) and write ``<stem>.<color>.html`` (+ ``.png``) into ``out_dir``.

    ``tokenizer`` is a tokenizer object or a local path for ``transformers.AutoTokenizer`` (only used to split
    verl's text dumps into tokens); ``png_options`` go to :func:`render_png`. Returns ``{"html", "png", "input",
    "n_prompts", "n_responses", "scale"}``.
    """
    src = find_dump(input_path, step)
    if isinstance(tokenizer, str | Path):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
    responses = load_responses(src, tokenizer=tokenizer, correct_threshold=correct_threshold)
    shown = group_responses(responses, max_prompts)
    html_path, png_path = render_heatmap(
        responses,
        Path(out_dir) / f"{src.stem}.{color}",
        color=color,
        max_prompts=max_prompts,
        vmax=vmax,
        title=heatmap_title(color, shown, src.name),
        png=png,
        **png_options,
    )
    scale = figure_scales(color, shown, vmax)[0]
    return {
        "html": html_path,
        "png": png_path,
        "input": src,
        "n_prompts": len({r.uid for r in shown}),
        "n_responses": len(shown),
        "scale": scale,
    }
