"""A run checkpointed at world size 2, resharded to 1, continued, checkpointed, resharded back to 2 and continued
trains step by step as the same run without interruption, through verl 0.9.1's real actor worker.

    GTPO_SLOW_TESTS=1 .venv/bin/python -m pytest -q tests/test_reshard_dp.py -p no:cacheprovider

How (``tests/support/reshard_dp.py``): gloo rank processes without Ray build verl's ``ActorRolloutRefWorker`` (FSDP2
engine, the recipe's loss as ``GTPOTrainerMixin`` installs it) from the recipe's config for ``method=gtpo``, as
``tests/support/dp.py`` does for ``tests/test_dp_equivalence.py``, with AdamW (weight decay 0.01) and verl's cosine
schedule with two warm-up steps: the learning rate of updates 1, 2, 3 is 0.5, 1 and 0.75 times 1e-3. Every update
trains on the same fixed driver batch (dp.py's 4 prompt groups, 15 responses and verl's padding row, the old-policy
log-probs and the advantages computed once by the recipe's driver), so nothing is sampled.

* The uninterrupted run: 2 ranks run updates 1, 2, 3 and save after update 1 with the worker's ``save_checkpoint``
  into ``global_step_1/actor``, as verl's trainer does at ``save_freq`` (the interrupted run's first life).
* The interrupted run: ``reshard_checkpoint(global_step_1, 1)``; 1 rank loads it with the worker's
  ``load_checkpoint``, runs update 2 and saves ``global_step_2``; ``reshard_checkpoint(global_step_2, 2)``; 2 ranks
  load it and run update 3.
* Each reshard is first killed (``SIGKILL``, a child process): the one to 1 after its first new file and, run
  again, between its two renames; the one to 2 after its swap, before the original is removed. The original stays
  byte for byte what verl wrote until a reshard completes; ``finish_interrupted_reshards`` puts it back (or removes
  it after a complete swap), and the run then continues as if nothing had been killed.

Proven:

* exact: after each load, the full parameters, both AdamW moments, the optimizer's step and the scheduler's
  position equal (``torch.equal``) those the saving ranks held at the save, at the other world size;
* within fp32 rounding: updates 2 (1 rank) and 3 (2 ranks) give the uninterrupted run's ``actor/pg_loss``,
  ``actor/loss`` and ``actor/grad_norm`` to relative 1e-5 (the bound of the dp = 1 vs 2 equivalence test; observed
  at most 6e-7) and the same learning rate, and its weights to absolute 5e-6. The dp = 1 update sums the same fp32
  terms in another order, as in ``tests/test_dp_equivalence.py`` (weights within 1e-6 after one SGD step there);
  AdamW divides by the root of the second moment, which carries that rounding into later steps, and the weights
  after update 3 differ by up to 5.7e-7 (after update 2: 4e-8). The bound is about 10 times that and 100 times
  below the smallest change any parameter tensor gets from an update (its largest element: 5e-4 at update 1,
  1e-3 at update 2, 7.3e-4 at update 3; AdamW moves an element by about the learning rate);
* the schedule and the optimizer are the ones stated: the learning rates after updates 1, 2, 3 are 1, 0.75 and
  0.25 times 1e-3 (hand-computed from verl's formula), and update 1, AdamW's first step (``lr * g / |g|`` plus the
  decay ``lr * 0.01 * w``), changes every parameter tensor by 0.5e-3 (warm-up) within 2%.

A lost optimizer state changes the result far beyond the bound (checked by hand): loading ``global_step_1`` at 1 rank
without its optimizer file (``checkpoint.load_contents=[model, extra]``: fresh AdamW moments) fails the exact check
and moves the weights of update 2 by 7e-4 to 1.2e-3 (every parameter tensor) away from the uninterrupted run's.

Runtime: 45-70 s on 2 cores (five rank processes in three phases, each importing verl, and three reshard
processes): the slow tier.
"""

from __future__ import annotations

import os

import pytest
import torch

from gtpo.trainer.resume.checkpoints import SHARD_KINDS, shard_files, shard_name
from gtpo.trainer.resume.reshard import NEW_SUFFIX, OLD_SUFFIX, finish_interrupted_reshards, reshard_checkpoint
from tests.support import dp as S
from tests.support import reshard_dp as R

pytestmark = pytest.mark.slow

LOSS_RTOL = 1e-5
WEIGHT_ATOL = 5e-6
# the lr factor of each update's schedule position (warm-up 1/2, then 0.5 * (1 + cos(pi * k / 3)) for k = 0, 1, 2),
# as the worker reports it: the lr set for the next update
LR_AFTER = {1: 1.0, 2: 0.75, 3: 0.25}


