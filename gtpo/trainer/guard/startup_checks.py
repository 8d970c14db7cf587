"""Start-up checks inside the trainer: a run that would go wrong stops before it trains.

Once the trainer has built its workers, :func:`check_reward_workers` stops a run whose reward workers failed.
verl 0.9.1's ``RewardLoopManager`` creates its ``RewardLoopWorker`` actors with ``.remote()`` and never waits for
them. A worker whose ``__init__`` raises (verl's DAPO reward manager asserting on its overlong buffer, a custom
reward function that does not load, any reward manager that rejects its config) is a dead actor that nobody has
asked yet: the first ``compute_score_batch`` call from the agent loop fails, the agent loop marks the rollouts as
failed, and the trainer stops at step 1 with "Sync replay buffer selected terminal groups with no materializable
trajectories", an error that names none of this. :func:`check_reward_workers` waits for every reward worker to be
constructed and raises the first construction error with the constructor's own traceback and message. It reads
verl's ``reward_loop_workers`` and calls Ray's internal ``__ray_ready__`` (seam ``reward-worker-readiness``,
docs/architecture.md).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

# Seconds to wait for the reward workers' constructors (tokenizer load, reward-function import); a worker still
# pending after that is left to verl (it may be waiting for resources) with a warning.
REWARD_WORKER_READY_TIMEOUT_S = 300.0


class RewardWorkerStartupError(RuntimeError):
    """A reward-loop worker failed in its constructor; the message carries the original error."""


def check_reward_workers(trainer, timeout_s: float = REWARD_WORKER_READY_TIMEOUT_S) -> int:
    """Wait until every reward-loop worker of ``trainer.reward_loop_manager`` is constructed; raise if one failed.

    Args:
        trainer: verl's v1 trainer after ``_setup()`` (``trainer.reward_loop_manager.reward_loop_workers``: Ray
            actor handles). A trainer without reward workers passes.
        timeout_s: how long to wait for the constructors.

    Returns:
        the number of workers found ready.

    Raises:
        RewardWorkerStartupError: naming the worker and the reward manager, with Ray's report of the constructor's
            exception (its traceback, type and message) and chained to Ray's error.
    """
    import ray
    from ray.exceptions import RayActorError

    manager = getattr(trainer, "reward_loop_manager", None)
    workers = list(getattr(manager, "reward_loop_workers", None) or [])
    if not workers:
        return 0
    pending = {w.__ray_ready__.remote(): i for i, w in enumerate(workers)}
    ready, not_ready = ray.wait(list(pending), num_returns=len(pending), timeout=timeout_s)
    for ref in ready:
        try:
            ray.get(ref)
        except RayActorError as err:
            # Ray's message holds the constructor's traceback and exception ("AssertionError: ...").
            reward_manager = trainer.config.reward.reward_manager.get("name", None)
            raise RewardWorkerStartupError(
                f"reward worker {pending[ref]} (reward.reward_manager.name={reward_manager}) failed in its "
                f"constructor; the run stops before training. {getattr(err, 'error_msg', None) or err}"
            ) from err
    if not_ready:
        logger.warning("%d reward worker(s) not ready after %.0f s; not checked", len(not_ready), timeout_s)
    return len(ready)
