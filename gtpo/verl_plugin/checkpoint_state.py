"""The recipe's own state across steps, saved beside verl's checkpoint and restored on resume.

verl's checkpoint (``global_step_<N>/``: ``actor/``, ``data.pt`` with the dataloader state, the tracker
``latest_checkpointed_iteration.txt``) holds the weights, the optimiser and the data order. The recipe adds one
file per checkpoint, ``global_step_<N>/gtpo_state.json``, for the state its estimators keep in the trainer process:

- ``gtpo_traj.h_ini``: the ``<H>_ini`` that ``gtpo_traj``'s ini gate (``variant=paper``) measured on the first
  batch (``gtpo.verl_plugin.trajectory.current_h_ini()``); null if nothing was measured. On resume it is restored
  unless ``algorithm.gtpo_traj.h_ini`` is set, which always wins.

Nothing else persists across steps: DAPO's generation-round counter (``dynamic_sampling.BoundedDapoReplayBuffer``)
is reset at every ``sample()`` call, the forking-token parameters are read from the config, and the reward cache
holds pure results. The file is written before verl writes the tracker, so a checkpoint the tracker names always
has it; it is written to a temporary name and renamed, so it is never half-written.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from gtpo.verl_plugin import trajectory

__all__ = ["STATE_FILE", "collect_state", "restore_state", "save_state"]

STATE_FILE = "gtpo_state.json"
_FORMAT = 1

logger = logging.getLogger(__name__)


def collect_state() -> dict[str, Any]:
    """The recipe's cross-step state of this process, as JSON-ready values."""
    return {"gtpo_traj": {"h_ini": trajectory.current_h_ini()}}


def save_state(folder: str, global_steps: int) -> str:
    """Write ``<folder>/gtpo_state.json`` atomically; returns its path."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, STATE_FILE)
    payload = {"format": _FORMAT, "global_steps": int(global_steps), **collect_state()}
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def restore_state(folder: str, algorithm_config: Any) -> dict[str, Any]:
    """Restore the state saved in ``folder`` into this process; returns what was restored.

    A checkpoint without the file (written by an older recipe) restores nothing; a ``gtpo_traj`` run with the ini
    gate then stops at its first step and asks for ``algorithm.gtpo_traj.h_ini``. An explicit
    ``algorithm.gtpo_traj.h_ini`` is never overwritten.
    """
    path = os.path.join(folder, STATE_FILE)
    if not os.path.exists(path):
        logger.warning("no %s in %s: the recipe's state starts empty", STATE_FILE, folder)
        return {}
    with open(path, encoding="utf-8") as f:
        payload = json.load(f)
    if payload.get("format") != _FORMAT:
        raise ValueError(f"{path}: format={payload.get('format')!r}, this recipe reads format {_FORMAT}")
    restored: dict[str, Any] = {}
    h_ini = (payload.get("gtpo_traj") or {}).get("h_ini")
    traj_node = algorithm_config.get("gtpo_traj", None) if algorithm_config is not None else None
    explicit = traj_node.get("h_ini", None) if traj_node is not None else None
    if h_ini is not None and explicit is None:
        trajectory.set_h_ini(float(h_ini))
        restored["gtpo_traj.h_ini"] = float(h_ini)
    return restored
