"""Whether a gtpo trainer runs on the cluster: each trainer keeps a record of itself alive in Ray's key-value store
(:class:`TrainerPresence`), and ``python -m gtpo.trainer.preemption request`` reads them (:func:`live_trainers`).

A KubeRay job that has ended still runs every pod's preStop hook when its RayCluster is deleted; without a trainer
the hook's wait for a save would hold the pod's GPUs for its whole ``--wait``. A record names its trainer and when it
expires; the trainer renews it every :data:`RENEW_S` seconds from a thread (so a long save keeps it alive) and removes
it when ``fit`` ends. A trainer killed without that leaves a record that expires :data:`TTL_S` seconds after its last
renewal.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable

from gtpo.trainer.preemption.channel import current_job_id, delete_key, get_value, keys_with_prefix, put_value

__all__ = ["PRESENCE_PREFIX", "RENEW_S", "TTL_S", "TrainerPresence", "live_trainers", "presence_key"]

PRESENCE_PREFIX = "trainer/"
# A record lives this long after its last renewal; renewed well within it (clocks of the nodes may differ a little).
TTL_S = 120.0
RENEW_S = 20.0


def presence_key(job_id: str) -> str:
    return f"{PRESENCE_PREFIX}{job_id}"


class TrainerPresence:
    """This trainer's record, renewed by a daemon thread between :meth:`start` and :meth:`stop`."""

    def __init__(self, job_id: str | None = None, ttl_s: float = TTL_S, renew_s: float = RENEW_S, clock=time.time):
        self.key = presence_key(job_id if job_id is not None else current_job_id())
        self.ttl_s, self.renew_s, self._clock = float(ttl_s), float(renew_s), clock
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def record(self) -> dict:
        return {"host": socket.gethostname(), "pid": os.getpid(), "expires": self._clock() + self.ttl_s}

    def start(self) -> TrainerPresence:
        put_value(self.key, self.record())
        self._thread = threading.Thread(target=self._renew, name="gtpo-trainer-presence", daemon=True)
        self._thread.start()
        return self

    def _renew(self) -> None:
        while not self._stopped.wait(self.renew_s):
            try:
                put_value(self.key, self.record())
            except Exception:  # noqa: BLE001 - a GCS hiccup: the next renewal tries again within the TTL
                continue

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        try:
            delete_key(self.key)
        except Exception:  # noqa: BLE001 - the cluster is going away; the record expires on its own
            pass


def live_trainers(now: Callable[[], float] = time.time) -> list[str]:
    """The trainers whose record has not expired, as ``<job id> on <host> (pid <pid>)``."""
    found = []
    for key in sorted(keys_with_prefix(PRESENCE_PREFIX)):
        record = get_value(key)
        if record is None or float(record.get("expires", 0)) <= now():
            continue
        found.append(f"{key.removeprefix(PRESENCE_PREFIX)} on {record.get('host')} (pid {record.get('pid')})")
    return found
