"""Every method preset runs in the CPU demo through verl's real trainer, and a reward worker that fails in its
constructor stops the run at start-up with its own error (gtpo.trainer.guard.startup_checks).

grpo_s runs in the default tier through tests/test_compare.py (the harness's tiny sweep, two steps); here every
preset runs one step, and the broken reward one start-up, in the slow tier (~2.5 min each on 2 cores):

    GTPO_SLOW_TESTS=1 .venv/bin/python -m pytest -q tests/test_demo_presets.py -m e2e
"""

from __future__ import annotations

import pytest

from gtpo.cpu import demo

# preset -> a metric only that method's code logs (its estimator or loss really ran)
PRESET_METRIC = {
    "grpo": "critic/advantages/mean",
    "dapo_forking": "actor/forking/selected_token_frac",
    "gtpo": "gtpo/",
    "grpo_s": "actor/grpo_s/seq_ratio_mean",
}


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> demo.DemoAssets:
    return demo.build_demo_assets(tmp_path_factory.mktemp("demo_cache"), seed=0)


def _log(out) -> str:
    return (out / "train.log").read_text(errors="replace")


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(PRESET_METRIC))
def test_preset_runs_one_demo_step(ray_cluster, assets, tmp_path, method):
    summary = demo.run_demo(
        assets, method, 1, 0, tmp_path, [], timeout=400, ray_address=ray_cluster.address, plots=False
    )
    assert summary["returncode"] == 0 and summary["steps"] == 1, _log(tmp_path)[-4000:]
    metrics = (tmp_path / "metrics.jsonl").read_text()
    assert f'"{PRESET_METRIC[method]}' in metrics


@pytest.mark.e2e
@pytest.mark.slow
def test_a_broken_reward_function_stops_the_run_at_start_up(ray_cluster, assets, tmp_path):
    """The reward worker cannot load its reward function: verl's error, before any step, not a replay-buffer one."""
    summary = demo.run_demo(
        assets, "grpo", 2, 0, tmp_path, ["reward.custom_reward_function.name=no_such_score"], timeout=400,
        ray_address=ray_cluster.address, plots=False,
    )  # fmt: skip
    log = _log(tmp_path)
    assert summary["returncode"] != 0 and summary["steps"] == 0, log[-4000:]
    assert "RewardWorkerStartupError: reward worker 0 (reward.reward_manager.name=naive) failed" in log, log[-4000:]
    # verl's own message from RewardLoopWorker.__init__ -> load_extern_object
    assert "Object not found in module: object_name='no_such_score'" in log
    assert "no materializable trajectories" not in log
