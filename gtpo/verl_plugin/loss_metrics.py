"""Min / max metrics of the recipe's policy losses, aggregated as min / max across micro-batches and ranks.

verl 0.9.1's ``ppo_loss`` (``verl/workers/utils/losses.py``) wraps every metric a registered policy loss returns as
``Metric(value, MEAN)``, and refuses a ``Metric`` the loss returns itself; the worker then averages the micro-batch
values over micro-batches and data-parallel ranks, so a logged "min" would be a mean of per-micro-batch minima.
:class:`GRPOSPPOLoss` is verl's ``ppo_loss`` followed by :func:`tag_extrema`, which re-tags the extremes as MIN / MAX
(``Metric.aggregate_dp`` then takes the extreme); the forking-token loss applies :func:`tag_extrema` too. The
recipe's trainer installs one of them in the actor workers (:func:`gtpo.verl_plugin.forking.install`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["EXTREMA_METRICS", "GRPOSPPOLoss", "install_grpo_s_loss", "tag_extrema"]


# The grpo_s loss's metrics that are extremes of one micro-batch, and how to combine them.
EXTREMA_METRICS = {"grpo_s/seq_ratio_min": "min", "grpo_s/seq_ratio_max": "max"}


def tag_extrema(metrics: dict) -> dict:
    """Make the :data:`EXTREMA_METRICS` among a loss's verl ``Metric`` values aggregate as min / max (in place).

    verl's ``ppo_loss`` wraps each registered-loss metric as ``Metric(value, MEAN)``; the worker then averages the
    micro-batch values over micro-batches and DP ranks (``Metric.aggregate_dp``), where MIN / MAX take the extreme.
    """
    from verl.utils.metric import AggregationType, Metric

    for key, aggregation in EXTREMA_METRICS.items():
        value = metrics.get(key)
        if isinstance(value, Metric) and value.aggregation is not AggregationType(aggregation):
            tagged = Metric(AggregationType(aggregation))
            tagged.extend(value.values)
            metrics[key] = tagged
    return metrics


class GRPOSPPOLoss:
    """Loss callable for ``set_loss_fn``: verl's ``ppo_loss`` (what verl's actor worker calls) plus
    :func:`tag_extrema`. ``fn(model_output, data, dp_group=None) -> (loss, metrics)``.

    Args:
        actor_config: the actor dataclass (``omega_conf_to_dataclass(config.actor_rollout_ref.actor)``).
    """

    def __init__(self, actor_config: Any):
        self.config = actor_config

    def __call__(self, model_output: dict, data: Any, dp_group: Any = None):
        from verl.workers.utils.losses import ppo_loss

        loss, metrics = ppo_loss(self.config, model_output, data, dp_group=dp_group)
        return loss, tag_extrema(metrics)


def install_grpo_s_loss(trainer: Any) -> bool:
    """Install :class:`GRPOSPPOLoss` in every actor worker when the policy loss is ``grpo_s``.

    Not with verl's distillation, whose own loss the workers keep (the extremes are then averaged). Call once after
    ``init_workers``, before the first step.

    Returns:
        Whether it was installed.
    """
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass

    config = trainer.config
    loss_mode = OmegaConf.select(config, "actor_rollout_ref.actor.policy_loss.loss_mode", default="vanilla")
    if loss_mode != "grpo_s" or OmegaConf.select(config, "distillation.enabled", default=False):
        return False
    trainer.actor_rollout_wg.set_loss_fn(GRPOSPPOLoss(omega_conf_to_dataclass(config.actor_rollout_ref.actor)))
    return True
