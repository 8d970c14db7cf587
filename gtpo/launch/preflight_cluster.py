"""Preflight checks 9-12 (:mod:`gtpo.launch.preflight`): the cluster the run will meet, from each node's report.

:func:`node_report` runs once on every node (a Ray task pinned to it; :class:`RayCluster`) or on this machine alone
(:class:`LocalCluster`, no ``RAY_ADDRESS``); the checks read the reports: ``ray cluster`` (GPU nodes and GPUs per
node against ``trainer.nnodes`` x ``trainer.n_gpus_per_node`` and the standalone rollout pool, on nodes of its own or
sharing the trainer's where both fit, no loopback node),
``checkpoint shared`` (every node reads the token file back), ``driver`` (NVIDIA driver major >=
``MIN_DRIVER_VERSION``), ``interfaces`` (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``, ``RAY_NETWORK_INTERFACE``
with a non-loopback IPv4 address on every node).
"""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from gtpo.launch.preflight_checks import PreflightError

__all__ = ["LocalCluster", "RayCluster", "node_report", "check_cluster", "check_shared", "check_driver",
           "check_interfaces", "wanted_interfaces", "MIN_DRIVER_VERSION", "NODE_TIMEOUT_S"]  # fmt: skip

MIN_DRIVER_VERSION = 580
NODE_TIMEOUT_S = 120.0


def _ipv4_of(interface: str) -> str | None:
    """IPv4 address of a network interface (Linux SIOCGIFADDR), or None."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", interface[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def node_report(token_path: str | None, interfaces: Sequence[str]) -> dict[str, Any]:
    """Facts about the node this runs on: driver, GPU count, interface addresses, the checkpoint token's content."""

    def smi(*args: str) -> list[str]:
        try:
            out = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return []
        return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []

    token: str | None = None
    if token_path:
        try:
            token = Path(token_path).read_text()
        except OSError as err:
            token = f"<unreadable: {err.strerror}>"
    drivers = smi("--query-gpu=driver_version", "--format=csv,noheader")
    return {
        "node": socket.gethostname(),
        "driver": drivers[0] if drivers else None,
        "gpus": sum(1 for line in smi("-L") if line.startswith("GPU ")),
        "interfaces": {name: _ipv4_of(name) for name in interfaces},
        "token": token,
    }


class LocalCluster:
    """This machine only (no RAY_ADDRESS): a single-node run."""

    remote = False

    def nodes(self) -> list[dict[str, Any]]:
        report = node_report(None, [])
        return [{"node": report["node"], "address": None, "gpus": report["gpus"]}]

    def run_on_each(self, nodes: list[dict[str, Any]], fn: Callable[..., dict], *args: Any) -> list[dict]:
        return [fn(*args)]


class RayCluster:
    """The running Ray cluster at ``address``: GPU node list from ``ray.nodes()``, tasks pinned to each node."""

    remote = True

    def __init__(self, address: str):
        import ray

        if not ray.is_initialized():
            ray.init(address=address, log_to_driver=False, logging_level="ERROR")
        self._ray = ray

    def nodes(self) -> list[dict[str, Any]]:
        return [
            {
                "node": n.get("NodeManagerHostname") or n["NodeManagerAddress"],
                "address": n["NodeManagerAddress"],
                "gpus": int(n.get("Resources", {}).get("GPU", 0)),
                "id": n["NodeID"],
            }
            for n in self._ray.nodes()
            if n.get("Alive")
        ]

    def run_on_each(self, nodes: list[dict[str, Any]], fn: Callable[..., dict], *args: Any) -> list[dict]:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        task = self._ray.remote(num_cpus=0)(fn)
        refs = [
            task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=n["id"], soft=False)).remote(*args)
            for n in nodes
        ]
        try:
            return self._ray.get(refs, timeout=NODE_TIMEOUT_S)
        except self._ray.exceptions.GetTimeoutError:
            raise PreflightError("ray cluster", f"a node did not answer within {NODE_TIMEOUT_S:.0f} s") from None


