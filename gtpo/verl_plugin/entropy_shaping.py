"""verl adapters for GTPO-token and GRPO-S (Tan et al., arXiv 2508.04349), plus GROP (App. D).

Registers into verl's registries on import (only ``verl.trainer.ppo.core_algos`` is needed; nothing starts Ray):

- ``register_adv_est("gtpo")``   -> :func:`compute_gtpo_advantage`   (knobs ``algorithm.gtpo``, ``algorithm.grop``)
- ``register_adv_est("grpo_s")`` -> :func:`compute_grpo_s_advantage` (knobs ``algorithm.grpo_s``, ``algorithm.grop``)
- ``register_policy_loss("grpo_s")`` -> :func:`compute_policy_loss_grpo_s` (arithmetic-mean sequence ratio, clipped
  per sequence; use ``actor.loss_agg_mode=seq-mean-token-mean`` for the paper's 1/G mean over sequences).

verl's ``ppo_loss`` logs every registered loss's metrics as means over micro-batches and data-parallel ranks; the
extremes ``grpo_s/seq_ratio_min`` / ``_max`` are aggregated as min / max by :mod:`gtpo.verl_plugin.loss_metrics`.

The estimators follow the recipe's contract: ``fn(token_level_rewards, response_mask, index, config, entropy=None,
responses=None, metrics=None, **kwargs) -> (advantages, returns)``. The sequence reward is
``token_level_rewards.sum(-1)``; groups are read from ``index`` (uids), never from row positions. With
``algorithm.grop.enable`` the GROP penalty is computed here from the response lengths and correctness and added to
the reward base of every response (it does not change which responses count as correct); callers must therefore pass
unpenalised rewards (:data:`ESTIMATORS_APPLYING_GROP`). ``returns`` is the advantages tensor itself, as verl's GRPO
estimators return it (one ``[B, L]`` write instead of two; the recipe's trainer copies both into the batch).
Diagnostics go to ``metrics`` as python floats under ``gtpo/...`` / ``grpo_s/...`` (GROP: ``grop/penalty_mean``,
``grop/penalised_frac``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from verl.trainer.ppo.core_algos import agg_loss, register_adv_est, register_policy_loss

from gtpo.algorithms.entropy_shaping import grpo_s_advantages, gtpo_token_advantages
from gtpo.algorithms.group_ops import group_ids
from gtpo.algorithms.kernel_dispatch import row_sums
from gtpo.algorithms.length_penalty import GROPParams, grop_penalty
from gtpo.algorithms.losses import grpo_s_loss_matrix
from gtpo.algorithms.shaping_params import GRPOSParams, GTPOParams
from gtpo.knobs import load_knobs

__all__ = [
    "ESTIMATORS_APPLYING_GROP",
    "compute_gtpo_advantage",
    "compute_grpo_s_advantage",
    "compute_policy_loss_grpo_s",
    "load_gtpo_params",
    "load_grpo_s_params",
    "load_grop_params",
]


# These estimators add the GROP penalty themselves (to the reward base of both polarities, so a penalised
# incorrect response keeps its penalty under the literal -1 base of Eq. 5); a caller must not add it to the
# rewards a second time.
ESTIMATORS_APPLYING_GROP = frozenset({"gtpo", "grpo_s"})


def _block(config: Any, key: str) -> Any:
    if config is None:
        return None
    getter = getattr(config, "get", None)
    if getter is None:
        return getattr(config, key, None)
    return getter(key, None)


def load_gtpo_params(config: Any) -> GTPOParams:
    """``algorithm.gtpo`` as :class:`GTPOParams` (defaults when absent); errors name ``algorithm.gtpo.<key>``."""
    return load_knobs(GTPOParams, _block(config, "gtpo"), "algorithm.gtpo")


def load_grpo_s_params(config: Any) -> GRPOSParams:
    """``algorithm.grpo_s`` as :class:`GRPOSParams`; errors name ``algorithm.grpo_s.<key>``."""
    return load_knobs(GRPOSParams, _block(config, "grpo_s"), "algorithm.grpo_s")


def load_grop_params(config: Any) -> GROPParams:
    """``algorithm.grop`` as :class:`GROPParams`; errors name ``algorithm.grop.<key>``."""
    return load_knobs(GROPParams, _block(config, "grop"), "algorithm.grop")


def _common_inputs(name: str, token_level_rewards, response_mask, index, entropy):
    """Validate the verl-side inputs; return ``(rewards [B], mask [B, L] (dtype as given), gid [B], num_groups)``."""
    if entropy is None:
        raise ValueError(
            f"adv_estimator={name} needs the old policy's per-token entropy, got entropy=None (run one of the "
            "recipe's trainers, trainer.v1.trainer_mode=gtpo_sync, gtpo_colocate_async or gtpo_separate_async; "
            "rollout_correction.bypass_mode computes no entropy)"
        )
    if index is None:
        raise ValueError(f"adv_estimator={name} needs index (the uid of each row's prompt group), got None")
    if not isinstance(token_level_rewards, torch.Tensor) or token_level_rewards.dim() != 2:
        raise ValueError(f"token_level_rewards must be a [batch, response_len] tensor, got {type(token_level_rewards)}")
    if not isinstance(response_mask, torch.Tensor) or response_mask.shape != token_level_rewards.shape:
        raise ValueError(
            f"response_mask shape {getattr(response_mask, 'shape', None)} does not match token_level_rewards shape "
            f"{tuple(token_level_rewards.shape)}"
        )
    if not isinstance(entropy, torch.Tensor) or entropy.shape != token_level_rewards.shape:
        raise ValueError(
            f"entropy shape {getattr(entropy, 'shape', None)} does not match token_level_rewards shape "
            f"{tuple(token_level_rewards.shape)}"
        )
    idx = np.asarray(index, dtype=object) if not isinstance(index, (np.ndarray, torch.Tensor)) else index
    if len(idx) != token_level_rewards.shape[0]:
        raise ValueError(f"index has {len(idx)} entries for {token_level_rewards.shape[0]} rows")
    gid, num_groups = group_ids(idx)
    device = token_level_rewards.device
    rewards = row_sums(token_level_rewards)
    # the mask goes through as given (0/1 of any dtype): a bool copy would be one more pass over [B, L]
    return rewards, response_mask.to(device), gid.to(device), num_groups


def _grop_offset(config, rewards, mask, gid, num_groups, threshold, diag):
    """GROP penalty ``[B]`` from lengths and correctness (``reward > threshold``), or None when disabled."""
    grop = load_grop_params(config)
    if not grop.enable:
        return None
    correct = rewards > threshold
    pen = grop_penalty(row_sums(mask), correct, gid, num_groups, params=grop)
    b = max(int(pen.numel()), 1)
    diag["grop/penalty_mean"] = float(pen.sum()) / b
    diag["grop/penalised_frac"] = float((pen < 0).sum()) / b
    return pen.to(device=rewards.device)


def _write_metrics(metrics: dict | None, prefix: str, diag: dict[str, float], extra: dict[str, float]) -> None:
    if metrics is None:
        return
    for key, value in diag.items():
        metrics[f"{prefix}/{key}"] = float(value)
    for key, value in extra.items():
        metrics[key] = float(value)


@register_adv_est("gtpo")
def compute_gtpo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray | None = None,
    config: Any = None,
    entropy: torch.Tensor | None = None,
    responses: torch.Tensor | None = None,
    metrics: dict | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GTPO-token advantages (Eq. 3, 5, 6) as a verl advantage estimator.

    Args:
        token_level_rewards: ``[B, L]``; the sequence reward is the row sum.
        response_mask: ``[B, L]``.
        index: ``[B]`` uid per row (numpy object array); rows in any order, groups of any size.
        config: the ``algorithm`` config node; knobs under ``algorithm.gtpo`` and ``algorithm.grop``.
        entropy: ``[B, L]`` old-policy token entropy (required).
        responses: ``[B, L]`` token ids (required when ``algorithm.gtpo.conflict_mask``).
        metrics: optional dict receiving ``gtpo/<key>`` python floats.
        **kwargs: other fields verl may pass (ignored).

    Returns:
        ``(advantages, returns)``, both ``[B, L]`` in ``token_level_rewards``' dtype, zero on padding.
    """
    params = load_gtpo_params(config)
    rewards, mask, gid, num_groups = _common_inputs("gtpo", token_level_rewards, response_mask, index, entropy)
    extra: dict[str, float] = {}
    offset = _grop_offset(config, rewards, mask, gid, num_groups, params.reward_threshold, extra)
    adv, diag = gtpo_token_advantages(
        entropy, mask, rewards, gid, num_groups, params, reward_offset=offset, responses=responses
    )
    _write_metrics(metrics, "gtpo", diag, extra)
    adv = adv.to(token_level_rewards.dtype)
    return adv, adv


