"""scripts/slurm/ray_on_slurm.sbatch under a real Slurm 22.05 (one node on this host: tests/support/slurm.py).

    .venv/bin/python -m pytest -n 0 -q tests/test_slurm_preemption.py

1. A stand-in launch script: the time-limit warning (``scancel --signal=USR1 --batch``, what ``--signal=B:USR1@<s>``
   sends) reaches the driver's step through the script; the driver exits 85 and the job is requeued, and the
   requeued job runs to its end. A driver that crashes (exit 1) is not requeued. The same job checks Ray's token
   authentication: the driver joins the cluster with the job's token, ``ray.init`` without a token or with a wrong
   one is refused, and the token is in no process's arguments or environment, nor in the job's output.
2. End to end (the CPU backend's training, two ranks, ``trainer=colocate_async``, through the 7B launcher): the
   job's time limit leaves less than ``algorithm.preemption.margin_s`` from the start, so the trainer, reading the
   job's end from ``squeue``, saves after step 1 and exits 85; the script requeues the job; the requeued job, given
   a longer limit while it waits, resumes from that checkpoint and finishes, every step in the metric log once.

Each waits for a condition it controls or observes (a step the deadline always falls inside, the requeued job
pending, the previous run's processes gone), never for a delay; the timeouts only bound a failure.

A requeued job waits about two minutes before Slurm starts it again (its eligible time); the tests move its start
time to now to save that wait. The fake-``srun`` harness (tests/test_slurm.py) keeps what one node cannot show.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import time
from pathlib import Path

import pytest

from gtpo.trainer.resume.checkpoints import TRACKER_FILE
from tests.support.e2e import read_metrics
from tests.support.slurm import LocalSlurm, missing_tools

REPO = Path(__file__).resolve().parents[1]
SBATCH = REPO / "scripts" / "slurm" / "ray_on_slurm.sbatch"
VENV_BIN = Path(os.environ.get("VIRTUAL_ENV", REPO / ".venv")) / "bin"

STUB_LAUNCH = r"""#!/usr/bin/env bash
# Stand-in driver: exits 85 on USR1 (as the recipe's driver after its save), FAKE_CRASH=1 exits 1 at once, a requeued
# run exits 0. STUB_RAY_INIT=1: first joins the job's Ray cluster as the recipe's driver does (ray.init, RAY_ADDRESS).
echo "stub: start restart=${SLURM_RESTART_COUNT:-0} ALLOCATION_NNODES=${ALLOCATION_NNODES} PREFLIGHT=${PREFLIGHT}" \
    >> "${STUB_LOG}"
[[ "${FAKE_CRASH:-0}" == 1 ]] && { echo "stub: crash" >> "${STUB_LOG}"; exit 1; }
[[ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]] && { echo "stub: resumed, done" >> "${STUB_LOG}"; exit 0; }
if [[ "${STUB_RAY_INIT:-0}" == 1 ]]; then
    join='import ray; ray.init(log_to_driver=False); print("stub: ray.init CPU=%g" % ray.cluster_resources()["CPU"])'
    python -c "${join}" >> "${STUB_LOG}" || exit 1
fi
trap 'echo "stub: USR1" >> "${STUB_LOG}"; exit 85' USR1
touch "${STUB_LOG}.running"
while true; do sleep 0.2; done
"""


def _interface_and_address() -> tuple[str, str] | tuple[None, None]:
    """A non-loopback IPv4 interface of this host and its address (the script refuses loopback addresses)."""
    out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        fields = line.split()
        if len(fields) > 3 and fields[1] != "lo" and not fields[3].startswith("127."):
            return fields[1], fields[3].split("/")[0]
    return None, None


def _interface() -> str | None:
    return _interface_and_address()[0]


# A client of the job's cluster from outside the job: exit 3 when the GCS refuses it (one connection attempt
# instead of Ray's twenty, a second each).
CLIENT = """
import sys, ray
try:
    ray.init(address=sys.argv[1], log_to_driver=False)
except ConnectionError as e:
    print("refused:", e)
    sys.exit(3)
