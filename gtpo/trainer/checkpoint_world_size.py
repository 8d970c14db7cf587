"""Checkpoints and the run's world size: a resume at another number of ranks is refused before any worker loads.

A checkpoint saved by ``W`` ranks cannot be loaded by another number: the files of the run's world
size do not exist, and the run would fail inside a worker. Resharding is not attempted (each FSDP2 shard is a
rank's slice of DTensors, and the optimizer state is sharded alike): :func:`check_resume_world_size` refuses such a
resume (``auto`` or ``resume_path``) before any worker loads (the entry point checks it once more before Ray
starts, :func:`gtpo.launch.driver_checks.check_world_size_before_launch`, where the driver sees the folder), naming
both sizes, the folder and
the ways out (resume with ``W`` GPUs, or merge the weights with verl's model merger and start a new run from
them). A save at step N first removes shard files of another world size left in ``global_step_<N>`` by an
abandoned attempt (:func:`discard_other_world_sizes`), so the recipe's own saves never mix two sizes in one folder.
"""

from __future__ import annotations

import os

from gtpo.trainer.checkpoints import ROLE_DIRS, shard_files, shard_name

__all__ = [
    "check_resume_world_size",
    "checkpoint_world_size",
    "discard_other_world_sizes",
]


def checkpoint_world_size(folder: str) -> int | None:
    """The world size the checkpoint ``folder``'s ``actor/`` was saved at, read from its shard file names; None when
    it holds no shard file (nothing saved, or a non-FSDP format).

    Raises:
        ValueError: ``actor/`` holds the shards of several world sizes.
    """
    found = shard_files(os.path.join(folder, "actor"))
    if len(found) > 1:
        raise ValueError(f"{folder}/actor mixes the shards of world sizes {', '.join(map(str, sorted(found)))}")
    return next(iter(found), None)


def _shape_for(world_size: int, n_gpus_per_node: int) -> tuple[int, int]:
    """A ``(nnodes, n_gpus_per_node)`` of ``world_size`` GPUs: the run's GPUs per node where they divide it."""
    if n_gpus_per_node > 1 and world_size % n_gpus_per_node == 0:
        return world_size // n_gpus_per_node, n_gpus_per_node
    return 1, world_size


def check_resume_world_size(folder: str, nnodes: int, n_gpus_per_node: int) -> None:
    """Refuse to resume from ``folder`` at another world size than its shards were saved at.

    The run's world size is ``trainer.nnodes × trainer.n_gpus_per_node``: verl's actor (and critic) workers fill the
    whole global resource pool in every trainer mode. A folder without shard files is left to verl.

    Raises:
        RuntimeError: the sizes differ (or ``actor/`` mixes several), naming both, the folder and the ways out.
    """
    run = int(nnodes) * int(n_gpus_per_node)
    folder = os.path.abspath(folder)
    try:
        saved = checkpoint_world_size(folder)
    except ValueError as err:
        raise RuntimeError(f"cannot resume from {folder}: {err}; resume from another checkpoint") from None
    if saved is None or saved == run:
        return
    nodes, per_node = _shape_for(saved, int(n_gpus_per_node))
    actor, merged = os.path.join(folder, "actor"), f"{folder}_hf"
    raise RuntimeError(
        f"cannot resume from {folder} at world size {run} (trainer.nnodes={nnodes} x "
        f"trainer.n_gpus_per_node={n_gpus_per_node}): it was saved at world size {saved} "
        f"({shard_name('model', saved, 0)} ... {shard_name('model', saved, saved - 1)}), and each of verl's workers "
        f"loads only the shards of its own world size and rank. Either resume on {saved} GPUs "
        f"(trainer.nnodes x trainer.n_gpus_per_node = {saved}, e.g. trainer.nnodes={nodes} "
        f"trainer.n_gpus_per_node={per_node}), or merge its weights into a Hugging Face model, "
        f"`python -m verl.model_merger merge --backend fsdp --local_dir {actor} --target_dir {merged}`, and start a "
        f"new run from them with actor_rollout_ref.model.path={merged} and another trainer.default_local_dir (the "
        "optimizer state, the data order and the step count then start afresh)."
    )


def discard_other_world_sizes(folder: str, world_size: int) -> list[str]:
    """Remove the shard files of any world size but ``world_size`` from ``folder``'s ``actor/`` and ``critic/``: left
    by an abandoned attempt at this step at another size, they would make the save about to rewrite the folder mix
    two sizes. Returns the removed paths."""
    removed = []
    for role in ROLE_DIRS:
        directory = os.path.join(folder, role)
        for size, files in shard_files(directory).items():
            if size == world_size:
                continue
            for kind, rank in files:
                path = os.path.join(directory, shard_name(kind, size, rank))
                try:
                    os.remove(path)
                except FileNotFoundError:
                    continue
                removed.append(path)
    return removed