def _entries(folder) -> list[str]:
    return sorted(os.listdir(folder))


def _pt_files(folder) -> list[str]:
    return sorted(p.name for p in folder.glob("*.pt"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, worker_id):
    """The uninterrupted run, the interrupted one, and what was on disk after each kill. Computed once per session:
    pytest-xdist workers share it through the session's base folder."""
    if worker_id == "master":
        return _run_all(tmp_path_factory.mktemp("reshard_dp"))
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp().parent / "reshard_dp"
    with FileLock(f"{shared}.lock"):
        if not (shared / "runs.pt").exists():
            shared.mkdir()
            torch.save(_run_all(shared), shared / "runs.pt")
        return torch.load(shared / "runs.pt", weights_only=False)


def _run_all(tmp):
    import gtpo.verl_plugin.register  # noqa: F401

    old, trained = S.build_models()
    model_dir = S.write_model_dir(tmp / "model", trained)
    cfg = S.compose_config(R.METHOD, model_dir)
    batches = {dp: S.driver_batch(cfg, dp, old) for dp in (1, 2)}
    root = tmp / "checkpoints"
    seen: dict = {}

    reference = R.run_phase(R.phase(2, batches[2], model_dir, root, (1, 2, 3), save_at=1), tmp / "uninterrupted")
    step1 = R.checkpoint_dir(root, 1)
    seen["saved_1"] = R.hashes(step1 / "actor")
    R.killed_reshard(step1, 1, "after_first_file")
    seen["after_first_file"] = (
        _entries(step1), _pt_files(step1 / ("actor" + NEW_SUFFIX)), R.hashes(step1 / "actor")
    )  # fmt: skip
    R.killed_reshard(step1, 1, "between_renames")
    seen["between_renames"] = (
        _entries(step1), sorted(shard_files(str(step1 / ("actor" + NEW_SUFFIX)))),
        R.hashes(step1 / ("actor" + OLD_SUFFIX)),
    )  # fmt: skip
    seen["finish_1"] = finish_interrupted_reshards(str(root))
    seen["restored_1"] = (_entries(step1), R.hashes(step1 / "actor"))
    seen["reshard_1"] = reshard_checkpoint(str(step1), 1)
    seen["files_1"] = _pt_files(step1 / "actor")

    at_1 = R.run_phase(R.phase(1, batches[1], model_dir, root, (2,), load_step=1, save_at=2), tmp / "dp1")
    step2 = R.checkpoint_dir(root, 2)
    seen["saved_2"] = R.hashes(step2 / "actor")
    R.killed_reshard(step2, 2, "before_cleanup")
    seen["before_cleanup"] = (
        _entries(step2), R.hashes(step2 / ("actor" + OLD_SUFFIX)), sorted(shard_files(str(step2 / "actor")))
    )  # fmt: skip
    seen["finish_2"] = finish_interrupted_reshards(str(root))
    seen["reshard_2"] = reshard_checkpoint(str(step2), 2)
    seen["files_2"] = (_entries(step2), _pt_files(step2 / "actor"))

    at_2 = R.run_phase(R.phase(2, batches[2], model_dir, root, (3,), load_step=2), tmp / "dp2")
    initial = {name: p.detach().clone() for name, p in trained.named_parameters()}
    return {"reference": reference, "at_1": at_1, "at_2": at_2, "seen": seen, "root": root, "initial": initial}


def _names(kinds, world_size: int) -> list[str]:
    return sorted(shard_name(k, world_size, r) for k in kinds for r in range(world_size))


def test_a_killed_reshard_leaves_verls_files_and_is_finished_or_undone(runs):
    """Killed after its first new file: ``actor/`` is byte for byte what verl saved, beside a partial
    ``actor.reshard/`` of one file. Killed between the renames: the original whole in ``actor.pre-reshard/``, the new
    set complete in ``actor.reshard/``; ``finish_interrupted_reshards`` puts the original back unchanged and removes
    the copy. Killed after the swap: the new set in ``actor/``, the original whole beside it, removed by
    ``finish_interrupted_reshards``; the reshard then has nothing left to do."""
    seen, root = runs["seen"], runs["root"]
    step1, step2 = R.checkpoint_dir(root, 1), R.checkpoint_dir(root, 2)
    assert seen["saved_1"] and all(name in seen["saved_1"] for name in _names(SHARD_KINDS, 2))

    entries, partial, original = seen["after_first_file"]
    assert entries == ["actor", "actor" + NEW_SUFFIX]
    assert partial == [shard_name("model", 1, 0)]
    assert original == seen["saved_1"]

    entries, new_sizes, original = seen["between_renames"]
    assert entries == ["actor" + OLD_SUFFIX, "actor" + NEW_SUFFIX]
    assert new_sizes == [1]
    assert original == seen["saved_1"]
    assert seen["finish_1"] == [
        f"restored {step1 / 'actor'} from an interrupted reshard",
        f"removed {step1 / ('actor' + NEW_SUFFIX)}",
    ]
    assert seen["restored_1"] == (["actor"], seen["saved_1"])
    assert seen["reshard_1"] == {"actor": 2}
    assert seen["files_1"] == _names(SHARD_KINDS, 1)

    entries, original, new_sizes = seen["before_cleanup"]
    assert entries == ["actor", "actor" + OLD_SUFFIX]
    assert original == seen["saved_2"] and all(name in original for name in _names(SHARD_KINDS, 1))
    assert new_sizes == [2]
    assert seen["finish_2"] == [f"removed {step2 / ('actor' + OLD_SUFFIX)}"]
    assert seen["reshard_2"] == {}
    assert seen["files_2"] == (["actor"], _names(SHARD_KINDS, 2))


def _assert_same_state(loaded: dict, saved: dict) -> None:
    assert loaded["params"].keys() == saved["params"].keys()
    for part in ("params", "exp_avg", "exp_avg_sq"):
        assert loaded[part].keys() == saved[part].keys() == saved["params"].keys(), part
        for name, value in saved[part].items():
            assert torch.equal(loaded[part][name], value), (part, name)
    assert loaded["step"] == saved["step"]
    assert (loaded["last_epoch"], loaded["lr"]) == (saved["last_epoch"], saved["lr"])


def test_each_load_restores_the_saved_training_state_exactly(runs):
    """1 rank after loading ``global_step_1`` (saved by 2, resharded to 1), and 2 ranks after loading
    ``global_step_2`` (saved by 1, resharded to 2), hold exactly the full parameters, AdamW moments, optimizer
    steps and scheduler position of the saving ranks at their save."""
    reference, at_1, at_2 = runs["reference"], runs["at_1"], runs["at_2"]
    assert set(reference.saved["step"].values()) == {1.0} and reference.saved["last_epoch"] == 1
    assert set(at_1.saved["step"].values()) == {2.0} and at_1.saved["last_epoch"] == 2
    assert any(v.abs().max() > 0 for v in reference.saved["exp_avg"].values())
    _assert_same_state(at_1.loaded, reference.saved)
    _assert_same_state(at_2.loaded, at_1.saved)


def assert_same_update(got_metrics: dict, got_weights: dict, ref_metrics: dict, ref_weights: dict) -> None:
    """The update's metrics to :data:`LOSS_RTOL` and weights to :data:`WEIGHT_ATOL`."""
    for key in ("actor/pg_loss", "actor/loss", "actor/grad_norm"):
        assert got_metrics[key] == pytest.approx(ref_metrics[key], rel=LOSS_RTOL, abs=1e-8), key
    assert got_metrics["actor/lr"] == ref_metrics["actor/lr"]
    assert got_weights.keys() == ref_weights.keys()
    for name, value in ref_weights.items():
        torch.testing.assert_close(got_weights[name], value, rtol=0, atol=WEIGHT_ATOL, msg=name)


def test_the_resharded_run_continues_as_the_uninterrupted_one(runs):
    """Update 2 at 1 rank from the resharded ``global_step_1`` and update 3 at 2 ranks from the resharded
    ``global_step_2`` give the uninterrupted 2-rank run's ``pg_loss``, ``loss`` and ``grad_norm`` (relative 1e-5),
    learning rate and weights (absolute 5e-6), while each update moves every parameter tensor far beyond that bound;
    the learning rates follow the stated schedule and update 1 is AdamW's first step at the warm-up's half rate."""
    reference, at_1, at_2 = runs["reference"], runs["at_1"], runs["at_2"]
    previous = runs["initial"]
    first = [float((reference.weights[1][n] - previous[n]).abs().max()) for n in previous]
    assert all(0.5 * R.LR * 0.99 < move < 0.5 * R.LR * 1.02 for move in first), (min(first), max(first))
    for step in (1, 2, 3):
        assert reference.metrics[step]["actor/lr"] == pytest.approx(R.LR * LR_AFTER[step], rel=1e-12)
        assert reference.metrics[step]["actor/grad_norm"] > 0.1
        moved = min(float((reference.weights[step][n] - previous[n]).abs().max()) for n in previous)
        assert moved > 50 * WEIGHT_ATOL, f"update {step} must move every tensor far beyond the bound"
        previous = reference.weights[step]
    for step, run in ((2, at_1), (3, at_2)):
        assert_same_update(run.metrics[step], run.weights[step], reference.metrics[step], reference.weights[step])
