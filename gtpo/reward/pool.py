"""A per-process pool of grading subprocesses with a hard wall-clock limit per call.

Why subprocesses: math-verify's timeouts are SIGALRM-based (main thread only, and they cannot interrupt C-level
sympy/bigint work such as ``5^(5^3125)``), while verl's reward loop calls reward functions from executor threads
inside async Ray actors. Each call here is shipped to a worker (``python -m gtpo.reward._worker``) over a pipe;
if no answer arrives within ``timeout_s`` the worker is SIGKILLed and the call returns ``(False, "timeout")``.
The next call that needs a worker starts a fresh one.

Design points:

* Workers are started with ``subprocess.Popen`` (fork+exec), never with a bare ``fork`` of a process that holds
  Ray/torch threads and locks, and without ``multiprocessing`` (no re-import of ``__main__``; works inside daemonic
  processes). They are started lazily, up to ``max_workers``, when every running worker is busy.
* One pool per process, created lazily by ``get_pool``; after ``os.fork`` the child drops the parent's pool
  (closing its copies of the pipes) and builds its own. Workers are killed at interpreter exit (``atexit``),
  exit on EOF of stdin, and on Linux get SIGKILL when the pool's owner dies (``PR_SET_PDEATHSIG``, armed from a
  long-lived spawner thread; needed because a worker stuck in C code holds the GIL and cannot notice anything).
* Thread-safe: any number of threads may call ``grade`` concurrently; each blocks only on its own worker.
* Bounds per call: waiting for a free worker is bounded by ``queue_timeout_s`` (status ``busy``), starting a worker
  by ``start_timeout_s`` (status ``error``), grading by ``timeout_s`` (status ``timeout``), and the worker's memory
  by ``memory_limit_mb`` (status ``memory``).
* Memory ceiling: while a call waits for its answer, the worker's resident set (``/proc/<pid>/statm``) is read
  every 50 ms; over ``memory_limit_mb`` (default 1024, env ``GTPO_REWARD_MEMORY_MB``, 0 = none) the worker is
  SIGKILLed like a timed-out one and replaced on demand. Polling the RSS from the parent was chosen over
  ``RLIMIT_AS`` in the worker: an address-space limit surfaces as a ``MemoryError`` that math-verify's own
  ``except Exception`` swallows (the call would score as an ordinary parse failure and the worker keep a damaged
  heap), and it counts reserved, untouched address space. Without ``/proc`` (not Linux) there is no ceiling.
* Environment: a worker starts with the parent's minus every variable whose name looks like a secret
  (``KEY``, ``TOKEN``, ``SECRET``, ``PASSWORD``, ``PASSWD``, ``CREDENTIAL``, any case: ``WANDB_API_KEY``, ``HF_TOKEN``,
  ``RAY_AUTH_TOKEN_PATH``); it grades text the policy wrote and needs none of them. The parent's is unchanged.
* Two kinds of job: ``grade`` (an extracted answer, strict mode) and ``grade_response`` (a whole response graded
  with math-verify's own extraction, lenient mode); same limits for both.
"""

from __future__ import annotations

import atexit
import os
import pickle
import select
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gtpo.private_files import looks_secret
from gtpo.reward._protocol import HEADER as _HEADER
from gtpo.reward._protocol import encode, write_all

__all__ = ["GraderPool", "default_memory_limit_mb", "default_num_workers", "get_pool", "shutdown_pool", "worker_env"]

_PKG_PARENT = str(Path(__file__).resolve().parents[2])
# How often a waiting call reads its worker's resident set size.
_MEMORY_POLL_S = 0.05
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
# Returned by _Worker._recv when the worker went over the memory ceiling.
_OVER_MEMORY = object()


def _env_number(name: str, cast, minimum: float, rule: str):
    """``cast(os.environ[name])`` checked against ``minimum``; None when unset."""
    env = os.environ.get(name)
    if not env:
        return None
    value = cast(env)
    if value < minimum:
        raise ValueError(f"{name}={env}: must be {rule}")
    return value


def default_memory_limit_mb() -> float:
    """``GTPO_REWARD_MEMORY_MB`` if set (0 = no ceiling), else 1024 MB of resident memory per grading worker."""
    mb = _env_number("GTPO_REWARD_MEMORY_MB", float, 0.0, ">= 0 (0: no ceiling)")
    return 1024.0 if mb is None else mb


def _rss_bytes(pid: int) -> int | None:
    """Resident set size of ``pid`` (Linux ``/proc``); None if unavailable."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE_BYTES
    except (OSError, ValueError, IndexError):
        return None


def worker_env(parent: dict[str, str], parent_pid: int) -> dict[str, str]:
    """A grading worker's environment: ``parent``'s without secret-looking names, this package first on
    ``PYTHONPATH``, the owner's pid, single-threaded BLAS (sympy needs no BLAS threads)."""
    env = {k: v for k, v in parent.items() if not looks_secret(k)}  # credentials, and paths to them
    env["PYTHONPATH"] = _PKG_PARENT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["GTPO_GRADER_PARENT"] = str(parent_pid)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = "1"
    return env


