"""The trainer's side of preemption (:mod:`gtpo.trainer.preemption`): where in verl's step loop it saves and stops.

verl 0.9.1's ``fit`` runs, per step: ``on_step_begin``, the step, the periodic save, ``on_step_end`` (the weight sync
to the rollout), validation, metrics, ``logger.log``. :class:`TrainerStop` is called from the mixin's
``on_step_end`` (a stop request or a deadline that no longer leaves room for another step: save the finished step,
then skip the weight sync) and ``on_step_begin`` (stop before the next step: the finished step's metrics are logged
by then; a request that came during validation or logging saves that step first), from ``_validate`` (skipped once
the run stops) and from ``_save_checkpoint`` (every save is timed: the deadline needs a save's duration).
"""

from __future__ import annotations

import contextlib
import os
import time

from gtpo.methods import knob
from gtpo.trainer.preemption import (
    CLUSTER_KEY,
    EXIT_CODE,
    SAVED_KEY,
    PreemptedError,
    PreemptionParams,
    StopPolicy,
    current_job_id,
    get_request,
    job_key,
    put_request,
    resolve_deadline,
)

__all__ = ["TrainerStop"]


class TrainerStop:
    """Stop requests, the deadline and the saves of one trainer process."""

    def __init__(
        self, params: PreemptionParams, job_id: str | None = None, clock=time.time, requests=None, announce=None
    ):
        self.params = params
        self.policy = StopPolicy(
            margin_s=float(params.margin_s),
            save_estimate_s=float(params.save_estimate_s),
            step_factor=float(params.step_factor),
        )
        self._clock = clock
        self._started = clock()
        self._keys = (job_key(job_id if job_id is not None else current_job_id()), CLUSTER_KEY)
        self._requests = requests or self._stored_request
        # tells `python -m gtpo.trainer.preemption request --wait` (a preStop hook) that the save is complete
        self._announce = announce or (lambda message: put_request(SAVED_KEY, message))
        self.reason: str | None = None  # why the run stops, once decided
        self.stop_after: int | None = None  # the step after which the run stops
        self.finished_step: int | None = None  # the last step whose on_step_end ran in this process
        self.saved_step: int | None = None  # the last step saved (periodic or for the stop)

    @classmethod
    def for_trainer(cls, algorithm) -> TrainerStop:
        return cls(knob(algorithm, "preemption"))

    def _stored_request(self) -> str | None:
        for key in self._keys:
            reason = get_request(key, self._started)
            if reason:
                return reason
        return None

    def _say(self, message: str) -> None:
        print(f"gtpo preemption: {message}", flush=True)

    # ------------------------------------------------------------------------------------------------ the hooks

    def after_step(self, trainer) -> bool:
        """``on_step_end`` of step ``trainer.global_steps``: True when the run stops after this step (saved)."""
        now = self._clock()
        step = int(trainer.global_steps)
        self.policy.step_ended(now)
        self.finished_step = step
        reason = self._requests()
        if reason is None:
            deadline, source = resolve_deadline(self.params)
            reason = self.policy.out_of_time(now, deadline)
            if reason is not None:
                reason += f" (job end from {source})"
        if reason is None:
            return False
        if step >= int(trainer.total_training_steps):
            self._say(f"{reason}; step {step} is the run's last, which ends normally")
            return False
        self._stop(trainer, step, reason)
        return True

    def before_step(self, trainer) -> None:
        """``on_step_begin`` of step ``trainer.global_steps``: raises :class:`PreemptedError` to end the run."""
        step = int(trainer.global_steps)
        if self.stop_after is None and self.finished_step == step - 1:
            # A request that arrived after the last step's on_step_end (during its validation or logging).
            reason = self._requests()
            if reason is not None:
                with previous_step(trainer):
                    self._stop(trainer, step - 1, reason)
        if self.stop_after is not None:
            flush_trackers(trainer)
            raise PreemptedError(
                f"gtpo preemption: stopped after step {self.stop_after} ({self.reason}); checkpoint "
                f"global_step_{self.stop_after} is complete; exit {EXIT_CODE}; trainer.resume_mode=auto continues",
                step=self.stop_after,
            )
        self.policy.step_started(self._clock())

    def skip_validation(self) -> bool:
        if self.stop_after is None:
            return False
        self._say(f"validation after step {self.stop_after} skipped: the run is stopping")
        return True

    @contextlib.contextmanager
    def timed_save(self, trainer):
        start = self._clock()
        yield
        seconds = self._clock() - start
        self.policy.saved(seconds)
        self.saved_step = int(trainer.global_steps)
        if self.reason is not None:
            self._say(f"checkpoint of step {self.saved_step} saved in {seconds:.1f} s")

    def _stop(self, trainer, step: int, reason: str) -> None:
        self.reason = reason
        self.stop_after = step
        folder = os.path.join(str(trainer.config.trainer.default_local_dir), f"global_step_{step}")
        if self.saved_step == step:
            self._say(f"{reason}: step {step} is saved already ({folder}); the run stops")
        else:
            self._say(f"{reason}: saving step {step} to {folder}, then the run stops")
            trainer._save_checkpoint()
        self._announce(f"step {step} in {folder}")


@contextlib.contextmanager
def previous_step(trainer):
    """``trainer.global_steps`` one lower for the block: verl has advanced it past the finished step already."""
    trainer.global_steps -= 1
    try:
        yield
    finally:
        trainer.global_steps += 1


def flush_trackers(trainer) -> None:
    """Finish verl's trackers (W&B, TensorBoard, MLflow, the file log) before the process goes away."""
    tracking = trainer.__dict__.get("logger")  # set by verl's fit()
    if tracking is not None:
        tracking.finish()
