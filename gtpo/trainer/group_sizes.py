"""Group sizes the recipe's estimators see: a group short of ``rollout.n`` responses is logged, or refused.

verl 0.9.1's replay buffer keeps a prompt sampleable when some of its ``n`` agent-loop sessions failed (a request
error, a replica restarted) and drops the failed trajectories (``verl/trainer/ppo/v1/replay_buffer.py``), so a
group can reach the estimator with, say, 14 of 16 responses. Every estimator takes groups of any size, but GTPO's
group-scope statistics, GRPO-S's group standard deviation and ``gtpo_traj``'s conflict tokens then rest on fewer
responses without anything saying so. Each estimator call logs ``<estimator>/min_group_size`` and
``<estimator>/short_groups_total`` (groups with fewer than ``rollout.n`` responses); ``algorithm.groups.refuse_short``
fails the step instead. The names choose how verl's ``MetricsAggregator`` combines the ``parameter_sync_step`` slices
of a separate_async step (``verl/trainer/ppo/v1/utils.py``, by name): "min" takes the smallest, "total" the sum; a
count under any other name would be averaged over the slices.
"""

from __future__ import annotations

import numpy as np

__all__ = ["ShortGroupError", "group_size_metrics"]


class ShortGroupError(RuntimeError):
    """A group reached the estimator with fewer than ``rollout.n`` responses and ``refuse_short`` is set."""


def group_size_metrics(index: np.ndarray, expected: int, prefix: str, refuse_short: bool = False) -> dict[str, float]:
    """``{<prefix>/min_group_size, <prefix>/short_groups_total}`` of the uids in ``index``.

    Args:
        index: ``[rows]`` group id (uid) of each real response.
        expected: responses per group (``actor_rollout_ref.rollout.n``).
        prefix: the estimator's metric prefix.
        refuse_short: raise :class:`ShortGroupError` when a group has fewer than ``expected`` responses.
    """
    if expected < 1:
        raise ValueError(f"expected={expected!r}: responses per group must be >= 1")
    if len(index) == 0:
        return {f"{prefix}/min_group_size": 0.0, f"{prefix}/short_groups_total": 0.0}
    uids, sizes = np.unique(np.asarray(index, dtype=object).astype(str), return_counts=True)
    short = sizes < expected
    if refuse_short and short.any():
        listed = ", ".join(f"{u} ({s})" for u, s in zip(uids[short][:5], sizes[short][:5]))
        raise ShortGroupError(
            f"{int(short.sum())} of {len(uids)} groups have fewer than rollout.n={expected} responses (failed rollout "
            f"sessions): {listed}{', ...' if short.sum() > 5 else ''}; algorithm.groups.refuse_short=false shapes "
            "them with the responses they have"
        )
    return {f"{prefix}/min_group_size": float(sizes.min()), f"{prefix}/short_groups_total": float(short.sum())}
