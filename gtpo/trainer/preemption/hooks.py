"""Where in verl's step loop a stop is checked, saved and carried out (:class:`StopHooks`)."""

from __future__ import annotations

import contextlib

from gtpo.methods import knob
from gtpo.trainer.preemption.presence import TrainerPresence
from gtpo.trainer.preemption.stop import TrainerStop

__all__ = ["StopHooks"]


class StopHooks:
    """Stop requests and the job's deadline on a verl v1 trainer (:class:`.stop.TrainerStop`).

    verl 0.9.1's ``fit`` runs, per step: ``on_step_begin``, the step, the periodic save, ``on_step_end`` (the weight
    sync to the rollout), validation, metrics, ``logger.log``. Overrides:

    * ``fit``: the trainer's :class:`.stop.TrainerStop`, from ``algorithm.preemption``, and its record on the cluster
      (:class:`.presence.TrainerPresence`) while it runs, which the preStop hooks' request waits on;
    * ``on_step_end``: a request or a deadline that leaves no room for another step saves the finished step and skips
      the rest of the hook (the weight sync: nothing generates for this run again), without calling verl's;
    * ``on_step_begin``: ends the run (``PreemptedError``) once the finished step's metrics are logged; a request
      that came during validation or logging saves that step first;
    * ``_validate``: skipped once the run stops;
    * ``_save_checkpoint``: every save is timed, since the deadline needs a save's duration.

    Only ``on_step_begin`` and ``on_step_end`` are hooks verl declares; the rest, the save called from outside and the
    skipped ``on_step_end`` rely on the order of the steps in verl's ``fit`` (seam ``preemption-step-hooks``,
    docs/architecture.md).
    """

    def fit(self, agent_loop_manager):
        self._trainer_stop = TrainerStop(knob(self.config.algorithm, "preemption"))
        presence = TrainerPresence().start()
        try:
            return super().fit(agent_loop_manager)
        finally:
            presence.stop()

    def on_step_begin(self):
        self._trainer_stop.before_step(self)
        super().on_step_begin()

    def on_step_end(self):
        if self._trainer_stop.after_step(self):
            return
        super().on_step_end()

    def _validate(self):
        stop = self.__dict__.get("_trainer_stop")
        if stop is not None and stop.skip_validation():
            return {}
        return super()._validate()

    def _save_checkpoint(self):
        stop = self.__dict__.get("_trainer_stop")  # None before fit(): nothing to time for
        with stop.timed_save(self) if stop is not None else contextlib.nullcontext():
            super()._save_checkpoint()
