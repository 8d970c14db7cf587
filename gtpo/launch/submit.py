"""How a launch runs once :mod:`gtpo.launch.launcher` has planned it: here, or as a Ray job on a running cluster.

``SUBMIT_MODE=local`` runs ``python -m recipe.gtpo.main_gtpo <overrides>`` in this process's place: a fresh local
Ray, or the cluster ``RAY_ADDRESS=<ip>:6379`` names (a Slurm driver, a RayJob's entrypoint). ``SUBMIT_MODE=job``
runs ``ray job submit`` against the dashboard ``RAY_ADDRESS=http://<head>:8265`` names, with a private copy of
``RUNTIME_ENV`` that adds the plugin module, the log folders, the run's name (``GTPO_RUN``) and the variables
``ENV_PASSTHROUGH`` names, and nothing else (a runtime env is readable through the dashboard's job API; a login
node's NCCL_* or GLOO_* settings are wrong on GPU nodes), then exits with the driver's own status
(:mod:`gtpo.launch.job_exit`). ``auto`` (the default) is ``job`` for a dashboard URL outside a Ray job's driver.

On a cluster (``SLURM_JOB_ID``, job mode, or more than one node) every node must read the data, the model and the
checkpoints at one path: absolute, and outside ``$HOME`` (pyxis does not mount it, home quotas do not hold
checkpoints, and in job mode it is the submitting machine's) unless ``ALLOW_HOME_PATHS=1``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence

import yaml

from gtpo.private_files import looks_secret, token_file_problem

__all__ = ["LaunchError", "check_paths", "cluster_reason", "run_here", "submit_job", "submit_mode"]

# Log folders (paths, never secrets): copied into a job's runtime env whatever ENV_PASSTHROUGH says.
LOG_DIR_VARS = ("VERL_FILE_LOGGER_ROOT", "VERL_FILE_LOGGER_PATH", "TENSORBOARD_DIR", "WANDB_DIR")
DEFAULT_PASSTHROUGH = "WANDB_ENTITY WANDB_PROJECT WANDB_MODE WANDB_BASE_URL HF_ENDPOINT HF_HUB_OFFLINE"
# The paths every node of a cluster must read at the same place.
SHARED_PATHS = ("TRAIN_FILE", "TEST_FILE", "MODEL_PATH", "CKPTS_DIR")


class LaunchError(Exception):
    """A launcher mistake, refused before anything runs: one line, exit 2."""


def submit_mode(environ: Mapping[str, str]) -> str:
    """``SUBMIT_MODE`` resolved to ``local`` or ``job``."""
    mode = environ.get("SUBMIT_MODE", "auto") or "auto"
    if mode in ("local", "job"):
        return mode
    if mode != "auto":
        raise LaunchError(f"SUBMIT_MODE={mode}: expected auto, local or job")
    address = environ.get("RAY_ADDRESS", "")
    # A Ray job's driver (KubeRay, `ray job submit`) has RAY_ADDRESS=<gcs ip:port> and this variable set.
    in_job = bool(environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR"))
    return "job" if address.startswith(("http://", "https://")) and not in_job else "local"


def cluster_reason(mode: str, nnodes: int, environ: Mapping[str, str]) -> str | None:
    """Why this launch counts as a cluster run, or None."""
    if environ.get("SLURM_JOB_ID"):
        return f"SLURM_JOB_ID={environ['SLURM_JOB_ID']}"
    if mode == "job":
        return f"SUBMIT_MODE=job, RAY_ADDRESS={environ.get('RAY_ADDRESS', '')}"
    return f"{nnodes} nodes" if nnodes > 1 else None


def _items(value: str) -> list[str]:
    """A path, or each item of a Hydra list ``[a,b]``."""
    return [item.strip().strip("\"'") for item in value.strip().removeprefix("[").removesuffix("]").split(",")]


def check_paths(paths: Mapping[str, str], reason: str | None, environ: Mapping[str, str]) -> None:
    """On a cluster (``reason``) every path is absolute and, unless ``ALLOW_HOME_PATHS=1``, outside ``$HOME``."""
    if reason is None:
        return
    home = environ.get("HOME", "")
    for var in SHARED_PATHS:
        for item in _items(paths[var]):
            if not item.startswith("/"):
                raise LaunchError(
                    f"{var}={item}: not an absolute path; on a cluster ({reason}) every node must read it at the same "
                    "place (MODEL_PATH is a local folder, not a hub id: hf download <repo> --local-dir <dir>)"
                )
            if environ.get("ALLOW_HOME_PATHS", "0") != "1" and home and (item == home or item.startswith(home + "/")):
                raise LaunchError(
                    f"{var}={item} is under $HOME={home}: on a cluster ({reason}) set RAY_DATA_HOME=<shared folder "
                    f"mounted at the same path on every node> or {var} itself (ALLOW_HOME_PATHS=1 if $HOME is such a "
                    "folder)"
                )


def _trace(command: Sequence[str], environ: Mapping[str, str]) -> None:
    if environ.get("GTPO_TRACE", "0") == "1":
        print("+ " + " ".join(command), file=sys.stderr, flush=True)


def run_here(command: Sequence[str], environ: Mapping[str, str], replace: bool) -> int:
    """Run ``command`` with ``environ``; ``replace``: in this process's place (signals reach the driver itself)."""
    _trace(command, environ)
    sys.stdout.flush()
    sys.stderr.flush()
    if replace:
        os.execvpe(command[0], list(command), dict(environ))
    return subprocess.run(list(command), env=dict(environ), check=False).returncode


