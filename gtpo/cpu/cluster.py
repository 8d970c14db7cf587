"""A Ray cluster of several simulated nodes on one CPU host, with the CPU backend's environment in every raylet.

    python -m gtpo.cpu.cluster start --nodes 2          # prints the address; export RAY_ADDRESS=<it>
    RAY_ADDRESS=127.0.0.1:6390 python -m gtpo.cpu.demo --nnodes 2 --steps 20
    python -m gtpo.cpu.cluster stop                    # this cluster's processes only, never `ray stop`

Each node is its own raylet (``ray start``: a head, then ``ray start --address`` for every further node), with
``gpus_per_node`` logical GPUs that the CPU platform (:mod:`gtpo.cpu.platform`) turns into CPU workers. verl then
places its resource pool as on a real cluster: one placement group per node, ``trainer.nnodes`` ×
``trainer.n_gpus_per_node`` FSDP ranks, one vLLM replica per ``tensor_model_parallel_size`` GPUs, ``LOCAL_RANK`` 0
on every node.

Workers of a running cluster do not inherit a driver's shell, so each raylet starts with :func:`gtpo.cpu.env`'s
variables (``VERL_PLATFORM=cpu`` and the platform module; without them a worker would pick verl's CUDA platform),
but *without* the recipe's plugin list: the entry point puts ``gtpo.verl_plugin.register`` into the job's runtime
env, as on a multi-node cluster whose nodes were started before the job. Join such a cluster with
``ray_kwargs.ray_init.num_cpus=null ray_kwargs.ray_init.num_gpus=null`` (``ray.init`` refuses resources when it
connects to an existing cluster); the demo does that itself when ``RAY_ADDRESS`` is set.

Like every cluster the recipe starts, it requires Ray's token (``RAY_AUTH_MODE=token``): a fresh random token in a
folder only this user can read (:func:`gtpo.private_files.write_ray_token`), its path in every raylet's environment
(:func:`cluster_env`), and in the environment of every driver or client that joins: ``start`` prints the two
variables. The nodes are started on 127.0.0.1, but Ray 2.60 resolves a loopback address to the host's routable one
(``ray._private.services.resolve_ip_for_localhost``) and its GCS listens on every interface: the cluster is reachable
from the network, and the token is what keeps others out.

``stop`` ends the processes of the clusters ``start`` recorded (each node's ``ray start`` runs in a session of its
own; a process counts when it is this user's, in such a session and carries the cluster's token path) and removes
their tokens; ``ray stop`` would end every Ray process of the host, another user's training run included. The tests
own their cluster's processes (:func:`node_command` with ``block=True``); ``start`` / ``stop`` here are for a person
trying the CPU backend on several nodes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gtpo.private_files import check_private_dir, private_dir, ray_token_env, write_ray_token

__all__ = [
    "cluster_env", "cluster_processes", "free_port", "new_token", "node_command", "ray_executable", "start", "stop",
    "wait_for_nodes",
]  # fmt: skip

# Logical CPUs per node: verl's placement bundles ask for several CPUs per worker, more than a 2-core host has.
CPUS_PER_NODE = 8
# Plasma store per node (Ray's default is 30 % of the memory, per raylet): the tiny runs move kilobytes.
OBJECT_STORE_BYTES = 512 * 1024**2


def ray_executable() -> str:
    """The ``ray`` command of this Python environment."""
    return str(Path(sys.executable).with_name("ray"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def new_token(folder: str | os.PathLike) -> Path:
    """A fresh token for a cluster in ``folder/auth/token`` (the folder private, an older token replaced)."""
    auth = private_dir(Path(folder) / "auth", "the Ray token folder")
    with contextlib.suppress(FileNotFoundError):
        (auth / "token").unlink()
    return write_ray_token(auth)


def cluster_env(token_path: str | os.PathLike, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of every raylet, and of the probes that ask it: the CPU backend's variables, the cluster's token
    (``RAY_AUTH_MODE=token``, ``RAY_AUTH_TOKEN_PATH``; a token *value* inherited from ``base`` is dropped), no plugin
    list, no ``RAY_ADDRESS``."""
    from gtpo.cpu import env as cpu_env

    out = cpu_env(base=dict(os.environ) if base is None else base)
    out.pop("VERL_USE_EXTERNAL_MODULES", None)
    out.pop("RAY_ADDRESS", None)
    out.pop("RAY_AUTH_TOKEN", None)
    out.update(ray_token_env(token_path))
    return out