print("connected")
"""


def _outsiders(address: str, home: Path, token_file: Path) -> dict[str, subprocess.CompletedProcess]:
    """ray.init to the job's GCS without the token (RAY_AUTH_MODE unset, no ~/.ray/auth_token) and with a wrong one,
    both at once."""
    home.mkdir(exist_ok=True)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "SLURM_"))}
    base.update(HOME=str(home), RAY_NUM_REDIS_GET_RETRIES="1", PYTHONWARNINGS="ignore")
    wrong = "0" * len(token_file.read_text())
    envs = {"no token": base, "wrong token": {**base, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": wrong}}
    procs = {
        name: subprocess.Popen(
            [str(VENV_BIN / "python"), "-c", CLIENT, address],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, env in envs.items()
    }
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=120)
        out[name] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    return out


def _environments_holding(value: str) -> list[str]:
    """The processes on this host whose environment holds ``value``."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if value.encode() in environ.read_bytes():
                found.append(environ.parent.name)
        except OSError:
            pass  # gone, or not ours to read
    return found


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    missing = missing_tools()
    if missing or os.geteuid() != 0:
        pytest.skip(f"a local Slurm needs root and {missing or 'its daemons'} (apt-get install slurmctld slurmd ...)")
    if _interface() is None:
        pytest.skip("no non-loopback IPv4 interface for Ray to bind")
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm"), cpus=16)
    cluster.start()
    yield cluster
    cluster.stop()


def sbatch_env(tmp: Path, **extra: str) -> dict[str, str]:
    from gtpo.cpu.cluster import free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RAY_", "PREFLIGHT"))}
    env.update(
        PATH=f"{VENV_BIN}{os.pathsep}{env['PATH']}",
        REPO_DIR=str(REPO),
        RAY_DATA_HOME=str(tmp / "shared"),
        MIN_DRIVER_VERSION="0",
        RAY_NETWORK_INTERFACE=_interface() or "",
        RAY_PORT=str(free_port()),
        RAY_DASHBOARD_PORT=str(free_port()),
        CPUS_PER_NODE="8",
        DRIVER_CPUS="2",
        DRIVER_MEM="2G",
        RUN_PREFLIGHT="0",
        REQUEUE_ON_TIMEOUT="1",
    )
    env.update(extra)
    return env


