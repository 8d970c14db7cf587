"""The Ray cluster of a run that names none: its own, started by its driver, private to it.

Without ``RAY_ADDRESS`` (the one-GPU launchers, the smoke run outside Slurm, ``scripts/eval_checkpoint.sh`` on a
workstation, a direct ``python -m recipe.gtpo.main_gtpo``) ``ray.init()`` would join the cluster
``<tmp>/ray/ray_current_cluster`` records, a file any local user can write (Ray makes ``<tmp>/ray`` 0777 without
the sticky bit), and send it the token of Ray's shared ``~/.ray/auth_token``, which Ray writes under the caller's
umask. Such a run instead gets, in its driver's environment before ``ray.init``:

* ``RAY_ADDRESS=local``: a new cluster, whatever a file records;
* ``RAY_TMPDIR``: a fresh folder only this user can enter (``mkdtemp``, 0700), so Ray's session folders, which Ray
  makes 0777 without the sticky bit (sockets, logs, the runtime-env agent's package cache), are out of others' reach;
* a fresh random token in it (``RAY_AUTH_MODE=token``, ``RAY_AUTH_TOKEN_PATH``; an inherited ``RAY_AUTH_TOKEN``
  value is dropped), removed when the driver exits; the session's logs stay.

A run that names a cluster (``RAY_ADDRESS=<ip>:<port>``, ``ray_kwargs.ray_init.address``) joins it with that
cluster's token (:mod:`gtpo.launch.ray_auth`), unless another verl run is on it (:func:`refuse_a_cluster_in_use`):
verl 0.9.1's TransferQueue keeps one controller per Ray cluster, which a second run would share and, at its end,
kill (seam ``one-run-per-cluster``).
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

from gtpo.private_files import ray_token_env, write_ray_token

__all__ = ["ClusterInUseError", "names_a_cluster", "refuse_a_cluster_in_use", "start_private_local_ray"]

# TransferQueue's controller: one named actor per Ray cluster, in a namespace of its own (transfer_queue.interface).
TQ_CONTROLLER_NAME, TQ_NAMESPACE = "TransferQueueController", "transfer_queue"

# Ray's socket paths (<folder>/ray/session_<date>_<time>_<us>_<pid>/sockets/plasma_store) must fit in 107 bytes.
MAX_FOLDER_CHARS = 36


def names_a_cluster(environ: Mapping[str, str], ray_init: Mapping[str, Any] | None = None) -> bool:
    """Whether ``ray.init`` joins a running cluster the user named, rather than starting one."""
    address = environ.get("RAY_ADDRESS", "").strip()
    return address not in ("", "local") or (ray_init or {}).get("address") is not None


def start_private_local_ray(
    ray_init: Mapping[str, Any] | None = None, environ: MutableMapping[str, str] | None = None
) -> Path | None:
    """For a run that names no cluster, set ``RAY_ADDRESS=local``, a private ``RAY_TMPDIR`` and a fresh token in
    ``environ`` (this process's by default); returns the folder, or None when the run joins a named cluster."""
    environ = os.environ if environ is None else environ
    if names_a_cluster(environ, ray_init):
        return None
    base = tempfile.gettempdir()
    if len(os.path.join(base, "gtpo-ray-12345678")) > MAX_FOLDER_CHARS:
        base = "/tmp"  # a long TMPDIR (a job's scratch folder) leaves no room for Ray's socket names
    folder = Path(tempfile.mkdtemp(prefix="gtpo-ray-", dir=base))
    token_dir = folder / "auth"
    token = write_ray_token(token_dir)
    atexit.register(shutil.rmtree, token_dir, ignore_errors=True)
    environ.pop("RAY_AUTH_TOKEN", None)
    environ.update({"RAY_ADDRESS": "local", "RAY_TMPDIR": str(folder), **ray_token_env(token)})
    if environ is os.environ and "ray" in sys.modules:
        _reload_ray_auth()
    print(
        f"gtpo: starting a new local Ray cluster of this run's own (session logs under {folder}/ray, token "
        "authentication on); set RAY_ADDRESS to join a running cluster",
        file=sys.stderr,
        flush=True,
    )
    return folder


def _reload_ray_auth() -> None:
    """Make an already imported Ray read the authentication variables again (seam ``ray-auth-reload``): Ray reads
    ``RAY_AUTH_MODE`` into its config when it is imported and caches the token it loaded, so a driver that imported
    it before the variables were set would start a cluster requiring the token and connect to it without one. This
    is what Ray itself does when it turns authentication on for a process (``_enable_token_auth``)."""
    from ray._private.authentication.authentication_token_setup import _enable_token_auth
    from ray._raylet import AuthenticationTokenLoader

    _enable_token_auth()
    AuthenticationTokenLoader.instance().reset_cache()


class ClusterInUseError(RuntimeError):
    """The Ray cluster a run joined holds another verl run's TransferQueue."""


def refuse_a_cluster_in_use() -> None:
    """Raise :class:`ClusterInUseError` when the Ray cluster this driver joined already holds TransferQueue's
    controller, i.e. another verl run (a training job, an evaluation) lives on it.

    verl's TaskRunner calls ``tq.init``, which attaches to a controller it finds instead of starting its own (the two
    runs' batches then meet in one store), and ``tq.close`` at its end, which ``ray.kill``-s that controller: the
    other run waits at its next step for good (seam ``one-run-per-cluster``). Called after ``ray.init`` and before
    the TaskRunner exists, so nothing of either run has been touched."""
    import ray

    if not ray.is_initialized():
        return  # on no cluster (and ray.get_actor would start one)
    try:
        controller = ray.get_actor(TQ_CONTROLLER_NAME, namespace=TQ_NAMESPACE)
    except ValueError:
        return
    try:
        ray.get(controller.get_config.remote(), timeout=60)
    except ray.exceptions.RayActorError:
        return  # the controller of a run that has ended, going with it: nothing left to share or stop
    except ray.exceptions.GetTimeoutError:
        pass  # alive, busy serving its run
    address = ray.get_runtime_context().gcs_address
    raise ClusterInUseError(
        f"the Ray cluster at {address} runs another verl job (TransferQueue's controller, one per cluster, is on it): "
        "this run would share its data store and, ending, stop that job; run it on a cluster of its own (no "
        "RAY_ADDRESS: a private local one; on Slurm or KubeRay its own job)"
    )