def node_command(
    *,
    head_port: int,
    head: bool,
    gpus: int,
    cpus: int = CPUS_PER_NODE,
    temp_dir: str | os.PathLike | None = None,
    block: bool = False,
) -> list[str]:
    """``ray start`` of the head (``head=True``) or of a further node joining ``127.0.0.1:<head_port>``."""
    if gpus < 0 or cpus < 1:
        raise ValueError(f"gpus={gpus}, cpus={cpus}: a node needs gpus >= 0 and cpus >= 1")
    common = [
        "--node-ip-address=127.0.0.1", f"--num-cpus={cpus}", f"--num-gpus={gpus}",
        f"--object-store-memory={OBJECT_STORE_BYTES}", "--disable-usage-stats",
    ]  # fmt: skip
    if head:
        cmd = [ray_executable(), "start", "--head", f"--port={head_port}", "--include-dashboard=false", *common]
    else:
        cmd = [ray_executable(), "start", f"--address=127.0.0.1:{head_port}", *common]
    if temp_dir is not None:
        # A folder of each node's own: two raylets sharing one session folder would each forward every worker's
        # output to the driver (every log line twice).
        cmd.append(f"--temp-dir={temp_dir}")
    if block:
        cmd.append("--block")
    return cmd


def alive_nodes(address: str, token_path: str | os.PathLike) -> int:
    """Number of alive nodes of the cluster at ``address`` (0 when it does not answer)."""
    probe = subprocess.run(
        [sys.executable, "-c", _COUNT_NODES, address],
        capture_output=True, text=True, env=cluster_env(token_path), timeout=120,
    )  # fmt: skip
    try:
        return int(probe.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return 0


_COUNT_NODES = """
import sys, ray
ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
print(sum(1 for n in ray.nodes() if n["Alive"]))
"""


def wait_for_nodes(
    address: str, nodes: int, token_path: str | os.PathLike, timeout: float = 180.0, procs: list | None = None
) -> None:
    """Wait until ``nodes`` nodes of the cluster at ``address`` are alive; raises naming what is missing."""
    deadline = time.monotonic() + timeout
    seen = 0
    while time.monotonic() < deadline:
        for proc in procs or ():
            if proc.poll() is not None:
                raise RuntimeError(f"a ray node process exited with {proc.returncode}: {proc.args}")
        seen = alive_nodes(address, token_path)
        if seen >= nodes:
            return
        time.sleep(2)
    raise TimeoutError(f"the Ray cluster at {address} has {seen} of {nodes} nodes alive after {timeout:.0f} s")


def start(nodes: int = 2, gpus_per_node: int = 1, port: int | None = None) -> tuple[str, Path]:
    """Start a head and ``nodes - 1`` further nodes in the background; returns the cluster's address and the path
    of its token. Each node's ``ray start`` runs in a session of its own, whose id is recorded in the cluster's
    folder (:data:`SESSIONS_FILE`): :func:`stop` ends those processes and no others."""
    if nodes < 1 or gpus_per_node < 1:
        raise ValueError(f"nodes={nodes}, gpus_per_node={gpus_per_node}: both must be >= 1")
    port = port or free_port()
    # Short (Ray's socket paths must fit in 107 bytes) and predictable, so it must be ours and private: it holds the
    # nodes' sockets and the token.
    root = private_dir(cluster_folder(port), "the Ray cluster folder")
    token_path = new_token(root)
    env = cluster_env(token_path)
    sessions = []
    for i in range(nodes):
        cmd = node_command(head_port=port, head=i == 0, gpus=gpus_per_node, temp_dir=root / f"n{i}")
        # its own session: the node's daemons and workers keep its id after `ray start` returns
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)  # fmt: skip
        sessions.append(proc.pid)
        _record_sessions(root, port, sessions)
        out, err = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed ({proc.returncode}):\n{out[-2000:]}{err}")
    address = f"127.0.0.1:{port}"
    wait_for_nodes(address, nodes, token_path)
    return address, token_path


