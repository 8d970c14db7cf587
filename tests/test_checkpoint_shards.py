"""Every rank's shards, the world size a checkpoint was saved at, and how many checkpoints the disk keeps
(``checkpoints``: ``incomplete_reasons``, ``check_resume_world_size``, ``prune_checkpoints``).

    PYTHONPATH=$PWD .venv/bin/python -m pytest -q tests/test_checkpoint_shards.py

Folders are laid out as verl 0.9.1's FSDP checkpoint manager and ``_save_checkpoint`` write them (the ``save``
helper of tests/test_resume_checkpoint.py). A "resume" here is what it is to the recipe: a new process that knows
nothing of the earlier saves but what is on disk.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import shutil
import sys

import pytest
from omegaconf import OmegaConf

from gtpo.launch.checks import ResumeRefused, check_world_size_before_launch
from gtpo.trainer.resume import checkpoint_state, checkpoint_world_size, checkpoints
from gtpo.trainer.resume.checkpoints import TRACKER_FILE, CheckpointLayout, prune_checkpoints, resolve_auto_resume
from tests.support.checkpoints import make_trainer, save, write_shards

SYNC = CheckpointLayout()
ASYNC = CheckpointLayout(async_mode=True)


@pytest.fixture
def root(tmp_path):
    path = tmp_path / "ckpt"
    path.mkdir()
    return path


# ------------------------------------------------------------------------------------------------- the shard set


@pytest.mark.parametrize(
    "damage,reason",
    [
        (lambda a: (a / "model_world_size_2_rank_1.pt").unlink(), "actor/ lacks model_world_size_2_rank_1.pt"),
        (
            lambda a: (a / "optim_world_size_2_rank_0.pt").write_bytes(b""),
            "actor/ has an empty optim_world_size_2_rank_0.pt",
        ),
        (lambda a: write_shards(a, world_size=1), "actor/ mixes the shards of world sizes 1, 2"),
        (lambda a: [p.unlink() for p in a.glob("*.pt")], "actor/ has no model_world_size_<W>_rank_<r>.pt"),
    ],
    ids=["a-rank-missing", "an-empty-shard", "two-world-sizes", "only-huggingface"],
)
def test_every_rank_of_the_world_size_in_the_names_is_required(root, damage, reason):
    save(root, 2, world_size=2)
    folder = save(root, 4, world_size=2)
    assert checkpoints.incomplete_reasons(str(folder), 4, SYNC) == []
    damage(folder / "actor")
    assert checkpoints.incomplete_reasons(str(folder), 4, SYNC) == [reason]
    assert resolve_auto_resume(str(root), SYNC) == str(root / "global_step_2")  # falls back past it


def test_what_is_missing_is_named_shortly_even_at_a_large_world_size(root):
    folder = save(root, 4, world_size=64)
    for rank in range(60, 64):
        (folder / "actor" / checkpoints.shard_name("extra_state", 64, rank)).unlink()
    (folder / "critic").mkdir()
    assert checkpoints.incomplete_reasons(str(folder), 4, CheckpointLayout(use_critic=True)) == [
        "actor/ lacks extra_state_world_size_64_rank_60.pt, extra_state_world_size_64_rank_61.pt, "
        "extra_state_world_size_64_rank_62.pt and 1 more",
        "no critic/",
    ]


def test_the_shards_required_follow_load_contents_and_the_strategy(root):
    """``save_contents`` without the optimizer (``load_contents`` follows it by default): no optim file is needed;
    a partial set of a kind not loaded still means lost files. Megatron's format is not read: a non-empty folder."""
    without_optim = {"strategy": "fsdp2", "checkpoint": {"load_contents": ["model", "extra"]}}
    assert checkpoints.loaded_shards(OmegaConf.create(without_optim)) == ("model", "extra_state")
    assert checkpoints.loaded_shards(OmegaConf.create({"strategy": "fsdp"})) == checkpoints.SHARD_KINDS
    assert checkpoints.loaded_shards(OmegaConf.create({"strategy": "megatron"})) == ()
    layout = CheckpointLayout(actor_shards=("model", "extra_state"))
    folder = save(root, 4, world_size=2)
    for rank in (0, 1):
        (folder / "actor" / checkpoints.shard_name("optim", 2, rank)).unlink()
    assert checkpoints.incomplete_reasons(str(folder), 4, layout) == []
    assert checkpoints.incomplete_reasons(str(folder), 4, SYNC) == [
        "actor/ lacks optim_world_size_2_rank_0.pt, optim_world_size_2_rank_1.pt"
    ]
    write_shards(folder / "actor", world_size=2, kinds=("optim",))
    (folder / "actor" / checkpoints.shard_name("optim", 2, 1)).unlink()
    assert checkpoints.incomplete_reasons(str(folder), 4, layout) == ["actor/ lacks optim_world_size_2_rank_1.pt"]
    megatron = CheckpointLayout(actor_shards=())
    for path in (folder / "actor").glob("*.pt"):
        path.unlink()
    (folder / "actor" / "dist_ckpt").mkdir()
    assert checkpoints.incomplete_reasons(str(folder), 4, megatron) == []


