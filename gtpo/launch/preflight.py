"""Preflight: what breaks a first cluster run before any GPU work, checked on the cluster in seconds.

``PREFLIGHT=1 bash scripts/run.sh METHOD MODEL`` (or a published ``scripts/run_*.sh``; on the Ray head, inside the
sbatch before training, or submitted as a Ray job) runs :func:`main` with the launcher's overrides instead of the
trainer. The dry run (:mod:`gtpo.launch.dry_run`) checks arithmetic on a laptop; the preflight checks the cluster the
run will meet, one line per check, stopping at the first failure (exit status 1):

1. ``config``: every check the entry point runs before Ray (:func:`gtpo.launch.checks.check_config`: resolution,
   registries, the recipe's rules, the batch plan, verl's ``validate_config``), the checkpoint engine's transport
   importable here (cupy for ``nccl``), and no CPU test backend (``VERL_PLATFORM=cpu``, ``gtpo.cpu`` modules) unless
   ``trainer.device=cpu``; the startup notes follow as ``note`` lines;
2. ``overlong buffer``: with DAPO's soft overlong punishment on, ``0 < len < max_resp_len`` (else every token of
   every response is penalised);
3. ``train data`` / ``val data``: every file as the driver checks it before Ray (:mod:`gtpo.launch.data_checks`):
   a parquet file with rows, the columns verl reads, prompts of text within ``data.max_prompt_length`` tokens
   where ``data.truncation=error``;
4. ``run length``: ``trainer.total_epochs`` epochs of the training rows hold ``trainer.total_training_steps`` steps
   (verl stops at whichever comes first);
5. ``model``: ``actor_rollout_ref.model.path`` is a local folder (not a hub id) with ``config.json``
   (``max_position_embeddings >= max_prompt_length + max_response_length``), tokenizer files and complete weights
   (every shard the index names, each file as long as its header says);
6. ``trackers``: ``wandb`` in ``trainer.logger`` needs ``WANDB_API_KEY`` or ``WANDB_MODE=offline|disabled``; a
   ``warn`` line (not a failure) for ``file`` / ``tensorboard`` writing to a relative folder
   (``VERL_FILE_LOGGER_ROOT`` / ``VERL_FILE_LOGGER_PATH``, ``TENSORBOARD_DIR``, from the Ray runtime env or this
   environment): verl's TaskRunner resolves it in its working directory, a Ray session's scratch folder on
   whichever node it starts, so the log is lost with the session and a resume finds no history to keep;
7. ``checkpoint cadence``: ``trainer.save_freq > 0`` (a Slurm time limit or a crash otherwise loses every step);
8. ``checkpoint dir``: ``trainer.default_local_dir`` is writable here (a token file is written, removed at the end)
   and nobody else can plant files in it: this user's, not writable by group or others, no symlink, and no folder
   above it writable by everyone without the sticky bit (verl loads checkpoints with ``torch.load``, which runs
   code; :func:`gtpo.launch.preflight_checks.check_checkpoint_dir`);
9. ``ray cluster``: the GPU nodes and their GPUs match ``trainer.nnodes`` x ``trainer.n_gpus_per_node``, plus
   ``actor_rollout_ref.rollout.nnodes`` x ``n_gpus_per_node`` under separate_async, no node on a loopback address
   (RAY_ADDRESS set: the Ray cluster; unset: this machine through ``nvidia-smi -L``);
10. ``checkpoint shared``: every node reads the token file back with the same content;
11. ``driver``: every node's NVIDIA driver major version >= ``MIN_DRIVER_VERSION`` (580: the image's CUDA 13.0);
12. ``interfaces``: ``GLOO_SOCKET_IFNAME`` (one name), ``NCCL_SOCKET_IFNAME`` (unless a ``^`` exclusion list) and
    ``RAY_NETWORK_INTERFACE`` exist on every node with a non-loopback IPv4 address.

This module runs the checks in order and prints their lines; the checks are two modules, by where their facts come
from: :mod:`gtpo.launch.preflight_checks` (1-8: the composed config, the data, the model, this machine) and
:mod:`gtpo.launch.preflight_cluster` (9-12: the nodes, whose facts come from :func:`node_report`, run once on
every node as a Ray task pinned to it).
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from gtpo.launch.preflight_checks import (
    PreflightError,
    as_list,
    check_checkpoint_dir,
    check_config,
    check_data_files,
    check_model,
    check_overlong,
    check_run_length,
    check_trackers,
    log_dir_warnings,
    parquet_rows,
)
from gtpo.launch.preflight_cluster import (
    MIN_DRIVER_VERSION,
    LocalCluster,
    RayCluster,
    check_cluster,
    check_driver,
    check_interfaces,
    check_shared,
    node_report,
    wanted_interfaces,
)
from gtpo.launch.ray_auth import ray_auth_problem

__all__ = ["LocalCluster", "PreflightError", "RayCluster", "main", "node_report", "run_preflight"]


def run_preflight(cfg: DictConfig, cluster: Any, env: dict[str, str] | None = None, out=None) -> int:
    """Run every check in order; print one line each; return 0, or 1 at the first failure.

    Args:
        cfg: the composed (unresolved is fine) trainer config of the launch script.
        cluster: :class:`RayCluster`, :class:`LocalCluster`, or anything with ``remote``, ``nodes()`` and
            ``run_on_each(nodes, fn, *args)`` (``fn(*args)`` on each of ``nodes``, results in that order).
        env: the environment to judge (default ``os.environ``).
        out: stream for the report (default stdout).
    """
    from gtpo.launch.batch_checks import startup_notes

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
        check("config", lambda: check_config(cfg, env))
        resolved = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
        for note in startup_notes(resolved):
            print(f"[preflight] note {note}", file=out, flush=True)
        check("overlong buffer", lambda: check_overlong(resolved))
        for item, key in (("train data", "data.train_files"), ("val data", "data.val_files")):
            check(item, lambda item=item, key=key: check_data_files(item, key, resolved))
        train_rows = parquet_rows(as_list(resolved.data.train_files))
        check("run length", lambda: check_run_length(resolved, train_rows))
        check("model", lambda: check_model(resolved))
        check("trackers", lambda: check_trackers(resolved, env))
        for warning in log_dir_warnings(resolved, env):
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
            check_checkpoint_dir(ckpt_dir)  # before creating anything under a parent others could write
            try:
                ckpt_dir.mkdir(parents=True, exist_ok=True)
                # checked again as it now is: the umask's mode, or a folder someone else made meanwhile
                private = check_checkpoint_dir(ckpt_dir)
                token_file = ckpt_dir / f".preflight-{token}"
                token_file.write_text(token)
            except OSError as err:
                raise PreflightError("checkpoint dir", f"trainer.default_local_dir={ckpt_dir}: {err}") from None
            return f"{ckpt_dir} writable, {private}"

        check("checkpoint dir", writable)
        nodes = cluster.nodes()
        check("ray cluster", lambda: check_cluster(resolved, nodes, cluster.remote))
        interfaces = wanted_interfaces(env)
        reports = cluster.run_on_each(nodes, node_report, str(token_file), interfaces)
        for node, report in zip(nodes, reports, strict=True):
            report["cluster_gpus"] = node["gpus"]
        check("checkpoint shared", lambda: check_shared(reports, token, token_file))
        minimum = int(env.get("MIN_DRIVER_VERSION", MIN_DRIVER_VERSION))
        check("driver", lambda: check_driver(reports, minimum))
        check("interfaces", lambda: check_interfaces(reports, interfaces, env))
    except PreflightError as err:
        line("FAIL", err.item, str(err).removeprefix(f"{err.item}: "))
        return 1
    finally:
        if token_file is not None:
            token_file.unlink(missing_ok=True)
    print(f"[preflight] OK: {passed} checks passed in {time.monotonic() - start:.1f} s", file=out)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: ``python -m gtpo.launch.preflight override ...`` (the launch script's overrides)."""
    import verl  # noqa: F401  (loads VERL_USE_EXTERNAL_MODULES and verl.plugins entry points)

    import gtpo.verl_plugin.register  # noqa: F401
    from gtpo.launch.dry_run import CONFIG_ERROR_EXIT, compose_config, config_error_line

    overrides = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = compose_config(overrides)
    except Exception as err:
        # a misspelt key or preset: one line naming it, as the recipe's entry point prints it
        line = config_error_line(err)
        if line is None or os.environ.get("GTPO_TRACEBACK", "0") == "1":
            raise
        print(f"[preflight] FAIL config: {line}", flush=True)
        return CONFIG_ERROR_EXIT
    address = os.environ.get("RAY_ADDRESS", "")
    auth_problem = ray_auth_problem()
    if auth_problem:
        print(f"[preflight] FAIL ray cluster: {auth_problem}", flush=True)
        return 1
    try:
        cluster = RayCluster(address) if address else LocalCluster()
    except Exception as err:  # ray.init raises ConnectionError and others
        print(f"[preflight] FAIL ray cluster: cannot connect to RAY_ADDRESS={address}: {err}", flush=True)
        return 1
    return run_preflight(cfg, cluster)


if __name__ == "__main__":
    sys.exit(main())
