"""The actor loss the recipe's trainers install in verl's actor workers (``ActorRolloutRefWorker.set_loss_fn``).

Two losses, installed by :func:`install` after ``init_workers``:

- **DAPO w/ Forking Tokens** ("Beyond the 80/20 Rule", arXiv 2506.01939 v2, §5.1-5.2; ``algorithm.forking.enable``):
  the policy gradient is restricted to the top-``rho`` highest-entropy response tokens, and the token-mean
  denominator counts only those tokens (docs/ALGORITHMS.md §7.3). A registered policy loss cannot do this in verl
  0.9.1: it receives neither the entropy nor any way to change the denominator (``agg_loss`` normalises
  ``token-mean`` by the global mini-batch token count ``batch_num_tokens`` that the engine computes from
  ``loss_mask``). The narrowest correct hook is a whole-loss replacement: :class:`ForkingPPOLoss` selects the tokens,
  then calls verl's own ``ppo_loss`` (clip, rollout-IS weights, KL and entropy terms unchanged) on a shallow copy of
  the micro-batch whose ``response_mask`` is the selection and whose ``batch_num_tokens`` is the selected-token
  denominator (seam ``forking-loss``, docs/architecture.md).
- **The min / max metrics of a registered policy loss** (GRPO-S's ``seq_ratio_min`` / ``_max``): verl's ``ppo_loss``
  wraps every metric of a registered loss as ``Metric(value, MEAN)``, so a logged "min" would be a mean of
  per-micro-batch minima; :class:`ExtremaPPOLoss` is ``ppo_loss`` followed by :func:`tag_extrema`, which re-tags the
  extremes as MIN / MAX (the forking loss applies :func:`tag_extrema` too).

Forking scopes (``algorithm.forking.scope``):

- ``micro_batch`` (the paper's micro-batch; the knob's default): the threshold is the top-rho quantile of the
  **training** policy's entropy (``model_output["entropy"]``, present when ``actor.calculate_entropy=true``) over
  the valid tokens of the micro-batch on this rank. The micro-batch loss is ``sum_sel l / n_sel(mb)`` (the paper's
  ``J^B``), combined over micro-batches and ranks with verl's token weights ``n_valid(mb) / N``, i.e.
  ``batch_num_tokens_eff = N * n_sel(mb) / n_valid(mb)``.
- ``batch`` (the ``dapo_forking`` preset's: with token-budget micro-batches what a micro-batch holds depends on how
  the budget packed it, ``tests/test_path_equivalence.py``): the threshold is the top-rho quantile over the whole
  training batch of the **old** policy's entropy, taken on the driver
  (:func:`gtpo.algorithms.token_selection.batch_threshold_extra_info`, by the recipe's trainer) and handed over in
  the batch's ``extra_info``; the denominator is ``rho_B * N`` with ``rho_B`` the batch's realised fraction.

The mask is built under ``no_grad`` from detached entropies: no gradient flows through it; padding is never selected.
With ``entropy_coeff == 0`` (the preset's) verl's ``ppo_loss`` gets the entropy detached as well: it would otherwise
add ``0 * entropy_loss``, whose zero gradient makes the backward recompute verl's checkpointed chunked entropy with
autograd (``tokens x vocabulary x 4 B x 2``, ~28 GiB at the 7B preset's budget, :mod:`gtpo.launch.memory_estimate`).
Metrics (logged by verl as ``actor/forking/...``): ``forking/selected_token_frac``, ``forking/entropy_threshold``.
"""

from __future__ import annotations

from typing import Any

import torch

from gtpo.algorithms.token_selection import FRACTION_KEY, THRESHOLD_KEY, ForkingParams, top_entropy_mask
from gtpo.methods import ENTROPY, FIELDS, knob

__all__ = ["EXTREMA_METRICS", "ExtremaPPOLoss", "ForkingPPOLoss", "install", "tag_extrema"]

# The registered losses' metrics that are extremes of one micro-batch, and how to combine them.
EXTREMA_METRICS = {"grpo_s/seq_ratio_min": "min", "grpo_s/seq_ratio_max": "max"}


def _nested_to_padded(x: torch.Tensor, width: int) -> torch.Tensor:
    padded = x.to_padded_tensor(0) if x.is_nested else x
    if padded.shape[1] < width:
        padded = torch.nn.functional.pad(padded, (0, width - padded.shape[1]))
    return padded[:, :width]