def default_num_workers() -> int:
    """``GTPO_REWARD_WORKERS`` if set, else min(8, cpu count): verl runs several reward actors per node."""
    n = _env_number("GTPO_REWARD_WORKERS", int, 1, ">= 1")
    return max(1, min(8, os.cpu_count() or 1)) if n is None else n


class _Worker:
    """One grading subprocess and its pipe ends."""

    def __init__(self, start_timeout_s: float):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gtpo.reward._worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=worker_env(dict(os.environ), os.getpid()),
            close_fds=True,
            # own session: a terminal Ctrl-C reaches the parent only, which then cleans up
            start_new_session=True,
        )
        self.rfd = self.proc.stdout.fileno()
        self.wfd = self.proc.stdin.fileno()
        msg = self._recv(time.monotonic() + start_timeout_s)
        if not (isinstance(msg, tuple) and msg and msg[0] == "ready"):
            self.kill()
            raise RuntimeError(f"grading worker failed to start (got {msg!r})")

    def _recv(self, deadline: float, memory_limit_bytes: int | None = None):
        """Read one frame; ``None`` on timeout or EOF, ``_OVER_MEMORY`` once the worker's RSS passes the limit."""
        buf = bytearray()
        need = _HEADER.size
        header_done = False
        while True:
            while len(buf) < need:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                wait = remaining if memory_limit_bytes is None else min(remaining, _MEMORY_POLL_S)
                ready, _, _ = select.select([self.rfd], [], [], wait)
                if not ready:
                    if memory_limit_bytes is not None and (_rss_bytes(self.proc.pid) or 0) > memory_limit_bytes:
                        return _OVER_MEMORY
                    continue
                chunk = os.read(self.rfd, need - len(buf))
                if not chunk:
                    return None
                buf += chunk
            if header_done:
                return pickle.loads(bytes(buf[:need]))
            need = _HEADER.unpack(bytes(buf[: _HEADER.size]))[0]
            buf = buf[_HEADER.size :]
            header_done = True

    def request(self, job: tuple, timeout_s: float, memory_limit_bytes: int | None = None):
        try:
            write_all(self.wfd, encode(job))
        except OSError:
            return None
        return self._recv(time.monotonic() + timeout_s, memory_limit_bytes)

    def kill(self) -> None:
        try:
            self.proc.kill()
            self.proc.wait(timeout=5)
        except Exception:  # noqa: BLE001 - already gone
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except Exception:  # noqa: BLE001
                pass

    def close_fds_only(self) -> None:
        """Forget this worker in a forked child without touching the parent's process."""
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except Exception:  # noqa: BLE001
                pass


