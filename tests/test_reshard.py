"""Resharding verl's FSDP2 checkpoint to another world size (gtpo.trainer.resume.reshard,
gtpo.trainer.resume.checkpoint_world_size).

    .venv/bin/python -m pytest -q tests/test_reshard.py

The checkpoints are verl 0.9.1's own: gloo ranks save and load them with its ``FSDPCheckpointManager``
(tests/support/fsdp_checkpoints.py), a tiny Qwen2 wrapped with FSDP2 after two AdamW steps. After a reshard every
parameter and both AdamW moments, gathered at the new world size, equal the saved ones element for element, the
optimizer's step and the scheduler go on, a kill at any instant leaves the original loadable, and what cannot be
resharded is refused before anything is written, naming why. The reshards 4 -> 2 and 2 -> 4 are in the slow tier.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from gtpo.trainer.resume import checkpoint_world_size
from gtpo.trainer.resume.checkpoints import CheckpointLayout, shard_files, shard_name
from gtpo.trainer.resume.reshard import NEW_SUFFIX, OLD_SUFFIX, finish_interrupted_reshards, reshard_checkpoint
from gtpo.trainer.resume.reshard_shards import ReshardRefused, reshard_role
from tests.support.fsdp_checkpoints import LR, TRAIN_STEPS, WARMUP, run_ranks

REPO = Path(__file__).resolve().parents[1]


def _saved(root: Path, world_size: int) -> tuple[Path, dict]:
    folder = root / f"global_step_{TRAIN_STEPS}"
    report = run_ranks(world_size, "save", folder / "actor", root / f"save{world_size}.pt")
    return folder, report


@pytest.fixture(scope="module")
def saved_at_2(tmp_path_factory):
    """A world-size-2 checkpoint of verl's (``global_step_2/actor``) and rank 0's report of the full state."""
    return _saved(tmp_path_factory.mktemp("ws2"), 2)


def _copy(folder: Path, tmp_path: Path) -> Path:
    target = tmp_path / folder.name
    shutil.copytree(folder, target)
    return target


def _hashes(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.glob("*.pt"))}


def _assert_same_state(saved: dict, loaded: dict) -> None:
    for key in ("params", "exp_avg", "exp_avg_sq"):
        assert saved[key].keys() == loaded[key].keys()
        differ = [n for n in saved[key] if not torch.equal(saved[key][n], loaded[key][n])]
        assert not differ, f"{key} differs after the reshard: {differ[:5]}"
    assert loaded["step"] == saved["step"] and set(saved["step"].values()) == {float(TRAIN_STEPS)}
    assert (loaded["lr"], loaded["last_epoch"]) == (saved["lr"], saved["last_epoch"]) == (LR * 3 / WARMUP, 2)
    assert loaded["lr_after_step"] == LR * min(1.0, (TRAIN_STEPS + 2) / WARMUP)  # the warm-up goes on


def _reshard_and_load(folder: Path, report: dict, world_size_to: int, tmp_path: Path) -> dict:
    before = _hashes(folder / "actor")
    done = reshard_checkpoint(str(folder), world_size_to)
    assert done == {"actor": len(before) // 3}
    assert sorted(shard_files(str(folder / "actor"))) == [world_size_to]
    assert json.loads((folder / "actor" / "fsdp_config.json").read_text())["world_size"] == world_size_to
    assert (folder / "actor" / "huggingface" / "config.json").exists()
    assert not list(folder.glob(f"*{NEW_SUFFIX}")) and not list(folder.glob(f"*{OLD_SUFFIX}"))
    loaded = run_ranks(world_size_to, "load", folder / "actor", tmp_path / f"load{world_size_to}.pt")
    _assert_same_state(report, loaded)
    return loaded


def test_a_world_size_2_checkpoint_loads_at_3_element_for_element(saved_at_2, tmp_path):
    """2 -> 3: the 37-row embedding's rows 0-18 / 19-36 become 0-12 / 13-25 / 26-36 (torch.chunk's cut); the new
    ranks load with verl's own manager and every gathered tensor is the saved one. RNG: ranks 0 and 1 keep theirs,
    rank 2 gets a fresh one seeded by (step, rank)."""
    folder = _copy(saved_at_2[0], tmp_path)
    old_rng = [torch.load(saved_at_2[0] / "actor" / shard_name("extra_state", 2, r), weights_only=False)["rng"]
               for r in range(2)]  # fmt: skip
    _reshard_and_load(folder, saved_at_2[1], 3, tmp_path)
    new = [torch.load(folder / "actor" / shard_name("extra_state", 3, r), weights_only=False) for r in range(3)]
    for rank in (0, 1):
        assert torch.equal(new[rank]["rng"]["cpu"], old_rng[rank]["cpu"])
        assert new[rank]["rng"]["random"] == old_rng[rank]["random"]
    fresh = new[2]["rng"]
    assert not any(torch.equal(fresh["cpu"], old["cpu"]) for old in old_rng)
    assert set(fresh) == {"cpu", "numpy", "random"}
    assert new[2]["lr_scheduler"] == new[0]["lr_scheduler"]
    local = torch.load(folder / "actor" / shard_name("model", 3, 2), weights_only=False)["model.embed_tokens.weight"]
    assert local._local_tensor.shape[0] == 37 - 2 * 13 and local.device_mesh.size() == 3


@pytest.mark.slow
@pytest.mark.parametrize("world_size_from,world_size_to", [(4, 2), (2, 4)])
def test_4_to_2_and_2_to_4(world_size_from, world_size_to, tmp_path, saved_at_2):
    folder, report = saved_at_2 if world_size_from == 2 else _saved(tmp_path / "ws4", 4)
    _reshard_and_load(_copy(folder, tmp_path), report, world_size_to, tmp_path)


def test_reshard_back_and_forth_gives_the_same_files_contents(saved_at_2, tmp_path):
    """2 -> 3 -> 2: every tensor of every rank file is the original (the pickled metadata may differ)."""
    folder = _copy(saved_at_2[0], tmp_path)
    reshard_checkpoint(str(folder), 3)
    reshard_checkpoint(str(folder), 2)
    _assert_same_files(saved_at_2[0] / "actor", folder / "actor", 2)


def _assert_same_files(a_dir: Path, b_dir: Path, world_size: int) -> None:
    for kind in ("model", "optim"):
        for rank in range(world_size):
            a = torch.load(a_dir / shard_name(kind, world_size, rank), weights_only=False)
            b = torch.load(b_dir / shard_name(kind, world_size, rank), weights_only=False)
            flat_a, flat_b = _leaves(a), _leaves(b)
            assert flat_a.keys() == flat_b.keys()
            for key, value in flat_a.items():
                if isinstance(value, torch.Tensor):
                    local = getattr(value, "_local_tensor", value)
                    assert torch.equal(local, getattr(flat_b[key], "_local_tensor", flat_b[key])), key
                else:
                    assert value == flat_b[key], key


def _leaves(value, prefix=""):
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _leaves(item, f"{prefix}/{key}").items()}
    if isinstance(value, (list, tuple)):
        return {k: v for i, item in enumerate(value) for k, v in _leaves(item, f"{prefix}/{i}").items()}
    return {prefix: value}


# ------------------------------------------------------------------------------------------- killed half-way

_KILLED = """
import sys, time
import gtpo.trainer.resume.reshard_shards as shards
from gtpo.trainer.resume.reshard import reshard_checkpoint