def test_the_trainer_layout_reads_the_actor_and_critic_config(root):
    trainer = make_trainer(root, use_critic=True)
    trainer.config.critic.checkpoint.load_contents = ["model"]
    layout = trainer._checkpoint_layout()
    assert layout.actor_shards == checkpoints.SHARD_KINDS
    assert layout.critic_shards == ("model",)
    assert layout.use_critic and not layout.async_mode


# ----------------------------------------------------------------------------------------------- the world size


def test_checkpoint_world_size_is_read_from_the_shard_names(root):
    assert checkpoint_world_size.checkpoint_world_size(str(save(root, 2, world_size=8))) == 8
    assert checkpoint_world_size.checkpoint_world_size(str(root / "global_step_404")) is None
    folder = save(root, 4, upto=0)
    (folder / "actor" / "huggingface").mkdir(parents=True)
    assert checkpoint_world_size.checkpoint_world_size(str(folder)) is None
    write_shards(folder / "actor", world_size=1)
    write_shards(folder / "actor", world_size=2)
    with pytest.raises(ValueError, match="mixes the shards of world sizes 1, 2"):
        checkpoint_world_size.checkpoint_world_size(str(folder))


def test_a_resume_at_another_world_size_is_refused_naming_both_and_the_ways_out(root, monkeypatch):
    folder = save(root, 3, world_size=2)
    checkpoint_world_size.check_resume_world_size(str(folder), nnodes=1, n_gpus_per_node=2)
    checkpoint_world_size.check_resume_world_size(str(folder), nnodes=2, n_gpus_per_node=1)
    with pytest.raises(RuntimeError) as err:
        checkpoint_world_size.check_resume_world_size(str(folder), nnodes=1, n_gpus_per_node=1)
    message = str(err.value)
    assert message.startswith(f"cannot resume from {folder} at world size 1 (trainer.nnodes=1 x ")
    assert "it was saved at world size 2 (model_world_size_2_rank_0.pt ... model_world_size_2_rank_1.pt)" in message
    assert "e.g. trainer.nnodes=1 trainer.n_gpus_per_node=2" in message
    assert f"actor_rollout_ref.model.path={folder}_hf and another trainer.default_local_dir" in message

    # The merge command in the message is one verl's model merger accepts, on this checkpoint's actor/.
    from verl.model_merger.base_model_merger import parse_args

    reshard_command, merge_command = message.split("`")[1], message.split("`")[3]
    assert reshard_command == f"python -m gtpo.trainer.resume.reshard --from {folder} --world-size 1"
    command = shlex.split(merge_command)
    assert command[:3] == ["python", "-m", "verl.model_merger"]
    monkeypatch.setattr(sys, "argv", ["verl.model_merger", *command[3:]])
    args = parse_args()
    assert (args.operation, args.backend) == ("merge", "fsdp")
    assert (args.local_dir, args.target_dir) == (str(folder / "actor"), f"{folder}_hf")