# The record of a cluster started here: its port and the session id of each node's `ray start`.
SESSIONS_FILE = "sessions.json"


def cluster_folder(port: int) -> Path:
    """The private folder of the cluster on ``port``: its nodes' session folders, its token, its record."""
    return Path(tempfile.gettempdir()) / f"gtpo-ray-{port}"


def _record_sessions(root: Path, port: int, sessions: list[int]) -> None:
    (root / SESSIONS_FILE).write_text(json.dumps({"port": port, "sessions": sessions}))


def _session_of(pid: int) -> int | None:
    """The session id of process ``pid`` (``/proc/<pid>/stat``, field 6), or None when it is gone."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat_line.rpartition(")")[2].split()[3])  # after the command name, which may hold spaces


def cluster_processes(root: Path) -> list[int]:
    """The processes of the cluster recorded in ``root``: this user's, in a recorded session, and started with this
    cluster's token path in their environment (a session id the kernel gave to a later, unrelated process does not
    qualify)."""
    try:
        sessions = set(json.loads((root / SESSIONS_FILE).read_text())["sessions"])
    except (OSError, ValueError, KeyError):
        return []
    marker = f"RAY_AUTH_TOKEN_PATH={root / 'auth' / 'token'}\0".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        pid = int(entry.name)
        try:
            if entry.stat().st_uid != os.getuid() or _session_of(pid) not in sessions:
                continue
            if marker in (entry / "environ").read_bytes():
                found.append(pid)
        except OSError:
            continue  # gone meanwhile
    return found


def stop(port: int | None = None, grace_s: float = 30.0) -> list[int]:
    """Stop the clusters :func:`start` recorded (the one on ``port``, else every one of this user's): SIGTERM to
    their processes, SIGKILL to those left after ``grace_s``; their tokens are removed. Never ``ray stop``, which
    ends every Ray process of the host, other users' and other clusters' included. Returns the ports stopped."""
    roots = [cluster_folder(port)] if port else sorted(Path(tempfile.gettempdir()).glob("gtpo-ray-*"))
    stopped = []
    for root in roots:
        try:
            check_private_dir(root, "the Ray cluster folder")  # what others planted is neither read nor obeyed
            recorded = json.loads((root / SESSIONS_FILE).read_text())
        except (OSError, ValueError):
            continue
        pids = cluster_processes(root)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 10.0)
            while pids and time.monotonic() < deadline:
                time.sleep(0.2)
                pids = [pid for pid in pids if _session_of(pid) is not None and not _is_zombie(pid)]
            if not pids:
                break
        shutil.rmtree(root / "auth", ignore_errors=True)
        (root / SESSIONS_FILE).unlink(missing_ok=True)
        stopped.append(int(recorded.get("port", 0)))
    return stopped


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gtpo.cpu.cluster", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    start_p = sub.add_parser("start", help="start a head and further simulated nodes on this host")
    start_p.add_argument("--nodes", type=int, default=2, help="number of nodes, the head included (default 2)")
    start_p.add_argument("--gpus-per-node", type=int, default=1, help="logical GPUs per node (default 1)")
    start_p.add_argument("--port", type=int, default=None, help="the head's port (default: a free one)")
    stop_p = sub.add_parser("stop", help="stop the clusters `start` started (never another Ray process of this host)")
    stop_p.add_argument("--port", type=int, default=None, help="only the cluster on this port (default: every one)")
    args = parser.parse_args(argv)
    if args.command == "stop":
        ports = stop(args.port)
        print(f"stopped the Ray cluster(s) at {', '.join(f'127.0.0.1:{p}' for p in ports)}" if ports else
              "no Ray cluster started by `python -m gtpo.cpu.cluster start` is recorded here")  # fmt: skip
        return 0
    try:
        address, token_path = start(args.nodes, args.gpus_per_node, args.port)
    except (RuntimeError, TimeoutError, ValueError, OSError) as e:
        print(f"gtpo.cpu.cluster: {e}", file=sys.stderr)
        return 1
    print(f"Ray cluster of {args.nodes} nodes x {args.gpus_per_node} GPU at {address}")
    print(f"export RAY_ADDRESS={address} RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={token_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