real, calls = shards.fsync, []
def fsync_then_hang(path):
    real(path)
    calls.append(path)
    if len(calls) == 3:  # model files of ranks 0-2 written, nothing else
        open(sys.argv[2], "w").close()
        time.sleep(600)
shards.fsync = fsync_then_hang
reshard_checkpoint(sys.argv[1], 3)
"""


def test_a_reshard_killed_half_way_leaves_the_original_and_starts_again(saved_at_2, tmp_path):
    """``kill -9`` after three of the nine new files: the original is byte for byte what it was and still the only
    set in ``actor/``; the next resume removes the partial copy and reshards again. A kill between the two renames
    (``actor`` moved aside, the new one not yet in place) is undone the same way."""
    folder = _copy(saved_at_2[0], tmp_path)
    before = _hashes(folder / "actor")
    flag = tmp_path / "hanging"
    proc = subprocess.Popen([sys.executable, "-c", _KILLED, str(folder), str(flag)], cwd=REPO)
    deadline = time.monotonic() + 120
    while not flag.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the reshard ended before the kill"
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    partial = folder / ("actor" + NEW_SUFFIX)
    assert sorted(p.name for p in partial.glob("*.pt")) == [shard_name("model", 3, r) for r in range(3)]
    assert _hashes(folder / "actor") == before
    assert sorted(shard_files(str(folder / "actor"))) == [2]

    assert finish_interrupted_reshards(str(folder.parent)) == [f"removed {partial}"]
    (folder / "actor").rename(folder / ("actor" + OLD_SUFFIX))  # a kill between the renames
    os.makedirs(folder / ("actor" + NEW_SUFFIX))
    assert finish_interrupted_reshards(str(folder)) == [
        f"restored {folder / 'actor'} from an interrupted reshard",
        f"removed {folder / ('actor' + NEW_SUFFIX)}",
    ]
    assert _hashes(folder / "actor") == before
    assert reshard_checkpoint(str(folder), 3) == {"actor": 2}  # the next resume's reshard, whole this time
    reference = _copy(saved_at_2[0], tmp_path / "reference")
    reshard_checkpoint(str(reference), 3)
    _assert_same_files(reference / "actor", folder / "actor", 3)


# --------------------------------------------------------------------------------------------------- refusals


def _run_config(tmp_path: Path, world_size: int, **model) -> OmegaConf:
    return OmegaConf.create(
        {
            "trainer": {"nnodes": 1, "n_gpus_per_node": world_size},
            "algorithm": {"resume": {"other_world_size": "reshard"}},
            "actor_rollout_ref": {"model": {"path": str(tmp_path / "model"), **model}, "actor": {}},
        }
    )


def _model_dir(tmp_path: Path, folder: Path, **changes) -> None:
    (tmp_path / "model").mkdir(exist_ok=True)
    config = json.loads((folder / "actor" / "huggingface" / "config.json").read_text())
    (tmp_path / "model" / "config.json").write_text(json.dumps({**config, **changes}))


SYNC = CheckpointLayout()


def test_the_resume_reshards_actor_and_critic_in_place_and_a_second_look_finds_nothing_to_do(
    saved_at_2, tmp_path, capsys
):
    folder = _copy(saved_at_2[0], tmp_path)
    shutil.copytree(folder / "actor", folder / "critic")  # a critic's files are the actor's format
    _model_dir(tmp_path, folder)
    config, layout = _run_config(tmp_path, 3), CheckpointLayout(use_critic=True)
    assert checkpoint_world_size.match_resume_world_size(str(folder), config, layout) == {"actor": 2, "critic": 2}
    assert f"gtpo: resharded {folder} to world size 3: actor from 2, critic from 2" in capsys.readouterr().out
    assert sorted(shard_files(str(folder / "critic"))) == [3]
    _assert_same_files(folder / "actor", folder / "critic", 3)
    assert checkpoint_world_size.match_resume_world_size(str(folder), config, layout) == {}


@pytest.mark.parametrize(
    "change,expect",
    [
        ("critic", "the run has a critic but {folder}/critic holds no critic shards"),
        ("lora", "the checkpoint holds a full model without adapters and the run trains LoRA adapters "
                 "(actor_rollout_ref.model.lora_rank=8)"),
        ("model", "the checkpoint is of another model than actor_rollout_ref.model.path={model} (hidden_size: 64 "
                  "saved, 128 in the run; num_hidden_layers: 2 saved, 3 in the run)"),
        ("hsdp", "actor_rollout_ref.actor.fsdp_config.fsdp_size=2 < world size 4 (HSDP)"),
        ("refuse", "algorithm.resume.other_world_size=refuse"),
    ],
    ids=["critic", "lora", "model", "hsdp", "refuse"],
)  # fmt: skip
def test_what_cannot_be_resharded_is_refused_before_anything_is_written(saved_at_2, tmp_path, change, expect):
    folder = _copy(saved_at_2[0], tmp_path)
    before = _hashes(folder / "actor")
    _model_dir(tmp_path, folder, **({"hidden_size": 128, "num_hidden_layers": 3} if change == "model" else {}))
    config = _run_config(tmp_path, 4, **({"lora_rank": 8} if change == "lora" else {}))
    if change == "hsdp":
        config.actor_rollout_ref.actor = {"fsdp_config": {"fsdp_size": 2}}
    if change == "refuse":
        config.algorithm.resume.other_world_size = "refuse"
    layout = CheckpointLayout(use_critic=change == "critic")
    with pytest.raises(RuntimeError) as err:
        checkpoint_world_size.match_resume_world_size(str(folder), config, layout)
    assert expect.format(folder=folder, model=tmp_path / "model") in str(err.value)
    assert _hashes(folder / "actor") == before and sorted(p.name for p in folder.iterdir()) == ["actor"]


def test_a_checkpoint_above_the_in_job_limit_is_refused_with_the_offline_command(saved_at_2, tmp_path):
    """Inside the job every GPU would wait for the reshard: above algorithm.resume.reshard_in_job_max_gb the run
    stops before anything is written, printing the command that does it offline; null reshards any size."""
    folder = _copy(saved_at_2[0], tmp_path)
    before = _hashes(folder / "actor")
    _model_dir(tmp_path, folder)
    config = _run_config(tmp_path, 3)
    size = checkpoint_world_size.checkpoint_bytes(str(folder)) / 1e9
    config.algorithm.resume.reshard_in_job_max_gb = size / 2
    with pytest.raises(RuntimeError) as err:
        checkpoint_world_size.match_resume_world_size(str(folder), config, SYNC)
    message = str(err.value)
    assert f"more than algorithm.resume.reshard_in_job_max_gb={size / 2:g}" in message
    assert f"`python -m gtpo.trainer.resume.reshard --from {folder} --world-size 3`" in message
    assert _hashes(folder / "actor") == before
    config.algorithm.resume.reshard_in_job_max_gb = None
    assert checkpoint_world_size.match_resume_world_size(str(folder), config, SYNC) == {"actor": 2}


def test_rows_are_written_back_slice_by_slice_with_the_same_bytes(saved_at_2, tmp_path, monkeypatch):
    """The write-back bound: with slices of a few rows every tensor is copied in many pieces, each handed to the
    write-back (msync-free sync_file_range, then the page cache dropped), and the files are byte-for-byte those of
    one copy per tensor."""
    from gtpo.trainer.resume import reshard_shards

    whole = _copy(saved_at_2[0], tmp_path / "whole")
    reshard_checkpoint(str(whole), 3)
    sliced = _copy(saved_at_2[0], tmp_path / "sliced")
    flushed = []
    real_flush = reshard_shards._WriteBack._flush

    def counting_flush(self, mapped):
        flushed.append(mapped.numel() * mapped.element_size())
        real_flush(self, mapped)

    monkeypatch.setattr(reshard_shards, "WRITEBACK_BYTES", 1024)
    monkeypatch.setattr(reshard_shards._WriteBack, "_flush", counting_flush)
    reshard_checkpoint(str(sliced), 3)
    assert max(flushed) <= 1024 and len(flushed) > 100, (max(flushed), len(flushed))
    assert _hashes(sliced / "actor") == _hashes(whole / "actor")


def test_a_lora_checkpoint_for_a_full_run_is_refused(tmp_path):
    actor = tmp_path / "global_step_2" / "actor"
    actor.mkdir(parents=True)
    for rank in range(2):
        adapter = {"model.layers.0.q_proj.lora_A.default.weight": torch.zeros(2)}
        torch.save(adapter, actor / shard_name("model", 2, rank))
    with pytest.raises(RuntimeError, match="the checkpoint holds LoRA adapters and the run trains the full model"):
        checkpoint_world_size.match_resume_world_size(str(actor.parent), _run_config(tmp_path, 1), SYNC)


@pytest.mark.parametrize(
    "plant,expect",
    [
        (lambda actor: (actor / "fsdp_config.json").write_text('{"FSDP_version": 1, "world_size": 2}'),
         "fsdp_config.json: FSDP_version=1; resharding reads FSDP2 checkpoints"),
        (lambda actor: (actor / shard_name("optim", 2, 1)).unlink(), "optim_world_size_2_rank_1.pt is missing"),
        (lambda actor: torch.save({"w": torch.zeros(3)}, actor / shard_name("model", 2, 1)),
         "rank 1 holds other entries than rank 0"),
        (lambda actor: (actor / shard_name("model", 2, 1)).write_bytes(b"cut short"),
         "model_world_size_2_rank_1.pt: cannot be read as a torch.save file"),
    ],
    ids=["fsdp1", "rank-file-missing", "foreign-entries", "truncated"],
)  # fmt: skip
def test_a_format_not_understood_is_refused_naming_the_file(saved_at_2, tmp_path, plant, expect):
    folder = _copy(saved_at_2[0], tmp_path)
    plant(folder / "actor")
    with pytest.raises(ReshardRefused, match=expect.replace(".", r"\.")):
        reshard_role(str(folder / "actor"), str(tmp_path / "out"), 3)
    with pytest.raises(ReshardRefused, match=expect.replace(".", r"\.")):
        reshard_checkpoint(str(folder), 3)
    assert sorted(p.name for p in folder.iterdir()) == ["actor"]  # the partial copy is gone


def test_a_rank_whose_rows_are_not_torch_chunks_cut_is_refused(saved_at_2, tmp_path):
    from torch.distributed.tensor import DTensor

    folder = _copy(saved_at_2[0], tmp_path)
    path = folder / "actor" / shard_name("model", 2, 1)
    state = torch.load(path, weights_only=False)
    value = state["model.embed_tokens.weight"]
    state["model.embed_tokens.weight"] = DTensor(value._local_tensor[:-1].clone(), value._spec, requires_grad=False)
    torch.save(state, path)
    with pytest.raises(ReshardRefused, match=r"rank 1 holds local rows of shape \(17, 64\) where torch.chunk's cut"):
        reshard_checkpoint(str(folder), 3)


# ------------------------------------------------------------------------------- the swap, and what each check holds


def test_a_kill_during_the_swap_itself_leaves_the_original_loadable(saved_at_2, tmp_path, monkeypatch):
    """A kill right after the first operation on ``actor/`` itself (the original moved aside; the new copy complete
    beside it, not yet renamed in): the next resume restores the original, byte for byte."""
    folder = _copy(saved_at_2[0], tmp_path)
    before = _hashes(folder / "actor")
    actor = str(folder / "actor")

    class Killed(BaseException):
        pass

    def killed_after(real):
        def op(src, *args, **kwargs):
            real(src, *args, **kwargs)
            if str(src) == actor:
                raise Killed  # nothing after this line of the reshard runs, as under kill -9

        return op

    monkeypatch.setattr(os, "replace", killed_after(os.replace))
    monkeypatch.setattr(shutil, "rmtree", killed_after(shutil.rmtree))
    with pytest.raises(Killed):
        reshard_checkpoint(str(folder), 3)
    monkeypatch.undo()
    assert not (folder / "actor").exists() and sorted(shard_files(actor + NEW_SUFFIX)) == [3]
    assert finish_interrupted_reshards(str(folder)) == [
        f"restored {actor} from an interrupted reshard",
        f"removed {actor + NEW_SUFFIX}",
    ]
    assert _hashes(folder / "actor") == before and sorted(p.name for p in folder.iterdir()) == ["actor"]


def test_an_original_left_after_a_complete_swap_is_removed(saved_at_2, tmp_path):
    """A kill after the second rename, before the original's removal: ``actor/`` is the new copy and stays."""
    folder = _copy(saved_at_2[0], tmp_path)
    shutil.copytree(folder / "actor", folder / ("actor" + OLD_SUFFIX))
    before = _hashes(folder / "actor")
    assert finish_interrupted_reshards(str(folder)) == [f"removed {folder / ('actor' + OLD_SUFFIX)}"]
    assert sorted(p.name for p in folder.iterdir()) == ["actor"] and _hashes(folder / "actor") == before