def _padded_to_nested_like(padded: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Pack ``padded`` ``[b, W]`` into a jagged nested tensor with ``like``'s offsets (row i keeps ``len_i``)."""
    if not like.is_nested:
        return padded[:, : like.shape[1]].to(like.dtype)
    offsets = like.offsets()
    lengths = offsets.diff()
    inside = torch.arange(padded.shape[1], device=padded.device)[None, :] < lengths[:, None].to(padded.device)
    values = padded[inside].to(like.dtype)
    # Without explicit seqlen bounds to_padded_tensor pads to the total length; keep the row lengths' bounds.
    return torch.nested.nested_tensor_from_jagged(
        values, offsets, min_seqlen=int(lengths.min()), max_seqlen=int(lengths.max())
    )


class ForkingPPOLoss:
    """Loss callable for ``set_loss_fn``: ``fn(model_output, data, dp_group=None) -> (loss, metrics)``.

    Args:
        actor_config: the actor dataclass (``omega_conf_to_dataclass(config.actor_rollout_ref.actor)``); must use
            ``loss_agg_mode=token-mean``.
        params: :class:`ForkingParams`.
    """

    def __init__(self, actor_config: Any, params: ForkingParams):
        if actor_config.loss_agg_mode != "token-mean":
            raise ValueError(
                f"actor.loss_agg_mode={actor_config.loss_agg_mode!r}: forking tokens need token-mean (the "
                "denominator counts the selected tokens)"
            )
        self.config = actor_config
        self.params = params

    def __call__(self, model_output: dict, data: Any, dp_group: Any = None):
        from verl.utils import tensordict_utils as tu
        from verl.utils.metric import AggregationType, Metric
        from verl.workers.utils.losses import ppo_loss
        from verl.workers.utils.padding import no_padding_2_padding

        log_prob = no_padding_2_padding(model_output["log_probs"], data)
        width = log_prob.shape[1]
        resp_nested = data["response_mask"]
        valid = _nested_to_padded(resp_nested, width).bool()

        if self.params.scope == "micro_batch":
            ent = model_output.get("entropy", None)
            if ent is None:
                raise ValueError(
                    "algorithm.forking.scope=micro_batch needs the training policy's entropy: set "
                    "actor_rollout_ref.actor.calculate_entropy=true"
                )
            entropy = no_padding_2_padding(ent, data).detach()
            selected, tau = top_entropy_mask(entropy, valid, self.params.rho)
        else:
            tau_b = tu.get_non_tensor_data(data=data, key=THRESHOLD_KEY, default=None)
            frac_b = tu.get_non_tensor_data(data=data, key=FRACTION_KEY, default=None)
            old_entropy = FIELDS[ENTROPY]  # the old policy's entropy, a field of the batch the workers get
            if tau_b is None or frac_b is None or old_entropy not in data.keys():
                raise ValueError(
                    "algorithm.forking.scope=batch needs the driver hook: batch.extra_info from "
                    "gtpo.algorithms.token_selection.batch_threshold_extra_info and the old-policy entropy in the batch"
                )
            entropy = _nested_to_padded(data[old_entropy], width).detach()
            selected, tau = top_entropy_mask(entropy, valid, self.params.rho, threshold=float(tau_b))

        n_valid = int(valid.sum())
        n_sel = int(selected.sum())
        total = data["batch_num_tokens"]
        total = float(total.item() if isinstance(total, torch.Tensor) else total)
        if self.params.scope == "micro_batch":
            eff = total * n_sel / n_valid if n_sel > 0 else total
        else:
            eff = total * float(frac_b) if float(frac_b) > 0 else total

        sub = data.copy()
        sub["response_mask"] = _padded_to_nested_like(selected, resp_nested)
        tu.assign_non_tensor(sub, batch_num_tokens=eff)
        outputs = model_output
        if not self.config.entropy_coeff and model_output.get("entropy", None) is not None:
            # No entropy bonus: nothing may backpropagate into the entropy (see the module docstring).
            outputs = {**model_output, "entropy": model_output["entropy"].detach()}
        loss, metrics = ppo_loss(self.config, outputs, sub, dp_group=dp_group)
        tag_extrema(metrics)
        extra = {
            "forking/selected_token_frac": n_sel / max(n_valid, 1),
            "forking/entropy_threshold": float(tau) if torch.isfinite(tau) else 0.0,
        }
        metrics.update(Metric.from_dict(extra, aggregation=AggregationType.MEAN))
        return loss, metrics


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


class ExtremaPPOLoss:
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


def install(trainer: Any) -> ForkingParams | None:
    """Install :class:`ForkingPPOLoss` in every actor worker when ``algorithm.forking.enable``; else, when the policy
    loss has min / max metrics (``grpo_s``), :class:`ExtremaPPOLoss`; else leave verl's loss. Not under verl's
    distillation, whose own loss the workers keep (the extremes are then averaged).

    Call once after ``init_workers`` (the actor worker group exists), before the first step. Returns the forking
    knobs when the forking loss is installed, else None.
    """
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass

    config = trainer.config
    params = knob(config.algorithm, "forking")
    actor_config = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    if params.enable:
        if params.scope == "micro_batch" and not actor_config.calculate_entropy:
            raise ValueError(
                "algorithm.forking.scope=micro_batch needs actor_rollout_ref.actor.calculate_entropy=true "
                "(the training policy's entropy selects the tokens)"
            )
        trainer.actor_rollout_wg.set_loss_fn(ForkingPPOLoss(actor_config, params))
        return params
    loss_mode = OmegaConf.select(config, "actor_rollout_ref.actor.policy_loss.loss_mode", default="vanilla")
    has_extrema = any(key.startswith(f"{loss_mode}/") for key in EXTREMA_METRICS)
    if has_extrema and not OmegaConf.select(config, "distillation.enabled", default=False):
        trainer.actor_rollout_wg.set_loss_fn(ExtremaPPOLoss(actor_config))
    return None
