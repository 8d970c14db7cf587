"""Which checkpoint a resume starts from, whatever instant of a save the previous attempt was killed at, and which
checkpoints the disk keeps.

verl 0.9.1's ``_save_checkpoint`` (``verl/trainer/ppo/v1/trainer_base.py``) writes, in order: ``actor/`` (the
workers' shards and ``huggingface/``), ``critic/`` when there is a critic, ``data.pt`` (the dataloader),
``transfer_queue/`` in the asynchronous modes, then the tracker ``latest_checkpointed_iteration.txt`` *in place*
(``open(path, "w")`` then ``write``), then the checkpoint callback, where the recipe writes
``gtpo_state.json`` (:mod:`gtpo.trainer.resume.checkpoint_state`). On resume verl's ``find_latest_ckpt_path`` reads the
tracker with ``int(...)``: a kill between verl's ``open`` and ``write`` leaves an empty tracker, and every later
start fails with ``ValueError: invalid literal for int()``. The tracker write is verl's own (the recipe would have
to copy ``_save_checkpoint`` to replace it); what the recipe owns is the resume.

A ``global_step_<N>`` folder is **complete** when it holds everything ``_load_checkpoint`` reads and the file
written last: ``actor/`` with every rank's shards, ``data.pt``, ``critic/`` likewise (with a critic),
``transfer_queue/`` (asynchronous modes) and a readable ``gtpo_state.json`` for step N. verl's FSDP checkpoint
manager (``verl/utils/checkpoint/fsdp_checkpoint_manager.py``) writes one file per rank and content,
``{model,optim,extra_state}_world_size_<W>_rank_<r>.pt``, and each rank loads the files named with the run's world
size and its own rank. So ``actor/`` (and ``critic/``) must hold, for the ``W`` its file names give, ranks
``0..W-1`` of every content the resume loads (``checkpoint.load_contents``, by default what ``save_contents``
wrote: all three) and of every content present, none of them empty, and files of one ``W`` only. On another
strategy (Megatron: its own format) a non-empty folder is all that is checked. The state file is written after all
the others, so a folder without it was not written whole; the shard check catches what goes missing after it (a
removal cut short, a node's write-back cache lost), which would otherwise fail the resume inside ``torch.load``.
A folder whose ``actor/`` verl's ``max_actor_ckpt_to_keep`` removed is not complete either.

:func:`resolve_auto_resume` (``trainer.resume_mode=auto``, before verl's ``_load_checkpoint``):

* a tracker naming a complete folder: that folder, as verl does;
* a tracker that is empty, unreadable, names a missing or incomplete folder, or is missing while complete folders
  exist: the newest complete ``global_step_<N>``, with a warning naming the tracker and why; the tracker is
  rewritten to name it (temporary file, flush, fsync, ``os.replace``), so verl's own lookup finds it;
* no tracker and no complete folder: no checkpoint was ever recorded, the run starts from scratch as in verl
  (a warning names any half-written folder, which the next save overwrites);
* a tracker but no complete folder: refused (``RuntimeError`` naming the folder and what each candidate lacks),
  since starting over would silently discard a run that did checkpoint.

verl's tracker, its lookup and its folders are the seam ``resume-tracker`` of docs/architecture.md.

**World size.** A checkpoint saved by ``W`` ranks cannot be loaded by another number:
:mod:`gtpo.trainer.resume.checkpoint_world_size` refuses such a resume before any worker loads.

**Retention.** verl's ``max_actor_ckpt_to_keep`` counts only the saves of the running process: after a resume the
earlier checkpoints are never deleted, and nothing deletes ``transfer_queue/`` (the asynchronous modes' stored
trajectories). After each save, :func:`prune_checkpoints` keeps the folder just saved and the newest ``K - 1``
complete folders of lower steps, ``K`` being ``trainer.max_actor_ckpt_to_keep`` (with a critic, the smaller of it
and ``trainer.max_critic_ckpt_to_keep``: a checkpoint lacking either cannot be resumed); null or <= 0 keeps every
checkpoint, as in verl. Every other folder of a lower step is removed whole (``actor/``, ``critic/``, ``data.pt``,
``transfer_queue/``), complete or not: a lower step than a complete save can no longer be resumed by ``auto``. The
removal starts with ``gtpo_state.json``, so a folder whose removal is cut short never passes for complete, and the
next save finishes it. Never touched: the folder the tracker names, the folder just saved (nothing is removed at
all when it is not complete, e.g. an asynchronous save still writing) and folders of higher steps (a killed
attempt's later saves after a resume from an earlier one; they are rewritten or pruned once the run passes them).
So the disk holds at most ``K`` checkpoints of steps up to the latest save however often the job is requeued.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from dataclasses import dataclass
from typing import Any

from gtpo.trainer.resume.checkpoint_state import STATE_FILE, discard_state, read_state

__all__ = [
    "ROLE_DIRS",
    "SHARD_KINDS",
    "TRACKER_FILE",
    "CheckpointLayout",
    "incomplete_reasons",
    "layout_of",
    "loaded_shards",
    "newest_complete",
    "prune_checkpoints",
    "read_tracker",
    "resolve_auto_resume",
    "role_world_size",
    "shard_files",
    "shard_name",
    "step_folders",
    "write_tracker",
]

TRACKER_FILE = "latest_checkpointed_iteration.txt"  # verl's get_checkpoint_tracker_filename
_STEP_DIR = re.compile(r"global_step_(\d+)")

# The per-rank files of verl's FSDPCheckpointManager, and the checkpoint.load_contents entry that loads each.
SHARD_KINDS = ("model", "optim", "extra_state")
_CONTENT_OF_KIND = {"model": "model", "optim": "optimizer", "extra_state": "extra"}
_SHARD_FILE = re.compile(r"(model|optim|extra_state)_world_size_(\d+)_rank_(\d+)\.pt")
_FSDP_STRATEGIES = frozenset({"fsdp", "fsdp2"})
ROLE_DIRS = ("actor", "critic")  # verl's folder names for Role.Actor* and Role.Critic

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointLayout:
    """What verl writes into each checkpoint of this trainer."""

    use_critic: bool = False
    async_mode: bool = False  # colocate_async / separate_async save transfer_queue/
    # The per-rank files the resume loads from actor/ (critic/), from loaded_shards(); () on a non-FSDP strategy.
    actor_shards: tuple[str, ...] = SHARD_KINDS
    critic_shards: tuple[str, ...] = SHARD_KINDS


def shard_name(kind: str, world_size: int, rank: int) -> str:
    """verl's name of one rank's file, e.g. ``model_world_size_2_rank_1.pt``."""
    return f"{kind}_world_size_{world_size}_rank_{rank}.pt"


def loaded_shards(role_config: Any) -> tuple[str, ...]:
    """The kinds of per-rank file (:data:`SHARD_KINDS`) a resume loads for one role, from its config block
    (``actor_rollout_ref.actor`` or ``critic``): one per entry of ``checkpoint.load_contents`` (verl's default: model,
    optimizer, extra) on ``strategy`` fsdp/fsdp2; ``()`` on another strategy, whose format is not read here."""
    if str(role_config.get("strategy", "fsdp")) not in _FSDP_STRATEGIES:
        return ()
    contents = (role_config.get("checkpoint", None) or {}).get("load_contents", None)
    if contents is None:
        contents = ["model", "optimizer", "extra"]  # BaseCheckpointManager's default
    return tuple(kind for kind in SHARD_KINDS if _CONTENT_OF_KIND[kind] in contents)


def layout_of(config: Any, use_critic: bool, async_mode: bool) -> CheckpointLayout:
    """The :class:`CheckpointLayout` of a run of ``config`` (the trainer's, and the entry point's before Ray starts):
    the shards each role's resume loads (:func:`loaded_shards`)."""
    return CheckpointLayout(
        use_critic=use_critic,
        async_mode=async_mode,
        actor_shards=loaded_shards(config.actor_rollout_ref.actor),
        critic_shards=loaded_shards(config.critic) if use_critic else (),
    )