def check_cluster(cfg: DictConfig, nodes: list[dict[str, Any]], remote: bool) -> str:
    """The GPU nodes against the trainer's pool and, under separate_async, the standalone rollout pool: each pool's
    nodes of their own (``trainer.nnodes`` + ``rollout.nnodes`` GPU nodes), or fewer nodes that hold both side by
    side (verl checks the total only; one 8-GPU node split 4 + 4 is its fully-async examples' layout)."""
    from gtpo.launch.batch_checks import rollout_pool

    trainer_nodes, want_gpus = int(cfg.trainer.nnodes), int(cfg.trainer.n_gpus_per_node)
    pool_nodes, pool_gpus = rollout_pool(cfg) or (0, 0)
    want_nodes = trainer_nodes + pool_nodes
    wanted = f"trainer.nnodes={trainer_nodes}"
    if pool_nodes:
        wanted += (
            f" + actor_rollout_ref.rollout.nnodes={pool_nodes} = {want_nodes} (separate_async: the standalone rollout "
            "pool has nodes of its own; under Slurm pass actor_rollout_ref.rollout.nnodes to the sbatch, which gives "
            "the trainer the allocation minus the pool)"
        )
    for node in nodes:
        if node["address"] and str(node["address"]).startswith("127."):
            raise PreflightError("ray cluster", f"node {node['node']} joined on loopback address {node['address']}")
    gpu_nodes = [n for n in nodes if n["gpus"] > 0]
    if pool_nodes and len(gpu_nodes) < want_nodes:
        return _check_shared_nodes(gpu_nodes, trainer_nodes, want_gpus, pool_nodes, pool_gpus, wanted, remote, nodes)
    if not remote and want_nodes > 1:
        raise PreflightError("ray cluster", f"{wanted} but RAY_ADDRESS is unset: run on the cluster")
    if len(gpu_nodes) != want_nodes:
        raise PreflightError(
            "ray cluster", f"{len(gpu_nodes)} GPU node(s) {[n['node'] for n in gpu_nodes]} != {wanted}"
        )
    # The trainer's pool takes the nodes with the most GPUs; the rollout pool the rest.
    ranked = sorted(gpu_nodes, key=lambda n: -n["gpus"])
    for node in ranked[:trainer_nodes]:
        if node["gpus"] < want_gpus:
            raise PreflightError(
                "ray cluster", f"node {node['node']} has {node['gpus']} GPU(s) < trainer.n_gpus_per_node={want_gpus}"
            )
    for node in ranked[trainer_nodes:]:
        if node["gpus"] < pool_gpus:
            raise PreflightError(
                "ray cluster",
                f"node {node['node']} has {node['gpus']} GPU(s) < "
                f"actor_rollout_ref.rollout.n_gpus_per_node={pool_gpus}",
            )
    shape = f"{trainer_nodes} GPU node(s) x >= {want_gpus} GPU(s)"
    if pool_nodes:
        shape += f" + rollout pool {pool_nodes} x >= {pool_gpus}"
    return shape + (f", {len(nodes)} node(s) in all" if remote else "")


def _check_shared_nodes(
    gpu_nodes: list[dict[str, Any]],
    trainer_nodes: int,
    want_gpus: int,
    pool_nodes: int,
    pool_gpus: int,
    wanted: str,
    remote: bool,
    nodes: list[dict[str, Any]],
) -> str:
    """Fewer GPU nodes than the two pools' nodes: they pass when the pools fit side by side. verl places each pool
    node's GPUs as one block on one node (a STRICT_PACK placement group), so the blocks must pack into the nodes."""
    blocks = [want_gpus] * trainer_nodes + [pool_gpus] * pool_nodes
    free = [n["gpus"] for n in gpu_nodes]
    if not _packs(sorted(blocks, reverse=True), free):
        have = f"{len(gpu_nodes)} GPU node(s) {[n['node'] for n in gpu_nodes]}"
        raise PreflightError(
            "ray cluster",
            f"{have} != {wanted}, nor do they hold both pools side by side: trainer {trainer_nodes} x {want_gpus} "
            f"GPU(s) + rollout pool {pool_nodes} x {pool_gpus} GPU(s) (each pool node's GPUs on one node) on nodes of "
            f"{free} GPU(s)" + ("" if remote else "; RAY_ADDRESS is unset: run on the cluster"),
        )
    shape = (
        f"{trainer_nodes} x {want_gpus} GPU(s) + rollout pool {pool_nodes} x {pool_gpus} sharing "
        f"{len(gpu_nodes)} GPU node(s) of {free} GPU(s)"
    )
    return shape + (f", {len(nodes)} node(s) in all" if remote else "")


