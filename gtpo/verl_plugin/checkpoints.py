"""Which checkpoint a resume starts from, whatever instant of a save the previous attempt was killed at.

verl 0.9.1's ``_save_checkpoint`` (``verl/trainer/ppo/v1/trainer_base.py``) writes, in order: ``actor/`` (the
workers' shards and ``huggingface/``), ``critic/`` when there is a critic, ``data.pt`` (the dataloader),
``transfer_queue/`` in the asynchronous modes, then the tracker ``latest_checkpointed_iteration.txt`` *in place*
(``open(path, "w")`` then ``write``), then the checkpoint callback, where the recipe writes
``gtpo_state.json`` (:mod:`gtpo.verl_plugin.checkpoint_state`). On resume verl's ``find_latest_ckpt_path`` reads the
tracker with ``int(...)``: a kill between verl's ``open`` and ``write`` leaves an empty tracker, and every later
start fails with ``ValueError: invalid literal for int()``. The tracker write is verl's own (the recipe would have
to copy ``_save_checkpoint`` to replace it); what the recipe owns is the resume.

A ``global_step_<N>`` folder is **complete** when it holds everything ``_load_checkpoint`` reads and the file
written last: a non-empty ``actor/``, ``data.pt``, a non-empty ``critic/`` (with a critic), ``transfer_queue/``
(asynchronous modes) and a readable ``gtpo_state.json`` for step N. The state file is written after all the
others, so a folder that has it was written whole; a folder whose ``actor/`` verl's ``max_actor_ckpt_to_keep``
removed is not complete either.

:func:`resolve_auto_resume` (``trainer.resume_mode=auto``, before verl's ``_load_checkpoint``):

* a tracker naming a complete folder: that folder, as verl does;
* a tracker that is empty, unreadable, names a missing or incomplete folder, or is missing while complete folders
  exist: the newest complete ``global_step_<N>``, with a warning naming the tracker and why; the tracker is
  rewritten to name it (temporary file, flush, fsync, ``os.replace``), so verl's own lookup finds it;
* no tracker and no complete folder: no checkpoint was ever recorded, the run starts from scratch as in verl
  (a warning names any half-written folder, which the next save overwrites);
* a tracker but no complete folder: refused (``RuntimeError`` naming the folder and what each candidate lacks),
  since starting over would silently discard a run that did checkpoint.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

from gtpo.verl_plugin.checkpoint_state import STATE_FILE, read_state

__all__ = [
    "TRACKER_FILE",
    "CheckpointLayout",
    "incomplete_reasons",
    "newest_complete",
    "read_tracker",
    "resolve_auto_resume",
    "step_folders",
    "write_tracker",
]

TRACKER_FILE = "latest_checkpointed_iteration.txt"  # verl's get_checkpoint_tracker_filename
_STEP_DIR = re.compile(r"global_step_(\d+)")

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointLayout:
    """What verl writes into each checkpoint of this trainer."""

    use_critic: bool = False
    async_mode: bool = False  # colocate_async / separate_async save transfer_queue/


def _non_empty_dir(path: str) -> bool:
    try:
        with os.scandir(path) as it:
            return any(True for _ in it)
    except (FileNotFoundError, NotADirectoryError):
        return False


def incomplete_reasons(folder: str, step: int, layout: CheckpointLayout) -> list[str]:
    """Why ``folder`` (the checkpoint of ``step``) is not complete, e.g. ``["no data.pt"]``; ``[]`` when complete."""
    if not os.path.isdir(folder):
        return ["no such folder"]
    reasons = []
    if not _non_empty_dir(os.path.join(folder, "actor")):
        reasons.append("no actor/")
    if layout.use_critic and not _non_empty_dir(os.path.join(folder, "critic")):
        reasons.append("no critic/")
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
