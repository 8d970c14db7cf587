"""Preflight: what breaks a first cluster run before any GPU work, checked on the cluster in seconds.

``PREFLIGHT=1 bash scripts/run_<method>_qwen2.5_<size>.sh`` (on the Ray head, inside the sbatch before training, or
submitted as a Ray job) runs :func:`main` with the launch script's overrides instead of the trainer. The dry run
(:mod:`gtpo.verl_plugin.dry_run`) checks arithmetic on a laptop; the preflight checks the cluster the run will
meet, one line per check, stopping at the first failure (exit status 1):

1. ``config``: the recipe's knob validation and the whole dry run (resolution, registries, batch plan, verl's
   ``validate_config``), on the same composed config, the checkpoint engine's transport importable here
   (cupy for ``nccl``), and no CPU test backend (``VERL_PLATFORM=cpu``, ``gtpo.cpu`` modules) unless
   ``trainer.device=cpu``; the startup notes follow as ``note`` lines;
2. ``overlong buffer``: with DAPO's soft overlong punishment on, ``0 < len < max_resp_len`` (else every token of
   every response is penalised);
3. ``train data`` / ``val data``: every file exists, is a parquet file with rows and the ``data.prompt_key`` column;
4. ``run length``: ``trainer.total_epochs`` epochs of the training rows hold ``trainer.total_training_steps`` steps
   (verl stops at whichever comes first);
5. ``model``: ``actor_rollout_ref.model.path`` is a local folder (not a hub id) with ``config.json``
   (``max_position_embeddings >= max_prompt_length + max_response_length``), tokenizer files and weights;
6. ``trackers``: ``wandb`` in ``trainer.logger`` needs ``WANDB_API_KEY`` or ``WANDB_MODE=offline|disabled``; a
   ``warn`` line (not a failure) for ``file`` / ``tensorboard`` writing to a relative folder
   (``VERL_FILE_LOGGER_ROOT`` / ``VERL_FILE_LOGGER_PATH``, ``TENSORBOARD_DIR``, from the Ray runtime env or this
   environment): verl's TaskRunner resolves it in its working directory, a Ray session's scratch folder on
   whichever node it starts, so the log is lost with the session and a resume finds no history to keep;
7. ``checkpoint cadence``: ``trainer.save_freq > 0`` (a Slurm time limit or a crash otherwise loses every step);
8. ``checkpoint dir``: ``trainer.default_local_dir`` is writable here (a token file is written, removed at the end);
9. ``ray cluster``: the GPU nodes and their GPUs match ``trainer.nnodes`` x ``trainer.n_gpus_per_node``, plus
   ``actor_rollout_ref.rollout.nnodes`` x ``n_gpus_per_node`` under separate_async, no node on a loopback address
   (RAY_ADDRESS set: the Ray cluster; unset: this machine through ``nvidia-smi -L``);
10. ``checkpoint shared``: every node reads the token file back with the same content;
11. ``driver``: every node's NVIDIA driver major version >= ``MIN_DRIVER_VERSION`` (580: the image's CUDA 13.0);
12. ``interfaces``: ``GLOO_SOCKET_IFNAME`` (one name), ``NCCL_SOCKET_IFNAME`` (unless a ``^`` exclusion list) and
    ``RAY_NETWORK_INTERFACE`` exist on every node with a non-loopback IPv4 address.

Node-side facts come from :func:`node_report`, run once on every node (a Ray task pinned to each node). The module
is over 400 lines because the twelve checks and their messages belong together; each is a short function.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

__all__ = ["LocalCluster", "PreflightError", "RayCluster", "main", "node_report", "run_preflight"]

MIN_DRIVER_VERSION = 580
NODE_TIMEOUT_S = 120.0


class PreflightError(Exception):
    """A failed check: ``item`` names it, the message says what is wrong and with which value."""

    def __init__(self, item: str, message: str):
        super().__init__(f"{item}: {message}")
        self.item = item


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


def _as_list(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value]


def _check_config(cfg: DictConfig, env: dict[str, str]) -> str:
    from gtpo.verl_plugin.async_checks import check_checkpoint_engine
    from gtpo.verl_plugin.dry_run import run_dry
    from gtpo.verl_plugin.startup_checks import check_cpu_backend
    from gtpo.verl_plugin.validation import validate_recipe_config

    try:
        validate_recipe_config(cfg)
        with contextlib.redirect_stdout(io.StringIO()) as out:
            run_dry(cfg)
        check_checkpoint_engine(cfg)
        check_cpu_backend(cfg, env)
    except ValueError as err:
        raise PreflightError("config", str(err)) from None
    summary = [line for line in out.getvalue().splitlines() if line.startswith("[dry run] resources")]
    return summary[0].removeprefix("[dry run] resources: ") if summary else "dry run passed"


def _check_overlong(cfg: DictConfig) -> str:
    from gtpo.verl_plugin.validation import check_overlong_shaping

    buffer = OmegaConf.select(cfg, "reward.reward_kwargs.overlong_buffer_cfg")
    if not buffer or not buffer.get("enable", False):
        return "soft overlong punishment off"
    try:
        check_overlong_shaping(cfg)
    except ValueError as err:
        raise PreflightError("overlong buffer", str(err)) from None
    return f"len={buffer.get('len')} < max_resp_len={OmegaConf.select(cfg, 'reward.reward_kwargs.max_resp_len')}"


def _parquet_rows(files: list[str]) -> int:
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(path).metadata.num_rows for path in files)


def _check_run_length(cfg: DictConfig, rows: int) -> str:
    """verl runs min(total_epochs x (rows // train_batch_size), total_training_steps) steps."""
    batch, epochs = int(cfg.data.train_batch_size), int(cfg.trainer.total_epochs)
    steps = cfg.trainer.get("total_training_steps", None)
    cap = int(cfg.data.get("train_max_samples", -1) or -1)
    rows = min(rows, cap) if cap > 0 else rows
    per_epoch = rows // batch
    if per_epoch == 0:
        raise PreflightError(
            "run length", f"data.train_files hold {rows} prompts < data.train_batch_size={batch}: no training step"
        )
    if steps is None:
        return f"trainer.total_epochs={epochs} x {per_epoch} steps per epoch = {epochs * per_epoch} steps"
    if epochs * per_epoch < int(steps):
        raise PreflightError(
            "run length",
            f"trainer.total_training_steps={steps} but trainer.total_epochs={epochs} x {rows} // {batch} = "
            f"{epochs * per_epoch} steps: verl stops at the first of the two, and without the last step's checkpoint "
            f"and validation; raise trainer.total_epochs to at least {-(-int(steps) // per_epoch)} (or drop the "
            "override)",
        )
    return f"trainer.total_training_steps={steps} ({per_epoch} steps per epoch, total_epochs={epochs})"


def _check_parquet(item: str, key: str, files: list[str], prompt_key: str) -> str:
    import pyarrow.parquet as pq

    if not files:
        raise PreflightError(item, f"{key} is empty")
    rows = 0
    for path in files:
        if not Path(path).is_file():
            raise PreflightError(item, f"{key}: {path} does not exist on this node")
        try:
            parquet = pq.ParquetFile(path)
        except Exception as err:  # pyarrow raises ArrowInvalid, OSError, ...
            raise PreflightError(item, f"{key}: {path} is not a readable parquet file ({err})") from None
        if prompt_key not in parquet.schema_arrow.names:
            raise PreflightError(item, f"{key}: {path} has no column data.prompt_key={prompt_key!r}")
        if parquet.metadata.num_rows == 0:
            raise PreflightError(item, f"{key}: {path} has no rows")
        rows += parquet.metadata.num_rows
    return f"{len(files)} file(s), {rows} rows"


def _check_model(cfg: DictConfig) -> str:
    path = Path(str(cfg.actor_rollout_ref.model.path))
    key = f"actor_rollout_ref.model.path={path}"
    if not path.is_dir():
        raise PreflightError("model", f"{key} is not a local folder (download it once to shared storage)")
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise PreflightError("model", f"{key}: config.json unreadable ({err})") from None
    need = int(cfg.data.max_prompt_length) + int(cfg.data.max_response_length)
    positions = config.get("max_position_embeddings")
    if not isinstance(positions, int) or positions < need:
        raise PreflightError(
            "model", f"{key}: max_position_embeddings={positions} < max_prompt_length + max_response_length = {need}"
        )
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise PreflightError("model", f"{key}: no tokenizer files")
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise PreflightError("model", f"{key}: no weights (*.safetensors / *.bin)")
    return f"{path} (max_position_embeddings={positions} >= {need})"


def _check_trackers(cfg: DictConfig, env: dict[str, str]) -> str:
    loggers = _as_list(OmegaConf.select(cfg, "trainer.logger"))
    if "wandb" not in loggers:
        return f"trainer.logger={loggers}"
    mode = env.get("WANDB_MODE", "")
    if mode in ("offline", "disabled", "dryrun") or env.get("WANDB_API_KEY"):
        return f"wandb ({'WANDB_MODE=' + mode if mode else 'WANDB_API_KEY set'})"
    raise PreflightError(
        "trackers",
        f"trainer.logger={loggers} but WANDB_API_KEY is unset and WANDB_MODE={mode or '<unset>'}: wandb.init would "
        "fail or hang; set the key where Ray runs, WANDB_MODE=offline, or trainer.logger=[console,file]",
    )


def _log_dir_warnings(cfg: DictConfig, env: dict[str, str]) -> list[str]:
    """The ``file`` / ``tensorboard`` loggers of ``trainer.logger`` whose folder is relative (verl's defaults are)."""
    loggers = _as_list(OmegaConf.select(cfg, "trainer.logger"))
    runtime_env = OmegaConf.select(cfg, "ray_kwargs.ray_init.runtime_env.env_vars") or {}

    def value(var: str) -> str:
        # The runtime env is what the TaskRunner sees; the recipe's entry point copies this environment's there.
        return str(runtime_env.get(var) or env.get(var) or "")

    wanted = []
    if "file" in loggers:
        var = "VERL_FILE_LOGGER_PATH" if value("VERL_FILE_LOGGER_PATH") else "VERL_FILE_LOGGER_ROOT"
        wanted.append(("file", var, "."))
    if "tensorboard" in loggers:
        wanted.append(("tensorboard", "TENSORBOARD_DIR", "tensorboard_log/<project>/<experiment>"))
    warnings = []
    for logger_name, var, default in wanted:
        if not os.path.isabs(os.path.expanduser(value(var) or default)):
            shown = f"{var}={value(var)}" if value(var) else f"{var} unset (verl's default {default})"
            warnings.append(
                f"trainer.logger has {logger_name} but {shown} is relative: verl's TaskRunner resolves it in its "
                "working directory, a Ray session's scratch folder on whichever node it starts, so the log is lost "
                f"with the session and a resume finds no history; set {var} to shared storage (the launch scripts "
                "put it under CKPTS_DIR)"
            )
    return warnings


def _check_cluster(cfg: DictConfig, nodes: list[dict[str, Any]], remote: bool) -> str:
    from gtpo.verl_plugin.dry_run import rollout_pool

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
    if not remote and want_nodes > 1:
        raise PreflightError("ray cluster", f"{wanted} but RAY_ADDRESS is unset: run on the cluster")
    for node in nodes:
        if node["address"] and str(node["address"]).startswith("127."):
            raise PreflightError("ray cluster", f"node {node['node']} joined on loopback address {node['address']}")
    gpu_nodes = [n for n in nodes if n["gpus"] > 0]
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


def _check_shared(reports: list[dict[str, Any]], token: str, path: Path) -> str:
    for report in reports:
        if report["token"] != token:
            raise PreflightError(
                "checkpoint shared",
                f"node {report['node']} reads {path} as {report['token']!r}, not what this node wrote: "
                "trainer.default_local_dir must be on storage every node shares",
            )
    return f"{len(reports)} node(s) read {path.parent}"


def _check_driver(reports: list[dict[str, Any]], minimum: int) -> str:
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


def _wanted_interfaces(env: dict[str, str]) -> list[str]:
    """Interface names every node must have: Gloo's, NCCL's (unless an exclusion list), Ray's."""
    gloo, nccl = env.get("GLOO_SOCKET_IFNAME", ""), env.get("NCCL_SOCKET_IFNAME", "")
    names = [gloo if _single_name(gloo) else "", env.get("RAY_NETWORK_INTERFACE", "")]
    if nccl and not nccl.startswith("^"):
        names += nccl.lstrip("=").split(",")
    return sorted({n for n in names if n})


def _check_interfaces(reports: list[dict[str, Any]], names: list[str], env: dict[str, str]) -> str:
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


def run_preflight(cfg: DictConfig, cluster: Any, env: dict[str, str] | None = None, out=None) -> int:
    """Run every check in order; print one line each; return 0, or 1 at the first failure.

    Args:
        cfg: the composed (unresolved is fine) trainer config of the launch script.
        cluster: :class:`RayCluster`, :class:`LocalCluster`, or anything with ``remote``, ``nodes()`` and
            ``run_on_each(nodes, fn, *args)`` (``fn(*args)`` on each of ``nodes``, results in that order).
        env: the environment to judge (default ``os.environ``).
        out: stream for the report (default stdout).
    """
    from gtpo.verl_plugin.async_checks import startup_notes

    env = dict(os.environ if env is None else env)
    out = out or sys.stdout
    start = time.monotonic()
    token_file: Path | None = None
    passed = 0

    def line(status: str, item: str, detail: str) -> None:
        print(f"[preflight] {status:<4} {item}: {detail}", file=out, flush=True)

    def check(item: str, fn: Callable[[], str]) -> None:
        nonlocal passed
        line("ok", item, fn())
        passed += 1

    try:
        check("config", lambda: _check_config(cfg, env))
        resolved = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
        for note in startup_notes(resolved):
            print(f"[preflight] note {note}", file=out, flush=True)
        prompt_key = str(resolved.data.get("prompt_key", "prompt"))
        check("overlong buffer", lambda: _check_overlong(resolved))
        for item, key in (("train data", "data.train_files"), ("val data", "data.val_files")):
            files = _as_list(OmegaConf.select(resolved, key))
            check(item, lambda item=item, key=key, files=files: _check_parquet(item, key, files, prompt_key))
        train_rows = _parquet_rows(_as_list(resolved.data.train_files))
        check("run length", lambda: _check_run_length(resolved, train_rows))
        check("model", lambda: _check_model(resolved))
        check("trackers", lambda: _check_trackers(resolved, env))
        for warning in _log_dir_warnings(resolved, env):
            line("warn", "trackers", warning)

        def cadence() -> str:
            freq = int(resolved.trainer.save_freq)
            if freq <= 0:
                raise PreflightError("checkpoint cadence", f"trainer.save_freq={freq}: no checkpoint before the end")
            return f"every {freq} step(s), resume_mode={resolved.trainer.get('resume_mode')}"

        check("checkpoint cadence", cadence)
        ckpt_dir = Path(str(resolved.trainer.default_local_dir))
        token = uuid.uuid4().hex

        def writable() -> str:
            nonlocal token_file
            try:
                ckpt_dir.mkdir(parents=True, exist_ok=True)
                token_file = ckpt_dir / f".preflight-{token}"
                token_file.write_text(token)
            except OSError as err:
                raise PreflightError("checkpoint dir", f"trainer.default_local_dir={ckpt_dir}: {err}") from None
            return f"{ckpt_dir} writable"

        check("checkpoint dir", writable)
        nodes = cluster.nodes()
        check("ray cluster", lambda: _check_cluster(resolved, nodes, cluster.remote))
        interfaces = _wanted_interfaces(env)
        reports = cluster.run_on_each(nodes, node_report, str(token_file), interfaces)
        for node, report in zip(nodes, reports, strict=True):
            report["cluster_gpus"] = node["gpus"]
        check("checkpoint shared", lambda: _check_shared(reports, token, token_file))
        minimum = int(env.get("MIN_DRIVER_VERSION", MIN_DRIVER_VERSION))
        check("driver", lambda: _check_driver(reports, minimum))
        check("interfaces", lambda: _check_interfaces(reports, interfaces, env))
    except PreflightError as err:
        line("FAIL", err.item, str(err).removeprefix(f"{err.item}: "))
        return 1
    finally:
        if token_file is not None:
            token_file.unlink(missing_ok=True)
    print(f"[preflight] OK: {passed} checks passed in {time.monotonic() - start:.1f} s", file=out)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: ``python -m gtpo.verl_plugin.preflight override ...`` (the launch script's overrides)."""
    import verl  # noqa: F401  (loads VERL_USE_EXTERNAL_MODULES and verl.plugins entry points)

    import gtpo.verl_plugin.register  # noqa: F401
    from gtpo.verl_plugin.dry_run import compose_config

    overrides = list(sys.argv[1:] if argv is None else argv)
    cfg = compose_config(overrides)
    address = os.environ.get("RAY_ADDRESS", "")
    try:
        cluster = RayCluster(address) if address else LocalCluster()
    except Exception as err:  # ray.init raises ConnectionError and others
        print(f"[preflight] FAIL ray cluster: cannot connect to RAY_ADDRESS={address}: {err}", flush=True)
        return 1
    return run_preflight(cfg, cluster)


if __name__ == "__main__":
    sys.exit(main())