def test_refuse_also_refuses_a_critic_at_another_size(saved_at_2, tmp_path):
    """``other_world_size=refuse`` with the actor at the run's size and only ``critic/`` at another: refused, the
    critic untouched (not resharded as with ``reshard``)."""
    folder = _copy(saved_at_2[0], tmp_path)
    reshard_role(str(folder / "actor"), str(folder / "critic"), 3)
    before = _hashes(folder / "critic")
    _model_dir(tmp_path, folder)
    config = _run_config(tmp_path, 2)
    config.algorithm.resume.other_world_size = "refuse"
    with pytest.raises(RuntimeError, match=f"cannot resume from {folder}: its critic is at another world size than 2"):
        checkpoint_world_size.match_resume_world_size(str(folder), config, CheckpointLayout(use_critic=True))
    assert _hashes(folder / "critic") == before and sorted(shard_files(str(folder / "critic"))) == [3]


def _resave(path: Path, change) -> None:
    state = torch.load(path, weights_only=False)
    change(state)
    torch.save(state, path)


def test_a_scheduler_state_that_differs_between_ranks_is_refused(saved_at_2, tmp_path):
    """Only sharded entries may differ between rank files: rank 1's ``lr_scheduler.last_epoch`` one higher."""
    folder = _copy(saved_at_2[0], tmp_path)
    path = folder / "actor" / shard_name("extra_state", 2, 1)
    _resave(path, lambda state: state["lr_scheduler"].update(last_epoch=state["lr_scheduler"]["last_epoch"] + 1))
    with pytest.raises(ReshardRefused, match=r"\['lr_scheduler'\]\['last_epoch'\]: rank 1's value differs from rank"):
        reshard_checkpoint(str(folder), 3)
    assert sorted(p.name for p in folder.iterdir()) == ["actor"]


