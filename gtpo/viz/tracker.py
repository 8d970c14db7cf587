"""The token heatmap in the experiment tracker: TensorBoard and W&B, through verl's own ``Tracking`` object.

The recipe trainer (``gtpo_sync``) dumps ``tokens_<step>.jsonl`` when ``trainer.rollout_data_dir`` is set. When
``trainer.logger`` also names ``tensorboard`` or ``wandb``, :func:`log_token_heatmap` renders that step's heatmap
(advantage boxes, entropy strips) into ``<rollout_data_dir>/heatmaps/tokens_<step>.advantage.{html,png}`` and logs it
at the step it belongs to, with the backends verl's ``Tracking`` already holds (``verl/utils/tracking.py``):

* ``tensorboard`` (``Tracking.logger["tensorboard"].writer``, a ``SummaryWriter``): the PNG as image
  :data:`IMAGE_TAG`, and the HTML file's path as text :data:`HTML_TAG` (TensorBoard cannot show a file);
* ``wandb`` (``Tracking.logger["wandb"]``, the ``wandb`` module): ``wandb.Image`` under :data:`IMAGE_TAG` and
  the page as ``wandb.Html`` under :data:`HTML_TAG`, in one ``wandb.log(..., step=step)`` call.

Other backends (console, file, mlflow, ...) get nothing: they have no image channel verl uses for training steps.
A rendering or logging failure is reported as a warning and never stops training.

Size: the tracker's page shows what its PNG shows (:data:`TRACKER_MAX_PROMPTS` prompts, up to
:data:`TRACKER_RESPONSES_PER_COLUMN` correct and incorrect responses each), about 0.2 kB of HTML per token, so
8 responses of 4,096 tokens make ~7 MB (and a ~0.8 MB PNG); a page over :data:`WANDB_MAX_HTML_BYTES` is not
uploaded to W&B (a short page with its path is logged instead). ``python -m gtpo.viz tokens`` renders every
response of the step's dump. Rendering and logging a step of 8 prompts x 16 responses of 4,096 tokens takes
~1.3 s on a shared 2-core CPU machine.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["HTML_TAG", "IMAGE_TAG", "IMAGE_BACKENDS", "log_token_heatmap", "tracker_responses", "wants_heatmap"]

logger = logging.getLogger(__name__)

IMAGE_TAG = "token_heatmap/advantage"
HTML_TAG = "token_heatmap/html"
IMAGE_BACKENDS = ("tensorboard", "wandb")
# Kept small: the tracker shows one picture per step; tokens_<step>.jsonl keeps every dumped response.
TRACKER_MAX_PROMPTS = 2
TRACKER_RESPONSES_PER_COLUMN = 2
WANDB_MAX_HTML_BYTES = 10_000_000


def wants_heatmap(tracking: Any) -> list[str]:
    """The backends of a verl ``Tracking`` object that take the heatmap (in :data:`IMAGE_BACKENDS` order)."""
    loggers = getattr(tracking, "logger", None) or {}
    return [name for name in IMAGE_BACKENDS if name in loggers]


def log_token_heatmap(
    tracking: Any,
    records: Sequence[dict],
    step: int,
    out_dir: str | os.PathLike,
    *,
    max_prompts: int = TRACKER_MAX_PROMPTS,
) -> dict[str, str]:
    """Render the step's token heatmap and log it to the tracking backends that show images.

    Args:
        tracking: verl's ``Tracking`` (the trainer's ``self.logger``); only its ``logger`` dict is read.
        records: the step's token-dump records (:func:`gtpo.viz.dump_writer.records_from_batch`).
        step: the training step the records belong to (the step their metrics are logged at).
        out_dir: folder for ``tokens_<step>.advantage.{html,png}``.
        max_prompts: prompt groups drawn.

    Returns:
        ``{"html", "png", "backends"}`` (paths and comma-separated backend names) of what was logged; ``{}`` when
        no backend takes images, there are no records, or rendering or logging failed (a warning says why).
    """
    backends = wants_heatmap(tracking)
    if not backends or not records:
        return {}
    try:
        from gtpo.viz.dump_reader import responses_from_records
        from gtpo.viz.tokens import heatmap_title, render_heatmap

        responses = tracker_responses(responses_from_records(list(records)), max_prompts)
        color = "advantage" if all(r.advantages is not None for r in responses) else "score"
        # The counts on the page are of the shown responses: the title says which ones they are.
        k = TRACKER_RESPONSES_PER_COLUMN
        shown = f"up to {k} correct and {k} incorrect responses of {len({r.uid for r in responses})} prompts"
        html_path, png_path = render_heatmap(
            responses,
            Path(out_dir) / f"tokens_{step}.{color}",
            color=color,
            max_prompts=max_prompts,
            title=heatmap_title(color, responses, shown),
        )
        for name in backends:
            _LOGGERS[name](tracking.logger[name], png_path, html_path, step)
    except Exception as e:  # a picture must never end a training run
        logger.warning("token heatmap of step %s not logged to %s: %r", step, ",".join(backends), e)
        return {}
    return {"html": str(html_path), "png": str(png_path), "backends": ",".join(backends)}


def tracker_responses(responses: list, max_prompts: int) -> list:
    """The responses the tracker shows: per prompt group (the first ``max_prompts``), the first
    :data:`TRACKER_RESPONSES_PER_COLUMN` of each column (correct, incorrect, ungraded)."""
    from gtpo.viz.heatmap_style import columns, group_by_prompt

    return [
        r
        for group in group_by_prompt(responses, max_prompts)
        for _, rs in columns(group)
        for r in rs[:TRACKER_RESPONSES_PER_COLUMN]
    ]


def _png_array(png_path: Path):
    """The PNG as an ``[H, W, 3]`` uint8 array (what ``SummaryWriter.add_image`` encodes)."""
    import numpy as np
    from matplotlib.image import imread

    img = imread(png_path)[..., :3]
    return np.clip(np.rint(img * 255), 0, 255).astype(np.uint8)


def _log_tensorboard(adapter: Any, png_path: Path, html_path: Path, step: int) -> None:
    writer = adapter.writer
    writer.add_image(IMAGE_TAG, _png_array(png_path), global_step=step, dataformats="HWC")
    writer.add_text(HTML_TAG, f"interactive page (hover shows each token's values): `{html_path}`", global_step=step)
    writer.flush()


def _log_wandb(wandb: Any, png_path: Path, html_path: Path, step: int) -> None:
    if getattr(wandb, "run", None) is None:
        raise RuntimeError("wandb has no active run")
    size = html_path.stat().st_size
    if size <= WANDB_MAX_HTML_BYTES:
        html = html_path.read_text(encoding="utf-8")
    else:
        html = (
            f"<p>The token page of step {step} ({size / 1e6:.1f} MB) is too large to upload; it is at {html_path}.</p>"
        )
    wandb.log({IMAGE_TAG: wandb.Image(str(png_path)), HTML_TAG: wandb.Html(html, inject=False)}, step=step)


_LOGGERS = {"tensorboard": _log_tensorboard, "wandb": _log_wandb}
