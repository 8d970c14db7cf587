"""The resume's hooks in verl's trainer: what each save adds and clears, and which checkpoint a resume loads."""

from __future__ import annotations

import os

from gtpo.trainer.resume import checkpoint_state, checkpoints
from gtpo.trainer.resume.checkpoint_world_size import discard_other_world_sizes, match_resume_world_size, run_world_size
from gtpo.trainer.resume.loads import refuse_unless_private
from gtpo.trainer.resume.reshard import finish_interrupted_reshards

__all__ = ["ResumeHooks"]


class ResumeHooks:
    """Checkpoints and resume on a verl v1 trainer, whatever instant the last attempt was killed at. Overrides:

    * ``__init__``: verl's checkpoint callback wrapped so that the recipe's state file (``gtpo_state.json``) is
      written last, marking the save complete (seam ``checkpoint-callback``, :mod:`.checkpoint_state`);
    * ``_save_checkpoint``: first removes what an abandoned attempt at this step left in its folder (a state file that
      would mark the half-written save complete, shards of another world size), then keeps
      ``trainer.max_actor_ckpt_to_keep`` checkpoints on disk counting earlier attempts' (:mod:`.checkpoints`);
    * ``_load_checkpoint``: ``resume_mode=auto`` resolved to the newest complete checkpoint before verl's own lookup,
      the checkpoint refused if others could have written into it (:func:`.loads.refuse_unless_private`, again right
      before verl's loads in this process; each worker checks its role folder itself, seam
      ``checkpoint-load-check``), a checkpoint of another world size resharded (or refused) before any worker loads
      (:mod:`.checkpoint_world_size`), then the recipe's state restored.

    The tracker file, verl's lookup and the pruned folders are the seam ``resume-tracker`` (docs/architecture.md).

    ``recipe_state`` is the trainer's cross-step state, one block per stateful method (:func:`.checkpoint_state.
    new_state`); the advantage hand-off lends each estimator its block.
    """

    def __init__(self, config):
        super().__init__(config)
        self.checkpoint_callback = checkpoint_state.StateAfterSave(self.checkpoint_callback, self.recipe_state)

    @property
    def recipe_state(self) -> dict:
        """This trainer's cross-step state: saved with each checkpoint, restored on resume."""
        return self.__dict__.setdefault("_recipe_state", checkpoint_state.new_state())

    def _save_checkpoint(self):
        folder = os.path.join(self.config.trainer.default_local_dir, f"global_step_{self.global_steps}")
        checkpoint_state.discard_state(folder)
        discard_other_world_sizes(folder, run_world_size(self.config.trainer))
        super()._save_checkpoint()
        self._prune_checkpoints()

    def _checkpoint_layout(self) -> checkpoints.CheckpointLayout:
        return checkpoints.layout_of(self.config, bool(self.use_critic), async_mode=self.trainer_mode != "sync")

    def _load_checkpoint(self):
        trainer_cfg = self.config.trainer
        resolved = None
        if trainer_cfg.resume_mode == "auto":
            root = trainer_cfg.default_local_dir
            if os.path.lexists(root):  # before anything in it is read or renamed
                refuse_unless_private(root, "trainer.default_local_dir", inside=False)
            # Before verl's own lookup, which fails on an empty tracker and trusts a half-written folder.
            finish_interrupted_reshards(root)
            resolved = checkpoints.resolve_auto_resume(root, self._checkpoint_layout())
        elif trainer_cfg.resume_mode == "resume_path" and isinstance(trainer_cfg.resume_from_path, str):
            resolved = os.path.abspath(trainer_cfg.resume_from_path)  # as verl resolves it
        if resolved is not None:
            # Again here: the driver's check was minutes ago (a folder may have been swapped since), or never (a
            # folder the driver does not see).
            refuse_unless_private(resolved)
            # Before any worker loads: at another world size each one would fail on a shard file that does not exist.
            match_resume_world_size(resolved, self.config, self._checkpoint_layout())
            refuse_unless_private(resolved)  # right before verl's loads here (data.pt, transfer_queue/)
        super()._load_checkpoint()
        if self.global_steps > 0:
            folder = self._resumed_checkpoint_folder(resolved)
            restored = checkpoint_state.restore_state(folder, self.config.algorithm, self.recipe_state)
            print(f"gtpo: resumed from {folder} at step {self.global_steps}; recipe state restored: {restored}")

    def _resumed_checkpoint_folder(self, resolved: str | None) -> str:
        """The ``global_step_<N>`` folder verl's ``_load_checkpoint`` resumed from (``resolved`` by ours)."""
        folder = resolved
        if self.config.trainer.resume_mode == "resume_path" and folder is not None:
            reasons = checkpoints.incomplete_reasons(folder, self.global_steps, self._checkpoint_layout())
            if reasons:
                # the user named this folder: loaded as asked, but said
                print(f"gtpo: warning: trainer.resume_from_path={folder} is incomplete: {', '.join(reasons)}")
        if folder is None or os.path.basename(os.path.normpath(folder)) != f"global_step_{self.global_steps}":
            raise RuntimeError(f"resumed at step {self.global_steps} but the checkpoint folder resolves to {folder}")
        return folder

    def _prune_checkpoints(self) -> None:
        """After a save: keep ``trainer.max_actor_ckpt_to_keep`` (``max_critic_ckpt_to_keep``) checkpoints on disk,
        counting those of earlier attempts too, which verl's in-process count forgets at each resume."""
        message = checkpoints.prune_for_trainer(self.config.trainer, self.global_steps, self._checkpoint_layout())
        if message:
            print(message)
