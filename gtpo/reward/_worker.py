"""Grading worker process: ``python -m gtpo.reward._worker`` (started by ``gtpo.reward.pool``; not a user CLI).

Protocol on stdin/stdout: frames of ``gtpo.reward._protocol`` (8-byte length, pickle). After start-up the worker
sends ``("ready", pid)``; then for each job ``("answer", gold, pred, parse_timeout, verify_timeout)`` it answers
``(acc, status)`` (``grader.grade_pair``) and for ``("response", gold, response, ...)`` ``(acc, status, pred)``
(``grader.grade_response``). EOF on stdin, or the parent process disappearing (PR_SET_PDEATHSIG on Linux, plus a polling
watchdog), ends the worker. Anything libraries print to
stdout is redirected to stderr so it cannot corrupt the frames. Grading runs on this process's main thread, so
math-verify's SIGALRM timeouts work here; the parent kills the process if they do not fire in time.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time

from gtpo.reward._protocol import HEADER, encode, read_exact, write_all


def _watch_parent(parent_pid: int) -> None:
    # reparenting means the pool owner died without closing our stdin (e.g. SIGKILL of a forked child)
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(0)


def _die_with_parent(parent_pid: int) -> None:
    """Linux: ask the kernel for SIGKILL when the parent goes (works even while we hold the GIL in C code)."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    except Exception:  # noqa: BLE001 - not Linux: the polling watchdog below still covers the common case
        pass
    if os.getppid() != parent_pid:
        os._exit(0)


def main() -> None:
    out_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    parent_pid = int(os.environ.get("GTPO_GRADER_PARENT", os.getppid()))
    _die_with_parent(parent_pid)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()

    from gtpo.reward.grader import grade_pair, grade_response, silence_math_verify

    silence_math_verify()
    # warm the lazy imports of math-verify/sympy before declaring readiness
    grade_pair("1", "1")
    write_all(out_fd, encode(("ready", os.getpid())))
    while True:
        header = read_exact(0, HEADER.size)
        if header is None:
            return
        body = read_exact(0, HEADER.unpack(header)[0])
        if body is None:
            return
        kind, gold, text, parse_timeout, verify_timeout = pickle.loads(body)
        try:
            if kind == "response":
                result = grade_response(gold, text, parse_timeout, verify_timeout)
            else:
                result = grade_pair(gold, text, parse_timeout, verify_timeout)
        except BaseException as exc:  # noqa: BLE001 - any failure is a verdict, never a dead worker
            result = (False, f"error:{type(exc).__name__}", "")
        write_all(out_fd, encode(result))


if __name__ == "__main__":
    main()