def submit(slurm: LocalSlurm, tmp: Path, env: dict[str, str], *sbatch_args: str, script_args=()) -> str:
    out = tmp / "job.out"
    cmd = [
        "sbatch", "--parsable", "--nodes=1", "--cpus-per-task=8", "--gpus-per-node=0", "--requeue",
        "--open-mode=append", f"--output={out}", *sbatch_args, str(SBATCH), *script_args,
    ]  # fmt: skip
    proc = subprocess.run(cmd, env={**env, "SLURM_CONF": str(slurm.conf)}, capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def job_processes(job_id: str) -> list[int]:
    """The processes of this host that run for Slurm job ``job_id`` (``SLURM_JOB_ID`` in their environment): its
    batch script, its steps, and the Ray processes those started, which can outlive a step that was killed."""
    marker = f"SLURM_JOB_ID={job_id}\0".encode()
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker in environ.read_bytes():
                found.append(int(environ.parent.name))
        except OSError:
            pass  # gone, or not ours to read
    return found


def restart_now(slurm: LocalSlurm, job_id: str, timeout: float = 120.0, time_limit: int | None = None) -> None:
    """Wait until the job is requeued (pending again, its restart count above zero: a job waiting for its first start
    is pending too) and every process of its previous run has ended, then move its start to now (Slurm holds it ~2
    minutes), with ``time_limit`` minutes if given.

    The previous run's Ray head must be gone before the next binds the same port, however long its processes take
    to stop on a loaded machine: the test decides by their absence, not by a delay. The requeue revokes the old
    run's job credential, and slurmd refuses a new credential issued in the same second ("Killing non-startable batch
    JobId=N: Job credential revoked", the job then FAILED): the start waits for the next whole second plus one."""
    slurm.wait_for_state(job_id, {"PENDING"}, timeout, min_restarts=1)
    deadline = time.monotonic() + 300  # a bound for the failure message only
    while (left := job_processes(job_id)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"processes of job {job_id}'s previous run still running after 300 s: {left}"
    if time_limit is not None:
        slurm.run("scontrol", "update", f"JobId={job_id}", f"TimeLimit={time_limit}")
    time.sleep(2.0 - time.time() % 1.0)
    slurm.run("scontrol", "update", f"JobId={job_id}", "StartTime=now", check=False)


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def test_the_warning_reaches_the_driver_and_exit_85_requeues_the_job(slurm, tmp_path):
    """Also Ray's token authentication on the job's cluster: the driver joins it, outsiders are refused, the token is
    in no process's arguments or environment nor in the job's output, and its folder goes with the job."""
    stub = tmp_path / "stub_launch.sh"
    stub.write_text(STUB_LAUNCH)
    stub_log = tmp_path / "stub.log"
    env = sbatch_env(tmp_path, LAUNCH_SCRIPT=str(stub), STUB_LOG=str(stub_log), STUB_RAY_INIT="1")
    job = submit(slurm, tmp_path, env, "--time=10", "--signal=B:USR1@30")
    deadline = time.monotonic() + 180

    def wait_for(done) -> None:
        while not done():
            assert time.monotonic() < deadline, _read(tmp_path / "job.out")[-3000:]
            state = slurm.job(job).get("JobState")
            assert state in ("PENDING", "RUNNING", "CONFIGURING"), _read(tmp_path / "job.out")[-3000:]
            time.sleep(0.5)

    # The cluster is complete once the driver starts; outsiders try it while the driver joins it.
    wait_for(lambda: "stub: start" in _read(stub_log))
    auth = tmp_path / "shared" / ".ray-auth" / job
    token = (auth / "token").read_text()
    assert len(token) == 64 and stat.S_IMODE((auth / "token").stat().st_mode) == 0o600
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    assert "ray start" in ps and token not in ps
    assert _environments_holding(token) == []
    address = f"{_interface_and_address()[1]}:{env['RAY_PORT']}"
    for name, client in _outsiders(address, tmp_path / "home", auth / "token").items():
        assert client.returncode == 3, (name, client.stdout, client.stderr[-2000:])
        assert "Authentication token is missing or incorrect" in client.stderr, (name, client.stderr[-2000:])
    wait_for(Path(f"{stub_log}.running").exists)
    # what --signal=B:USR1@<s> does at the time limit: USR1 to the batch script only
    slurm.run("scancel", "--signal=USR1", "--batch", job)
    restart_now(slurm, job)
    final = slurm.wait_for_state(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, 240)
    output = _read(tmp_path / "job.out")
    assert final["JobState"] == "COMPLETED" and final["Restarts"] == "1", (final, output[-3000:])
    assert _read(stub_log).splitlines() == [
        "stub: start restart=0 ALLOCATION_NNODES=1 PREFLIGHT=0",
        "stub: ray.init CPU=8",
        "stub: USR1",
        "stub: start restart=1 ALLOCATION_NNODES=1 PREFLIGHT=0",
        "stub: resumed, done",
    ], output[-3000:]
    assert "USR1: the time limit is near; the trainer saves after the step in flight (step " in output
    assert f"REQUEUE_ON_TIMEOUT=1: scontrol requeue {job}" in output
    assert token not in output and not auth.exists()


def test_a_crashed_driver_is_not_requeued(slurm, tmp_path):
    stub = tmp_path / "stub_launch.sh"
    stub.write_text(STUB_LAUNCH)
    stub_log = tmp_path / "stub.log"
    env = sbatch_env(tmp_path, LAUNCH_SCRIPT=str(stub), STUB_LOG=str(stub_log), FAKE_CRASH="1")
    job = submit(slurm, tmp_path, env, "--time=10", "--signal=B:USR1@30")
    final = slurm.wait_for_state(job, {"COMPLETED", "FAILED", "CANCELLED"}, 180)
    assert final["JobState"] == "FAILED" and final["Restarts"] == "0", (final, _read(tmp_path / "job.out")[-3000:])
    assert final["ExitCode"] == "1:0"
    assert "scontrol requeue" not in _read(tmp_path / "job.out")


@pytest.mark.e2e
def test_a_shortened_time_limit_saves_requeues_and_resumes(slurm, ray_cluster, tmp_path):
    """The CPU trainer at world size two under colocate_async, stopped by its deadline, requeued and resumed.

    The deadline is the test's to set, not the machine's speed to meet: the job's time limit (30 min) is shorter
    than ``algorithm.preemption.margin_s`` (40 min) from its start, so the trainer, which reads the job's end from
    squeue after every step, stops after step 1 whatever a step costs here; the requeued job gets 120 minutes (set
    while it waits, before it starts), so the same margin leaves room for every remaining step."""
    from gtpo.cpu import env as cpu_env
    from gtpo.cpu.demo import build_demo_assets
    from tests.support.launch import LAUNCHER, cpu_args, launcher_env

    ray_cluster.wait_until_free()  # one trainer at a time on this host
    assets = build_demo_assets(seed=0)
    ckpt = tmp_path / "ckpt"
    metrics_path = tmp_path / "run.metrics.jsonl"
    env = launcher_env(tmp_path, assets, {"ALLOW_HOME_PATHS": "1", "CKPTS_DIR": str(ckpt)})
    env.pop("DRY_RUN")
    env.update(cpu_env(base=env))
    # the job's own Ray token and address: none of the local cluster's RAY_* (RAY_AUTH_MODE=disabled, RAY_ADDRESS)
    env = sbatch_env(
        tmp_path, **{k: v for k, v in env.items() if k not in ("NNODES", "NGPUS_PER_NODE") and not k.startswith("RAY_")}
    )
    # two CPU "GPUs" on the job's one node: the 7B launcher's count set to the allocation's (the launcher refuses a
    # run whose count is not the allocation's)
    env.update(LAUNCH_SCRIPT=str(LAUNCHER), GPUS_PER_NODE="2", NGPUS_PER_NODE="2")
    env.update(VERL_FILE_LOGGER_PATH=str(metrics_path))
    total = 3  # step 1 before the deadline stop, steps 2 and 3 after the requeue
    args = [
        "trainer=colocate_async", *cpu_args(assets), f"trainer.total_training_steps={total}",
        "trainer.resume_mode=auto", "trainer.logger=[console,file]",
        # joining the job's Ray cluster, which the script started
        "ray_kwargs.ray_init.num_cpus=null", "ray_kwargs.ray_init.num_gpus=null",
        # room kept before the job's end: more than the first run's 30 minutes, less than the requeued run's 120
        "algorithm.preemption.margin_s=2400", "algorithm.preemption.save_estimate_s=5",
        f"hydra.run.dir={tmp_path / 'hydra'}",
    ]  # fmt: skip
    job = submit(slurm, tmp_path, env, "--time=30", "--signal=B:USR1@30", script_args=args)
    output_path = tmp_path / "job.out"
    restart_now(slurm, job, timeout=900, time_limit=120)
    final = slurm.wait_for_state(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, 1200)
    output = _read(output_path)
    assert final["JobState"] == "COMPLETED" and final["Restarts"] == "1", (final, output[-4000:])

    # the first run stopped for its deadline, read from squeue, and saved the step it had finished
    assert "left before the job's end" in output and f"(job end from squeue -j {job} -o %e)" in output, output[-4000:]
    assert f"REQUEUE_ON_TIMEOUT=1: scontrol requeue {job}" in output
    assert "stopped after step 1 (" in output, output[-4000:]
    # the requeued run resumed from it and trained to the end, every step logged once
    assert f"resumed from {ckpt / 'global_step_1'} at step 1" in output, output[-4000:]
    assert [m["step"] for m in read_metrics(metrics_path)] == list(range(1, total + 1))
    assert (ckpt / TRACKER_FILE).read_text().strip() in ("1", str(total))
    shutil.rmtree(ckpt, ignore_errors=True)
