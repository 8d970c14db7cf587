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
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["HTML_TAG", "IMAGE_TAG", "IMAGE_BACKENDS", "log_token_heatmap", "wants_heatmap"]

logger = logging.getLogger(__name__)

IMAGE_TAG = "token_heatmap/advantage"
HTML_TAG = "token_heatmap/html"
IMAGE_BACKENDS = ("tensorboard", "wandb")
# Kept small: the tracker shows one picture per step, the files on disk keep the same page.
TRACKER_MAX_PROMPTS = 4


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
        from gtpo.viz.tokens import render_heatmap

        responses = responses_from_records(list(records))
        color = "advantage" if all(r.advantages is not None for r in responses) else "score"
        html_path, png_path = render_heatmap(
            responses, Path(out_dir) / f"tokens_{step}.{color}", color=color, max_prompts=max_prompts
        )
        for name in backends:
            _LOGGERS[name](tracking.logger[name], png_path, html_path, step)
    except Exception as e:  # a picture must never end a training run
        logger.warning("token heatmap of step %s not logged to %s: %r", step, ",".join(backends), e)
        return {}
    return {"html": str(html_path), "png": str(png_path), "backends": ",".join(backends)}


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
    html = html_path.read_text(encoding="utf-8")
    wandb.log({IMAGE_TAG: wandb.Image(str(png_path)), HTML_TAG: wandb.Html(html, inject=False)}, step=step)


_LOGGERS = {"tensorboard": _log_tensorboard, "wandb": _log_wandb}
