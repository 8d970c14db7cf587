"""scripts/slurm/ray_on_slurm.sbatch with fake srun, ray, scontrol, hostname and apptainer executables.

    .venv/bin/pytest -q tests/test_slurm.py

The fakes record their arguments (one tab-separated line each, in call order) and behave just enough like the real
tools: `srun` strips its options and runs the command, `ray start --block` blocks until killed, `ray status` lists
as many active nodes as `ray start` calls were seen (capped by FAKE_MAX_NODES), `scontrol show hostnames` prints
FAKE_NODES. A fake launch script records the driver's environment and arguments. Asserted: the head starts first,
every worker joins before the driver starts, the driver runs on the head with `srun --overlap` and sees the
cluster address, node count and plugin; containers wrap every Ray and driver step; a cluster that never fills up
fails at the timeout without starting the driver.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SBATCH = REPO / "scripts" / "slurm" / "ray_on_slurm.sbatch"
NODES = ("gpu-a01", "gpu-a02", "gpu-a03")

FAKES = {
    "srun": r"""
        printf 'srun\t%s\n' "$(printf '%q ' "$@")" >> "$FAKE_LOG"
        node=""
        while [[ $# -gt 0 && "$1" == --* ]]; do
            case "$1" in --nodelist=*) node=${1#--nodelist=} ;; esac
            shift
        done
        export FAKE_NODE=$node
        exec "$@"
    """,
    "ray": r"""
        case "$1" in
            start)
                printf 'ray\t%s\t%s\n' "${FAKE_NODE:-}" "$(printf '%q ' "$@")" >> "$FAKE_LOG"
                if [[ " $* " == *" --block "* ]]; then exec sleep 120; fi
                ;;
            status)
                # Count first, then record what this poll saw: the record says which nodes it could have seen,
                # whatever the interleaving with concurrent `ray start` records.
                n=$(grep -c $'^ray\t[^\t]*\tstart ' "$FAKE_LOG" || true)
                if (( n > ${FAKE_MAX_NODES:-1000} )); then n=${FAKE_MAX_NODES}; fi
                printf 'ray\t%s\tactive=%s\t%s\n' "${FAKE_NODE:-}" "$n" "$(printf '%q ' "$@")" >> "$FAKE_LOG"
                echo "======== Autoscaler status ========"
                echo "Node status"
                echo "---------------------------------------------------------------"
                echo "Active:"
                for ((i = 1; i <= n; i++)); do echo " 1 node_$i"; done
                echo "Pending:"
                echo " (no pending nodes)"
                echo "Resources"
                echo " 0.0/$((n * 8)).0 GPU"
                ;;
            *)
                printf 'ray\t%s\t%s\n' "${FAKE_NODE:-}" "$(printf '%q ' "$@")" >> "$FAKE_LOG"
                ;;
        esac
    """,
    "scontrol": r"""
        printf 'scontrol\t%s\n' "$(printf '%q ' "$@")" >> "$FAKE_LOG"
        [[ "$1 $2" == "show hostnames" ]] && tr ' ' '\n' <<<"$FAKE_NODES"
    """,
    "hostname": r"""
        printf 'hostname\t%s\t%s\n' "${FAKE_NODE:-}" "$(printf '%q ' "$@")" >> "$FAKE_LOG"
        echo "fe80::1 10.1.2.3 192.168.0.9"
    """,
    "apptainer": r"""
        printf 'apptainer\t%s\n' "$(printf '%q ' "$@")" >> "$FAKE_LOG"
        shift
        while [[ "$1" == --* ]]; do
            case "$1" in --nv) shift ;; *) shift 2 ;; esac
        done
        shift
        exec "$@"
    """,
}

LAUNCH = r"""#!/usr/bin/env bash
printf 'launch\t%s\t%s\n' "${FAKE_NODE:-}" "$(printf '%q ' \
    "RAY_ADDRESS=${RAY_ADDRESS:-}" "SUBMIT_MODE=${SUBMIT_MODE:-}" "NNODES=${NNODES:-}" \
    "NGPUS_PER_NODE=${NGPUS_PER_NODE:-}" "VERL_USE_EXTERNAL_MODULES=${VERL_USE_EXTERNAL_MODULES:-}" \
    "PYTHONPATH=${PYTHONPATH:-}" "WANDB_API_KEY=${WANDB_API_KEY:-}" "$@")" >> "$FAKE_LOG"
