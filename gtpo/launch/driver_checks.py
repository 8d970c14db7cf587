"""What the entry point's driver checks before Ray starts, where it sees the shell's environment and the folders.

:func:`check_cpu_backend` refuses the CPU test backend in a run whose ``trainer.device`` is not ``cpu``:
``VERL_PLATFORM=cpu`` or a ``gtpo.cpu`` module in ``VERL_USE_EXTERNAL_MODULES`` (the variables :func:`gtpo.cpu.env`
sets), inherited from a shell that ran the CPU tests, would put the CPU platform and its gloo-only process groups on
the GPU workers: no error, a very slow run. The preflight runs it too.

:func:`check_world_size_before_launch` finds the checkpoint a resume would load, refuses it when others could have
planted files in it, and reshards it when it was saved at another world size (or refuses, as
``algorithm.resume.other_world_size`` says); the trainer does the same once more before its workers load
(:func:`gtpo.trainer.resume.checkpoint_world_size.match_resume_world_size`), for a folder the driver does not see.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from omegaconf import OmegaConf

from gtpo.private_files import check_private_dir
from gtpo.trainer.resume.checkpoint_world_size import match_resume_world_size
from gtpo.trainer.resume.checkpoints import CheckpointLayout, incomplete_reasons, newest_complete, read_tracker
from gtpo.trainer.resume.reshard import finish_interrupted_reshards

__all__ = ["CPU_BACKEND_PACKAGE", "check_cpu_backend", "check_world_size_before_launch"]

# The CPU test backend's package, and the config key of the environment verl's Ray processes get.
CPU_BACKEND_PACKAGE = "gtpo.cpu"
RUNTIME_ENV_VARS_KEY = "ray_kwargs.ray_init.runtime_env.env_vars"


def check_cpu_backend(config: Any, environ: Mapping[str, str] | None = None) -> None:
    """Refuse the CPU test backend (``gtpo.cpu``) when ``trainer.device`` is not ``cpu``.

    Args:
        config: the trainer config (``trainer.device``, ``ray_kwargs.ray_init.runtime_env.env_vars``).
        environ: the driver's environment, which a fresh local Ray passes on to its workers (default ``os.environ``).

    Raises:
        ValueError: naming each variable that selects the CPU backend and where it is set.
    """
    device = str(OmegaConf.select(config, "trainer.device", default="cuda"))
    if device == "cpu":
        return
    sources = {"the environment": os.environ if environ is None else environ}
    sources[RUNTIME_ENV_VARS_KEY] = OmegaConf.select(config, RUNTIME_ENV_VARS_KEY, default=None) or {}
    found = []
    for where, env in sources.items():
        platform = str(env.get("VERL_PLATFORM", "") or "")
        if platform.strip().lower() == "cpu":
            found.append(f"VERL_PLATFORM={platform} ({where})")
        modules = [m.strip() for m in str(env.get("VERL_USE_EXTERNAL_MODULES", "") or "").split(",")]
        cpu_modules = [m for m in modules if m == CPU_BACKEND_PACKAGE or m.startswith(CPU_BACKEND_PACKAGE + ".")]
        if cpu_modules:
            found.append(f"VERL_USE_EXTERNAL_MODULES with {','.join(cpu_modules)} ({where})")
    if found:
        raise ValueError(
            f"trainer.device={device} but {'; '.join(found)}: the CPU test backend (gtpo.cpu.env()) would run verl's "
            "workers on its cpu platform with gloo-only process groups; unset these for a GPU run, or run the CPU "
            "backend with backend=cpu_tiny (trainer.device=cpu)"
        )


def _refuse_unless_private(folder: str, what: str, inside: bool) -> None:
    """``folder`` (and with ``inside`` every folder in it, symlinks not followed: one is refused) only this user can
    write (:func:`gtpo.private_files.check_private_dir`); verl loads the files there with ``torch.load``, which runs
    code."""
    try:
        check_private_dir(folder, what)
        for top, dirs, _ in os.walk(folder) if inside else ():
            for name in dirs:
                check_private_dir(os.path.join(top, name), "a folder of the checkpoint")
    except OSError as err:
        raise RuntimeError(f"cannot resume: {err}") from None


def check_world_size_before_launch(config: Any, layout: CheckpointLayout) -> str | None:
    """The driver's early :func:`~gtpo.trainer.resume.checkpoint_world_size.match_resume_world_size`, before Ray starts
    or a GPU is allocated, on the folder a resume would load (``resume_path``: the named one; ``auto``: the
    tracker's when complete, else the newest complete one, complete as ``layout`` says,
    :func:`gtpo.trainer.resume.checkpoints.layout_of`; the tracker is not rewritten; a reshard killed half-way is undone
    first). Returns the folder checked; None when there is nothing to check here (no resume, or the checkpoint
    folder is not visible from the driver: the trainer checks again before loading).

    First, since verl loads checkpoints with ``torch.load(weights_only=False)`` (code, whatever the file names say),
    the folder and every folder in it must be this user's, writable by neither group nor others, and no symlink;
    under ``auto`` ``trainer.default_local_dir`` too, wherever it exists (also with nothing saved yet: a run saving
    there would resume from it later). The preflight refuses such a folder as well, but it can be skipped.

    Raises:
        RuntimeError: a folder others could plant files in, named with its owner or mode; or as
            :func:`gtpo.trainer.resume.checkpoint_world_size.match_resume_world_size`.
    """
    trainer_cfg = config.trainer
    mode = str(trainer_cfg.get("resume_mode", "disable"))
    if mode == "resume_path" and trainer_cfg.get("resume_from_path"):
        folder = os.path.abspath(str(trainer_cfg.resume_from_path))
    elif mode == "auto" and trainer_cfg.get("default_local_dir"):
        root = os.path.abspath(str(trainer_cfg.default_local_dir))
        if os.path.lexists(root):  # before reading anything in it
            _refuse_unless_private(root, "trainer.default_local_dir", inside=False)
            finish_interrupted_reshards(root)
        step, _ = read_tracker(root)
        named = os.path.join(root, f"global_step_{step}") if step is not None else None
        if named is not None and not incomplete_reasons(named, step, layout):
            folder = named
        else:
            found = newest_complete(root, layout)
            folder = found[1] if found else None
    else:
        return None
    if folder is None or not os.path.lexists(folder):
        return None
    _refuse_unless_private(folder, "trainer.resume_from_path" if mode == "resume_path" else "checkpoint", inside=True)
    match_resume_world_size(folder, config, layout)
    return folder
