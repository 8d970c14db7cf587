"""Which checkpoint ``resume_mode=auto`` starts from after a kill at any instant of a save (``checkpoints``).

    PYTHONPATH=$PWD .venv/bin/python -m pytest -q tests/test_resume_checkpoint.py

Folders are laid out as verl 0.9.1's ``_save_checkpoint`` writes them, in its order: ``actor/`` (every rank's
``model_/optim_/extra_state_world_size_<W>_rank_<r>.pt``), ``critic/``, ``data.pt``, ``transfer_queue/``, the tracker,
then the recipe's ``gtpo_state.json`` (tests/support/checkpoints.py). Each test stops that sequence where a kill
would. The shard set, the world size and retention: tests/test_checkpoint_shards.py. The same states through the
real trainer: tests/test_e2e_resume.py.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat

import pytest

from gtpo.trainer.resume import checkpoint_state, checkpoints
from gtpo.trainer.resume.checkpoints import TRACKER_FILE, CheckpointLayout, resolve_auto_resume
from tests.support.checkpoints import make_trainer, save, write_shards

SYNC = CheckpointLayout()


@pytest.fixture
def root(tmp_path):
    path = tmp_path / "ckpt"
    path.mkdir()
    return path


def test_a_finished_save_resumes_where_the_tracker_points(root, caplog):
    save(root, 2)
    save(root, 4)
    with caplog.at_level(logging.WARNING):
        assert resolve_auto_resume(str(root), SYNC) == str(root / "global_step_4")
    assert caplog.records == []
    assert (root / TRACKER_FILE).read_text() == "4"


@pytest.mark.parametrize(
    "upto,tracker_text,expected_step",
    [
        (1, None, 4),  # killed while the actor was written: the tracker still names 4
        (2, None, 4),  # killed after data.pt, before the tracker
        (3, "", 4),  # killed between verl's open("w") and write: an empty tracker
        (3, None, 4),  # killed after the tracker, before the recipe's state file: 6 is not complete
        (4, None, 6),  # the whole save
    ],
    ids=["in-actor", "before-tracker", "empty-tracker", "before-state", "done"],
)
def test_a_kill_at_each_instant_of_a_save(root, caplog, upto, tracker_text, expected_step):
    save(root, 2)
    save(root, 4)
    save(root, 6, upto=upto, tracker_text=tracker_text)
    with caplog.at_level(logging.WARNING, logger="gtpo.trainer.resume.checkpoints"):
        folder = resolve_auto_resume(str(root), SYNC)
    assert folder == str(root / f"global_step_{expected_step}")
    assert (root / TRACKER_FILE).read_text() == str(expected_step)
    warned = [r.getMessage() for r in caplog.records]
    if upto in (1, 2, 4):
        assert warned == []
    else:
        (message,) = warned
        assert str(root / TRACKER_FILE) in message and "global_step_4" in message


def test_verl_alone_fails_on_the_empty_tracker_every_time(root):
    """The failure the resolution prevents: verl 0.9.1's own lookup on the state an empty-tracker kill leaves."""
    from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

    save(root, 4)
    save(root, 6, upto=3, tracker_text="")
    with pytest.raises(ValueError, match="invalid literal for int"):
        find_latest_ckpt_path(str(root))
    resolve_auto_resume(str(root), SYNC)
    assert find_latest_ckpt_path(str(root)) == str(root / "global_step_4")  # the rewritten tracker reads


@pytest.mark.parametrize(
    "tracker_text,why",
    [
        ("\x00\x00", "is unreadable"),
        ("six", "is unreadable: 'six' is not a step number"),
        ("8", "names global_step_8, which is incomplete (no such folder)"),
    ],
)
def test_an_unreadable_tracker_or_one_naming_a_missing_folder(root, caplog, tracker_text, why):
    save(root, 4)
    (root / TRACKER_FILE).write_text(tracker_text)
    with caplog.at_level(logging.WARNING, logger="gtpo.trainer.resume.checkpoints"):
        assert resolve_auto_resume(str(root), SYNC) == str(root / "global_step_4")
    assert why in caplog.records[0].getMessage()


