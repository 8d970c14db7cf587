"""Support for the end-to-end tests: one Ray cluster of two simulated nodes for the session, and recipe runs as
separate driver jobs.

Each run is ``python -m recipe.gtpo.main_gtpo backend=cpu_tiny ...`` in a subprocess that joins the session's
cluster through ``RAY_ADDRESS``: the Ray start-up is paid once, and every run is its own Ray job, so its actors and
placement groups are freed when it ends.

The cluster is two raylets on this host (:mod:`gtpo.cpu.cluster`), one logical GPU each: a run with
:data:`WORLD_SIZE_2` has one FSDP rank and one vLLM replica on each node, as on two machines; a run with the
backend's defaults (one rank) takes one of them. The raylets start *without* ``VERL_USE_EXTERNAL_MODULES`` in their
environment: the TaskRunner and the workers only register the plugin if the entry point's runtime env carries it —
the situation of a multi-node cluster, which a single-node ``ray.init`` would hide.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
# Two FSDP ranks and two vLLM replicas, one of each on each of the session cluster's two nodes.
WORLD_SIZE_2 = ("trainer.nnodes=2", "trainer.n_gpus_per_node=1")
PYTHON = sys.executable
# The runs' reward: +1 or -1 by the CRC32 of the response text, so a random model still gets mixed groups.
COIN_REWARD = REPO_ROOT / "tests" / "assets" / "coin_reward.py"


class RayCluster:
    """A local Ray cluster of ``nodes`` simulated nodes (``ray start ... --block`` each), owned by the test session.

    Every node has one logical GPU: a world-size-two run (``trainer.nnodes=2 trainer.n_gpus_per_node=1``) places one
    FSDP rank and one vLLM replica on each node, as on two machines.
    """

    def __init__(self, temp_dir: Path, nodes: int = 2):
        from gtpo.cpu.cluster import free_port

        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.temp_dir = temp_dir
        self.nodes = nodes
        self.procs: list[subprocess.Popen] = []
        self.token_path: Path | None = None

    @property
    def auth_env(self) -> dict[str, str]:
        """What a driver or client needs to join: ``RAY_AUTH_MODE=token`` and the path of this cluster's token."""
        from gtpo.private_files import ray_token_env

        assert self.token_path is not None, "the cluster has not started"
        return ray_token_env(self.token_path)

    @property
    def proc(self) -> subprocess.Popen | None:
        """The head's process."""
        return self.procs[0] if self.procs else None

    def start(self, timeout: float = 180.0) -> None:
        from gtpo.cpu.cluster import cluster_env, new_token, node_command, wait_for_nodes

        # The token beside the session folders, as `python -m gtpo.cpu.cluster start` keeps it.
        self.token_path = new_token(self.temp_dir.parent)
        env = cluster_env(self.token_path)
        for i in range(self.nodes):
            temp_dir = self.temp_dir if i == 0 else self.temp_dir.with_name(f"{self.temp_dir.name}{i}")
            cmd = node_command(head_port=self.port, head=i == 0, gpus=1, temp_dir=temp_dir, block=True)
            log = open(self.temp_dir.parent / f"ray_node{i}.log", "wb")  # noqa: SIM115 - closed with the process
            self.procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
            if i == 0:
                self._wait_for_head(timeout, Path(log.name))
        wait_for_nodes(self.address, self.nodes, self.token_path, timeout=timeout, procs=self.procs)

    def _wait_for_head(self, timeout: float, log_path: Path) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.status().returncode == 0:
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray head exited with {self.proc.returncode}:\n{tail(log_path.read_text())}")
            time.sleep(2)
        raise TimeoutError(f"ray head at {self.address} not ready after {timeout} s")

    def status(self) -> subprocess.CompletedProcess:
        """``ray status`` of this cluster (text output)."""
        from gtpo.cpu.cluster import cluster_env, ray_executable

        cmd = [ray_executable(), "status", f"--address={self.address}"]
        return subprocess.run(cmd, capture_output=True, text=True, env=cluster_env(self.token_path), timeout=60)

    def wait_until_free(self, timeout: float = 180.0) -> None:
        """Wait while an earlier job still holds the cluster's GPU slot (a run killed by a timeout frees it only once
        Ray has noticed its driver is gone), so one timed-out run does not fail the next launches too."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                probe = self.status()
            except subprocess.TimeoutExpired:
                return
            used = re.search(r"([0-9.]+)/([0-9.]+) GPU", probe.stdout)
            if probe.returncode != 0 or used is None or float(used.group(1)) == 0.0:
                return
            time.sleep(5)

    def stop(self) -> None:
        for proc in reversed(self.procs):  # the further nodes first, then the head
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()


@dataclass
class RunResult:
    returncode: int
    log_path: Path
    metrics: list[dict] = field(default_factory=list)

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def steps(self) -> list[int]:
        return [m["step"] for m in self.metrics]

    def series(self, key: str) -> list[float]:
        return [m["data"][key] for m in self.metrics if key in m["data"]]

    def last(self) -> dict:
        return self.metrics[-1]["data"] if self.metrics else {}


def _recipe_launch(
    cluster: RayCluster, workdir: Path, overrides: list[str], name: str, metrics_name: str | None, log_env: dict | None
) -> tuple[list[str], dict[str, str], Path, Path]:
    """Command, environment, metrics path and console-log path of one recipe run (see :func:`run_recipe`)."""
    from gtpo.cpu import env as cpu_env

    workdir.mkdir(parents=True, exist_ok=True)
    cluster.wait_until_free()
    metrics_path = workdir / f"{metrics_name or name}.metrics.jsonl"
    log_path = workdir / f"{name}.log"
    env = cpu_env(base=dict(os.environ))  # modules the caller's environment names stay (a test's own method)
    env["RAY_ADDRESS"] = cluster.address
    env.update(cluster.auth_env)
    env["PYTHONUNBUFFERED"] = "1"
    log_env = {"VERL_FILE_LOGGER_PATH": str(metrics_path)} if log_env is None else log_env
    cmd = [
        PYTHON, "-m", "recipe.gtpo.main_gtpo",
        "backend=cpu_tiny",
        "ray_kwargs.ray_init.num_cpus=null",
        "ray_kwargs.ray_init.num_gpus=null",
        "trainer.logger=[console,file]",
        *(f"+ray_kwargs.ray_init.runtime_env.env_vars.{k}={v}" for k, v in log_env.items()),
        f"hydra.run.dir={workdir / 'hydra'}",
        *overrides,
    ]  # fmt: skip
    return cmd, env, metrics_path, log_path


def read_metrics(path: Path) -> list[dict]:
    """Every line of a file-logger JSONL, in file order (repeated steps included); a partial last line is left out."""
    if not path.exists():
        return []
    records = []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise
    return records


def run_recipe(
    cluster: RayCluster,
    workdir: Path,
    overrides: list[str],
    timeout: float = 600.0,
    name: str = "run",
    metrics_name: str | None = None,
    log_env: dict[str, str] | None = None,
) -> RunResult:
    """Run the recipe's entry point with the CPU backend as a separate Ray job; return its logged metrics.

    ``metrics_name`` (default ``name``) names the file logger's JSONL, so a resumed run can share its first run's
    log; ``log_env`` replaces the default ``VERL_FILE_LOGGER_PATH`` (e.g. ``VERL_FILE_LOGGER_ROOT`` for verl's
    default path); ``metrics`` then stays empty.
    """
    cmd, env, metrics_path, log_path = _recipe_launch(cluster, workdir, overrides, name, metrics_name, log_env)
    with open(log_path, "wb") as log:
        try:
            proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
            returncode = proc.returncode
        except subprocess.TimeoutExpired:
            returncode = -9
    return RunResult(returncode=returncode, log_path=log_path, metrics=read_metrics(metrics_path))


class RunningRecipe:
    """A recipe run started in the background, to be killed hard (:meth:`kill_job`) while it trains."""

    def __init__(self, cluster: RayCluster, workdir: Path, overrides: list[str], name: str, log_env: dict | None):
        cmd, env, self.metrics_path, self.log_path = _recipe_launch(cluster, workdir, overrides, name, None, log_env)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in kill_job
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_until(self, condition, timeout: float, poll: float = 0.2) -> None:
        """Poll ``condition()`` until true; raises if the run exits first or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"run exited (rc={self.proc.returncode}) before the condition:\n{tail(self.log)}")
            time.sleep(poll)
        raise TimeoutError(f"condition not met after {timeout} s:\n{tail(self.log)}")

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def job_pids(self) -> set[int]:
        """Pids of the job's Ray workers (actors and tasks): Ray prefixes their forwarded output with ``pid=N``."""
        pids = {int(p) for p in re.findall(r"\bpid=(\d+)", self.log)}
        alive = set()
        for pid in pids:
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if cmdline.startswith(b"ray::"):  # a Ray worker's process title, never the raylet or the GCS
                alive.add(pid)
        return alive

    def kill_job(self, timeout: float = 60.0) -> set[int]:
        """``kill -9`` the driver and every worker process of the job; wait until they are gone."""
        workers = self.job_pids()
        self.proc.kill()
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=timeout)
        self._log.close()
        deadline = time.monotonic() + timeout
        while any(Path(f"/proc/{pid}").exists() for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        return workers


def process_ids(title_prefix: str) -> list[int]:
    """Pids of this host's processes whose command line starts with ``title_prefix`` (a Ray worker's process title
    is ``ray::<class>.<method>``)."""
    out = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if (proc / "cmdline").read_bytes().startswith(title_prefix.encode()):
                    out.append(int(proc.name))
            except OSError:
                continue
    return sorted(out)


def actor_table() -> dict[str, dict]:
    """Every actor the cluster's GCS knows, alive or dead, by actor id: ``class``, ``node`` (id), ``state``, ``pid``.

    Read in a process connected to the cluster (the ``ray_session`` fixture). Ray's public state API
    (``ray.util.state``) reads the same table through the dashboard, which the test cluster does not start.
    """
    from ray._private import state

    return {
        actor_id: {
            "class": info["ActorClassName"].rsplit(".", 1)[-1],
            "node": info["Address"]["NodeID"],
            "state": info["State"],
            "pid": info["Pid"],
        }
        for actor_id, info in state.actors().items()
    }


def placement(before: dict[str, dict]) -> dict[str, list[str]]:
    """``{actor class: [node id of each actor]}`` of the actors created since ``before`` (an :func:`actor_table`)."""
    out: dict[str, list[str]] = {}
    for actor_id, info in actor_table().items():
        if actor_id not in before:
            out.setdefault(info["class"], []).append(info["node"])
    return out


def shard_names(actor_dir: Path) -> list[str]:
    """The FSDP shard files of a checkpoint's ``actor/`` folder, sorted."""
    return sorted(p.name for p in actor_dir.glob("*_world_size_*_rank_*.pt"))


def tail(text: str, n: int = 60) -> str:
    return "\n".join(text.splitlines()[-n:])


def base_overrides(assets) -> list[str]:
    """A run on ``assets`` (gtpo.cpu's tiny model, tokenizer and data) rewarded by :data:`COIN_REWARD`."""
    return [
        f"actor_rollout_ref.model.path={assets.model_dir}",
        f"actor_rollout_ref.model.tokenizer_path={assets.tokenizer_dir}",
        f"data.train_files={assets.train_parquet}",
        f"data.val_files={assets.val_parquet}",
        f"reward.custom_reward_function.path={COIN_REWARD}",
        "reward.custom_reward_function.name=compute_score",
        "actor_rollout_ref.actor.optim.lr=1e-3",
    ]


def assert_ran(result: RunResult, steps: int):
    """The run ended with rc 0, its last ``steps`` steps logged in order, every recipe metric finite."""
    assert result.returncode == 0, f"trainer failed (rc={result.returncode}):\n{tail(result.log)}"
    assert result.steps()[-steps:] == list(range(result.steps()[-1] - steps + 1, result.steps()[-1] + 1))
    for entry in result.metrics:
        for key, value in entry["data"].items():
            if key.startswith(("gtpo/", "grpo_s/", "gtpo_traj/", "forking/", "actor/forking/")) and value is not None:
                assert math.isfinite(float(value)), f"step {entry['step']}: {key}={value}"
