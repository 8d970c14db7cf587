"""Preemption without loss: on a scheduler's warning or before the job's known end, save after the step and exit.

Why: verl 0.9.1's trainers save only when ``trainer.save_freq`` matches. A Slurm time limit, a Kubernetes eviction or
``ray job stop`` ends the run at once, losing every step since the last periodic save (an hour of a 32B run).

What happens (every trainer mode, every method):

* **A stop request** arrives as one of ``algorithm.preemption.signals`` (SIGUSR1 and SIGTERM by default) sent to the
  driver (``python -m recipe.gtpo.main_gtpo``), which relays it through Ray's internal key-value store to the
  trainer in the TaskRunner actor, wherever that runs (:class:`DriverRelay`); or as ``python -m
  gtpo.trainer.preemption request`` run on any node of the cluster (a Kubernetes preStop hook).
* **A deadline**: the job's end (``algorithm.preemption.deadline``: ``auto`` reads Slurm's ``squeue -h -j
  $SLURM_JOB_ID -o %e``, or ``SLURM_JOB_END_TIME`` where squeue cannot tell; or a Unix time / ISO 8601 time for any
  scheduler). It is read again after every step, so ``scontrol update JobId=<id> TimeLimit=...`` takes effect. When
  the time left is less than ``step_factor`` times the longest step seen, plus the longest save seen
  (``save_estimate_s`` before the first), plus ``margin_s``, the trainer stops as on a signal and logs the time left.

Then the trainer finishes the step in flight, saves a complete checkpoint of it (unless that step's periodic save
already did), skips the rest of the step's hooks (the weight sync to the rollout, validation), logs the step's
metrics, flushes every tracker and raises :class:`PreemptedError`; the driver exits with :data:`EXIT_CODE`, which
the Slurm script requeues on (``REQUEUE_ON_TIMEOUT=1``) and ``trainer.resume_mode=auto`` continues from. A request
that arrives during validation or after the step's hooks saves the finished step before the next one starts; a
second signal while saving is logged and changes nothing (SIGKILL still ends the run at once). A request during the
run's last step lets the run finish normally (exit 0).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from gtpo.knobs import PreemptionParams, parse_deadline

__all__ = [
    "EXIT_CODE",
    "DriverRelay",
    "PreemptedError",
    "StopPolicy",
    "record_stall",
    "recorded_stall",
    "resolve_deadline",
]

# The driver's exit status after a preemption save: "saved, resume me" (a crash exits 1, a refused config 2,
# a stalled stage 75).
EXIT_CODE = 85
# Ray internal-KV namespace and keys of a stop request: one per Ray job, one for the whole cluster.
KV_NAMESPACE = "gtpo"
CLUSTER_KEY = "preempt/cluster"
# Written by a trainer once its stop's checkpoint is complete (what `request --wait` waits for).
SAVED_KEY = "preempt/saved"


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


# ------------------------------------------------------------------------------------------------ the stop channel


def job_key(job_id: str) -> str:
    return f"preempt/job/{job_id}"


def put_request(key: str, reason: str) -> None:
    """Store a stop request in Ray's internal key-value store (this process must be connected to the cluster)."""
    from ray.experimental import internal_kv

    value = json.dumps({"reason": reason, "time": time.time()}).encode()
    # Ray's internal store: Ray has no public cluster-wide one (docs/architecture.md, Seams: stop-channel-kv)
    internal_kv._internal_kv_put(key, value, overwrite=True, namespace=KV_NAMESPACE)


def get_request(key: str, since: float) -> str | None:
    """The reason of a stop request stored under ``key`` at or after ``since`` (Unix time), or None."""
    from ray.experimental import internal_kv

    raw = internal_kv._internal_kv_get(key, namespace=KV_NAMESPACE)
    if not raw:
        return None
    try:
        request = json.loads(raw)
    except ValueError:
        return None
    return str(request.get("reason", "stop requested")) if float(request.get("time", 0)) >= since else None


def current_job_id() -> str:
    import ray

    return ray.get_runtime_context().get_job_id()


