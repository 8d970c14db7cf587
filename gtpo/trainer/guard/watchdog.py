"""A weight sync or a generation that stops making progress fails the run within a bounded time, naming the stage.

Why: verl 0.9.1 waits without a deadline at the two places where its rollout engine can stall. A weight sync is
``ray.get`` on the actor workers' ``update_weights``, whose sender waits on its socket for the vLLM worker; when
the worker fails to load the weights (a vLLM that replaced the parameters it loads into, a dtype or shape
mismatch), the exception stays in the worker's log and the trainer waits forever. Generation is the replay
buffer polling TransferQueue until a batch of responses has finished; a dead or wedged engine leaves it polling
forever. On a cluster either is hours of idle GPUs with nothing in the log.

Knobs (``algorithm.watchdog``, 0 turns a limit off):

* ``weight_sync_s``: wall-clock limit of one weight-sync call of verl's checkpoint manager (``update_weights``, and
  the pause / resume / sleep calls around it in the asynchronous trainers), and of each whole ``update_weights`` of
  separate_async's standalone manager (abort the standalone replicas, NCCL broadcast, resume);
* ``generation_s``: limit on time *without progress* while a batch is generated: progress is any change of the
  replay buffer's counts of pending, running, finished and failed prompts or of its stored responses (each
  response is stored when it finishes, long before its group of ``rollout.n`` settles), so a long but moving
  generation (20,480-token responses at scale=dapo) never trips it;
* ``grace_s``: after a limit passes, how long the trainer may take to fail on its own before its process exits.

When a limit passes, a background thread logs the stage, its limit and its knob with the stacks of every thread of
the trainer process, then stops the trainer's worker actors (the actor/rollout workers, the rollout servers and,
under separate_async, the standalone pool's servers and workers), so
that the blocked ``ray.get`` returns; the trainer then raises :class:`StageTimeoutError` with that message (in the
generation stage it raises from the polling loop itself). If the process is still there ``grace_s`` later, it
exits with :data:`EXIT_CODE`, so no stall outlives its limit by more than ``grace_s``.

The driver (``recipe/gtpo/main_gtpo.py``) exits with :data:`EXIT_CODE` too: Ray hands it the trainer's
:class:`StageTimeoutError` (an instance of it, wrapped with the remote traceback), or, after the trainer process
exited, only a dead actor; for that case the expiry is also left in Ray's key-value store under the job's id
(:func:`gtpo.trainer.preemption.channel.record_stall`, read back with
:func:`gtpo.trainer.preemption.channel.recorded_stall`).
"""

from __future__ import annotations

import faulthandler
import inspect
import os
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

from gtpo.methods import knob

__all__ = ["EXIT_CODE", "StageTimeoutError", "StageWatchdog", "find_expiry"]

# The trainer process's exit status when a stalled stage did not end by itself within grace_s.
EXIT_CODE = 75
# How every expiry message starts (a log reader finds it by this).
MESSAGE_PREFIX = "gtpo watchdog: stage '"


def find_expiry(log_text: str) -> str | None:
    """The first expiry message in a trainer log (without Ray's line prefix), or None."""
    for line in log_text.splitlines():
        at = line.find(MESSAGE_PREFIX)
        if at >= 0:
            return line[at:].strip()
    return None


class StageTimeoutError(RuntimeError):
    """A trainer stage made no progress within its limit."""


@dataclass
class _Stage:
    name: str
    limit_s: float
    knob: str
    detail: Callable[[], str]
    started: float
    last_progress: float