def test_incomplete_folders_are_skipped_for_the_newest_complete_one(root):
    save(root, 2)
    old = save(root, 4)
    shutil.rmtree(old / "actor")  # verl's max_actor_ckpt_to_keep removed step 4's actor/
    stale = save(root, 6, upto=2)
    checkpoint_state.save_state(str(stale), 5, checkpoint_state.new_state())  # a state file of another step
    save(root, 8, upto=3)
    assert resolve_auto_resume(str(root), SYNC) == str(root / "global_step_2")
    assert checkpoints.incomplete_reasons(str(old), 4, SYNC) == ["no actor/"]
    assert checkpoints.incomplete_reasons(str(stale), 6, SYNC) == ["gtpo_state.json is of step 5"]


def test_critic_and_transfer_queue_are_required_where_verl_writes_them(root):
    folder = save(root, 4)
    assert checkpoints.incomplete_reasons(str(folder), 4, CheckpointLayout(use_critic=True, async_mode=True)) == [
        "no critic/",
        "no transfer_queue/",
    ]
    write_shards(folder / "critic")
    (folder / "transfer_queue").mkdir()
    assert checkpoints.incomplete_reasons(str(folder), 4, CheckpointLayout(use_critic=True, async_mode=True)) == []


def test_no_complete_checkpoint_behind_a_tracker_is_refused_naming_the_folder(root):
    save(root, 2, upto=3)  # the first save, killed before the state file
    with pytest.raises(RuntimeError) as err:
        resolve_auto_resume(str(root), SYNC)
    message = str(err.value)
    assert str(root) in message and "global_step_2: no gtpo_state.json" in message
    assert "trainer.resume_mode=disable" in message
    (root / TRACKER_FILE).write_text("")
    with pytest.raises(RuntimeError, match="is empty"):
        resolve_auto_resume(str(root), SYNC)


def test_without_a_tracker(root, caplog, tmp_path):
    assert resolve_auto_resume(str(tmp_path / "never_created"), SYNC) is None  # a first run
    save(root, 2, upto=2)  # the first save, killed before the tracker: nothing was ever recorded
    with caplog.at_level(logging.WARNING, logger="gtpo.trainer.resume.checkpoints"):
        assert resolve_auto_resume(str(root), SYNC) is None
    assert "training from scratch" in caplog.records[0].getMessage()
    # complete, but the tracker was deleted
    checkpoint_state.save_state(str(root / "global_step_2"), 2, checkpoint_state.new_state())
    assert resolve_auto_resume(str(root), SYNC) == str(root / "global_step_2")
    assert (root / TRACKER_FILE).read_text() == "2"


def test_the_newest_checkpoint_is_the_highest_step_not_the_last_name(root):
    """``global_step_10`` sorts before ``global_step_9`` as a name; a broken tracker must still lead to 10."""
    save(root, 9)
    save(root, 10)
    (root / TRACKER_FILE).write_text("ten")
    assert resolve_auto_resume(str(root), SYNC) == str(root / "global_step_10")
    assert (root / TRACKER_FILE).read_text() == "10"


def test_an_empty_actor_folder_is_incomplete(root):
    save(root, 2)
    folder = save(root, 4)
    shutil.rmtree(folder / "actor")
    (folder / "actor").mkdir()  # created, nothing written into it yet
    assert checkpoints.incomplete_reasons(str(folder), 4, SYNC) == ["no actor/"]
    assert resolve_auto_resume(str(root), SYNC) == str(root / "global_step_2")


def test_a_critic_run_needs_its_critic(root):
    with_critic = CheckpointLayout(use_critic=True)
    save(root, 2, critic=True)
    folder = save(root, 4)  # critic/ never written
    assert checkpoints.incomplete_reasons(str(folder), 4, with_critic) == ["no critic/"]
    assert checkpoints.incomplete_reasons(str(folder), 4, SYNC) == []
    assert resolve_auto_resume(str(root), with_critic) == str(root / "global_step_2")


def test_a_stray_copy_beside_the_step_folders_is_ignored(root):
    save(root, 4)
    shutil.copytree(save(root, 9), root / "global_step_9.bak")  # a complete folder under another name
    shutil.rmtree(root / "global_step_9")
    assert checkpoints.step_folders(str(root)) == {4: str(root / "global_step_4")}
    assert resolve_auto_resume(str(root), SYNC) == str(root / "global_step_4")  # the tracker names the gone 9
    assert (root / TRACKER_FILE).read_text() == "4"