@pytest.mark.parametrize(
    "saved,nnodes,n_gpus_per_node,suggested",
    [(16, 1, 8, "trainer.nnodes=2 trainer.n_gpus_per_node=8"), (8, 2, 8, "trainer.nnodes=1 trainer.n_gpus_per_node=8"),
     (4, 1, 8, "trainer.nnodes=1 trainer.n_gpus_per_node=4")],
)  # fmt: skip
def test_the_suggested_shape_keeps_the_gpus_per_node_where_it_can(root, saved, nnodes, n_gpus_per_node, suggested):
    folder = save(root, 3, world_size=saved)
    with pytest.raises(RuntimeError, match=f"at world size {nnodes * n_gpus_per_node} .* e.g. {suggested}"):
        checkpoint_world_size.check_resume_world_size(str(folder), nnodes=nnodes, n_gpus_per_node=n_gpus_per_node)


@pytest.mark.parametrize("mode", ["auto", "resume_path"])
def test_the_trainer_refuses_before_any_worker_loads(root, monkeypatch, mode):
    """What tests/test_e2e_resume.py's runs cannot show on one CPU: a world-size-2 checkpoint resumed by 1 rank."""
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    loaded = []
    monkeypatch.setattr(PPOTrainerSync, "_load_checkpoint", lambda self: loaded.append(self))
    save(root, 3, world_size=2)  # files that are not verl's: resharding them is refused, naming the first
    trainer = make_trainer(root, resume_mode=mode, resume_from_path=str(root / "global_step_3"))
    unreadable = root / "global_step_3" / "actor" / "model_world_size_2_rank_0.pt"
    with pytest.raises(
        RuntimeError,
        match=re.escape(
            f"cannot reshard {root / 'global_step_3'} to world size 1: {unreadable} cannot be read as a torch.save file"
        ),
    ):
        trainer._load_checkpoint()
    trainer.config.algorithm = {"resume": {"other_world_size": "refuse"}}
    with pytest.raises(RuntimeError, match=f"cannot resume from {root / 'global_step_3'} at world size 1 "):
        trainer._load_checkpoint()
    assert loaded == []
    trainer.config.trainer.n_gpus_per_node = 2
    trainer.global_steps = 3  # what verl's _load_checkpoint sets
    trainer._load_checkpoint()
    assert loaded == [trainer]


# ------------------------------------------------------------------------------------------------------ retention


def _steps(root):
    return sorted(checkpoints.step_folders(str(root)))


def test_retention_holds_across_resumes(root):
    """A run that keeps 2 is requeued twice; each attempt is a fresh process, verl's count starts empty each time."""
    # attempt 1: saves 2, 4, 6; verl's in-process retention removed step 2's actor/ only; killed after step 7
    for step in (2, 4, 6):
        save(root, step, async_mode=True)
    shutil.rmtree(root / "global_step_2" / "actor")
    assert (root / "global_step_2" / "transfer_queue").is_dir()
    # attempt 2 resumes from 6 and saves 8: verl knows only 8, the recipe counts what is on disk
    assert resolve_auto_resume(str(root), ASYNC) == str(root / "global_step_6")
    save(root, 8, async_mode=True)
    removed = prune_checkpoints(str(root), 8, ASYNC, max_actor_ckpt_to_keep=2)
    assert removed == [str(root / "global_step_4"), str(root / "global_step_2")]
    assert _steps(root) == [6, 8]
    # attempt 3, killed during the save of 10 (actor/ written), resumes from 8 and saves 10 and 12
    save(root, 10, upto=1, async_mode=True)
    assert resolve_auto_resume(str(root), ASYNC) == str(root / "global_step_8")
    for step in (10, 12):
        save(root, step, async_mode=True)
        prune_checkpoints(str(root), step, ASYNC, max_actor_ckpt_to_keep=2)
    assert _steps(root) == [10, 12]
    assert sorted(p.parent.name for p in root.glob("*/transfer_queue")) == ["global_step_10", "global_step_12"]


