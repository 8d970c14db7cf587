"""Batch arithmetic at the run's world size, checked before Ray starts.

Without dynamic batch sizes every rank cuts its share of the rows into micro-batches of a fixed size, and verl
0.9.1 checks that the cut is even only inside the workers (``prepare_micro_batches`` in
``verl/workers/engine/utils.py``: "data size must be divisible by force_group_size * micro_batch_size_per_gpu"),
minutes after launch. The shares, as verl computes them:

* a PPO mini-batch of ``ppo_mini_batch_size × rollout.n`` responses is split evenly over the
  ``nnodes × n_gpus_per_node`` actor ranks;
* a log-prob pass (old policy, reference) takes the rank's share of the step's batch, which the trainer first pads
  with no-op rows to a multiple of ``lcm(world size, mini-batch responses)`` (``_get_required_batch_multiple`` in
  ``verl/trainer/ppo/v1/trainer_base.py``); under ``separate_async`` a step computes ``parameter_sync_step``
  slices of the batch one after another.

A world size that does not divide is refused here with the numbers and the keys to change.
"""

from __future__ import annotations

import math

from omegaconf import DictConfig, OmegaConf

__all__ = ["check_micro_batches"]


def _get(config: DictConfig, key: str, default=None):
    return OmegaConf.select(config, key, default=default)


def _log_prob_rows_per_rank(batch_rows: int, world: int, mini_rows: int) -> int:
    multiple = math.lcm(world, mini_rows)
    return -(-batch_rows // multiple) * multiple // world


def check_micro_batches(config: DictConfig) -> None:
    """Raise ``ValueError`` when a fixed micro-batch does not divide a rank's rows at the run's world size."""
    from gtpo.launch.async_checks import verl_mode

    nnodes, gpus = int(_get(config, "trainer.nnodes", 1)), int(_get(config, "trainer.n_gpus_per_node", 1))
    world = nnodes * gpus
    where = f"trainer.nnodes={nnodes} x trainer.n_gpus_per_node={gpus} = {world} ranks"
    n = int(_get(config, "actor_rollout_ref.rollout.n", 1))
    mini = _get(config, "actor_rollout_ref.actor.ppo_mini_batch_size")
    train_batch = _get(config, "data.train_batch_size")
    if mini is None or train_batch is None:
        return
    mini_rows = int(mini) * n
    if mini_rows % world:
        raise ValueError(
            f"actor_rollout_ref.actor.ppo_mini_batch_size={mini} x rollout.n={n} = {mini_rows} responses per "
            f"mini-batch do not split evenly over {where}"
        )
    if not _get(config, "actor_rollout_ref.actor.use_dynamic_bsz", False):
        micro = _get(config, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu")
        if micro and (mini_rows // world) % int(micro):
            raise ValueError(
                f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro} does not divide the "
                f"{mini_rows // world} responses each rank gets of a mini-batch ({mini_rows} over {where}); use a "
                "divisor of it or actor_rollout_ref.actor.use_dynamic_bsz=true"
            )
    separate = verl_mode(str(_get(config, "trainer.v1.trainer_mode", "gtpo_sync"))) == "separate_async"
    slices = int(_get(config, "trainer.v1.separate_async.parameter_sync_step", 1) or 1) if separate else 1
    batch_rows = int(train_batch) // slices * n
    per_rank = _log_prob_rows_per_rank(batch_rows, world, mini_rows)
    uses_ref = bool(_get(config, "actor_rollout_ref.actor.use_kl_loss", False)) or bool(
        _get(config, "algorithm.use_kl_in_reward", False)
    )
    for role in ("rollout", "ref"):
        if role == "ref" and not uses_ref:
            continue
        if _get(config, f"actor_rollout_ref.{role}.log_prob_use_dynamic_bsz", False):
            continue
        key = f"actor_rollout_ref.{role}.log_prob_micro_batch_size_per_gpu"
        micro = _get(config, key)
        if micro and per_rank % int(micro):
            raise ValueError(
                f"{key}={micro} does not divide the {per_rank} responses each rank gets of a log-prob pass "
                f"({batch_rows} responses, padded to a multiple of lcm({world}, {mini_rows}), over {where}); use a "
                f"divisor of {per_rank} or actor_rollout_ref.{role}.log_prob_use_dynamic_bsz=true"
            )
