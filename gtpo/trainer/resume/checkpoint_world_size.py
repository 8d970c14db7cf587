"""Checkpoints and the run's world size: a resume at another number of ranks reshards the checkpoint first (or,
with ``algorithm.resume.other_world_size=refuse``, is refused), before any worker loads.

A checkpoint saved by ``W`` ranks cannot be loaded by another number as it is: each of verl's workers loads the files
named with the run's world size and its own rank. :func:`match_resume_world_size` (called by the driver before Ray
starts, :func:`gtpo.launch.checks.check_world_size_before_launch`, where it sees the folder, and by the
trainer before its workers load) leaves a checkpoint of the run's size alone and otherwise:

* ``reshard`` (the default): first refuses what cannot be resharded, naming why (:func:`reshard_problems`: a critic
  the run has and the checkpoint lacks, a LoRA checkpoint for a full run or the reverse, another model than the
  run's ``model.path`` by its ``config.json``, an HSDP run) and a checkpoint too large to reshard inside the job
  (:func:`check_in_job_reshard_size`: above ``algorithm.resume.reshard_in_job_max_gb`` the offline command is the
  way); then rewrites each role's shards for the run's ranks in place
  (:func:`gtpo.trainer.resume.reshard.reshard_checkpoint`, which also refuses a format it does not know); never for
  an evaluation (``trainer.val_only``), whose driver reshards a copy of its own
  (:func:`gtpo.launch.checks.reshard_evaluation_copy`);
* ``refuse``: :func:`check_resume_world_size` raises, naming both sizes, the folder and the ways out (resume with
  ``W`` GPUs, reshard offline, or merge the weights with verl's model merger and start a new run from them).

A save at step N first removes shard files of another world size left in ``global_step_<N>`` by an abandoned
attempt (:func:`discard_other_world_sizes`), so the recipe's own saves never mix two sizes in one folder.
"""

from __future__ import annotations

import json
import os
from typing import Any

from gtpo.methods import knob
from gtpo.trainer.resume.checkpoints import ROLE_DIRS, CheckpointLayout, role_world_size, shard_files, shard_name

__all__ = [
    "check_in_job_reshard_size",
    "check_resume_world_size",
    "checkpoint_bytes",
    "checkpoint_world_size",
    "discard_other_world_sizes",
    "match_resume_world_size",
    "reshard_problems",
    "run_world_size",
]

# config.json fields that make two checkpoints the same model (a different value: another model's weights)
MODEL_FIELDS = (
    "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "vocab_size", "tie_word_embeddings",
)  # fmt: skip


def run_world_size(trainer_cfg: Any) -> int:
    """``trainer.nnodes x trainer.n_gpus_per_node``: verl's actor (and critic) workers fill the whole pool."""
    return int(trainer_cfg.nnodes) * int(trainer_cfg.n_gpus_per_node)


def checkpoint_world_size(folder: str) -> int | None:
    """The world size the checkpoint ``folder``'s ``actor/`` was saved at, read from its shard file names; None when
    it holds no shard file (nothing saved, or a non-FSDP format).

    Raises:
        ValueError: ``actor/`` holds the shards of several world sizes.
    """
    return role_world_size(os.path.join(folder, "actor"))


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
        f"loads only the shards of its own world size and rank, and algorithm.resume.other_world_size=refuse. "
        f"Either resume on {saved} GPUs "
        f"(trainer.nnodes x trainer.n_gpus_per_node = {saved}, e.g. trainer.nnodes={nodes} "
        f"trainer.n_gpus_per_node={per_node}), or reshard it (algorithm.resume.other_world_size=reshard, or "
        f"`python -m gtpo.trainer.resume.reshard --from {folder} --world-size {run}`), or merge its weights into a "
        "Hugging Face model, "
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


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            value = json.load(f)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _checkpoint_is_lora(role_dir: str, world_size: int) -> bool:
    """Whether verl saved only the adapter (``save_lora_only``: every model key a ``lora_`` / ``.adapter_`` one) or
    a model with adapters: any such key in rank 0's model file (memory-mapped, nothing read but the keys)."""
    from gtpo.trainer.resume.loads import load_checkpoint_file

    path = os.path.join(role_dir, shard_name("model", world_size, 0))
    if not os.path.lexists(path):
        return False
    try:
        state = load_checkpoint_file(path, "a shard file")
    except PermissionError as err:  # others could have written it: refused before anything is read
        raise RuntimeError(str(err)) from None
    except Exception as err:  # a truncated or foreign file, or one holding more than data: named, before any worker
        raise RuntimeError(f"{path} cannot be read as a torch.save file ({type(err).__name__}: {err})") from None
    return isinstance(state, dict) and any("lora_" in str(key) or ".adapter_" in str(key) for key in state)


