"""The trainer's side of a stop: when the next step no longer fits before the job's end, and how the trainer saves
and ends the run at a step boundary (:class:`TrainerStop`, called by :class:`gtpo.trainer.preemption.hooks.StopHooks`).

The job's end is ``algorithm.preemption.deadline``: ``auto`` reads Slurm's ``squeue -h -j $SLURM_JOB_ID -o %e``
(``SLURM_JOB_END_TIME`` where squeue cannot tell), or a Unix / ISO 8601 time; it is read again after every step, so
``scontrol update JobId=<id> TimeLimit=...`` takes effect. A stop request comes through
:mod:`gtpo.trainer.preemption.channel`. The run then ends with :class:`PreemptedError`, the driver with
:data:`EXIT_CODE`.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import subprocess
import time
from dataclasses import dataclass, field

from gtpo.knobs import PreemptionParams, parse_deadline
from gtpo.trainer.preemption.channel import CLUSTER_KEY, SAVED_KEY, current_job_id, get_request, job_key, put_request

__all__ = ["EXIT_CODE", "PreemptedError", "StopPolicy", "TrainerStop", "resolve_deadline", "slurm_end_time"]

# The driver's exit status after a preemption save: "saved, resume me" (a crash exits 1, a refused config 2,
# a stalled stage 75).
EXIT_CODE = 85


class PreemptedError(RuntimeError):
    """The trainer saved after a stop request and ended the run; the driver exits with :data:`EXIT_CODE`."""

    def __init__(self, message: str, step: int = -1):
        super().__init__(message)
        self.step = step

    def __reduce__(self):  # Ray pickles the exception back to the driver
        return (PreemptedError, (str(self), self.step))


def slurm_end_time(job_id: str, run=subprocess.run) -> float | None:
    """The job's end from ``squeue -h -j <id> -o %e`` (Slurm's local time), or None where squeue cannot tell."""
    try:
        out = run(["squeue", "-h", "-j", job_id, "-o", "%e"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = (out.stdout or "").strip()
    if out.returncode != 0 or not text or text in ("N/A", "Unknown", "NONE"):
        return None
    try:
        return dt.datetime.fromisoformat(text.splitlines()[0].strip()).timestamp()
    except ValueError:
        return None


def resolve_deadline(params: PreemptionParams, env=os.environ, run=subprocess.run) -> tuple[float | None, str]:
    """The job's end as a Unix time (or None) and where it came from."""
    deadline = parse_deadline(params.deadline)
    if deadline != "auto":
        return deadline, "algorithm.preemption.deadline" if deadline is not None else "none"
    # squeue first: it sees `scontrol update JobId=<id> TimeLimit=...`; the variable is fixed at the job's start
    job_id = env.get("SLURM_JOB_ID", "")
    if job_id:
        end_time = slurm_end_time(job_id, run=run)
        if end_time is not None:
            return end_time, f"squeue -j {job_id} -o %e"
    end = env.get("SLURM_JOB_END_TIME", "")
    if end.strip().isdigit() and int(end) > 0:
        return float(end), "SLURM_JOB_END_TIME"
    return None, "none"


@dataclass
class StopPolicy:
    """Decides after each step whether the next step and a save still fit before the deadline.

    A step is the wall time from one step's end to the next (validation and logging included; a periodic save in it
    is not: the save is counted once, on its own), the first one from its start; both measures keep their maximum,
    so one slow step or save is not forgotten. The longest step is multiplied by ``step_factor``: the next step can
    be longer than any seen (dynamic sampling's extra generation rounds).
    """

    margin_s: float
    save_estimate_s: float
    step_factor: float
    longest_step_s: float = 0.0
    longest_save_s: float | None = None
    _last_step_end: float | None = field(default=None, repr=False)
    _saved_in_step_s: float = field(default=0.0, repr=False)

    def step_started(self, now: float) -> None:
        if self._last_step_end is None:
            self._last_step_end = now

    def step_ended(self, now: float) -> None:
        if self._last_step_end is not None:
            self.longest_step_s = max(self.longest_step_s, now - self._last_step_end - self._saved_in_step_s)
        self._last_step_end = now
        self._saved_in_step_s = 0.0

    def saved(self, seconds: float) -> None:
        self.longest_save_s = max(self.longest_save_s or 0.0, seconds)
        self._saved_in_step_s += seconds

    def needed_s(self) -> float:
        save = self.longest_save_s if self.longest_save_s is not None else self.save_estimate_s
        return self.step_factor * self.longest_step_s + save + self.margin_s

    def out_of_time(self, now: float, deadline: float | None) -> str | None:
        """A message saying why the run stops now, or None while another step fits."""
        if deadline is None:
            return None
        left = deadline - now
        needed = self.needed_s()
        if left >= needed:
            return None
        save = self.longest_save_s if self.longest_save_s is not None else self.save_estimate_s
        return (
            f"{left:.0f} s left before the job's end, less than a step ({self.longest_step_s:.0f} s × step_factor "
            f"{self.step_factor:g}) + a save "
            f"({save:.0f} s{'' if self.longest_save_s is not None else ', save_estimate_s'}) + margin_s "
            f"({self.margin_s:.0f} s) = {needed:.0f} s"
        )


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
