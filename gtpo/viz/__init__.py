"""Visualisation: token-level advantage / entropy heatmaps and training curves (matplotlib, no Ray, no verl).

* ``python -m gtpo.viz tokens --input DUMP --out DIR [--color advantage|entropy|...]`` (:mod:`gtpo.viz.tokens`):
  :mod:`gtpo.viz.dump_writer` builds the token dumps the recipe trainer writes next to verl's rollout dumps,
  :mod:`gtpo.viz.dump_reader` reads them (and verl's text dumps), :mod:`gtpo.viz.heatmap_style` holds the colour
  scales, grouping and labels, :mod:`gtpo.viz.heatmap_html` and :mod:`gtpo.viz.heatmap_png` draw the two pictures.
* :mod:`gtpo.viz.tracker` logs each dumped step's heatmap to TensorBoard / W&B through verl's ``Tracking``.
* ``python -m gtpo.viz curves --run NAME=metrics.jsonl [--run ...] --out curves.png`` (:mod:`gtpo.viz.curves`).

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
