"""The exit status of a Ray job's driver, for the launcher that ran ``ray job submit`` (gtpo/launch/submit.py).

    python -m gtpo.launch.job_exit <submission id> [--address http://<head>:8265] [--cli-status N]

Why: ``ray job submit`` exits 1 when the job FAILED and 0 otherwise (Ray 2.60, ``dashboard/modules/job/cli.py``), so
the recipe's meaningful exits are lost on the way: 85 (saved for a preemption, resume me) and 75 (a stage stalled)
become 1, and a driver stopped by ``ray job stop`` that saved and exited 85 becomes 0. A Slurm wrapper or a CI step
then requeues nothing, or retries what should not be retried.

What it reads (``JobSubmissionClient.get_job_info``): the job's ``driver_exit_code``, which Ray records when the
driver ends by itself (SUCCEEDED, FAILED). After ``ray job stop`` Ray records STOPPED and no code
(``job_supervisor.py``): the driver's last :data:`EXIT_LINE` in the tail of the job's log then gives it (the driver
prints one before exiting 85 or 75: :func:`exit_line`). Neither: the CLI's own status (``--cli-status``), and the
job's status is printed. The token: ``RAY_AUTH_MODE=token`` and ``RAY_AUTH_TOKEN_PATH``, as for ``ray job submit``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import urllib.parse

__all__ = ["EXIT_LINE", "exit_line", "job_exit_code", "last_exit_line", "main"]

# How the driver's own exit line starts (recipe/gtpo/main_gtpo.py prints it before exiting 85 or 75).
EXIT_LINE = "gtpo driver: exit status "
_EXIT_RE = re.compile(re.escape(EXIT_LINE) + r"(\d+)\b")
# Lines of the job's log searched for the driver's exit line (it is among the driver's last).
TAIL_LINES = 200


def exit_line(code: int, why: str) -> str:
    """The line a driver prints before exiting ``code``, which :func:`last_exit_line` finds in the job's log."""
    return f"{EXIT_LINE}{code} ({why})"


def last_exit_line(log_text: str) -> int | None:
    """The code of the last :func:`exit_line` in ``log_text``, or None."""
    found = _EXIT_RE.findall(log_text)
    return int(found[-1]) if found else None


def job_exit_code(status: str, driver_exit_code: int | None, log_tail, cli_status: int) -> tuple[int, str]:
    """The status the submitting shell should exit with, and a line saying where it comes from.

    Args:
        status: the job's status (SUCCEEDED, FAILED, STOPPED, ...).
        driver_exit_code: what Ray recorded as the driver's exit code, or None.
        log_tail: called (only when needed) for the end of the job's log.
        cli_status: the exit status of ``ray job submit``.
    """
    if driver_exit_code is not None:
        code = int(driver_exit_code)
        if code < 0:  # Popen's -N: killed by signal N, which a shell reports as 128 + N
            return 128 - code, f"the driver was killed by signal {-code} (job {status})"
        return code, f"the driver exited {code} (job {status})"
    if status == "STOPPED":
        code = last_exit_line(log_tail())
        if code is not None:
            return code, f"the driver exited {code} after the stop (job STOPPED; code from its last line)"
    return cli_status, f"job {status}, no driver exit code recorded: ray job submit's status {cli_status}"


def _log_tail(client, job_id: str) -> str:
    """The last :data:`TAIL_LINES` lines of the job's log (the whole log where the state API is not there), through
    the job client's private ``_do_request`` (seam ``job-exit-log-tail``, docs/architecture.md)."""
    query = urllib.parse.urlencode({"submission_id": job_id, "lines": TAIL_LINES})
    try:
        response = client._do_request("GET", f"/api/v0/logs/file?{query}", timeout=60)
        if response.status_code == 200:
            return response.text
    except Exception:  # noqa: BLE001 - the full log below still tells
        pass
    return client.get_job_logs(job_id)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gtpo.launch.job_exit", description=__doc__.split("\n\n")[0])
    parser.add_argument("job_id", help="the submission id given to ray job submit --submission-id")
    parser.add_argument("--address", default=os.environ.get("RAY_ADDRESS", ""), help="the dashboard [RAY_ADDRESS]")
    parser.add_argument("--cli-status", type=int, default=0, help="exit status of ray job submit [0]")
    args = parser.parse_args(argv)
    try:
        from ray.job_submission import JobSubmissionClient

        client = JobSubmissionClient(args.address or None)
        info = client.get_job_info(args.job_id)
    except Exception as err:  # noqa: BLE001 - whatever failed, the CLI's own status is what is left
        print(
            f"[gtpo] job {args.job_id}: its status could not be read from --address={args.address} ({err}); "
            f"exiting with ray job submit's status {args.cli_status}",
            file=sys.stderr,
        )
        return args.cli_status
    status = str(getattr(info.status, "value", info.status))
    if status in ("PENDING", "RUNNING"):
        print(
            f"[gtpo] job {args.job_id} is still {status} (ray job submit ended with {args.cli_status}): follow it with"
            f" ray job logs --address {args.address} {args.job_id} --follow",
            file=sys.stderr,
        )
        return args.cli_status
    try:
        tail = lambda: _log_tail(client, args.job_id)  # noqa: E731 - read only for a stopped job
        code, why = job_exit_code(status, info.driver_exit_code, tail, args.cli_status)
    except Exception as err:  # noqa: BLE001 - the log could not be read
        code, why = args.cli_status, f"job {status}, its log could not be read ({err}): ray job submit's status"
    print(f"[gtpo] job {args.job_id}: {why}; exiting {code}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
