"""A Ray job's driver status reaches the shell that submitted it (the launcher's job mode, gtpo/launch/job_exit.py).

    .venv/bin/python -m pytest -q tests/test_job_exit.py          # GTPO_SLOW_TESTS=1 for the real cluster

``ray job submit`` exits 1 on FAILED and 0 otherwise, and a job stopped by ``ray job stop`` is STOPPED with no
exit code (Ray 2.60). The rules of :func:`job_exit_code` run without Ray; the slow test starts a one-node Ray head
with the dashboard's job server and token authentication (the session's cluster has no dashboard) and submits fake
drivers through a real launcher (``ENTRYPOINT`` is a module of a few lines in the uploaded working directory):
exits 85, 75, 1 and 0 reach the launcher's shell as they are, and so does the 85 of a driver that saves on
``ray job stop``'s SIGTERM.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gtpo.launch.job_exit import exit_line, job_exit_code, last_exit_line

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent


def no_log():
    raise AssertionError("the log is read only for a stopped job without an exit code")


@pytest.mark.parametrize(
    "status,code,log,cli,expect",
    [
        ("FAILED", 85, None, 1, 85),  # the CLI says 1
        ("FAILED", 75, None, 1, 75),
        ("FAILED", 1, None, 1, 1),
        ("SUCCEEDED", 0, None, 0, 0),
        ("FAILED", -9, None, 1, 137),  # killed by SIGKILL, as a shell reports it
        ("STOPPED", None, f"step 3\n{exit_line(85, 'saved')}\nbye\n", 0, 85),  # the CLI says 0
        ("STOPPED", None, "killed before any save\n", 0, 0),
        ("FAILED", None, None, 1, 1),  # nothing recorded (the supervisor failed): the CLI's status
    ],
)
def test_the_driver_code_wins_over_the_cli_status(status, code, log, cli, expect):
    got, why = job_exit_code(status, code, (lambda: log) if log is not None else no_log, cli)
    assert got == expect and status in why


def test_a_job_still_running_is_named_with_how_to_follow_it(monkeypatch, capsys):
    """``JOB_NO_WAIT`` or a CLI that gave up: a RUNNING job has no driver exit code yet; the CLI's status is kept."""
    import types

    from gtpo.launch import job_exit

    class Client:
        def __init__(self, address):
            self.address = address

        def get_job_info(self, job_id):
            return types.SimpleNamespace(status="RUNNING", driver_exit_code=None)

    monkeypatch.setitem(sys.modules, "ray.job_submission", types.SimpleNamespace(JobSubmissionClient=Client))
    assert job_exit.main(["gtpo_x", "--address", "http://h:8265", "--cli-status", "3"]) == 3
    err = capsys.readouterr().err
    assert "job gtpo_x is still RUNNING (ray job submit ended with 3)" in err and "--follow" in err


def test_the_last_exit_line_counts():
    text = f"{exit_line(75, 'a')}\nlater\n{exit_line(85, 'b')}\n"
    assert last_exit_line(text) == 85 and last_exit_line("gtpo driver: exit status x") is None


# ------------------------------------------------------------------------ a real Ray head with the job server

FAKE_DRIVER = """
import signal, sys, time
code = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("+fake.exit="))
if code != "stop":
    print("fake driver: exit", code, flush=True)
    sys.exit(int(code))

def saved(signum, frame):  # as the recipe's driver on `ray job stop`: the trainer saves, the driver says so
    print({line!r}, file=sys.stderr, flush=True)
    sys.exit(85)

signal.signal(signal.SIGTERM, saved)
print("fake driver: waiting for the stop", flush=True)
while True:
    time.sleep(0.2)
"""


