"""The recipe's three trainer modes: verl 0.9.1's three v1 trainers, each with the recipe's behaviour put first
(:class:`GTPOTrainerMixin`, composed here from one class per concern).

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

Under asynchrony the rollout engine returns no entropy, and a response may span policy versions: the estimators use
the entropy recomputed by verl's old-log-prob pass, of the policy about to be updated (pi_old, one version for the
whole response; under ``separate_async`` the version saved at the start of the ``parameter_sync_step`` cycle).

One verl 0.9.1 defect is worked around here: ``PPOTrainerSeparateAsync._setup`` logs the ``hybrid_engine=false`` case
(the recipe's separate_async preset: no colocated replicas) with ``logger.info(..., flush=True)``, which the standard
library's ``Logger`` refuses with a ``TypeError``: without the workaround (verl's module ``logger`` is a
:class:`FlushDroppingAdapter` while ``_setup`` runs; the row ``separate-async-flush`` of the Seams table in
``docs/architecture.md``) that mode cannot start.
"""

from __future__ import annotations

import contextlib
import logging

from verl.trainer.ppo.v1 import trainer_separate_async
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_colocate_async import PPOTrainerColocateAsync
from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

from gtpo.trainer.advantage import AdvantageHandoff
from gtpo.trainer.dynamic_sampling import bound_generation_rounds
from gtpo.trainer.guard.hooks import GuardHooks
from gtpo.trainer.mode_names import TRAINER_MODES
from gtpo.trainer.observe.hooks import ObserveHooks
from gtpo.trainer.preemption.hooks import StopHooks
from gtpo.trainer.resume.hooks import ResumeHooks

__all__ = [
    "GTPOTrainerColocateAsync",
    "GTPOTrainerMixin",
    "GTPOTrainerSeparateAsync",
    "GTPOTrainerSync",
    "ReplayBufferSettings",
]


class ReplayBufferSettings:
    """verl's replay buffer with the recipe's sampler settings. Overrides ``_build_replay_buffer``:

    * ``trainer.v1.sampler.sampler_kwargs.poll_interval``: verl's ``ReplayBuffer`` polls TransferQueue every 2 s with
      no config key (it stores ``sampler_kwargs`` but does not read this one), so a step whose generation takes less
      (the CPU backend, small debug runs) would wait for nothing (seam ``replay-buffer-poll-interval``);
    * DAPO's ``algorithm.filter_groups.max_num_gen_batches`` round limit, which verl 0.9.1 ignores (sync only,
      :mod:`gtpo.trainer.dynamic_sampling`).
    """

    def _build_replay_buffer(self):
        buffer = super()._build_replay_buffer()
        poll_interval = self.config.trainer.v1.sampler.get("sampler_kwargs", {}).get("poll_interval", None)
        if poll_interval is not None:
            if not float(poll_interval) > 0:
                raise ValueError(f"trainer.v1.sampler.sampler_kwargs.poll_interval={poll_interval!r}: must be > 0 s")
            buffer.poll_interval = float(poll_interval)
        return bound_generation_rounds(buffer, self.config.algorithm)


class GTPOTrainerMixin(AdvantageHandoff, ObserveHooks, StopHooks, GuardHooks, ResumeHooks, ReplayBufferSettings):
    """The recipe's behaviour, put before one of verl's v1 trainers in the bases; subclasses set the two class
    attributes below. One class per concern, each naming the verl members it overrides:

    * :class:`~gtpo.trainer.advantage.AdvantageHandoff`: the estimators' inputs, the actor loss;
    * :class:`~gtpo.trainer.observe.hooks.ObserveHooks`: dumps, validation columns, staleness, the trackers' history;
    * :class:`~gtpo.trainer.preemption.hooks.StopHooks`: save and stop on a stop request or before the job's end;
    * :class:`~gtpo.trainer.guard.hooks.GuardHooks`: stage deadlines and the start-up check;
    * :class:`~gtpo.trainer.resume.hooks.ResumeHooks`: checkpoints, resume, the recipe's state;
    * :class:`ReplayBufferSettings`: the poll interval and DAPO's round limit.

    The order matters where two of them override one member: the stop times the whole save (``_save_checkpoint``),
    and the generation watchdog wraps the buffer the settings built (``_build_replay_buffer``).

    Itself it overrides ``trainer_mode`` (seam ``trainer-mode``): verl stores the registered name there, and its base
    class branches on the literal mode.
    """

    # The name the class is registered under (trainer.v1.trainer_mode), e.g. "gtpo_colocate_async".
    REGISTERED_MODE: str = ""
    # The mode verl's base class branches on: "sync", "colocate_async" or "separate_async".
    VERL_MODE: str = ""

    @property
    def trainer_mode(self) -> str:
        return self.VERL_MODE

    @trainer_mode.setter
    def trainer_mode(self, value: str) -> None:
        if value != self.REGISTERED_MODE:
            raise ValueError(f"trainer.v1.trainer_mode={value!r} selects another trainer than {self.REGISTERED_MODE}")


@register_trainer("gtpo_sync")
class GTPOTrainerSync(GTPOTrainerMixin, PPOTrainerSync):
    """verl's sync trainer with the recipe's behaviour."""

    REGISTERED_MODE = "gtpo_sync"
    VERL_MODE = TRAINER_MODES[REGISTERED_MODE]


@register_trainer("gtpo_colocate_async")
class GTPOTrainerColocateAsync(GTPOTrainerMixin, PPOTrainerColocateAsync):
    """verl's colocated asynchronous trainer (partial rollout) with the recipe's behaviour."""

    REGISTERED_MODE = "gtpo_colocate_async"
    VERL_MODE = TRAINER_MODES[REGISTERED_MODE]


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
    VERL_MODE = TRAINER_MODES[REGISTERED_MODE]

    def _setup(self):
        # verl's _setup passes flush=True to logger.info when hybrid_engine=false (see the module docstring)
        with logger_ignoring_flush(trainer_separate_async):
            super()._setup()