def test_a_nan_the_same_on_every_rank_is_resharded(saved_at_2, tmp_path):
    folder = _copy(saved_at_2[0], tmp_path)
    for rank in range(2):
        _resave(folder / "actor" / shard_name("extra_state", 2, rank), lambda state: state.update(best=float("nan")))
    assert reshard_checkpoint(str(folder), 3) == {"actor": 2}
    new = torch.load(folder / "actor" / shard_name("extra_state", 3, 2), weights_only=False)
    assert new["best"] != new["best"]  # NaN, written once per new rank


def test_a_dtensor_on_a_mesh_of_another_size_than_the_files_say_is_refused(saved_at_2, tmp_path):
    """Both rank files' embedding re-saved on a mesh of 4 ranks (same local rows; the names still say 2)."""
    import dataclasses

    from torch.distributed.tensor import DTensor

    from gtpo.trainer.resume.reshard_shards import _new_mesh

    folder = _copy(saved_at_2[0], tmp_path)
    for rank in range(2):

        def four(state, rank=rank):
            value = state["model.embed_tokens.weight"]
            spec = dataclasses.replace(value._spec, mesh=_new_mesh(value.device_mesh, 4, rank))
            state["model.embed_tokens.weight"] = DTensor(value._local_tensor, spec, requires_grad=False)

        _resave(folder / "actor" / shard_name("model", 2, rank), four)
    with pytest.raises(ReshardRefused, match=r"model.embed_tokens.weight'\] \(rank 0\): a DTensor on mesh \(4,\)"):
        reshard_checkpoint(str(folder), 3)