"""


def run_sbatch(tmp_path: Path, *args: str, **env_extra: str) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in FAKES.items():
        path = bin_dir / name
        path.write_text("#!/usr/bin/env bash\n" + textwrap.dedent(body))
        path.chmod(0o755)
    launch = tmp_path / "fake_launch.sh"
    launch.write_text(LAUNCH)
    log = tmp_path / "calls.log"
    log.touch()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RAY_", "VERL_"))}
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env['PATH']}",
        FAKE_LOG=str(log),
        FAKE_NODES=" ".join(NODES),
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="gpu-a[01-03]",
        SLURM_JOB_NUM_NODES=str(len(NODES)),
        SLURM_NNODES=str(len(NODES)),
        SLURM_CPUS_PER_TASK="64",
        SLURM_GPUS_ON_NODE="8",
        SLURM_SUBMIT_DIR=str(REPO),
        LAUNCH_SCRIPT=str(launch),
        RAY_POLL_INTERVAL="0.1",
        RAY_WAIT_TIMEOUT="20",
        WANDB_API_KEY="secret-from-sbatch-env",
    )
    env.update(env_extra)
    proc = subprocess.run(["bash", str(SBATCH), *args], env=env, capture_output=True, text=True, timeout=60)
    records = [line.split("\t") for line in log.read_text().splitlines()]
    return proc, records


def index_of(records, pred) -> list[int]:
    return [i for i, rec in enumerate(records) if pred(rec)]


def argv(rec: list[str]) -> list[str]:
    return shlex.split(rec[-1])


def test_head_first_workers_join_driver_on_head(tmp_path):
    proc, records = run_sbatch(tmp_path, "trainer.total_epochs=1", "+extra=a b")
    assert proc.returncode == 0, proc.stdout + proc.stderr

    starts = index_of(records, lambda r: r[0] == "ray" and argv(r)[0] == "start")
    assert len(starts) == len(NODES)
    head = argv(records[starts[0]])
    # The head comes first, on the first node, bound to the IPv4 address, with the allocation's CPUs and GPUs.
    assert records[starts[0]][1] == NODES[0]
    assert "--head" in head and "--block" in head
    assert "--node-ip-address=10.1.2.3" in head and "--port=6379" in head
    assert "--num-cpus=64" in head and "--num-gpus=8" in head
    # Every other node joins the head's address, after a status poll saw the head.
    polls = index_of(records, lambda r: r[0] == "ray" and argv(r)[0] == "status")
    seen_head = [i for i in polls if records[i][2] != "active=0"]
    assert seen_head and seen_head[0] > starts[0]
    worker_sruns = index_of(records, lambda r: r[0] == "srun" and "start" in argv(r) and "--head" not in argv(r))
    assert seen_head and len(worker_sruns) == len(NODES) - 1 and min(worker_sruns) > seen_head[0]
    workers = starts[1:]
    assert sorted(records[i][1] for i in workers) == sorted(NODES[1:])
    for i in workers:
        worker = argv(records[i])
        assert "--head" not in worker and "--address=10.1.2.3:6379" in worker
        assert "--num-cpus=64" in worker and "--num-gpus=8" in worker and "--block" in worker
    # Status polls run next to the Ray step on the head (srun --overlap) against the head's address.
    for i in polls:
        assert records[i][1] == NODES[0] and "--address=10.1.2.3:6379" in argv(records[i])

    (driver,) = index_of(records, lambda r: r[0] == "launch")
    assert driver == len(records) - 1 and driver > max(starts) and driver > polls[-1]
    assert records[driver][1] == NODES[0]
    srun_driver = argv(records[driver - 1])
    assert records[driver - 1][0] == "srun" and "--overlap" in srun_driver and f"--nodelist={NODES[0]}" in srun_driver
    seen = dict(item.split("=", 1) for item in argv(records[driver])[:7])
    assert seen["RAY_ADDRESS"] == "10.1.2.3:6379" and seen["SUBMIT_MODE"] == "local"
    assert seen["NNODES"] == "3" and seen["NGPUS_PER_NODE"] == "8"
    assert "gtpo.verl_plugin.register" in seen["VERL_USE_EXTERNAL_MODULES"].split(",")
    assert seen["PYTHONPATH"].split(":")[0] == str(REPO)
    assert seen["WANDB_API_KEY"] == "secret-from-sbatch-env"
    assert argv(records[driver])[7:] == ["trainer.total_epochs=1", "+extra=a b"]
    # The secret never lands on a command line.
    assert not any("secret-from-sbatch-env" in rec[-1] for rec in records if rec[0] != "launch")


def test_apptainer_wraps_every_step(tmp_path):
    proc, records = run_sbatch(tmp_path, CONTAINER_RUNTIME="apptainer", CONTAINER_IMAGE="/images/gtpo.sif")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    wrapped = [argv(r) for r in records if r[0] == "apptainer"]
    ray_calls = [r for r in records if r[0] == "ray"]
    assert len(wrapped) == len(ray_calls) + 1  # every ray start / status, plus the driver
    for call in wrapped:
        assert call[:2] == ["exec", "--nv"] and "/images/gtpo.sif" in call
        assert call[call.index("--bind") + 1] == str(REPO)


def test_pyxis_flags_on_every_step(tmp_path):
    proc, records = run_sbatch(tmp_path, CONTAINER_RUNTIME="pyxis", CONTAINER_IMAGE="registry#gtpo:0.1.0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = [argv(r) for r in records if r[0] == "srun" and "hostname" not in argv(r)]
    assert len(steps) >= len(NODES) + 2
    for call in steps:
        assert "--container-image=registry#gtpo:0.1.0" in call and f"--container-workdir={REPO}" in call


def test_timeout_when_a_worker_never_joins(tmp_path):
    proc, records = run_sbatch(tmp_path, FAKE_MAX_NODES="2", RAY_WAIT_TIMEOUT="1")
    assert proc.returncode != 0
    assert "timeout: 2/3 node(s)" in proc.stderr
    assert not index_of(records, lambda r: r[0] == "launch")


@pytest.mark.parametrize(
    "env,message",
    [
        ({"CONTAINER_RUNTIME": "docker"}, "expected none, apptainer or pyxis"),
        ({"CONTAINER_RUNTIME": "apptainer"}, "needs CONTAINER_IMAGE"),
        ({"LAUNCH_SCRIPT": "scripts/no_such_script.sh"}, "not found"),
    ],
)
def test_bad_settings_fail_before_any_step(tmp_path, env, message):
    proc, records = run_sbatch(tmp_path, **env)
    assert proc.returncode != 0 and message in proc.stderr
    assert not [r for r in records if r[0] in ("srun", "ray")]
