"""Start-up checks: a run that would go wrong stops before it trains.

Before Ray starts (the recipe's entry point, the preflight), :func:`check_cpu_backend` refuses the CPU test backend
in a run whose ``trainer.device`` is not ``cpu``: ``VERL_PLATFORM=cpu`` or a ``gtpo.cpu`` module in
``VERL_USE_EXTERNAL_MODULES`` (the variables :func:`gtpo.cpu.env` sets), inherited from a shell that ran the CPU
tests, would put the CPU platform and its gloo-only process groups on the GPU workers: no error, a very slow run.

Once the trainer has built its workers, :func:`check_reward_workers` stops a run whose reward workers failed.
verl 0.9.1's ``RewardLoopManager`` creates its ``RewardLoopWorker`` actors with ``.remote()`` and never waits for
them. A worker whose ``__init__`` raises (verl's DAPO reward manager asserting on its overlong buffer, a custom
reward function that does not load, any reward manager that rejects its config) is a dead actor that nobody has
asked yet: the first ``compute_score_batch`` call from the agent loop fails, the agent loop marks the rollouts as
failed, and the trainer stops at step 1 with "Sync replay buffer selected terminal groups with no materializable
trajectories", an error that names none of this. :func:`check_reward_workers` waits for every reward worker to be
constructed and raises the first construction error with the constructor's own traceback and message.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from omegaconf import OmegaConf

logger = logging.getLogger(__name__)

# The CPU test backend's package, and the config key of the environment verl's Ray processes get.
CPU_BACKEND_PACKAGE = "gtpo.cpu"
RUNTIME_ENV_VARS_KEY = "ray_kwargs.ray_init.runtime_env.env_vars"

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


def check_cpu_backend(config: Any, environ: Mapping[str, str] | None = None) -> None:
    """Refuse the CPU test backend (``gtpo.cpu``) when ``trainer.device`` is not ``cpu``.

    Args:
        config: the trainer config (``trainer.device``, ``ray_kwargs.ray_init.runtime_env.env_vars``).
        environ: the driver's environment, which a fresh local Ray passes on to its workers (default ``os.environ``).

    Raises:
        ValueError: naming each variable that selects the CPU backend and where it is set.
    """
    device = str(OmegaConf.select(config, "trainer.device", default="cuda"))
    if device == "cpu":
        return
    sources = {"the environment": os.environ if environ is None else environ}
    sources[RUNTIME_ENV_VARS_KEY] = OmegaConf.select(config, RUNTIME_ENV_VARS_KEY, default=None) or {}
    found = []
    for where, env in sources.items():
        platform = str(env.get("VERL_PLATFORM", "") or "")
        if platform.strip().lower() == "cpu":
            found.append(f"VERL_PLATFORM={platform} ({where})")
        modules = [m.strip() for m in str(env.get("VERL_USE_EXTERNAL_MODULES", "") or "").split(",")]
        cpu_modules = [m for m in modules if m == CPU_BACKEND_PACKAGE or m.startswith(CPU_BACKEND_PACKAGE + ".")]
        if cpu_modules:
            found.append(f"VERL_USE_EXTERNAL_MODULES with {','.join(cpu_modules)} ({where})")
    if found:
        raise ValueError(
            f"trainer.device={device} but {'; '.join(found)}: the CPU test backend (gtpo.cpu.env()) would run verl's "
            "workers on its cpu platform with gloo-only process groups; unset these for a GPU run, or run the CPU "
            "backend with backend=cpu_tiny (trainer.device=cpu)"
        )