@pytest.mark.parametrize("record", ['{"FSDP_version": 3, "world_size": 2}', '{"world_size": 2}'])
def test_an_fsdp_version_other_than_2_is_refused(saved_at_2, tmp_path, record):
    folder = _copy(saved_at_2[0], tmp_path)
    (folder / "actor" / "fsdp_config.json").write_text(record)
    version = json.loads(record).get("FSDP_version")
    with pytest.raises(ReshardRefused, match=f"fsdp_config.json: FSDP_version={version!r}; resharding reads FSDP2"):
        reshard_checkpoint(str(folder), 3)


def test_another_vocabulary_is_another_model(saved_at_2, tmp_path):
    folder = _copy(saved_at_2[0], tmp_path)
    _model_dir(tmp_path, folder, vocab_size=38)
    problems = checkpoint_world_size.reshard_problems(str(folder), _run_config(tmp_path, 3), SYNC)
    assert len(problems) == 1 and "(vocab_size: 37 saved, 38 in the run)" in problems[0]


def test_an_empty_critic_folder_is_no_critic(saved_at_2, tmp_path):
    folder = _copy(saved_at_2[0], tmp_path)
    (folder / "critic").mkdir()
    _model_dir(tmp_path, folder)
    problems = checkpoint_world_size.reshard_problems(str(folder), _run_config(tmp_path, 3), CheckpointLayout(True))
    assert problems == [f"the run has a critic but {folder}/critic holds no critic shards"]


