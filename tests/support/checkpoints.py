"""Checkpoint folders laid out as verl 0.9.1's ``_save_checkpoint`` writes them, and a trainer as far as its
checkpoint methods look.

verl's save writes, in this order: ``actor/`` (every rank's ``model_/optim_/extra_state_world_size_<W>_rank_<r>.pt``),
``critic/``, ``data.pt``, ``transfer_queue/``, the tracker, then the recipe's ``gtpo_state.json``
(gtpo/trainer/resume/checkpoints.py reads them back).
"""

from __future__ import annotations

from pathlib import Path

from gtpo.trainer.resume import checkpoint_state, checkpoints
from gtpo.trainer.resume.checkpoints import SHARD_KINDS, TRACKER_FILE

# verl's save, step by step; a kill after step i leaves SAVE_STEPS[:i] done.
SAVE_STEPS = ("actor", "data", "tracker", "state")


def write_shards(directory, world_size=1, kinds=SHARD_KINDS):
    """What verl's FSDP checkpoint manager writes into ``actor/`` (``critic/``) at ``world_size``."""
    (directory / "huggingface").mkdir(parents=True, exist_ok=True)
    for kind in kinds:
        for rank in range(world_size):
            (directory / checkpoints.shard_name(kind, world_size, rank)).write_bytes(b"tensors")


def save(root, step, upto=None, tracker_text=None, world_size=1, critic=False, async_mode=False):
    """Run verl's save sequence for ``step`` as far as ``upto`` steps; ``tracker_text`` replaces what verl writes."""
    folder = root / f"global_step_{step}"
    done = SAVE_STEPS[: len(SAVE_STEPS) if upto is None else upto]
    if "actor" in done:
        write_shards(folder / "actor", world_size)
        if critic:
            write_shards(folder / "critic", world_size)
    if "data" in done:
        (folder / "data.pt").write_bytes(b"dataloader")
        if async_mode:
            (folder / "transfer_queue").mkdir(exist_ok=True)
            (folder / "transfer_queue" / "trajectories.bin").write_bytes(b"stored trajectories")
    if "tracker" in done:
        (root / TRACKER_FILE).write_text(str(step) if tracker_text is None else tracker_text)
    if "state" in done:
        checkpoint_state.save_state(str(folder), step, checkpoint_state.new_state())
    return folder


def complete_checkpoint(folder: Path, step: int, world_size: int = 8) -> Path:
    """A checkpoint folder as the recipe's resume calls complete (gtpo/trainer/resume/checkpoints.py): every rank's
    shards in actor/, data.pt and gtpo_state.json of its step."""
    (folder / "actor").mkdir(parents=True)
    for kind in ("model", "optim", "extra_state"):
        for rank in range(world_size):
            (folder / "actor" / f"{kind}_world_size_{world_size}_rank_{rank}.pt").write_bytes(b"x")
    (folder / "data.pt").write_bytes(b"x")
    checkpoint_state.save_state(str(folder), step, checkpoint_state.new_state())
    return folder


def make_trainer(root, use_critic=False, **trainer):
    """A sync trainer as far as its checkpoint methods look: config and use_critic (no workers)."""
    from omegaconf import OmegaConf

    from gtpo.trainer.modes import GTPOTrainerSync

    trainer_cfg = {"default_local_dir": str(root), "nnodes": 1, "n_gpus_per_node": 1, "resume_mode": "auto"}
    contents = ["model", "optimizer", "extra"]
    role = {"strategy": "fsdp2", "checkpoint": {"save_contents": contents, "load_contents": contents}}
    out = object.__new__(GTPOTrainerSync)
    out.config = OmegaConf.create(
        {"trainer": {**trainer_cfg, **trainer}, "actor_rollout_ref": {"actor": role}, "critic": role, "algorithm": {}}
    )
    out.use_critic = use_critic
    return out
