"""A file planted in a checkpoint never runs: every file the recipe or verl loads from a checkpoint is checked right
before the load, in the process that loads it (the driver before Ray starts, the trainer before verl's
``_load_checkpoint``, each worker before its ``FSDPCheckpointManager.load_checkpoint``, the reshard command), and the
recipe's own loads read data only (``torch.load(weights_only=True)``).

    .venv/bin/python -m pytest -q -n 0 tests/test_planted_checkpoints.py

A *payload* is a ``torch.save`` file whose unpickling creates a marker file (what a planted pickle could do with
any code): each test shows that the payload is live (verl's own load, unguarded, runs it) and that the guarded path
refuses before it runs, naming the file, the marker absent. "Another user" is uid 65534 (needs root for ``chown``).
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import struct
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from gtpo.launch.checks import ResumeRefused, check_world_size_before_launch
from gtpo.trainer.resume.checkpoints import CheckpointLayout
from tests.support.checkpoints import make_trainer, save

NOBODY = 65534


class Payload:
    """Unpickled, creates ``marker``: code a planted checkpoint file runs under ``torch.load(weights_only=False)``."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def write_payload(path: Path, marker: Path) -> Path:
    torch.save({"state": Payload(marker)}, path)
    return path


def need_root() -> None:
    if os.getuid() != 0:
        pytest.skip("giving a file to another uid needs root")


def grant_write_acl(path: Path, uid: int) -> None:
    """A POSIX access ACL ``user:<uid>:rw-`` with mask ``rw-`` on ``path`` (what ``setfacl -m u:<uid>:rw`` sets)."""
    owner = (stat.S_IMODE(os.stat(path).st_mode) >> 6) & 7
    entries = [(0x01, owner, 0xFFFFFFFF), (0x02, 6, uid), (0x04, 0, 0xFFFFFFFF), (0x10, 6, 0xFFFFFFFF),
               (0x20, 0, 0xFFFFFFFF)]  # fmt: skip
    value = struct.pack("<I", 2) + b"".join(
        struct.pack("<HHI", tag, perm, qualifier) for tag, perm, qualifier in entries
    )
    try:
        os.setxattr(path, "system.posix_acl_access", value)
    except OSError as err:
        pytest.skip(f"no POSIX ACLs on this filesystem ({err.strerror})")


def plant_symlinked_data(step: Path, marker: Path) -> tuple[Path, str]:
    """``data.pt`` a symlink to a 0666 file of another user's in a shared sticky folder (review row 37)."""
    need_root()
    shared = step.parents[2] / "shared"
    shared.mkdir(mode=0o1777, exist_ok=True)
    target = write_payload(shared / "data.pt", marker)
    os.chown(target, NOBODY, -1)
    target.chmod(0o666)
    (step / "data.pt").unlink()
    (step / "data.pt").symlink_to(target)
    return step / "data.pt", "a symbolic link (to "


def plant_open_shard(step: Path, marker: Path) -> tuple[Path, str]:
    shard = write_payload(step / "actor" / "model_world_size_1_rank_0.pt", marker)
    shard.chmod(0o666)
    return shard, "mode 0666 lets group or others write it"


def plant_foreign_shard(step: Path, marker: Path) -> tuple[Path, str]:
    need_root()
    shard = write_payload(step / "actor" / "optim_world_size_1_rank_0.pt", marker)
    os.chown(shard, NOBODY, -1)
    return shard, f"owned by uid {NOBODY}, not by this user"


def plant_acl_shard(step: Path, marker: Path) -> tuple[Path, str]:
    shard = write_payload(step / "actor" / "extra_state_world_size_1_rank_0.pt", marker)
    shard.chmod(0o600)
    grant_write_acl(shard, NOBODY)
    return shard, "mode 0660 lets group or others write it"


PLANTS = {
    "symlinked-data.pt": plant_symlinked_data,
    "world-writable-shard": plant_open_shard,
    "another-users-shard": plant_foreign_shard,
    "acl-shard": plant_acl_shard,
}