def shard_files(directory: str) -> dict[int, dict[tuple[str, int], int]]:
    """``{W: {(kind, rank): size in bytes}}`` of the shard files in ``directory``."""
    found: dict[int, dict[tuple[str, int], int]] = {}
    try:
        with os.scandir(directory) as it:
            for entry in it:
                m = _SHARD_FILE.fullmatch(entry.name)
                if m and entry.is_file():
                    found.setdefault(int(m.group(2)), {})[(m.group(1), int(m.group(3)))] = entry.stat().st_size
    except (FileNotFoundError, NotADirectoryError):
        pass
    return found


def role_world_size(directory: str) -> int | None:
    """The one world size of the shard files in ``directory`` (a role folder, ``actor/`` or ``critic/``); None
    without any.

    Raises:
        ValueError: files of several world sizes, naming them.
    """
    found = shard_files(directory)
    if len(found) > 1:
        raise ValueError(f"{directory} mixes the shards of world sizes {', '.join(map(str, sorted(found)))}")
    return next(iter(found), None)


def _some(names: list[str], shown: int = 3) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _non_empty_dir(path: str) -> bool:
    try:
        with os.scandir(path) as it:
            return any(True for _ in it)
    except (FileNotFoundError, NotADirectoryError):
        return False


def _role_reasons(folder: str, role: str, kinds: tuple[str, ...]) -> list[str]:
    """Why ``folder/<role>/`` cannot be loaded: missing, another world size's files mixed in, or shards lacking."""
    path = os.path.join(folder, role)
    if not _non_empty_dir(path):
        return [f"no {role}/"]
    found = shard_files(path)
    if len(found) > 1:
        return [f"{role}/ mixes the shards of world sizes {', '.join(map(str, sorted(found)))}"]
    if not found:
        return [f"{role}/ has no {kinds[0]}_world_size_<W>_rank_<r>.pt"] if kinds else []
    ((world_size, files),) = found.items()
    # The loaded kinds, and any other kind saved: a partial set of it means files were lost.
    wanted = [kind for kind in SHARD_KINDS if kind in kinds or any(k == kind for k, _ in files)]
    missing = [shard_name(k, world_size, r) for k in wanted for r in range(world_size) if (k, r) not in files]
    empty = [shard_name(k, world_size, r) for k in wanted for r in range(world_size) if files.get((k, r)) == 0]
    reasons = []
    if missing:
        reasons.append(f"{role}/ lacks {_some(missing)}")
    if empty:
        reasons.append(f"{role}/ has an empty {_some(empty)}")
    return reasons