@pytest.fixture(scope="module")
def dashboard_head(tmp_path_factory):
    """A one-node Ray head with the dashboard (job submission) and token auth, every port its own."""
    import tempfile

    from gtpo.cpu.cluster import cluster_env, free_port, new_token, ray_executable

    root = Path(tempfile.mkdtemp(prefix="gtpo-job-"))  # Ray's socket paths must stay short
    token = new_token(root)
    ports = {name: free_port() for name in ("port", "dashboard", "client", "agent", "metrics", "env_agent")}
    cmd = [
        ray_executable(), "start", "--head", f"--port={ports['port']}", "--node-ip-address=127.0.0.1",
        "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={ports['dashboard']}",
        f"--ray-client-server-port={ports['client']}", f"--dashboard-agent-listen-port={ports['agent']}",
        f"--metrics-export-port={ports['metrics']}", f"--runtime-env-agent-port={ports['env_agent']}",
        "--num-cpus=2", "--num-gpus=0", "--disable-usage-stats", f"--temp-dir={root / 't'}", "--block",
    ]  # fmt: skip
    env = cluster_env(token)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env['PATH']}"
    log = open(root / "head.log", "wb")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    address = f"http://127.0.0.1:{ports['dashboard']}"
    try:
        deadline = time.monotonic() + 180
        while True:
            probe = subprocess.run(
                [ray_executable(), "job", "list", "--address", address], env=env, capture_output=True, text=True
            )
            if probe.returncode == 0:
                break
            assert proc.poll() is None and time.monotonic() < deadline, (root / "head.log").read_text()[-3000:]
            time.sleep(2)
        yield address, token
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        import shutil

        shutil.rmtree(root, ignore_errors=True)


def launcher(tmp_path: Path, address: str, token: Path, code: str) -> subprocess.Popen:
    """The 7B GTPO launcher in job mode, its entrypoint replaced by the fake driver."""
    work = tmp_path / f"work_{code}"
    work.mkdir()
    (work / "fake_driver.py").write_text(FAKE_DRIVER.format(line=exit_line(85, "saved for a stop")))
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "SUBMIT_", "DRY_RUN", "PREFLIGHT"))}
    env.update(
        PATH=f"{VENV_BIN}{os.pathsep}{env['PATH']}",
        PYTHON=sys.executable,
        HOME=str(home),
        RAY_ADDRESS=address,
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN_PATH=str(token),
        RAY_DATA_HOME=str(tmp_path / "shared"),
        ENTRYPOINT="fake_driver",
        WORKING_DIR=str(work),
        RUNTIME_ENV=str(REPO / "recipe" / "gtpo" / "runtime_env.yaml"),
    )
    script = REPO / "scripts" / "run_gtpo_qwen2.5_7b.sh"
    return subprocess.Popen(
        ["bash", str(script), f"+fake.exit={code}"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


# The cluster's jobs as "<submission id> <status> <driver exit code> <entrypoint>" lines (a client of its own: Ray
# reads the token settings once per process).
LIST_JOBS = """
import sys
from ray.job_submission import JobSubmissionClient
for job in JobSubmissionClient(sys.argv[1]).list_jobs():
    print(job.submission_id, job.status.value, job.driver_exit_code, job.entrypoint)
"""


def jobs(address: str, token: Path) -> list[list[str]]:
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    out = subprocess.run(
        [sys.executable, "-c", LIST_JOBS, address], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    return [line.split(" ", 3) for line in out.stdout.splitlines()]


@pytest.mark.slow  # a Ray head with its dashboard and five job submissions: ~45 s on 2 cores
def test_the_drivers_exit_status_reaches_the_shell(dashboard_head, tmp_path):
    address, token = dashboard_head
    runs = {code: launcher(tmp_path, address, token, code) for code in ("85", "75", "1", "0", "stop")}
    # `ray job stop` on the waiting driver, which the launcher submitted under an id of its own
    deadline = time.monotonic() + 240
    stopped = None
    while stopped is None:
        assert time.monotonic() < deadline, "the stop scenario's driver never ran"
        for job_id, status, _, entrypoint in jobs(address, token):
            if status == "RUNNING" and "+fake.exit=stop" in entrypoint:
                subprocess.run(
                    [str(VENV_BIN / "ray"), "job", "stop", "--address", address, job_id],
                    env={**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)},
                    capture_output=True,
                    timeout=120,
                )
                stopped = job_id
        time.sleep(1)
    results = {code: proc.communicate(timeout=240) for code, proc in runs.items()}
    for code, proc in runs.items():
        want = 85 if code == "stop" else int(code)
        out, err = results[code]
        assert proc.returncode == want, (code, out[-2000:], err[-3000:])
        assert "[gtpo] job gtpo_" in err and f"; exiting {want}" in err, err[-2000:]
    # Ray's own view of the stopped job: STOPPED, no exit code
    assert [(s, c) for j, s, c, _ in jobs(address, token) if j == stopped] == [("STOPPED", "None")]
    assert "the driver exited 85 after the stop (job STOPPED" in results["stop"][1]
