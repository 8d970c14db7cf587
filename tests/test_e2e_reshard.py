"""A resume at another world size through verl 0.9.1's real trainer on CPU: the checkpoint is resharded before any
worker loads, and training goes on where it stopped.

    GTPO_SLOW_TESTS=1 .venv/bin/python -m pytest -q tests/test_e2e_reshard.py

``gtpo`` on the session cluster's two simulated nodes (tests/support/e2e.py), three runs on one checkpoint folder,
one metric log (``VERL_FILE_LOGGER_PATH``: a resumed run appends to it) and one rollout-dump folder:

1. world size two (one FSDP rank and one vLLM replica on each node), steps 1-2, a checkpoint every 2 steps;
2. ``trainer.resume_mode=auto`` at world size one (the CPU backend's own size, the same batch settings) to step 4:
   the driver reshards ``global_step_2`` from two ranks to one before Ray starts
   (``algorithm.resume.other_world_size=reshard``, the default), the trainer finds it at the run's size and loads it;
3. ``trainer.resume_mode=auto`` at world size two to step 6: ``global_step_4`` is resharded from one rank to two.

What carries over, each checked against values known without the code under test: the weights and both AdamW
moments of each resharded checkpoint (the same full tensors before and after); the step count (every step 1-6
logged once, in order, ``training/global_step`` = the step); the learning-rate schedule (a linear warm-up over
``WARMUP`` steps: ``actor/lr`` after step k is ``LR * k / WARMUP``, which a scheduler restarted at a resume would not
give) and the optimizer's step count (6 AdamW steps in the last checkpoint); the data order (the prompts of every step
are those of an uninterrupted run: the trainer's sampler draws one ``torch.randperm`` of the 16 training rows from
``data.seed``, reproduced here and checked against the first run's steps 1-2, so no prompt of the epoch repeats);
and the recipe's ``gtpo_state.json`` in every checkpoint.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest
import torch

from tests.support.e2e import WORLD_SIZE_2, assert_ran, base_overrides, read_metrics, run_recipe, shard_names, tail

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

WORLD_SIZE_1 = ("trainer.nnodes=1", "trainer.n_gpus_per_node=1")
SEED = 7
LR = 1e-3  # base_overrides' actor learning rate
WARMUP = 10  # linear warm-up steps: the learning rate still rises at step 6
PROMPTS_PER_STEP = 2  # the CPU backend's data.train_batch_size
RUN_TIMEOUT_S = 900


def _shards(world_size: int) -> list[str]:
    """The shard files verl's FSDP checkpoint manager writes into ``actor/`` at ``world_size``, sorted."""
    kinds = ("model", "optim", "extra_state")
    return sorted(f"{kind}_world_size_{world_size}_rank_{rank}.pt" for kind in kinds for rank in range(world_size))


def _gathered(actor_dir: Path, kind: str) -> dict[str, torch.Tensor]:
    """Every tensor of the ``kind`` (``model`` / ``optim``) files of ``actor_dir`` whole, by its path in the state:
    a DTensor as its ranks' local rows in rank order (FSDP2 shards dimension 0), any other tensor as rank 0 holds it."""
    from torch.distributed.tensor import DTensor

    files = sorted(actor_dir.glob(f"{kind}_world_size_*_rank_*.pt"), key=lambda p: int(p.stem.rpartition("_")[2]))
    out: dict[str, torch.Tensor] = {}

    def walk(values: list, path: str) -> None:
        first = values[0]
        if isinstance(first, DTensor):
            out[path] = torch.cat([v.to_local() for v in values])
        elif isinstance(first, torch.Tensor):
            out[path] = first.clone()
        elif isinstance(first, dict):
            for key in first:
                walk([v[key] for v in values], f"{path}/{key}")
        elif isinstance(first, (list, tuple)):
            for i in range(len(first)):
                walk([v[i] for v in values], f"{path}/{i}")

    walk([torch.load(f, map_location="cpu", weights_only=False) for f in files], kind)
    assert out, f"no tensors in {actor_dir}/{kind}_*"
    return out


def _snapshot(actor_dir: Path) -> dict[str, torch.Tensor]:
    return {**_gathered(actor_dir, "model"), **_gathered(actor_dir, "optim")}


def _assert_same_state(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], where: Path) -> None:
    assert before.keys() == after.keys(), f"{where}: entries differ, {sorted(before.keys() ^ after.keys())[:5]}"
    differ = [k for k in before if before[k].shape != after[k].shape or not torch.equal(before[k], after[k])]
    assert not differ, f"{where}: resharding changed {differ[:5]}"
    assert any("exp_avg_sq" in k for k in before), f"{where}: no AdamW moments in the optimizer state"


def _step_questions(dump_file: Path, questions: list[str]) -> set[int]:
    """Training-row indices of the prompts in one step's rollout dump (verl's ``<step>.jsonl``, decoded prompts)."""
    inputs = {json.loads(line)["input"] for line in dump_file.read_text().splitlines() if line.strip()}
    rows = set()
    for text in inputs:
        found = [i for i, q in enumerate(questions) if q in text]
        assert len(found) == 1, f"{dump_file}: prompt matches rows {found}: {text[:200]!r}"
        rows |= set(found)
    return rows


def _state_steps(folder: Path) -> int:
    return json.loads((folder / "gtpo_state.json").read_text())["global_steps"]


def _resumed(cluster, tmp_path, overrides: list[str], steps: int, name: str):
    return run_recipe(
        cluster,
        tmp_path,
        overrides + [f"trainer.total_training_steps={steps}", "trainer.resume_mode=auto"],
        timeout=RUN_TIMEOUT_S,
        name=name,
        metrics_name="reshard",
    )