@register_adv_est("grpo_s")
def compute_grpo_s_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray | None = None,
    config: Any = None,
    entropy: torch.Tensor | None = None,
    responses: torch.Tensor | None = None,
    metrics: dict | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO-S sequence advantages broadcast to tokens, as a verl advantage estimator.

    Same arguments as :func:`compute_gtpo_advantage`; knobs under ``algorithm.grpo_s`` and ``algorithm.grop``;
    metrics under ``grpo_s/<key>``. ``responses`` is accepted and unused.
    """
    params = load_grpo_s_params(config)
    rewards, mask, gid, num_groups = _common_inputs("grpo_s", token_level_rewards, response_mask, index, entropy)
    extra: dict[str, float] = {}
    offset = _grop_offset(config, rewards, mask, gid, num_groups, params.reward_threshold, extra)
    adv, diag = grpo_s_advantages(entropy, mask, rewards, gid, num_groups, params, reward_offset=offset)
    _write_metrics(metrics, "grpo_s", diag, extra)
    adv = adv.to(token_level_rewards.dtype)
    return adv, adv


def _clip_bounds(config: Any) -> tuple[float, float]:
    clip = getattr(config, "clip_ratio", 0.2)
    low = getattr(config, "clip_ratio_low", None)
    high = getattr(config, "clip_ratio_high", None)
    low = clip if low is None else low
    high = clip if high is None else high
    return float(low), float(high)


@register_policy_loss("grpo_s")
def compute_policy_loss_grpo_s(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """GRPO-S clipped sequence-level policy loss (see :mod:`gtpo.algorithms.losses`).

    ``loss_agg_mode="seq-mean-token-mean"`` reproduces the paper's ``(1/G) sum_i l_i`` exactly; it is aggregated by
    verl's ``agg_loss`` with ``config.global_batch_info`` (DP size, global batch size), so micro-batching and data
    parallelism give the mini-batch mean. ``rollout_is_weights`` ``[B, L]``, when given, multiply the per-token
    copies of ``l_i``.

    Args:
        old_log_prob, log_prob, advantages, response_mask: ``[B, L]``.
        loss_agg_mode: verl aggregation mode.
        config: the actor config (``clip_ratio_low`` / ``clip_ratio_high``, ``global_batch_info``).
        rollout_is_weights: optional ``[B, L]``.

    Returns:
        ``(loss, metrics)``; metrics ``grpo_s/seq_ratio_mean|min|max``, ``grpo_s/seq_clipfrac``,
        ``grpo_s/seq_clipfrac_high``, ``grpo_s/seq_clipfrac_low``, ``grpo_s/ppo_kl`` as python floats (of this
        micro-batch; :mod:`gtpo.verl_plugin.loss_metrics` makes the extremes aggregate as min / max).
    """
    if config is None:
        raise ValueError("policy loss grpo_s needs the actor config (clip_ratio_low / clip_ratio_high), got None")
    low, high = _clip_bounds(config)
    loss_mat, stats = grpo_s_loss_matrix(log_prob, old_log_prob, advantages, response_mask, low, high)
    if rollout_is_weights is not None:
        loss_mat = loss_mat * rollout_is_weights
    batch_info = getattr(config, "global_batch_info", None) or {}
    loss = agg_loss(loss_mat=loss_mat, loss_mask=response_mask, loss_agg_mode=loss_agg_mode, **batch_info)

    m = response_mask.bool()
    valid = stats["seq_valid"]
    n_seq = max(int(valid.sum()), 1)
    ratio = stats["seq_ratio"][valid]
    n_tok = max(int(m.sum()), 1)
    kl = torch.where(m, (old_log_prob - log_prob).detach(), torch.zeros_like(log_prob)).sum() / n_tok
    high_n = int(stats["seq_clipped_high"].sum())
    low_n = int(stats["seq_clipped_low"].sum())
    metrics = {
        "grpo_s/seq_ratio_mean": float(ratio.mean()) if ratio.numel() else 1.0,
        "grpo_s/seq_ratio_min": float(ratio.min()) if ratio.numel() else 1.0,
        "grpo_s/seq_ratio_max": float(ratio.max()) if ratio.numel() else 1.0,
        "grpo_s/seq_clipfrac": (high_n + low_n) / n_seq,
        "grpo_s/seq_clipfrac_high": high_n / n_seq,
        "grpo_s/seq_clipfrac_low": low_n / n_seq,
        "grpo_s/ppo_kl": float(kl),
    }
    return loss, metrics