def reshard_problems(folder: str, config: Any, layout: CheckpointLayout) -> list[str]:
    """Why the checkpoint ``folder`` cannot be resharded for the run ``config`` (an empty list when it can): what
    differs between the two is named with the keys to look at."""
    problems = []
    actor = os.path.join(folder, "actor")
    saved = checkpoint_world_size(folder)
    if layout.use_critic and not shard_files(os.path.join(folder, "critic")):
        problems.append(f"the run has a critic but {folder}/critic holds no critic shards")
    model_cfg = config.get("actor_rollout_ref", {}).get("model", None) or {}
    run_lora = int(model_cfg.get("lora_rank", 0) or 0) > 0
    try:
        saved_lora = saved is not None and _checkpoint_is_lora(actor, saved)
    except RuntimeError as err:
        return [*problems, str(err)]
    if saved_lora != run_lora:
        problems.append(
            f"the checkpoint holds {'LoRA adapters' if not run_lora else 'a full model without adapters'} and the run "
            f"trains {'the full model' if not run_lora else 'LoRA adapters'} "
            f"(actor_rollout_ref.model.lora_rank={model_cfg.get('lora_rank', 0)})"
        )
    ours = _read_json(os.path.join(str(model_cfg.get("path", "")), "config.json"))
    theirs = _read_json(os.path.join(actor, "huggingface", "config.json"))
    if ours is not None and theirs is not None:
        differ = [f"{k}: {theirs.get(k)!r} saved, {ours.get(k)!r} in the run" for k in MODEL_FIELDS
                  if theirs.get(k) != ours.get(k)]  # fmt: skip
        if differ:
            problems.append(
                f"the checkpoint is of another model than actor_rollout_ref.model.path={model_cfg.get('path')} "
                f"({'; '.join(differ)})"
            )
    actor_cfg = config.get("actor_rollout_ref", {}).get("actor", None) or {}
    fsdp_size = (actor_cfg.get("fsdp_config", None) or {}).get("fsdp_size", -1)
    run = run_world_size(config.trainer)
    if isinstance(fsdp_size, int) and 0 < fsdp_size < run:
        problems.append(
            f"actor_rollout_ref.actor.fsdp_config.fsdp_size={fsdp_size} < world size {run} (HSDP): resharding writes "
            "one-dimensional FSDP2 shards"
        )
    return problems


def checkpoint_bytes(folder: str) -> int:
    """Bytes of the model and optimizer shard files of the checkpoint ``folder`` (what a reshard reads and writes)."""
    total = 0
    for role in ROLE_DIRS:
        directory = os.path.join(folder, role)
        for size, files in shard_files(directory).items():
            for kind, rank in files:
                if kind in ("model", "optim"):
                    total += os.path.getsize(os.path.join(directory, shard_name(kind, size, rank)))
    return total


def check_in_job_reshard_size(folder: str, config: Any) -> None:
    """Refuse to reshard inside the job a checkpoint larger than ``algorithm.resume.reshard_in_job_max_gb``: every GPU
    of the allocation would wait for it (32B: 393 GB, read and written once), in a step whose memory limit is charged
    for the page cache it fills. The offline command on a login node does the same work, recoverably."""
    limit = knob(config.get("algorithm", None), "resume").reshard_in_job_max_gb
    size = checkpoint_bytes(folder) / 1e9
    if limit is None or size <= limit:
        return
    run = run_world_size(config.trainer)
    raise RuntimeError(
        f"{folder} holds {size:.0f} GB of model and optimizer shards, more than algorithm.resume."
        f"reshard_in_job_max_gb={limit:g}: resharding it to world size {run} inside the job would keep every GPU of "
        f"the job waiting. Reshard it offline first (a login node, no GPU): `python -m gtpo.trainer.resume.reshard "
        f"--from {folder} --world-size {run}` (in place and recoverable; --out <folder> writes a copy), then submit "
        "again; or set algorithm.resume.reshard_in_job_max_gb=null to reshard inside the job"
    )


def match_resume_world_size(folder: str, config: Any, layout: CheckpointLayout) -> dict[str, int]:
    """Make the checkpoint ``folder`` loadable at the run's world size, before any worker loads: nothing when it
    already is; otherwise refuse (``algorithm.resume.other_world_size=refuse``, or what :func:`reshard_problems`
    names) or reshard it in place. Returns ``{role: old world size}`` of what was resharded.

    Raises:
        RuntimeError: refused, naming why and the ways out.
    """
    from gtpo.trainer.resume.reshard import ReshardRefused, finish_interrupted_reshards, reshard_checkpoint

    folder = os.path.abspath(folder)
    finish_interrupted_reshards(folder)
    trainer_cfg = config.trainer
    run = run_world_size(trainer_cfg)
    try:
        sizes = {role: role_world_size(os.path.join(folder, role)) for role in ROLE_DIRS}
    except ValueError as err:  # a role folder mixing two sizes
        raise RuntimeError(f"cannot resume from {folder}: {err}; resume from another checkpoint") from None
    if all(size in (None, run) for size in sizes.values()):
        return {}
    if knob(config.get("algorithm", None), "resume").other_world_size == "refuse":
        check_resume_world_size(folder, trainer_cfg.nnodes, trainer_cfg.n_gpus_per_node)
        raise RuntimeError(f"cannot resume from {folder}: its critic is at another world size than {run}")
    if trainer_cfg.get("val_only", False):
        # An evaluation's driver reshards into a copy of its own (gtpo.launch.checks.reshard_evaluation_copy); the
        # run it evaluates may still be training from this folder.
        raise RuntimeError(
            f"cannot evaluate {folder} at world size {run} (saved at {sizes}): an evaluation never reshards the "
            "run's checkpoint in place; run it through scripts/eval_checkpoint.sh, or reshard a copy first: "
            f"`python -m gtpo.trainer.resume.reshard --from {folder} --world-size {run} --out <folder>`"
        )
    problems = reshard_problems(folder, config, layout)
    if problems:
        raise RuntimeError(f"cannot reshard {folder} to world size {run}: {'; '.join(problems)}")
    check_in_job_reshard_size(folder, config)
    try:
        done = reshard_checkpoint(folder, run)
    except ReshardRefused as err:
        raise RuntimeError(f"cannot reshard {folder} to world size {run}: {err}") from None
    print(f"gtpo: resharded {folder} to world size {run}: " + ", ".join(f"{r} from {w}" for r, w in done.items()))
    return done