def test_transfer_queue_goes_with_its_actor(root):
    """verl deletes only ``actor/``: the trajectories it leaves behind go with the rest of that folder."""
    for step in (2, 4):
        save(root, step, async_mode=True)
    shutil.rmtree(root / "global_step_2" / "actor")  # verl's own retention (max_actor_ckpt_to_keep=1) at step 4
    prune_checkpoints(str(root), 4, ASYNC, max_actor_ckpt_to_keep=1)
    assert not (root / "global_step_2").exists()
    assert (root / "global_step_4" / "transfer_queue" / "trajectories.bin").is_file()


def test_retention_never_touches_the_saved_the_tracked_or_newer_folders(root):
    for step in (2, 4, 6, 10):
        save(root, step)
    save(root, 8, upto=2)  # a killed attempt's half-written save of a higher step
    (root / TRACKER_FILE).write_text("4")
    assert prune_checkpoints(str(root), 6, SYNC, max_actor_ckpt_to_keep=1) == [str(root / "global_step_2")]
    assert _steps(root) == [4, 6, 8, 10]


def test_nothing_is_removed_after_a_save_that_is_not_complete(root):
    """An asynchronous save gets no state file: the older checkpoints may be the only complete ones."""
    save(root, 2)
    save(root, 4, upto=3)
    assert prune_checkpoints(str(root), 4, SYNC, max_actor_ckpt_to_keep=1) == []
    assert prune_checkpoints(str(root), 6, SYNC, max_actor_ckpt_to_keep=1) == []  # nothing saved at 6
    assert _steps(root) == [2, 4]


@pytest.mark.parametrize("keep", [None, 0, -1])
def test_no_limit_keeps_every_checkpoint_as_verl_does(root, keep):
    for step in (2, 4, 6):
        save(root, step)
    assert prune_checkpoints(str(root), 6, SYNC, max_actor_ckpt_to_keep=keep) == []
    assert _steps(root) == [2, 4, 6]


def test_older_incomplete_folders_go_and_complete_ones_count(root):
    save(root, 2)
    save(root, 4, upto=2)  # an abandoned save, superseded
    save(root, 6)
    save(root, 8)
    assert prune_checkpoints(str(root), 8, SYNC, max_actor_ckpt_to_keep=3) == [str(root / "global_step_4")]
    assert _steps(root) == [2, 6, 8]


def test_with_a_critic_the_smaller_limit_applies(root):
    layout = CheckpointLayout(use_critic=True)
    for step in (2, 4, 6):
        save(root, step, critic=True)
    assert prune_checkpoints(str(root), 6, layout, max_actor_ckpt_to_keep=3, max_critic_ckpt_to_keep=2) == [
        str(root / "global_step_2")
    ]
    assert prune_checkpoints(str(root), 6, SYNC, max_actor_ckpt_to_keep=3, max_critic_ckpt_to_keep=1) == []
    assert _steps(root) == [4, 6]


def test_the_trainer_reads_the_critic_limit_from_the_critic_key(root):
    """``prune_for_trainer`` with an actor limit of 3 and a critic limit of 1: after the saves of steps 2, 4 and 6
    only step 6 is left (a checkpoint without its critic cannot be resumed, so the critic's 1 rules). Reading the
    critic's limit from the actor's key would keep all three."""
    layout = CheckpointLayout(use_critic=True)
    cfg = OmegaConf.create({"default_local_dir": str(root), "max_actor_ckpt_to_keep": 3, "max_critic_ckpt_to_keep": 1})
    for step in (2, 4, 6):
        save(root, step, critic=True)
        checkpoints.prune_for_trainer(cfg, step, layout)
    assert _steps(root) == [6]
    assert (root / "global_step_6" / "critic").is_dir()
    cfg.max_critic_ckpt_to_keep = 3  # the limits swapped: the actor's 3 and the critic's 3 keep all
    for step in (8, 10):
        save(root, step, critic=True)
        checkpoints.prune_for_trainer(cfg, step, layout)
    assert _steps(root) == [6, 8, 10]


