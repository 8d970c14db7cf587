"""verl's side of the method table: a row's estimator and policy loss in verl's calling conventions.

verl calls an advantage estimator as ``fn(token_level_rewards, response_mask, index, config, **kwargs)``; the recipe's
trainers (:mod:`gtpo.trainer.advantage`) add what the row needs from the batch (``entropy=``, ``responses=``: the
row's ``needs``, :data:`gtpo.methods.FIELDS`), ``metrics=`` (a dict the call writes ``<estimator>/...`` floats
into), ``global_steps=`` and ``state=`` (the estimator's block of the trainer's cross-step state). One adapter
serves every row (:class:`VerlEstimator`): it checks the inputs, turns the uids into group ids, takes the sequence
reward as the row sum of ``token_level_rewards`` (verl's are 0 off the response's last token), reads the row's knob
block, adds GROP's penalty where the row applies it (``algorithm.grop``, App. D of arXiv 2508.04349: to the reward
base of both polarities, so the callers pass unpenalised rewards) and calls the row's estimator. ``returns`` is the
advantages tensor itself, as verl's GRPO estimators return it.

A row's policy loss (:func:`verl_policy_loss`) gets verl's ``(old_log_prob, log_prob, advantages, response_mask,
loss_agg_mode, config, rollout_is_weights)``; the row's function returns the per-token loss matrix, aggregated here
with verl's ``agg_loss`` and ``config.global_batch_info`` (so micro-batches and data-parallel ranks give the
mini-batch mean), and its metrics, logged under the row's name.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from gtpo.algorithms.group_ops import group_ids
from gtpo.algorithms.kernel_dispatch import row_sums
from gtpo.algorithms.length_penalty import grop_penalty
from gtpo.methods import Method, knob

__all__ = ["VerlEstimator", "verl_policy_loss"]


class VerlEstimator:
    """A row's estimator as a verl advantage estimator (registered under ``method.adv_estimator``)."""

    def __init__(self, method: Method):
        self.method = method
        self.__name__ = f"compute_{method.adv_estimator}_advantage"
        self.__doc__ = f"{method.name} ({method.paper}) in verl's estimator contract: {method.advantages.__doc__}"

    def __call__(
        self,
        token_level_rewards: torch.Tensor,
        response_mask: torch.Tensor,
        index: np.ndarray | None = None,
        config: Any = None,
        entropy: torch.Tensor | None = None,
        responses: torch.Tensor | None = None,
        metrics: dict | None = None,
        state: dict | None = None,
        global_steps: int | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        method, name = self.method, self.method.adv_estimator
        params = knob(config, method.knobs)
        given = {"entropy": entropy, "responses": responses}
        for need in (*method.needs, *getattr(params, "needs", ())):
            if given[need] is None:
                raise ValueError(
                    f"adv_estimator={name} needs {need}, got {need}=None: the recipe's trainers hand it over "
                    "(trainer.v1.trainer_mode=gtpo_sync, gtpo_colocate_async or gtpo_separate_async); "
                    "algorithm.rollout_correction.bypass_mode computes no entropy"
                )
            _check_like(need, given[need], token_level_rewards)
        _check_like("response_mask", response_mask, token_level_rewards)
        if index is None:
            raise ValueError(f"adv_estimator={name} needs index (the uid of each row's prompt group), got None")
        if len(index) != token_level_rewards.shape[0]:
            raise ValueError(f"index has {len(index)} entries for {token_level_rewards.shape[0]} rows")
        gid, num_groups = group_ids(index)
        gid = gid.to(token_level_rewards.device)
        rewards = row_sums(token_level_rewards)
        extra: dict[str, float] = {}
        offset = None
        if method.applies_grop:
            offset = _grop_offset(config, rewards, response_mask, gid, num_groups, params.reward_threshold, extra)
        advantages, diagnostics = method.advantages(
            entropy=entropy,
            response_mask=response_mask,
            rewards=rewards,
            gid=gid,
            num_groups=num_groups,
            params=params,
            responses=responses,
            reward_offset=offset,
            state=state,
            global_steps=global_steps,
        )
        if metrics is not None:
            metrics.update({f"{name}/{key}": float(value) for key, value in diagnostics.items()})
            metrics.update(extra)
        advantages = advantages.to(token_level_rewards.dtype)
        return advantages, advantages


def _check_like(name: str, value: Any, rewards: torch.Tensor) -> None:
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(rewards.shape):
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{name} shape {got} does not match token_level_rewards shape {tuple(rewards.shape)}")


def _grop_offset(config, rewards, response_mask, gid, num_groups, threshold, extra) -> torch.Tensor | None:
    """GROP's penalty ``[B]`` from the response lengths and correctness (``reward > threshold``); None when off."""
    grop = knob(config, "grop")
    if not grop.enable:
        return None
    lengths = row_sums(response_mask)
    penalty = grop_penalty(lengths, rewards > threshold, gid, num_groups, params=grop)
    count = max(int(penalty.numel()), 1)
    extra["grop/penalty_mean"] = float(penalty.sum()) / count
    extra["grop/penalised_frac"] = float((penalty < 0).sum()) / count
    return penalty.to(device=rewards.device)


def verl_policy_loss(method: Method):
    """``method``'s policy loss as a verl policy loss (for ``register_policy_loss(method.name)``)."""
    # imported here, not with the module: verl's package import loads the registration, which imports this module
    from verl.trainer.ppo.core_algos import agg_loss

    def policy_loss(
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = "seq-mean-token-mean",
        config: Any = None,
        rollout_is_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        if config is None:
            raise ValueError(f"policy loss {method.name} needs the actor config (clip_ratio_low / _high), got None")
        clip = getattr(config, "clip_ratio", 0.2)
        low, high = getattr(config, "clip_ratio_low", None), getattr(config, "clip_ratio_high", None)
        low, high = float(clip if low is None else low), float(clip if high is None else high)
        loss_mat, stats = method.policy_loss(log_prob, old_log_prob, advantages, response_mask, low, high)
        if rollout_is_weights is not None:
            loss_mat = loss_mat * rollout_is_weights
        batch_info = getattr(config, "global_batch_info", None) or {}
        loss = agg_loss(loss_mat=loss_mat, loss_mask=response_mask, loss_agg_mode=loss_agg_mode, **batch_info)
        return loss, {f"{method.name}/{key}": value for key, value in stats.items()}

    policy_loss.__name__ = policy_loss.__qualname__ = f"compute_policy_loss_{method.name}"
    policy_loss.__doc__ = f"{method.name}'s policy loss in verl's contract: {method.policy_loss.__doc__}"
    return policy_loss