@pytest.fixture
def run(tmp_path):
    """A private checkpoint folder (``ckpt/global_step_2``, world size 1, complete) and the payload's marker."""
    root = tmp_path / "ckpt"
    root.mkdir(mode=0o700)
    return root, save(root, 2, world_size=1), tmp_path / "PAYLOAD_RAN"


def trainer_cfg(root: Path, **trainer):
    return OmegaConf.create(
        {"trainer": {"resume_mode": "auto", "default_local_dir": str(root), "nnodes": 1, "n_gpus_per_node": 1,
                     **trainer}, "algorithm": {}, "actor_rollout_ref": {"model": {}}}
    )  # fmt: skip


def verls_load(path: Path) -> None:
    """What verl's loads do with a checkpoint file (``trainer_base.py:895``, ``fsdp_checkpoint_manager.py:215``)."""
    torch.load(path, weights_only=False)


@pytest.mark.parametrize("plant", list(PLANTS), ids=list(PLANTS))
def test_the_driver_refuses_a_planted_file_before_ray_starts(run, plant):
    root, step, marker = run
    planted, why = PLANTS[plant](step, marker)
    with pytest.raises(ResumeRefused) as err:
        check_world_size_before_launch(trainer_cfg(root), CheckpointLayout())
    assert f"{planted}: {why}" in str(err.value) and "\n" not in str(err.value)
    assert not marker.exists()
    verls_load(planted)  # the payload is live: verl's own load would have run it
    assert marker.exists()