def _assert_resharded(result, folder: Path, world_size: int, old: int, step: int) -> None:
    """The run ended well, the driver resharded ``folder`` once (the trainer found it at the run's size) and the
    trainer resumed from it."""
    assert result.returncode == 0, f"{result.log_path.name} failed (rc={result.returncode}):\n{tail(result.log)}"
    log = result.log
    assert f"gtpo: resharded {folder} to world size {world_size}: actor from {old}" in log, tail(log)
    assert log.count("gtpo: resharded") == 1, "resharded more than once"
    assert f"gtpo: resumed from {folder} at step {step}" in log, tail(log)
    assert shard_names(folder / "actor") == _shards(world_size)
    assert sorted(p.name for p in folder.iterdir() if ".reshard" in p.name or ".pre-reshard" in p.name) == []


def test_resume_at_world_size_1_then_2_reshards_and_continues(ray_cluster, tiny_assets, tmp_path):
    ckpt = tmp_path / "ckpt"
    dumps = tmp_path / "rollouts"
    common = base_overrides(tiny_assets) + [
        "method=gtpo",
        "algorithm.filter_groups.enable=false",  # one batch of prompts per step: the data order is the sampler's
        f"data.seed={SEED}",
        f"actor_rollout_ref.actor.optim.lr_warmup_steps={WARMUP}",
        f"trainer.default_local_dir={ckpt}",
        "trainer.save_freq=2",
        f"trainer.rollout_data_dir={dumps}",
    ]
    world_2, world_1 = common + list(WORLD_SIZE_2), common + list(WORLD_SIZE_1)
    step2, step4, step6 = (ckpt / f"global_step_{n}" for n in (2, 4, 6))

    # 1. World size two, steps 1-2.
    first = run_recipe(
        ray_cluster, tmp_path, world_2 + ["trainer.total_training_steps=2"], timeout=RUN_TIMEOUT_S, name="reshard"
    )
    assert_ran(first, steps=2)
    assert first.steps() == [1, 2]
    assert shard_names(step2 / "actor") == _shards(2)
    saved_at_2 = _snapshot(step2 / "actor")

    # 2. World size one, steps 3-4, from global_step_2 resharded 2 -> 1.
    second = _resumed(ray_cluster, tmp_path, world_1, steps=4, name="world1")
    _assert_resharded(second, step2, world_size=1, old=2, step=2)
    _assert_same_state(saved_at_2, _snapshot(step2 / "actor"), step2)
    del saved_at_2
    after_second = read_metrics(tmp_path / "reshard.metrics.jsonl")
    assert [r["step"] for r in after_second] == [1, 2, 3, 4]
    assert after_second[:2] == first.metrics  # the history before the checkpoint kept as it was
    assert shard_names(step4 / "actor") == _shards(1)
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    saved_at_4 = _snapshot(step4 / "actor")

    # 3. World size two, steps 5-6, from global_step_4 resharded 1 -> 2.
    third = _resumed(ray_cluster, tmp_path, world_2, steps=6, name="world2")
    _assert_resharded(third, step4, world_size=2, old=1, step=4)
    _assert_same_state(saved_at_4, _snapshot(step4 / "actor"), step4)
    del saved_at_4
    assert shard_names(step6 / "actor") == _shards(2)
    assert shard_names(step2 / "actor") == _shards(1)  # an older checkpoint is left as it is
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "6"

    # Every step once, in order, the history of each run kept by the next.
    raw = read_metrics(tmp_path / "reshard.metrics.jsonl")
    assert [r["step"] for r in raw] == [1, 2, 3, 4, 5, 6]
    assert raw[:4] == after_second
    for r in raw:
        data, step = r["data"], r["step"]
        for key in ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "critic/rewards/mean"):
            assert key in data and math.isfinite(float(data[key])), f"step {step}: {key}={data.get(key)}"
        assert -1.0 <= data["critic/score/mean"] <= 1.0  # the coin reward is +1 or -1
        assert data["training/global_step"] == step
        # warm-up: the scheduler's k-th step sets LR * k / WARMUP (restarted at a resume, step 3 would log step 1's)
        assert data["actor/lr"] == pytest.approx(LR * step / WARMUP, rel=1e-6), f"step {step}: {data['actor/lr']}"
    # The optimizer and the scheduler went through both reshards: one AdamW step per training step.
    optim = torch.load(step6 / "actor" / "optim_world_size_2_rank_0.pt", map_location="cpu", weights_only=False)
    assert {float(s["step"]) for s in optim["state"].values()} == {6.0}
    extra = torch.load(step6 / "actor" / "extra_state_world_size_2_rank_1.pt", map_location="cpu", weights_only=False)
    assert extra["lr_scheduler"]["last_epoch"] == 6

    # The recipe's state file in every checkpoint, the resharded ones included.
    assert [_state_steps(folder) for folder in (step2, step4, step6)] == [2, 4, 6]

    # Data order: the sampler's permutation of the epoch, two rows a step, as an uninterrupted run draws them.
    questions = [row["question"] for row in pd.read_parquet(tiny_assets.train_parquet)["extra_info"]]
    order = torch.randperm(len(questions), generator=torch.Generator().manual_seed(SEED)).tolist()
    expected = {k: set(order[(k - 1) * PROMPTS_PER_STEP : k * PROMPTS_PER_STEP]) for k in range(1, 7)}
    drawn = {k: _step_questions(dumps / f"{k}.jsonl", questions) for k in range(1, 7)}
    # the reproduction is the trainer's order: the first run's own steps
    assert [drawn[1], drawn[2]] == [expected[1], expected[2]], (drawn, order)
    assert drawn == expected, (drawn, order)
    every = [row for k in sorted(drawn) for row in drawn[k]]
    assert len(every) == len(set(every)) == 6 * PROMPTS_PER_STEP  # no prompt of the epoch twice
