"""The recipe's own state across steps, saved beside verl's checkpoint and restored on resume.

verl's checkpoint (``global_step_<N>/``: ``actor/``, ``data.pt`` with the dataloader state, the tracker
``latest_checkpointed_iteration.txt``) holds the weights, the optimiser and the data order. The recipe adds one
file per checkpoint, ``global_step_<N>/gtpo_state.json``, for what its estimators keep across steps: one block per
``stateful`` row of :data:`gtpo.methods.METHODS`, named by its estimator (:func:`new_state`), holding values the
estimator measured for knobs of its block left null. Today that is ``gtpo_traj.h_ini``, the ``<H>_ini`` that
``gtpo_traj``'s ini gate (``variant=paper``) measures on the first batch. The state belongs to the trainer
(:class:`gtpo.trainer.resume.hooks.ResumeHooks`), which lends each estimator its block; two trainers in one process
share nothing. Nothing else persists across steps: DAPO's round counter is reset at every ``sample()``, the forking
parameters are read from the config, and the reward cache holds pure results.

The file is the last one a save writes (:class:`StateAfterSave`, from verl's checkpoint callback, once the actor, the
critic, ``data.pt`` and ``transfer_queue/`` are written and the tracker updated; a stale copy is removed before each
save starts), so its presence marks a checkpoint written whole (:mod:`gtpo.trainer.resume.checkpoints`). It is
written to a temporary name and renamed, never half-written; removing an old checkpoint starts with it.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from gtpo.methods import METHODS

__all__ = [
    "STATE_FILE",
    "StateAfterSave",
    "discard_state",
    "new_state",
    "read_state",
    "restore_state",
    "save_state",
]

STATE_FILE = "gtpo_state.json"
_FORMAT = 1

logger = logging.getLogger(__name__)


def new_state() -> dict[str, dict[str, Any]]:
    """A trainer's cross-step state before anything is measured: an empty block per stateful method, named by its
    estimator (the ``state=`` the advantage hand-off passes it)."""
    return {row.adv_estimator: {} for row in METHODS.values() if row.stateful}


def save_state(folder: str, global_steps: int, state: dict[str, dict[str, Any]]) -> str:
    """Write ``state`` (a trainer's, JSON-ready) to ``<folder>/gtpo_state.json`` atomically; returns its path."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, STATE_FILE)
    payload = {"format": _FORMAT, "global_steps": int(global_steps), **state}
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def discard_state(folder: str) -> None:
    """Remove ``<folder>/gtpo_state.json`` (a save is about to rewrite the folder: a copy left from an earlier,
    abandoned attempt at this step must not mark the half-written folder complete)."""
    try:
        os.remove(os.path.join(folder, STATE_FILE))
    except FileNotFoundError:
        pass


def read_state(folder: str) -> dict[str, Any] | str:
    """The saved state of ``folder``, or why there is none usable (a string naming the file)."""
    path = os.path.join(folder, STATE_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            payload = json.load(f)
    except FileNotFoundError:
        return f"no {STATE_FILE}"
    except (OSError, ValueError) as e:
        return f"{STATE_FILE} unreadable ({type(e).__name__})"
    if not isinstance(payload, dict) or payload.get("format") != _FORMAT:
        got = payload.get("format") if isinstance(payload, dict) else payload
        return f"{STATE_FILE} has format={got!r}, this recipe reads format {_FORMAT}"
    return payload


class StateAfterSave:
    """verl's checkpoint callback (``trainer.checkpoint_callback_class``, a no-op by default) with the trainer's
    ``state`` written first: ``on_save`` runs after verl has written the checkpoint and its tracker.

    An asynchronous save (``async_save=True``, Megatron only in verl 0.9.1) may still be writing when the hook
    fires, so it gets no state file: such a checkpoint is never taken for complete.
    """

    def __init__(self, inner, state: dict[str, dict[str, Any]]):
        self.inner = inner
        self.state = state

    def on_save(self, trainer, global_step: int, checkpoint_dir: str, async_save: bool = False, **kwargs) -> None:
        if not async_save:
            save_state(checkpoint_dir, global_step, self.state)
        self.inner.on_save(
            trainer=trainer, global_step=global_step, checkpoint_dir=checkpoint_dir, async_save=async_save, **kwargs
        )

    def __getattr__(self, name):
        if name in ("inner", "state"):
            raise AttributeError(name)
        return getattr(self.inner, name)


def restore_state(folder: str, algorithm_config: Any, state: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Restore the state saved in ``folder`` into a trainer's ``state`` (in place); returns what was restored, as
    ``{"<block>.<key>": value}``.

    A measured value is restored unless the config sets the knob of that name in the method's block
    (``algorithm.gtpo_traj.h_ini``), which always wins. A checkpoint without the file (written by an older recipe)
    restores nothing; a ``gtpo_traj`` run with the ini gate then stops at its first step and asks for
    ``algorithm.gtpo_traj.h_ini``.
    """
    path = os.path.join(folder, STATE_FILE)
    if not os.path.exists(path):
        logger.warning("no %s in %s: the recipe's state starts empty", STATE_FILE, folder)
        return {}
    payload = read_state(folder)
    if isinstance(payload, str):
        raise ValueError(f"{path}: {payload}")
    restored: dict[str, Any] = {}
    for row in METHODS.values():
        if not row.stateful:
            continue
        node = algorithm_config.get(row.knobs, None) if algorithm_config is not None and row.knobs else None
        for key, value in (payload.get(row.adv_estimator) or {}).items():
            explicit = node.get(key, None) if node is not None else None
            if value is not None and explicit is None:
                state.setdefault(row.adv_estimator, {})[key] = value
                restored[f"{row.adv_estimator}.{key}"] = value
    return restored