class GraderPool:
    """Pool of grading subprocesses; ``grade`` is thread-safe and always returns within its bounds."""

    def __init__(
        self, max_workers: int | None = None, start_timeout_s: float = 120.0, memory_limit_mb: float | None = None
    ):
        self.max_workers = int(max_workers or default_num_workers())
        if self.max_workers < 1:
            raise ValueError(f"max_workers={max_workers}: must be >= 1")
        self.start_timeout_s = float(start_timeout_s)
        mb = default_memory_limit_mb() if memory_limit_mb is None else float(memory_limit_mb)
        if mb < 0:
            raise ValueError(f"memory_limit_mb={memory_limit_mb}: must be >= 0 (0: no ceiling)")
        self.memory_limit_bytes = int(mb * 2**20) if mb > 0 else None
        self._cond = threading.Condition()
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()
        self._n_slots = 0
        self._closed = False
        self._spawn_executor: ThreadPoolExecutor | None = None
        self.n_killed = 0
        self.n_over_memory = 0

    def _spawner(self) -> ThreadPoolExecutor:
        # Workers are started from one long-lived thread: their PR_SET_PDEATHSIG is tied to the creating thread,
        # and callers' threads (executor threads, short-lived batch threads) may exit before the pool does.
        with self._cond:
            if self._spawn_executor is None:
                self._spawn_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gtpo-grader-spawn")
            return self._spawn_executor

    def _acquire(self, queue_timeout_s: float) -> _Worker | None | str:
        deadline = time.monotonic() + queue_timeout_s
        with self._cond:
            while True:
                if self._closed:
                    return "closed"
                if self._idle:
                    return self._idle.pop()
                if self._n_slots < self.max_workers:
                    self._n_slots += 1
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)
        try:
            worker = self._spawner().submit(_Worker, self.start_timeout_s).result()
        except Exception:  # noqa: BLE001 - reported to the caller as status "error"
            with self._cond:
                self._n_slots -= 1
                self._cond.notify()
            return "error"
        with self._cond:
            self._all.add(worker)
        return worker

    def _release(self, worker: _Worker, healthy: bool) -> None:
        if not healthy:
            worker.kill()
        with self._cond:
            if healthy and not self._closed:
                self._idle.append(worker)
            else:
                self._all.discard(worker)
                self._n_slots -= 1
                if not healthy:
                    self.n_killed += 1
            self._cond.notify()
        if healthy and self._closed:
            worker.kill()

    def _run(self, job: tuple, timeout_s: float, queue_timeout_s: float) -> tuple | str:
        """Send ``job`` to a free worker: its reply, or the failure status (busy, error, timeout, memory)."""
        got = self._acquire(queue_timeout_s)
        if got is None:
            return "busy"
        if isinstance(got, str):
            return "error"
        worker = got
        try:
            reply = worker.request(job, timeout_s, self.memory_limit_bytes)
        except Exception:  # noqa: BLE001 - e.g. a corrupt frame: never leak the slot
            reply = None
        if reply is _OVER_MEMORY:
            self._release(worker, healthy=False)
            with self._cond:
                self.n_over_memory += 1
            return "memory"
        if reply is None:
            # no answer in time (or the worker died): kill it, its slot restarts on demand
            dead = worker.proc.poll() is not None
            self._release(worker, healthy=False)
            return "error" if dead else "timeout"
        self._release(worker, healthy=True)
        return reply

    @staticmethod
    def _soft(timeout_s: float, soft_timeout_s: int | None) -> int | None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s}: must be > 0")
        if soft_timeout_s is None:
            return max(1, int(timeout_s // 3))
        return int(soft_timeout_s) or None

    def grade(
        self,
        gold: str,
        pred: str,
        timeout_s: float = 10.0,
        queue_timeout_s: float = 600.0,
        soft_timeout_s: int | None = None,
    ) -> tuple[bool, str]:
        """Grade one (gold, extracted answer) pair in a worker. Never raises on any input; returns (acc, status).

        Args:
            timeout_s: hard wall-clock limit once the job is sent; the worker is killed past it.
            queue_timeout_s: limit on waiting for a free (or freshly started) worker.
            soft_timeout_s: math-verify's own alarm per parse/verify step (integer seconds); None = timeout_s // 3
                (>= 1) so that most slow cases end without a kill; 0 disables the alarms (hard limit only).

        status: ``ok`` / ``parse_error`` / ``gold_error`` / ``timeout`` (worker killed or soft alarm) /
        ``memory`` (worker killed over the memory ceiling) / ``busy`` (no worker free within queue_timeout_s) /
        ``error`` (worker crashed or could not start).
        """
        soft = self._soft(timeout_s, soft_timeout_s)
        reply = self._run(("answer", str(gold), str(pred), soft, soft), timeout_s, queue_timeout_s)
        if isinstance(reply, str):
            return False, reply
        acc, status = reply[0], str(reply[1])
        return bool(acc), ("error" if status.startswith("error") else status)

    def grade_response(
        self,
        gold: str,
        response: str,
        timeout_s: float = 10.0,
        queue_timeout_s: float = 600.0,
        soft_timeout_s: int | None = None,
    ) -> tuple[bool, str, str]:
        """Grade a whole response with math-verify's own extraction (``grader.grade_response``); same limits and
        statuses as :meth:`grade`, plus ``no_answer``. Returns (acc, status, extracted answer text or "")."""
        soft = self._soft(timeout_s, soft_timeout_s)
        reply = self._run(("response", str(gold), str(response), soft, soft), timeout_s, queue_timeout_s)
        if isinstance(reply, str):
            return False, reply, ""
        acc, status, pred = reply[0], str(reply[1]), str(reply[2])
        return bool(acc), ("error" if status.startswith("error") else status), pred

    def worker_pids(self) -> list[int]:
        with self._cond:
            return [w.proc.pid for w in self._all]

    def shutdown(self) -> None:
        with self._cond:
            self._closed = True
            workers = list(self._all)
            self._idle.clear()
            self._all.clear()
            self._cond.notify_all()
        for w in workers:
            w.kill()
        if self._spawn_executor is not None:
            self._spawn_executor.shutdown(wait=False)

    def _forget_after_fork(self) -> None:
        for w in list(self._all):
            w.close_fds_only()


_POOL: GraderPool | None = None
_POOL_PID: int | None = None
_POOL_LOCK = threading.Lock()


def get_pool(max_workers: int | None = None) -> GraderPool:
    """The process-wide pool (created on first use; ``max_workers`` only counts at creation)."""
    global _POOL, _POOL_PID
    pid = os.getpid()
    pool = _POOL
    if pool is not None and _POOL_PID == pid:
        return pool
    with _POOL_LOCK:
        if _POOL is None or _POOL_PID != pid:
            _POOL = GraderPool(max_workers)
            _POOL_PID = pid
        return _POOL


def shutdown_pool() -> None:
    """Kill this process's grading workers (a later call creates a new pool)."""
    global _POOL
    with _POOL_LOCK:
        pool, _POOL = _POOL, None
    if pool is not None and _POOL_PID == os.getpid():
        pool.shutdown()


def _after_fork_in_child() -> None:
    global _POOL, _POOL_LOCK
    # the lock may have been held by another thread at fork time
    _POOL_LOCK = threading.Lock()
    if _POOL is not None:
        _POOL._forget_after_fork()
    _POOL = None


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(shutdown_pool)
