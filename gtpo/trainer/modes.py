"""The recipe's three trainer modes: :class:`~gtpo.trainer.mixin.GTPOTrainerMixin` on each v1 trainer.

* ``gtpo_sync`` on ``PPOTrainerSync``: generate, then train; weights synced every step.
* ``gtpo_colocate_async`` on ``PPOTrainerColocateAsync``: partial rollout on the training GPUs. Generation runs
  ahead (``trainer.v1.colocate_async.num_warmup_batches``), is aborted while a step trains and resumed with the
  new weights, so a response may span policy versions.
* ``gtpo_separate_async`` on ``PPOTrainerSeparateAsync``: a standalone rollout pool
  (``actor_rollout_ref.rollout.nnodes`` x ``n_gpus_per_node``) generates while the trainer trains; weights go over
  a checkpoint engine (nccl, ...) after every ``trainer.v1.separate_async.parameter_sync_step`` mini-batches.

Each class reports its base class's mode (``trainer_mode``), so verl's mode-dependent branches (replay buffer
class, dataloader refill, checkpointing of in-flight prompts, the ``trainer.v1.<mode>`` block) behave exactly as for
the unmodified trainer. ``configs/trainer/{sync,colocate_async,separate_async}.yaml`` select them (``trainer=...``).

One verl 0.9.1 defect is worked around here: ``PPOTrainerSeparateAsync._setup`` logs the ``hybrid_engine=false`` case
(the recipe's separate_async preset: no colocated replicas) with ``logger.info(..., flush=True)``
(``verl/trainer/ppo/v1/trainer_separate_async.py:181-185``), which the standard library's ``Logger`` refuses with a
``TypeError``: without the workaround (verl's module ``logger`` is a :class:`FlushDroppingAdapter` while ``_setup``
runs; the row ``separate-async-flush`` of the Seams table in ``docs/architecture.md``) that mode cannot start.
"""

from __future__ import annotations

import contextlib
import logging

from verl.trainer.ppo.v1 import trainer_separate_async
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_colocate_async import PPOTrainerColocateAsync
from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

from gtpo.trainer.mixin import GTPOTrainerMixin

__all__ = [
    "TRAINER_MODE",
    "TRAINER_MODES",
    "GTPOTrainerColocateAsync",
    "GTPOTrainerSeparateAsync",
    "GTPOTrainerSync",
]

# The default mode (recipe/gtpo/config/gtpo_trainer.yaml).
TRAINER_MODE = "gtpo_sync"


@register_trainer("gtpo_sync")
class GTPOTrainerSync(GTPOTrainerMixin, PPOTrainerSync):
    """verl's sync trainer with the recipe's behaviour."""

    REGISTERED_MODE = "gtpo_sync"
    VERL_MODE = "sync"


@register_trainer("gtpo_colocate_async")
class GTPOTrainerColocateAsync(GTPOTrainerMixin, PPOTrainerColocateAsync):
    """verl's colocated asynchronous trainer (partial rollout) with the recipe's behaviour."""

    REGISTERED_MODE = "gtpo_colocate_async"
    VERL_MODE = "colocate_async"


class FlushDroppingAdapter(logging.LoggerAdapter):
    """A logger that accepts (and drops) the ``flush=`` keyword ``print`` takes; everything else as ``logger``."""

    def process(self, msg, kwargs):
        kwargs.pop("flush", None)
        return msg, kwargs


@contextlib.contextmanager
def logger_ignoring_flush(module, name: str = "logger"):
    """``module.<name>`` (a module's ``logging.Logger``) replaced by a :class:`FlushDroppingAdapter` of it for the
    ``with`` block."""
    logger = getattr(module, name)
    setattr(module, name, FlushDroppingAdapter(logger, {}))
    try:
        yield
    finally:
        setattr(module, name, logger)


@register_trainer("gtpo_separate_async")
class GTPOTrainerSeparateAsync(GTPOTrainerMixin, PPOTrainerSeparateAsync):
    """verl's separate asynchronous trainer (standalone rollout pool) with the recipe's behaviour."""

    REGISTERED_MODE = "gtpo_separate_async"
    VERL_MODE = "separate_async"

    def _setup(self):
        # verl's _setup passes flush=True to logger.info when hybrid_engine=false (see the module docstring)
        with logger_ignoring_flush(trainer_separate_async):
            super()._setup()


# Registered name -> the verl mode its base class expects.
TRAINER_MODES: dict[str, str] = {
    cls.REGISTERED_MODE: cls.VERL_MODE for cls in (GTPOTrainerSync, GTPOTrainerColocateAsync, GTPOTrainerSeparateAsync)
}