class StageWatchdog:
    """Deadlines for the trainer's blocking stages, enforced by a daemon thread.

    Args:
        on_expire: called from the watchdog thread once a stage has expired (e.g. to stop the worker actors the
            main thread waits on); its exceptions are logged, never raised.
        grace_s: seconds the main thread has, after the expiry, to raise before the process exits.
        poll_s: how often the thread looks at the current stage.
        exit_fn: how the process ends after the grace period (``os._exit``; tests pass a recorder).
    """

    def __init__(
        self,
        on_expire: Callable[[str], None] | None = None,
        grace_s: float = 60.0,
        poll_s: float = 0.5,
        exit_fn: Callable[[int], None] = os._exit,
    ):
        self._on_expire = on_expire
        self._grace_s = float(grace_s)
        self._poll_s = float(poll_s)
        self._exit_fn = exit_fn
        self._lock = threading.Lock()
        self._stage: _Stage | None = None
        self._expired: str | None = None
        self._raised = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------------------- main thread

    @contextmanager
    def stage(self, name: str, limit_s: float, knob: str, detail: Callable[[], str] | None = None):
        """Run the block as stage ``name`` with deadline ``limit_s`` (0: no deadline; nested stages: the outer one)."""
        with self._lock:
            owner = limit_s > 0 and self._stage is None
            if owner:
                now = time.monotonic()
                self._stage = _Stage(name, float(limit_s), knob, detail or (lambda: ""), now, now)
        if owner:
            self._start_thread()
        try:
            yield self
        except BaseException as err:
            if owner and self._expired is not None:
                self._raised = True
                raise StageTimeoutError(self._expired) from err
            raise
        finally:
            if owner:
                with self._lock:
                    self._stage = None
        if owner and self._expired is not None:
            self._raised = True
            raise StageTimeoutError(self._expired)

    def progress(self) -> None:
        """The current stage moved: its no-progress deadline starts again."""
        with self._lock:
            if self._stage is not None:
                self._stage.last_progress = time.monotonic()

    def check(self) -> None:
        """From the stage's own loop: raise :class:`StageTimeoutError` once the stage is past its deadline."""
        message = self._expire_if_due(stop_workers=False)
        if message is not None:
            self._raised = True
            raise StageTimeoutError(message)

    @property
    def expired(self) -> str | None:
        """The expiry message, once a stage has expired."""
        return self._expired

    # ------------------------------------------------------------------------------------------ watchdog thread

    def _start_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gtpo-stage-watchdog", daemon=True)
            self._thread.start()

    def _expire_if_due(self, stop_workers: bool) -> str | None:
        with self._lock:
            stage = self._stage
            if self._expired is not None:
                return self._expired
            if stage is None:
                return None
            now = time.monotonic()
            idle = now - stage.last_progress
            if idle <= stage.limit_s:
                return None
            moving = "" if stage.last_progress == stage.started else f", {_seconds(now - stage.started)} s in all"
            detail = _safe(stage.detail)
            self._expired = (
                f"{MESSAGE_PREFIX}{stage.name}' made no progress for {_seconds(idle)} s{moving}, over its limit "
                f"{stage.knob}={stage.limit_s:g}" + (f": {detail}" if detail else "")
            )
            message = self._expired
        print(message, file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        if stop_workers and self._on_expire is not None:
            try:
                self._on_expire(message)
            except Exception as err:  # noqa: BLE001 - the watchdog must reach its exit below
                print(f"gtpo watchdog: stopping the workers failed: {err!r}", file=sys.stderr, flush=True)
        return message

    def _run(self) -> None:
        expired_at = None
        while True:
            time.sleep(self._poll_s)
            if expired_at is None:
                if self._expire_if_due(stop_workers=True) is not None:
                    expired_at = time.monotonic()
            elif not self._raised and time.monotonic() - expired_at > self._grace_s:
                print(
                    f"{self._expired}; the trainer did not fail within {self._grace_s:g} s "
                    f"(algorithm.watchdog.grace_s), exiting with status {EXIT_CODE}",
                    file=sys.stderr,
                    flush=True,
                )
                self._exit_fn(EXIT_CODE)
                return
            elif self._raised:
                return


def _seconds(value: float) -> str:
    return f"{value:.0f}" if value >= 10 else f"{value:.1f}"


def _safe(fn: Callable[[], str]) -> str:
    try:
        return str(fn())
    except Exception as err:  # noqa: BLE001 - a diagnostic must not hide the expiry
        return f"<no detail: {err!r}>"


# ---------------------------------------------------------------------------------------------------------------
# the trainer's stages

KNOB = "algorithm.watchdog"
# verl's CheckpointEngineManager calls the trainers make around a weight sync (v1 sync and async trainers).
WEIGHT_SYNC_CALLS = ("update_weights", "abort_replicas", "resume_generation_replicas", "sleep_replicas")
# separate_async's standalone manager (nccl backend): the outer call only; its abort / release / resume coroutines
# are awaited inside it, so they fall under this one stage.
STANDALONE_WEIGHT_SYNC_CALLS = ("update_weights",)
# The replay buffer's per-partition collections whose sizes measure generation progress: the prompts' four status
# sets, and the stored trajectories (one key per finished response, written before its group of rollout.n settles).
GENERATION_COUNTS = ("pending_keys", "running_keys", "finished_keys", "failure_keys", "partitions")


def watchdog_of(trainer) -> StageWatchdog:
    """The trainer's one :class:`StageWatchdog`, created on first use; on expiry it records the stall for the driver
    and stops the trainer's workers."""
    watchdog = trainer.__dict__.get("_gtpo_watchdog")
    if watchdog is None:

        def on_expire(message: str) -> None:
            from gtpo.trainer.preemption.channel import record_stall

            record_stall(message)
            stop_workers(trainer)

        watchdog = StageWatchdog(on_expire=on_expire, grace_s=knob(trainer.config.algorithm, "watchdog").grace_s)
        trainer.__dict__["_gtpo_watchdog"] = watchdog
    return watchdog


def worker_handles(trainer) -> list:
    """The actor/rollout workers, and the servers and workers of every rollout replica of the trainer's checkpoint
    managers (separate_async: also the standalone pool's), each once: attributes of verl's classes, not an API (seam
    ``watchdog-worker-handles``, docs/architecture.md)."""
    handles = list(getattr(getattr(trainer, "actor_rollout_wg", None), "workers", None) or [])
    for manager in ("checkpoint_manager", "standalone_checkpoint_manager"):
        for replica in getattr(getattr(trainer, manager, None), "replicas", None) or []:
            handles.extend(getattr(replica, "servers", None) or [])
            handles.extend(getattr(replica, "workers", None) or [])  # hybrid replicas: the actor workers again
    return list(dict.fromkeys(handles))


def stop_workers(trainer) -> int:
    """Kill every handle of :func:`worker_handles`, so that a ``ray.get`` waiting on any of them returns."""
    import ray

    handles = worker_handles(trainer)
    failed = []
    for handle in handles:
        try:
            ray.kill(handle, no_restart=True)
        except Exception as err:  # noqa: BLE001 - one dead handle must not spare the others
            failed.append(repr(err))
    print(
        f"gtpo watchdog: stopped {len(handles) - len(failed)} worker actors"
        + (f"; {len(failed)} could not be stopped: {'; '.join(failed)}" if failed else ""),
        file=sys.stderr,
        flush=True,
    )
    return len(handles) - len(failed)


def _in_stage(call: Callable, watchdog: StageWatchdog, name: str, limit: float, detail: str) -> Callable:
    """``call`` run as stage ``name``. Called from a coroutine (as verl's ``auto_await`` tells them apart), it returns
    a coroutine that awaits ``call`` inside the stage; called from plain code it runs ``call`` there."""
    limit_knob = f"{KNOB}.weight_sync_s"

    def watched(*args, **kwargs):
        if sys._getframe(1).f_code.co_flags & inspect.CO_COROUTINE:

            async def awaited():
                with watchdog.stage(name, limit, limit_knob, lambda: detail):
                    result = call(*args, **kwargs)
                    return await result if inspect.isawaitable(result) else result

            return awaited()
        with watchdog.stage(name, limit, limit_knob, lambda: detail):
            return call(*args, **kwargs)

    return watched


def watch_weight_sync(trainer) -> None:
    """Give each weight-sync call of ``trainer.checkpoint_manager``, and ``update_weights`` of separate_async's
    ``trainer.standalone_checkpoint_manager``, the ``weight_sync_s`` deadline (idempotent)."""
    limit = knob(trainer.config.algorithm, "watchdog").weight_sync_s
    if limit <= 0:
        return
    watchdog = watchdog_of(trainer)
    managers = (
        ("checkpoint_manager", WEIGHT_SYNC_CALLS, ""),
        ("standalone_checkpoint_manager", STANDALONE_WEIGHT_SYNC_CALLS, "standalone "),
    )
    for attr, calls, which in managers:
        manager = getattr(trainer, attr, None)
        if manager is None or getattr(manager, "_gtpo_watched", False):
            continue
        for name in calls:
            call = getattr(manager, name, None)
            if call is None:
                continue
            detail = (
                f"verl's {which}checkpoint manager {name}() did not return; the rollout engine's log (vLLM worker) "
                "shows why it stopped taking the weights"
            )
            setattr(manager, name, _in_stage(call, watchdog, f"weight sync ({which}{name})", limit, detail))
        manager._gtpo_watched = True


def watch_generation(buffer, trainer):
    """Give the replay buffer's sampling the ``generation_s`` no-progress deadline; returns ``buffer``."""
    limit = knob(trainer.config.algorithm, "watchdog").generation_s
    if limit <= 0 or getattr(buffer, "_gtpo_watched", False):
        return buffer
    watchdog = watchdog_of(trainer)
    seen: dict[str, tuple[int, ...]] = {}

    def counts(partition_id: str) -> tuple[int, ...]:
        return tuple(len((getattr(buffer, attr, None) or {}).get(partition_id, ())) for attr in GENERATION_COUNTS)

    poll = buffer._wait_for_next_poll

    def _wait_for_next_poll(partition_id, last_debug_time):
        now = counts(partition_id)
        if seen.get(partition_id) != now:
            seen[partition_id] = now
            watchdog.progress()
        watchdog.check()
        return poll(partition_id, last_debug_time)

    buffer._wait_for_next_poll = _wait_for_next_poll

    for name in ("sample", "wait_for_sampleable"):
        call = getattr(buffer, name, None)
        if call is None:
            continue

        def watched(global_steps, partition_id, *args, _call=call, **kwargs):
            def detail() -> str:
                pending, running, finished, failed, stored = counts(partition_id)
                return (
                    f"the rollout finished no response (partition {partition_id!r}: prompts {pending} pending, "
                    f"{running} running, {finished} finished, {failed} failed; {stored} responses stored)"
                )

            with watchdog.stage("generation", limit, f"{KNOB}.generation_s", detail):
                return _call(global_steps, partition_id, *args, **kwargs)

        setattr(buffer, name, watched)
    buffer._gtpo_watched = True
    return buffer