def test_the_entry_point_refuses_it_in_one_line_with_exit_2(run, tmp_path):
    """Review row 35: ``python -m recipe.gtpo.main_gtpo ... trainer.resume_from_path=<a folder others may write>`` was
    refused before Ray but as a 17-frame traceback. Now: exit 2, one line naming the file, no traceback, no Ray."""
    import subprocess
    import sys

    from tests.support.configs import REPO_ROOT, data_overrides

    _, step, marker = run
    planted, why = plant_open_shard(step, marker)
    import gtpo.cpu

    # the CPU backend's environment, as its launchers give it (without it verl's platform is CUDA's)
    env = {k: v for k, v in os.environ.items() if k not in ("GTPO_TRACEBACK", "DRY_RUN") and not k.startswith("RAY_")}
    env = gtpo.cpu.env(base=env)
    proc = subprocess.run(
        [sys.executable, "-m", "recipe.gtpo.main_gtpo", "backend=cpu_tiny", *data_overrides(tmp_path / "data"),
         "trainer.resume_mode=resume_path", f"trainer.resume_from_path={step}", f"hydra.run.dir={tmp_path}/hydra"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    said = [line for line in proc.stderr.splitlines() if line.startswith("gtpo:")]
    assert (
        len(said) == 1
        and said[0].startswith("gtpo: invalid configuration: cannot resume: ")
        and f"{planted}: {why}" in said[0]
    )
    assert "Traceback" not in proc.stderr and "starting a new local Ray cluster" not in proc.stderr
    assert not marker.exists()


class FakeWorkers:
    """``actor_rollout_ref`` worker group whose ``load_checkpoint`` is what each FSDP worker runs: verl's
    ``FSDPCheckpointManager.load_checkpoint`` (as the plugin installs it) on the rank's manager."""

    def __init__(self):
        from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

        self.manager = object.__new__(FSDPCheckpointManager)
        self.manager.checkpoint_load_contents = ["model", "optimizer", "extra"]
        model = torch.nn.Linear(1, 1)
        self.manager.model, self.manager.optimizer = model, torch.optim.SGD(model.parameters(), lr=0.1)
        self.manager.lr_scheduler = None
        self.manager.rank, self.manager.world_size = 0, 1
        self.loaded: list[str] = []

    def load_checkpoint(self, local_path, del_local_after_load=False):
        self.loaded.append(local_path)
        self.manager.load_checkpoint(local_path, del_local_after_load=del_local_after_load)


def trainer_at(root: Path, **trainer):
    import gtpo.verl_plugin.register  # noqa: F401  (installs the workers' check, as in every Ray process)

    out = make_trainer(root, **trainer)
    out.actor_rollout_wg = FakeWorkers()
    return out


@pytest.mark.parametrize("plant", list(PLANTS), ids=list(PLANTS))
def test_the_trainer_checks_again_right_before_verls_loads(run, plant):
    """A folder the driver never saw (or checked minutes earlier): the trainer refuses in its own process before
    verl's ``_load_checkpoint`` loads anything, data.pt included; no worker is asked to load."""
    root, step, marker = run
    planted, why = PLANTS[plant](step, marker)
    trainer = trainer_at(root)
    with pytest.raises(RuntimeError, match=f"cannot resume: .*{re.escape(f'{planted}: {why}')}"):
        trainer._load_checkpoint()
    assert not marker.exists() and trainer.actor_rollout_wg.loaded == []


@pytest.mark.parametrize("plant", ["world-writable-shard", "another-users-shard", "acl-shard"])
def test_each_worker_checks_its_files_before_verls_torch_load(run, plant):
    """The wrapper around verl's ``FSDPCheckpointManager.load_checkpoint`` (seam ``checkpoint-load-check``) refuses
    the role folder in the worker's own process, before verl's ``torch.load(weights_only=False)``."""
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    root, step, marker = run
    planted, why = PLANTS[plant](step, marker)
    workers = trainer_at(root).actor_rollout_wg
    with pytest.raises(RuntimeError, match=f"cannot resume: .*{re.escape(f'{planted}: {why}')}"):
        workers.load_checkpoint(str(step / "actor"))
    assert not marker.exists()
    # verl's method itself, unwrapped, would have run it (the model file is the first it loads)
    verls = FSDPCheckpointManager.load_checkpoint.__wrapped__
    write_payload(step / "actor" / "model_world_size_1_rank_0.pt", marker)
    with pytest.raises(Exception):  # noqa: B017 - the payload is no state dict; what matters is that it ran
        verls(workers.manager, str(step / "actor"))
    assert marker.exists()


def test_a_folder_swapped_after_the_drivers_check_is_refused_by_the_trainer(tmp_path):
    """Review row 39: the driver checks a clean folder; someone who may write its parent (a group-writable project
    folder) then moves it aside and puts a planted copy in its place. The trainer's check right before verl's loads
    refuses the copy; nothing of it runs."""
    need_root()
    project = tmp_path / "project"
    project.mkdir()
    project.chmod(0o2770)  # shared with a group: accepted, a group member could swap what is in it
    root = project / "ckpt"
    root.mkdir(mode=0o700)
    step = save(root, 2, world_size=1)
    marker = tmp_path / "PAYLOAD_RAN"
    assert check_world_size_before_launch(trainer_cfg(root), CheckpointLayout()) == str(step)
    # the swap, as the other user does it: their copy, their files
    os.rename(root, project / "ckpt.moved")
    shutil.copytree(project / "ckpt.moved", root)
    write_payload(root / "global_step_2" / "data.pt", marker)
    for path in [root, *root.rglob("*")]:
        os.chown(path, NOBODY, -1, follow_symlinks=False)
    trainer = trainer_at(root)
    with pytest.raises(RuntimeError, match=f"cannot resume: trainer.default_local_dir={root}: owned by uid {NOBODY}"):
        trainer._load_checkpoint()
    assert not marker.exists() and trainer.actor_rollout_wg.loaded == []
    # the same copy named by resume_path: refused at the folder itself
    named = trainer_at(root, resume_mode="resume_path", resume_from_path=str(root / "global_step_2"))
    with pytest.raises(RuntimeError, match=f"checkpoint={root / 'global_step_2'}: owned by uid {NOBODY}"):
        named._load_checkpoint()
    assert not marker.exists()


@pytest.mark.parametrize("parent_mode,refused", [(0o777, True), (0o1777, False), (0o775, False)])
def test_a_checkpoint_under_a_folder_everyone_may_write_is_refused_at_once(tmp_path, parent_mode, refused):
    """A parent writable by everyone without the sticky bit lets anyone swap the folder between any check and the
    load: refused outright (the sticky bit of a shared /tmp keeps others from renaming what is not theirs)."""
    parent = tmp_path / "open"
    parent.mkdir()
    parent.chmod(parent_mode)
    root = parent / "ckpt"
    root.mkdir(mode=0o700)
    step = save(root, 2, world_size=1)
    if not refused:
        assert check_world_size_before_launch(trainer_cfg(root), CheckpointLayout()) == str(step)
        return
    expect = re.escape(f"{parent}, is writable by everyone without the sticky bit (mode 0777)")
    with pytest.raises(ResumeRefused, match=expect):
        check_world_size_before_launch(trainer_cfg(root), CheckpointLayout())
    with pytest.raises(RuntimeError, match=expect):
        trainer_at(root)._load_checkpoint()


# ------------------------------------------------------------------------------------------- the reshard command


def reshard(*args: str, capsys) -> tuple[int, str]:
    from gtpo.trainer.resume.reshard import main

    rc = main(list(args))
    return rc, capsys.readouterr().err


def two_rank_checkpoint(folder: Path, marker: Path) -> Path:
    """A world-size-2 ``actor/`` whose rank 0 model file is a payload (the reshard reads every old shard)."""
    from tests.support.checkpoints import write_shards

    write_shards(folder / "actor", world_size=2)
    write_payload(folder / "actor" / "model_world_size_2_rank_0.pt", marker)
    return folder


@pytest.mark.parametrize("case", ["world-writable", "another-users", "symlinked-from", "symlinked-shard"])
def test_the_reshard_command_refuses_a_checkpoint_others_could_write(tmp_path, capsys, case):
    """Review rows 30-32: ``python -m gtpo.trainer.resume.reshard --from`` a world-writable, foreign-owned or
    symlinked folder (or one holding a symlinked shard) ran the payload; now refused, exit 2, before any read."""
    marker = tmp_path / "PAYLOAD_RAN"
    folder = two_rank_checkpoint(tmp_path / "run" / "global_step_2", marker)
    given, expect = folder, None
    if case == "world-writable":
        folder.chmod(0o777)
        expect = f"the checkpoint={folder}: mode 0777 lets group or others write into it"
    elif case == "another-users":
        need_root()
        os.chown(folder, NOBODY, -1)
        expect = f"the checkpoint={folder}: owned by uid {NOBODY}"
    elif case == "symlinked-from":
        given = tmp_path / "link"
        given.symlink_to(folder)
        expect = f"the checkpoint={given}: a symbolic link (to {folder})"
    else:
        elsewhere = write_payload(tmp_path / "elsewhere.pt", marker)
        shard = folder / "actor" / "model_world_size_2_rank_1.pt"
        shard.unlink()
        shard.symlink_to(elsewhere)
        expect = f"a file of the checkpoint={shard}: a symbolic link (to {elsewhere})"
    rc, err = reshard("--from", str(given), "--world-size", "1", "--out", str(tmp_path / "out"), capsys=capsys)
    assert rc == 2 and f"gtpo reshard: refused: {expect}" in err, err
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_the_recipes_own_loads_read_data_only(tmp_path, capsys):
    """A payload in a private checkpoint (one's own file, copied from a shared place): the reshard and the resume's
    LoRA probe read shards with ``torch.load(weights_only=True)``, which refuses what is not data; nothing runs."""
    from gtpo.trainer.resume.checkpoint_world_size import _checkpoint_is_lora

    marker = tmp_path / "PAYLOAD_RAN"
    folder = two_rank_checkpoint(tmp_path / "run" / "global_step_2", marker)
    rc, err = reshard("--from", str(folder), "--world-size", "1", capsys=capsys)
    shard = folder / "actor" / "model_world_size_2_rank_0.pt"
    assert rc == 2 and f"gtpo reshard: refused: {shard}: cannot be read as a torch.save file (UnpicklingError" in err
    with pytest.raises(RuntimeError, match=f"{shard} cannot be read as a torch.save file \\(UnpicklingError"):
        _checkpoint_is_lora(str(folder / "actor"), 2)
    assert not marker.exists()


# ------------------------------------------------------------------------------------------- verl's rollout cache


def test_a_rollout_cache_others_could_write_is_refused_before_ray(tmp_path):
    """verl's rollout cache (``skip.rollout_tq``): a later run's TaskRunner loads the batches it finds under
    ``dump_dir`` with ``torch.load(weights_only=False)``. An enabled cache holding a file others may write, or under a
    folder everyone may write, is refused by the driver before Ray starts (``prepare_launch``), in one line naming
    the key or the file; the payload never runs. A private cache, or one not enabled, is accepted."""
    from gtpo.launch.checks import check_config, prepare_launch
    from tests.support.configs import compose, data_overrides

    data = data_overrides(tmp_path / "data")
    marker = tmp_path / "PAYLOAD_RAN"
    cache = tmp_path / "cache"
    batch = cache / "exp_proj" / "GBS8_N2_in8_out8" / "1" / "0"
    batch.mkdir(parents=True)
    planted = write_payload(batch / "tq_batch.pt", marker)
    planted.chmod(0o666)

    def launch(dump_dir: Path, enable: bool = True) -> None:
        config = compose(["backend=cpu_tiny", *data, f"skip.rollout_tq.enable={enable}",
                          f"skip.rollout_tq.dump_dir={dump_dir}"])  # fmt: skip
        prepare_launch(config, check_config(config), environ={})

    with pytest.raises(ValueError) as err:
        launch(cache)
    assert f"a file of the rollout cache={planted}: mode 0666 lets group or others write it" in str(err.value)
    assert "\n" not in str(err.value) and not marker.exists()
    launch(cache, enable=False)  # verl's default: nothing is read from it
    open_parent = tmp_path / "open"
    open_parent.mkdir()
    open_parent.chmod(0o777)
    expect = f"skip.rollout_tq.dump_dir={open_parent / 'cache'}: the folder above it, {open_parent}, is writable by"
    with pytest.raises(ValueError, match=re.escape(expect)):
        launch(open_parent / "cache")  # not made yet: anyone could make it first
    planted.chmod(0o600)
    launch(cache)
    assert not marker.exists()
    verls_load(planted)  # the payload is live: verl's own load would have run it
    assert marker.exists()


# ------------------------------------------------------------------------------------ the guard's corner cases


def test_a_checkpoint_file_that_is_no_regular_file_is_refused(run):
    """A FIFO named ``data.pt`` (this user's, private) would block verl's ``torch.load`` forever: refused by name."""
    root, step, _ = run
    (step / "data.pt").unlink()
    os.mkfifo(step / "data.pt", 0o600)
    with pytest.raises(ResumeRefused, match=re.escape(f"a file of the checkpoint={step / 'data.pt'}: not a regular")):
        check_world_size_before_launch(
            trainer_cfg(root, resume_mode="resume_path", resume_from_path=str(step)), CheckpointLayout()
        )


def test_a_folder_everyone_may_write_above_the_real_path_is_refused(tmp_path):
    """``resume_from_path`` through a symlink in a folder above it: the path as written crosses no open folder, the
    real one does (``open/`` 0777 above ``open/sub/ckpt``); judged on both, it is refused, also by the reshard."""
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    (open_dir / "sub").mkdir(mode=0o755)
    root = open_dir / "sub" / "ckpt"
    root.mkdir(mode=0o700)
    step = save(root, 2, world_size=1)
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    (mine / "link").symlink_to(open_dir / "sub")
    named = mine / "link" / "ckpt" / "global_step_2"
    expect = re.escape(f"{open_dir}, is writable by everyone without the sticky bit (mode 0777)")
    cfg = trainer_cfg(root, resume_mode="resume_path", resume_from_path=str(named))
    with pytest.raises(ResumeRefused, match=expect):
        check_world_size_before_launch(cfg, CheckpointLayout())
    assert step.is_dir()


@pytest.mark.parametrize("how", ["resume_path", "reshard"])
def test_a_named_checkpoint_under_a_folder_everyone_may_write_is_refused(tmp_path, capsys, how):
    """Named directly (``resume_path``, the reshard's ``--from``), not found under ``default_local_dir``: the folders
    above it are judged too."""
    parent = tmp_path / "open"
    parent.mkdir()
    parent.chmod(0o777)
    expect = f"{parent}, is writable by everyone without the sticky bit (mode 0777)"
    if how == "reshard":
        folder = two_rank_checkpoint(parent / "global_step_2", tmp_path / "PAYLOAD_RAN")
        rc, err = reshard("--from", str(folder), "--world-size", "1", capsys=capsys)
        assert rc == 2 and expect in err
        return
    root = parent / "ckpt"
    root.mkdir(mode=0o700)
    step = save(root, 2, world_size=1)
    with pytest.raises(ResumeRefused, match=re.escape(expect)):
        check_world_size_before_launch(
            trainer_cfg(tmp_path / "unused", resume_mode="resume_path", resume_from_path=str(step)), CheckpointLayout()
        )


def test_an_empty_checkpoint_folder_under_a_folder_everyone_may_write_is_refused(tmp_path):
    """``default_local_dir`` made (by the preflight or a first run) under an open folder, with nothing to resume yet:
    refused before Ray all the same, as the preflight refuses it; the run's own saves would land where anyone can
    swap them."""
    parent = tmp_path / "open"
    parent.mkdir()
    parent.chmod(0o777)
    root = parent / "ckpt"
    root.mkdir(mode=0o700)
    with pytest.raises(ResumeRefused, match=re.escape(f"trainer.default_local_dir={root}: the folder above it")):
        check_world_size_before_launch(trainer_cfg(root), CheckpointLayout())


def test_the_trainer_checks_again_after_the_world_size_step(run, monkeypatch):
    """What happens to the folder while the trainer matches the world size (a reshard may take minutes) is checked
    right before verl's loads: a shard made writable by others meanwhile is refused, nothing loaded."""
    from gtpo.trainer.resume import hooks

    root, step, marker = run
    shard = step / "actor" / "model_world_size_1_rank_0.pt"
    real_match = hooks.match_resume_world_size

    def match_then_planted(folder, config, layout):
        result = real_match(folder, config, layout)
        write_payload(shard, marker).chmod(0o666)  # the swap, after the first check passed
        return result

    monkeypatch.setattr(hooks, "match_resume_world_size", match_then_planted)
    trainer = trainer_at(root)
    with pytest.raises(RuntimeError, match=re.escape(f"{shard}: mode 0666 lets group or others write it")):
        trainer._load_checkpoint()
    assert not marker.exists() and trainer.actor_rollout_wg.loaded == []


def test_the_recipes_own_reads_check_each_file_first(tmp_path):
    """The LoRA probe's read of a shard another user could write is refused by name before anything is read, even
    when the folder check before it was skipped or raced."""
    from gtpo.trainer.resume.checkpoint_world_size import _checkpoint_is_lora

    folder = two_rank_checkpoint(tmp_path / "run" / "global_step_2", tmp_path / "PAYLOAD_RAN")
    shard = folder / "actor" / "model_world_size_2_rank_0.pt"
    shard.chmod(0o666)
    with pytest.raises(RuntimeError, match=re.escape(f"{shard}: mode 0666 lets group or others write it")):
        _checkpoint_is_lora(str(folder / "actor"), 2)


def test_the_trainer_checks_the_folder_before_the_world_size_step(tmp_path):
    """A checkpoint of another world size with a file others may write: the trainer refuses it for that file before
    it looks at the world size (no reshard renames anything in it, no refusal about the size hides the real one)."""
    from omegaconf import OmegaConf

    root = tmp_path / "ckpt"
    root.mkdir(mode=0o700)
    step = save(root, 2, world_size=2)
    shard = write_payload(step / "actor" / "model_world_size_2_rank_0.pt", tmp_path / "PAYLOAD_RAN")
    shard.chmod(0o666)
    trainer = trainer_at(root)
    trainer.config.algorithm = OmegaConf.create({"resume": {"other_world_size": "refuse"}})
    with pytest.raises(RuntimeError, match=re.escape(f"cannot resume: a file of the checkpoint={shard}: mode 0666")):
        trainer._load_checkpoint()
    assert not (tmp_path / "PAYLOAD_RAN").exists() and trainer.actor_rollout_wg.loaded == []
