"""Visualisation: token-level advantage / entropy heatmaps and training curves (matplotlib, no Ray, no verl).

* :mod:`gtpo.viz.tokens` — ``python -m gtpo.viz tokens --input DUMP --out DIR [--color advantage|entropy|...]``;
  :func:`token_records` / :func:`records_from_batch` build the token dumps that the recipe trainer writes next to
  verl's rollout dumps.
* :mod:`gtpo.viz.curves` — ``python -m gtpo.viz curves --run NAME=metrics.jsonl [--run ...] --out curves.png``.

matplotlib is imported only when something is drawn, so the trainer can import :func:`token_records` cheaply.
"""

from gtpo.viz.curves import load_metrics, plot_curves
from gtpo.viz.tokens import (
    load_responses,
    records_from_batch,
    render_html,
    render_png,
    render_tokens,
    token_records,
    write_token_dump,
)

__all__ = [
    "load_metrics",
    "load_responses",
    "plot_curves",
    "records_from_batch",
    "render_html",
    "render_png",
    "render_tokens",
    "token_records",
    "write_token_dump",
]