class DriverRelay:
    """Signal handlers of the driver: the first signal becomes a stop request for this Ray job's trainer.

    The handler only records the signal (it runs between two bytecodes of the main thread, which waits in
    ``ray.get``); a thread stores the request once Ray is connected. Later signals are logged and change nothing.
    """

    def __init__(self, params: PreemptionParams, out=sys.stderr):
        self.params = params
        self.received: list[str] = []
        self._out = out
        self._pending = threading.Event()
        self._thread: threading.Thread | None = None

    def install(self) -> None:
        """Install the handlers (main thread only); again after ``ray.init``, which sets its own for SIGTERM."""
        for name in self.params.signals:
            signal.signal(signal.Signals[name], self._handle)
        if self._thread is None:
            self._thread = threading.Thread(target=self._relay, name="gtpo-preemption-relay", daemon=True)
            self._thread.start()

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        self.received.append(name)
        if len(self.received) == 1:
            print(
                f"gtpo preemption: {name} received: the trainer saves after the step in flight, then the run exits "
                f"with {EXIT_CODE}",
                file=self._out,
                flush=True,
            )
            self._pending.set()
        else:
            print(
                f"gtpo preemption: {name} received again: the stop is under way and the save is not cut short "
                "(SIGKILL ends the run without it)",
                file=self._out,
                flush=True,
            )

    def _relay(self) -> None:
        import ray

        self._pending.wait()
        while not ray.is_initialized():
            time.sleep(0.2)
        reason = f"{self.received[0]} to the driver (pid {os.getpid()})"
        put_request(job_key(current_job_id()), reason)


# ---------------------------------------------------------------------------------------------- the command line


# The stage watchdog's channel to the driver (gtpo/trainer/watchdog.py), beside the stop requests'.
def _stall_key(job_id: str) -> str:
    return f"watchdog/job/{job_id}"


def record_stall(message: str) -> None:
    """Leave the expiry in Ray's key-value store under this Ray job's id: if the trainer process exits with
    :data:`gtpo.trainer.watchdog.EXIT_CODE`, the driver's ``ray.get`` sees only a dead actor, and this tells it why."""
    import ray

    if not ray.is_initialized():  # not a Ray process (asking Ray for the job id would start or join a cluster)
        return
    try:
        put_request(_stall_key(current_job_id()), message)
    except Exception as err:  # noqa: BLE001 - the watchdog must still stop the workers and exit
        print(f"gtpo watchdog: could not record the stall for the driver: {err!r}", file=sys.stderr, flush=True)


def recorded_stall(job_id: str) -> str | None:
    """The expiry :func:`record_stall` left for Ray job ``job_id``, or None (the driver, connected to the cluster)."""
    return get_request(_stall_key(job_id), since=0.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gtpo.trainer.preemption",
        description="Ask every gtpo trainer on a Ray cluster to save after its step in flight and exit "
        f"{EXIT_CODE} (e.g. from a Kubernetes preStop hook).",
    )
    parser.add_argument("command", choices=["request"])
    parser.add_argument("--address", default=os.environ.get("RAY_ADDRESS", "auto"), help="the cluster [auto]")
    parser.add_argument("--reason", default="python -m gtpo.trainer.preemption request")
    parser.add_argument(
        "--wait", type=float, default=0.0, metavar="S", help="then wait up to S seconds for the trainer's save [0]"
    )
    args = parser.parse_args(argv)
    import ray

    try:
        ray.init(address=args.address, logging_level="ERROR", log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as err:
        print(f"gtpo preemption: no Ray cluster at --address={args.address}: {err}", file=sys.stderr)
        return 1
    asked = time.time()
    put_request(CLUSTER_KEY, args.reason)
    print(f"gtpo preemption: stop requested on the cluster at {args.address}", file=sys.stderr)
    deadline = time.monotonic() + args.wait
    while time.monotonic() < deadline:
        saved = get_request(SAVED_KEY, asked)
        if saved:
            print(f"gtpo preemption: the trainer saved ({saved})", file=sys.stderr)
            return 0
        time.sleep(2.0)
    return 0 if args.wait == 0 else 3


if __name__ == "__main__":
    sys.exit(main())