def test_fsdp_over_the_whole_world_is_not_hsdp(saved_at_2, tmp_path):
    folder = _copy(saved_at_2[0], tmp_path)
    _model_dir(tmp_path, folder)
    config = _run_config(tmp_path, 4)
    config.actor_rollout_ref.actor = {"fsdp_config": {"fsdp_size": 4}}
    assert checkpoint_world_size.reshard_problems(str(folder), config, SYNC) == []


def test_bare_adapter_keys_are_lora(tmp_path):
    """``save_lora_only`` files whose keys start with ``lora_`` (no dotted prefix)."""
    actor = tmp_path / "actor"
    actor.mkdir()
    torch.save({"lora_A.weight": torch.zeros(2), "lora_B.weight": torch.zeros(2)}, actor / shard_name("model", 1, 0))
    assert checkpoint_world_size._checkpoint_is_lora(str(actor), 1)


@pytest.mark.parametrize("rows", range(9))
@pytest.mark.parametrize("world_size", range(1, 6))
def test_the_row_cut_is_torch_chunks(rows, world_size):
    """Including the cuts the tiny model never has: 1 row over 3 ranks, 5 rows over 4 (empty ranks at the end)."""
    from gtpo.trainer.resume.reshard_shards import _chunk_rows

    chunks = torch.arange(rows).chunk(world_size) if rows else ()
    for rank in range(world_size):
        expect = chunks[rank].tolist() if rank < len(chunks) else []
        start, end = _chunk_rows(rows, world_size, rank)
        assert list(range(start, end)) == expect, (rows, world_size, rank)


