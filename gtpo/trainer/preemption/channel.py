"""Stop requests and stall records in Ray's internal key-value store, the one channel that reaches the trainer
wherever Ray placed it (seam ``stop-channel-kv``, docs/architecture.md).

Written by the driver's signal relay (:class:`gtpo.trainer.preemption.driver.DriverRelay`), by ``python -m
gtpo.trainer.preemption request`` on any node and by the stage watchdog (:func:`record_stall`); read by the trainer
after every step (:class:`gtpo.trainer.preemption.stop.TrainerStop`), by the request command waiting for the save and
by the driver explaining a trainer that died (:func:`recorded_stall`).
"""

from __future__ import annotations

import json
import sys
import time

__all__ = [
    "CLUSTER_KEY",
    "KV_NAMESPACE",
    "SAVED_KEY",
    "current_job_id",
    "get_request",
    "job_key",
    "put_request",
    "record_stall",
    "recorded_stall",
]

# Ray internal-KV namespace and keys of a stop request: one per Ray job, one for the whole cluster.
KV_NAMESPACE = "gtpo"
CLUSTER_KEY = "preempt/cluster"
# Written by a trainer once its stop's checkpoint is complete (what `request --wait` waits for).
SAVED_KEY = "preempt/saved"


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


def _stall_key(job_id: str) -> str:
    return f"watchdog/job/{job_id}"


def record_stall(message: str) -> None:
    """Leave the watchdog's expiry in Ray's key-value store under this Ray job's id: if the trainer process exits with
    :data:`gtpo.trainer.guard.watchdog.EXIT_CODE`, the driver's ``ray.get`` sees only a dead actor, and this tells it
    why."""
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