def incomplete_reasons(folder: str, step: int, layout: CheckpointLayout) -> list[str]:
    """Why ``folder`` (the checkpoint of ``step``) is not complete, e.g. ``["no data.pt"]``; ``[]`` when complete."""
    if not os.path.isdir(folder):
        return ["no such folder"]
    reasons = _role_reasons(folder, "actor", layout.actor_shards)
    if layout.use_critic:
        reasons += _role_reasons(folder, "critic", layout.critic_shards)
    if not os.path.isfile(os.path.join(folder, "data.pt")):
        reasons.append("no data.pt")
    if layout.async_mode and not os.path.isdir(os.path.join(folder, "transfer_queue")):
        reasons.append("no transfer_queue/")
    state = read_state(folder)
    if isinstance(state, str):
        reasons.append(state)
    elif state.get("global_steps") != step:
        reasons.append(f"{STATE_FILE} is of step {state.get('global_steps')!r}")
    return reasons


def step_folders(root: str) -> dict[int, str]:
    """``{N: path}`` of the ``global_step_<N>`` folders in ``root``."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return {}
    out = {}
    for name in names:
        m = _STEP_DIR.fullmatch(name)
        if m and os.path.isdir(os.path.join(root, name)):
            out[int(m.group(1))] = os.path.join(root, name)
    return out


def newest_complete(root: str, layout: CheckpointLayout) -> tuple[int, str] | None:
    """The complete checkpoint of the highest step in ``root``, as ``(step, folder)``."""
    for step, folder in sorted(step_folders(root).items(), reverse=True):
        if not incomplete_reasons(folder, step, layout):
            return step, folder
    return None


def _retention_limit(max_ckpt_to_keep: Any) -> int | None:
    """verl's reading of ``max_*_ckpt_to_keep``: a positive int is a limit, anything else keeps all (None)."""
    if isinstance(max_ckpt_to_keep, int) and max_ckpt_to_keep > 0:
        return max_ckpt_to_keep
    return None


def _remove_checkpoint(folder: str) -> bool:
    try:
        discard_state(folder)  # first: a removal cut short leaves a folder that no longer passes for complete
        shutil.rmtree(folder)
    except OSError as err:
        logger.warning("could not remove the old checkpoint %s (%s); the next save tries again", folder, err)
        return False
    return True


def prune_checkpoints(
    root: str,
    saved_step: int,
    layout: CheckpointLayout,
    max_actor_ckpt_to_keep: Any,
    max_critic_ckpt_to_keep: Any = None,
) -> list[str]:
    """After the save of ``saved_step`` into ``root``: remove the checkpoint folders of lower steps that the
    retention limits do not keep (the rule is in the module docstring). Returns the removed folders."""
    limits = [_retention_limit(max_actor_ckpt_to_keep)]
    if layout.use_critic:
        limits.append(_retention_limit(max_critic_ckpt_to_keep))
    limits = [k for k in limits if k is not None]
    if not limits:
        return []
    folders = step_folders(root)
    saved = folders.get(saved_step)
    if saved is None or incomplete_reasons(saved, saved_step, layout):
        return []  # the older checkpoints may be the newest complete ones
    tracked, _ = read_tracker(root)
    room = min(limits) - 1  # the folder just saved is the first one kept
    removed = []
    for step in sorted((s for s in folders if s < saved_step), reverse=True):
        folder = folders[step]
        if step == tracked:
            continue
        if room > 0 and not incomplete_reasons(folder, step, layout):
            room -= 1
            continue
        if _remove_checkpoint(folder):
            removed.append(folder)
    return removed