def test_the_tracker_is_fsynced_before_its_rename(root, monkeypatch):
    """The order a node crash needs: the new tracker's bytes on disk, then the rename, then the folder entry."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        st = os.fstat(fd)
        events.append(("fsync", "folder" if stat.S_ISDIR(st.st_mode) else f"file of {st.st_size} bytes"))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.path.basename(dst), open(src).read()))
        real_replace(src, dst)

    monkeypatch.setattr(checkpoints.os, "fsync", fsync)
    monkeypatch.setattr(checkpoints.os, "replace", replace)
    checkpoints.write_tracker(str(root), 12)
    monkeypatch.undo()
    assert events == [("fsync", "file of 2 bytes"), ("replace", TRACKER_FILE, "12"), ("fsync", "folder")]
    assert (root / TRACKER_FILE).read_text() == "12"


def test_tracker_write_is_atomic(root, monkeypatch):
    (root / TRACKER_FILE).write_text("4")

    def killed(*args):
        raise KeyboardInterrupt  # a kill between the temporary file and the rename

    monkeypatch.setattr(checkpoints.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        checkpoints.write_tracker(str(root), 6)
    assert (root / TRACKER_FILE).read_text() == "4"  # the old tracker is whole
    monkeypatch.undo()
    checkpoints.write_tracker(str(root), 6)
    assert (root / TRACKER_FILE).read_text() == "6"


def test_the_state_file_comes_after_verls_save_and_a_stale_one_goes_first(root, monkeypatch):
    """The trainer's ``_save_checkpoint`` discards a state file left at this step, and the callback verl calls after
    its tracker write (``StateAfterSave``) writes the new one before the user's callback runs."""
    from verl.trainer.ppo.checkpoint_callback import CheckpointCallback
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    seen = {}

    class UserCallback(CheckpointCallback):
        def on_save(self, trainer, global_step, checkpoint_dir, async_save=False, **kwargs):
            seen["user"] = checkpoint_state.read_state(checkpoint_dir)

    stale = save(root, 6, upto=2)
    # left by an attempt whose later save was abandoned
    checkpoint_state.save_state(str(stale), 6, checkpoint_state.new_state())

    def verl_save(trainer):  # what verl's _save_checkpoint does around its callback
        seen["during"] = checkpoint_state.read_state(str(stale))
        (root / TRACKER_FILE).write_text("6")
        trainer.checkpoint_callback.on_save(trainer=trainer, global_step=6, checkpoint_dir=str(stale))

    monkeypatch.setattr(PPOTrainerSync, "_save_checkpoint", verl_save)
    trainer = make_trainer(root)
    trainer.global_steps = 6
    trainer.checkpoint_callback = checkpoint_state.StateAfterSave(UserCallback(), checkpoint_state.new_state())
    trainer._save_checkpoint()
    assert seen["during"] == "no gtpo_state.json"
    assert seen["user"]["global_steps"] == 6
    async_callback = checkpoint_state.StateAfterSave(UserCallback(), checkpoint_state.new_state())
    checkpoint_state.discard_state(str(stale))
    async_callback.on_save(trainer=trainer, global_step=6, checkpoint_dir=str(stale), async_save=True)
    assert seen["user"] == "no gtpo_state.json"  # an asynchronous save may still be writing: never complete


@pytest.mark.parametrize(
    "save_freq,strategy,async_save,refused",
    [(10, "fsdp2", True, True), (10, "fsdp2", False, False), (-1, "fsdp2", True, False), (10, "megatron", True, False)],
)
def test_an_asynchronous_fsdp_save_is_refused_at_startup(save_freq, strategy, async_save, refused):
    """verl's v1 trainer writes no tracker for an asynchronous save: on FSDP nothing saved could be resumed."""
    from omegaconf import OmegaConf

    from gtpo.launch.checks import check_checkpoint_saves

    config = OmegaConf.create(
        {
            "trainer": {"save_freq": save_freq},
            "actor_rollout_ref": {"actor": {"strategy": strategy, "checkpoint": {"async_save": async_save}}},
        }
    )
    if refused:
        with pytest.raises(ValueError, match="async_save=true with actor.strategy=fsdp2"):
            check_checkpoint_saves(config)
    else:
        check_checkpoint_saves(config)