def _packs(blocks: list[int], free: list[int]) -> bool:
    """Whether every block (largest first) fits whole into one node's free GPUs (exact search; a few blocks)."""
    if not blocks:
        return True
    tried = set()
    for i, room in enumerate(free):
        if room >= blocks[0] and room not in tried:
            tried.add(room)  # nodes with the same room left are interchangeable
            if _packs(blocks[1:], free[:i] + [room - blocks[0]] + free[i + 1 :]):
                return True
    return False


def check_shared(reports: list[dict[str, Any]], token: str, path: Path) -> str:
    for report in reports:
        if report["token"] != token:
            raise PreflightError(
                "checkpoint shared",
                f"node {report['node']} reads {path} as {report['token']!r}, not what this node wrote: "
                "trainer.default_local_dir must be on storage every node shares",
            )
    return f"{len(reports)} node(s) read {path.parent}"


def check_driver(reports: list[dict[str, Any]], minimum: int) -> str:
    """Every node the cluster lists with GPUs (a GPU-less head, as in the RayJob, has no driver to check)."""
    if minimum <= 0:
        return "MIN_DRIVER_VERSION=0: not checked"
    reports = [r for r in reports if r["cluster_gpus"] > 0]
    for report in reports:
        driver = report["driver"] or ""
        major = driver.split(".", 1)[0]
        if not major.isdigit():
            raise PreflightError("driver", f"node {report['node']}: no NVIDIA driver answered (nvidia-smi)")
        if int(major) < minimum:
            raise PreflightError(
                "driver", f"node {report['node']}: NVIDIA driver {driver} < {minimum} (the image's CUDA 13.0)"
            )
    return ", ".join(sorted({str(r["driver"]) for r in reports})) + f" >= {minimum}"


def _single_name(value: str) -> bool:
    return bool(value) and "," not in value and not value.startswith("^")


def wanted_interfaces(env: dict[str, str]) -> list[str]:
    """Interface names every node must have: Gloo's, NCCL's (unless an exclusion list), Ray's."""
    gloo, nccl = env.get("GLOO_SOCKET_IFNAME", ""), env.get("NCCL_SOCKET_IFNAME", "")
    names = [gloo if _single_name(gloo) else "", env.get("RAY_NETWORK_INTERFACE", "")]
    if nccl and not nccl.startswith("^"):
        names += nccl.lstrip("=").split(",")
    return sorted({n for n in names if n})


def check_interfaces(reports: list[dict[str, Any]], names: list[str], env: dict[str, str]) -> str:
    gloo = env.get("GLOO_SOCKET_IFNAME", "")
    if gloo and not _single_name(gloo):
        raise PreflightError("interfaces", f"GLOO_SOCKET_IFNAME={gloo}: Gloo needs one interface name")
    if not names:
        return "none set (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME, RAY_NETWORK_INTERFACE)"
    for report in reports:
        for name in names:
            addr = report["interfaces"].get(name)
            if not addr or addr.startswith("127."):
                raise PreflightError(
                    "interfaces", f"node {report['node']}: interface {name} has {addr or 'no'} IPv4 address"
                )
    return f"{', '.join(names)} on {len(reports)} node(s)"