def read_tracker(root: str) -> tuple[int | None, str]:
    """``(step, "")`` from ``root``'s tracker, or ``(None, why not)``: ``missing``, ``empty``, ``unreadable...``."""
    path = os.path.join(root, TRACKER_FILE)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None, "missing"
    except OSError as e:
        return None, f"unreadable ({e.strerror})"
    text = raw.decode("utf-8", errors="replace").strip()
    if not text:
        return None, "empty"
    if not text.isdigit():
        return None, f"unreadable: {text[:40]!r} is not a step number"
    return int(text), ""


def write_tracker(root: str, step: int) -> str:
    """Write ``root``'s tracker naming ``step`` atomically (temporary file, flush, fsync, ``os.replace``)."""
    path = os.path.join(root, TRACKER_FILE)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(str(int(step)))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    try:
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)  # the rename itself survives a node crash
        finally:
            os.close(fd)
    except OSError:
        pass
    return path


def _candidates(root: str, layout: CheckpointLayout) -> str:
    folders = step_folders(root)
    if not folders:
        return "no global_step_<N> folder"
    parts = [f"global_step_{s}: {', '.join(incomplete_reasons(f, s, layout))}" for s, f in sorted(folders.items())]
    return "; ".join(parts)


def resolve_auto_resume(root: str, layout: CheckpointLayout) -> str | None:
    """The ``global_step_<N>`` folder ``resume_mode=auto`` resumes from (None: from scratch); see the module
    docstring. Leaves the tracker naming it.

    Raises:
        RuntimeError: a tracker exists but no complete checkpoint does.
    """
    root = os.path.abspath(root)
    tracker = os.path.join(root, TRACKER_FILE)
    step, why = read_tracker(root)
    if step is not None:
        folder = os.path.join(root, f"global_step_{step}")
        reasons = incomplete_reasons(folder, step, layout)
        if not reasons:
            return folder
        problem = f"names global_step_{step}, which is incomplete ({', '.join(reasons)})"
    else:
        problem = {"missing": "does not exist", "empty": "is empty"}.get(why, f"is {why}")
    found = newest_complete(root, layout)
    if found is None:
        if why == "missing":
            if step_folders(root):
                logger.warning(
                    "no %s and no complete checkpoint in %s (%s): training from scratch",
                    tracker,
                    root,
                    _candidates(root, layout),
                )
            return None
        raise RuntimeError(
            f"{tracker} {problem}, and {root} holds no complete checkpoint ({_candidates(root, layout)}). "
            "Nothing to resume from: set trainer.resume_mode=disable to start over, or trainer.resume_mode=resume_path "
            "with trainer.resume_from_path=<a global_step_<N> folder>."
        )
    step, folder = found
    logger.warning(
        "%s %s: resuming from %s, the newest complete checkpoint; the tracker now names it", tracker, problem, folder
    )
    write_tracker(root, step)
    return folder


def prune_for_trainer(trainer_cfg: Any, saved_step: int, layout: CheckpointLayout) -> str | None:
    """:func:`prune_checkpoints` with the trainer's retention knobs (verl's deprecated
    ``remove_previous_ckpt_in_save`` keeps 1); a line naming what was removed, or None."""
    keep_one = trainer_cfg.get("remove_previous_ckpt_in_save", False)
    keep_actor = 1 if keep_one else trainer_cfg.get("max_actor_ckpt_to_keep", None)
    keep_critic = 1 if keep_one else trainer_cfg.get("max_critic_ckpt_to_keep", None)
    removed = prune_checkpoints(trainer_cfg.default_local_dir, saved_step, layout, keep_actor, keep_critic)
    if not removed:
        return None
    return (
        f"gtpo: removed {len(removed)} older checkpoint folder(s) beyond trainer.max_actor_ckpt_to_keep="
        f"{keep_actor} (max_critic_ckpt_to_keep={keep_critic}): {', '.join(removed)}"
    )