def test_a_removal_cut_short_never_leaves_a_complete_looking_folder(root, monkeypatch, caplog):
    for step in (2, 4):
        save(root, step)

    def interrupted(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(checkpoints.shutil, "rmtree", interrupted)
    with caplog.at_level(logging.WARNING, logger="gtpo.trainer.resume.checkpoints"):
        assert prune_checkpoints(str(root), 4, SYNC, max_actor_ckpt_to_keep=1) == []
    assert "could not remove the old checkpoint" in caplog.records[0].getMessage()
    assert checkpoints.incomplete_reasons(str(root / "global_step_2"), 2, SYNC) == ["no gtpo_state.json"]
    monkeypatch.undo()
    assert prune_checkpoints(str(root), 4, SYNC, max_actor_ckpt_to_keep=1) == [str(root / "global_step_2")]


def test_the_trainer_prunes_after_verls_save_and_clears_another_world_size_first(root, monkeypatch, capsys):
    """``_save_checkpoint``: shards an abandoned attempt at another world size left in this step's folder go before
    verl writes; after verl's save (and the state file) the retention limit applies to the whole disk."""
    from verl.trainer.ppo.checkpoint_callback import CheckpointCallback
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    save(root, 2)
    save(root, 4)
    stale = save(root, 6, upto=1, world_size=2)  # an attempt at world size 2, killed during its save of step 6
    before = {}

    def verl_save(trainer):
        before["actor"] = sorted(p.name for p in (stale / "actor").glob("*.pt"))
        save(root, 6, upto=3)
        trainer.checkpoint_callback.on_save(trainer=trainer, global_step=6, checkpoint_dir=str(stale))

    monkeypatch.setattr(PPOTrainerSync, "_save_checkpoint", verl_save)
    trainer = make_trainer(root, max_actor_ckpt_to_keep=2)
    trainer.global_steps = 6
    trainer.checkpoint_callback = checkpoint_state.StateAfterSave(CheckpointCallback(), checkpoint_state.new_state())
    trainer._save_checkpoint()
    assert before["actor"] == []  # the world-size-2 shards were gone before verl wrote
    assert checkpoints.incomplete_reasons(str(stale), 6, SYNC) == []
    assert _steps(root) == [4, 6]
    assert "removed 1 older checkpoint folder(s) beyond trainer.max_actor_ckpt_to_keep=2" in capsys.readouterr().out


def _trainer_cfg(root, **kw):
    base = {"resume_mode": "auto", "default_local_dir": str(root), "resume_from_path": None, "nnodes": 1,
            "n_gpus_per_node": 1}  # fmt: skip
    # the refusal (the reshard of real shard files: tests/test_reshard.py)
    return OmegaConf.create({"trainer": {**base, **kw}, "algorithm": {"resume": {"other_world_size": "refuse"}}})


def test_the_refusal_suggests_the_runs_gpus_per_node_only_where_they_divide_the_saved_size(root):
    """Saved at 6, resumed on 4 GPUs a node: the way out names 1 node x 6 GPUs, not 4 GPUs (which hold 4 ranks)."""
    save(root, 2, world_size=6)
    with pytest.raises(RuntimeError, match=r"e\.g\. trainer\.nnodes=1 trainer\.n_gpus_per_node=6\)"):
        checkpoint_world_size.check_resume_world_size(str(root / "global_step_2"), 1, 4)
    save(root, 4, world_size=8)
    with pytest.raises(RuntimeError, match=r"e\.g\. trainer\.nnodes=2 trainer\.n_gpus_per_node=4\)"):
        checkpoint_world_size.check_resume_world_size(str(root / "global_step_4"), 1, 4)


def test_the_driver_refuses_before_ray_starts_where_it_sees_the_folder(root):
    save(root, 2, world_size=1)
    save(root, 4, world_size=2)
    with pytest.raises(ResumeRefused, match=f"cannot resume from {root / 'global_step_4'} at world size 1 "):
        check_world_size_before_launch(_trainer_cfg(root), SYNC)
    assert check_world_size_before_launch(_trainer_cfg(root, n_gpus_per_node=2), SYNC) == str(root / "global_step_4")
    # auto reads, never rewrites: a tracker naming an incomplete folder falls back to the newest complete one
    save(root, 6, upto=3, world_size=1)  # shards, data, tracker; no state file
    assert (root / TRACKER_FILE).read_text() == "6"
    with pytest.raises(ResumeRefused, match="global_step_4 at world size 1"):
        check_world_size_before_launch(_trainer_cfg(root), SYNC)
    assert (root / TRACKER_FILE).read_text() == "6"
    # resume_path checks the folder it names, whatever its completeness
    named = _trainer_cfg(root, resume_mode="resume_path", resume_from_path=str(root / "global_step_2"))
    assert check_world_size_before_launch(named, SYNC) == str(root / "global_step_2")


NOBODY = 65534  # another user's uid (the tests run as root, which may chown)


@pytest.mark.parametrize(
    "plant,what,why",
    [
        (lambda root, step: os.chmod(root, 0o777), "trainer.default_local_dir={root}", "mode 0777 lets group or"),
        (lambda root, step: os.chown(root, NOBODY, -1), "trainer.default_local_dir={root}", f"owned by uid {NOBODY}"),
        (lambda root, step: os.chmod(step, 0o775), "checkpoint={step}", "mode 0775 lets group or others"),
        (lambda root, step: os.chmod(step / "actor", 0o757), "a folder of the checkpoint={step}/actor", "mode 0757"),
        (
            lambda root, step: (
                shutil.move(step / "actor", root / "elsewhere"),
                (step / "actor").symlink_to(root / "elsewhere"),
            ),
            "a folder of the checkpoint={step}/actor",
            "a symbolic link (to ",
        ),
    ],
    ids=["open-root", "root-of-another-user", "group-writable-step", "others-writable-actor", "symlinked-actor"],
)
def test_the_driver_refuses_to_resume_from_a_folder_others_could_plant_files_in(root, plant, what, why):
    """verl loads the shards and data.pt with torch.load(weights_only=False): before Ray starts the driver refuses
    the folder a resume would load (and, under auto, trainer.default_local_dir) unless only this user can write it,
    naming the folder, its owner or mode and the fix; the world size is not even looked at."""
    step = save(root, 2, world_size=2)  # another world size than the run's: the privacy check comes first
    plant(root, step)
    expect = f"cannot resume: {what.format(root=root, step=step)}: {why}"
    with pytest.raises(ResumeRefused, match=re.escape(expect)) as err:
        check_world_size_before_launch(_trainer_cfg(root), SYNC)
    fixes = ("give the real folder", "chmod go-w", "use a folder of your own")
    assert "\n" not in str(err.value) and any(fix in str(err.value) for fix in fixes)


def test_an_evaluation_refuses_a_named_checkpoint_others_could_write(root):
    """scripts/eval_checkpoint.sh resumes with trainer.resume_from_path=<folder>: the folder it names is checked the
    same way, its files too; a folder of one's own inside a shared one is allowed when nobody else can swap it there
    (the sticky bit of a shared folder such as /tmp), refused when everyone could."""
    step = save(root, 2, world_size=1)
    named = _trainer_cfg(root, resume_mode="resume_path", resume_from_path=str(step))
    os.chmod(root, 0o1777)
    assert check_world_size_before_launch(named, SYNC) == str(step)
    os.chmod(root, 0o777)
    with pytest.raises(ResumeRefused, match=re.escape(f"{root}, is writable by everyone without the sticky bit")):
        check_world_size_before_launch(named, SYNC)
    os.chmod(root, 0o755)
    os.chown(step / "data.pt", NOBODY, -1)
    with pytest.raises(ResumeRefused, match=re.escape(f"{step}/data.pt: owned by uid {NOBODY}")):
        check_world_size_before_launch(named, SYNC)
    os.chown(step / "data.pt", os.getuid(), -1)
    os.chown(step, NOBODY, -1)
    with pytest.raises(ResumeRefused, match=re.escape(f"trainer.resume_from_path={step}: owned by uid {NOBODY}")):
        check_world_size_before_launch(named, SYNC)


@pytest.mark.parametrize("mode", ["disable", "auto", "resume_path"])
def test_nothing_to_check_when_there_is_no_resume_or_no_folder(root, mode):
    cfg = _trainer_cfg(root / "not_here", resume_mode=mode, resume_from_path=str(root / "missing"))
    assert check_world_size_before_launch(cfg, ASYNC) is None


def test_prepare_config_refuses_the_resume_before_ray_starts(root, monkeypatch):
    import gtpo.verl_plugin.register  # noqa: F401  (the estimators, as main() registers them before prepare_config)
    from recipe.gtpo.main_gtpo import prepare_config
    from tests.support.configs import compose, data_overrides

    monkeypatch.delenv("VERL_USE_EXTERNAL_MODULES", raising=False)  # prepare_config sets it; restored afterwards
    # backend=cpu_tiny's device stays cpu whatever platform verl detected first in this process (CUDA's, alone)
    monkeypatch.setattr("recipe.gtpo.main_gtpo.auto_set_device", lambda config: None)

    save(root, 2, world_size=2)
    cfg = compose(["backend=cpu_tiny", "trainer.resume_mode=auto", f"trainer.default_local_dir={root}",
                   "algorithm.resume.other_world_size=refuse", *data_overrides(root.parent / "data")])  # fmt: skip
    with pytest.raises(ResumeRefused, match="saved at world size 2"):
        prepare_config(cfg)
    prepare_config(cfg, dry_run=True)  # a dry run may run where the cluster's storage is not mounted: no check


def test_prepare_config_reads_an_async_run_checkpoints_as_its_trainer_does(root, monkeypatch):
    """Under colocate_async a folder without transfer_queue/ is incomplete: the driver skips it as the trainer's
    resume would, and checks the complete one it would load instead (saved at this world size)."""
    import gtpo.verl_plugin.register  # noqa: F401  (the estimators, as main() registers them before prepare_config)
    from recipe.gtpo.main_gtpo import prepare_config
    from tests.support.configs import compose, data_overrides

    monkeypatch.delenv("VERL_USE_EXTERNAL_MODULES", raising=False)
    # backend=cpu_tiny's device stays cpu whatever platform verl detected first in this process (CUDA's, alone)
    monkeypatch.setattr("recipe.gtpo.main_gtpo.auto_set_device", lambda config: None)
    save(root, 2, world_size=1, async_mode=True)
    save(root, 4, world_size=2)  # no transfer_queue/: not resumable by an asynchronous trainer
    data = data_overrides(root.parent / "data")
    cfg = compose(["backend=cpu_tiny", "trainer=colocate_async", "trainer.resume_mode=auto",
                   f"trainer.default_local_dir={root}", *data])  # fmt: skip
    prepare_config(cfg)
    with pytest.raises(ResumeRefused, match="global_step_4 at world size 1"):
        prepare_config(compose(["backend=cpu_tiny", "trainer.resume_mode=auto", f"trainer.default_local_dir={root}",
                                "algorithm.resume.other_world_size=refuse", *data]))  # fmt: skip


def test_a_role_folder_mixing_two_sizes_is_refused_for_the_critic_as_for_the_actor(root):
    """Shards of two world sizes in ``critic/`` (an abandoned attempt's, beside the saved ones): whichever size the
    folder listing gave first, the resume stops, naming the folder and both sizes."""
    folder = save(root, 2, world_size=1, critic=True)
    write_shards(folder / "critic", world_size=2)
    cfg = OmegaConf.create({"trainer": {"nnodes": 1, "n_gpus_per_node": 1}, "algorithm": {}})
    expect = f"cannot resume from {folder}: {folder}/critic mixes the shards of world sizes 1, 2"
    with pytest.raises(RuntimeError, match=re.escape(expect)):
        checkpoint_world_size.match_resume_world_size(str(folder), cfg, CheckpointLayout(use_critic=True))