def test_the_new_ranks_rng_is_fresh_per_rank_and_seeded_by_the_step(saved_at_2, tmp_path):
    """2 -> 4: ranks 2 and 3 get generator states of their own, seeded by the step of ``global_step_<N>``."""
    from gtpo.trainer.resume.reshard_shards import _fresh_rng

    folder = tmp_path / "run" / "global_step_7"
    shutil.copytree(saved_at_2[0], folder)
    old = torch.load(folder / "actor" / shard_name("extra_state", 2, 0), weights_only=False)["rng"]
    assert reshard_checkpoint(str(folder), 4) == {"actor": 2}
    new = [torch.load(folder / "actor" / shard_name("extra_state", 4, r), weights_only=False)["rng"] for r in (2, 3)]
    assert not torch.equal(new[0]["cpu"], new[1]["cpu"]) and new[0]["random"] != new[1]["random"]
    for rank, rng in zip((2, 3), new, strict=True):
        assert torch.equal(rng["cpu"], _fresh_rng(old, 7, rank)["cpu"])
        assert not torch.equal(rng["cpu"], _fresh_rng(old, 0, rank)["cpu"])


def test_the_resharded_role_folder_is_private(saved_at_2, tmp_path):
    folder = _copy(saved_at_2[0], tmp_path)
    old = os.umask(0o022)
    try:
        reshard_checkpoint(str(folder), 3)
    finally:
        os.umask(old)
    assert (folder / "actor").stat().st_mode & 0o777 == 0o700


