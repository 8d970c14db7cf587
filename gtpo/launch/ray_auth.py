"""Ray token authentication, checked where a driver or a client joins a running cluster (before ``ray.init``).

Every cluster the recipe starts requires Ray's token (``RAY_AUTH_MODE=token``): the Slurm script makes one per job,
the RayJob mounts it from a Secret, the CPU clusters write one into a private folder (:mod:`gtpo.private_files`).
A process that joins one must carry both variables itself: Ray enables authentication on its own only for a cluster
it starts, never when ``RAY_ADDRESS`` names one (``ray/_private/worker.py``, Ray 2.60), and a client without the token
is refused only after Ray's 20-second connection retries, with ``ConnectionError: Failed to connect``. This check
says it at once, naming the variable.

``RAY_AUTH_MODE=disabled`` is the explicit way to attach to a cluster started without authentication (a private
machine, a cluster behind its own firewall).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from gtpo.private_files import token_file_problem

__all__ = ["joins_running_cluster", "ray_auth_problem", "check_ray_auth"]

# RAY_ADDRESS values that start a new cluster rather than join one.
_NEW_CLUSTER = ("", "local")


def joins_running_cluster(environ: Mapping[str, str]) -> bool:
    """True when ``ray.init()`` in this environment connects to a cluster that is already running."""
    return environ.get("RAY_ADDRESS", "").strip() not in _NEW_CLUSTER


def ray_auth_problem(environ: Mapping[str, str] | None = None) -> str | None:
    """What keeps a process with ``environ`` from authenticating to the cluster ``RAY_ADDRESS`` names, or None.

    Nothing to say for a new local cluster (the entry point gives it a private token, :mod:`gtpo.launch.local_ray`).
    For a running one: ``RAY_AUTH_MODE`` must be ``token`` (with ``RAY_AUTH_TOKEN_PATH`` naming a file of this user's
    that nobody else may read, :func:`gtpo.private_files.token_file_problem`, or ``RAY_AUTH_TOKEN``) or an explicit
    ``disabled``.
    """
    environ = os.environ if environ is None else environ
    if not joins_running_cluster(environ):
        return None
    address = environ["RAY_ADDRESS"]
    mode = environ.get("RAY_AUTH_MODE")
    hint = (
        "export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=<the cluster's token file> (the Slurm job's is under "
        "RAY_AUTH_DIR, a RayJob's in its Secret, `python -m gtpo.cpu.cluster start` prints its own), or "
        "RAY_AUTH_MODE=disabled for a cluster started without authentication"
    )
    if mode is None:
        return f"RAY_ADDRESS={address} joins a running Ray cluster but RAY_AUTH_MODE is unset: Ray would connect " \
            f"without its token and be refused after 20 s; {hint}"  # fmt: skip
    if mode == "disabled":
        return None
    if mode != "token":
        return f"RAY_AUTH_MODE={mode}: expected token or disabled"
    if environ.get("RAY_AUTH_TOKEN"):
        return None
    path = environ.get("RAY_AUTH_TOKEN_PATH")
    if not path:
        return f"RAY_AUTH_MODE=token but RAY_AUTH_TOKEN_PATH is unset (RAY_ADDRESS={address}); {hint}"
    problem = token_file_problem(path)  # a folder, another user's file, one others may read
    if problem:
        return f"{problem} (RAY_ADDRESS={address}); {hint}"
    return None


def check_ray_auth(environ: Mapping[str, str] | None = None) -> None:
    """Raise ``ValueError`` naming the missing variable when :func:`ray_auth_problem` finds one."""
    problem = ray_auth_problem(environ)
    if problem:
        raise ValueError(problem)
