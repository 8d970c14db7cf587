"""The driver's side of a stop: its signal handlers turn the first stop signal into a stop request for this Ray
job's trainer (``algorithm.preemption.signals``, SIGUSR1 and SIGTERM by default, sent to ``python -m
recipe.gtpo.main_gtpo``).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from gtpo.knobs import PreemptionParams
from gtpo.trainer.preemption.channel import current_job_id, job_key, put_request
from gtpo.trainer.preemption.stop import EXIT_CODE

__all__ = ["DriverRelay"]


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
