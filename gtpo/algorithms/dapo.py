"""DAPO pieces as pure reference functions (DAPO, arXiv 2503.14476, §3.4 and §4.1; docs/ALGORITHMS.md §7.2).

verl 0.9.1 already provides DAPO's soft overlong punishment (``reward.reward_manager.name=dapo`` with
``reward.reward_kwargs.overlong_buffer_cfg``) and its group filter (``algorithm.filter_groups`` in the v1
``ReplayBuffer``); the recipe's presets use those. The functions here restate the paper's formulas so that the
tests can check verl's mechanisms against them, and so that a trainer without verl's machinery can reuse them.

- Soft overlong punishment (DAPO Eq. 13):

      R_len(y) = 0                                   if |y| <= L_max - L_cache
               = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
               = -1                                  if |y| > L_max

  verl's manager computes ``min(-(|y| - (L_max - L_cache)) / L_cache * factor, 0)``: identical for
  ``|y| <= L_max`` at ``factor = 1``, and below -1 (unclamped) for ``|y| > L_max``, a case that cannot occur when
  ``max_resp_len`` equals ``rollout.response_length`` (generation stops at that length).
- Dynamic-sampling keep rule: a group is kept iff its accuracy is neither all 0 nor all 1, i.e. its metric is not
  constant over the group (verl evicts a group when the standard deviation of its metric is exactly 0).
"""

from __future__ import annotations

import torch

from gtpo.algorithms.group_ops import segment_sum

__all__ = ["overlong_reward", "mixed_groups"]


@torch.no_grad()
def overlong_reward(lengths: torch.Tensor, max_len: int, cache_len: int, penalty_factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment ``R_len`` per response.

    Args:
        lengths: ``[B]`` response lengths ``|y|`` in tokens.
        max_len: ``L_max`` (the expected maximum plus the cache, e.g. 20480).
        cache_len: ``L_cache`` (e.g. 4096), ``0 < L_cache <= L_max``.
        penalty_factor: scale of the penalty (1 in the paper).

    Returns:
        ``[B]`` float32 in ``[-penalty_factor, 0]``.
    """
    if not (0 < cache_len <= max_len):
        raise ValueError(f"cache_len={cache_len}: must satisfy 0 < cache_len <= max_len={max_len}")
    if penalty_factor < 0:
        raise ValueError(f"penalty_factor={penalty_factor}: must be >= 0")
    y = lengths.to(torch.float64)
    soft = ((max_len - cache_len) - y) / cache_len
    out = torch.where(y <= max_len - cache_len, torch.zeros_like(y), soft)
    out = torch.where(y > max_len, torch.full_like(y, -1.0), out)
    return (out * penalty_factor).to(torch.float32)


@torch.no_grad()
def mixed_groups(metric: torch.Tensor, gid: torch.Tensor, num_groups: int) -> torch.Tensor:
    """DAPO's keep decision per group: True iff the metric (accuracy) is not constant over the group.

    Args:
        metric: ``[B]`` per-response metric (e.g. accuracy in {0, 1}).
        gid: ``[B]`` int64 group ids; num_groups: ``NG``.

    Returns:
        ``[NG]`` bool. A group of one response is not kept (its accuracy is all 0 or all 1); verl's replay buffer
        differs here and keeps such a group (it only evicts groups of more than one response).
    """
    m = metric.to(torch.float64)
    gmax = torch.full((num_groups,), float("-inf"), dtype=torch.float64).scatter_reduce(0, gid, m, "amax")
    gmin = torch.full((num_groups,), float("inf"), dtype=torch.float64).scatter_reduce(0, gid, m, "amin")
    count = segment_sum(torch.ones_like(m), gid, num_groups)
    return (gmax > gmin) & (count > 1)