def check_job_auth(environ: Mapping[str, str]) -> dict[str, str]:
    """``ray job submit`` authenticates with the cluster's Ray token: ``RAY_AUTH_MODE=token`` (set here when unset)
    and the token's file in ``RAY_AUTH_TOKEN_PATH`` (a path, never the value; a file of this user's that nobody else
    may read); ``disabled`` submits without it."""
    mode = environ.get("RAY_AUTH_MODE") or "token"
    if mode == "disabled":
        print(
            "[gtpo] RAY_AUTH_MODE=disabled: submitting without Ray's token (a cluster started without authentication "
            "accepts anyone who can reach it)",
            file=sys.stderr,
        )
        return {}
    if mode != "token":
        raise LaunchError(f"RAY_AUTH_MODE={mode}: expected token or disabled")
    path = environ.get("RAY_AUTH_TOKEN_PATH", "")
    if not path:
        raise LaunchError(
            f"RAY_ADDRESS={environ.get('RAY_ADDRESS')}: the cluster's dashboard wants its Ray token and "
            "RAY_AUTH_TOKEN_PATH is unset; set it to the token's file (docs/cluster.md, \"Security\": a Slurm job's is "
            "under RAY_AUTH_DIR, a RayJob's is in its Secret), or RAY_AUTH_MODE=disabled for a cluster started "
            "without authentication"
        )
    problem = token_file_problem(path)  # a folder, another user's file, one others may read
    if problem:
        raise LaunchError(problem)
    return {"RAY_AUTH_MODE": "token"}


def write_runtime_env(path: str, environ: Mapping[str, str], plugin: str, always: Sequence[str]) -> None:
    """``RUNTIME_ENV`` plus the plugin module, the variables ``always`` names and those ``ENV_PASSTHROUGH`` names
    that are set; a secret-looking name is copied with a warning (the dashboard shows it)."""
    from gtpo.verl_plugin.config import merge_module_list

    if environ.get("ENV_PASSTHROUGH_PREFIXES"):
        raise LaunchError(
            f"ENV_PASSTHROUGH_PREFIXES={environ['ENV_PASSTHROUGH_PREFIXES']}: prefix copying is gone; name each "
            "variable in ENV_PASSTHROUGH (cluster-specific NCCL_* / GLOO_* settings belong on the cluster nodes)"
        )
    with open(environ["RUNTIME_ENV"]) as f:
        env = yaml.safe_load(f) or {}
    env_vars = {str(k): str(v) for k, v in (env.get("env_vars") or {}).items()}
    env_vars["VERL_USE_EXTERNAL_MODULES"] = merge_module_list(env_vars.get("VERL_USE_EXTERNAL_MODULES"), plugin)
    names = [*always, *environ.get("ENV_PASSTHROUGH", DEFAULT_PASSTHROUGH).split()]
    for key in dict.fromkeys(names):
        if key in environ:
            env_vars[key] = environ[key]
            if looks_secret(key):
                print(
                    f"[gtpo] warning: {key} is stored with the job and readable through the Ray dashboard; prefer "
                    "setting it where `ray start` runs",
                    file=sys.stderr,
                )
    env["env_vars"] = env_vars
    with open(path, "w") as f:
        yaml.safe_dump(env, f, sort_keys=True)
    print(f"[gtpo] runtime env {path}: env_vars {sorted(env_vars)}", file=sys.stderr)


def submit_job(args: Sequence[str], environ: Mapping[str, str], plugin: str, always: Sequence[str]) -> int:
    """``ray job submit -- python3 <args>`` under an id of ours; then the driver's own status (85 saved for a
    preemption, 75 a stalled stage), which ``ray job submit`` (0 or 1) does not give."""
    environ = {**environ, **check_job_auth(environ)}
    python, address = environ.get("PYTHON") or sys.executable, environ["RAY_ADDRESS"]
    job_id = f"gtpo_{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    fd, env_file = tempfile.mkstemp(prefix="gtpo_runtime_env.", dir=environ.get("TMPDIR") or None)
    os.close(fd)
    try:
        write_runtime_env(env_file, environ, plugin, always)
        submit = ["ray", "job", "submit", "--address", address, "--submission-id", job_id, "--runtime-env", env_file,
                  "--working-dir", environ["WORKING_DIR"]]  # fmt: skip
        no_wait = environ.get("JOB_NO_WAIT", "0") == "1"
        rc = run_here([*submit, *(["--no-wait"] if no_wait else []), "--", "python3", *args], environ, replace=False)
    finally:
        os.unlink(env_file)
    if no_wait:
        print(
            f"[gtpo] job {job_id} submitted: ray job logs --address {address} {job_id} --follow; once it has ended, "
            f"{python} -m gtpo.launch.job_exit {job_id} --address {address} exits with its driver's status",
            file=sys.stderr,
        )
        return rc
    exit_status = [python, "-m", "gtpo.launch.job_exit", job_id, "--address", address, "--cli-status", str(rc)]
    return run_here(exit_status, environ, replace=False)
