"""Stop requests and stall records in Ray's internal key-value store, the one channel that reaches the trainer
wherever Ray placed it (seam ``stop-channel-kv``, docs/architecture.md).

Written by the driver's signal relay (:class:`gtpo.trainer.preemption.driver.DriverRelay`), by ``python -m
gtpo.trainer.preemption request`` on any node and by the stage watchdog (:func:`record_stall`); read by the trainer
after every step (:class:`gtpo.trainer.preemption.stop.TrainerStop`), by the request command waiting for the save and
by the driver explaining a trainer that died (:func:`recorded_stall`). Each running trainer also keeps a record of
itself here (:mod:`gtpo.trainer.preemption.presence`), which the request command reads to know whether anything
would save.
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
    "delete_key",
    "get_request",
    "get_value",
    "job_key",
    "keys_with_prefix",
    "put_request",
    "put_value",
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


def put_value(key: str, value: dict) -> None:
    """Store ``value`` as JSON under ``key`` in Ray's internal key-value store (this process must be connected)."""
    from ray.experimental import internal_kv

    # Ray's internal store: Ray has no public cluster-wide one (docs/architecture.md, Seams: stop-channel-kv)
    internal_kv._internal_kv_put(key, json.dumps(value).encode(), overwrite=True, namespace=KV_NAMESPACE)


def get_value(key: str) -> dict | None:
    """The JSON object stored under ``key``, or None (absent or not an object)."""
    from ray.experimental import internal_kv

    raw = internal_kv._internal_kv_get(key, namespace=KV_NAMESPACE)
    try:
        value = json.loads(raw) if raw else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def keys_with_prefix(prefix: str) -> list[str]:
    """The keys stored under ``prefix``."""
    from ray.experimental import internal_kv

    return [k.decode() if isinstance(k, bytes) else str(k)
            for k in internal_kv._internal_kv_list(prefix, namespace=KV_NAMESPACE)]  # fmt: skip


def delete_key(key: str) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_del(key, namespace=KV_NAMESPACE)


def put_request(key: str, reason: str) -> None:
    """Store a stop request in Ray's internal key-value store (this process must be connected to the cluster)."""
    put_value(key, {"reason": reason, "time": time.time()})


def get_request(key: str, since: float) -> str | None:
    """The reason of a stop request stored under ``key`` at or after ``since`` (Unix time), or None."""
    request = get_value(key)
    if request is None:
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
