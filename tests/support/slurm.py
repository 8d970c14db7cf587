"""A real one-node Slurm (Debian's 22.05: slurmctld, slurmd, munge) on this host, for the tests of the sbatch script.

    apt-get install --no-install-recommends slurmctld slurmd slurm-client munge     # .ci/run does this as root

:class:`LocalSlurm` writes a ``slurm.conf`` into a folder of its own (``SLURM_CONF`` points the client commands at
it), starts ``munged`` if none runs, then ``slurmctld`` and ``slurmd`` in the foreground of their own processes, and
waits until the node is idle. The settings are the few a container without cgroups or systemd needs:
``proctrack/linuxproc``, ``task/none``, no accounting; one node with this host's cores; requeue allowed.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch", "squeue", "scontrol")


def missing_tools() -> list[str]:
    return [name for name in DAEMONS if shutil.which(name) is None and not Path(f"/usr/sbin/{name}").exists()]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _sbin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class LocalSlurm:
    def __init__(self, folder: Path, cpus: int | None = None):
        self.folder = Path(folder)
        self.cpus = cpus or os.cpu_count() or 2
        self.node = socket.gethostname()
        self.conf = self.folder / "slurm.conf"
        self.procs: list[subprocess.Popen] = []
        self.munged: subprocess.Popen | None = None

    @property
    def env(self) -> dict[str, str]:
        """The environment of a client command (sbatch, squeue, scontrol) talking to this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def _write_conf(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        for sub in ("state", "spool", "logs"):
            (self.folder / sub).mkdir(parents=True, exist_ok=True)
        memory_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
        f = self.folder
        self.conf.write_text(
            f"""ClusterName=gtpo-test
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={f}/state
SlurmdSpoolDir={f}/spool
SlurmctldPidFile={f}/slurmctld.pid
SlurmdPidFile={f}/slurmd.pid
SlurmctldLogFile={f}/logs/slurmctld.log
SlurmdLogFile={f}/logs/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
MpiDefault=none
ReturnToService=2
# the node may declare more CPUs than the host has (Ray is told 8 per node, as on the simulated clusters)
SlurmdParameters=config_overrides
JobRequeue=1
MinJobAge=3600
KillWait=30
SchedulerParameters=sched_interval=2
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={memory_mb * 3 // 4} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
        )

    def start(self, timeout: float = 60.0) -> None:
        self._write_conf()
        env = self.env
        if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode != 0:
            Path("/run/munge").mkdir(parents=True, exist_ok=True)
            shutil.chown("/run/munge", "munge", "munge")
            munge_log = open(self.folder / "munged.log", "wb")  # noqa: SIM115 - owned by the daemon's lifetime
            self.munged = subprocess.Popen(
                ["runuser", "-u", "munge", "--", _sbin("munged"), "--foreground"], stdout=munge_log, stderr=munge_log
            )
        logs = self.folder / "logs"
        for daemon in ("slurmctld", "slurmd"):
            out = open(logs / f"{daemon}.out", "wb")  # noqa: SIM115 - owned by the daemon's lifetime
            self.procs.append(
                subprocess.Popen([_sbin(daemon), "-D", "-f", str(self.conf)], env=env, stdout=out, stderr=out)
            )
            time.sleep(1.0)
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            state = self.run("sinfo", "-h", "-o", "%T", check=False).stdout.strip()
            if state in ("idle", "mixed", "allocated"):
                return
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the local Slurm node did not come up (sinfo: {state!r}); see {logs}")

    def run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, check=check, timeout=60)

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as key -> value (the first value of each key)."""
        out = self.run("scontrol", "show", "job", "-o", job_id, check=False).stdout
        fields: dict[str, str] = {}
        for token in out.split():
            key, _, value = token.partition("=")
            fields.setdefault(key, value)
        return fields

    def wait_for_state(self, job_id: str, states: set[str], timeout: float, min_restarts: int = 0) -> dict[str, str]:
        """The job's fields once it is in one of ``states`` having been requeued at least ``min_restarts`` times (a
        job waiting for its first start is PENDING too)."""
        deadline = time.monotonic() + timeout
        fields = {}
        while time.monotonic() < deadline:
            fields = self.job(job_id)
            if fields.get("JobState") in states and int(fields.get("Restarts") or 0) >= min_restarts:
                return fields
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} not in {states} after {min_restarts}+ restarts in {timeout} s: {fields}")

    def stop(self) -> None:
        self.run("scancel", "--full", "--user=root", check=False)
        for proc in reversed(self.procs):
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        if self.munged is not None:
            self.munged.terminate()