def test_out_copies_a_role_already_at_the_size(saved_at_2, tmp_path):
    folder = _copy(saved_at_2[0], tmp_path)
    out = tmp_path / "copy"
    assert reshard_checkpoint(str(folder), 2, out=str(out)) == {}
    assert _hashes(out / "actor") == _hashes(folder / "actor") and sorted(shard_files(str(out / "actor"))) == [2]


# -------------------------------------------------------------------------------------------- the offline command


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gtpo.trainer.resume.reshard", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_offline_command_writes_a_copy_and_leaves_the_original(saved_at_2, tmp_path):
    folder = _copy(saved_at_2[0], tmp_path)
    (folder / "data.pt").write_bytes(b"dataloader")
    before = _hashes(folder / "actor")
    out = tmp_path / "copy" / "global_step_2"
    out.parent.mkdir()
    done = _cli("--from", str(folder), "--world-size", "3", "--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == f"gtpo reshard: {out}/actor: world size 2 -> 3"
    assert _hashes(folder / "actor") == before
    assert sorted(shard_files(str(out / "actor"))) == [3] and (out / "data.pt").read_bytes() == b"dataloader"
    again = _cli("--from", str(folder), "--world-size", "2")
    assert again.returncode == 0 and "already at world size 2" in again.stdout
    exists = _cli("--from", str(folder), "--world-size", "3", "--out", str(out))
    assert exists.returncode == 2 and f"--out {out} exists; name a new folder" in exists.stderr
    bad = _cli("--from", str(folder), "--world-size", "0")
    assert bad.returncode == 2 and "--world-size 0: must be >= 1" in bad.stderr


def _tree_hashes(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}  # fmt: skip


def test_an_evaluation_at_another_world_size_reshards_a_copy_of_its_own(saved_at_2, tmp_path, capsys):
    """scripts/eval_checkpoint.sh on another shape: the run's checkpoint (its run may still be training from it) is
    left byte for byte; the evaluation loads a copy resharded in its own folder, and the trainer never reshards an
    evaluation's checkpoint in place."""
    from gtpo.launch.checks import reshard_evaluation_copy

    folder = _copy(saved_at_2[0], tmp_path / "run")
    _model_dir(tmp_path, folder)
    before = _tree_hashes(folder)
    config = _run_config(tmp_path, 3)
    config.trainer.update(val_only=True, resume_mode="resume_path", resume_from_path=str(folder),
                          default_local_dir=str(tmp_path / "run-eval-step2"))  # fmt: skip
    copy = tmp_path / "run-eval-step2" / "resharded" / folder.name
    with pytest.raises(RuntimeError, match="an evaluation never reshards the run's checkpoint in place"):
        checkpoint_world_size.match_resume_world_size(str(folder), config, SYNC)
    assert reshard_evaluation_copy(config, SYNC) == str(copy)
    assert config.trainer.resume_from_path == str(copy)
    assert f"through a copy resharded to world size 3: {copy}" in capsys.readouterr().out
    assert sorted(shard_files(str(copy / "actor"))) == [3] and _tree_hashes(folder) == before
    # the trainer finds the copy at its size; a second evaluation at this size reuses it
    assert checkpoint_world_size.match_resume_world_size(str(copy), config, SYNC) == {}
    config.trainer.resume_from_path = str(folder)
    assert reshard_evaluation_copy(config, SYNC) == str(copy) and "resharded" not in capsys.readouterr().out
    assert _tree_hashes(folder) == before
